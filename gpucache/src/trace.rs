//! Recording what the caches do over time: a timeline of events, exported as Chrome trace-event
//! JSON that [Perfetto](https://ui.perfetto.dev) and `chrome://tracing` open.
//!
//! Recording is off unless asked for, at run time:
//!
//! * **`GPUCACHE_TRACE=path`** in the environment records the whole run (from the first scope
//!   entry) and writes the trace to `path` when the process exits (on Unix; elsewhere, and
//!   earlier, when [`stop`] is called). A path that cannot be written gives a one-line warning
//!   naming it on standard error, and the program runs on without recording.
//! * **[`start`]** / **[`start_to`]** and **[`stop`]** record a part of a run from code; `stop`
//!   hands the events back as a [`Trace`] (and writes the file `start_to` named).
//!
//! ```
//! use gpucache::{Array, Device};
//! gpucache::trace::start()?;
//! for _ in 0..3 {
//!     let _scope = gpucache::enter("trace-doc");
//!     let _a = Array::<f32>::zeros(Device::Cpu, [64])?;
//! }
//! let trace = gpucache::trace::stop().expect("recording");
//! let mine = |k| {
//!     trace.events().iter().filter(|e| e.kind == k && e.cache.as_deref() == Some("trace-doc")).count()
//! };
//! use gpucache::trace::EventKind::*;
//! // Misses: the first step's array, then the plan's block (also recorded as the block it
//! // is); the third step is a hit. The first step's array went back to the device, the later
//! // ones back to the plan.
//! assert_eq!((mine(ScopeEnter), mine(Miss), mine(Hit), mine(ScopeExit)), (3, 2, 1, 3));
//! assert_eq!((mine(PlanBlock), mine(DeviceFree), mine(FreeToCache)), (1, 1, 2));
//! let mut json = Vec::new();
//! trace.write_chrome(&mut json)?; // or trace.save("trace.json")?
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Open a saved trace at <https://ui.perfetto.dev> ("Open trace file") or in `chrome://tracing`:
//! each thread is a track with its scopes as slices and instant events for misses, the blocks of
//! plans and slabs, device frees, invalidations, evictions, `empty_cache`, out-of-memory and
//! returns from other threads; counter tracks show the bytes in use and cached per device and
//! per cache.
//!
//! # Events and their cost
//!
//! Every [`Event`] carries the time in nanoseconds since recording started, the thread, the
//! cache's name, the key (element type and shape, or size class), the bytes, the device, and on
//! CUDA the stream; events that change what a cache holds carry the cache's bytes in use and
//! cached on the device afterwards, from which the counter tracks are drawn. Each thread writes
//! into a buffer of its own (no lock, not even on a hit), of at most
//! [`MAX_EVENTS_PER_THREAD`] events (`GPUCACHE_TRACE_MAX_EVENTS` changes it, up to 2^28; a
//! larger or unreadable value is warned about in one line on standard error, and 2^28 or the
//! default used; chunks of the buffer are allocated as events fill them); events past that
//! are counted in [`Trace::dropped`], not kept. While recording is off, the hit path and drops
//! pay nothing (the test of a cache's flags they make anyway sends a recorded cache to the slow
//! path; a planned cache's drop, already there, tests whether recording is on) and a scope's
//! entry and exit one test each. While it is on, each event is a write into
//! the thread's own buffer (the repository's BENCHMARKS.md has what that costs).

mod chrome;
pub(crate) mod record;

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Once;

use record::on;
pub use record::{Event, EventKind, MAX_EVENTS_PER_THREAD, TraceKey};

use crate::{Error, Result};

/// A recorded timeline: what [`stop`] returns.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    events: Vec<Event>,
    threads: Vec<(u64, String)>,
    dropped: u64,
}

impl Trace {
    /// The events, in time order.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The threads that recorded events: (number, name).
    pub fn threads(&self) -> &[(u64, String)] {
        &self.threads
    }

    /// Events that were not kept because a thread's buffer was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Writes the trace as Chrome trace-event JSON (what Perfetto and `chrome://tracing` open).
    ///
    /// # Errors
    /// The writer's.
    pub fn write_chrome(&self, out: impl Write) -> io::Result<()> {
        chrome::write(self, out)
    }

    /// Writes the trace as Chrome trace-event JSON to the file `path`.
    ///
    /// # Errors
    /// [`Error::TraceFile`] when the file cannot be created or written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file_error = |source| Error::TraceFile {
            path: path.to_owned(),
            source,
        };
        let mut out = BufWriter::new(File::create(path).map_err(file_error)?);
        self.write_chrome(&mut out).map_err(file_error)?;
        out.flush().map_err(file_error)
    }
}

/// Whether events are being recorded now (`GPUCACHE_TRACE` included, from the start).
pub fn is_recording() -> bool {
    init_from_env();
    on()
}

/// Starts recording, in memory; [`stop`] hands the events back.
///
/// # Errors
/// [`Error::TraceActive`] when a trace is already being recorded (by `GPUCACHE_TRACE`, or by an
/// earlier call not yet stopped).
pub fn start() -> Result<()> {
    init_from_env();
    begin(None)
}

/// Starts recording; [`stop`] hands the events back and writes them to `path` as Chrome
/// trace-event JSON. The file is created now, so that a path that cannot be written is an
/// error here rather than at the end of the run.
///
/// # Errors
/// [`Error::TraceFile`] when `path` cannot be created; [`Error::TraceActive`] as for
/// [`start`].
pub fn start_to(path: impl AsRef<Path>) -> Result<()> {
    init_from_env();
    start_file(path.as_ref())
}

fn start_file(path: &Path) -> Result<()> {
    if on() {
        return Err(Error::TraceActive);
    }
    File::create(path).map_err(|source| Error::TraceFile {
        path: path.to_owned(),
        source,
    })?;
    begin(Some(path.to_owned()))
}

fn begin(path: Option<PathBuf>) -> Result<()> {
    record::begin(path, max_events())?;
    // The caches record from now on, starting with the bytes each holds.
    crate::registry::set_traced(true);
    Ok(())
}

/// The bound of a thread's buffer: `GPUCACHE_TRACE_MAX_EVENTS` if set and within
/// [`record::MAX_EVENTS_BOUND`]; the bound for a larger number, the default for an unreadable
/// value (each with a one-line warning on standard error, once per process).
fn max_events() -> usize {
    static WARNED: Once = Once::new();
    let var = "GPUCACHE_TRACE_MAX_EVENTS";
    let Some(value) = std::env::var_os(var) else {
        return MAX_EVENTS_PER_THREAD;
    };
    let (max, why) = match value.to_str().map(|v| v.trim().parse::<u128>()) {
        Some(Ok(n)) if n <= record::MAX_EVENTS_BOUND as u128 => return n as usize,
        Some(Ok(_)) => (
            record::MAX_EVENTS_BOUND,
            "more than the bound; using the bound of",
        ),
        _ => (MAX_EVENTS_PER_THREAD, "not a number; using the default of"),
    };
    WARNED.call_once(|| {
        eprintln!(
            "gpucache: {var}={}: {why} {max} events per thread",
            value.to_string_lossy()
        );
    });
    max
}

/// Stops recording and returns the events (`None` when nothing was being recorded). A recording
/// started by [`start_to`] or `GPUCACHE_TRACE` is also written to its file; if that fails, a
/// one-line warning naming the file goes to standard error.
///
/// Events other threads record while `stop` runs may be left out.
pub fn stop() -> Option<Trace> {
    let recorded = record::end()?;
    crate::registry::set_traced(false);
    let trace = Trace {
        events: recorded.events,
        threads: recorded.threads,
        dropped: recorded.dropped,
    };
    if let Some(path) = &recorded.path
        && let Err(e) = trace.save(path)
    {
        eprintln!("gpucache: {e}: {}", io_source(&e));
    }
    Some(trace)
}

/// The I/O error behind `e`, as text.
fn io_source(e: &Error) -> String {
    std::error::Error::source(e).map_or_else(String::new, ToString::to_string)
}

/// Reads `GPUCACHE_TRACE` once: starts recording to that path, or warns in one line when the
/// path cannot be written. Called before the first cache is made (by the scope that makes it)
/// and by the functions of this module.
pub(crate) fn init_from_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let Some(path) = std::env::var_os("GPUCACHE_TRACE").filter(|p| !p.is_empty()) else {
            return;
        };
        match start_file(path.as_ref()) {
            Ok(()) => write_at_exit(),
            Err(e) => eprintln!(
                "gpucache: GPUCACHE_TRACE: {e}: {}; not recording",
                io_source(&e)
            ),
        }
    });
}

/// Writes the trace `GPUCACHE_TRACE` names when the process exits.
#[cfg(unix)]
fn write_at_exit() {
    extern "C" fn at_exit() {
        // A panic must not unwind into C.
        let _ = std::panic::catch_unwind(|| drop(stop()));
    }
    // SAFETY: `at_exit` is an `extern "C" fn()` that never unwinds; registering it has no other
    // precondition.
    unsafe { libc::atexit(at_exit) };
}

#[cfg(not(unix))]
fn write_at_exit() {}

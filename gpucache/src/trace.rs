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
//! assert_eq!((mine(ScopeEnter), mine(Miss), mine(Hit), mine(ScopeExit)), (3, 1, 2, 3));
//! let mut json = Vec::new();
//! trace.write_chrome(&mut json)?; // or trace.save("trace.json")?
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Open a saved trace at <https://ui.perfetto.dev> ("Open trace file") or in `chrome://tracing`:
//! each thread is a track with its scopes as slices and instant events for misses, device frees,
//! invalidations, evictions, `empty_cache`, out-of-memory and returns from other threads;
//! counter tracks show the bytes in use and cached per device and per cache.
//!
//! # Events and their cost
//!
//! Every [`Event`] carries the time in nanoseconds since recording started, the thread, the
//! cache's name, the key (element type and shape, or size class), the bytes, the device, and on
//! CUDA the stream; events that change what a cache holds carry the cache's bytes in use and
//! cached on the device afterwards, from which the counter tracks are drawn. Each thread writes
//! into a buffer of its own (no lock, not even on a hit), of at most
//! [`MAX_EVENTS_PER_THREAD`] events (`GPUCACHE_TRACE_MAX_EVENTS` changes it); events past that
//! are counted in [`Trace::dropped`], not kept. While recording is off, the hit path and drops
//! pay nothing (the test of a cache's flags they make anyway sends a recorded cache to the slow
//! path) and a scope's entry and exit one test each. While it is on, an event costs about 160 ns
//! (an H100 machine's host CPU; the repository's BENCHMARKS.md has the measurements).

mod chrome;

use std::cell::RefCell;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Once, OnceLock};
use std::time::Instant;

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::{DType, Device, Error, Result, Shape};

/// The default bound of a thread's buffer, in events (about 100 bytes each).
pub const MAX_EVENTS_PER_THREAD: usize = 1 << 20;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// A scope of the cache was entered (nested and recursive entries included).
    ScopeEnter,
    /// A scope of the cache was exited; the cache's bytes after the exit follow as
    /// [`EventKind::Settled`] events.
    ScopeExit,
    /// An allocation served from the cache's free list.
    Hit,
    /// An allocation the cache could not serve: `bytes` were allocated from the device.
    Miss,
    /// A dropped array's buffer went back to its cache: onto a free list, or waiting for the
    /// scope's exit or for work on other streams.
    FreeToCache,
    /// A buffer of the cache was given back to the device.
    DeviceFree,
    /// The cache was invalidated (its device frees precede this event).
    Invalidate,
    /// A free buffer was evicted to stay within `max_cached_bytes` (its device free follows).
    Evict,
    /// [`empty_cache`](crate::empty_cache) was called (the device frees it caused follow).
    EmptyCache,
    /// A device allocation of `bytes` ran out of memory; the caches gave back `released` bytes
    /// of the device, and the retry succeeded or not.
    OutOfMemory {
        /// Bytes given back to the device before the retry.
        released: usize,
        /// Whether the retry succeeded.
        recovered: bool,
    },
    /// An array dropped on this thread returned its buffer to another thread's cache (or, the
    /// owner having exited, freed it).
    Returned,
    /// The cache's bytes changed without an allocation or a free: buffers dropped in a scope
    /// became free at its exit, work on other streams completed, buffers returned by other
    /// threads were taken in. Also the reading of every cache when recording starts.
    Settled,
}

/// The key of a cache's free list, as events report it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TraceKey {
    /// [`KeyPolicy::Exact`](crate::KeyPolicy::Exact): element type and shape.
    Exact {
        /// The element type.
        dtype: DType,
        /// The shape.
        shape: Shape,
    },
    /// [`KeyPolicy::SizeClass`](crate::KeyPolicy::SizeClass): the class's capacity in bytes.
    SizeClass {
        /// The capacity of the class's buffers.
        bytes: usize,
    },
}

impl std::fmt::Display for TraceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceKey::Exact { dtype, shape } => write!(f, "{dtype}{:?}", shape.dims()),
            TraceKey::SizeClass { bytes } => write!(f, "class {bytes} B"),
        }
    }
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event {
    /// Nanoseconds since recording started.
    pub time_ns: u64,
    /// The number of the thread it happened on (as in
    /// [`SnapshotRow::thread_number`](crate::SnapshotRow::thread_number)).
    pub thread: u64,
    /// What happened.
    pub kind: EventKind,
    /// The cache's name (`None` for [`EventKind::EmptyCache`] and
    /// [`EventKind::OutOfMemory`]).
    pub cache: Option<Arc<str>>,
    /// The number of the thread that owns the cache: caches are per thread, and another
    /// thread may free a cache's buffers or return one to it.
    pub cache_thread: u64,
    /// The free list's key, for events about one buffer.
    pub key: Option<TraceKey>,
    /// The buffer's size in bytes (the requested size for [`EventKind::OutOfMemory`]).
    pub bytes: usize,
    /// A number naming the buffer while it lives (its address), for events about one buffer:
    /// an allocation ([`EventKind::Miss`], [`EventKind::Hit`]) and the drop that ends it
    /// ([`EventKind::FreeToCache`], [`EventKind::Returned`]) carry the same number.
    pub buffer: Option<u64>,
    /// The device.
    pub device: Option<Device>,
    /// On CUDA, the stream (`CUstream` handle, 0 for the default stream): the thread's current
    /// stream for hits and misses, the buffer's last stream for frees.
    pub stream: Option<u64>,
    /// The cache's bytes on `device` after the event, `(in use, cached)`, for events that change
    /// them (this thread's cache of that name, or the owner's).
    pub bytes_after: Option<(usize, usize)>,
}

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

// ---------------------------------------------------------------------------------------------
// Recording state

/// Whether recording is on: the one flag the hot paths test.
static ON: AtomicBool = AtomicBool::new(false);

/// Whether recording is on. Inlined into the hit path, drops and scopes: one load and a branch.
#[inline(always)]
pub(crate) fn on() -> bool {
    ON.load(Relaxed)
}

/// Whether events are being recorded now (`GPUCACHE_TRACE` included, from the start).
pub fn is_recording() -> bool {
    init_from_env();
    on()
}

/// One recording, from [`start`] to [`stop`].
struct Session {
    id: u64,
    start: Instant,
    /// The file to write when it stops.
    path: Option<PathBuf>,
    max_events: usize,
    buffers: Mutex<Vec<Arc<ThreadBuf>>>,
    /// Events of threads being torn down, whose buffer is gone: (thread, event).
    late: Mutex<Vec<(u64, Stamped)>>,
}

/// The session being recorded, if any.
static SESSION: Mutex<Option<Arc<Session>>> = parking_lot::const_mutex(None);
/// The id of the session being recorded (0: none); threads compare it with their buffer's.
static SESSION_ID: AtomicU64 = AtomicU64::new(0);

/// Events per chunk of a thread's buffer.
const CHUNK: usize = 1024;

/// [`CHUNK`] events, each set once.
type Chunk = Box<[OnceLock<Stamped>]>;

/// A thread's events of one session. Only its thread appends (through [`WRITER`]); any thread
/// may read the events published so far (`len`).
struct ThreadBuf {
    thread: u64,
    name: String,
    /// Events written, in order; each is set once.
    chunks: Box<[OnceLock<Chunk>]>,
    max: usize,
    len: AtomicUsize,
    dropped: AtomicU64,
}

impl ThreadBuf {
    fn new(max_events: usize) -> ThreadBuf {
        let thread = std::thread::current();
        ThreadBuf {
            thread: crate::cache::thread_token(),
            name: match thread.name() {
                Some(name) => name.to_owned(),
                None => format!("{:?}", thread.id()),
            },
            chunks: (0..max_events.div_ceil(CHUNK))
                .map(|_| OnceLock::new())
                .collect(),
            max: max_events,
            len: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// Appends `event` (the buffer's thread only).
    fn push(&self, event: Stamped) {
        let n = self.len.load(Relaxed);
        let Some(chunk) = self.chunks.get(n / CHUNK).filter(|_| n < self.max) else {
            self.dropped.store(self.dropped.load(Relaxed) + 1, Relaxed);
            return;
        };
        let chunk = chunk.get_or_init(|| (0..CHUNK).map(|_| OnceLock::new()).collect());
        // Only this thread appends, and `n` was never written: the slot is empty.
        let _ = chunk[n % CHUNK].set(event);
        // Publishes the event to readers (`Acquire` in `events`).
        self.len.store(n + 1, Release);
    }

    /// The events published so far.
    fn events(&self) -> impl Iterator<Item = &Stamped> {
        let n = self.len.load(Acquire);
        (0..n).filter_map(|i| self.chunks[i / CHUNK].get()?[i % CHUNK].get())
    }
}

/// This thread's buffer and the session it belongs to.
struct Writer {
    session: u64,
    start: Instant,
    buf: Arc<ThreadBuf>,
}

thread_local! {
    static WRITER: RefCell<Option<Writer>> = const { RefCell::new(None) };
}

/// The cache names and the cells (one per thread and name) events refer to.
#[derive(Default)]
struct Cells {
    names: Vec<Arc<str>>,
    by_name: HashMap<Arc<str>, u32>,
    /// Per cell: its name's index and its owner thread.
    cells: Vec<(u32, u64)>,
}

static CELLS: Mutex<Option<Cells>> = parking_lot::const_mutex(None);

/// A number for a new cache of `name` owned by thread `owner`, for its events (called once per
/// cache, when it is created).
pub(crate) fn register_cell(name: &str, owner: u64) -> u32 {
    init_from_env();
    let mut cells = CELLS.lock();
    let cells = cells.get_or_insert_with(Cells::default);
    let name_index = match cells.by_name.get(name) {
        Some(&i) => i,
        None => {
            let i = cells.names.len() as u32;
            let name: Arc<str> = name.into();
            cells.names.push(Arc::clone(&name));
            cells.by_name.insert(name, i);
            i
        }
    };
    cells.cells.push((name_index, owner));
    (cells.cells.len() - 1) as u32
}

/// The name of cache `id` (for `tracing` events; takes a lock).
#[cfg(feature = "tracing")]
pub(crate) fn cache_name(id: u32) -> Arc<str> {
    let cells = CELLS.lock();
    cells
        .as_ref()
        .and_then(|c| {
            let &(name, _) = c.cells.get(id as usize)?;
            Some(Arc::clone(&c.names[name as usize]))
        })
        .unwrap_or_else(|| "".into())
}

/// What a hook reports: an [`Event`] without its time and thread, naming its cache by number
/// (resolved to its name when recording stops, so that recording takes no lock).
#[derive(Clone)]
pub(crate) struct Note {
    pub(crate) kind: EventKind,
    /// The cache's number from [`register_cell`], or `None`.
    pub(crate) cell: Option<u32>,
    pub(crate) key: Option<TraceKey>,
    pub(crate) bytes: usize,
    pub(crate) buffer: Option<u64>,
    pub(crate) device: Option<Device>,
    pub(crate) stream: Option<u64>,
    pub(crate) bytes_after: Option<(usize, usize)>,
}

impl Note {
    /// A note of `kind` about cache `cell` and nothing else.
    pub(crate) fn about(kind: EventKind, cell: Option<u32>) -> Note {
        Note {
            kind,
            cell,
            key: None,
            bytes: 0,
            buffer: None,
            device: None,
            stream: None,
            bytes_after: None,
        }
    }
}

/// A note and when it was recorded.
struct Stamped {
    time_ns: u64,
    note: Note,
}

/// Records `note` in this thread's buffer (if recording is on). Out of line: hooks call it
/// after testing [`on`].
#[cold]
#[inline(never)]
pub(crate) fn record(note: Note) {
    let current = SESSION_ID.load(Acquire);
    if current == 0 {
        return;
    }
    let mut note = Some(note);
    let _ = WRITER.try_with(|w| {
        let mut w = w.borrow_mut();
        if w.as_ref().is_none_or(|w| w.session != current) {
            *w = join(current);
        }
        let (Some(w), Some(note)) = (w.as_ref(), note.take()) else {
            return;
        };
        w.buf.push(Stamped {
            time_ns: w.start.elapsed().as_nanos() as u64,
            note,
        });
    });
    if let Some(note) = note {
        record_late(current, note);
    }
}

/// Records `note` of a thread whose buffer is gone (it is exiting: its caches close).
#[cold]
fn record_late(id: u64, note: Note) {
    let Some(session) = SESSION.lock().clone().filter(|s| s.id == id) else {
        return;
    };
    let time_ns = session.start.elapsed().as_nanos() as u64;
    let thread = crate::cache::thread_token();
    session
        .late
        .lock()
        .push((thread, Stamped { time_ns, note }));
}

/// A buffer of session `id` for this thread, if it is still the one being recorded.
fn join(id: u64) -> Option<Writer> {
    let session = SESSION.lock().clone().filter(|s| s.id == id)?;
    let buf = Arc::new(ThreadBuf::new(session.max_events));
    session.buffers.lock().push(Arc::clone(&buf));
    Some(Writer {
        session: id,
        start: session.start,
        buf,
    })
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
    static NEXT: AtomicU64 = AtomicU64::new(1);
    {
        let mut session = SESSION.lock();
        if session.is_some() {
            return Err(Error::TraceActive);
        }
        let max_events = std::env::var("GPUCACHE_TRACE_MAX_EVENTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(MAX_EVENTS_PER_THREAD);
        let id = NEXT.fetch_add(1, Relaxed);
        *session = Some(Arc::new(Session {
            id,
            start: Instant::now(),
            path,
            max_events,
            buffers: Mutex::new(Vec::new()),
            late: Mutex::new(Vec::new()),
        }));
        SESSION_ID.store(id, Release);
        ON.store(true, Release);
    }
    // The caches record from now on, starting with the bytes each holds.
    crate::registry::set_traced(true);
    Ok(())
}

/// Stops recording and returns the events (`None` when nothing was being recorded). A recording
/// started by [`start_to`] or `GPUCACHE_TRACE` is also written to its file; if that fails, a
/// one-line warning naming the file goes to standard error.
///
/// Events other threads record while `stop` runs may be left out.
pub fn stop() -> Option<Trace> {
    let session = SESSION.lock().take()?;
    ON.store(false, Relaxed);
    SESSION_ID.store(0, Release);
    crate::registry::set_traced(false);
    // This thread's buffer goes with the trace; another thread's is let go when it records
    // again or exits.
    let _ = WRITER.try_with(|w| w.borrow_mut().take());
    let buffers = session.buffers.lock().clone();
    let mut events: Vec<Event> = {
        let cells = CELLS.lock();
        let cache = |cell: Option<u32>| {
            let cells = cells.as_ref()?;
            let &(name, owner) = cells.cells.get(cell? as usize)?;
            Some((Arc::clone(&cells.names[name as usize]), owner))
        };
        let late = session.late.lock();
        buffers
            .iter()
            .flat_map(|b| b.events().map(move |e| (b.thread, e)))
            .chain(late.iter().map(|(thread, e)| (*thread, e)))
            .map(|(thread, Stamped { time_ns, note })| {
                let (cache, cache_thread) = cache(note.cell).unzip();
                Event {
                    time_ns: *time_ns,
                    thread,
                    kind: note.kind,
                    cache,
                    cache_thread: cache_thread.unwrap_or(0),
                    key: note.key.clone(),
                    bytes: note.bytes,
                    buffer: note.buffer,
                    device: note.device,
                    stream: note.stream,
                    bytes_after: note.bytes_after,
                }
            })
            .collect()
    };
    // Each buffer is in time order; merge them (stable: a thread's order is kept on ties).
    events.sort_by_key(|e| e.time_ns);
    let trace = Trace {
        events,
        threads: buffers.iter().map(|b| (b.thread, b.name.clone())).collect(),
        dropped: buffers.iter().map(|b| b.dropped.load(Relaxed)).sum(),
    };
    if let Some(path) = &session.path
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
/// path cannot be written.
fn init_from_env() {
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

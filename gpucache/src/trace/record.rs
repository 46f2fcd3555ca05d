//! Recording: the flag the hot paths test, each thread's event buffer, the names of the caches
//! events refer to, and the start and end of a session.
//!
//! This is what the caches call. It imports nothing of gpucache above the thread module and the
//! value types (device, element type, shape, error), so the cache can record without reaching
//! up; the public API above it (`trace`: start, stop, save, `GPUCACHE_TRACE`) is the only code
//! that also turns every cache's recording flag on and off (through the registry).

use std::cell::RefCell;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::{DType, Device, Error, Result, Shape};

/// The default bound of a thread's buffer, in events (about 100 bytes each).
pub const MAX_EVENTS_PER_THREAD: usize = 1 << 20;

/// The largest bound of a thread's buffer `GPUCACHE_TRACE_MAX_EVENTS` may set: 2^28 events
/// (about 25 GiB per thread if every event is used).
pub(crate) const MAX_EVENTS_BOUND: usize = CHUNK * SEGMENT * SEGMENTS;

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
    /// A planned cache allocated the block of its plan (`bytes`) from the device. Its arrays are
    /// views of it at planned offsets: the allocation that made it is recorded as a miss (of the
    /// array's bytes), later ones as hits.
    PlanBlock,
    /// A planned cache allocated a *slab* (`bytes`) from the device: a block of slots, one per
    /// small array (at most 512 bytes) of the steps it serves online once their block has grown
    /// around such arrays. The allocation that made it is recorded as a miss (of the array's
    /// bytes), the slots taken later as hits.
    SlabBlock,
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

/// Whether recording is on: the one flag the hot paths test.
static ON: AtomicBool = AtomicBool::new(false);

/// Whether recording is on. Inlined into the hit path, drops and scopes: one load and a branch.
#[inline(always)]
pub(crate) fn on() -> bool {
    ON.load(Relaxed)
}

/// One recording, from [`begin`] to [`end`].
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
/// Chunks per segment.
const SEGMENT: usize = 1024;
/// The most segments of a buffer (see [`MAX_EVENTS_BOUND`]).
const SEGMENTS: usize = 256;

/// [`CHUNK`] events, each set once.
type Chunk = Box<[OnceLock<Stamped>]>;
/// [`SEGMENT`] chunks, each made when its first event is written. Segments are made the same
/// way, so a buffer allocates up front only its table of segments (at most [`SEGMENTS`]).
type Segment = Box<[OnceLock<Chunk>]>;

/// A thread's events of one session. Only its thread appends (through [`WRITER`]); any thread
/// may read the events published so far (`len`).
struct ThreadBuf {
    thread: u64,
    name: String,
    /// Events written, in order; each is set once.
    segments: Box<[OnceLock<Segment>]>,
    max: usize,
    len: AtomicUsize,
    dropped: AtomicU64,
}

impl ThreadBuf {
    /// A buffer of at most `max_events` events ([`MAX_EVENTS_BOUND`] at most).
    fn new(max_events: usize) -> ThreadBuf {
        let max_events = max_events.min(MAX_EVENTS_BOUND);
        ThreadBuf {
            thread: crate::thread::token(),
            name: crate::thread::name(),
            segments: (0..max_events.div_ceil(CHUNK * SEGMENT))
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
        let Some(segment) = self
            .segments
            .get(n / (CHUNK * SEGMENT))
            .filter(|_| n < self.max)
        else {
            self.dropped.store(self.dropped.load(Relaxed) + 1, Relaxed);
            return;
        };
        let segment = segment.get_or_init(|| (0..SEGMENT).map(|_| OnceLock::new()).collect());
        let chunk = segment[n / CHUNK % SEGMENT]
            .get_or_init(|| (0..CHUNK).map(|_| OnceLock::new()).collect());
        // Only this thread appends, and `n` was never written: the slot is empty.
        let _ = chunk[n % CHUNK].set(event);
        // Publishes the event to readers (`Acquire` in `events`).
        self.len.store(n + 1, Release);
    }

    /// The events published so far.
    fn events(&self) -> impl Iterator<Item = &Stamped> {
        let n = self.len.load(Acquire);
        (0..n).filter_map(|i| {
            self.segments[i / (CHUNK * SEGMENT)].get()?[i / CHUNK % SEGMENT].get()?[i % CHUNK].get()
        })
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

/// A cache as events name it: its name, its owner thread, and the number events carry, given
/// when the cache first records (so that caches that never record, while recording is off,
/// take no room in the table of cells; a cache made before recording started gets its number
/// when it records).
pub(crate) struct CellName {
    name: Arc<str>,
    owner: u64,
    id: OnceLock<u32>,
}

impl CellName {
    /// Cache `name` of thread `owner`, with no number yet.
    pub(crate) fn new(name: &str, owner: u64) -> CellName {
        CellName {
            name: name.into(),
            owner,
            id: OnceLock::new(),
        }
    }

    /// The cache's name.
    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The cache's number in events (given at the first call; takes a lock then).
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        *self
            .id
            .get_or_init(|| register_cell(&self.name, self.owner))
    }
}

/// A number for cache `name` owned by thread `owner`, for its events (once per cache, when it
/// first records).
#[cold]
fn register_cell(name: &str, owner: u64) -> u32 {
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

/// How many caches have a number for events.
#[cfg(test)]
pub(crate) fn registered_cells() -> usize {
    CELLS.lock().as_ref().map_or(0, |c| c.cells.len())
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
pub(crate) fn push(note: Note) {
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
    let thread = crate::thread::token();
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

/// Starts a session (writing to `path` when it ends, if given), with at most `max_events`
/// events per thread. The caches' recording flags are the caller's to set.
///
/// # Errors
/// [`Error::TraceActive`] when a session is already being recorded.
pub(crate) fn begin(path: Option<PathBuf>, max_events: usize) -> Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut session = SESSION.lock();
    if session.is_some() {
        return Err(Error::TraceActive);
    }
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
    Ok(())
}

/// What a session recorded, as [`end`] hands it over.
pub(crate) struct Recorded {
    /// Every thread's events, merged in time order.
    pub(crate) events: Vec<Event>,
    /// The threads that recorded: (number, name).
    pub(crate) threads: Vec<(u64, String)>,
    /// Events not kept because a buffer was full.
    pub(crate) dropped: u64,
    /// The file the session is to be written to.
    pub(crate) path: Option<PathBuf>,
}

/// Ends the session (`None` if none is being recorded) and hands its events over, with the
/// caches' names resolved. Events other threads record meanwhile may be left out.
pub(crate) fn end() -> Option<Recorded> {
    let session = SESSION.lock().take()?;
    ON.store(false, Relaxed);
    SESSION_ID.store(0, Release);
    // This thread's buffer goes with the events; another thread's is let go when it records
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
    Some(Recorded {
        events,
        threads: buffers.iter().map(|b| (b.thread, b.name.clone())).collect(),
        dropped: buffers.iter().map(|b| b.dropped.load(Relaxed)).sum(),
        path: session.path.clone(),
    })
}

//! The caches of every thread, by name: lookup, [`invalidate`], [`empty_cache`], [`configure`],
//! [`stats`], [`summary`], and device allocation with out-of-memory recovery.
//!
//! Each thread keeps its caches in a thread-local map (looked up once per scope entry, never per
//! allocation). So that one thread can reach every thread's caches (`empty_cache`, `summary`,
//! out-of-memory recovery), each thread also lists them in its slot of a
//! [`thread_local::ThreadLocal`]; the owner locks that list only when it creates a cache.

use std::cell::RefCell;

use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;
use thread_local::ThreadLocal;

use crate::backend::{self, AllocError, Block};
use crate::cache::CacheCell;
use crate::stats::{self, CacheStats, Row};
use crate::{CacheConfig, Device, DeviceStats, Error, Result};

/// A thread's caches, as other threads see them.
#[derive(Default)]
struct ThreadEntry {
    cells: Mutex<Vec<Arc<CacheCell>>>,
}

static THREADS: ThreadLocal<ThreadEntry> = ThreadLocal::new();

/// A thread's caches, as the thread itself sees them.
struct Local {
    caches: RefCell<HashMap<Box<str>, Arc<CacheCell>>>,
    entry: &'static ThreadEntry,
    thread_name: String,
}

impl Local {
    fn new() -> Local {
        let thread = std::thread::current();
        let thread_name = match thread.name() {
            Some(name) => name.to_owned(),
            None => format!("{:?}", thread.id()),
        };
        Local {
            caches: RefCell::default(),
            entry: THREADS.get_or_default(),
            thread_name,
        }
    }
}

impl Drop for Local {
    /// The thread is exiting: close its caches, so that what they hold goes back to the device
    /// and arrays still alive elsewhere free their buffers when they drop.
    fn drop(&mut self) {
        self.entry.cells.lock().clear();
        for (_, cell) in self.caches.get_mut().drain() {
            cell.close();
        }
    }
}

thread_local! {
    static LOCAL: Local = Local::new();
}

/// This thread's cache `name`, created if new. `None` while the thread is being torn down.
pub(crate) fn cell(name: &str) -> Option<Arc<CacheCell>> {
    LOCAL
        .try_with(|local| {
            if let Some(cell) = local.caches.borrow().get(name) {
                return Arc::clone(cell);
            }
            let cell = Arc::new(CacheCell::new(name, &local.thread_name));
            local.entry.cells.lock().push(Arc::clone(&cell));
            local
                .caches
                .borrow_mut()
                .insert(name.into(), Arc::clone(&cell));
            cell
        })
        .ok()
}

/// This thread's cache `name`, if it exists.
fn find(name: &str) -> Option<Arc<CacheCell>> {
    LOCAL
        .try_with(|local| local.caches.borrow().get(name).cloned())
        .ok()
        .flatten()
}

/// This thread's caches.
fn own_cells() -> Vec<Arc<CacheCell>> {
    LOCAL
        .try_with(|local| local.caches.borrow().values().cloned().collect())
        .unwrap_or_default()
}

/// Every thread's caches.
fn all_cells() -> Vec<Arc<CacheCell>> {
    THREADS
        .iter()
        .flat_map(|entry| entry.cells.lock().clone())
        .collect()
}

/// Frees every cached (free-listed) buffer of the calling thread's cache `name` back to the
/// device and starts a new generation of it.
///
/// Arrays still alive stay valid; their buffers are freed, not cached, when they drop. Buffers
/// of arrays dropped inside a scope of the cache that is still active are freed too. Unknown
/// names are ignored.
///
/// ```
/// use gpucache::{Array, Device};
/// {
///     let _scope = gpucache::enter("epoch");
///     let _a = Array::<f32>::zeros(Device::Cpu, [256])?;
/// }
/// assert_eq!(gpucache::stats("epoch").bytes_cached, 1024);
/// gpucache::invalidate("epoch");
/// assert_eq!(gpucache::stats("epoch").bytes_cached, 0);
/// # Ok::<(), gpucache::Error>(())
/// ```
pub fn invalidate(name: &str) {
    if let Some(cell) = find(name) {
        cell.invalidate();
    }
}

/// Frees every free-listed buffer of every cache on every thread back to the device.
///
/// Buffers of live arrays are untouched. A cache that another thread is using inside a scope at
/// this moment is released when that scope exits.
pub fn empty_cache() {
    release_cached(None);
}

/// Sets the options of the calling thread's cache `name` (created if new).
///
/// Changing [`CacheConfig::key`] invalidates the cache (see [`invalidate`]); lowering
/// [`CacheConfig::max_cached_bytes`] evicts at once.
pub fn configure(name: &str, config: CacheConfig) {
    if let Some(cell) = cell(name) {
        cell.configure(config);
    }
}

/// The counters of the calling thread's cache `name` (all zero if it does not exist).
pub fn stats(name: &str) -> CacheStats {
    find(name).map(|c| c.stats_owned()).unwrap_or_default()
}

/// Every cache of every live thread, as a table with one row per (thread, cache).
///
/// Counters of other threads' caches are read without stopping those threads, so a row can be
/// a few operations behind.
pub fn summary() -> String {
    let mut rows: Vec<Row> = all_cells()
        .iter()
        .map(|cell| Row {
            thread: cell.thread_name().to_owned(),
            cache: cell.name().to_owned(),
            stats: cell.snapshot(),
        })
        .collect();
    rows.sort_by(|a, b| (&a.thread, &a.cache).cmp(&(&b.thread, &b.cache)));
    stats::table(&rows)
}

/// What gpucache has allocated and freed on `device`, cached or not, as counted by the backend
/// serving it on this thread.
///
/// ```
/// use gpucache::{Array, Device};
/// let before = gpucache::device_stats(Device::Cpu)?;
/// drop(Array::<u8>::zeros(Device::Cpu, 100)?);
/// let after = gpucache::device_stats(Device::Cpu)?;
/// assert!(after.allocs > before.allocs && after.frees > before.frees);
/// # Ok::<(), gpucache::Error>(())
/// ```
///
/// # Errors
/// As [`Device::cuda`](crate::Device::cuda) for a device this build or machine cannot use.
pub fn device_stats(device: Device) -> Result<DeviceStats> {
    Ok(backend::resolve(device)?.stats(device))
}

/// Frees the free lists of this thread's caches, then every other thread's, for `device` (or
/// all devices). Returns the bytes still cached in caches that were busy in a scope on another
/// thread and could not be released now.
fn release_cached(device: Option<Device>) -> usize {
    release_own(device);
    all_cells()
        .iter()
        .filter(|cell| !cell.is_owned_here())
        .filter(|cell| !cell.flush_from_other_thread(device))
        .map(|cell| cell.snapshot().bytes_cached)
        .sum()
}

/// Frees the free lists of this thread's caches, for `device` (or all devices).
pub(crate) fn release_own(device: Option<Device>) {
    for cell in own_cells() {
        cell.flush_owned(device);
    }
}

/// Allocates `bytes` on `device`. When the device is out of memory, releases the cached buffers
/// for it (this thread's caches, then every thread's) and retries once.
pub(crate) fn alloc_block(device: Device, bytes: usize, zeroed: bool) -> Result<Block> {
    let backend = backend::resolve(device)?;
    match Block::alloc(&backend, device, bytes, zeroed) {
        Ok(block) => return Ok(block),
        Err(AllocError::Other(e)) => return Err(e),
        Err(AllocError::OutOfMemory) => {}
    }
    let cached = release_cached(Some(device));
    match Block::alloc(&backend, device, bytes, zeroed) {
        Ok(block) => Ok(block),
        Err(AllocError::Other(e)) => Err(e),
        Err(AllocError::OutOfMemory) => Err(Error::OutOfMemory {
            device,
            requested: bytes,
            cached,
            in_use: backend.stats(device).bytes_allocated.saturating_sub(cached),
        }),
    }
}

//! The caches of every thread, by name: lookup, and the calls that act on a name everywhere
//! ([`invalidate`], [`configure`], [`reset_peak`]) or on every cache ([`empty_cache`],
//! [`snapshot`], [`summary`]), and giving back what no array owns, for out-of-memory recovery
//! (which the allocation pipeline runs: `alloc.rs`).
//!
//! Each thread keeps its caches in a thread-local map (looked up once per scope entry, never per
//! allocation). So that one thread can reach every thread's caches, each thread also lists them
//! in its slot of a [`thread_local::ThreadLocal`]; the owner locks that list only when it creates
//! a cache. Options set with [`configure`] are kept by name, for the caches created later.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;

use hashbrown::{HashMap, HashSet};
use thread_local::ThreadLocal;

use crate::backend;
use crate::cache::{CacheCell, ConfigSeq};
use crate::metrics::{CacheStats, DeviceUsage, Snapshot, SnapshotRow};
// A thread's list of caches and the exited threads' rows are reached by other threads under
// these mutexes: `parking_lot`'s, or loom's under `cfg(loom)` (see `crate::sync`), for the loom
// models of a thread's exit (`loom_tests`).
use crate::sync::Mutex;
use crate::trace::record;
use crate::{CacheConfig, Device, DeviceStats, Result};

/// A thread's caches, as other threads see them.
#[derive(Default)]
struct ThreadEntry {
    cells: Mutex<Vec<Arc<CacheCell>>>,
}

impl ThreadEntry {
    /// The thread's caches, as another thread finds them (copied under the lock).
    fn listed(&self) -> Vec<Arc<CacheCell>> {
        self.cells.lock().clone()
    }
}

/// Each thread's entry. The thread keeps its own `Arc` (in [`Local`]) rather than the reference
/// `get_or` returns, which is derived from a `&mut` inside the `ThreadLocal` that other threads
/// iterate over meanwhile (an aliasing Miri reports); the reference is used only to clone.
static THREADS: ThreadLocal<Arc<ThreadEntry>> = ThreadLocal::new();

/// The options [`configure`] set, by name, for caches created later, with the number of the
/// call that set them.
#[derive(Default)]
struct Configs {
    by_name: Vec<(Box<str>, ConfigSeq, CacheConfig)>,
    /// The number of the latest call (see [`ConfigSeq`]).
    seq: ConfigSeq,
}

static CONFIGS: parking_lot::Mutex<Configs> = parking_lot::const_mutex(Configs {
    by_name: Vec::new(),
    seq: 0,
});

/// The options `configure` set for `name` and the call's number (the default and 0 if none).
fn lookup(configs: &Configs, name: &str) -> (ConfigSeq, CacheConfig) {
    configs
        .by_name
        .iter()
        .find(|(n, ..)| &**n == name)
        .map(|&(_, seq, c)| (seq, c))
        .unwrap_or_default()
}

/// A cache whose thread has exited; its names are shared with the other rows (see
/// [`Exited::names`]).
struct ExitedRow {
    thread: Arc<str>,
    thread_number: u64,
    cache: Arc<str>,
    counters: Counted,
}

/// The counters of an exited thread's cache.
enum Counted {
    /// Arrays of it were alive elsewhere when it was last looked at: its counters still change
    /// (each drop counts a free), so the row reads the cache itself.
    Live(Arc<CacheCell>),
    /// None is: the counters are final.
    Final(CacheStats),
}

impl ExitedRow {
    fn stats(&self) -> CacheStats {
        match &self.counters {
            Counted::Live(cell) => cell.snapshot(),
            Counted::Final(stats) => *stats,
        }
    }

    /// Whether the counters can no longer change (settling a live one that has become so).
    fn settle(&mut self) -> bool {
        if let Counted::Live(cell) = &self.counters
            && !cell.has_orphans()
        {
            self.counters = Counted::Final(cell.snapshot());
        }
        matches!(self.counters, Counted::Final(_))
    }
}

/// The caches of threads that have exited: the latest [`EXITED_ROWS`] one by one (more while
/// arrays of the older ones are still alive elsewhere), older ones summed per cache name once
/// their counters are final, so memory stays bounded by the number of names and of caches with
/// live arrays.
#[derive(Default)]
struct Exited {
    recent: VecDeque<ExitedRow>,
    /// Per cache name, the sum of its rows that left `recent` (found by hash: a thread's exit
    /// costs the same however many names there are).
    older: HashMap<Arc<str>, CacheStats>,
    /// The names the rows hold, one copy each (a name no row holds any more is let go), so
    /// that threads sharing a long name keep it once.
    names: HashSet<Arc<str>>,
}

/// How many caches of exited threads [`snapshot`] keeps one by one.
const EXITED_ROWS: usize = 256;

#[cfg(not(loom))]
static EXITED: Mutex<Option<Exited>> = parking_lot::const_mutex(None);

// Under loom, made anew in each execution of a model (loom's mutex is not `const`).
#[cfg(loom)]
loom::lazy_static! {
    static ref EXITED: Mutex<Option<Exited>> = Mutex::new(None);
}

impl Exited {
    /// The shared copy of `name`.
    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(name) = self.names.get(name) {
            return Arc::clone(name);
        }
        let name: Arc<str> = name.into();
        self.names.insert(Arc::clone(&name));
        name
    }

    /// Keeps `cell`, whose thread has just exited (and closed it).
    fn record(&mut self, cell: Arc<CacheCell>) {
        let mut row = ExitedRow {
            thread: self.intern(cell.thread_name()),
            thread_number: cell.thread_number(),
            cache: self.intern(cell.name()),
            counters: Counted::Live(cell),
        };
        row.settle();
        self.push(row);
    }

    fn push(&mut self, row: ExitedRow) {
        self.recent.push_back(row);
        while self.recent.len() > EXITED_ROWS {
            // The oldest whose counters are final.
            let Some(i) = self.recent.iter_mut().position(ExitedRow::settle) else {
                return;
            };
            let Some(old) = self.recent.remove(i) else {
                return;
            };
            let sum = self.older.entry(Arc::clone(&old.cache)).or_default();
            *sum = sum.plus(&old.stats());
            // Its thread's name, if no other row holds it (the cache's stays, in `older`).
            if Arc::strong_count(&old.thread) == 2 {
                self.names.remove(&old.thread);
            }
        }
    }

    /// The caches whose arrays were still alive elsewhere when last looked at.
    fn live(&self) -> impl Iterator<Item = &Arc<CacheCell>> + '_ {
        self.recent.iter().filter_map(|r| match &r.counters {
            Counted::Live(cell) => Some(cell),
            Counted::Final(_) => None,
        })
    }

    /// The rows, as [`snapshot`] shows them.
    fn rows(&self) -> impl Iterator<Item = SnapshotRow> + '_ {
        let older = self.older.iter().map(|(cache, stats)| SnapshotRow {
            thread: "(earlier threads)".into(),
            thread_number: 0,
            exited: true,
            cache: cache.to_string(),
            stats: *stats,
        });
        let recent = self.recent.iter().map(|r| SnapshotRow {
            thread: r.thread.to_string(),
            thread_number: r.thread_number,
            exited: true,
            cache: r.cache.to_string(),
            stats: r.stats(),
        });
        older.chain(recent)
    }
}

/// The row of `cell`, a live thread's cache.
fn row(cell: &CacheCell) -> SnapshotRow {
    SnapshotRow {
        thread: cell.thread_name().to_owned(),
        thread_number: cell.thread_number(),
        exited: false,
        cache: cell.name().to_owned(),
        stats: cell.snapshot(),
    }
}

/// A thread's caches, as the thread itself sees them.
struct Local {
    caches: RefCell<HashMap<Box<str>, Arc<CacheCell>>>,
    entry: Arc<ThreadEntry>,
    thread_name: String,
}

impl Local {
    fn new() -> Local {
        Local {
            caches: RefCell::default(),
            entry: Arc::clone(THREADS.get_or_default()),
            thread_name: crate::thread::name(),
        }
    }
}

impl Drop for Local {
    /// The thread is exiting: close its caches, so that what they hold goes back to the device
    /// and arrays still alive elsewhere free their buffers when they drop, and keep their final
    /// counters for [`snapshot`].
    fn drop(&mut self) {
        exit_thread(
            &self.entry,
            self.caches.get_mut().drain().map(|(_, cell)| cell),
        );
    }
}

/// What a thread's exit does (run by its [`Local`]'s destructor, and by the loom models):
/// unlists its caches, so that other threads no longer find them, then closes each of `cells`
/// and keeps it as an exited row.
fn exit_thread(entry: &ThreadEntry, cells: impl Iterator<Item = Arc<CacheCell>>) {
    entry.cells.lock().clear();
    for cell in cells {
        cell.close();
        EXITED
            .lock()
            .get_or_insert_with(Exited::default)
            .record(cell);
    }
}

thread_local! {
    static LOCAL: Local = Local::new();
}

/// This thread's cache `name`: `Some(None)` when it has none yet, `None` while the thread is
/// being torn down.
#[inline]
pub(crate) fn own_cell(name: &str) -> Option<Option<Arc<CacheCell>>> {
    LOCAL
        .try_with(|local| local.caches.borrow().get(name).cloned())
        .ok()
}

/// A new cache `name` of this thread (`None` while the thread is being torn down). Out of
/// line: scope entries only look caches up.
#[cold]
#[inline(never)]
pub(crate) fn create_cell(name: &str) -> Option<Arc<CacheCell>> {
    LOCAL.try_with(|local| create(local, name)).ok()
}

/// Makes this thread's cache `name`.
fn create(local: &Local, name: &str) -> Arc<CacheCell> {
    let cell = {
        // Listed for other threads under the options' lock: a `configure` of this name either
        // wrote its options before this reads them, or finds the cell listed.
        let configs = CONFIGS.lock();
        let config = lookup(&configs, name);
        let cell = Arc::new(CacheCell::new(name, &local.thread_name, config));
        local.entry.cells.lock().push(Arc::clone(&cell));
        cell
    };
    // Recording may have started after the cell was made and before it was listed.
    if record::on() {
        cell.set_traced(true);
    }
    local
        .caches
        .borrow_mut()
        .insert(name.into(), Arc::clone(&cell));
    cell
}

/// This thread's cache `name`, if it exists.
fn find(name: &str) -> Option<Arc<CacheCell>> {
    own_cell(name).flatten()
}

/// Every live thread's caches.
fn all_cells() -> Vec<Arc<CacheCell>> {
    THREADS.iter().flat_map(|entry| entry.listed()).collect()
}

/// Runs `own` on the calling thread's cache `name` and `other` on every other thread's.
fn for_name(name: &str, own: impl Fn(&CacheCell), other: impl Fn(&CacheCell)) {
    for_name_in(all_cells(), name, own, other);
}

/// [`for_name`] over `cells`.
fn for_name_in(
    cells: Vec<Arc<CacheCell>>,
    name: &str,
    own: impl Fn(&CacheCell),
    other: impl Fn(&CacheCell),
) {
    for cell in cells.iter().filter(|c| c.name() == name) {
        if cell.is_owned_here() {
            own(cell);
        } else {
            other(cell);
        }
    }
}

/// Frees the cached buffers of cache `name` on every thread back to the device and starts a new
/// generation of each.
///
/// The calling thread's cache is invalidated at once; another thread's at once when that thread
/// is not inside a scope of it, else when that scope exits (buffers other threads returned to it
/// are freed at once either way). Arrays still alive stay valid; their buffers are freed, not
/// cached, when they drop. Buffers of arrays dropped inside a scope of the cache that is still
/// active are freed too. Unknown names are ignored, and so is the cache of a thread that exits
/// while the call runs, if the call reaches it after the exit (it holds nothing any more).
///
/// ```
/// use gpucache::{Array, Device};
/// for _ in 0..2 {
///     let _scope = gpucache::enter("epoch");
///     let _a = Array::<f32>::zeros(Device::Cpu, [256])?;
/// }
/// assert_eq!(gpucache::stats("epoch").bytes_cached, 1024); // the plan's block
/// gpucache::invalidate("epoch");
/// assert_eq!(gpucache::stats("epoch").bytes_cached, 0);
/// # Ok::<(), gpucache::Error>(())
/// ```
pub fn invalidate(name: &str) {
    invalidate_in(all_cells(), name);
}

/// [`invalidate`] over `cells`.
fn invalidate_in(cells: Vec<Arc<CacheCell>>, name: &str) {
    for_name_in(cells, name, CacheCell::invalidate, |cell| {
        cell.free_returned(None);
        cell.request(|r| r.invalidate += 1);
    });
}

/// Frees every free-listed buffer of every cache on every thread back to the device, and the
/// buffers that arrays dropped on other threads returned to a cache whose owner has not taken
/// them in yet.
///
/// Buffers of live arrays are untouched. The free lists of a cache that another thread is using
/// inside a scope at this moment are released when that scope exits.
pub fn empty_cache() {
    if record::on() {
        record::push(record::Note::about(record::EventKind::EmptyCache, None));
    }
    give_back_unowned(None, false);
}

/// Sets the options of cache `name` on every thread: the caches of that name that exist (the
/// calling thread's at once; another thread's at once when it is not inside a scope of it, else
/// when that scope exits) and those created later. Unknown names are fine. When calls race or
/// one waits for a scope's exit, the last call (the last to reach the registry) wins on every
/// cache: a cache never applies a call older than the one it has.
///
/// Changing [`CacheConfig::key`] invalidates the cache (see [`invalidate`]); lowering
/// [`CacheConfig::max_cached_bytes`] evicts at once.
pub fn configure(name: &str, config: CacheConfig) {
    // Numbered under the lock: the call that takes it last wins on every cache, whichever
    // order the caches apply the calls in.
    let seq = {
        let mut configs = CONFIGS.lock();
        configs.seq += 1;
        let seq = configs.seq;
        match configs.by_name.iter_mut().find(|(n, ..)| &**n == name) {
            Some((_, s, c)) => (*s, *c) = (seq, config),
            None => configs.by_name.push((name.into(), seq, config)),
        }
        seq
    };
    for_name(
        name,
        |cell| cell.configure(seq, config),
        |cell| {
            cell.request(|r| r.configure(seq, config));
        },
    );
}

/// The counters of the calling thread's cache `name` (all zero if it does not exist). For every
/// thread's, see [`snapshot`] and [`Snapshot::total`].
pub fn stats(name: &str) -> CacheStats {
    find(name).map(|c| c.stats_owned()).unwrap_or_default()
}

/// Restarts `peak_bytes` of cache `name`, on every thread, from the bytes each holds now. The
/// cache of a thread that exits while the call runs keeps the peak its exit recorded.
///
/// ```
/// use gpucache::{Array, Device};
/// {
///     let _scope = gpucache::enter("peak-doc");
///     let _a = Array::<u8>::zeros(Device::Cpu, 4096)?;
///     let _b = Array::<u8>::zeros(Device::Cpu, 4096)?;
/// }
/// gpucache::invalidate("peak-doc");
/// assert_eq!(gpucache::stats("peak-doc").peak_bytes, 8192);
/// gpucache::reset_peak("peak-doc");
/// assert_eq!(gpucache::stats("peak-doc").peak_bytes, 0);
/// # Ok::<(), gpucache::Error>(())
/// ```
pub fn reset_peak(name: &str) {
    for_name(name, CacheCell::reset_peak, CacheCell::reset_peak);
}

/// A reading of every cache on every thread, including the caches of threads that have exited
/// (the latest 256 one by one, older ones summed per cache name once none of their arrays is
/// alive). An exited thread's row goes on counting: its arrays still alive elsewhere are counted
/// as freed when they drop.
///
/// ```
/// use gpucache::{Array, Device};
/// std::thread::spawn(|| {
///     let _scope = gpucache::enter("snapshot-doc");
///     Array::<f32>::zeros(Device::Cpu, 16).map(drop)
/// })
/// .join()
/// .unwrap()?;
/// let snap = gpucache::snapshot();
/// assert_eq!(snap.total("snapshot-doc").misses, 1);
/// assert!(snap.rows().iter().any(|r| r.cache == "snapshot-doc" && r.exited));
/// # Ok::<(), gpucache::Error>(())
/// ```
pub fn snapshot() -> Snapshot {
    let cells = all_cells();
    // Exited threads' caches read once: their rows, and those whose arrays are still alive.
    let (mut gone, exited): (Vec<SnapshotRow>, Vec<Arc<CacheCell>>) = {
        let exited = EXITED.lock();
        (
            exited.iter().flat_map(Exited::rows).collect(),
            exited.iter().flat_map(Exited::live).cloned().collect(),
        )
    };
    let mut devices: Vec<DeviceUsage> = Vec::new();
    // Arrays of exited threads' caches still alive elsewhere count on their device too.
    for (device, bytes) in cells.iter().chain(&exited).flat_map(|c| c.device_bytes()) {
        let usage = match devices.iter_mut().find(|u| u.device == device) {
            Some(u) => u,
            None => {
                devices.push(DeviceUsage {
                    device,
                    ..DeviceUsage::default()
                });
                devices.last_mut().expect("just pushed")
            }
        };
        usage.bytes_in_use += bytes.held.saturating_sub(bytes.cached);
        usage.bytes_cached += bytes.cached;
    }
    let mut rows: Vec<SnapshotRow> = cells.iter().map(|c| row(c)).collect();
    let key = |r: &SnapshotRow| (r.thread.clone(), r.thread_number, r.cache.clone());
    rows.sort_by_key(key);
    gone.sort_by_key(key);
    rows.extend(gone);
    Snapshot { rows, devices }
}

/// Every cache of every thread (see [`snapshot`]), as a table with one row per (thread, cache).
/// Threads are shown as `name#number`, so threads that share a name stay apart; names longer
/// than 40 characters are shortened. When `GPUCACHE_DISABLE` turned caching off, the table is
/// preceded by the line `caching disabled (GPUCACHE_DISABLE)`.
pub fn summary() -> String {
    let table = snapshot().to_string();
    if crate::config::caching_disabled() {
        return format!("caching disabled (GPUCACHE_DISABLE)\n{table}");
    }
    table
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

/// Gives back what every thread's caches hold on `device` (or all devices) that no array owns:
/// buffers returned by other threads, at once; free lists and deferred buffers, at once for this
/// thread's caches and idle ones, at the scope's exit for a cache active on another thread;
/// with `pending`, also what this thread's active scopes hold for their exit.
pub(crate) fn give_back_unowned(device: Option<Device>, pending: bool) {
    give_back_in(all_cells(), device, pending);
}

/// [`give_back_unowned`] over `cells`.
fn give_back_in(cells: Vec<Arc<CacheCell>>, device: Option<Device>, pending: bool) {
    for cell in cells {
        cell.free_returned(device);
        if cell.is_owned_here() {
            cell.give_back_owned(device, pending);
        } else {
            cell.request(|r| r.flush(device));
        }
    }
}

/// Frees the free lists of this thread's caches, for `device` (or all devices).
pub(crate) fn give_back_own(device: Option<Device>) {
    let cells = LOCAL
        .try_with(|local| local.caches.borrow().values().cloned().collect())
        .unwrap_or_else(|_| Vec::<Arc<CacheCell>>::new());
    for cell in cells {
        cell.give_back_owned(device, false);
    }
}

/// What every thread's caches hold on `device` that no array owns: free lists, deferred
/// buffers, buffers dropped in scopes still active, and buffers other threads returned.
pub(crate) fn unowned_bytes(device: Device) -> usize {
    all_cells()
        .iter()
        .flat_map(|c| c.device_bytes())
        .filter(|&(d, _)| d == device)
        .map(|(_, b)| b.cached + b.waiting)
        .sum()
}

/// Turns recording of every cache's events on or off; when on, records the bytes each holds.
pub(crate) fn set_traced(on: bool) {
    for cell in all_cells() {
        cell.set_traced(on);
        if on {
            cell.note_all_bytes();
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    fn exited_row(exited: &mut Exited, thread: &str, number: u64, cache: &str) -> ExitedRow {
        ExitedRow {
            thread: exited.intern(thread),
            thread_number: number,
            cache: exited.intern(cache),
            counters: Counted::Final(CacheStats {
                misses: 1,
                ..CacheStats::default()
            }),
        }
    }

    #[test]
    fn caches_that_never_record_take_no_number_for_events() {
        let before = record::registered_cells();
        for _ in 0..100 {
            std::thread::spawn(|| {
                let cell = create_cell("registry-unrecorded").unwrap();
                cell.enter();
                cell.exit();
            })
            .join()
            .unwrap();
        }
        // (Other tests of this binary may record meanwhile, but not 100 caches.)
        let grown = record::registered_cells() - before;
        assert!(
            grown < 100,
            "{grown} numbers for caches that never recorded"
        );
    }

    #[test]
    fn exited_rows_are_summed_by_name_in_a_map() {
        let mut exited = Exited::default();
        let names = 2000;
        for i in 0..(EXITED_ROWS + 2 * names) as u64 {
            let row = exited_row(&mut exited, "t", i, &format!("cache-{}", i % names as u64));
            exited.push(row);
        }
        // Every name once, with the sum of its rows (two each, but the latest 256 rows).
        assert_eq!(exited.older.len(), names);
        let summed: u64 = exited.older.values().map(|s| s.misses).sum();
        assert_eq!(summed, 2 * names as u64);
        assert_eq!(exited.rows().count(), names + EXITED_ROWS);
    }

    #[test]
    fn exited_rows_keep_one_copy_of_a_long_name() {
        let mut exited = Exited::default();
        let long = "x".repeat(1 << 16);
        for i in 0..300 {
            let row = exited_row(&mut exited, &long, i, &long);
            exited.push(row);
        }
        assert_eq!(exited.names.len(), 1);
        assert!(
            exited
                .recent
                .iter()
                .all(|r| Arc::ptr_eq(&r.thread, &r.cache))
        );
        // A thread name no row holds is let go.
        for i in 0..EXITED_ROWS as u64 {
            let row = exited_row(&mut exited, "short", i, "c");
            exited.push(row);
        }
        assert!(
            exited
                .names
                .iter()
                .all(|n| n.len() < 1 << 16 || exited.older.contains_key(n))
        );
    }

    #[test]
    fn flush_requests_behind_a_long_scope_stay_few() {
        let _serial = crate::sync::global_tests();
        let (cell_tx, cell_rx) = channel();
        let (done_tx, done_rx) = channel::<()>();
        let owner = std::thread::spawn(move || {
            let cell = create_cell("registry-flush-requests").unwrap();
            cell.enter();
            cell_tx.send(Arc::clone(&cell)).unwrap();
            let _ = done_rx.recv();
            cell.exit();
        });
        let cell = cell_rx.recv().unwrap();
        for _ in 0..100 {
            give_back_unowned(Some(Device::Cpu), false);
        }
        assert_eq!(cell.queued_flushes(), 1, "one device, flushed once");
        for _ in 0..100 {
            give_back_unowned(None, false);
            give_back_unowned(Some(Device::Cpu), false);
        }
        assert_eq!(cell.queued_flushes(), 1, "every device subsumes the rest");
        done_tx.send(()).unwrap();
        owner.join().unwrap();
        assert_eq!(cell.queued_flushes(), 0);
    }
}

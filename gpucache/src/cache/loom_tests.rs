//! Loom models of a cache's cross-thread protocol, run on the real [`CacheCell`]
//! (`RUSTFLAGS="--cfg loom" cargo test -p gpucache --lib --release loom`; see CONTRIBUTING.md).
//!
//! Under `cfg(loom)` the cell's lock byte, its flags, the cell holding its state (each access
//! through `CacheCell::locked` is checked: loom fails a model whose lock does not order it after
//! the previous one) and its remote side's mutex are loom's (`crate::sync`); a cell is made with
//! [`CacheCell::new`], and its buffers come from a [`CountingBackend`], which counts every
//! allocation and free. The models call the cell's own methods, as scopes, allocations, drops and
//! the registry call them: `enter`/`exit` (a scope), `take` then `adopt` (`alloc_slow` on a miss),
//! [`return_block`] (an array's drop, on the owner inside its scope or on another thread),
//! `invalidate` (the owner's `gpucache::invalidate`), `request` (another thread's `invalidate`),
//! `free_returned` (`empty_cache` and out-of-memory recovery from another thread).
//!
//! Every model checks, once its threads have joined ([`check_end`]): the lock is free, no
//! request is left and no request hint, each request was served once (`invalidations` counts
//! them), returned buffers still queued have their hint set; then, after the owner takes the
//! queue in, that every buffer is accounted exactly once: the backend's allocations not freed are
//! exactly the cache's free lists, the cache's counters agree with the backend's, and no array
//! is left counted as alive.
//!
//! The helpers here ([`exact_cell`], [`allocate`], [`Escaped`]) also serve the models of a
//! thread's exit (`registry/loom_tests.rs`).

use std::ptr;
use std::sync::Arc;

use loom::thread;

use super::lock::{LOCKED, PARKED, REQUESTED, RETURNED};
use super::{CacheCell, Got, Home, Request, Take, return_block};
use crate::backend::{Backend, Block};
use crate::sync::model;
use crate::testing::CountingBackend;
use crate::{CacheConfig, DType, Device, KeyPolicy, Shape};

/// Bytes of each array.
pub(crate) const BYTES: usize = 64;

/// The request of every array of the models.
fn request() -> Request<'static> {
    static SHAPE: std::sync::LazyLock<Shape> = std::sync::LazyLock::new(|| Shape::from(BYTES));
    Request {
        dtype: DType::U8,
        shape: &SHAPE,
        device: Device::Cpu,
        bytes: BYTES,
    }
}

/// A new cache of free lists (`KeyPolicy::Exact`), owned by the calling thread.
pub(crate) fn exact_cell() -> Arc<CacheCell> {
    let config = CacheConfig {
        key: KeyPolicy::Exact,
        ..CacheConfig::default()
    };
    Arc::new(CacheCell::new("loom", "owner", (0, config)))
}

/// An array's buffer and its home: what `Array` holds.
pub(crate) struct Escaped(Block, Home);

impl Escaped {
    /// The array's drop on a thread with no scope of the cell entered (`current` null): on
    /// another thread, the remote path.
    pub(crate) fn drop_elsewhere(self) {
        return_block(self.0, Some(self.1), ptr::null());
    }

    /// The array's drop on the owner, inside a scope of `cell` (its current cache).
    fn drop_in_scope(self, cell: &CacheCell) {
        return_block(self.0, Some(self.1), cell);
    }
}

/// An allocation inside a scope of `cell` on its owner, as `alloc_slow` serves it once the hit
/// path found nothing: `take`, and on a miss a block from `backend` that `adopt` accounts.
fn alloc(cell: &CacheCell, backend: &Arc<dyn Backend>) -> Escaped {
    let req = request();
    let got = match cell.take(&req) {
        Take::Hit(block, home) => Got::Recycled(block, home),
        Take::Miss { capacity, .. } => {
            let block = Block::alloc(backend, Device::Cpu, capacity, false).unwrap();
            cell.adopt(&req, block).unwrap()
        }
        Take::Bypass | Take::Failed(_) => panic!("a cache of free lists serves every request"),
    };
    match got {
        Got::Recycled(block, home) | Got::Fresh(block, Some(home)) => Escaped(block, home),
        Got::Fresh(_, None) => panic!("the cache took the block"),
    }
}

/// `n` arrays allocated in one scope of `cell` (owner), which escape it.
pub(crate) fn allocate(cell: &CacheCell, backend: &Arc<dyn Backend>, n: usize) -> Vec<Escaped> {
    cell.enter();
    let arrays = (0..n).map(|_| alloc(cell, backend)).collect();
    cell.exit();
    arrays
}

/// The counting backend, and the same as `Block::alloc` takes it.
pub(crate) fn backend() -> (Arc<CountingBackend>, Arc<dyn Backend>) {
    let counting = CountingBackend::new();
    let backend: Arc<dyn Backend> = Arc::clone(&counting) as Arc<dyn Backend>;
    (counting, backend)
}

/// A scope cycle of the owner with no allocation.
fn step(cell: &CacheCell) {
    cell.enter();
    cell.exit();
}

/// A scope cycle of the owner in which one array is allocated (a buffer taken in at the entry or
/// the miss is reused, else one is allocated) and dropped.
fn step_alloc(cell: &CacheCell, backend: &Arc<dyn Backend>) {
    cell.enter();
    alloc(cell, backend).drop_in_scope(cell);
    cell.exit();
}

/// After every thread has joined (on the owner): the lock is free and no request is left, each
/// of the `invalidations` calls (the owner's and the requests) counted once, returned buffers
/// still queued have their hint; then, once the owner has taken the queue in, every buffer is
/// accounted once (see the module docs).
fn check_end(cell: &CacheCell, counting: &CountingBackend, invalidations: u64) {
    let byte = cell.lock.bits();
    assert_eq!(
        byte & (LOCKED | PARKED),
        0,
        "the lock is left held: {byte:#06b}"
    );
    assert_eq!(
        byte & REQUESTED,
        0,
        "a request hint is left set: {byte:#06b}"
    );
    {
        let remote = cell.remote.state.lock();
        let requests = &remote.requests;
        assert!(
            requests.invalidate == 0 && requests.config.is_none() && requests.flush.is_empty(),
            "a request is left unserved"
        );
        if !remote.queue.is_empty() || !remote.released.is_empty() {
            assert_ne!(byte & RETURNED, 0, "returned buffers wait with no hint");
        }
    }
    // The owner reads its stats: it takes the queue in.
    let stats = cell.stats_owned();
    assert_eq!(stats.invalidations, invalidations, "requests served");
    {
        let remote = cell.remote.state.lock();
        assert!(remote.queue.is_empty() && remote.released.is_empty());
    }
    // SAFETY: (see `locked`) every other thread has joined; no reference to the state is alive.
    let live = unsafe { cell.locked() }.live;
    assert_eq!(live, 0, "an array is still counted alive");
    assert_eq!(stats.bytes_in_use, 0, "bytes in use with no array alive");
    assert_eq!(
        counting.outstanding_bytes(),
        stats.bytes_cached,
        "the backend's outstanding bytes are not the free lists'"
    );
    assert_eq!(
        counting.allocs(),
        stats.device_allocs,
        "allocations counted"
    );
    assert_eq!(counting.frees(), stats.device_frees, "frees counted");
}

/// A request (`invalidate`) from another thread while the owner runs two scope cycles: the
/// owner's exit serves it, or the requester, finding the lock free, serves it itself (the owner
/// then waits for it, parked).
#[test]
fn loom_request_served_once() {
    model("request_served_once", || {
        let (counting, _) = backend();
        let cell = exact_cell();
        let other = Arc::clone(&cell);
        let requester = thread::spawn(move || {
            other.request(|r| r.invalidate += 1);
        });
        step(&cell);
        step(&cell);
        requester.join().unwrap();
        check_end(&cell, &counting, 1);
    });
}

/// Two requests from another thread, one after the other, while the owner invalidates outside a
/// scope (`owned`) and then runs a scope cycle: a request left while the holder serves the first
/// is served before the lock goes.
#[test]
fn loom_requests_while_owned() {
    model("requests_while_owned", || {
        let (counting, _) = backend();
        let cell = exact_cell();
        let other = Arc::clone(&cell);
        let requester = thread::spawn(move || {
            other.request(|r| r.invalidate += 1);
            other.request(|r| r.invalidate += 1);
        });
        cell.invalidate();
        step(&cell);
        requester.join().unwrap();
        check_end(&cell, &counting, 3);
    });
}

/// Two escaped arrays dropped on another thread, which then gives the queue back to the device
/// (`free_returned`), while the owner runs two scope cycles that each allocate and drop an array:
/// each buffer is reused (taken in at an entry or a miss), freed by `free_returned` and
/// accounted, or waits with its hint set; never lost, never both reused and freed.
#[test]
fn loom_returned_never_lost() {
    model("returned_never_lost", || {
        let (counting, backend) = backend();
        let cell = exact_cell();
        let arrays = allocate(&cell, &backend, 2);
        let other = Arc::clone(&cell);
        let returner = thread::spawn(move || {
            for a in arrays {
                a.drop_elsewhere();
            }
            other.free_returned(None);
        });
        step_alloc(&cell, &backend);
        step_alloc(&cell, &backend);
        returner.join().unwrap();
        check_end(&cell, &counting, 0);
    });
}

/// Requests from two threads at once while the owner runs a scope cycle: at most one of them
/// holds the lock at a time, and each request is served once, by whichever thread.
#[test]
fn loom_requests_from_two_threads() {
    model("requests_from_two_threads", || {
        let (counting, _) = backend();
        let cell = exact_cell();
        let requesters: Vec<_> = (0..2)
            .map(|_| {
                let other = Arc::clone(&cell);
                thread::spawn(move || {
                    other.request(|r| r.invalidate += 1);
                })
            })
            .collect();
        step(&cell);
        for r in requesters {
            r.join().unwrap();
        }
        check_end(&cell, &counting, 2);
    });
}

/// Two arrays dropped on another thread around its request, while the owner runs a scope cycle:
/// whoever serves the request takes the returned buffers in too (`serve_requests` drains the
/// queue), and the invalidation frees them.
#[test]
fn loom_returned_and_requested() {
    model("returned_and_requested", || {
        let (counting, backend) = backend();
        let cell = exact_cell();
        let mut arrays = allocate(&cell, &backend, 2);
        let other = Arc::clone(&cell);
        let remote = thread::spawn(move || {
            arrays.pop().unwrap().drop_elsewhere();
            other.request(|r| r.invalidate += 1);
            arrays.pop().unwrap().drop_elsewhere();
        });
        step(&cell);
        remote.join().unwrap();
        check_end(&cell, &counting, 1);
    });
}

/// A request from one thread, and an array dropped then `free_returned` on another, while the
/// owner runs a scope cycle.
#[test]
fn loom_request_and_return_from_two_threads() {
    model("request_and_return_from_two_threads", || {
        let (counting, backend) = backend();
        let cell = exact_cell();
        let mut arrays = allocate(&cell, &backend, 1);
        let other = Arc::clone(&cell);
        let requester = thread::spawn(move || {
            other.request(|r| r.invalidate += 1);
        });
        let other = Arc::clone(&cell);
        let returner = thread::spawn(move || {
            arrays.pop().unwrap().drop_elsewhere();
            other.free_returned(None);
        });
        step(&cell);
        requester.join().unwrap();
        returner.join().unwrap();
        check_end(&cell, &counting, 1);
    });
}

//! Loom models of a thread's exit while arrays of its caches are alive on other threads
//! (`RUSTFLAGS="--cfg loom" cargo test -p gpucache --lib --release loom`; see CONTRIBUTING.md).
//!
//! The exit is [`exit_thread`], the function a thread's `Local` destructor runs: it unlists the
//! thread's caches from its [`ThreadEntry`], closes each one (`CacheCell::close`: what it holds
//! goes back to the device, and arrays still alive elsewhere free their buffers when they drop,
//! the last one releasing the cell's keep-alive) and records it in [`EXITED`] (under loom a
//! `loom::lazy_static`, new in each execution). The other threads run the real
//! [`return_block`](crate::cache::return_block) of an escaped array's drop and the registry's
//! own [`invalidate_in`] and [`give_back_in`] (`invalidate` and `empty_cache` over the cells they
//! list from the entry, as `all_cells` lists them from every thread's). The cell is a real
//! `CacheCell` with `crate::sync`'s loom primitives, its buffers from a counting backend (see
//! `cache/loom_tests.rs`).
//!
//! Every model checks, after its threads have joined ([`check_exited`]): the exited cache's row
//! is final (no array counted alive), its counters agree with the backend's (every buffer
//! allocated was freed exactly once, nothing outstanding), and the cell itself was freed (its
//! keep-alive released, by the last array's drop or never taken).

use std::sync::{Arc, Weak};

use loom::thread;

use super::{EXITED, ThreadEntry, exit_thread, give_back_in, invalidate_in};
use crate::CacheStats;
use crate::cache::CacheCell;
use crate::cache::loom_tests::{allocate, backend, exact_cell};
use crate::sync::model;
use crate::testing::CountingBackend;

/// The owner's side: a thread entry listing a new cache of free lists, as `create` lists it.
fn owner() -> (Arc<ThreadEntry>, Arc<CacheCell>) {
    let entry = Arc::new(ThreadEntry::default());
    let cell = exact_cell();
    entry.cells.lock().push(Arc::clone(&cell));
    (entry, cell)
}

/// After every thread has joined: the exited row of `cell` (made by `exit_thread`) is final,
/// with `arrays` allocations, each freed once, and nothing held; the backend agrees; once the row
/// is dropped, nothing keeps the cell alive. Returns the row's counters.
fn check_exited(cell: Weak<CacheCell>, counting: &CountingBackend, arrays: u64) -> CacheStats {
    let mut exited = EXITED.lock().take().expect("the exit recorded its cache");
    assert_eq!(exited.recent.len(), 1, "one row for the one cache");
    let row = &mut exited.recent[0];
    assert!(
        row.settle(),
        "arrays of the exited cache are still counted alive"
    );
    let stats = row.stats();
    assert_eq!(stats.misses, arrays, "misses");
    assert_eq!(stats.device_allocs, arrays, "allocations counted");
    assert_eq!(stats.device_frees, arrays, "frees counted");
    assert_eq!(
        stats.bytes_in_use + stats.bytes_cached,
        0,
        "bytes still held"
    );
    drop(exited);
    assert!(
        cell.upgrade().is_none(),
        "the closed cache outlives its last array (keep-alive not released)"
    );
    assert_eq!(counting.allocs(), arrays, "the backend's allocations");
    assert_eq!(counting.frees(), arrays, "the backend's frees");
    assert_eq!(counting.outstanding_bytes(), 0, "bytes outstanding");
    stats
}

/// The owner thread exits while another thread drops an array that escaped its cache's scope and
/// a third runs `third` on the cells it lists from the owner's entry (before or after the exit
/// unlists them). Returns what `third` returned and the exited row's counters, checked
/// ([`check_exited`]).
fn exit_while<R: Send + 'static>(
    third: impl FnOnce(Vec<Arc<CacheCell>>) -> R + Send + 'static,
) -> (R, CacheStats) {
    let (counting, backend) = backend();
    let (entry, cell) = owner();
    let weak = Arc::downgrade(&cell);
    let array = allocate(&cell, &backend, 1).pop().unwrap();
    let dropper = thread::spawn(move || array.drop_elsewhere());
    let listed = Arc::clone(&entry);
    let other = thread::spawn(move || third(listed.listed()));
    exit_thread(&entry, std::iter::once(cell));
    dropper.join().unwrap();
    let r = other.join().unwrap();
    (r, check_exited(weak, &counting, 1))
}

/// The owner thread exits while another thread drops two arrays that escaped its cache's scope
/// (a third was dropped on the owner before, and waits in a free list): each drop finds the cell
/// open (the buffer is queued, and the close frees it) or closed (the drop frees it and counts
/// it, and the last one releases the keep-alive).
#[test]
fn loom_exit_with_arrays_alive_elsewhere() {
    model("exit_with_arrays_alive_elsewhere", || {
        let (counting, backend) = backend();
        let (entry, cell) = owner();
        let weak = Arc::downgrade(&cell);
        let mut arrays = allocate(&cell, &backend, 3);
        // Dropped on the owner, outside a scope: to the free list.
        arrays.pop().unwrap().drop_elsewhere();
        let dropper = thread::spawn(move || {
            for a in arrays {
                a.drop_elsewhere();
            }
        });
        exit_thread(&entry, std::iter::once(cell));
        dropper.join().unwrap();
        assert_eq!(check_exited(weak, &counting, 3).invalidations, 0);
    });
}

/// The owner thread exits while another thread drops an escaped array and a third calls
/// `invalidate` on the cache's name: the third may find the cell listed (before the exit unlists
/// it) and then free the return queue and leave its request on an open or a closed cell, served
/// by the owner's close or by itself. The exited row counts the call or not (a call that reaches
/// a closed cache finds nothing to invalidate, as for a name with no cache), but never less than
/// the cache counted: what the invalidating thread reads from the cell after its call.
#[test]
fn loom_exit_while_invalidated() {
    model("exit_while_invalidated", || {
        let ((found, seen), row) = exit_while(|cells| {
            invalidate_in(cells.clone(), "loom");
            let seen = cells.first().map(|c| c.snapshot().invalidations);
            (cells.len() as u64, seen.unwrap_or(0))
        });
        let counted = row.invalidations;
        assert!(
            seen <= counted && counted <= found,
            "the exited row counts {counted} invalidations; the cell counted {seen} after the \
             call, which found {found} cells"
        );
    });
}

/// The owner thread exits while another thread drops an escaped array and a third calls
/// `empty_cache` (`give_back_unowned`): as with `invalidate`, with a flush request.
#[test]
fn loom_exit_while_emptied() {
    model("exit_while_emptied", || {
        let ((), row) = exit_while(|cells| give_back_in(cells, None, false));
        assert_eq!(row.invalidations, 0);
    });
}

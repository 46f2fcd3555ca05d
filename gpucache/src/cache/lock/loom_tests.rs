//! A loom model of the lock alone (`RUSTFLAGS="--cfg loom" cargo test -p gpucache --lib
//! --release loom`; see CONTRIBUTING.md): two threads taking the real [`CellLock`] with `lock`,
//! so that its waiting (parking, and the wake-up at unlock) is checked where `CacheCell` seldom
//! reaches it. The protocol as `CacheCell` drives the lock (requests, returned buffers) is
//! modelled on the real cell, in `cache/loom_tests.rs`.

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use super::{CellLock, LOCKED, PARKED, REQUESTED, RETURNED};
use crate::sync::model;

/// A lock and what it guards: a count of the critical sections (a loom `UnsafeCell`, whose
/// accesses loom checks are ordered by the lock).
#[derive(Default)]
struct Guarded {
    lock: CellLock,
    work: UnsafeCell<usize>,
}

// SAFETY: `work` is only reached by the thread holding `lock` (loom reports any access the lock
// does not order).
unsafe impl Sync for Guarded {}

impl Guarded {
    /// A critical section: takes the lock (waiting, parked, if it is held), counts, gives it up.
    fn section(&self) {
        self.lock.lock();
        // SAFETY: this thread holds the lock.
        self.work.with_mut(|w| unsafe { *w += 1 });
        assert!(self.lock.unlock_unless_requested());
    }
}

/// Two threads taking the lock with `lock` (spinning off, parking on) and giving it up: they
/// exclude each other (loom checks the count's accesses), and a waiter always wakes.
#[test]
fn loom_lock_excludes_and_wakes() {
    model("lock_excludes_and_wakes", || {
        let guarded = Arc::new(Guarded::default());
        let other = Arc::clone(&guarded);
        let contender = thread::spawn(move || {
            for _ in 0..2 {
                other.section();
            }
        });
        for _ in 0..2 {
            guarded.section();
        }
        contender.join().unwrap();
        // SAFETY: the other thread has joined.
        assert_eq!(guarded.work.with(|w| unsafe { *w }), 4);
        let byte = guarded.lock.0.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            byte & (LOCKED | PARKED | REQUESTED | RETURNED),
            0,
            "{byte:#06b}"
        );
    });
}

//! A cache's lock, and the two hints other threads leave for its holder, in one byte.
//!
//! The owner thread takes the lock at a scope's outermost entry and gives it up at its exit, so
//! each scope cycle costs two atomic read-modify-writes on this byte, and nothing else: neither
//! a fence nor a second load. Other threads set hints with one `fetch_or`:
//! * [`REQUESTED`]: a request (`configure`, `invalidate`, `empty_cache`, out-of-memory
//!   recovery) waits in the cache's remote state for the holder of the lock;
//! * [`RETURNED`]: buffers of arrays dropped on other threads wait in the return queue.
//!
//! Because the lock bit and the hints live in one atomic, a request cannot be missed: either
//! the requester's `fetch_or` comes first in the byte's modification order, and the holder's
//! release fails and serves it, or the release comes first, and the requester sees the lock
//! free and takes it to serve the request itself. The fast paths are plain compare-exchanges
//! that succeed only when no hint is set; every other case goes to the cold path of the caller.
//!
//! Waiting is rare: only the owner waits, outside a scope, while another thread holds the lock
//! to serve a request. Waiters spin briefly, then park (`parking_lot_core`, keyed by the lock's
//! address, as `parking_lot`'s own mutex does).
//!
//! The byte is a [`crate::sync`] atomic, so that the loom tests (`loom_tests`, under
//! `cfg(loom)`) check this protocol as `cache` and `cache::remote` use it. Under loom, parking
//! and spinning, which loom can neither see nor schedule around, become a wait with loom's
//! `yield_now` (see [`CellLock::park`]).

use std::sync::atomic::Ordering::*;

#[cfg(not(loom))]
use parking_lot_core::{DEFAULT_PARK_TOKEN, DEFAULT_UNPARK_TOKEN, SpinWait};

use crate::sync::AtomicU8;

/// The lock is held.
pub(super) const LOCKED: u8 = 1;
/// A thread is parked waiting for the lock.
pub(super) const PARKED: u8 = 2;
/// A request waits for the holder of the lock.
pub(super) const REQUESTED: u8 = 4;
/// Buffers returned by other threads wait in the return queue.
pub(super) const RETURNED: u8 = 8;

/// A cache's lock and hints (see the module docs).
#[derive(Debug, Default)]
pub(super) struct CellLock(
    AtomicU8,
    /// Under loom, this lock's queue in the parking lot: its bucket's mutex, and the number of
    /// `unpark_all` calls so far (see [`CellLock::park`]).
    #[cfg(loom)]
    loom::sync::Mutex<u64>,
);

impl CellLock {
    /// Takes the lock if it is free and no hint is set (the scope-entry fast path).
    #[inline(always)]
    pub(super) fn try_lock_plain(&self) -> bool {
        self.0.compare_exchange(0, LOCKED, Acquire, Relaxed).is_ok()
    }

    /// Gives the lock up if no hint is set (the scope-exit fast path). On `false` the lock is
    /// still held: serve the requests, then [`CellLock::unlock_unless_requested`] (returned
    /// buffers may stay queued, their hint set, for the next holder to take in).
    #[inline(always)]
    pub(super) fn try_unlock_plain(&self) -> bool {
        self.0.compare_exchange(LOCKED, 0, Release, Relaxed).is_ok()
    }

    /// Takes the lock if it is free, whatever the hints.
    pub(super) fn try_lock(&self) -> bool {
        let mut state = self.0.load(Relaxed);
        while state & LOCKED == 0 {
            match self
                .0
                .compare_exchange_weak(state, state | LOCKED, Acquire, Relaxed)
            {
                Ok(_) => return true,
                Err(now) => state = now,
            }
        }
        false
    }

    /// Takes the lock, waiting for its holder if there is one.
    #[inline]
    pub(super) fn lock(&self) {
        if !self.try_lock_plain() {
            self.lock_slow();
        }
    }

    #[cold]
    #[inline(never)]
    fn lock_slow(&self) {
        let mut spin = SpinWait::new();
        loop {
            if self.try_lock() {
                return;
            }
            let state = self.0.load(Relaxed);
            if state & LOCKED == 0 {
                continue;
            }
            if state & PARKED == 0 {
                if spin.spin() {
                    continue;
                }
                if self
                    .0
                    .compare_exchange_weak(state, state | PARKED, Relaxed, Relaxed)
                    .is_err()
                {
                    continue;
                }
            }
            self.park();
            spin.reset();
        }
    }

    /// Waits, unless the lock is free or [`PARKED`] is off by then, until the holder gives the
    /// lock up and calls [`CellLock::unpark_all`].
    #[cfg(not(loom))]
    #[inline]
    fn park(&self) {
        let key = self.key();
        let validate = || self.0.load(Relaxed) & (LOCKED | PARKED) == LOCKED | PARKED;
        // SAFETY: the key is this lock's address, which no other synchronisation primitive
        // uses (the byte is owned by this `CellLock`); `validate` only loads an atomic and
        // cannot panic; the other callbacks do nothing.
        unsafe {
            parking_lot_core::park(key, validate, || {}, |_, _| {}, DEFAULT_PARK_TOKEN, None);
        }
    }

    /// Wakes the threads parked on this lock.
    #[cfg(not(loom))]
    #[inline]
    fn unpark_all(&self) {
        // SAFETY: as in `park`: this lock's own address.
        unsafe { parking_lot_core::unpark_all(self.key(), DEFAULT_UNPARK_TOKEN) };
    }

    /// [`CellLock::park`] under loom, which cannot run `parking_lot_core` (its atomics and its
    /// bucket locks are std's, and it would block the one OS thread that runs every modelled
    /// thread). The same contract, on loom's primitives: `validate` is checked under the
    /// bucket's mutex, as `parking_lot_core::park` does, and the thread then waits, spinning
    /// with loom's `yield_now`, until a call of [`CellLock::unpark_all`] after that check. A
    /// missing wake-up leaves the waiter spinning, which loom reports (its branch limit).
    #[cfg(loom)]
    fn park(&self) {
        let parked_at = {
            let lot = self.1.lock().unwrap();
            if self.0.load(Relaxed) & (LOCKED | PARKED) != LOCKED | PARKED {
                return;
            }
            *lot
        };
        while *self.1.lock().unwrap() == parked_at {
            loom::thread::yield_now();
        }
    }

    /// [`CellLock::unpark_all`] under loom: wakes every thread parked so far (see
    /// [`CellLock::park`]).
    #[cfg(loom)]
    fn unpark_all(&self) {
        *self.1.lock().unwrap() += 1;
    }

    /// Whether `hint` is set (a hint: read without ordering; the holder takes it with
    /// [`CellLock::take`]).
    #[inline(always)]
    pub(super) fn has(&self, hint: u8) -> bool {
        self.0.load(Relaxed) & hint != 0
    }

    /// Takes `hint` off (holder of the lock); returns whether it was set. Take it before
    /// taking what it announces, so that anything announced later sets it again.
    #[inline]
    pub(super) fn take(&self, hint: u8) -> bool {
        self.0.fetch_and(!hint, Acquire) & hint != 0
    }

    /// Sets `hint` (any thread, after leaving what it announces); returns whether the lock was
    /// free at that moment, in which case nobody will serve the hint until the next holder.
    #[inline]
    pub(super) fn set(&self, hint: u8) -> bool {
        self.0.fetch_or(hint, AcqRel) & LOCKED == 0
    }

    /// Gives the lock up unless a request waits, in which case it stays held and `false` is
    /// returned: serve it and call again. Other hints stay set for the next holder.
    pub(super) fn unlock_unless_requested(&self) -> bool {
        let mut state = self.0.load(Relaxed);
        loop {
            if state & REQUESTED != 0 {
                return false;
            }
            match self
                .0
                .compare_exchange_weak(state, state & !(LOCKED | PARKED), Release, Relaxed)
            {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        if state & PARKED != 0 {
            self.unpark_all();
        }
        true
    }

    /// The byte, for the loom models' checks once their threads have joined.
    #[cfg(all(test, loom))]
    pub(super) fn bits(&self) -> u8 {
        self.0.load(Relaxed)
    }

    #[cfg(not(loom))]
    fn key(&self) -> usize {
        self as *const Self as usize
    }
}

/// `parking_lot_core::SpinWait` under loom: no spinning, which would only multiply the states
/// loom explores (each spin retries the byte); the waiter parks at once (see [`CellLock::park`]).
#[cfg(loom)]
struct SpinWait;

#[cfg(loom)]
impl SpinWait {
    fn new() -> SpinWait {
        SpinWait
    }

    fn spin(&mut self) -> bool {
        false
    }

    fn reset(&mut self) {}
}

#[cfg(all(test, loom))]
mod loom_tests;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn fast_paths_refuse_hints() {
        let lock = CellLock::default();
        assert!(lock.try_lock_plain());
        assert!(!lock.try_lock(), "held");
        assert!(!lock.set(RETURNED), "the lock was held");
        assert!(!lock.try_unlock_plain(), "a hint is set");
        assert!(lock.take(RETURNED));
        assert!(!lock.take(RETURNED));
        assert!(lock.try_unlock_plain());
        assert!(lock.set(REQUESTED), "the lock was free");
        assert!(!lock.try_lock_plain(), "a hint is set");
        assert!(lock.try_lock());
        assert!(!lock.unlock_unless_requested(), "a request waits");
        assert!(lock.take(REQUESTED));
        assert!(lock.unlock_unless_requested());
        assert!(lock.try_lock_plain());
    }

    #[test]
    fn excludes_and_wakes_waiters() {
        let lock = Arc::new(CellLock::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (lock, inside) = (Arc::clone(&lock), Arc::clone(&inside));
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        lock.lock();
                        assert_eq!(inside.fetch_add(1, Relaxed), 0, "two holders");
                        std::hint::spin_loop();
                        inside.fetch_sub(1, Relaxed);
                        assert!(lock.unlock_unless_requested());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(lock.try_lock_plain(), "free and without hints at the end");
    }
}

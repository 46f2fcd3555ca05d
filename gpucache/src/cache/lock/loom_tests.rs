//! Loom models of the lock's protocol (`RUSTFLAGS="--cfg loom" cargo test -p gpucache --lib
//! --release loom`; see CONTRIBUTING.md).
//!
//! [`Cell`] is `CacheCell` cut down to its lock (the real [`CellLock`], whose byte is a loom
//! atomic under `cfg(loom)`), its state (a loom `UnsafeCell`: loom fails any access to it that
//! the lock does not order after the previous one, so each model also checks that the lock
//! excludes and publishes) and its remote side (a loom mutex, as `RemoteSide`'s is a
//! `parking_lot` one). Its methods mirror, call for call on the lock, those of `cache/mod.rs` and
//! `cache/remote.rs` that they are named after; the cache's work is reduced to counters.

use std::mem;
use std::sync::atomic::Ordering::Relaxed;

use loom::cell::UnsafeCell;
use loom::sync::{Arc, Mutex};
use loom::thread;

use super::{CellLock, LOCKED, PARKED, REQUESTED, RETURNED};
use crate::sync::model;

/// `CacheState`: what the holder of the lock owns.
#[derive(Default)]
struct State {
    /// Requests served (a request counts once, whichever thread serves it).
    served: usize,
    /// Returned buffers taken in from the queue.
    taken_in: usize,
    /// Buffers that another thread gave back to the device from the queue, accounted.
    accounted: usize,
    /// Work done under the lock by the owner (scope cycles, operations outside a scope).
    work: usize,
}

/// `Remote`: what other threads write, under its own mutex.
#[derive(Default)]
struct Remote {
    /// Requests left for the holder of the lock (`Requests`).
    requests: usize,
    /// Buffers returned by other threads (`queue`).
    queue: usize,
    /// Buffers of the queue given back to the device, not yet accounted (`released`).
    released: usize,
}

/// `CacheCell`, as the lock's protocol sees it.
#[derive(Default)]
struct Cell {
    lock: CellLock,
    state: UnsafeCell<State>,
    remote: Mutex<Remote>,
}

// SAFETY: as `CacheCell`'s: `state` is only reached through `Cell::locked`, by the thread
// holding `lock`; the rest are a loom atomic and a loom mutex.
unsafe impl Sync for Cell {}

impl Cell {
    /// `CacheCell::locked`: the state, for the holder of the lock (loom checks that it is).
    fn locked<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        // SAFETY: every caller holds the lock (loom reports any access the lock does not
        // order), and the reference lives only for `f`, which touches nothing else of the cell.
        self.state.with_mut(|state| f(unsafe { &mut *state }))
    }

    /// `CacheCell::enter`, the outermost entry (owner).
    fn enter(&self) {
        if !self.lock.try_lock_plain() {
            self.enter_slow();
        }
    }

    /// `CacheCell::enter_slow`.
    fn enter_slow(&self) {
        self.lock.lock();
        self.drain_returned();
        self.serve_requests();
    }

    /// `CacheCell::exit`, the outermost exit (owner): takes in what was returned, settles the
    /// step (`work`), gives the lock up.
    fn exit(&self) {
        self.drain_returned();
        self.locked(|s| s.work += 1);
        self.unlock();
    }

    /// A scope cycle of the owner: enter, work under the lock, exit.
    fn step(&self) {
        self.enter();
        self.locked(|s| s.work += 1);
        self.exit();
    }

    /// `CacheCell::owned` outside a scope (`hold`, then the `LockGuard`'s drop), running
    /// `CacheCell::invalidate`'s body: takes in what was returned, then works.
    fn owned_invalidate(&self) {
        self.lock.lock();
        self.drain_returned();
        self.locked(|s| s.work += 1);
        self.unlock();
    }

    /// `CacheCell::unlock`.
    fn unlock(&self) {
        if !self.lock.try_unlock_plain() {
            self.serve_and_unlock();
        }
    }

    /// `CacheCell::serve_and_unlock`.
    fn serve_and_unlock(&self) {
        loop {
            self.serve_requests();
            if self.lock.unlock_unless_requested() {
                return;
            }
        }
    }

    /// `CacheCell::serve_requests` (lock holder).
    fn serve_requests(&self) {
        if !self.lock.take(REQUESTED) {
            return;
        }
        let requests = mem::take(&mut self.remote.lock().unwrap().requests);
        self.drain_returned();
        self.locked(|s| s.served += requests);
    }

    /// `CacheCell::request` (another thread): leaves a request, and serves it at once if the
    /// lock was free (`try_hold`, whose `LockGuard` is dropped at once: its unlock serves).
    /// Returns whether it was served at once.
    fn request(&self) -> bool {
        self.remote.lock().unwrap().requests += 1;
        self.lock.set(REQUESTED) && self.try_hold()
    }

    /// `CacheCell::try_hold` and the drop of its `LockGuard`.
    fn try_hold(&self) -> bool {
        if !self.lock.try_lock() {
            return false;
        }
        self.unlock();
        true
    }

    /// `CacheCell::drain_returned` (lock holder).
    fn drain_returned(&self) {
        if self.lock.has(RETURNED) {
            self.take_in_returned();
        }
    }

    /// `CacheCell::take_in_returned`: the hint first, then the queue.
    fn take_in_returned(&self) {
        self.lock.take(RETURNED);
        let (returned, released) = {
            let mut remote = self.remote.lock().unwrap();
            (
                mem::take(&mut remote.queue),
                mem::take(&mut remote.released),
            )
        };
        self.locked(|s| {
            s.taken_in += returned;
            s.accounted += released;
        });
    }

    /// `send_home_remote` while the cell is open (another thread): queues a buffer and sets the
    /// hint, under the mutex.
    fn send_home_remote(&self) {
        let mut remote = self.remote.lock().unwrap();
        remote.queue += 1;
        self.lock.set(RETURNED);
        drop(remote);
    }

    /// `CacheCell::free_returned` (any thread): gives the queue back to the device, for the
    /// next holder of the lock to account.
    fn free_returned(&self) {
        let freed = {
            let mut remote = self.remote.lock().unwrap();
            let freed = mem::take(&mut remote.queue);
            remote.released += freed;
            freed
        };
        if freed > 0 {
            self.lock.set(RETURNED);
        }
    }

    /// After every thread has joined: the lock is free, every one of `requests` requests was
    /// served once and no request hint is left, and each of `returned` returned buffers was
    /// taken in or accounted, or waits with its hint set for the next holder.
    fn check_end(&self, requests: usize, returned: usize) {
        let byte = self.lock.0.load(Relaxed);
        assert_eq!(
            byte & (LOCKED | PARKED),
            0,
            "the lock is left held: {byte:#06b}"
        );
        let remote = self.remote.lock().unwrap();
        let state = self.locked(mem::take);
        assert_eq!(remote.requests, 0, "a request is left unserved");
        assert_eq!(state.served, requests, "requests served");
        assert_eq!(
            byte & REQUESTED,
            0,
            "a request hint is left set: {byte:#06b}"
        );
        assert_eq!(
            state.taken_in + state.accounted + remote.queue + remote.released,
            returned,
            "a returned buffer was lost or counted twice"
        );
        if remote.queue + remote.released > 0 {
            assert_ne!(byte & RETURNED, 0, "returned buffers wait with no hint");
        }
    }
}

/// A request from another thread while the owner runs two scope cycles: the owner's exit
/// serves it, or the requester, finding the lock free, serves it itself (the owner then waits
/// for it in `lock`, parked).
#[test]
fn loom_request_served_once() {
    model("request_served_once", || {
        let cell = Arc::new(Cell::default());
        let other = Arc::clone(&cell);
        let requester = thread::spawn(move || {
            other.request();
        });
        cell.step();
        cell.step();
        requester.join().unwrap();
        cell.check_end(1, 0);
    });
}

/// Two requests from another thread, one after the other, while the owner takes the lock
/// outside a scope (`owned`) and then runs a scope cycle: a request hint set while the holder
/// serves the first is served before the lock goes.
#[test]
fn loom_requests_while_owned() {
    model("requests_while_owned", || {
        let cell = Arc::new(Cell::default());
        let other = Arc::clone(&cell);
        let requester = thread::spawn(move || {
            other.request();
            other.request();
        });
        cell.owned_invalidate();
        cell.step();
        requester.join().unwrap();
        cell.check_end(2, 0);
    });
}

/// Two buffers returned by another thread, which then gives the queue back to the device,
/// while the owner runs two scope cycles: each buffer is taken in (the exit takes the hint,
/// then the queue) or accounted, or waits with its hint set; never lost, never counted twice.
#[test]
fn loom_returned_never_lost() {
    model("returned_never_lost", || {
        let cell = Arc::new(Cell::default());
        let other = Arc::clone(&cell);
        let returner = thread::spawn(move || {
            other.send_home_remote();
            other.send_home_remote();
            other.free_returned();
        });
        cell.step();
        cell.step();
        returner.join().unwrap();
        cell.check_end(0, 2);
    });
}

/// Requests from two threads at once while the owner runs a scope cycle: at most one of them
/// holds the lock at a time, and each request is served once, by whichever thread.
#[test]
fn loom_requests_from_two_threads() {
    model("requests_from_two_threads", || {
        let cell = Arc::new(Cell::default());
        let requesters: Vec<_> = (0..2)
            .map(|_| {
                let other = Arc::clone(&cell);
                thread::spawn(move || {
                    other.request();
                })
            })
            .collect();
        cell.step();
        for r in requesters {
            r.join().unwrap();
        }
        cell.check_end(2, 0);
    });
}

/// Two buffers returned while the owner runs a scope cycle and a request is served: the
/// request's holder takes the returned buffers in too (`serve_requests` drains the queue).
#[test]
fn loom_returned_and_requested() {
    model("returned_and_requested", || {
        let cell = Arc::new(Cell::default());
        let other = Arc::clone(&cell);
        let remote = thread::spawn(move || {
            other.send_home_remote();
            other.request();
            other.send_home_remote();
        });
        cell.step();
        remote.join().unwrap();
        cell.check_end(1, 2);
    });
}

/// A request and a returned buffer (then `free_returned`) from two other threads while the owner
/// runs a scope cycle.
#[test]
fn loom_request_and_return_from_two_threads() {
    model("request_and_return_from_two_threads", || {
        let cell = Arc::new(Cell::default());
        let other = Arc::clone(&cell);
        let requester = thread::spawn(move || {
            other.request();
        });
        let other = Arc::clone(&cell);
        let returner = thread::spawn(move || {
            other.send_home_remote();
            other.free_returned();
        });
        cell.step();
        requester.join().unwrap();
        returner.join().unwrap();
        cell.check_end(1, 1);
    });
}

/// Two threads taking the lock with `lock` (spinning off, parking on) and giving it up: they
/// exclude each other (loom checks the state's accesses), and a waiter always wakes.
#[test]
fn loom_lock_excludes_and_wakes() {
    model("lock_excludes_and_wakes", || {
        let cell = Arc::new(Cell::default());
        let other = Arc::clone(&cell);
        let contender = thread::spawn(move || {
            for _ in 0..2 {
                other.lock.lock();
                other.locked(|s| s.work += 1);
                assert!(other.lock.unlock_unless_requested());
            }
        });
        for _ in 0..2 {
            cell.lock.lock();
            cell.locked(|s| s.work += 1);
            assert!(cell.lock.unlock_unless_requested());
        }
        contender.join().unwrap();
        assert_eq!(cell.locked(|s| s.work), 4);
        cell.check_end(0, 0);
    });
}

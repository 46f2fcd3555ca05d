//! Stress: eight threads allocate, drop, enter and exit scopes, pass arrays around a ring of
//! channels (so that most buffers are dropped on a thread other than the one whose cache they
//! belong to, often while that thread is inside a scope of it), invalidate, and now and then
//! empty every thread's caches, all at once on one counting backend.
//!
//! Every array is filled with a pattern unique to it when it is allocated and checked whenever
//! it changes hands and when it is dropped: a buffer handed to two live arrays breaks one of the
//! patterns. At the end every thread's `hits + misses` must equal the allocations it made inside
//! each cache's scopes, every cache must be empty after `invalidate`, and the backend must have
//! every byte back.
//!
//! `GPUCACHE_STRESS_OPS` sets the operations per thread (default [`DEFAULT_OPS`]; the closing
//! note of the reliability issue reports a run of 1,000,000 in release).

use gpucache_suite::common;

use std::sync::Barrier;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread;

use common::pattern::{AnyArray, Dt, Init};
use common::{Rng, configure, env_or};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Device, KeyPolicy, Reuse, ScopeGuard};

const THREADS: usize = 8;
const DEFAULT_OPS: usize = 100_000;
/// The cache names every thread uses (each thread has its own caches of these names).
const NAMES: [&str; 3] = ["step", "inner", "aux"];
/// The deepest scope nesting a thread reaches.
const MAX_DEPTH: usize = 4;
/// The most arrays a thread holds; beyond it, it drops one.
const MAX_LIVE: usize = 48;
const SHAPES: &[&[usize]] = &[&[], &[0], &[1], &[8], &[4, 4], &[33], &[2, 3, 5], &[64]];

/// An array with the id whose pattern it holds.
type Tagged = (AnyArray, u64);

#[test]
fn eight_threads_with_cross_thread_drops() {
    let _serial = common::serial();
    let ops = env_or("GPUCACHE_STRESS_OPS", DEFAULT_OPS);
    let backend = CountingBackend::new();
    let barrier = Barrier::new(THREADS);
    let (senders, receivers): (Vec<Sender<Tagged>>, Vec<Receiver<Tagged>>) =
        (0..THREADS).map(|_| channel()).unzip();
    let totals: Vec<Totals> = thread::scope(|s| {
        let workers: Vec<_> = receivers
            .into_iter()
            .enumerate()
            .map(|(i, inbox)| {
                let next = senders[(i + 1) % THREADS].clone();
                let (backend, barrier) = (&backend, &barrier);
                thread::Builder::new()
                    .name(format!("stress-{i}"))
                    .spawn_scoped(s, move || {
                        let _installed = use_backend(backend);
                        Worker::new(i, next, inbox).run(ops, barrier)
                    })
                    .expect("spawn")
            })
            .collect();
        drop(senders);
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let sum = |f: fn(&Totals) -> u64| totals.iter().map(f).sum::<u64>();
    eprintln!(
        "stress: {THREADS} threads x {ops} operations: {} allocations in scopes ({} hits), \
         {} outside, {} arrays dropped on another thread, {} invalidations, {} empty_cache; \
         backend: {backend:?}",
        sum(|t| t.in_scope),
        sum(|t| t.hits),
        sum(|t| t.outside),
        sum(|t| t.received),
        sum(|t| t.invalidations),
        sum(|t| t.empty_caches),
    );
    assert!(sum(|t| t.received) > 0 && sum(|t| t.hits) > 0);
    assert_eq!(backend.failures(), 0);
    assert_eq!(backend.outstanding_bytes(), 0, "{backend:?}");
    assert_eq!(backend.allocs(), backend.frees(), "{backend:?}");
}

/// What one thread did.
#[derive(Default)]
struct Totals {
    in_scope: u64,
    hits: u64,
    outside: u64,
    received: u64,
    invalidations: u64,
    empty_caches: u64,
}

struct Worker {
    thread: usize,
    rng: Rng,
    next: Sender<Tagged>,
    inbox: Receiver<Tagged>,
    /// Guards with the index of their name, innermost last.
    scopes: Vec<(usize, ScopeGuard)>,
    live: Vec<Tagged>,
    next_id: u64,
    /// Non-empty allocations made inside each cache's scopes.
    allocated: [u64; NAMES.len()],
    totals: Totals,
}

impl Worker {
    fn new(thread: usize, next: Sender<Tagged>, inbox: Receiver<Tagged>) -> Worker {
        // Threads differ in how their caches are configured.
        configure("inner", |c| {
            c.reuse = if thread.is_multiple_of(2) {
                Reuse::OnExit
            } else {
                Reuse::Immediate
            }
        });
        configure("aux", |c| {
            c.key = KeyPolicy::SizeClass;
            c.max_cached_bytes = (thread % 4 < 2).then_some(2048);
        });
        Worker {
            thread,
            rng: Rng::with_seed(thread as u64 + 1),
            next,
            inbox,
            scopes: Vec::new(),
            live: Vec::new(),
            next_id: (thread as u64) << 40,
            allocated: [0; NAMES.len()],
            totals: Totals::default(),
        }
    }

    fn run(mut self, ops: usize, barrier: &Barrier) -> Totals {
        // A panic (a pattern broken, a failed assertion) is raised again once every thread has
        // reached the barrier: unwinding past it, this thread would leave the others waiting
        // there for good, and the test would hang instead of failing.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.work(ops)));
        // After a panic too, so that the next thread's drain ends.
        self.hang_up();
        // Now no array of this thread's caches is alive anywhere: every buffer has come home.
        barrier.wait();
        if let Err(panic) = ran {
            std::panic::resume_unwind(panic);
        }
        for (i, name) in NAMES.iter().enumerate() {
            let s = gpucache::stats(name);
            assert_eq!(
                s.hits + s.misses,
                self.allocated[i],
                "thread {}: {name}: {s}",
                self.thread
            );
            assert_eq!(s.bytes_in_use, 0, "thread {}: {name}: {s}", self.thread);
            assert_eq!(s.misses, s.device_allocs);
            self.totals.hits += s.hits;
            gpucache::invalidate(name);
            let s = gpucache::stats(name);
            assert_eq!(
                (s.bytes_in_use, s.bytes_cached),
                (0, 0),
                "thread {}: {name}",
                self.thread
            );
        }
        self.totals
    }

    /// The thread's operations; then it hands nothing more on, takes in (and drops) whatever
    /// the previous thread sends until it is done too, and drops everything.
    fn work(&mut self, ops: usize) {
        for _ in 0..ops {
            self.receive();
            self.step();
        }
        while self.scopes.pop().is_some() {}
        self.hang_up();
        for (array, id) in self.inbox.iter() {
            check(&array, id, "received");
        }
        for (array, id) in self.live.drain(..) {
            check(&array, id, "dropped at the end");
        }
    }

    /// Drops the sender to the next thread (for one whose receiver is gone already).
    fn hang_up(&mut self) {
        drop(std::mem::replace(&mut self.next, channel().0));
    }

    /// Takes in the arrays the previous thread sent: keeps most, drops some at once.
    fn receive(&mut self) {
        loop {
            match self.inbox.try_recv() {
                Ok((array, id)) => {
                    check(&array, id, "received");
                    self.totals.received += 1;
                    if self.rng.usize(..4) != 0 {
                        self.live.push((array, id));
                    }
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return,
            }
        }
    }

    fn step(&mut self) {
        let roll = self.rng.usize(..10_000);
        if self.live.len() >= MAX_LIVE || (3500..6000).contains(&roll) {
            self.drop_one();
        } else if roll < 3500 {
            self.allocate();
        } else if roll < 7000 {
            self.send_one();
        } else if roll < 8450 {
            if self.scopes.len() < MAX_DEPTH {
                let name = self.rng.usize(..NAMES.len());
                self.scopes.push((name, gpucache::enter(NAMES[name])));
            }
        } else if roll < 9900 {
            self.scopes.pop();
        } else if roll < 9920 {
            gpucache::invalidate(NAMES[self.rng.usize(..NAMES.len())]);
            self.totals.invalidations += 1;
        } else if roll < 9922 {
            gpucache::empty_cache();
            self.totals.empty_caches += 1;
        } else {
            for (array, id) in &self.live {
                check(array, *id, "checked");
            }
        }
    }

    fn allocate(&mut self) {
        let dt = *common::pick(&mut self.rng, &Dt::ALL);
        let shape = *common::pick(&mut self.rng, SHAPES);
        let init = *common::pick(&mut self.rng, &Init::ALL);
        let id = self.next_id;
        self.next_id += 1;
        let array = AnyArray::new(Device::Cpu, dt, shape, init, id)
            .unwrap_or_else(|e| panic!("thread {}: allocation failed: {e}", self.thread));
        if array.num_bytes() > 0 {
            match self.scopes.last() {
                Some(&(name, _)) => {
                    self.allocated[name] += 1;
                    self.totals.in_scope += 1;
                }
                None => self.totals.outside += 1,
            }
        }
        self.live.push((array, id));
    }

    fn take_one(&mut self) -> Option<Tagged> {
        if self.live.is_empty() {
            return None;
        }
        let i = self.rng.usize(..self.live.len());
        Some(self.live.swap_remove(i))
    }

    fn drop_one(&mut self) {
        if let Some((array, id)) = self.take_one() {
            check(&array, id, "dropped");
        }
    }

    fn send_one(&mut self) {
        if let Some((array, id)) = self.take_one() {
            check(&array, id, "sent");
            self.next
                .send((array, id))
                .expect("the next thread is alive");
        }
    }
}

fn check(array: &AnyArray, id: u64, when: &str) {
    assert!(
        array.holds(id),
        "array {id:#x} (of thread {}) lost its pattern when {when}",
        id >> 40
    );
}

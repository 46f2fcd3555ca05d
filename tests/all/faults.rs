//! Fault injection with the counting backend: allocations fail every Nth time, once, twice in
//! a row, against a device limit, and under concurrency. A single failure is absorbed by the
//! runtime (it releases cached buffers and retries once); a second failure in a row surfaces as
//! `Error::OutOfMemory` (when a planned cache asked for more than the array, after one more
//! attempt at the array's size: `tests/all/planned.rs`) — never a panic. Either way nothing
//! leaks, the thread keeps working and the stats stay exact.
//!
//! Out-of-memory recovery releases every thread's caches, so the tests of this binary run one
//! at a time (`serial()`).

use gpucache_suite::common;

use std::sync::Arc;
use std::thread;

use common::pattern::{AnyArray, Dt, Init};
use common::{Rng, serial};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Device, Error, Shape, enter};

/// What the allocation of one array came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// `Error::OutOfMemory` for this many bytes.
    OutOfMemory(usize),
}

/// A deterministic single-thread workload: steps of a loop inside the scope `name`, each with
/// two arrays that are recycled from step to step, one of a new shape (always a miss, so that
/// every step reaches the device) that escapes the step and lives for two more, and one array
/// allocated outside any scope. Every allocation's outcome is recorded, with the backend's
/// attempt number at its start, and the stats are checked after every step.
struct Workload {
    backend: Arc<CountingBackend>,
    name: String,
    /// Escaped arrays, oldest first.
    kept: Vec<(AnyArray, u64)>,
    next_id: u64,
    outcomes: Vec<Outcome>,
    /// `backend.attempts()` before each allocation.
    first_attempt: Vec<u64>,
    /// Successful non-empty allocations inside the scope.
    in_scope: u64,
}

impl Workload {
    fn new(backend: &Arc<CountingBackend>, name: &str) -> Workload {
        // The workload's counts are those of free lists.
        common::free_lists(name);
        Workload {
            backend: Arc::clone(backend),
            name: name.to_owned(),
            kept: Vec::new(),
            next_id: 1,
            outcomes: Vec::new(),
            first_attempt: Vec::new(),
            in_scope: 0,
        }
    }

    /// Allocates and fills an array; a failure must be `OutOfMemory` for the array's bytes,
    /// reporting nothing cached (a single thread's caches are all released) and the backend's
    /// outstanding bytes as in use.
    fn alloc(&mut self, dt: Dt, shape: &[usize], init: Init) -> Option<(AnyArray, u64)> {
        let id = self.next_id;
        self.next_id += 1;
        self.first_attempt.push(self.backend.attempts());
        let failures = self.backend.failures();
        let in_scope = gpucache::current_scope().is_some();
        match AnyArray::new(Device::Cpu, dt, shape, init, id) {
            Ok(array) => {
                if self.backend.failures() > failures {
                    let s = gpucache::stats(&self.name);
                    assert_eq!(
                        s.bytes_cached, 0,
                        "the retry came after releasing the cache"
                    );
                }
                self.outcomes.push(Outcome::Ok);
                if in_scope && array.num_bytes() > 0 {
                    self.in_scope += 1;
                }
                Some((array, id))
            }
            Err(Error::OutOfMemory {
                device,
                requested,
                cached,
                in_use,
            }) => {
                let bytes = Shape::from(shape).numel().unwrap() * dt.size();
                assert_eq!((device, requested), (Device::Cpu, bytes));
                assert_eq!(cached, 0, "every cache of this thread was released");
                assert_eq!(in_use, self.backend.outstanding_bytes());
                self.outcomes.push(Outcome::OutOfMemory(requested));
                None
            }
            Err(other) => panic!("allocation {id}: expected OutOfMemory, got {other:?}"),
        }
    }

    fn step(&mut self, i: usize) {
        {
            let _scope = enter(&self.name);
            let recycled = self.alloc(Dt::F32, &[16, 16], Init::Zeros);
            let reshaped = self.alloc(Dt::U8, &[i % 5 + 1, 7], Init::Empty);
            if let Some(new) = self.alloc(Dt::I64, &[100 + i], Init::FromSlice) {
                self.kept.push(new);
            }
            for (array, id) in [recycled, reshaped].into_iter().flatten() {
                assert!(array.holds(id), "array {id}");
            }
        }
        if self.kept.len() > 2 {
            self.kept.remove(0);
        }
        if let Some((outside, id)) = self.alloc(Dt::F16, &[50], Init::Empty) {
            assert!(outside.holds(id));
        }
        self.check(i);
    }

    /// The stats of the cache after a step: every successful allocation counted once, only the
    /// escaped arrays in use, and the backend holding exactly the cache's buffers.
    fn check(&self, step: usize) {
        let s = gpucache::stats(&self.name);
        let when = format!("after step {step}: {s}");
        assert_eq!(s.hits + s.misses, self.in_scope, "{when}");
        assert_eq!(s.misses, s.device_allocs, "{when}");
        let kept: usize = self.kept.iter().map(|(a, _)| a.num_bytes()).sum();
        assert_eq!(s.bytes_in_use, kept, "{when}");
        assert_eq!(
            self.backend.outstanding_bytes(),
            s.bytes_in_use + s.bytes_cached,
            "{when}"
        );
        for (array, id) in &self.kept {
            assert!(array.holds(*id), "kept array {id} {when}");
        }
        let b = &self.backend;
        assert_eq!(b.attempts(), b.allocs() + b.failures(), "{b:?}");
    }

    fn run(&mut self, steps: usize) {
        for i in 0..steps {
            self.step(i);
        }
    }

    /// Drops everything, invalidates and empties the caches: the backend has every byte back.
    fn finish(mut self) -> Vec<Outcome> {
        self.kept.clear();
        gpucache::invalidate(&self.name);
        gpucache::empty_cache();
        let b = &self.backend;
        assert_eq!(b.outstanding_bytes(), 0, "{b:?}");
        assert_eq!(b.allocs(), b.frees(), "{b:?}");
        self.outcomes
    }
}

/// Runs `steps` steps of the workload on a fresh backend set up by `faults`.
fn run_workload(
    name: &str,
    steps: usize,
    faults: impl FnOnce(&CountingBackend),
) -> (Vec<Outcome>, Vec<u64>, Arc<CountingBackend>) {
    let (backend, _installed) = common::counting();
    faults(&backend);
    let mut w = Workload::new(&backend, name);
    w.run(steps);
    let first_attempt = w.first_attempt.clone();
    let outcomes = w.finish();
    (outcomes, first_attempt, backend)
}

#[test]
fn every_nth_failure_is_absorbed_by_the_retry() {
    let _serial = serial();
    for n in [2, 3, 7, 50] {
        let (outcomes, _, backend) = run_workload(&format!("every-{n}"), 200, |b| b.fail_every(n));
        assert!(outcomes.iter().all(|&o| o == Outcome::Ok), "every {n}");
        // A failed attempt is retried at once, and the retry (not a multiple of n) succeeds.
        assert_eq!(backend.failures(), backend.attempts() / n, "every {n}");
        assert!(backend.failures() >= 400 / n, "every {n}: {backend:?}");
    }
}

#[test]
fn a_device_that_fails_everything_still_serves_hits() {
    let _serial = serial();
    let (backend, _installed) = common::counting();
    let mut w = Workload::new(&backend, "fail-all");
    w.run(2);
    backend.fail_every(1);
    let scope = enter("fail-all");
    // Cached in the steps before: a hit needs no device.
    assert!(w.alloc(Dt::F32, &[16, 16], Init::Zeros).is_some());
    // A miss fails twice and releases the cache.
    assert!(w.alloc(Dt::F32, &[17], Init::Zeros).is_none());
    assert_eq!(gpucache::stats("fail-all").bytes_cached, 0);
    assert!(w.alloc(Dt::U8, &[1, 7], Init::Zeros).is_none(), "released");
    drop(scope);
    assert_eq!(
        w.outcomes[w.outcomes.len() - 3..],
        [
            Outcome::Ok,
            Outcome::OutOfMemory(68),
            Outcome::OutOfMemory(7)
        ]
    );
    backend.fail_every(0);
    w.run(3); // the thread keeps working
    w.finish();
}

#[test]
fn two_failures_in_a_row_are_out_of_memory_and_the_thread_keeps_working() {
    let _serial = serial();
    for n in [2, 3, 7, 50] {
        let (backend, _installed) = common::counting();
        backend.fail_every(n);
        let mut w = Workload::new(&backend, &format!("double-{n}"));
        for i in 0..60 {
            if i % 5 == 4 {
                // The next attempt and its retry fail (whatever `fail_every` does).
                backend.fail_nth(1);
                backend.fail_nth(2);
                let bytes = 8 * (1000 + i);
                assert!(w.alloc(Dt::I64, &[1000 + i], Init::Zeros).is_none());
                assert_eq!(w.outcomes.last(), Some(&Outcome::OutOfMemory(bytes)));
            }
            w.step(i);
        }
        let failed = w.outcomes.iter().filter(|&&o| o != Outcome::Ok).count();
        assert_eq!(failed, 12, "every {n}: only the doubly failed allocations");
        w.finish();
    }
}

/// For every device allocation of the workload: failing it once changes no outcome; failing it
/// and its retry makes exactly that allocation `OutOfMemory`, and the workload goes on.
#[test]
fn any_single_failure_is_absorbed_and_any_double_failure_is_reported_where_it_happens() {
    let _serial = serial();
    const STEPS: usize = 12;
    let (clean, first_attempt, backend) = run_workload("sweep", STEPS, |_| {});
    assert!(clean.iter().all(|&o| o == Outcome::Ok));
    let attempts = backend.attempts();
    assert!(attempts >= 2 * STEPS as u64, "{backend:?}");
    for k in 1..=attempts {
        let (once, _, b) = run_workload(&format!("sweep-once-{k}"), STEPS, |b| b.fail_nth(k));
        assert_eq!(once, clean, "attempt {k} failed once");
        assert_eq!(b.failures(), 1);

        let (twice, _, b) = run_workload(&format!("sweep-twice-{k}"), STEPS, |b| {
            b.fail_nth(k);
            b.fail_nth(k + 1);
        });
        assert_eq!(b.failures(), 2);
        // The allocation whose device attempt was the k-th in the clean run.
        let victim = first_attempt.iter().rposition(|&a| a < k).unwrap();
        for (i, (&got, &want)) in twice.iter().zip(&clean).enumerate() {
            if i == victim {
                assert!(
                    matches!(got, Outcome::OutOfMemory(_)),
                    "attempt {k}: allocation {i}"
                );
            } else {
                assert_eq!(got, want, "attempt {k}: allocation {i}");
            }
        }
    }
}

/// Several threads on one backend that fails every third attempt, or that is a small device:
/// attempts of different threads interleave, so a retry can fail too and out-of-memory
/// recovery releases the caches of threads that are inside scopes. Every failure is typed,
/// every thread keeps working with exact stats, and nothing leaks.
#[test]
fn faults_under_concurrency_are_typed_and_leak_nothing() {
    let _serial = serial();
    for (every, limit) in [(3, None), (0, Some(24 << 10))] {
        let backend = CountingBackend::new();
        backend.fail_every(every);
        backend.set_limit(limit);
        let errors: usize = thread::scope(|s| {
            let workers: Vec<_> = (0..4)
                .map(|t| {
                    let backend = &backend;
                    s.spawn(move || concurrent_worker(backend, t, limit))
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        gpucache::empty_cache();
        assert_eq!(backend.outstanding_bytes(), 0, "{backend:?}");
        assert_eq!(backend.allocs(), backend.frees(), "{backend:?}");
        assert!(backend.failures() > 0, "{backend:?}");
        eprintln!("every {every}, limit {limit:?}: {errors} OutOfMemory errors, {backend:?}");
        if limit.is_some() {
            assert!(
                errors >= 4,
                "each thread asked once for more than the device has"
            );
        }
    }
}

/// Random allocations (most in scopes, some kept alive across steps) on one thread, and one
/// larger than the device if it has a `limit`; returns the number of `OutOfMemory` errors.
fn concurrent_worker(backend: &Arc<CountingBackend>, thread: u64, limit: Option<usize>) -> usize {
    let _installed = use_backend(backend);
    let mut rng = Rng::with_seed(thread + 100);
    let mut kept: Vec<(AnyArray, u64)> = Vec::new();
    let (mut errors, mut in_scope) = (0, 0);
    for step in 0..2000u64 {
        let scope = (step % 10 != 9).then(|| enter("concurrent"));
        for j in 0..3 {
            let id = thread << 40 | step << 2 | j;
            let shape = [1 + rng.usize(..64)];
            let dt = *common::pick(&mut rng, &Dt::ALL);
            match AnyArray::new(Device::Cpu, dt, shape, Init::Empty, id) {
                Ok(array) => {
                    in_scope += u64::from(scope.is_some());
                    assert!(array.holds(id));
                    if rng.usize(..4) == 0 {
                        kept.push((array, id));
                    }
                }
                Err(Error::OutOfMemory { device, .. }) => {
                    assert_eq!(device, Device::Cpu);
                    errors += 1;
                }
                Err(other) => panic!("expected OutOfMemory, got {other:?}"),
            }
        }
        if let Some(limit) = limit.filter(|_| step == 1000) {
            let err = AnyArray::new(Device::Cpu, Dt::U8, [limit + 1], Init::Zeros, 0).unwrap_err();
            assert!(
                matches!(err, Error::OutOfMemory { requested, .. } if requested == limit + 1),
                "{err:?}"
            );
            errors += 1;
        }
        drop(scope);
        if kept.len() > 8 {
            let (array, id) = kept.remove(rng.usize(..kept.len()));
            assert!(array.holds(id), "array {id:#x}");
        }
    }
    let s = gpucache::stats("concurrent");
    assert_eq!(s.hits + s.misses, in_scope, "{s}");
    assert_eq!(s.misses, s.device_allocs, "{s}");
    for (array, id) in kept {
        assert!(array.holds(id), "array {id:#x}");
    }
    gpucache::invalidate("concurrent");
    let s = gpucache::stats("concurrent");
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{s}");
    errors
}

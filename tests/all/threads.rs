//! Named caches across threads: a name means the same thing on every thread, buffers returned
//! from other threads are never stranded, and the process-wide readings see every thread.
//!
//! Threads hand over with channels and barriers, never sleeps. Every test here acts on caches of
//! other threads (or reads every thread's), so they run one at a time (`serial()`).

use gpucache_suite::common;

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Barrier};
use std::thread;

use common::{configure, serial};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Array, CacheConfig, CacheStats, Device, Error, KeyPolicy, enter, stats};

const MIB: usize = 1 << 20;

/// The row of cache `name` of the live thread named `thread`.
fn row_of(thread: &str, name: &str) -> CacheStats {
    let snapshot = gpucache::snapshot();
    let rows: Vec<_> = snapshot
        .rows()
        .iter()
        .filter(|r| !r.exited && r.thread == thread && r.cache == name)
        .collect();
    assert_eq!(
        rows.len(),
        1,
        "one live row of {thread}/{name}:\n{snapshot}"
    );
    rows[0].stats
}

/// A worker thread that makes `n` arrays of 1 MiB in a scope of `name`, sends them over `to`,
/// then, once it is where it waits (inside the scope if `in_scope`, else past its exit), sends
/// `()` over `to` too and waits on `go`; then it reports its cache's stats.
fn producer(
    backend: &Arc<CountingBackend>,
    name: &'static str,
    n: usize,
    in_scope: bool,
    to: Sender<Produced>,
    go: Receiver<()>,
) -> thread::JoinHandle<CacheStats> {
    let backend = Arc::clone(backend);
    thread::Builder::new()
        .name(format!("producer-{name}"))
        .spawn(move || {
            let _installed = use_backend(&backend);
            let wait = || {
                to.send(Produced::Waiting).unwrap();
                go.recv().unwrap();
            };
            {
                let _scope = enter(name);
                for _ in 0..n {
                    let array = Array::zeros(Device::Cpu, MIB).unwrap();
                    to.send(Produced::Array(array)).unwrap();
                }
                if in_scope {
                    wait();
                }
            }
            if !in_scope {
                wait();
            }
            stats(name)
        })
        .unwrap()
}

/// What [`producer`] sends: its arrays, then word that it waits.
enum Produced {
    Array(Array<u8>),
    Waiting,
}

/// The arrays `producer` sends, received once it waits (so that a drop of them finds it in or
/// out of its scope as the test asked, not on its way out).
fn produced(from: &Receiver<Produced>) -> Vec<Array<u8>> {
    let mut arrays = Vec::new();
    for produced in from {
        match produced {
            Produced::Array(array) => arrays.push(array),
            Produced::Waiting => return arrays,
        }
    }
    panic!("the producer stopped before it waited")
}

#[test]
fn empty_cache_frees_buffers_returned_by_other_threads_whatever_the_owner_does() {
    let _serial = serial();
    for (name, in_scope) in [("stranded-idle", false), ("stranded-busy", true)] {
        let backend = CountingBackend::new();
        let (to, arrays) = channel();
        let (go, wait) = channel();
        let worker = producer(&backend, name, 100, in_scope, to, wait);
        let received = produced(&arrays);
        assert_eq!(received.len(), 100);
        drop(received);
        // The worker is blocked (idle, or inside its scope): nobody takes its queue in.
        assert_eq!(backend.outstanding_bytes(), 100 * MIB, "{name}");
        gpucache::empty_cache();
        assert_eq!(backend.outstanding_bytes(), 0, "{name}: nothing stranded");
        go.send(()).unwrap();
        let s = worker.join().unwrap();
        assert_eq!((s.device_allocs, s.device_frees), (100, 100), "{name}: {s}");
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "{name}: {s}");
    }
}

#[test]
fn out_of_memory_recovery_frees_returned_buffers_and_reports_what_is_true() {
    let _serial = serial();
    let (backend, _installed) = common::counting();
    let (to, arrays) = channel();
    let (go, wait) = channel();
    let worker = producer(&backend, "oom-returned", 100, true, to, wait);
    let received = produced(&arrays);
    assert_eq!(received.len(), 100);
    drop(received);
    // A device of 120 MiB: 100 MiB sit in the worker's return queue while it is in its scope.
    backend.set_limit(Some(120 * MIB));
    let live = Array::<u8>::zeros(Device::Cpu, 60 * MIB).expect("recovery frees the queue");
    assert_eq!(backend.outstanding_bytes(), 60 * MIB);

    // Under size classes the request is rounded up; the error names what the caller asked for.
    configure("oom-class", |c| c.key = KeyPolicy::SizeClass);
    let _scope = enter("oom-class");
    let asked = 61 * MIB + 1;
    let err = Array::<u8>::zeros(Device::Cpu, asked).unwrap_err();
    let Error::OutOfMemory {
        requested,
        cached,
        in_use,
        ..
    } = err
    else {
        panic!("{err:?}");
    };
    assert_eq!((requested, cached, in_use), (asked, 0, 60 * MIB), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!(
            "60.0 MiB ({} bytes) in use by live arrays",
            60 * MIB
        )),
        "{msg}"
    );
    drop(live);
    go.send(()).unwrap();
    let s = worker.join().unwrap();
    assert_eq!((s.device_frees, s.bytes_in_use), (100, 0), "{s}");
}

#[test]
fn out_of_memory_counts_buffers_held_by_another_threads_active_scope_as_cached() {
    common::free_lists("oom-held");
    let _serial = serial();
    let (backend, _installed) = common::counting();
    let (ready, is_ready) = channel();
    let (go, wait) = channel::<()>();
    let worker = {
        let backend = Arc::clone(&backend);
        thread::spawn(move || {
            let _installed = use_backend(&backend);
            drop(Array::<u8>::zeros(Device::Cpu, MIB)); // outside any scope: freed
            let _scope = enter("oom-held");
            let kept = Array::<u8>::zeros(Device::Cpu, 2 * MIB).unwrap();
            drop(Array::<u8>::zeros(Device::Cpu, 3 * MIB).unwrap()); // free at the scope's exit
            ready.send(()).unwrap();
            wait.recv().unwrap();
            drop(kept);
        })
    };
    is_ready.recv().unwrap();
    backend.set_limit(Some(5 * MIB));
    let err = Array::<u8>::zeros(Device::Cpu, MIB).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfMemory { requested, cached, in_use, .. }
                if (requested, cached, in_use) == (MIB, 3 * MIB, 2 * MIB)
        ),
        "{err}"
    );
    go.send(()).unwrap();
    worker.join().unwrap();
    backend.set_limit(None);
}

#[test]
fn a_buffer_returned_between_steps_is_free_for_the_next_step() {
    let _serial = serial();
    let backend = CountingBackend::new();
    let (to, arrays) = channel::<Array<f32>>();
    let (ack, acked) = channel::<()>();
    let consumer = thread::spawn(move || {
        for array in arrays {
            assert_eq!(array.len(), 4096);
            drop(array);
            ack.send(()).unwrap();
        }
    });
    let producer = {
        let backend = Arc::clone(&backend);
        thread::spawn(move || {
            let _installed = use_backend(&backend);
            for _ in 0..10 {
                let out = {
                    let _step = enter("pipeline");
                    Array::<f32>::zeros(Device::Cpu, 4096).unwrap()
                };
                to.send(out).unwrap();
                acked.recv().unwrap(); // dropped on the consumer before the next step
            }
            stats("pipeline")
        })
    };
    let s = producer.join().unwrap();
    consumer.join().unwrap();
    assert_eq!((s.misses, s.hits, s.device_allocs), (1, 9, 1), "{s}");
    assert_eq!(backend.allocs(), 1, "one buffer serves the whole pipeline");
}

/// A thread that runs one step of `name` (a 4 KiB buffer, cached at the exit), then enters
/// `name` again if `busy` and waits on the barrier twice (the test acts between the two), then
/// exits and waits once more (the test checks).
fn cached_worker(name: &'static str, busy: bool, barrier: &Arc<Barrier>) -> thread::JoinHandle<()> {
    let barrier = Arc::clone(barrier);
    thread::Builder::new()
        .name(format!("{name}-{}", if busy { "busy" } else { "idle" }))
        .spawn(move || {
            {
                let _step = enter(name);
                drop(Array::<u8>::zeros(Device::Cpu, 4096).unwrap());
            }
            let scope = busy.then(|| enter(name));
            barrier.wait(); // ready
            barrier.wait(); // the test has acted
            drop(scope);
            barrier.wait(); // exited: the test checks
            barrier.wait(); // checked
        })
        .unwrap()
}

/// Runs `act` while an idle and a busy thread hold a cached buffer in cache `name`; `check` is
/// given the idle and busy rows right after `act`, and again after the busy thread's scope exited.
fn across_threads(
    name: &'static str,
    act: impl FnOnce(),
    mut check: impl FnMut(&str, CacheStats, CacheStats),
) {
    let barrier = Arc::new(Barrier::new(3));
    let idle = cached_worker(name, false, &barrier);
    let busy = cached_worker(name, true, &barrier);
    barrier.wait();
    act();
    let rows = || {
        (
            row_of(&format!("{name}-idle"), name),
            row_of(&format!("{name}-busy"), name),
        )
    };
    let (i, b) = rows();
    check("right after", i, b);
    barrier.wait();
    barrier.wait();
    let (i, b) = rows();
    check("after the busy scope exited", i, b);
    barrier.wait();
    idle.join().unwrap();
    busy.join().unwrap();
}

#[test]
fn configure_reaches_every_thread_now_or_at_its_scope_exit_and_later_threads() {
    common::free_lists("cfg-everywhere");
    let _serial = serial();
    let mut steps = 0;
    across_threads(
        "cfg-everywhere",
        || configure("cfg-everywhere", |c| c.max_cached_bytes = Some(0)),
        |when, idle, busy| {
            steps += 1;
            assert_eq!((idle.bytes_cached, idle.evictions), (0, 1), "idle {when}");
            let expected = if steps == 1 { (4096, 0) } else { (0, 1) };
            assert_eq!((busy.bytes_cached, busy.evictions), expected, "busy {when}");
        },
    );
    // A thread that creates the cache later gets the options too.
    let later = thread::spawn(|| {
        {
            let _step = enter("cfg-everywhere");
            drop(Array::<u8>::zeros(Device::Cpu, 4096).unwrap());
        }
        stats("cfg-everywhere")
    });
    let s = later.join().unwrap();
    assert_eq!((s.bytes_cached, s.evictions), (0, 1), "{s}");
    gpucache::configure("cfg-everywhere", CacheConfig::default());
}

#[test]
fn invalidate_reaches_every_thread_now_or_at_its_scope_exit() {
    common::free_lists("inval-everywhere");
    let _serial = serial();
    let mut steps = 0;
    across_threads(
        "inval-everywhere",
        || gpucache::invalidate("inval-everywhere"),
        |when, idle, busy| {
            steps += 1;
            assert_eq!(
                (idle.bytes_cached, idle.invalidations),
                (0, 1),
                "idle {when}"
            );
            let expected = if steps == 1 { (4096, 0) } else { (0, 1) };
            assert_eq!(
                (busy.bytes_cached, busy.invalidations),
                expected,
                "busy {when}"
            );
        },
    );
}

#[test]
fn snapshot_tells_threads_apart_and_keeps_exited_ones() {
    common::free_lists("same-name");
    common::free_lists("snap");
    common::free_lists("snap-live");
    let _serial = serial();
    let workers: Vec<_> = (1..=3)
        .map(|steps| {
            thread::Builder::new()
                .name("same-name".into())
                .spawn(move || {
                    for _ in 0..steps {
                        let _step = enter("snap");
                        drop(Array::<u8>::zeros(Device::Cpu, 100).unwrap());
                    }
                })
                .unwrap()
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let snapshot = gpucache::snapshot();
    let rows: Vec<_> = snapshot
        .rows()
        .iter()
        .filter(|r| r.cache == "snap")
        .collect();
    assert_eq!(rows.len(), 3, "{snapshot}");
    let mut numbers: Vec<u64> = rows.iter().map(|r| r.thread_number).collect();
    numbers.dedup();
    assert_eq!(numbers.len(), 3, "threads told apart: {snapshot}");
    assert!(rows.iter().all(|r| r.exited && r.thread == "same-name"));
    let total = snapshot.total("snap");
    assert_eq!((total.misses, total.hits), (3, 3), "{total}");
    assert_eq!((total.device_allocs, total.device_frees), (3, 3), "{total}");
    let table = gpucache::summary();
    assert_eq!(table.matches("same-name#").count(), 3, "{table}");

    // Per-device totals add up the live caches' bytes.
    let _scope = enter("snap-live");
    let _kept = Array::<u8>::zeros(Device::Cpu, 3000).unwrap();
    drop(Array::<u8>::zeros(Device::Cpu, 5000).unwrap());
    drop(_scope);
    let snapshot = gpucache::snapshot();
    let live: Vec<_> = snapshot.rows().iter().filter(|r| !r.exited).collect();
    let cpu = snapshot.device(Device::Cpu);
    assert_eq!(
        cpu.bytes_cached,
        live.iter().map(|r| r.stats.bytes_cached).sum::<usize>()
    );
    assert_eq!(
        cpu.bytes_in_use,
        live.iter().map(|r| r.stats.bytes_in_use).sum::<usize>()
    );
    assert!(
        cpu.bytes_cached >= 5000 && cpu.bytes_in_use >= 3000,
        "{cpu:?}"
    );
    assert_eq!(snapshot.device(Device::Cuda(7)).bytes_cached, 0);
}

#[test]
fn summary_shortens_long_names_instead_of_panicking() {
    let _serial = serial();
    let long = "n".repeat(70_000);
    let thread_name = long.clone();
    let cache = format!("{long}-cache");
    let summary = thread::Builder::new()
        .name(thread_name)
        .spawn(move || {
            let _scope = enter(&cache);
            drop(Array::<u8>::zeros(Device::Cpu, 10).unwrap());
            gpucache::summary()
        })
        .unwrap()
        .join()
        .unwrap();
    assert!(summary.lines().all(|l| l.len() < 400), "{}", summary.len());
    assert!(summary.contains("n-cache"), "{summary}");
}

#[test]
fn since_gives_per_epoch_figures_and_reset_peak_reaches_other_threads() {
    common::free_lists("epochs");
    let _serial = serial();
    let step = || {
        let _step = enter("epochs");
        drop(Array::<u8>::zeros(Device::Cpu, 1000).unwrap());
        drop(Array::<u8>::zeros(Device::Cpu, 24).unwrap());
    };
    for _ in 0..5 {
        step();
    }
    let epoch1 = stats("epochs");
    gpucache::invalidate("epochs");
    for _ in 0..5 {
        step();
    }
    let epoch2 = stats("epochs").since(&epoch1);
    assert_eq!((epoch2.misses, epoch2.hits), (2, 8), "{epoch2}");
    assert_eq!(
        (epoch2.device_allocs, epoch2.device_frees),
        (2, 2),
        "{epoch2}"
    );
    assert_eq!(
        (epoch2.invalidations, epoch2.bytes_cached),
        (1, 1024),
        "{epoch2}"
    );
    assert_eq!(epoch2.peak_bytes, 1024, "gauges as they are now");

    let _big = {
        let _step = enter("epochs");
        Array::<u8>::zeros(Device::Cpu, 1 << 16).unwrap()
    };
    gpucache::invalidate("epochs");
    assert_eq!(stats("epochs").peak_bytes, 1024 + (1 << 16));
    thread::spawn(|| gpucache::reset_peak("epochs"))
        .join()
        .unwrap();
    let s = stats("epochs");
    assert_eq!(s.peak_bytes, s.bytes_in_use + s.bytes_cached, "{s}");
    assert_eq!(s.peak_bytes, 1 << 16, "{s}");
}

/// A request that races a scope's exit is served: by the exiting owner, or by the requester
/// when it finds the cache unlocked. The requester sends a stream of `configure` calls while
/// the owner cycles through scopes; the last call sets a byte cap of 0, and
/// the owner stops right after it. If the last request were missed, the owner's free list
/// would keep the buffer of its last scope.
#[test]
fn a_request_racing_a_scope_exit_is_never_missed() {
    const NAME: &str = "threads-race";
    let _serial = serial();
    for round in 0..20 {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (started_tx, started_rx) = channel::<()>();
        let (idle_tx, idle_rx) = channel::<()>();
        let (checked_tx, checked_rx) = channel::<()>();
        let owner = {
            let done = Arc::clone(&done);
            thread::Builder::new()
                .name("race-owner".into())
                .spawn(move || {
                    let step = || {
                        let _scope = enter(NAME);
                        drop(Array::<f32>::zeros(Device::Cpu, 256).unwrap());
                    };
                    step();
                    started_tx.send(()).unwrap();
                    while !done.load(std::sync::atomic::Ordering::SeqCst) {
                        step();
                        // Lets the requester run where threads share a core (or run one at a
                        // time, as under valgrind); on an idle core it returns at once.
                        thread::yield_now();
                    }
                    idle_tx.send(()).unwrap();
                    checked_rx.recv().unwrap();
                })
                .unwrap()
        };
        started_rx.recv().unwrap();
        for i in 0..50 {
            configure(NAME, |c| c.max_cached_bytes = (i % 2 == 1).then_some(MIB));
        }
        configure(NAME, |c| c.max_cached_bytes = Some(0));
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        idle_rx.recv().unwrap();
        let row = row_of("race-owner", NAME);
        assert_eq!(
            row.bytes_cached, 0,
            "round {round}: the last configure (a cap of 0) did not reach the owner: {row:?}"
        );
        checked_tx.send(()).unwrap();
        owner.join().unwrap();
    }
    configure(NAME, |_| {});
}

/// Arrays made in a scope of a thread that then exits, dropped on this thread: the name's total
/// over every thread and the summary's row count their frees as the backend does, and show
/// nothing in use, under every key policy.
#[test]
fn arrays_outliving_their_thread_are_counted_when_they_drop() {
    let _serial = serial();
    for (name, key) in [
        ("outlive-exact", KeyPolicy::Exact),
        ("outlive-class", KeyPolicy::SizeClass),
        ("outlive-arena", KeyPolicy::Planned),
    ] {
        configure(name, |c| c.key = key);
        let backend = CountingBackend::new();
        let worker = Arc::clone(&backend);
        let arrays: Vec<Array<u8>> = thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _installed = use_backend(&worker);
                let _scope = enter(name);
                (0..3)
                    .map(|_| Array::zeros(Device::Cpu, 4096).unwrap())
                    .collect()
            })
            .unwrap()
            .join()
            .unwrap();
        let before = gpucache::snapshot().total(name);
        assert!(before.bytes_in_use >= 3 * 4096, "{key:?}: {before}");
        drop(arrays);
        assert_eq!(backend.outstanding_bytes(), 0, "{key:?}");
        let total = gpucache::snapshot().total(name);
        assert_eq!(
            (total.device_allocs, total.device_frees),
            (backend.allocs(), backend.frees()),
            "{key:?}: {total}"
        );
        assert_eq!(
            (total.bytes_in_use, total.bytes_cached),
            (0, 0),
            "{key:?}: {total}"
        );
        let summary = gpucache::summary();
        let row = summary
            .lines()
            .find(|l| l.starts_with(name) && l.contains("(exited)"))
            .unwrap_or_else(|| panic!("no exited row of {name}:\n{summary}"));
        let cells: Vec<&str> = row.split_whitespace().collect();
        // thread (exited) cache hits misses hit% allocs frees in-use...
        assert_eq!(
            (cells[6], cells[7], cells[8]),
            (
                backend.allocs().to_string().as_str(),
                backend.frees().to_string().as_str(),
                "0"
            ),
            "{key:?}: {row}"
        );
    }
}

#[test]
fn the_last_configure_wins_on_the_owner_as_on_later_threads() {
    let _serial = serial();
    let name = "cfg-last-wins";
    let fill = || {
        let _step = enter(name);
        drop(Array::<u8>::zeros(Device::Cpu, 4096).unwrap());
    };
    {
        let _scope = enter(name);
        // Another thread asks for cap 0 while the owner is busy: a request for its exit.
        thread::spawn(|| configure(name, |c| c.max_cached_bytes = Some(0)))
            .join()
            .unwrap();
        // Then the owner itself asks for no cap, which applies at once.
        configure(name, |c| c.max_cached_bytes = None);
    }
    fill();
    let own = stats(name);
    let later = thread::spawn(move || {
        fill();
        stats(name)
    })
    .join()
    .unwrap();
    gpucache::invalidate(name);
    gpucache::configure(name, CacheConfig::default());
    assert_eq!(later.bytes_cached, 4096, "a later thread: {later}");
    assert_eq!(
        own.bytes_cached, 4096,
        "the owner, as the last call asked: {own}"
    );
}

#[test]
fn invalidations_count_the_calls_that_reached_the_cache() {
    let _serial = serial();
    let name = "inval-count";
    {
        let _scope = enter(name);
        drop(Array::<u8>::zeros(Device::Cpu, 64).unwrap());
        // Three calls while the owner is busy: served together at its exit, counted each.
        for _ in 0..3 {
            thread::spawn(move || gpucache::invalidate(name))
                .join()
                .unwrap();
        }
    }
    assert_eq!(stats(name).invalidations, 3);
    gpucache::invalidate(name);
    assert_eq!(stats(name).invalidations, 4);
    // A change of key policy empties the cache, but is no call of `invalidate`.
    configure(name, |c| c.key = KeyPolicy::SizeClass);
    assert_eq!(stats(name).invalidations, 4);
    gpucache::configure(name, CacheConfig::default());
}

//! Recording (`gpucache::trace`): the events of each kind with their fields, the Chrome
//! trace-event JSON (parsed with serde_json: balanced slices per thread, timestamps that never go
//! back on a track, final counters equal to the stats), bad paths, `GPUCACHE_TRACE` and the bound
//! on a thread's buffer (in child processes of this binary, since the environment is read once).
//!
//! Recording is process-wide, so every test that records holds `common::serial()`.

use std::collections::{HashMap, HashSet};

use gpucache::testing::{CountingBackend, use_backend};
use gpucache::trace::{self, Event, EventKind, Trace, TraceKey};
use gpucache::{Array, CacheConfig, DType, Device, Error, Reuse, enter, stats};
use serde_json::Value;

use gpucache_suite::common::{self, configure, serial};
use gpucache_suite::replay::{self, Mode, Op};

/// The events of cache `name`.
fn of<'a>(t: &'a Trace, name: &str) -> Vec<&'a Event> {
    t.events()
        .iter()
        .filter(|e| e.cache.as_deref() == Some(name))
        .collect()
}

fn count(events: &[&Event], kind: EventKind) -> usize {
    events.iter().filter(|e| e.kind == kind).count()
}

/// Records `f` and returns the trace.
fn record(f: impl FnOnce()) -> Trace {
    trace::start().expect("nothing else records");
    f();
    trace::stop().expect("recording")
}

#[test]
fn planned_allocations_drops_and_blocks_are_recorded() {
    let _serial = serial();
    let name = "trace-arena";
    configure(name, |c| c.key = gpucache::KeyPolicy::Planned);
    let mut addrs = Vec::new();
    let t = record(|| {
        for _ in 0..3 {
            let _scope = enter(name);
            let a = Array::<f32>::zeros(Device::Cpu, [4, 8]).unwrap();
            let b = Array::<u8>::zeros(Device::Cpu, [3]).unwrap();
            addrs.push([
                a.as_slice().unwrap().as_ptr() as u64,
                b.as_slice().unwrap().as_ptr() as u64,
            ]);
        }
    });
    let events = of(&t, name);
    let s = stats(name);
    // The first step allocates each array apart (two misses), the second the plan's block for
    // its first array (a miss) and serves the other from it; the third is all hits.
    assert_eq!((s.misses, s.hits), (3, 3));
    assert_eq!(count(&events, EventKind::Miss), 3);
    assert_eq!(count(&events, EventKind::Hit), 3);
    // Each names the array's bytes and address.
    let bumps: Vec<(usize, u64)> = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Hit | EventKind::Miss))
        .map(|e| {
            assert_eq!(e.device, Some(Device::Cpu));
            (e.bytes, e.buffer.expect("an address"))
        })
        .collect();
    let expected: Vec<(usize, u64)> = addrs
        .iter()
        .flat_map(|&[a, b]| [(128, a), (3, b)])
        .collect();
    assert_eq!(bumps, expected);
    // The plan's block, made in the second step: both arrays, alive together, 256 bytes each.
    let blocks: Vec<&&Event> = events
        .iter()
        .filter(|e| e.kind == EventKind::PlanBlock)
        .collect();
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].bytes, 512);
    assert_eq!(
        blocks[0].buffer,
        Some(addrs[1][0]),
        "the block starts at a's offset 0"
    );
    // The first step's blocks go back to the device as their arrays drop; the later steps'
    // arrays go back to the plan.
    assert_eq!(count(&events, EventKind::DeviceFree), 2);
    assert_eq!(count(&events, EventKind::FreeToCache), 4);
    let last = events.last().unwrap();
    assert_eq!(
        last.bytes_after,
        Some((0, 512)),
        "nothing in use, the block cached"
    );
    // So the trace replays: every allocation ends.
    let ops = replay::from_trace(&t, None);
    let allocs = ops.iter().filter(|o| matches!(o, Op::Alloc { .. })).count();
    let frees = ops.iter().filter(|o| matches!(o, Op::Free { .. })).count();
    assert_eq!((allocs, frees), (6, 6));
    gpucache::invalidate(name);
}

#[test]
fn a_plan_block_grown_in_place_is_recorded_as_given_back_and_made_again() {
    let _serial = serial();
    let name = "trace-grown";
    configure(name, |c| c.key = gpucache::KeyPolicy::Planned);
    let backend = CountingBackend::new();
    backend.set_growable(true);
    let _installed = use_backend(&backend);
    // Two arrays of `n` floats, one after the other: a plan of one position's bytes.
    let step = |n: usize| {
        let _scope = enter(name);
        drop(Array::<f32>::zeros(Device::Cpu, n).unwrap());
        drop(Array::<f32>::zeros(Device::Cpu, n).unwrap());
    };
    step(256);
    step(256);
    let t = record(|| step(512));
    assert_eq!(backend.grows(), 1, "{backend:?}");
    let events = of(&t, name);
    let blocks: Vec<(EventKind, usize, Option<u64>)> = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::DeviceFree | EventKind::PlanBlock))
        .map(|e| (e.kind, e.bytes, e.buffer))
        .collect();
    let at = blocks.first().and_then(|b| b.2);
    assert!(at.is_some());
    // The old block given back, the same block made again larger (scaled by 2, a sixty-fourth
    // more, rounded up to 256), at the same address.
    assert_eq!(
        blocks,
        [
            (EventKind::DeviceFree, 1024, at),
            (EventKind::PlanBlock, 2304, at)
        ]
    );
    let s = stats(name);
    assert_eq!(
        events.last().unwrap().bytes_after,
        Some((s.bytes_in_use, s.bytes_cached)),
        "the recorded bytes end at the stats"
    );
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 2304));
    assert_eq!(backend.outstanding_bytes(), 2304);
    // So the trace replays: every allocation ends.
    let ops = replay::from_trace(&t, None);
    let allocs = ops.iter().filter(|o| matches!(o, Op::Alloc { .. })).count();
    let frees = ops.iter().filter(|o| matches!(o, Op::Free { .. })).count();
    assert_eq!((allocs, frees), (2, 2));
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn a_planned_array_dropped_on_another_thread_is_recorded_as_returned() {
    let _serial = serial();
    let name = "trace-arena-returned";
    configure(name, |c| c.key = gpucache::KeyPolicy::Planned);
    let mut at = 0;
    let t = record(|| {
        let a = {
            let _scope = enter(name);
            Array::<f32>::zeros(Device::Cpu, 100).unwrap()
        };
        at = a.as_slice().unwrap().as_ptr() as u64;
        std::thread::spawn(move || drop(a)).join().unwrap();
    });
    let returned: Vec<(usize, Option<u64>)> = of(&t, name)
        .iter()
        .filter(|e| e.kind == EventKind::Returned)
        .map(|e| (e.bytes, e.buffer))
        .collect();
    assert_eq!(returned, [(400, Some(at))]);
    gpucache::invalidate(name);
}

#[test]
fn every_kind_of_event_is_recorded_with_its_fields() {
    common::free_lists("trace-kinds");
    let _serial = serial();
    let name = "trace-kinds";
    let t = record(|| {
        for _ in 0..3 {
            let _scope = enter(name);
            let _a = Array::<f32>::zeros(Device::Cpu, [4, 8]).unwrap();
        }
        gpucache::invalidate(name);
        gpucache::empty_cache();
    });
    let events = of(&t, name);
    assert_eq!(count(&events, EventKind::ScopeEnter), 3);
    assert_eq!(count(&events, EventKind::ScopeExit), 3);
    assert_eq!(count(&events, EventKind::Miss), 1);
    assert_eq!(count(&events, EventKind::Hit), 2);
    assert_eq!(count(&events, EventKind::FreeToCache), 3);
    assert_eq!(
        count(&events, EventKind::DeviceFree),
        1,
        "invalidate frees it"
    );
    assert_eq!(count(&events, EventKind::Invalidate), 1);
    assert!(t.events().iter().any(|e| e.kind == EventKind::EmptyCache));
    let key = TraceKey::Exact {
        dtype: DType::F32,
        shape: [4, 8].into(),
    };
    for e in events.iter().filter(|e| {
        matches!(
            e.kind,
            EventKind::Miss | EventKind::Hit | EventKind::FreeToCache | EventKind::DeviceFree
        )
    }) {
        assert_eq!(e.key.as_ref(), Some(&key), "{e:?}");
        assert_eq!(
            (e.bytes, e.device, e.stream),
            (128, Some(Device::Cpu), None)
        );
        assert!(e.bytes_after.is_some(), "{e:?}");
    }
    let miss = events.iter().find(|e| e.kind == EventKind::Miss).unwrap();
    assert_eq!(miss.bytes_after, Some((128, 0)), "in use after the miss");
    let last = events.iter().rfind(|e| e.bytes_after.is_some()).unwrap();
    assert_eq!(last.bytes_after, Some((0, 0)), "all freed at the end");
    assert!(t.events().windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
    assert_eq!(t.dropped(), 0);
    assert!(!trace::is_recording());
}

#[test]
fn evictions_returns_from_other_threads_and_size_classes_are_recorded() {
    let _serial = serial();
    let (capped, classes) = ("trace-capped", "trace-classes");
    configure(capped, |c| {
        c.reuse = Reuse::Immediate;
        c.max_cached_bytes = Some(1000);
    });
    configure(classes, |c| c.key = gpucache::KeyPolicy::SizeClass);
    let t = record(|| {
        let _scope = enter(capped);
        drop(Array::<u8>::zeros(Device::Cpu, 600).unwrap());
        drop(Array::<u8>::zeros(Device::Cpu, 700).unwrap()); // evicts the first
        let escaped = {
            let _scope = enter(classes);
            Array::<u8>::zeros(Device::Cpu, 1000).unwrap()
        };
        std::thread::spawn(move || drop(escaped)).join().unwrap();
        let _scope = enter(classes); // takes the returned buffer in
    });
    let capped_events = of(&t, capped);
    assert_eq!(count(&capped_events, EventKind::Evict), 1);
    let evict = capped_events
        .iter()
        .find(|e| e.kind == EventKind::Evict)
        .unwrap();
    assert_eq!(evict.bytes, 600);
    let class_events = of(&t, classes);
    let returned: Vec<_> = class_events
        .iter()
        .filter(|e| e.kind == EventKind::Returned)
        .collect();
    assert_eq!(returned.len(), 1);
    assert_ne!(
        returned[0].thread, returned[0].cache_thread,
        "another thread"
    );
    assert_eq!(returned[0].bytes, 1024, "the size class");
    let miss = class_events
        .iter()
        .find(|e| e.kind == EventKind::Miss)
        .unwrap();
    assert_eq!(miss.key, Some(TraceKey::SizeClass { bytes: 1024 }));
    // Taken in by the owner: back on the free list, as the last reading says.
    let last = class_events
        .iter()
        .rfind(|e| e.bytes_after.is_some())
        .unwrap();
    assert_eq!(last.bytes_after, Some((0, 1024)));
    gpucache::invalidate(capped);
    gpucache::invalidate(classes);
}

#[test]
fn out_of_memory_is_recorded_with_the_release_and_the_retry() {
    common::free_lists("trace-oom");
    let _serial = serial();
    let backend = CountingBackend::new();
    let _installed = use_backend(&backend);
    let name = "trace-oom";
    let t = record(|| {
        {
            let _scope = enter(name);
            drop(Array::<u8>::zeros(Device::Cpu, 512).unwrap());
        }
        backend.fail_nth(1);
        let _ok = Array::<u8>::zeros(Device::Cpu, 64).unwrap(); // recovered
        backend.fail_nth(1);
        backend.fail_nth(2);
        let err = Array::<u8>::zeros(Device::Cpu, 32).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    });
    let ooms: Vec<_> = t
        .events()
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::OutOfMemory {
                released,
                recovered,
            } => Some((e.bytes, released, recovered)),
            _ => None,
        })
        .collect();
    assert_eq!(ooms, [(64, 512, true), (32, 0, false)]);
}

/// A workload for the Chrome export: two threads, nested and recursive scopes, a return from
/// another thread, an invalidation; returns the names of its caches.
fn workload() -> [&'static str; 3] {
    let names = ["trace-outer", "trace-inner", "trace-worker"];
    let [outer, inner, worker] = names;
    let escaped = std::thread::spawn(move || {
        let _scope = enter(worker);
        let a = Array::<f32>::zeros(Device::Cpu, 64).unwrap();
        drop(Array::<f32>::zeros(Device::Cpu, 32).unwrap());
        a
    })
    .join()
    .unwrap();
    for step in 0..4 {
        let _scope = enter(outer);
        let _x = Array::<f32>::zeros(Device::Cpu, [16, 16]).unwrap();
        {
            let _scope = enter(inner);
            let _y = Array::<i32>::zeros(Device::Cpu, [8]).unwrap();
            let _again = enter(inner); // recursive
            let _z = Array::<u8>::zeros(Device::Cpu, [3, 5]).unwrap();
        }
        if step == 2 {
            gpucache::invalidate(inner);
        }
    }
    drop(escaped); // returned to the exited worker's cache: freed
    names
}

#[test]
fn the_chrome_trace_parses_balances_and_ends_at_the_stats() {
    common::free_lists("trace-before");
    let _serial = serial();
    // A scope entered before recording starts: its exit is left out of the slices.
    let before = enter("trace-before");
    trace::start().unwrap();
    let names = workload();
    drop(before);
    let t = trace::stop().unwrap();
    let mut json = Vec::new();
    t.write_chrome(&mut json).unwrap();
    let doc: Value = serde_json::from_slice(&json).expect("valid JSON");
    let events = doc["traceEvents"].as_array().expect("traceEvents");
    assert_eq!(doc["otherData"]["dropped_events"], 0);

    let mut depth: HashMap<u64, i64> = HashMap::new();
    let mut last_ts: HashMap<(String, u64), f64> = HashMap::new();
    let mut counters: HashMap<String, (u64, u64)> = HashMap::new();
    let mut phases: HashMap<String, usize> = HashMap::new();
    for e in events {
        let ph = e["ph"].as_str().expect("ph");
        *phases.entry(ph.to_owned()).or_default() += 1;
        if ph == "M" {
            continue;
        }
        let tid = e["tid"].as_u64().expect("tid");
        let ts = e["ts"].as_f64().expect("ts");
        let track = match ph {
            "C" => (e["name"].as_str().unwrap().to_owned(), 0),
            _ => (String::new(), tid),
        };
        let prev = last_ts.insert(track.clone(), ts).unwrap_or(0.0);
        assert!(ts >= prev, "time went back on {track:?}: {prev} then {ts}");
        match ph {
            "B" => *depth.entry(tid).or_default() += 1,
            "E" => {
                let d = depth.entry(tid).or_default();
                *d -= 1;
                assert!(*d >= 0, "an E without its B on thread {tid}");
            }
            "C" => {
                let args = &e["args"];
                let value = (
                    args["in use"].as_u64().unwrap(),
                    args["cached"].as_u64().unwrap(),
                );
                counters.insert(e["name"].as_str().unwrap().to_owned(), value);
            }
            "i" => assert!(e["name"].is_string() && e["args"]["bytes"].is_u64()),
            other => panic!("unexpected phase {other}"),
        }
    }
    assert!(depth.values().all(|&d| d == 0), "unbalanced: {depth:?}");
    // 4 outer + 8 inner (one recursive each step) + 1 worker; "trace-before" was left out.
    assert_eq!(phases["B"], 13);
    assert_eq!(phases["E"], 13);
    assert!(phases["i"] >= 3 && phases["C"] > 0, "{phases:?}");
    // The workload's scopes ran on this thread and the worker, each named in the trace (another
    // test's thread may add events meanwhile: recording is process-wide, and only the tests
    // that record hold `serial()`).
    let tids = |f: &dyn Fn(&Value) -> bool| -> HashSet<u64> {
        events
            .iter()
            .filter(|e| f(e))
            .filter_map(|e| e["tid"].as_u64())
            .collect()
    };
    let scoped = tids(&|e| e["ph"] == "B");
    assert_eq!(scoped.len(), 2, "this thread and the worker");
    assert!(scoped.is_subset(&tids(&|e| e["name"] == "thread_name")));

    for name in &names[..2] {
        let s = stats(name);
        assert_eq!(
            counters[&format!("cache {name} on cpu")],
            (s.bytes_in_use as u64, s.bytes_cached as u64),
            "{name}"
        );
    }
    let worker = counters[&format!("cache {} on cpu", names[2])];
    assert_eq!(
        worker,
        (0, 0),
        "the worker's cache closed and its last array freed"
    );
    let cpu = gpucache::snapshot().device(Device::Cpu);
    assert_eq!(
        counters["device cpu"],
        (cpu.bytes_in_use as u64, cpu.bytes_cached as u64)
    );
    for name in names {
        gpucache::invalidate(name);
    }
}

#[test]
fn a_trace_file_that_cannot_be_written_is_an_error_and_nothing_records() {
    let _serial = serial();
    let path = std::path::Path::new("/nonexistent-gpucache-dir/trace.json");
    let err = trace::start_to(path).unwrap_err();
    assert!(
        matches!(&err, Error::TraceFile { path: p, .. } if p == path),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "cannot write the trace file /nonexistent-gpucache-dir/trace.json"
    );
    assert!(std::error::Error::source(&err).is_some());
    assert!(!trace::is_recording());
    assert!(trace::stop().is_none());
    let t = Trace::default();
    assert!(matches!(t.save(path), Err(Error::TraceFile { .. })));
}

#[test]
fn recording_twice_is_an_error_and_a_file_is_written_on_stop() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("gpucache-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("stop.json");
    trace::start_to(&path).unwrap();
    assert!(matches!(trace::start(), Err(Error::TraceActive)));
    {
        let _scope = enter("trace-file");
        drop(Array::<f32>::zeros(Device::Cpu, 10).unwrap());
    }
    let t = trace::stop().unwrap();
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let slices = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "B" && e["name"] == "trace-file")
        .count();
    assert_eq!(slices, 1);
    assert_eq!(count(&of(&t, "trace-file"), EventKind::Miss), 1);
    std::fs::remove_dir_all(&dir).unwrap();
    gpucache::invalidate("trace-file");
}

const CHILD: &str = "trace::child_process";

/// Runs [`child_process`] in a child of this test binary with `env`; returns its standard error.
fn child(env: &[(&str, &str)]) -> String {
    let mut env = env.to_vec();
    env.push(("GPUCACHE_TRACE_CHILD", "1"));
    gpucache_suite::common::run_child(CHILD, &env, "the child")
}

/// What the child processes run (listed as ignored in a normal run).
#[test]
#[ignore = "run by the other tests of this module in a child process"]
fn child_process() {
    common::free_lists("trace-huge");
    common::free_lists("trace-bounded");
    common::free_lists("trace-env");
    assert!(std::env::var_os("GPUCACHE_TRACE_CHILD").is_some());
    if std::env::var_os("GPUCACHE_TRACE_MAX_EVENTS").is_some_and(|v| v != "16") {
        // Out of range or unreadable: bounded (or the default), and recording works.
        let t = record(|| {
            for _ in 0..10 {
                let _scope = enter("trace-huge");
                drop(Array::<u8>::zeros(Device::Cpu, 8).unwrap());
            }
        });
        assert_eq!((t.events().len(), t.dropped()), (50, 0));
        return;
    }
    if std::env::var_os("GPUCACHE_TRACE_MAX_EVENTS").is_some() {
        let t = record(|| {
            for _ in 0..10 {
                let _scope = enter("trace-bounded");
                drop(Array::<u8>::zeros(Device::Cpu, 8).unwrap());
            }
        });
        // 50 events: enter, miss or hit, free to cache, exit and the bytes after it, per step.
        assert_eq!((t.events().len(), t.dropped()), (16, 34));
        return;
    }
    // The program's own work goes on whatever GPUCACHE_TRACE says.
    for _ in 0..3 {
        let _scope = enter("trace-env");
        let a = Array::<f32>::zeros(Device::Cpu, 16).unwrap();
        assert_eq!(a.to_vec().unwrap(), [0.0; 16]);
    }
    assert_eq!(stats("trace-env").hits, 2);
}

#[test]
fn gpucache_trace_writes_the_file_at_exit() {
    let _serial = serial();
    let path = std::env::temp_dir().join(format!("gpucache-env-{}.json", std::process::id()));
    let stderr = child(&[("GPUCACHE_TRACE", path.to_str().unwrap())]);
    assert!(!stderr.contains("gpucache:"), "{stderr}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let misses = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "miss" && e["args"]["cache"] == "trace-env")
        .count();
    assert_eq!(misses, 1);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_bad_gpucache_trace_path_warns_in_one_line_and_the_program_goes_on() {
    let _serial = serial();
    let stderr = child(&[("GPUCACHE_TRACE", "/nonexistent-gpucache-dir/t.json")]);
    let warnings: Vec<_> = stderr.lines().filter(|l| l.contains("gpucache:")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(
        warnings[0].starts_with(
            "gpucache: GPUCACHE_TRACE: cannot write the trace file \
             /nonexistent-gpucache-dir/t.json: "
        ) && warnings[0].ends_with("; not recording"),
        "{}",
        warnings[0]
    );
}

#[test]
fn a_full_buffer_drops_events_and_counts_them() {
    let _serial = serial();
    child(&[("GPUCACHE_TRACE_MAX_EVENTS", "16")]);
}

#[test]
fn a_huge_or_unreadable_buffer_bound_warns_in_one_line_and_recording_works() {
    let _serial = serial();
    for value in [&*usize::MAX.to_string(), "268435457", "lots"] {
        let stderr = child(&[("GPUCACHE_TRACE_MAX_EVENTS", value)]);
        let warnings: Vec<_> = stderr.lines().filter(|l| l.contains("gpucache:")).collect();
        assert_eq!(warnings.len(), 1, "{value}: {stderr}");
        assert!(
            warnings[0].starts_with("gpucache: GPUCACHE_TRACE_MAX_EVENTS="),
            "{}",
            warnings[0]
        );
    }
}

#[test]
fn cache_config_is_unchanged_by_recording() {
    let _serial = serial();
    let name = "trace-config";
    configure(name, |c| c.reuse = Reuse::Immediate);
    let t = record(|| {
        let _scope = enter(name);
        for _ in 0..3 {
            drop(Array::<u8>::zeros(Device::Cpu, 100).unwrap());
        }
    });
    let s = stats(name);
    assert_eq!((s.misses, s.hits), (1, 2), "recording changes no behaviour");
    assert_eq!(count(&of(&t, name), EventKind::Hit), 2);
    gpucache::configure(name, CacheConfig::default());
    gpucache::invalidate(name);
}

#[test]
fn a_recorded_allocation_log_round_trips_and_replays() {
    common::free_lists("trace-replay");
    let _serial = serial();
    let name = "trace-replay";
    let t = record(|| {
        for _epoch in 0..2 {
            for _ in 0..3 {
                let _scope = enter(name);
                let a = Array::<f32>::zeros(Device::Cpu, [64, 64]).unwrap();
                let _b = Array::<i32>::zeros(Device::Cpu, 16).unwrap();
                drop(a);
                let _c = Array::<u8>::zeros(Device::Cpu, [3, 5]).unwrap();
            }
            gpucache::invalidate(name);
        }
    });
    let ops = replay::from_trace(&t, None);
    let n = |f: fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
    assert_eq!(n(|o| matches!(o, Op::Enter(_))), 6);
    assert_eq!(n(|o| matches!(o, Op::Exit(_))), 6);
    assert_eq!(n(|o| matches!(o, Op::Invalidate(_))), 2);
    assert_eq!(n(|o| matches!(o, Op::Alloc { .. })), 18);
    assert_eq!(
        n(|o| matches!(o, Op::Free { .. })),
        18,
        "every allocation ends"
    );
    assert!(ops.contains(&Op::Alloc {
        cache: name.into(),
        buffer: 1,
        bytes: 64 * 64 * 4,
        elem: 4,
        dims: vec![64, 64],
    }));
    let path = std::env::temp_dir().join(format!("gpucache-log-{}.csv", std::process::id()));
    std::fs::write(&path, replay::to_csv(&ops)).unwrap();
    assert_eq!(replay::read(&path).unwrap(), ops, "the CSV reads back");
    std::fs::remove_file(&path).unwrap();

    let cached = replay::replay(&ops, Device::Cpu, Mode::Gpucache).unwrap();
    gpucache::empty_cache();
    let bare = replay::replay(&ops, Device::Cpu, Mode::Bare).unwrap();
    assert_eq!(bare.device_allocs, 18);
    assert_eq!(cached.device_allocs, 6, "three keys, once per epoch");
    assert_eq!(
        bare.peak_bytes,
        64 * 64 * 4 + 64,
        "a dropped before c is made"
    );
    assert_eq!(
        cached.peak_bytes,
        64 * 64 * 4 + 64 + 15,
        "OnExit: all three held at once"
    );
}

/// The fixture: an allocation log recorded from `train_cuda` on a GPU (2 epochs of 10 steps).
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/train_cuda.csv");

#[test]
fn the_train_cuda_fixture_replays_on_the_cpu() {
    let _serial = serial();
    let ops = replay::read(FIXTURE.as_ref()).unwrap();
    let allocs = ops.iter().filter(|o| matches!(o, Op::Alloc { .. })).count() as u64;
    assert!(allocs >= 100, "{allocs}");
    // Replayed through free lists (the counts below are theirs).
    for op in &ops {
        if let Op::Enter(name) = op {
            common::free_lists(name);
        }
    }
    let cached = replay::replay(&ops, Device::Cpu, Mode::Gpucache).unwrap();
    gpucache::empty_cache();
    let bare = replay::replay(&ops, Device::Cpu, Mode::Bare).unwrap();
    assert_eq!(bare.device_allocs, allocs);
    // One allocation per buffer of a step, in each of the two epochs.
    assert_eq!(cached.device_allocs * 10, allocs);
    assert!(cached.peak_bytes >= bare.peak_bytes);
}

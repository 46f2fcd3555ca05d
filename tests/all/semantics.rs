//! The cache's rules (the crate docs' "Semantics"), one test each, on every available device.
//!
//! Nothing here acts on other threads' caches (`empty_cache`, out-of-memory recovery): those
//! tests hold `common::serial()`, and every test here holds `common::shared()` (through
//! `common::device_tests!`), so that they cannot disturb these.

use gpucache_suite::common;

use std::thread;

use common::{addr, all_eq, escaping_step, filled};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Array, Device, KeyPolicy, Reuse, enter, stats};

const N: usize = 256; // elements per test array: 1 KiB of f32

common::device_tests! {
    fn recycles_on_reentry(dev, name) {
        let mut seen = Vec::new();
        for step in 0..5 {
            let _scope = enter(name);
            let a = Array::<f32>::zeros(dev, [16, 16]).unwrap();
            let b = Array::<f32>::zeros(dev, [16, 16]).unwrap();
            if dev == Device::Cpu {
                seen.push((addr(&a), addr(&b)));
            }
            let s = stats(name);
            assert_eq!(s.misses, 2, "step {step}: only the first step misses");
            assert_eq!(s.hits, 2 * step, "step {step}");
        }
        let s = stats(name);
        assert_eq!((s.device_allocs, s.device_frees), (2, 0));
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 2 * 1024));
        if dev == Device::Cpu {
            let (a0, b0) = seen[0];
            assert_ne!(a0, b0);
            for &(a, b) in &seen {
                let mut pair = [a, b];
                pair.sort();
                let mut first = [a0, b0];
                first.sort();
                assert_eq!(pair, first, "every step reuses the same two buffers");
            }
        }
    }

    fn keys_separate_by_dtype_and_shape(dev, name) {
        {
            let _scope = enter(name);
            Array::<f32>::zeros(dev, [4, 4]).unwrap();
        }
        let _scope = enter(name);
        let same_bytes_other_shape = Array::<f32>::zeros(dev, [16]).unwrap();
        let same_shape_other_dtype = Array::<u32>::zeros(dev, [4, 4]).unwrap();
        assert_eq!((stats(name).hits, stats(name).misses), (0, 3));
        let same_key = Array::<f32>::zeros(dev, [4, 4]).unwrap();
        assert_eq!((stats(name).hits, stats(name).misses), (1, 3));
        assert_eq!(same_bytes_other_shape.shape().dims(), &[16]);
        assert_eq!(same_shape_other_dtype.dtype(), gpucache::DType::U32);
        assert_eq!(same_key.shape().dims(), &[4, 4]);
    }

    fn zeros_zeroes_a_recycled_buffer_and_empty_recycles_it(dev, name) {
        {
            let _scope = enter(name);
            filled(dev, 7.5f32, N);
        }
        {
            let _scope = enter(name);
            let a = Array::<f32>::empty(dev, N).unwrap();
            assert_eq!(stats(name).hits, 1);
            assert!(all_eq(&a, 7.5), "empty hands back the recycled contents");
        }
        let _scope = enter(name);
        let z = Array::<f32>::zeros(dev, N).unwrap();
        assert_eq!(stats(name).hits, 2);
        assert!(all_eq(&z, 0.0), "zeros must clear a recycled buffer");
    }

    fn bool_arrays_from_recycled_bytes_are_valid(dev, name) {
        common::configure(name, |c| c.key = KeyPolicy::SizeClass);
        {
            let _scope = enter(name);
            filled(dev, 0xABu8, 512);
        }
        let _scope = enter(name);
        let b = Array::<bool>::empty(dev, 512).unwrap();
        assert_eq!(
            stats(name).hits,
            1,
            "the u8 buffer is recycled for the bools"
        );
        assert!(all_eq(&b, false), "bool arrays never expose recycled bytes");
    }

    fn new_planned_blocks_over_used_memory_still_give_zeros_and_false(dev, name) {
        common::configure(name, |c| c.key = KeyPolicy::Planned);
        for step in 0..3 {
            // Memory the device hands out again (on CUDA, its stream-ordered pool): dirty.
            drop((0..4).map(|_| filled(dev, 0xABu8, 4 * N)).collect::<Vec<_>>());
            let _scope = enter(name);
            // A new block each step: solo blocks in the first, the plan's in the second, and
            // (the first array growing) solo blocks again in the third; never zeroed as a whole.
            let z = Array::<f32>::zeros(dev, N * (1 + step)).unwrap();
            let b = Array::<bool>::empty(dev, 4 * N).unwrap();
            let e = Array::<u8>::empty(dev, 4 * N).unwrap();
            assert!(all_eq(&z, 0.0), "step {step}: zeros on a new block");
            assert!(all_eq(&b, false), "step {step}: bools on a new block");
            assert_eq!(e.len(), 4 * N);
        }
        assert!(stats(name).device_allocs >= 3, "new blocks were made");
    }

    fn escaped_array_is_never_recycled_while_alive_and_comes_home(dev, name) {
        let kept = escaping_step(dev, name, 42.0);
        for step in 0..10 {
            let other = escaping_step(dev, name, step as f32);
            assert!(all_eq(&other, step as f32));
            assert!(
                all_eq(&kept, 42.0),
                "step {step} overwrote an escaped array"
            );
            if dev == Device::Cpu {
                assert_ne!(addr(&kept), addr(&other));
            }
        }
        let before = stats(name);
        assert_eq!(before.bytes_in_use, 1024, "only `kept` is busy");
        drop(kept);
        let after = stats(name);
        assert_eq!(after.bytes_in_use, 0);
        assert_eq!(after.bytes_cached, before.bytes_cached + 1024);
        assert_eq!(
            after.device_frees, 0,
            "it came home, not back to the device"
        );
    }

    fn nested_scopes_route_to_the_innermost(dev, name) {
        let outer = format!("{name}/outer");
        let inner = format!("{name}/inner");
        common::free_lists(&outer);
        common::free_lists(&inner);
        let _o = enter(&outer);
        let _a = Array::<f32>::zeros(dev, N).unwrap();
        {
            let _i = enter(&inner);
            assert_eq!(gpucache::current_scope().as_deref(), Some(inner.as_str()));
            let _b = Array::<f32>::zeros(dev, N).unwrap();
            let _c = Array::<f32>::zeros(dev, N).unwrap();
        }
        assert_eq!(gpucache::current_scope().as_deref(), Some(outer.as_str()));
        let _d = Array::<f32>::zeros(dev, N).unwrap();
        assert_eq!(stats(&outer).misses, 2);
        assert_eq!(stats(&inner).misses, 2);
        assert_eq!(
            stats(&inner).bytes_cached,
            2048,
            "inner exited: its buffers are free"
        );
    }

    fn one_name_entered_recursively(dev, name) {
        recurse(dev, name, 3);
        let first = stats(name);
        assert_eq!((first.misses, first.hits), (4, 0));
        assert_eq!(
            first.bytes_cached,
            4 * 1024,
            "free after the outermost exit"
        );
        recurse(dev, name, 3);
        let second = stats(name);
        assert_eq!((second.misses, second.hits), (4, 4));
        assert_eq!(gpucache::current_scope(), None);
    }

    fn invalidate_frees_free_lists_and_keeps_live_arrays_valid(dev, name) {
        let live = escaping_step(dev, name, 3.0);
        let s = stats(name);
        assert_eq!((s.bytes_in_use, s.bytes_cached), (1024, 1024));
        gpucache::invalidate(name);
        let s = stats(name);
        assert_eq!((s.bytes_in_use, s.bytes_cached), (1024, 0));
        assert_eq!((s.device_frees, s.invalidations), (1, 1));
        assert!(all_eq(&live, 3.0), "live arrays stay valid");
        drop(live);
        let s = stats(name);
        assert_eq!(
            (s.bytes_in_use, s.bytes_cached),
            (0, 0),
            "freed, not cached"
        );
        assert_eq!(s.device_frees, 2);
        // The next step allocates afresh.
        drop(escaping_step(dev, name, 4.0));
        assert_eq!(stats(name).misses, 4);
    }

    fn invalidate_inside_an_active_scope(dev, name) {
        let _scope = enter(name);
        drop(filled(dev, 1.0f32, N));
        assert_eq!(
            stats(name).bytes_in_use,
            1024,
            "dropped, waiting for the exit"
        );
        gpucache::invalidate(name);
        let s = stats(name);
        assert_eq!((s.bytes_in_use, s.bytes_cached, s.device_frees), (0, 0, 1));
    }

    fn panic_unwinding_restores_the_thread_and_arrays_come_home(dev, name) {
        let result = std::panic::catch_unwind(|| {
            let _scope = enter(name);
            let _a = filled(dev, 1.0f32, N);
            let _inner = enter("panic-inner");
            panic!("boom");
        });
        assert!(result.is_err());
        assert_eq!(
            gpucache::current_scope(),
            None,
            "the scope stack is restored"
        );
        let s = stats(name);
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 1024));
        let _scope = enter(name);
        let _b = Array::<f32>::zeros(dev, N).unwrap();
        assert_eq!(
            stats(name).hits,
            1,
            "the array dropped while unwinding is recycled"
        );
    }

    fn caches_are_per_thread(dev, name) {
        let worker = |steps: u64| {
            let name = name.to_owned();
            move || {
                for _ in 0..steps {
                    let _scope = enter(&name);
                    Array::<f32>::zeros(dev, N).unwrap();
                }
                stats(&name)
            }
        };
        let (a, b) = thread::scope(|s| {
            let a = s.spawn(worker(3));
            let b = s.spawn(worker(5));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert_eq!((a.misses, a.hits), (1, 2));
        assert_eq!((b.misses, b.hits), (1, 4));
        assert_eq!(
            stats(name),
            Default::default(),
            "this thread's cache is untouched"
        );
    }

    fn an_array_dropped_on_another_thread_returns_home(dev, name) {
        let escaped = escaping_step(dev, name, 9.0);
        let before = stats(name);
        thread::spawn(move || {
            assert!(all_eq(&escaped, 9.0));
            drop(escaped);
        })
        .join()
        .unwrap();
        let after = stats(name);
        assert_eq!(after.bytes_in_use, before.bytes_in_use - 1024);
        assert_eq!(after.bytes_cached, before.bytes_cached + 1024);
        let _scope = enter(name);
        let _a = Array::<f32>::zeros(dev, N).unwrap();
        let _b = Array::<f32>::zeros(dev, N).unwrap();
        assert_eq!(stats(name).hits, before.hits + 2, "both buffers recycled");
    }

    fn reuse_immediate_recycles_within_the_scope(dev, name) {
        let on_exit = format!("{name}/on-exit");
        for (cache, reuse, misses) in [(name, Reuse::Immediate, 1), (&*on_exit, Reuse::OnExit, 3)] {
            common::configure(cache, |c| c.reuse = reuse);
            let _scope = enter(cache);
            for _ in 0..3 {
                drop(Array::<f32>::zeros(dev, N).unwrap());
            }
            let s = stats(cache);
            assert_eq!((s.misses, s.hits), (misses, 3 - misses), "{reuse:?}");
        }
    }

    fn max_cached_bytes_evicts_least_recently_used(dev, name) {
        common::configure(name, |c| c.max_cached_bytes = Some(3 * 1024));
        let shapes = [[N, 1], [1, N], [N / 2, 2], [2, N / 2]];
        {
            let _scope = enter(name);
            for shape in shapes {
                Array::<f32>::zeros(dev, shape).unwrap(); // dropped in this order
            }
        }
        let s = stats(name);
        assert_eq!(
            (s.bytes_cached, s.evictions, s.device_frees),
            (3 * 1024, 1, 1)
        );
        let _scope = enter(name);
        let _survivors: Vec<_> = shapes[1..]
            .iter()
            .map(|&s| Array::<f32>::zeros(dev, s).unwrap())
            .collect();
        assert_eq!(stats(name).hits, 3, "the three most recent were kept");
        let _first = Array::<f32>::zeros(dev, shapes[0]).unwrap();
        assert_eq!(
            stats(name).misses,
            5,
            "the least recently freed was evicted"
        );
    }

    fn lowering_the_cap_evicts_at_once(dev, name) {
        {
            let _scope = enter(name);
            let _a = Array::<f32>::zeros(dev, N).unwrap();
            let _b = Array::<u8>::zeros(dev, N).unwrap();
        }
        assert_eq!(stats(name).bytes_cached, 1024 + 256);
        common::configure(name, |c| c.max_cached_bytes = Some(0));
        let s = stats(name);
        assert_eq!((s.bytes_cached, s.evictions), (0, 2));
    }

    fn size_classes_share_buffers_across_shapes_and_dtypes(dev, name) {
        common::configure(name, |c| c.key = KeyPolicy::SizeClass);
        {
            let _scope = enter(name);
            filled(dev, 1.0f32, 250); // 1000 bytes: class 1024
        }
        assert_eq!(stats(name).bytes_cached, 1024);
        let _scope = enter(name);
        let a = Array::<u8>::zeros(dev, [32, 32]).unwrap(); // 1024 bytes: class 1024
        assert_eq!(stats(name).hits, 1);
        assert_eq!(
            (a.shape().dims(), a.len(), a.num_bytes()),
            (&[32, 32][..], 1024, 1024)
        );
        assert!(all_eq(&a, 0));
        let _b = Array::<u8>::zeros(dev, 1500).unwrap(); // class 1536
        assert_eq!(stats(name).misses, 2);
    }

    fn changing_the_key_policy_invalidates(dev, name) {
        let live = escaping_step(dev, name, 2.0);
        common::configure(name, |c| c.key = KeyPolicy::SizeClass);
        let s = stats(name);
        // Emptied, but no call of `invalidate`: not counted as one.
        assert_eq!((s.bytes_cached, s.invalidations), (0, 0));
        assert!(all_eq(&live, 2.0));
        drop(live);
        assert_eq!(
            stats(name).bytes_cached,
            0,
            "old-generation buffers are freed"
        );
    }
}

#[test]
fn allocations_outside_any_scope_are_not_cached() {
    let _shared = common::shared();
    let (backend, _installed) = common::counting();
    assert_eq!(gpucache::current_scope(), None);
    for _ in 0..3 {
        let a = Array::<f32>::zeros(Device::Cpu, N).unwrap();
        assert_eq!(backend.outstanding_bytes(), 1024);
        drop(a);
        assert_eq!(backend.outstanding_bytes(), 0, "freed at once, not cached");
    }
    assert_eq!((backend.allocs(), backend.frees()), (3, 3));
}

fn recurse(dev: Device, name: &str, depth: usize) {
    let _scope = enter(name);
    let a = filled(dev, depth as f32, N);
    if depth > 0 {
        recurse(dev, name, depth - 1);
        assert_eq!(
            stats(name).bytes_cached,
            0,
            "inner exits do not free buffers"
        );
    }
    assert!(all_eq(&a, depth as f32), "a buffer was handed out twice");
}

#[test]
fn an_array_outliving_its_home_thread_is_freed_when_dropped() {
    let _shared = common::shared();
    let backend = CountingBackend::new();
    let escaped = thread::scope(|s| {
        s.spawn(|| {
            let _installed = use_backend(&backend);
            escaping_step(Device::Cpu, "orphan", 5.0)
        })
        .join()
        .unwrap()
    });
    assert_eq!(
        backend.outstanding_bytes(),
        1024,
        "the home thread's cache was released"
    );
    assert!(all_eq(&escaped, 5.0));
    drop(escaped);
    assert_eq!(backend.outstanding_bytes(), 0);
    assert_eq!(backend.allocs(), backend.frees());
}

#[test]
fn summary_lists_caches_of_every_thread() {
    let _shared = common::shared();
    let _scope = enter("summary-main");
    drop(Array::<f32>::zeros(Device::Cpu, N).unwrap());
    thread::Builder::new()
        .name("summary-worker".into())
        .spawn(|| {
            let _scope = enter("summary-worker-cache");
            drop(Array::<f32>::zeros(Device::Cpu, N).unwrap());
            let table = gpucache::summary();
            assert!(table.contains("summary-main"), "{table}");
            let row = table
                .lines()
                .find(|l| l.contains("summary-worker-cache"))
                .unwrap_or_else(|| panic!("{table}"));
            assert!(row.starts_with("summary-worker"), "{row}");
        })
        .unwrap()
        .join()
        .unwrap();
}

/// `Array` and `&Array` may cross `catch_unwind` without `AssertUnwindSafe`.
#[test]
fn arrays_are_unwind_safe() {
    fn unwind_safe<T: std::panic::UnwindSafe + std::panic::RefUnwindSafe>() {}
    unwind_safe::<Array<f32>>();
    unwind_safe::<Array<bool>>();
    unwind_safe::<&Array<u8>>();
    let _shared = common::shared();
    let a = Array::<f32>::zeros(Device::Cpu, 4).unwrap();
    let read = std::panic::catch_unwind(|| a.to_vec().unwrap());
    assert_eq!(read.unwrap(), [0.0; 4]);
    let moved = std::panic::catch_unwind(move || a.len());
    assert_eq!(moved.unwrap(), 4);
}

#[test]
fn new_memory_is_asked_zeroed_only_for_arrays_that_must_be() {
    let (backend, _installed) = common::counting();
    let zeroed = || backend.zeroed_allocs();
    // Outside any scope: each array's own buffer.
    let _any = Array::<f32>::empty(Device::Cpu, N).unwrap();
    let _copy = Array::from_slice(Device::Cpu, &[1u8, 2, 3], 3).unwrap();
    assert_eq!(
        zeroed(),
        0,
        "empty and from_slice leave new memory as it is"
    );
    let _z = Array::<f32>::zeros(Device::Cpu, N).unwrap();
    let _b = Array::<bool>::empty(Device::Cpu, N).unwrap();
    assert_eq!(zeroed(), 2, "zeros, and bools (not every byte is one)");
    // A planned cache's blocks reach their arrays as views: never zeroed as a whole, each array
    // that must be zeroes its own bytes.
    let name = "new-memory-zeroed-planned";
    common::configure(name, |c| c.key = KeyPolicy::Planned);
    for _ in 0..3 {
        let _scope = enter(name);
        let z = Array::<f32>::zeros(Device::Cpu, N).unwrap();
        let b = Array::<bool>::empty(Device::Cpu, N).unwrap();
        assert!(all_eq(&z, 0.0) && all_eq(&b, false));
    }
    assert!(
        stats(name).device_allocs >= 3,
        "solo blocks, then the plan's"
    );
    assert_eq!(zeroed(), 2, "no arena block asked zeroed");
    // A free-list cache's new buffer is the array's own.
    let name = "new-memory-zeroed-exact";
    common::configure(name, |c| c.key = KeyPolicy::Exact);
    let _scope = enter(name);
    let _z = Array::<f32>::zeros(Device::Cpu, N).unwrap();
    let _e = Array::<f32>::empty(Device::Cpu, 2 * N).unwrap();
    assert_eq!(zeroed(), 3);
    gpucache::invalidate("new-memory-zeroed-planned");
}

//! Failure paths: bad input gets typed errors; out of memory releases cached buffers, retries
//! once and then returns `Error::OutOfMemory`; nothing leaks.
//!
//! Tests that act on every thread's caches (out-of-memory recovery, `empty_cache`) take the
//! `serial()` lock, so that they cannot release each other's buffers mid-test.

use gpucache_suite::common;

use std::sync::{Arc, mpsc};
use std::thread;

use common::{all_eq, escaping_step, filled, serial};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Array, DType, Device, Error, Reuse, Shape, enter, stats};

common::device_tests! {
    fn shape_overflow_is_a_typed_error(dev, name) {
        let _scope = enter(name);
        let err = Array::<u8>::zeros(dev, [usize::MAX, 2]).unwrap_err();
        assert!(
            matches!(&err, Error::ShapeOverflow { dims, .. } if dims == &[usize::MAX, 2]),
            "{err:?}"
        );
        // The element count fits, the byte count does not.
        let err = Array::<f32>::empty(dev, [1 << 31, 1 << 31]).unwrap_err();
        assert!(matches!(err, Error::ShapeOverflow { .. }), "{err:?}");
        assert!(err.to_string().contains("too large"), "{err}");
        assert_eq!(stats(name).misses + stats(name).hits, 0);
        assert!(Shape::from([usize::MAX, usize::MAX]).numel().is_err());
    }

    fn length_mismatch_is_a_typed_error(dev, _name) {
        let err = Array::from_slice(dev, &[1.0f32; 5], [2, 3]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::LengthMismatch {
                    expected: 6,
                    got: 5,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains('5') && msg.contains('6'), "{msg}");
    }

    fn host_access_is_refused_for_device_memory_only(dev, _name) {
        let mut a = Array::<f32>::zeros(dev, 4).unwrap();
        if dev.is_cuda() {
            assert!(matches!(a.as_slice(), Err(Error::NotHostAccessible { .. })));
            assert!(matches!(
                a.as_mut_slice(),
                Err(Error::NotHostAccessible { .. })
            ));
        } else {
            assert_eq!(a.as_mut_slice().unwrap(), &[0.0; 4]);
        }
    }

    fn zero_size_arrays_work_and_touch_no_cache(dev, name) {
        let _scope = enter(name);
        let a = Array::<f32>::zeros(dev, [0, 5]).unwrap();
        assert!(a.is_empty());
        assert_eq!((a.len(), a.num_bytes()), (0, 0));
        assert_eq!(a.to_vec().unwrap(), Vec::<f32>::new());
        let b = Array::<u8>::from_slice(dev, &[], 0).unwrap();
        assert!(b.is_empty());
        assert_eq!(stats(name), Default::default());
        let scalar = Array::from_slice(dev, &[3i64], Shape::scalar()).unwrap();
        assert_eq!((scalar.len(), scalar.to_vec().unwrap()), (1, vec![3]));
    }
}

#[test]
fn shape_overflow_names_the_element_type() {
    let err = Array::<f32>::from_slice(Device::Cpu, &[], [usize::MAX / 2, 3]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ShapeOverflow {
                dtype: Some(DType::F32),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("of f32"), "{err}");
    let err = Shape::from([usize::MAX, 2]).numel().unwrap_err();
    assert!(
        matches!(err, Error::ShapeOverflow { dtype: None, .. }),
        "{err:?}"
    );
}

#[test]
fn the_largest_requests_are_shape_overflows_not_out_of_memory() {
    for bytes in [isize::MAX as usize, isize::MAX as usize - 10] {
        for init in 0..2 {
            let err = match init {
                0 => Array::<u8>::zeros(Device::Cpu, bytes).unwrap_err(),
                _ => Array::<u8>::empty(Device::Cpu, bytes).unwrap_err(),
            };
            assert!(
                matches!(
                    err,
                    Error::ShapeOverflow {
                        dtype: Some(DType::U8),
                        ..
                    }
                ),
                "{bytes}: {err:?}"
            );
        }
    }
}

#[test]
fn backend_guards_dropped_out_of_order_keep_the_right_backend() {
    let _serial = serial();
    let (a, b) = (CountingBackend::new(), CountingBackend::new());
    let guard_a = use_backend(&a);
    let guard_b = use_backend(&b);
    drop(guard_a); // out of order: b stays installed
    drop(Array::<u8>::zeros(Device::Cpu, 10).unwrap());
    assert_eq!((a.allocs(), b.allocs()), (0, 1));
    drop(guard_b); // now neither
    drop(Array::<u8>::zeros(Device::Cpu, 10).unwrap());
    assert_eq!((a.allocs(), b.allocs()), (0, 1));
    let guard_a = use_backend(&a);
    drop(Array::<u8>::zeros(Device::Cpu, 10).unwrap());
    assert_eq!((a.allocs(), b.allocs()), (1, 1));
    drop(guard_a);
}

#[test]
fn a_missing_gpu_is_a_typed_error() {
    let err = Array::<f32>::zeros(Device::Cuda(99), 4).unwrap_err();
    assert!(err.to_string().contains("cuda:99"), "{err}");
    assert!(Device::cuda(99).is_err());
}

#[test]
fn one_pebibyte_on_the_cpu_is_out_of_memory() {
    let _serial = serial();
    let err = Array::<u8>::zeros(Device::Cpu, 1usize << 50).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfMemory { device: Device::Cpu, requested, .. } if requested == 1 << 50
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("out of memory on cpu"), "{err}");
}

/// Caches three free 1 KiB buffers of distinct keys in `name`.
fn cache_three(name: &str) {
    let _scope = enter(name);
    for shape in [[256, 1], [1, 256], [16, 16]] {
        Array::<f32>::zeros(Device::Cpu, shape).unwrap();
    }
}

#[test]
fn a_failed_allocation_releases_the_cache_and_retries_once() {
    common::free_lists("retry");
    let _serial = serial();
    let (backend, _installed) = common::counting();
    cache_three("retry");
    assert_eq!(backend.outstanding_bytes(), 3 * 1024);
    backend.fail_nth(1);
    let a = filled(Device::Cpu, 1.0f32, 100);
    assert_eq!((backend.failures(), backend.attempts()), (1, 5));
    let s = stats("retry");
    assert_eq!(
        (s.bytes_cached, s.device_frees),
        (0, 3),
        "the cache was released"
    );
    assert_eq!(backend.outstanding_bytes(), 400);
    assert!(all_eq(&a, 1.0));
}

#[test]
fn out_of_memory_after_the_retry_is_a_typed_error_and_nothing_leaks() {
    let _serial = serial();
    let (backend, _installed) = common::counting();
    let live = escaping_step(Device::Cpu, "oom", 1.0);
    backend.fail_nth(1);
    backend.fail_nth(2);
    let err = {
        let _scope = enter("oom");
        Array::<f32>::zeros(Device::Cpu, 1024).unwrap_err()
    };
    match err {
        Error::OutOfMemory {
            device,
            requested,
            cached,
            in_use,
        } => {
            assert_eq!((device, requested), (Device::Cpu, 4096));
            assert_eq!((cached, in_use), (0, 1024), "only `live` is left");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(stats("oom").bytes_cached, 0);
    // The thread keeps working.
    let again = filled(Device::Cpu, 2.0f32, 1024);
    assert!(all_eq(&again, 2.0) && all_eq(&live, 1.0));
    drop((again, live));
    gpucache::invalidate("oom");
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
    assert_eq!(backend.allocs(), backend.frees());
}

#[test]
fn a_device_limit_is_met_by_releasing_the_cache() {
    common::free_lists("limit");
    let _serial = serial();
    let (backend, _installed) = common::counting();
    cache_three("limit");
    backend.set_limit(Some(4096));
    let _scope = enter("limit");
    let big = Array::<u8>::zeros(Device::Cpu, 2048).unwrap();
    assert_eq!(backend.failures(), 1);
    assert_eq!(backend.outstanding_bytes(), 2048);
    assert_eq!(stats("limit").device_frees, 3);
    assert_eq!(big.len(), 2048);
}

/// A worker thread's side of [`on_worker`]: `pause` hands control to the main thread and
/// waits until it is done.
struct Pause {
    to_main: mpsc::Sender<()>,
    from_main: mpsc::Receiver<()>,
}

impl Pause {
    fn pause(&self) {
        self.to_main.send(()).unwrap();
        self.from_main.recv().unwrap();
    }
}

/// Runs `worker` on a new thread with `backend` installed; when it calls `Pause::pause`, runs
/// `main` on this thread, then lets the worker finish. Returns what the worker returns. If
/// `main` panics, the worker's `pause` fails too, so nothing hangs.
fn on_worker<R: Send>(
    backend: &Arc<CountingBackend>,
    worker: impl FnOnce(&Pause) -> R + Send,
    main: impl FnOnce(),
) -> R {
    let (to_main, from_worker) = mpsc::channel();
    let (to_worker, from_main) = mpsc::channel();
    thread::scope(move |s| {
        let handle = s.spawn(move || {
            let _installed = use_backend(backend);
            worker(&Pause { to_main, from_main })
        });
        from_worker.recv().unwrap();
        main();
        to_worker.send(()).unwrap();
        handle.join().unwrap()
    })
}

#[test]
fn out_of_memory_releases_other_threads_caches() {
    let _serial = serial();
    let backend = CountingBackend::new();
    let worker_cached = on_worker(
        &backend,
        |pause| {
            cache_three("other-thread");
            pause.pause();
            stats("other-thread").bytes_cached
        },
        || {
            let _installed = use_backend(&backend);
            backend.set_limit(Some(4096));
            let a = Array::<u8>::zeros(Device::Cpu, 2048).unwrap();
            assert_eq!(backend.outstanding_bytes(), 2048);
            drop(a);
        },
    );
    assert_eq!(worker_cached, 0, "the worker's cache was released");
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn empty_cache_reaches_every_thread() {
    common::free_lists("idle");
    common::free_lists("busy");
    let _serial = serial();
    let backend = CountingBackend::new();
    let (busy_during, busy_after) = on_worker(
        &backend,
        |pause| {
            // An idle cache, released by `empty_cache` at once.
            drop(escaping_step(Device::Cpu, "idle", 1.0));
            // A cache inside a scope, released when the scope exits.
            common::configure("busy", |c| c.reuse = Reuse::Immediate);
            let scope = enter("busy");
            drop(Array::<u8>::zeros(Device::Cpu, 100).unwrap());
            pause.pause();
            let during = stats("busy").bytes_cached;
            drop(scope);
            (during, stats("busy").bytes_cached)
        },
        || {
            assert_eq!(backend.outstanding_bytes(), 2 * 1024 + 100);
            gpucache::empty_cache();
            assert_eq!(
                backend.outstanding_bytes(),
                100,
                "the idle cache was released"
            );
        },
    );
    assert_eq!(busy_during, 100, "busy: kept until its scope exits");
    assert_eq!(busy_after, 0, "released when the scope exited");
    assert_eq!(backend.outstanding_bytes(), 0);
}

//! Two GPUs: per-device caches, per-device out-of-memory recovery and statistics, device checks,
//! per-device current streams, and NCCL collectives on cached arrays (feature `nccl`).
//!
//! A libtest-mimic harness: the two-GPU tests are listed as ignored (after a notice) when fewer
//! than two CUDA GPUs are usable, and fail instead when `GPUCACHE_REQUIRE_GPUS=2` (or more) is
//! set; the others always run. Under `GPUCACHE_DISABLE=1` (caching off) the checks of hit counts
//! are left out.

use gpucache_suite::common;

use std::error::Error as StdError;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use gpucache::cuda::cudarc::driver::sys::{self as cu, CUpointer_attribute, CUresult};
use gpucache::cuda::cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DeviceSlice, LaunchConfig, PushKernelArg,
};
use gpucache::cuda::cudarc::nvrtc::compile_ptx;
use gpucache::nccl::{Comm, ReduceOp, UniqueId};
use gpucache::{Array, CacheConfig, Device, Error, KeyPolicy, Reuse, enter, stats};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

/// GPUs 0 and 1 with the lock that serialises this binary's tests (they compare device-wide
/// counters and fill a GPU), or `None` after a notice.
fn two_gpus() -> Option<(Device, Device, MutexGuard<'static, ()>)> {
    static LOCK: Mutex<()> = Mutex::new(());
    let devices = common::gpus(2)?;
    let guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    Some((devices[0], devices[1], guard))
}

fn ordinal(dev: Device) -> usize {
    match dev {
        Device::Cuda(n) => n,
        Device::Cpu => panic!("a CUDA device"),
    }
}

/// The device the driver says `a`'s memory is on, and the device of its buffer's stream.
fn where_is(a: &Array<f32>) -> (usize, usize) {
    let stream = Arc::clone(DeviceSlice::stream(a));
    let (ptr, _record) = a.device_ptr(&stream);
    let mut dev: i32 = -1;
    // SAFETY: DEVICE_ORDINAL writes one int through the pointer, which points at `dev`; `ptr`
    // is a live device allocation (the array is alive).
    let r = unsafe {
        cu::cuPointerGetAttribute(
            (&raw mut dev).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    (
        usize::try_from(dev).expect("an ordinal"),
        stream.context().ordinal(),
    )
}

fn current(dev: Device) -> Arc<CudaStream> {
    gpucache::cuda::current_stream(dev).expect("current stream")
}

fn a_device_past_the_last_gpu_is_a_typed_error() {
    if let Err(
        e @ (Error::CudaDriverNotFound { .. } | Error::CudaDeviceNotFound { count: 0, .. }),
    ) = Device::cuda(0)
    {
        assert!(common::gpus(1).is_none(), "no GPU, yet a GPU");
        eprintln!("notice: no CUDA driver or GPU: {e}");
        return;
    }
    // The driver is there (without it, cudarc's own call would panic): ask it directly.
    let count =
        usize::try_from(CudaContext::device_count().expect("device count")).expect("a count");
    for past in [count, count + 1, 1 << 20] {
        match Device::cuda(past) {
            Err(Error::CudaDeviceNotFound { device, count: c }) => {
                assert_eq!((device, c), (Device::Cuda(past), count));
            }
            other => panic!("Device::cuda({past}) with {count} GPUs gave {other:?}"),
        }
    }
    if count > 0 {
        assert_eq!(Device::cuda(count - 1).ok(), Some(Device::Cuda(count - 1)));
    }
}

fn a_buffer_is_never_served_to_another_device() -> TestResult {
    let Some((d0, d1, _gpu)) = two_gpus() else {
        return Ok(());
    };
    let n = 1 << 16;
    for (key, reuse) in [
        (KeyPolicy::Exact, Reuse::OnExit),
        (KeyPolicy::Exact, Reuse::Immediate),
        (KeyPolicy::SizeClass, Reuse::OnExit),
        (KeyPolicy::SizeClass, Reuse::Immediate),
    ] {
        let name = format!("mg-own-device-{key:?}-{reuse:?}");
        common::configure(&name, |c: &mut CacheConfig| {
            c.key = key;
            c.reuse = reuse;
        });
        let before = (gpucache::device_stats(d0)?, gpucache::device_stats(d1)?);
        for step in 0..4 {
            let _scope = enter(&name);
            // Same shape and type on both devices, the device-0 array dropped first, so that
            // its buffer is free (at once under Immediate) when device 1 asks.
            for (dev, value) in [(d0, step as f32), (d1, 100.0 + step as f32)] {
                let a = Array::from_slice(dev, &vec![value; n], n)?;
                assert_eq!(where_is(&a), (ordinal(dev), ordinal(dev)), "{name}");
                assert!(a.to_vec()?.iter().all(|&v| v == value));
                drop(a);
                let b = Array::<f32>::zeros(dev, n)?;
                assert_eq!(where_is(&b), (ordinal(dev), ordinal(dev)), "{name}");
            }
        }
        let after = (gpucache::device_stats(d0)?, gpucache::device_stats(d1)?);
        let s = stats(&name);
        if common::caching() {
            // Each device allocated its own buffers (one, or two under OnExit), never the other's.
            let per_device = if reuse == Reuse::Immediate { 1 } else { 2 };
            assert_eq!(after.0.allocs - before.0.allocs, per_device, "{name}");
            assert_eq!(after.1.allocs - before.1.allocs, per_device, "{name}");
            assert_eq!((s.misses, s.hits), (2 * per_device, 16 - 2 * per_device));
        }
        gpucache::invalidate(&name);
    }
    Ok(())
}

fn device_stats_are_per_device() -> TestResult {
    let Some((d0, d1, _gpu)) = two_gpus() else {
        return Ok(());
    };
    let (b0, b1) = (gpucache::device_stats(d0)?, gpucache::device_stats(d1)?);
    let on0: Vec<Array<f32>> = (0..3)
        .map(|_| Array::zeros(d0, 1000))
        .collect::<gpucache::Result<_>>()?;
    let on1 = Array::<f64>::zeros(d1, 10)?;
    let (m0, m1) = (gpucache::device_stats(d0)?, gpucache::device_stats(d1)?);
    assert_eq!((m0.allocs - b0.allocs, m1.allocs - b1.allocs), (3, 1));
    assert_eq!(m0.bytes_allocated - b0.bytes_allocated, 3 * 4000);
    assert_eq!(m1.bytes_allocated - b1.bytes_allocated, 80);
    drop(on1);
    let (e0, e1) = (gpucache::device_stats(d0)?, gpucache::device_stats(d1)?);
    assert_eq!((e0.frees - b0.frees, e1.frees - b1.frees), (0, 1));
    assert_eq!(e1.bytes_allocated, b1.bytes_allocated);
    drop(on0);
    let e0 = gpucache::device_stats(d0)?;
    assert_eq!(
        (e0.frees - b0.frees, e0.bytes_allocated),
        (3, b0.bytes_allocated)
    );
    Ok(())
}

fn out_of_memory_on_one_device_releases_only_that_devices_buffers() -> TestResult {
    let Some((d0, d1, _gpu)) = two_gpus() else {
        return Ok(());
    };
    if !common::caching() {
        return Ok(()); // nothing is cached to release
    }
    let gib = 1usize << 30;
    let name = "mg-oom";
    // Free lists: the buffers of a step stay cached after it (a planned cache's first step gives
    // its arrays back to the device as they drop).
    common::configure(name, |c: &mut CacheConfig| c.key = KeyPolicy::Exact);
    // Another thread caches a buffer on each device, then waits (idle, outside its scope).
    let (to_worker, worker_rx) = mpsc::channel::<()>();
    let (to_main, main_rx) = mpsc::channel::<gpucache::CacheStats>();
    let worker = std::thread::spawn(move || -> TestResult {
        {
            let _scope = enter(name);
            let _a = Array::<u8>::empty(d0, gib)?;
            let _b = Array::<u8>::empty(d1, gib)?;
        }
        to_main.send(stats(name))?;
        worker_rx.recv()?; // main ran out of memory meanwhile
        let _scope = enter(name);
        let _b = Array::<u8>::empty(d1, gib)?; // still cached: a hit
        to_main.send(stats(name))?;
        Ok(())
    });
    let worker_cached = main_rx.recv()?;
    assert_eq!(worker_cached.bytes_cached, 2 * gib);
    {
        let _scope = enter(name);
        let _a = Array::<u8>::empty(d0, gib)?;
        let _b = Array::<u8>::empty(d1, gib)?;
    }
    let (b0, b1) = (gpucache::device_stats(d0)?, gpucache::device_stats(d1)?);
    let (_, total0) = gpucache::cuda::mem_get_info(d0)?;
    let err = {
        let _scope = enter(name);
        Array::<u8>::empty(d0, 2 * total0).expect_err("more than the card has")
    };
    match err {
        Error::OutOfMemory {
            device, requested, ..
        } => assert_eq!((device, requested), (d0, 2 * total0)),
        other => panic!("expected Error::OutOfMemory, got {other:?}"),
    }
    let (a0, a1) = (gpucache::device_stats(d0)?, gpucache::device_stats(d1)?);
    // Device 0's two cached buffers (this thread's and the idle worker's) went back; device
    // 1's two stayed.
    assert_eq!(a0.frees - b0.frees, 2);
    assert_eq!(a0.bytes_allocated, b0.bytes_allocated - 2 * gib);
    assert_eq!(
        (a1.frees, a1.bytes_allocated),
        (b1.frees, b1.bytes_allocated)
    );
    assert_eq!(stats(name).bytes_cached, gib);
    {
        let _scope = enter(name);
        let before = stats(name).hits;
        let _b = Array::<u8>::empty(d1, gib)?;
        assert_eq!(
            stats(name).hits,
            before + 1,
            "device 1's buffer is still cached"
        );
    }
    to_worker.send(())?;
    let worker_after = main_rx.recv()?;
    assert_eq!(worker_after.hits, worker_cached.hits + 1);
    worker.join().expect("worker")?;
    gpucache::empty_cache();
    Ok(())
}

fn current_streams_are_per_device_and_per_thread() -> TestResult {
    let Some((d0, d1, _gpu)) = two_gpus() else {
        return Ok(());
    };
    let default0 = gpucache::cuda::default_stream(d0)?;
    let default1 = gpucache::cuda::default_stream(d1)?;
    let side0 = gpucache::cuda::context(d0)?.new_stream()?;
    let side1 = gpucache::cuda::context(d1)?.new_stream()?;
    let _on_side0 = gpucache::cuda::use_stream(&side0)?;
    assert_eq!(current(d0), side0);
    assert_eq!(
        current(d1),
        default1,
        "device 1 keeps its own current stream"
    );
    let a1 = Array::<f32>::zeros(d1, 16)?;
    assert_eq!(**DeviceSlice::stream(&a1), *default1);
    let a0 = Array::<f32>::zeros(d0, 16)?;
    assert_eq!(**DeviceSlice::stream(&a0), *side0);
    // A stream of device 1 set here changes device 1 only.
    let previous = gpucache::cuda::set_stream(&side1)?;
    assert_eq!(previous, default1);
    assert_eq!((current(d0), current(d1)), (side0.clone(), side1.clone()));
    // Another thread has its own current streams: the defaults, until it sets one.
    let (s0, s1, other) = std::thread::scope(|s| {
        s.spawn(|| -> gpucache::Result<_> {
            let (s0, s1) = (current(d0), current(d1));
            let other = gpucache::cuda::context(d1)?.new_stream()?;
            gpucache::cuda::set_stream(&other)?;
            Ok((s0, s1, other))
        })
        .join()
        .expect("thread")
    })?;
    assert_eq!((s0, s1), (default0, default1.clone()));
    assert_ne!(other, side1);
    assert_eq!(
        current(d1),
        side1,
        "the other thread's setting stayed there"
    );
    gpucache::cuda::set_stream(&default1)?;
    // A stream of one device is refused where an array of the other is marked.
    assert!(matches!(
        a1.record_stream(&side0),
        Err(Error::DeviceMismatch { expected, found }) if (expected, found) == (d1, d0)
    ));
    Ok(())
}

const KERNELS: &str = r#"
extern "C" __global__ void copy(float* y, const float* x, unsigned n) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = x[i];
}
"#;

/// The environment variable that makes the launch test run its child part.
const CHILD: &str = "GPUCACHE_TEST_FOREIGN_LAUNCH_CHILD";

/// Kernel launches cannot be refused with an error: cudarc's `PushKernelArg` gets no stream to
/// check against. A launch on device 0 that reads an array of device 1 is what CUDA makes of it:
/// the kernel faults (`CUDA_ERROR_ILLEGAL_ADDRESS`, and the context of device 0 is unusable
/// afterwards), or, where peer access is enabled, reads device 1's memory. The test runs that
/// launch in a child process and checks that the outcome is one of the two: an error, or the
/// right values, never other values and never a crash of the process.
fn a_launch_with_an_array_of_another_device_fails_cleanly_or_reads_it() -> TestResult {
    if std::env::var_os(CHILD).is_some() {
        return foreign_launch_child();
    }
    let Some((_, _, _gpu)) = two_gpus() else {
        return Ok(());
    };
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "a_launch_with_an_array_of_another_device_fails_cleanly_or_reads_it",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!(
        "child: {}",
        stdout
            .lines()
            .filter(|l| l.starts_with("outcome"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    assert!(out.status.success(), "the child failed: {out:?}");
    assert!(
        stdout.contains("outcome: error") || stdout.contains("outcome: read device 1's values"),
        "{stdout}"
    );
    Ok(())
}

fn foreign_launch_child() -> TestResult {
    let (d0, d1) = (Device::cuda(0)?, Device::cuda(1)?);
    let n = 1 << 20;
    let x1 = Array::from_slice(d1, &vec![7.0f32; n], n)?;
    let mut y0 = Array::<f32>::zeros(d0, n)?;
    gpucache::cuda::current_stream(d1)?.synchronize()?;
    let stream = current(d0);
    let module = gpucache::cuda::context(d0)?.load_module(compile_ptx(KERNELS)?)?;
    let copy = module.load_function("copy")?;
    let len = n as u32;
    let mut launch = stream.launch_builder(&copy);
    launch.arg(&mut y0).arg(&x1).arg(&len);
    // SAFETY: `copy` takes (float*, const float*, unsigned) and both arrays hold n floats; the
    // point of the test is that x1 lives on the other device.
    let launched = unsafe { launch.launch(LaunchConfig::for_num_elems(len)) };
    let outcome = launched.map(drop).and_then(|()| stream.synchronize());
    match outcome.map_err(Error::from).and_then(|()| y0.to_vec()) {
        Err(e) => println!("outcome: error {e}"),
        Ok(v) if v.iter().all(|&x| x == 7.0) => println!("outcome: read device 1's values"),
        Ok(v) => println!("outcome: wrong values, e.g. {}", v[0]),
    }
    // The context of device 0 may be broken: leave without tearing anything down.
    use std::io::Write as _;
    std::io::stdout().flush()?;
    std::process::exit(0);
}

/// Runs `f(rank, device, comm)` on one thread per GPU, with a communicator of both.
fn on_two_ranks(f: impl Fn(usize, Device, &Comm) -> TestResult + Sync) -> Option<TestResult> {
    let (d0, d1, _gpu) = two_gpus()?;
    let id = match UniqueId::new() {
        Ok(id) => id,
        Err(e) => return Some(Err(e.into())),
    };
    Some(std::thread::scope(|s| {
        let handles: Vec<_> = [d0, d1]
            .into_iter()
            .enumerate()
            .map(|(rank, dev)| {
                let f = &f;
                s.spawn(move || -> TestResult {
                    let comm = Comm::new(dev, rank, 2, &id)?;
                    assert_eq!(
                        (comm.rank(), comm.world_size(), comm.device()),
                        (rank, 2, dev)
                    );
                    let out = f(rank, dev, &comm);
                    current(dev).synchronize()?;
                    out
                })
            })
            .collect();
        // Join both ranks before reporting the first failure.
        let results: Vec<TestResult> = handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect();
        results.into_iter().collect()
    }))
}

fn collectives_work_on_cached_arrays_with_no_copy() -> TestResult {
    let Some(result) = on_two_ranks(|rank, dev, comm| {
        let name = "mg-nccl";
        let n = 4096;
        let mut grad_addr = None;
        for step in 0..4 {
            let _scope = enter(name);
            let v = (rank + 1) as f32 * (step + 1) as f32;
            let mut grad = Array::from_slice(dev, &vec![v; n], n)?;
            let addr = grad.device_ptr(&current(dev)).0;
            comm.all_reduce(&mut grad, ReduceOp::Sum)?;
            // The collective ran in the array's own buffer, the one the cache recycles.
            assert_eq!(grad.device_ptr(&current(dev)).0, addr);
            if common::caching() && step > 0 {
                assert_eq!(Some(addr), grad_addr, "the cached buffer came back");
            }
            grad_addr = Some(addr);
            let want = 3.0 * (step + 1) as f32; // ranks contribute 1x and 2x
            assert!(grad.to_vec()?.iter().all(|&x| x == want), "step {step}");

            let local = Array::from_slice(dev, &[rank as f64; 3], 3)?;
            let mut mean = Array::<f64>::empty(dev, 3)?;
            comm.all_reduce_into(&local, &mut mean, ReduceOp::Avg)?;
            assert_eq!(
                (mean.to_vec()?, local.to_vec()?),
                (vec![0.5; 3], vec![rank as f64; 3])
            );

            // Broadcast moves bytes: any element type, here one NCCL cannot reduce.
            let mut b = Array::from_slice(dev, &[rank as u16 * 10 + step as u16; 5], 5)?;
            comm.broadcast(&mut b, 1)?;
            assert_eq!(b.to_vec()?, [10 + step as u16; 5]);

            // An exchange: each rank sends to the other, grouped so neither waits first.
            let mine = Array::from_slice(dev, &[rank as i32; 7], 7)?;
            let mut theirs = Array::<i32>::zeros(dev, 7)?;
            gpucache::nccl::group(|| {
                comm.send(&mine, 1 - rank)?;
                comm.recv(&mut theirs, 1 - rank)
            })?;
            assert_eq!(theirs.to_vec()?, [1 - rank as i32; 7]);
        }
        if common::caching() {
            // Planned (the default): the first step's six arrays come from the device, the
            // second step's first from the plan's block, made then; every other is a hit.
            let s = stats(name);
            assert_eq!((s.misses, s.hits), (7, 17), "rank {rank}: {s}");
        }
        Ok(())
    }) else {
        return Ok(());
    };
    result
}

fn collectives_refuse_arrays_of_another_device_and_bad_ranks() -> TestResult {
    let Some(result) = on_two_ranks(|rank, dev, comm| {
        let other = Device::Cuda(1 - ordinal(dev));
        let mut foreign = Array::<f32>::zeros(other, 8)?;
        let mut own = Array::<f32>::zeros(dev, 8)?;
        let short = Array::<f32>::zeros(dev, 4)?;
        let mismatch = |r: gpucache::Result<()>| {
            matches!(r, Err(Error::DeviceMismatch { expected, found })
                if (expected, found) == (dev, other))
        };
        assert!(mismatch(comm.all_reduce(&mut foreign, ReduceOp::Sum)));
        assert!(mismatch(comm.all_reduce_into(
            &own,
            &mut foreign,
            ReduceOp::Sum
        )));
        assert!(mismatch(comm.broadcast(&mut foreign, 0)));
        assert!(mismatch(comm.send(&foreign, 1 - rank)));
        assert!(mismatch(comm.recv(&mut foreign, 1 - rank)));
        let mut cpu = Array::<f32>::zeros(Device::Cpu, 8)?;
        assert!(matches!(
            comm.all_reduce(&mut cpu, ReduceOp::Sum),
            Err(Error::DeviceMismatch {
                found: Device::Cpu,
                ..
            })
        ));
        assert!(matches!(
            comm.all_reduce_into(&short, &mut own, ReduceOp::Sum),
            Err(Error::ArrayLengthMismatch {
                expected: 4,
                found: 8
            })
        ));
        assert!(matches!(
            comm.send(&own, 2),
            Err(Error::RankOutOfRange {
                rank: 2,
                world_size: 2
            })
        ));
        assert!(matches!(
            comm.broadcast(&mut own, 5),
            Err(Error::RankOutOfRange {
                rank: 5,
                world_size: 2
            })
        ));
        // Nothing was enqueued: the ranks are still in step for a real collective.
        let mut ones = Array::from_slice(dev, &[1u32; 8], 8)?;
        comm.all_reduce(&mut ones, ReduceOp::Sum)?;
        assert_eq!(ones.to_vec()?, [2; 8]);
        Ok(())
    }) else {
        return Ok(());
    };
    result
}

fn a_collective_on_a_side_stream_orders_the_buffers_reuse() -> TestResult {
    let Some(result) = on_two_ranks(|rank, dev, comm| {
        let name = "mg-nccl-side";
        let side = gpucache::cuda::context(dev)?.new_stream()?;
        let n = 1 << 20;
        for step in 0..3 {
            let _scope = enter(name);
            // Allocated on the default stream, reduced on a side stream: the buffer is marked
            // as used there, and its reuse by the next step waits for the collective.
            let mut g = Array::from_slice(dev, &vec![(rank + step) as f32; n], n)?;
            {
                let _on_side = gpucache::cuda::use_stream(&side)?;
                comm.all_reduce(&mut g, ReduceOp::Max)?;
            }
            current(dev).join(&side)?; // reading on the default stream: after the collective
            assert!(g.to_vec()?.iter().all(|&x| x == (1 + step) as f32));
        }
        let s = stats(name);
        assert_eq!(s.hits + s.misses, if common::caching() { 3 } else { 0 });
        Ok(())
    }) else {
        return Ok(());
    };
    result
}

fn bad_ranks_and_ids_are_typed_errors_without_a_gpu() {
    let id = UniqueId::from_bytes([7; 128]);
    assert!(matches!(
        Comm::new(Device::Cuda(0), 2, 2, &id),
        Err(Error::RankOutOfRange {
            rank: 2,
            world_size: 2
        })
    ));
    let text = id.to_string();
    assert_eq!(text.len(), 256);
    assert_eq!(
        text.parse::<UniqueId>().expect("parses").to_bytes(),
        [7; 128]
    );
    for bad in ["", "07", &text[1..], &format!("{}zz", &text[2..])] {
        assert!(matches!(
            bad.parse::<UniqueId>(),
            Err(Error::InvalidUniqueId { len }) if len == bad.len()
        ));
    }
}

/// A test that needs two GPUs.
type TwoGpuTest = fn() -> TestResult;

/// The tests that need two GPUs.
const TWO_GPU_TESTS: &[(&str, TwoGpuTest)] = common::test_table![
    a_buffer_is_never_served_to_another_device,
    device_stats_are_per_device,
    out_of_memory_on_one_device_releases_only_that_devices_buffers,
    current_streams_are_per_device_and_per_thread,
    a_launch_with_an_array_of_another_device_fails_cleanly_or_reads_it,
    collectives_work_on_cached_arrays_with_no_copy,
    collectives_refuse_arrays_of_another_device_and_bad_ranks,
    a_collective_on_a_side_stream_orders_the_buffers_reuse,
];

/// The tests that need no GPU.
const HOST_TESTS: &[(&str, fn())] = common::test_table![
    a_device_past_the_last_gpu_is_a_typed_error,
    bad_ranks_and_ids_are_typed_errors_without_a_gpu,
];

fn main() {
    let mut args = libtest_mimic::Arguments::from_args();
    // The tests compare device-wide counters and fill a GPU: one at a time.
    args.test_threads = Some(1);
    let two = common::gpus(2).is_some();
    let mut trials: Vec<_> = TWO_GPU_TESTS
        .iter()
        .map(|&(name, test)| {
            libtest_mimic::Trial::test(name, move || test().map_err(|e| e.to_string().into()))
                .with_ignored_flag(!two)
        })
        .collect();
    trials.extend(
        HOST_TESTS
            .iter()
            .map(|&(name, test)| common::host_trial(name.into(), test)),
    );
    libtest_mimic::run(&args, trials).exit();
}

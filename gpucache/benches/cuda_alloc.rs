//! Allocation on a CUDA GPU: a gpucache hit against cudarc's default allocation
//! (`CudaStream::alloc`: `cuMemAllocAsync` from the device's default pool, freed with
//! `cuMemFreeAsync` on drop), for 1 KiB and 64 MiB buffers.
//!
//! Run on a machine with a GPU: `cargo bench -p gpucache --features cuda --bench cuda_alloc`
//! (without a GPU it prints a notice and measures nothing). Two variants each:
//!
//! * `*/alloc_drop`: allocate and drop, nothing else. The pool recycles cudarc's buffers too.
//! * `*/alloc_drop_sync`: the same followed by a stream synchronisation, as a training step
//!   ends: with the pool's default release threshold of 0, the synchronisation hands cudarc's
//!   freed memory back to the driver, so its next allocation maps memory again. gpucache keeps
//!   its buffer.
//!
//! And `step/*`: a step of 560 arrays (256 B to 16 KiB, each dropped eight allocations later, as
//! a chain of layers) in a warm cache, per array: `planned` (the default, `KeyPolicy::Planned`),
//! against `exact_immediate` (exact keys, `Reuse::Immediate`: a free-list hit, recycled at
//! once) and `exact_on_exit` (exact keys, recycled when the step ends: the default before
//! planned caches), on the GPU and on the CPU backend of the same host, to tell the planned path's
//! device-specific cost from its bookkeeping.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpucache::cuda::cudarc::driver::CudaStream;
use gpucache::{Array, CacheConfig, Device, KeyPolicy, Reuse};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

fn bench(c: &mut Criterion) {
    let (dev, stream) = match gpu() {
        Ok(found) => found,
        Err(e) => {
            eprintln!("notice: cuda_alloc measures nothing without a GPU: {e}");
            return;
        }
    };
    const SCOPE: &str = "bench_cuda_alloc";
    gpucache::configure(
        SCOPE,
        CacheConfig {
            reuse: Reuse::Immediate,
            key: gpucache::KeyPolicy::Exact,
            ..CacheConfig::default()
        },
    );
    let _scope = gpucache::enter(SCOPE);
    for (label, bytes) in [("1KiB", KIB), ("64MiB", 64 * MIB)] {
        let n = bytes / size_of::<f32>();
        let gpucache_alloc = || Array::<f32>::empty(dev, n).expect("allocation");
        // SAFETY: the buffer is never read.
        let cudarc_alloc = || unsafe { stream.alloc::<f32>(n) }.expect("allocation");
        drop(gpucache_alloc()); // the miss that fills the cache
        let before = gpucache::stats(SCOPE);
        let mut group = c.benchmark_group(format!("cuda_alloc/{label}"));
        group.warm_up_time(Duration::from_millis(500));
        group.bench_function("gpucache/alloc_drop", |b| {
            b.iter(|| black_box(gpucache_alloc()))
        });
        group.bench_function("cudarc/alloc_drop", |b| {
            b.iter(|| black_box(cudarc_alloc()))
        });
        group.bench_function("gpucache/alloc_drop_sync", |b| {
            b.iter(|| {
                drop(black_box(gpucache_alloc()));
                stream.synchronize().expect("synchronize");
            })
        });
        group.bench_function("cudarc/alloc_drop_sync", |b| {
            b.iter(|| {
                drop(black_box(cudarc_alloc()));
                stream.synchronize().expect("synchronize");
            })
        });
        group.finish();
        assert_eq!(
            gpucache::stats(SCOPE).misses,
            before.misses,
            "the gpucache benchmark missed the cache"
        );
    }
}

/// The arrays of one step of `bench_step`: 560, of 256 B to 16 KiB.
fn step_sizes() -> Vec<usize> {
    (0..560).map(|i| 256usize << (i % 7)).collect()
}

/// One step in cache `name`: the arrays of `sizes` on `dev`, each dropped eight later.
fn step(dev: Device, name: &str, sizes: &[usize]) {
    let _scope = gpucache::enter(name);
    let mut live = VecDeque::new();
    for &n in sizes {
        live.push_back(Array::<u8>::empty(dev, n).expect("allocation"));
        if live.len() > 8 {
            drop(live.pop_front());
        }
    }
}

fn bench_step(c: &mut Criterion) {
    let dev = match gpu() {
        Ok((dev, _)) => dev,
        Err(e) => {
            eprintln!("notice: cuda_alloc measures nothing without a GPU: {e}");
            return;
        }
    };
    let sizes = step_sizes();
    for (on, dev) in [("cuda", dev), ("cpu", Device::Cpu)] {
        let mut group = c.benchmark_group(format!("step/{on}"));
        group.throughput(Throughput::Elements(sizes.len() as u64));
        group.warm_up_time(Duration::from_millis(500));
        for (label, key, reuse) in [
            ("planned", KeyPolicy::Planned, Reuse::OnExit),
            ("exact_immediate", KeyPolicy::Exact, Reuse::Immediate),
            ("exact_on_exit", KeyPolicy::Exact, Reuse::OnExit),
        ] {
            let name = format!("bench_step_{on}_{label}");
            gpucache::configure(
                &name,
                CacheConfig {
                    key,
                    reuse,
                    ..CacheConfig::default()
                },
            );
            // Planned from the first steps; the free lists filled.
            for _ in 0..3 {
                step(dev, &name, &sizes);
            }
            let before = gpucache::stats(&name);
            group.bench_function(label, |b| b.iter(|| step(dev, &name, &sizes)));
            assert_eq!(
                gpucache::stats(&name).misses,
                before.misses,
                "{name}: a warm step missed the cache"
            );
            gpucache::invalidate(&name);
        }
        group.finish();
    }
}

/// CUDA device 0 and this thread's current stream on it.
fn gpu() -> gpucache::Result<(Device, Arc<CudaStream>)> {
    let dev = Device::cuda(0)?;
    Ok((dev, gpucache::cuda::current_stream(dev)?))
}

criterion_group!(benches, bench, bench_step);
criterion_main!(benches);

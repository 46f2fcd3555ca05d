//! The hit path: allocating and dropping an array whose buffer the cache already holds, against
//! the system allocator.
//!
//! Run with `cargo bench -p gpucache --bench hit_path` (add `-- --warm-up-time 1
//! --measurement-time 3` for a short run). Groups, each comparing like with like:
//!
//! * `empty/1KiB`, `empty/64MiB`: `Array::<f32>::empty` + drop inside a long-lived scope under
//!   `Reuse::Immediate` (so every allocation is a hit) vs `alloc_zeroed` + `dealloc` of the same
//!   size with the CPU backend's 64-byte alignment (`system`; for an alignment above 16 the
//!   standard library cannot use `calloc` and zeroes the buffer itself, touching every page) and
//!   vs `vec![0u8; n]` (`system_vec`: `calloc`, whose large buffers are fresh `mmap` pages,
//!   zeroed lazily by the kernel on first touch).
//! * `empty_touched/1KiB`, `empty_touched/64MiB`: the same, writing one byte per 4 KiB page
//!   before the drop: fresh memory from `mmap` faults on first touch, a recycled buffer does not.
//! * `zeros/1KiB`: `Array::<f32>::zeros` on a hit vs `alloc_zeroed`.
//! * `keys/1KiB`: the hit with 1 and with 10,000 distinct keys cached (the timed key is one of
//!   them); `keys/1KiB/10000-cycling` allocates all 10,000 keys in turn (time per allocation).
//! * `scope_cycle/1KiB`: `enter` + `empty` + drop + exit under the default `Reuse::OnExit`.
//! * `traced/1KiB`: `empty/1KiB`'s hit + drop while events are recorded (two per iteration).
//! * `bump/1KiB`: a planned cache's hit + drop (`KeyPolicy::Planned`) beside the free-list hit +
//!   drop (`KeyPolicy::Exact`, `Reuse::Immediate`), both in steps of [`BUMPS`] allocations, the
//!   enter and exit included.

use std::alloc::{self, Layout};
use std::hint::black_box;
use std::iter;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, criterion_group, criterion_main};
use gpucache::{Array, CacheConfig, Device, KeyPolicy, Reuse, Shape};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
const PAGE: usize = 4096;
/// The CPU backend's alignment.
const ALIGN: usize = 64;
/// 1 KiB of f32 as a 4-D shape, so that it is one of the keys of [`distinct_shapes`].
const HIT_SHAPE: [usize; 4] = [4, 4, 4, 4];

fn sizes() -> [(&'static str, usize); 2] {
    [("1KiB", KIB), ("64MiB", 64 * MIB)]
}

/// Configures the calling thread's cache `name` with `Reuse::Immediate` and enters it, so that
/// an allocation after an allocation + drop of the same key is a hit.
fn immediate_scope(name: &str) -> gpucache::ScopeGuard {
    gpucache::configure(
        name,
        CacheConfig {
            reuse: Reuse::Immediate,
            key: KeyPolicy::Exact,
            ..CacheConfig::default()
        },
    );
    gpucache::enter(name)
}

/// An `f32` array of `shape` from the current scope's cache.
fn empty(shape: impl Into<Shape>) -> Array<f32> {
    Array::<f32>::empty(Device::Cpu, shape).expect("allocation")
}

fn f32_shape(bytes: usize) -> [usize; 1] {
    [bytes / size_of::<f32>()]
}

/// Writes one byte in each 4 KiB page of `buf`, and keeps the writes from being optimised away.
fn touch_pages(buf: &mut [u8]) {
    for b in buf.iter_mut().step_by(PAGE) {
        *b = 1;
    }
    black_box(buf);
}

/// The bytes of a host array.
fn bytes_of(a: &mut Array<f32>) -> &mut [u8] {
    let elems = a.as_mut_slice().expect("host array");
    let len = size_of_val(elems);
    // SAFETY: the slice's memory is `len` initialised bytes, exclusively borrowed for the
    // lifetime of the result, and every bit pattern is a valid `u8` (and, written back, a valid
    // `f32`).
    unsafe { std::slice::from_raw_parts_mut(elems.as_mut_ptr().cast::<u8>(), len) }
}

/// A zeroed buffer from the system allocator, aligned like the CPU backend's, freed on drop.
struct SystemBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl SystemBuf {
    fn zeroed(bytes: usize) -> SystemBuf {
        let layout = Layout::from_size_align(bytes, ALIGN).expect("layout");
        // SAFETY: `bytes > 0` in every benchmark, so the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        SystemBuf { ptr, layout }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `layout.size()` zeroed (so initialised) bytes, exclusively borrowed
        // through `&mut self` for the lifetime of the result.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for SystemBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated by the global allocator with `layout` and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Runs `f` in a group named `name` that takes fewer samples for 64 MiB buffers (a system
/// allocation touched page by page takes milliseconds).
fn group(
    c: &mut Criterion,
    name: String,
    bytes: usize,
    f: impl FnOnce(&mut BenchmarkGroup<'_, WallTime>),
) {
    let mut group = c.benchmark_group(name);
    if bytes >= MIB {
        group.sample_size(20);
        group.warm_up_time(Duration::from_millis(500));
    }
    f(&mut group);
    group.finish();
}

/// Asserts that the scope's cache served every allocation since `before` from its free lists
/// (a benchmark filtered out on the command line made none).
fn assert_only_hits(scope: &str, before: gpucache::CacheStats) {
    let after = gpucache::stats(scope);
    assert_eq!(
        after.misses, before.misses,
        "{scope}: the benchmark missed the cache"
    );
}

/// `empty` + drop (optionally touching every page) vs `alloc_zeroed` + `dealloc`.
fn bench_empty(c: &mut Criterion) {
    const SCOPE: &str = "bench_empty";
    let _scope = immediate_scope(SCOPE);
    for touched in [false, true] {
        let prefix = if touched { "empty_touched" } else { "empty" };
        for (label, bytes) in sizes() {
            let shape = f32_shape(bytes);
            drop(empty(shape)); // the miss that fills the cache
            let before = gpucache::stats(SCOPE);
            group(c, format!("{prefix}/{label}"), bytes, |g| {
                g.bench_function("gpucache", |b| {
                    b.iter(|| {
                        let mut a = black_box(empty(shape));
                        if touched {
                            touch_pages(bytes_of(&mut a));
                        }
                    })
                });
                g.bench_function("system", |b| {
                    b.iter(|| {
                        let mut buf = black_box(SystemBuf::zeroed(bytes));
                        if touched {
                            touch_pages(buf.bytes());
                        }
                    })
                });
                g.bench_function("system_vec", |b| {
                    b.iter(|| {
                        let mut buf = black_box(vec![0u8; bytes]);
                        if touched {
                            touch_pages(&mut buf);
                        }
                    })
                });
            });
            assert_only_hits(SCOPE, before);
        }
    }
    gpucache::invalidate(SCOPE);
}

/// `zeros` on a hit vs `alloc_zeroed` + `dealloc`, 1 KiB.
fn bench_zeros(c: &mut Criterion) {
    const SCOPE: &str = "bench_zeros";
    let _scope = immediate_scope(SCOPE);
    let shape = f32_shape(KIB);
    let zeros = || Array::<f32>::zeros(Device::Cpu, shape).expect("allocation");
    drop(zeros());
    let before = gpucache::stats(SCOPE);
    group(c, "zeros/1KiB".into(), KIB, |g| {
        g.bench_function("gpucache", |b| b.iter(|| black_box(zeros())));
        g.bench_function("system", |b| b.iter(|| black_box(SystemBuf::zeroed(KIB))));
    });
    assert_only_hits(SCOPE, before);
    gpucache::invalidate(SCOPE);
}

/// `n` distinct 4-D `f32` shapes with dimensions in `1..=10`, [`HIT_SHAPE`] first.
fn distinct_shapes(n: usize) -> impl Iterator<Item = [usize; 4]> {
    let all = (0..10_000).map(|i| [i % 10 + 1, i / 10 % 10 + 1, i / 100 % 10 + 1, i / 1000 + 1]);
    iter::once(HIT_SHAPE)
        .chain(all.filter(|&s| s != HIT_SHAPE))
        .take(n)
}

/// The 1 KiB hit with 1 and with 10,000 distinct keys cached.
fn bench_keys(c: &mut Criterion) {
    group(c, "keys/1KiB".into(), KIB, |g| {
        for keys in [1, 10_000] {
            let scope = format!("bench_keys_{keys}");
            let _scope = immediate_scope(&scope);
            let shapes: Vec<_> = distinct_shapes(keys).collect();
            shapes.iter().for_each(|&s| drop(empty(s)));
            assert_eq!(gpucache::stats(&scope).misses, keys as u64);
            let before = gpucache::stats(&scope);
            g.bench_with_input(BenchmarkId::from_parameter(keys), &HIT_SHAPE, |b, &s| {
                b.iter(|| black_box(empty(s)))
            });
            if keys > 1 {
                let id = BenchmarkId::from_parameter(format!("{keys}-cycling"));
                g.bench_with_input(id, &shapes, |b, shapes| {
                    let mut next = shapes.iter().cycle();
                    b.iter(|| black_box(empty(*next.next().expect("cycle"))))
                });
            }
            assert_only_hits(&scope, before);
            gpucache::invalidate(&scope);
        }
    });
}

/// A whole step of the smallest kind: enter, allocate 1 KiB, drop, exit (`Reuse::OnExit`).
fn bench_scope_cycle(c: &mut Criterion) {
    const SCOPE: &str = "bench_scope_cycle";
    let shape = f32_shape(KIB);
    let step = || {
        let _scope = gpucache::enter(SCOPE);
        drop(black_box(empty(shape)));
    };
    step();
    let before = gpucache::stats(SCOPE);
    group(c, "scope_cycle/1KiB".into(), KIB, |g| {
        g.bench_function("enter_empty_drop_exit", |b| b.iter(step));
    });
    assert_only_hits(SCOPE, before);
    gpucache::invalidate(SCOPE);
}

/// The 1 KiB hit + drop of `empty/1KiB` while events are recorded (`gpucache::trace`): two events
/// per iteration (a hit and a drop back to the cache). Recording restarts every 100,000
/// iterations, outside the timed part, so that the buffer never fills.
fn bench_traced(c: &mut Criterion) {
    const SCOPE: &str = "bench_traced";
    let shape = f32_shape(KIB);
    let _scope = immediate_scope(SCOPE);
    drop(empty(shape));
    group(c, "traced/1KiB".into(), KIB, |g| {
        g.bench_function("empty_drop_recorded", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let n = left.min(100_000);
                    gpucache::trace::start().expect("nothing else records");
                    let start = std::time::Instant::now();
                    for _ in 0..n {
                        drop(black_box(empty(shape)));
                    }
                    total += start.elapsed();
                    let trace = gpucache::trace::stop().expect("recording");
                    assert_eq!(trace.dropped(), 0);
                    left -= n;
                }
                total
            })
        });
    });
    gpucache::invalidate(SCOPE);
}

/// Allocations per step in `bump/1KiB`.
const BUMPS: u64 = 1024;

/// An arena's bump + drop beside the free-list hit + drop, per allocation, in steps of
/// [`BUMPS`].
fn bench_bump(c: &mut Criterion) {
    let shape = f32_shape(KIB);
    let variants = [
        ("free_list_hit", "bench_bump_exact", KeyPolicy::Exact),
        ("arena_bump", "bench_bump_arena", KeyPolicy::Planned),
    ];
    group(c, "bump/1KiB".into(), KIB, |g| {
        for (label, scope, key) in variants {
            gpucache::configure(
                scope,
                CacheConfig {
                    reuse: Reuse::Immediate,
                    key,
                    ..CacheConfig::default()
                },
            );
            let steps = |n: u64| {
                let start = Instant::now();
                let mut left = n;
                while left > 0 {
                    let _scope = gpucache::enter(scope);
                    for _ in 0..left.min(BUMPS) {
                        drop(black_box(empty(shape)));
                    }
                    left = left.saturating_sub(BUMPS);
                }
                start.elapsed()
            };
            // Warm up: a block sized to a whole step, or the free list's buffer.
            steps(2 * BUMPS);
            let before = gpucache::stats(scope);
            g.bench_function(label, |b| b.iter_custom(steps));
            assert_only_hits(scope, before);
            gpucache::invalidate(scope);
        }
    });
}

criterion_group!(
    benches,
    bench_traced,
    bench_empty,
    bench_zeros,
    bench_keys,
    bench_scope_cycle,
    bench_bump
);
criterion_main!(benches);

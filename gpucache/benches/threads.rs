//! Thread scaling: N threads (1, 2, 4, 8, 16) each run a loop of enter + allocate + drop + exit
//! on a cache of the same name (one cache per thread), and the total rate is compared with N
//! times the one-thread rate. With the `cuda` feature and a GPU, the same loop on CUDA GPU 0 (each
//! thread on a stream of its own) runs beside `cuMemAllocAsync` + `cuMemFreeAsync` from the same
//! threads (cudarc's `CudaStream::alloc`), which is what an allocation costs without the cache.
//!
//! ```text
//! cargo bench -p gpucache --bench threads                   # CPU only
//! cargo bench -p gpucache --features cuda --bench threads   # and CUDA, on a machine with a GPU
//! GPUCACHE_BENCH_ROUNDS=9 GPUCACHE_BENCH_THREADS=1,2,4 ...  # rounds (default 7), thread counts
//! ```
//!
//! Variants and thread counts are interleaved in every round; the table gives the median rate
//! over the rounds and the median (min–max) of each round's efficiency, `rate(N) / (N × rate(1))`
//! from the same round. The numbers are only meaningful on a machine with at least as many idle
//! cores as threads.
//!
//! A baseline, `cpu arithmetic`, runs a chain of multiplies that touches no memory (about as
//! long as one cache iteration): its efficiency is what the machine itself gives N busy threads
//! (clock speed falls as more cores are busy). The last column divides each variant's
//! efficiency by the baseline's from the same round: below 1, the variant itself scales worse
//! than the cores do.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use gpucache::{Array, Device};

/// The scope every thread enters (each thread has its own cache of this name).
const SCOPE: &str = "bench-threads";
/// Elements of the array each iteration allocates: 1 KiB of `f32`.
const LEN: usize = 256;
/// How long each thread loops in one measurement.
const SPAN: Duration = Duration::from_millis(250);

/// One thing to measure.
#[derive(Clone, Copy, Debug)]
enum Variant {
    /// A chain of dependent multiplies, no memory: how the machine scales.
    Arithmetic,
    /// enter + `Array::empty` + drop + exit on `Device::Cpu`.
    CpuCache,
    /// The same on a CUDA device.
    #[cfg(feature = "cuda")]
    CudaCache(Device),
    /// `CudaStream::alloc` + drop: `cuMemAllocAsync` + `cuMemFreeAsync`, no cache.
    #[cfg(feature = "cuda")]
    CudaAllocAsync(Device),
}

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Arithmetic => "cpu arithmetic",
            Variant::CpuCache => "cpu gpucache",
            #[cfg(feature = "cuda")]
            Variant::CudaCache(_) => "cuda gpucache",
            #[cfg(feature = "cuda")]
            Variant::CudaAllocAsync(_) => "cuda cuMemAllocAsync",
        }
    }

    /// Runs iterations for [`SPAN`] after `start` opens; returns how many and how long.
    fn run_thread(self, start: &Barrier) -> (u64, Duration) {
        let step: Box<dyn Fn()> = match self {
            Variant::Arithmetic => Box::new(arithmetic),
            Variant::CpuCache => Box::new(|| cached_step(Device::Cpu)),
            #[cfg(feature = "cuda")]
            Variant::CudaCache(dev) => {
                own_stream(dev);
                Box::new(move || cached_step(dev))
            }
            #[cfg(feature = "cuda")]
            Variant::CudaAllocAsync(dev) => {
                let stream = own_stream(dev);
                // SAFETY: the buffer is never read.
                Box::new(move || drop(black_box(unsafe { stream.alloc::<f32>(LEN) }.unwrap())))
            }
        };
        step(); // warm: the cache's first miss, the stream's first allocation
        start.wait();
        let begin = Instant::now();
        let mut n = 0u64;
        while begin.elapsed() < SPAN {
            for _ in 0..256 {
                step();
            }
            n += 256;
        }
        (n, begin.elapsed())
    }
}

/// One iteration through the cache: enter, allocate (a hit), drop, exit.
fn cached_step(dev: Device) {
    let _scope = gpucache::enter(SCOPE);
    black_box(Array::<f32>::empty(dev, LEN).expect("allocation"));
}

/// About as long as [`cached_step`] on the CPU, with no memory traffic at all.
fn arithmetic() {
    let mut x = black_box(0x9E37_79B9_7F4A_7C15u64);
    for _ in 0..64 {
        x = x.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ (x >> 29);
    }
    black_box(x);
}

/// A new stream on `dev`, made the thread's current one.
#[cfg(feature = "cuda")]
fn own_stream(dev: Device) -> Arc<gpucache::cuda::cudarc::driver::CudaStream> {
    let stream = gpucache::cuda::context(dev)
        .and_then(|ctx| Ok(ctx.new_stream()?))
        .expect("stream");
    gpucache::cuda::set_stream(&stream).expect("set stream");
    stream
}

/// The total rate (iterations per second) of `threads` threads running `variant` at once.
fn measure(variant: Variant, threads: usize) -> f64 {
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let start = Arc::clone(&start);
            thread::spawn(move || variant.run_thread(&start))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            let (n, t) = h.join().expect("bench thread");
            n as f64 / t.as_secs_f64()
        })
        .sum()
}

/// The CPU variant, and the CUDA ones when this build and machine have a GPU.
fn variants() -> Vec<Variant> {
    #[cfg(feature = "cuda")]
    match Device::cuda(0) {
        Ok(dev) => {
            return vec![
                Variant::Arithmetic,
                Variant::CpuCache,
                Variant::CudaCache(dev),
                Variant::CudaAllocAsync(dev),
            ];
        }
        Err(e) => eprintln!("notice: CUDA variants skipped: {e}"),
    }
    vec![Variant::Arithmetic, Variant::CpuCache]
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `median (min-max)` of `v`.
fn spread(mut v: Vec<f64>) -> String {
    let m = median(&mut v);
    format!("{m:.2} ({:.2}-{:.2})", v[0], v[v.len() - 1])
}

fn env_list(var: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(var) {
        Ok(v) => v
            .split(',')
            .map(|x| x.trim().parse().expect("a number"))
            .collect(),
        Err(_) => default.to_vec(),
    }
}

fn main() {
    let rounds = env_list("GPUCACHE_BENCH_ROUNDS", &[7])[0];
    let counts = env_list("GPUCACHE_BENCH_THREADS", &[1, 2, 4, 8, 16]);
    let variants = variants();
    println!(
        "threads: {} cores available, {rounds} rounds, {:?} threads",
        thread::available_parallelism().map_or(0, |n| n.get()),
        counts
    );
    // rates[variant][count][round]
    let mut rates = vec![vec![Vec::new(); counts.len()]; variants.len()];
    for _ in 0..rounds {
        for (c, &n) in counts.iter().enumerate() {
            for (v, &variant) in variants.iter().enumerate() {
                rates[v][c].push(measure(variant, n));
            }
        }
    }
    println!(
        "{:<22} {:>7} {:>14} {:>10}  {:<28} vs arithmetic: median (min-max)",
        "variant", "threads", "Mops/s median", "per thread", "efficiency: median (min-max)",
    );
    // Efficiency of variant `v` at count `c` in round `r`; the baseline is variant 0.
    let eff = |v: usize, c: usize, r: usize| {
        rates[v][c][r] / (counts[c] as f64 * rates[v][0][r] / counts[0] as f64)
    };
    for (v, variant) in variants.iter().enumerate() {
        for (c, &n) in counts.iter().enumerate() {
            let own: Vec<f64> = (0..rounds).map(|r| eff(v, c, r)).collect();
            let relative: Vec<f64> = (0..rounds).map(|r| eff(v, c, r) / eff(0, c, r)).collect();
            let rate = median(&mut rates[v][c].clone()) / 1e6;
            println!(
                "{:<22} {:>7} {:>14.2} {:>10.2}  {:<28} {}",
                variant.label(),
                n,
                rate,
                rate / n as f64,
                spread(own),
                spread(relative)
            );
        }
    }
}

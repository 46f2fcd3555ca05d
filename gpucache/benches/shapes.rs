//! A variable-shape workload under each key policy: every step draws a batch size from 1..=64
//! and allocates four arrays of that many rows (as inference with a variable batch does), then
//! drops them as the step's scope exits.
//!
//! ```text
//! cargo bench -p gpucache --bench shapes                   # CPU
//! cargo bench -p gpucache --features cuda --bench shapes   # and CUDA GPU 0, when present
//! GPUCACHE_BENCH_ROUNDS=9 GPUCACHE_BENCH_STEPS=4000 ...    # rounds (default 7), steps per round
//! ```
//!
//! Policies: `exact` (`KeyPolicy::Exact`), `exact+cap` (the same with `max_cached_bytes` at twice
//! the largest step), `size-class` and `arena`. In every round each policy runs the same seeded
//! sequence of steps on a fresh cache, policies interleaved. The table gives, per policy:
//! device allocations over the round and in its second half (the steady state), the hit rate,
//! the cache's peak and final cached bytes against the largest step's bytes (the four arrays of
//! a 64-row step), and the median time per step of the second half with its range over rounds
//! (on CUDA each step ends with a stream synchronisation, as a training step does). The last
//! column is the median (min–max) over rounds of the ratio to `exact` in the same round.

use std::hint::black_box;
use std::time::{Duration, Instant};

use gpucache::{Array, CacheConfig, CacheStats, Device, KeyPolicy};

/// Rows of the four arrays of one step: `[b, 512]`, `[b, 512]`, `[b, 256]` f32 and `[b]` i64.
const MAX_BATCH: usize = 64;

/// The bytes of one step of batch `b`.
fn step_bytes(b: usize) -> usize {
    b * (512 + 512 + 256) * 4 + b * 8
}

#[derive(Clone, Copy)]
struct Policy {
    label: &'static str,
    key: KeyPolicy,
    capped: bool,
}

const POLICIES: [Policy; 4] = [
    Policy {
        label: "exact",
        key: KeyPolicy::Exact,
        capped: false,
    },
    Policy {
        label: "exact+cap",
        key: KeyPolicy::Exact,
        capped: true,
    },
    Policy {
        label: "size-class",
        key: KeyPolicy::SizeClass,
        capped: false,
    },
    Policy {
        label: "planned",
        key: KeyPolicy::Planned,
        capped: false,
    },
];

/// What one round of one policy measured.
struct Round {
    per_step: Duration,
    allocs: u64,
    steady_allocs: u64,
    stats: CacheStats,
}

fn env(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One step: four arrays of `b` rows, touched, dropped at the scope's exit.
fn step(dev: Device, scope: &str, b: usize, sync: &dyn Fn()) {
    let _scope = gpucache::enter(scope);
    let x = Array::<f32>::empty(dev, [b, 512]).expect("allocation");
    let h = Array::<f32>::empty(dev, [b, 512]).expect("allocation");
    let y = Array::<f32>::empty(dev, [b, 256]).expect("allocation");
    let labels = Array::<i64>::zeros(dev, [b]).expect("allocation");
    black_box((&x, &h, &y, &labels));
    sync();
}

fn run_round(
    dev: Device,
    policy: Policy,
    round: usize,
    batches: &[usize],
    sync: &dyn Fn(),
) -> Round {
    let scope = format!("shapes-{}-{dev}-{round}", policy.label);
    gpucache::configure(
        &scope,
        CacheConfig {
            key: policy.key,
            max_cached_bytes: policy.capped.then_some(2 * step_bytes(MAX_BATCH)),
            ..CacheConfig::default()
        },
    );
    let half = batches.len() / 2;
    for &b in &batches[..half] {
        step(dev, &scope, b, sync);
    }
    let mid = gpucache::stats(&scope);
    let start = Instant::now();
    for &b in &batches[half..] {
        step(dev, &scope, b, sync);
    }
    let per_step = start.elapsed() / (batches.len() - half) as u32;
    let stats = gpucache::stats(&scope);
    gpucache::invalidate(&scope);
    Round {
        per_step,
        allocs: stats.device_allocs,
        steady_allocs: stats.device_allocs - mid.device_allocs,
        stats,
    }
}

fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn mib(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / (1 << 20) as f64)
}

fn bench(dev: Device, sync: &dyn Fn()) {
    let rounds = env("GPUCACHE_BENCH_ROUNDS", 7).max(1);
    let steps = env("GPUCACHE_BENCH_STEPS", 2000).max(2);
    let mut rng = fastrand::Rng::with_seed(13);
    let batches: Vec<usize> = (0..steps).map(|_| rng.usize(1..=MAX_BATCH)).collect();
    let largest = step_bytes(*batches.iter().max().expect("steps"));
    let mut results: Vec<Vec<Round>> = POLICIES.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        // Interleaved: each policy once per round, in a rotating order.
        for i in 0..POLICIES.len() {
            let p = (i + round) % POLICIES.len();
            results[p].push(run_round(dev, POLICIES[p], round, &batches, sync));
        }
    }
    println!(
        "\n{dev}: {steps} steps of batch 1..={MAX_BATCH} (4 arrays), {rounds} rounds; largest step {}",
        mib(largest)
    );
    println!(
        "{:<11} {:>7} {:>7} {:>6} {:>11} {:>11} {:>8} {:>22} {:>20}",
        "policy",
        "allocs",
        "steady",
        "hits",
        "peak",
        "cached",
        "/step",
        "time per step",
        "vs exact"
    );
    for (p, rounds) in POLICIES.iter().zip(&results) {
        let times: Vec<f64> = rounds
            .iter()
            .map(|r| r.per_step.as_secs_f64() * 1e6)
            .collect();
        let ratios: Vec<f64> = rounds
            .iter()
            .zip(&results[0])
            .map(|(r, e)| r.per_step.as_secs_f64() / e.per_step.as_secs_f64())
            .collect();
        let last = &rounds[rounds.len() - 1];
        let (lo, hi) = (
            times.iter().copied().fold(f64::MAX, f64::min),
            times.iter().copied().fold(0.0, f64::max),
        );
        let (rlo, rhi) = (
            ratios.iter().copied().fold(f64::MAX, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
        );
        println!(
            "{:<11} {:>7} {:>7} {:>5.1}% {:>11} {:>11} {:>7.2}x {:>8.2} us ({:.2}-{:.2}) {:>6.2} ({:.2}-{:.2})",
            p.label,
            last.allocs,
            last.steady_allocs,
            last.stats.hit_rate() * 100.0,
            mib(last.stats.peak_bytes),
            mib(last.stats.bytes_cached),
            last.stats.bytes_cached as f64 / largest as f64,
            median(times.clone()),
            lo,
            hi,
            median(ratios.clone()),
            rlo,
            rhi,
        );
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is not used.
    bench(Device::Cpu, &|| {});
    #[cfg(feature = "cuda")]
    match Device::cuda(0) {
        Ok(dev) => {
            let stream = gpucache::cuda::current_stream(dev).expect("stream");
            bench(dev, &|| stream.synchronize().expect("synchronize"));
        }
        Err(e) => eprintln!("notice: CUDA part of the shapes bench skipped: {e}"),
    }
}

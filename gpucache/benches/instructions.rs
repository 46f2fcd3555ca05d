//! Instruction counts of the hot paths, for `valgrind --tool=callgrind` (deterministic, unlike
//! timings): `instructions hit N` runs N allocations + drops that hit the free list of a
//! `Reuse::Immediate` cache (`KeyPolicy::Exact`) inside one scope; `instructions scope N` runs N
//! whole scopes of one (`enter` + an allocation + drop + exit, `Reuse::OnExit`); `instructions planned N` runs N
//! allocations + drops served by the plan of a `KeyPolicy::Planned` cache, in steps of
//! [`STEP`] (the step's end amortised over them). The cost of one iteration is the
//! difference between the counts of two runs (say N = 100,000 and 200,000) divided by their
//! difference in N, so start-up cancels out:
//!
//! ```text
//! cargo bench -p gpucache --bench instructions --no-run   # prints the binary's path
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null BINARY hit 100000
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null BINARY hit 200000
//! ```
//!
//! Run without arguments (as `cargo bench` does), it runs each path once, briefly.

use std::hint::black_box;

use gpucache::{Array, CacheConfig, Device, KeyPolicy, Reuse};

/// Allocations per step of `planned`.
const STEP: usize = 1000;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (what, n) = match args.as_slice() {
        [what, n] => (what.as_str(), n.parse().expect("N: a number of iterations")),
        // `cargo bench` passes `--bench`: run both paths briefly.
        _ => ("both", 1000),
    };
    gpucache::configure(
        "instructions-hit",
        CacheConfig {
            reuse: Reuse::Immediate,
            key: KeyPolicy::Exact,
            ..CacheConfig::default()
        },
    );
    gpucache::configure(
        "instructions-scope",
        CacheConfig {
            key: KeyPolicy::Exact,
            ..CacheConfig::default()
        },
    );
    if matches!(what, "hit" | "both") {
        let _scope = gpucache::enter("instructions-hit");
        drop(Array::<f32>::empty(Device::Cpu, 256).expect("warm-up"));
        for _ in 0..n {
            let a = Array::<f32>::empty(black_box(Device::Cpu), black_box(256)).expect("hit");
            drop(black_box(a));
        }
    }
    if matches!(what, "planned" | "both") {
        gpucache::configure(
            "instructions-planned",
            CacheConfig {
                key: KeyPolicy::Planned,
                ..CacheConfig::default()
            },
        );
        // Two steps to record and make the plan, then n allocations in steps of `STEP`.
        for steps in [2, (n as usize).div_ceil(STEP)] {
            for _ in 0..steps {
                let _scope = gpucache::enter("instructions-planned");
                for _ in 0..STEP {
                    let a = Array::<f32>::empty(black_box(Device::Cpu), black_box(256))
                        .expect("planned");
                    drop(black_box(a));
                }
            }
        }
    }
    if matches!(what, "scope" | "both") {
        for _ in 0..n {
            let _scope = gpucache::enter(black_box("instructions-scope"));
            let a = Array::<f32>::empty(black_box(Device::Cpu), black_box(256)).expect("hit");
            drop(black_box(a));
        }
    }
}

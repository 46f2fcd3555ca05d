//! The GPU tests, in a harness of their own (libtest-mimic), so that a machine without a GPU
//! lists them as *ignored*, with the reason, instead of passing them silently:
//!
//! * `semantics::*` and `failures::*`: the device tests of `tests/all` (`common::device_tests!`)
//!   on CUDA device 0;
//! * `gpu::*`: GPU-level checks of the CUDA backend (`gpu.rs`), and a few checks of the CUDA
//!   API that need no GPU (they always run);
//! * `graph::*`: `StepGraph` capture and replay (`graph.rs`).
//!
//! `gpu::views_get_slices_only_with_a_second_stream` runs first, as `main` starts, whatever the
//! filter: it needs the device's context on one stream, and a test that makes a stream leaves
//! the context with several for the rest of the process.
//!
//! With `GPUCACHE_REQUIRE_GPU=1` a missing GPU fails the run instead. With `GPUCACHE_DISABLE=1`
//! (caching off, so that compute-sanitizer sees every buffer) the device tests of `tests/all`,
//! which check the cache's rules, and the graph tests, which capture cache hits, are listed as
//! ignored. The tests share one GPU and the out-of-memory tests need all of it, so they run one
//! at a time.

use gpucache_suite::common;

// The device tests of `tests/all` (`common::device_tests!`), compiled into this harness too. They
// are test cases, not library code: each file also holds CPU-only `#[test]`s, and a `#[test]` of
// the library would run only in the library's own unit-test binary, so the two test binaries
// share the files by inclusion. This harness has no libtest (`harness = false`), so the CPU-only
// `#[test]`s are not compiled here, which leaves their helpers and some imports unused.
#[allow(unused_imports, dead_code)]
#[path = "../all/failures.rs"]
mod failures;
#[allow(unused_imports, dead_code)]
#[path = "../all/semantics.rs"]
mod semantics;

mod gpu;
mod graph;

use libtest_mimic::Arguments;

fn main() {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let gpu = common::gpu();
    // Without caching (`GPUCACHE_DISABLE=1`, for compute-sanitizer) the cache's rules do not
    // hold: the device tests of `tests/all` are listed as ignored; `gpu.rs` adapts its checks.
    let caching = common::caching();
    if !caching {
        eprintln!(
            "notice: GPUCACHE_DISABLE: the device tests of tests/all and the graph tests are ignored"
        );
    }
    let mut trials = Vec::new();
    // First, before any test makes a stream: a context on one stream never goes back to it.
    let name = "gpu::views_get_slices_only_with_a_second_stream".to_owned();
    let first = match gpu {
        Ok(dev) if caching && !args.list => {
            let run = std::panic::catch_unwind(|| {
                gpu::views_get_slices_only_with_a_second_stream(dev).map_err(|e| e.to_string())
            });
            run.unwrap_or_else(|_| Err("panicked".to_owned()))
        }
        _ => Ok(()),
    };
    let trial = common::gpu_trial(name, &gpu, move |_| first.map_err(Into::into));
    trials.push(trial.with_ignored_flag(gpu.is_err() || !caching));
    for (module, tests) in [
        ("semantics", semantics::DEVICE_TESTS),
        ("failures", failures::DEVICE_TESTS),
    ] {
        for &(name, test) in tests {
            let trial = common::gpu_trial(format!("{module}::{name}"), &gpu, move |dev| {
                common::on_device(dev, name, test);
                Ok(())
            });
            trials.push(trial.with_ignored_flag(gpu.is_err() || !caching));
        }
    }
    for &(name, test) in gpu::TESTS {
        trials.push(common::gpu_trial(format!("gpu::{name}"), &gpu, test));
    }
    for &(name, test) in graph::TESTS {
        // A graph captures cache hits: without caching, steps only ever run eagerly.
        let trial = common::gpu_trial(format!("graph::{name}"), &gpu, test);
        trials.push(trial.with_ignored_flag(gpu.is_err() || !caching));
    }
    for &(name, test) in gpu::HOST_TESTS {
        trials.push(common::host_trial(format!("gpu::{name}"), test));
    }
    libtest_mimic::run(&args, trials).exit();
}

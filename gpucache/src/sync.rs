//! The atomics of the cross-thread protocol (a cache's lock and hints, `cache::lock`; the biased
//! view counts of arena blocks, `cache::arena::block`): std's, or under `cfg(loom)` loom's, so
//! that the loom model tests (`RUSTFLAGS="--cfg loom"`, see CONTRIBUTING.md) explore every
//! interleaving and every weak-memory outcome of that code, as crossbeam-epoch and tokio do.
//!
//! A normal build sees std's types under these names: the generated code is the same.
//! Under loom they exist only inside `loom::model` (made outside one, they panic), are not
//! `const`-constructible and have no `get_mut`; the code that uses them relies on none of that.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicUsize};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicUsize};

/// Runs the loom model `f` as `loom::model` does (every interleaving of its threads up to the
/// preemption bound, `LOOM_MAX_PREEMPTIONS`, here 3 if unset rather than none; `LOOM_LOG` and
/// the other `LOOM_*` variables as loom reads them), and prints how many executions loom
/// explored (seen with `--nocapture`).
#[cfg(all(test, loom))]
pub(crate) fn model(name: &str, f: impl Fn() + Sync + Send + 'static) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use tracing_subscriber::util::SubscriberInitExt;

    // `loom::model`'s logger: loom's trace of each execution, filtered by `LOOM_LOG`.
    let _log = tracing_subscriber::fmt::Subscriber::builder()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("LOOM_LOG"))
        .with_test_writer()
        .without_time()
        .finish()
        .set_default();
    // Std's counter, not loom's: it counts executions across the model's runs.
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = builder.preemption_bound.or(Some(3));
    let bound = builder.preemption_bound;
    let start = std::time::Instant::now();
    builder.check(move || {
        counted.fetch_add(1, Relaxed);
        f();
    });
    eprintln!(
        "loom model {name}: {} executions, preemption bound {bound:?}, {:.2?}",
        runs.load(Relaxed),
        start.elapsed()
    );
}

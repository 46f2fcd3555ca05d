//! The primitives of the cross-thread protocol, std's (and `parking_lot`'s), or under
//! `cfg(loom)` loom's, so that the loom model tests (`RUSTFLAGS="--cfg loom"`, see
//! CONTRIBUTING.md) explore every interleaving and every weak-memory outcome of that code, as
//! crossbeam-epoch and tokio do. Reached through here: a cache's lock and hints
//! (`cache::lock`), its flags, its state's cell and its remote side's mutex (`cache`,
//! `cache::remote`), the biased view counts of arena blocks (`cache::arena::block`), a thread's
//! list of caches and the exited threads' rows (`registry`), and the thread-local that numbers
//! threads (`thread`).
//!
//! A normal build sees std's and `parking_lot`'s types under these names: the generated code is
//! the same. Under loom they exist only inside `loom::model` (made outside one, they panic), are
//! not `const`-constructible and have no `get_mut`; the code that uses them relies on none of
//! that (a static is a `loom::lazy_static!` under loom).

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicUsize};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicUsize};

/// `thread_local!` with a `const` initialiser: std's, or loom's, whose values are per modelled
/// thread (loom runs every modelled thread on one OS thread, where std's would be shared; its
/// macro takes no `const` block, and initialises lazily).
#[cfg(not(loom))]
macro_rules! const_thread_local {
    ($(#[$attr:meta])* static $name:ident: $t:ty = $init:expr;) => {
        std::thread_local! {
            $(#[$attr])* static $name: $t = const { $init };
        }
    };
}

#[cfg(loom)]
macro_rules! const_thread_local {
    ($(#[$attr:meta])* static $name:ident: $t:ty = $init:expr;) => {
        loom::thread_local! {
            $(#[$attr])* static $name: $t = $init;
        }
    };
}

pub(crate) use const_thread_local;

/// A cell whose accesses a lock orders: `get` gives the raw pointer. Under loom, each `get` is
/// an access loom checks: it fails the model if nothing orders it after the previous access
/// from another thread (a data race).
#[cfg(not(loom))]
pub(crate) use std::cell::UnsafeCell;

/// A mutex: `parking_lot`'s, whose `lock` returns the guard (no poisoning).
#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;

/// `std::cell::UnsafeCell` under loom (see the std version).
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(loom::cell::UnsafeCell<T>);

#[cfg(loom)]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(value: T) -> UnsafeCell<T> {
        UnsafeCell(loom::cell::UnsafeCell::new(value))
    }

    /// The pointer, after loom has checked that this access is ordered after the previous ones
    /// (the caller keeps the pointer's use within what the lock orders, as with std's).
    pub(crate) fn get(&self) -> *mut T {
        self.0.with_mut(|p| p)
    }
}

/// `parking_lot::Mutex` under loom: loom's mutex, with `parking_lot`'s `lock` (the guard, no
/// poisoning: a panic fails the model anyway).
#[cfg(loom)]
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Mutex<T> {
        Mutex(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

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

/// Held by the unit tests that give back what every cache holds (`registry`'s) and by those
/// that count what one cache keeps across its steps (`tests`), which the former would empty
/// under them: the unit tests run on several threads at once.
#[cfg(test)]
static GLOBAL_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`GLOBAL_TESTS`] (whatever a failed test left in it) for the caller's test.
#[cfg(test)]
pub(crate) fn global_tests() -> std::sync::MutexGuard<'static, ()> {
    GLOBAL_TESTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

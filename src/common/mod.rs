//! Helpers shared by the integration tests (`tests/all`, and the GPU harnesses `tests/cuda` and
//! `tests/multi_gpu`).

pub mod pattern;

use std::cell::Cell;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use gpucache::{Array, CacheConfig, Device, Element, Shape, enter};

/// Declares tests that run on every device. Each `fn name(dev, cache) { body }` becomes
///
/// * a function `name(dev: Device, cache: &str)`, where `cache` is a cache name unique to the
///   test and the device;
/// * a `#[test]` `on_cpu::name` that runs it on `Device::Cpu` (holding [`shared`]);
/// * an entry of the module's `DEVICE_TESTS`, which the GPU harness (`tests/cuda`) runs on the
///   GPU, where it shows as ignored when there is no GPU.
///
/// A test binary reaches it as `common::device_tests!` after `use gpucache_suite::common;`.
#[macro_export]
#[doc(hidden)] // documented at its re-export, `common::device_tests!`
macro_rules! __device_tests {
    ($($(#[doc = $doc:literal])* fn $name:ident($dev:ident, $cache:ident) $body:block)*) => {
        $(
            $(#[doc = $doc])*
            pub fn $name($dev: gpucache::Device, $cache: &str) {
                // The rules of free lists (a test of another policy configures it itself).
                $crate::common::free_lists($cache);
                $body
            }
        )*

        /// Every device test of this module, for the GPU harness.
        #[allow(dead_code)] // the CPU binary runs them through `on_cpu`
        pub const DEVICE_TESTS: &[(&str, fn(gpucache::Device, &str))] =
            &[$((stringify!($name), $name)),*];

        mod on_cpu {
            $(
                #[test]
                fn $name() {
                    let cpu = gpucache::Device::Cpu;
                    $crate::common::on_device(cpu, stringify!($name), super::$name);
                }
            )*
        }
    };
}
#[doc(inline)]
pub use crate::__device_tests as device_tests;

/// A table of test functions by name, for a libtest-mimic harness: `test_table![a, b]` is
/// `&[("a", a), ("b", b)]`, so that each test is named once. (A test function left out of its
/// table is never called, and the compiler says so: dead code.)
///
/// A test binary reaches it as `common::test_table!` after `use gpucache_suite::common;`.
#[macro_export]
#[doc(hidden)] // documented at its re-export, `common::test_table!`
macro_rules! __test_table {
    ($($name:ident),* $(,)?) => {
        &[$((stringify!($name), $name)),*]
    };
}
#[doc(inline)]
pub use crate::__test_table as test_table;

/// Runs a test of [`device_tests!`] on `dev`, holding [`shared`].
pub fn on_device(dev: Device, test: &str, f: fn(Device, &str)) {
    let _shared = shared();
    f(dev, &format!("{test}@{dev}"));
}

/// A fresh counting backend, installed for `Device::Cpu` on this thread until the guard drops.
pub fn counting() -> (
    std::sync::Arc<gpucache::testing::CountingBackend>,
    gpucache::testing::BackendGuard,
) {
    let backend = gpucache::testing::CountingBackend::new();
    let installed = gpucache::testing::use_backend(&backend);
    (backend, installed)
}

/// What a GPU test returns.
pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// CUDA device 0, or why it cannot be used. With `GPUCACHE_REQUIRE_GPU=1` a missing GPU panics
/// (the GPU machine must never skip a GPU test).
pub fn gpu() -> Result<Device, String> {
    match Device::cuda(0) {
        Ok(dev) => Ok(dev),
        Err(e) => {
            assert!(
                std::env::var_os("GPUCACHE_REQUIRE_GPU").is_none_or(|v| v != "1"),
                "GPUCACHE_REQUIRE_GPU=1 but CUDA device 0 is not usable: {e}"
            );
            eprintln!("notice: the GPU tests are ignored: {e}");
            Err(e.to_string())
        }
    }
}

/// Whether caching is on. `GPUCACHE_DISABLE` turns it off (for compute-sanitizer) with any of
/// the values the crate docs name ("Turning caching off"); read here as the library reads it:
/// [`gpucache::summary`] then starts with the line `caching disabled`.
pub fn caching() -> bool {
    !gpucache::summary().starts_with("caching disabled")
}

/// A libtest-mimic trial that runs `test` on the GPU, or is listed as ignored without one.
pub fn gpu_trial(
    name: String,
    gpu: &Result<Device, String>,
    test: impl FnOnce(Device) -> TestResult + Send + 'static,
) -> libtest_mimic::Trial {
    match *gpu {
        Ok(dev) => libtest_mimic::Trial::test(name, move || test(dev).map_err(failed)),
        Err(_) => libtest_mimic::Trial::test(name, || Ok(())).with_ignored_flag(true),
    }
}

/// A libtest-mimic trial that needs no GPU.
pub fn host_trial(name: String, test: fn()) -> libtest_mimic::Trial {
    libtest_mimic::Trial::test(name, move || {
        test();
        Ok(())
    })
}

fn failed(e: Box<dyn std::error::Error>) -> libtest_mimic::Failed {
    format!("{e} ({e:?})").into()
}

/// The size class of `bytes > 0` as `KeyPolicy::SizeClass` documents it (a model of the docs,
/// not the crate's code): 512 bytes and below, then four classes per power of two (`2^k`,
/// `1.25·2^k`, `1.5·2^k`, `1.75·2^k`).
pub fn size_class(bytes: usize) -> usize {
    (9..usize::BITS - 1)
        .flat_map(|k| (4..8).map(move |m| m << (k - 2)))
        .find(|&c| c >= bytes)
        .expect("test sizes are small")
}

/// An array of `shape` on `dev` with every element `value`.
pub fn filled<T: Element>(dev: Device, value: T, shape: impl Into<Shape>) -> Array<T> {
    let shape = shape.into();
    let n = shape.numel().expect("test shapes are small");
    Array::from_slice(dev, &vec![value; n], shape).expect("allocation")
}

/// Whether every element of `a` is `value`.
pub fn all_eq<T: Element + PartialEq>(a: &Array<T>, value: T) -> bool {
    a.to_vec()
        .expect("copy to host")
        .iter()
        .all(|&x| x == value)
}

/// The host address of a CPU array's buffer (to check which buffer an array got).
pub fn addr<T: Element>(a: &Array<T>) -> usize {
    a.as_slice().expect("host array").as_ptr() as usize
}

/// A step of cache `name` that uses a scratch array (freed at the scope's exit) and returns an
/// array of `N_ESCAPE` elements holding `value`, which escapes the scope.
pub fn escaping_step(dev: Device, name: &str, value: f32) -> Array<f32> {
    let _scope = enter(name);
    let scratch = filled(dev, -1.0f32, N_ESCAPE);
    drop(scratch);
    filled(dev, value, N_ESCAPE)
}

/// Elements of the arrays of [`escaping_step`]: 1 KiB of `f32`.
pub const N_ESCAPE: usize = 256;

/// Held by the tests of a binary that act on every thread's caches (`empty_cache`,
/// out-of-memory recovery, whole-process readings): no other test of the binary that holds
/// [`shared`] runs meanwhile.
pub fn serial() -> Exclusive {
    let guard = GLOBAL
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    EXCLUSIVE.with(|e| e.set(true));
    Exclusive { _guard: guard }
}

/// Held by tests that check what their own caches hold, so that no [`serial`] test releases
/// them meanwhile. Free on a thread that holds [`serial`].
pub fn shared() -> Option<RwLockReadGuard<'static, ()>> {
    if EXCLUSIVE.with(Cell::get) {
        return None;
    }
    Some(
        GLOBAL
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner()),
    )
}

static GLOBAL: RwLock<()> = RwLock::new(());

thread_local! {
    /// Whether this thread holds [`serial`].
    static EXCLUSIVE: Cell<bool> = const { Cell::new(false) };
}

/// The guard of [`serial`].
pub struct Exclusive {
    _guard: RwLockWriteGuard<'static, ()>,
}

impl Drop for Exclusive {
    fn drop(&mut self) {
        EXCLUSIVE.with(|e| e.set(false));
    }
}

/// Configures cache `name` (on every thread): free lists with exact keys (`KeyPolicy::Exact`,
/// the rules most tests check; the default is `KeyPolicy::Planned`) and the default reuse and
/// cap, changed by `set`.
pub fn configure(name: &str, set: impl FnOnce(&mut CacheConfig)) {
    let mut config = CacheConfig {
        key: gpucache::KeyPolicy::Exact,
        ..CacheConfig::default()
    };
    set(&mut config);
    gpucache::configure(name, config);
}

/// Makes cache `name` one of free lists with exact keys and the default reuse ([`configure`]).
pub fn free_lists(name: &str) {
    configure(name, |_| {});
}

/// A seeded generator for the stress and fault tests.
pub type Rng = fastrand::Rng;

/// One of `items`, uniformly.
pub fn pick<'a, T>(rng: &mut Rng, items: &'a [T]) -> &'a T {
    &items[rng.usize(..items.len())]
}

/// Runs the ignored test `test` (its full name) of this test binary alone in a child process,
/// with `env` set (and `GPUCACHE_TRACE` removed, so a recording of the parent's never follows
/// it), its output captured; returns the child's standard error. A failing child fails the
/// caller with `what` and the child's output.
pub fn run_child(test: &str, env: &[(&str, &str)], what: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            test,
            "--test-threads=1",
            "--include-ignored",
            "--nocapture",
        ])
        .env_remove("GPUCACHE_TRACE")
        .envs(env.iter().copied())
        .output()
        .expect("the test binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// A number from the environment variable `var`, or `default` when it is unset.
pub fn env_or(var: &str, default: usize) -> usize {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{var}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// CUDA GPUs 0..n, or `None` (after a notice) when this machine has fewer. With
/// `GPUCACHE_REQUIRE_GPUS=n` (or more) set, fewer GPUs is a failure instead.
#[cfg(feature = "cuda")]
pub fn gpus(n: usize) -> Option<Vec<Device>> {
    let found: Result<Vec<Device>, gpucache::Error> = (0..n).map(Device::cuda).collect();
    match found {
        Ok(devices) => Some(devices),
        Err(e) => {
            let required = std::env::var("GPUCACHE_REQUIRE_GPUS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            assert!(
                required < n,
                "GPUCACHE_REQUIRE_GPUS={required} but {n} CUDA devices are not usable: {e}"
            );
            eprintln!("notice: the {n}-GPU tests are ignored: {e}");
            None
        }
    }
}

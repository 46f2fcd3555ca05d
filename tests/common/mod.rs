//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses a different subset

pub mod pattern;

use std::sync::{Mutex, MutexGuard, Once};

use gpucache::{Array, CacheConfig, Device, Element, Shape, enter};

/// The devices a device-generic test runs on: the CPU, and CUDA GPU 0 when this build has the
/// `cuda` feature and a GPU is present. With `GPUCACHE_REQUIRE_GPU=1` a missing GPU is a test
/// failure instead of a skip.
pub fn devices() -> Vec<Device> {
    static NOTICE: Once = Once::new();
    match Device::cuda(0) {
        Ok(gpu) => vec![Device::Cpu, gpu],
        Err(e) => {
            assert!(
                std::env::var_os("GPUCACHE_REQUIRE_GPU").is_none_or(|v| v != "1"),
                "GPUCACHE_REQUIRE_GPU=1 but CUDA device 0 is not usable: {e}"
            );
            NOTICE.call_once(|| eprintln!("notice: GPU variants of the tests skipped: {e}"));
            vec![Device::Cpu]
        }
    }
}

/// Runs `test` once per device of [`devices`], with a cache name unique to the test and the
/// device (tests of one binary may share a thread when run with `--test-threads=1`).
pub fn for_each_device(test: &str, f: impl Fn(Device, &str)) {
    for dev in devices() {
        let name = format!("{test}@{dev}");
        f(dev, &name);
    }
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

/// Serialises the tests of one binary that act on every thread's caches.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Configures the calling thread's cache `name`: the default options, changed by `set`.
pub fn configure(name: &str, set: impl FnOnce(&mut CacheConfig)) {
    let mut config = CacheConfig::default();
    set(&mut config);
    gpucache::configure(name, config);
}

/// A seeded generator for the stress and fault tests.
pub type Rng = fastrand::Rng;

/// One of `items`, uniformly.
pub fn pick<'a, T>(rng: &mut Rng, items: &'a [T]) -> &'a T {
    &items[rng.usize(..items.len())]
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
/// `GPUCACHE_REQUIRE_GPUS=n` (or more) set, fewer GPUs is a test failure instead of a skip.
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
            eprintln!("notice: {n}-GPU test skipped: {e}");
            None
        }
    }
}

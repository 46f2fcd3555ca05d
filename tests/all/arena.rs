//! Arena caches (`KeyPolicy::Arena`) on the CPU backend: one bump-allocated block per scope,
//! free together at the scope's exit; escaped arrays keep their block; overflow, spares, the
//! byte cap, invalidation, `empty_cache` and out-of-memory recovery.
//!
//! Each test counts device allocations with its own `CountingBackend`, so tests that act on
//! every thread's caches (`empty_cache`, out-of-memory recovery) run one at a time (`serial()`).

use crate::common;

use std::sync::Arc;
use std::thread;

use common::{addr, configure, filled, serial};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Array, Device, KeyPolicy};

const DEV: Device = Device::Cpu;

/// A fresh counting backend installed on this thread, and cache `name` made an arena.
fn arena(
    name: &str,
    cap: Option<usize>,
) -> (Arc<CountingBackend>, gpucache::testing::BackendGuard) {
    let backend = CountingBackend::new();
    let guard = use_backend(&backend);
    configure(name, |c| {
        c.key = KeyPolicy::Arena;
        c.max_cached_bytes = cap;
    });
    (backend, guard)
}

/// One step of a variable-shape loop: `rows` rows of three arrays of different types.
fn step(name: &str, rows: usize) -> Vec<usize> {
    let _scope = gpucache::enter(name);
    let a = Array::<f32>::zeros(DEV, [rows, 64]).unwrap();
    let b = Array::<u8>::empty(DEV, [rows, 3]).unwrap();
    let c = filled(DEV, 7i64, [rows]);
    assert!(common::all_eq(&a, 0.0) && common::all_eq(&c, 7));
    vec![addr(&a), addr(&b), addr(&c)]
}

/// Bytes of [`step`] with `rows` rows, each array rounded up to 256.
fn step_bytes(rows: usize) -> usize {
    let up = |b: usize| b.div_ceil(256) * 256;
    up(rows * 256) + up(rows * 3) + up(rows * 8)
}

#[test]
fn one_block_serves_every_shape_after_the_largest_step() {
    let _serial = serial();
    let name = "arena-steady";
    let (backend, _installed) = arena(name, None);
    // The first step does not know its size: it grows into a second block (twice as large).
    step(name, 64);
    assert_eq!(backend.allocs(), 2);
    // Then one block sized to that step serves every step, from its start.
    let first = step(name, 64);
    assert_eq!(backend.allocs(), 3);
    assert_eq!(
        backend.outstanding_bytes(),
        step_bytes(64),
        "the first two were freed"
    );
    // Every array in one block, at 256-byte aligned offsets, in order.
    assert_eq!(first[1] - first[0], 64 * 256);
    assert_eq!(first[2] - first[1], 256);
    assert_eq!(first[0] % 64, 0);
    for rows in [1, 17, 64, 3, 40, 63, 2] {
        let addrs = step(name, rows);
        assert_eq!(addrs[0], first[0], "the bump pointer was reset at the exit");
        assert_eq!(addrs[1] - addrs[0], (rows * 256).div_ceil(256) * 256);
    }
    assert_eq!(
        backend.allocs(),
        3,
        "no device allocation after the largest step"
    );
    let s = gpucache::stats(name);
    assert_eq!((s.misses, s.hits), (3, 3 * 9 - 3), "{s}");
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, step_bytes(64)), "{s}");
    assert_eq!((s.device_allocs, s.device_frees), (3, 2));
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn constructors_keep_their_guarantees_on_a_reused_block() {
    let _serial = serial();
    let name = "arena-init";
    let (_backend, _installed) = arena(name, None);
    for round in 0..3u8 {
        let _scope = gpucache::enter(name);
        // Dirty the block with nonzero bytes everywhere the next arrays will be.
        let mut dirt = Array::<u8>::zeros(DEV, 4096).unwrap();
        assert!(common::all_eq(&dirt, 0), "round {round}: zeros");
        dirt.as_mut_slice().unwrap().fill(0xAB);
        let flags = Array::<bool>::empty(DEV, 1000).unwrap();
        assert!(
            common::all_eq(&flags, false),
            "bool arrays start valid (false)"
        );
        let data: Vec<f32> = (0..300).map(|i| i as f32).collect();
        let copy = Array::from_slice(DEV, &data, [300]).unwrap();
        assert_eq!(copy.to_vec().unwrap(), data);
        // The next round's `zeros` lands where `dirt` was.
    }
}

#[test]
fn an_escaped_array_keeps_its_block_and_is_never_overwritten() {
    let _serial = serial();
    let name = "arena-escape";
    let (backend, _installed) = arena(name, None);
    let two = |value: f32| {
        let _scope = gpucache::enter(name);
        let _scratch = filled(DEV, 1.0f32, 256);
        filled(DEV, value, 256)
    };
    drop(two(0.0)); // sizes the block: 2 KiB
    let allocs = backend.allocs();
    let escaped = two(42.0);
    assert_eq!(backend.allocs(), allocs, "the sized block served the step");
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_in_use, s.bytes_cached), (2048, 0), "{s}");
    for _ in 0..3 {
        let _scope = gpucache::enter(name);
        let a = filled(DEV, -1.0f32, 256);
        let b = filled(DEV, -2.0f32, 256);
        let apart = |x: usize, y: usize| x + 1024 <= y || y + 1024 <= x;
        assert!(apart(addr(&a), addr(&escaped)) && apart(addr(&b), addr(&escaped)));
    }
    assert!(
        common::all_eq(&escaped, 42.0),
        "later steps wrote over an escaped array"
    );
    assert_eq!(
        backend.allocs(),
        allocs + 1,
        "one new block for every later step"
    );
    drop(escaped);
    // The old block came back as a spare.
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 4096), "{s}");
    let frees = s.device_frees;
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_cached, s.device_frees), (0, frees + 2), "{s}");
}

#[test]
fn escaped_arrays_dropped_on_other_threads_send_their_block_home() {
    let _serial = serial();
    let name = "arena-threads";
    let (backend, _installed) = arena(name, None);
    step_of(name, 8);
    step_of(name, 8); // one block of 8 x 256 bytes now
    let allocs = backend.allocs();
    let escaped: Vec<Array<u8>> = {
        let _scope = gpucache::enter(name);
        (0..8).map(|i| filled(DEV, i as u8, 100)).collect()
    };
    let block = 8 * 256;
    // Half dropped on one thread, half on another; the block comes back after the last.
    let mut halves = escaped;
    let second = halves.split_off(4);
    thread::spawn(move || drop(halves)).join().unwrap();
    let s = gpucache::stats(name);
    assert_eq!(
        s.bytes_in_use, block,
        "four arrays still use the block: {s}"
    );
    thread::spawn(move || drop(second)).join().unwrap();
    // `stats` takes the returned block in: a spare now.
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, block), "{s}");
    // The next step bumps from it: no device allocation.
    step_of(name, 8);
    assert_eq!(backend.allocs(), allocs);
}

/// A step of `n` arrays of 100 bytes.
fn step_of(name: &str, n: usize) {
    let _scope = gpucache::enter(name);
    let _arrays: Vec<_> = (0..n)
        .map(|_| Array::<u8>::zeros(DEV, 100).unwrap())
        .collect();
}

#[test]
fn arrays_dropped_on_another_thread_during_the_step_do_not_retire_the_block() {
    let _serial = serial();
    let name = "arena-in-step";
    let (backend, _installed) = arena(name, None);
    let mut allocs = Vec::new();
    for _ in 0..4 {
        let _scope = gpucache::enter(name);
        let a = filled(DEV, 1u8, 1000);
        let b = filled(DEV, 2u8, 1000);
        thread::spawn(move || drop((a, b))).join().unwrap();
        allocs.push(backend.allocs());
    }
    // Two blocks for the first step (the second, twice as large, is the step's size and
    // stays), and none after: the drops on the other thread left no array of the block alive.
    assert_eq!(allocs, [2, 2, 2, 2]);
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 2048), "{s}");
}

#[test]
fn a_step_that_overflows_is_served_by_extra_blocks_then_one_block_sized_to_it() {
    let _serial = serial();
    let name = "arena-grow";
    let (backend, _installed) = arena(name, None);
    step(name, 4);
    step(name, 4);
    assert_eq!(backend.outstanding_bytes(), step_bytes(4));
    let allocs = backend.allocs();
    step(name, 64); // overflows the block
    assert!(backend.allocs() > allocs);
    let s = gpucache::stats(name);
    assert_eq!(
        s.bytes_cached, 0,
        "the step's blocks are given back at its end: {s}"
    );
    let allocs = backend.allocs();
    step(name, 64);
    assert_eq!(
        backend.allocs(),
        allocs + 1,
        "one block sized to the largest step"
    );
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, step_bytes(64)), "{s}");
    for rows in [1, 64, 30] {
        step(name, rows);
    }
    assert_eq!(backend.allocs(), allocs + 1);
    assert_eq!(backend.outstanding_bytes(), step_bytes(64));
}

#[test]
fn the_byte_cap_bounds_the_spare_blocks() {
    let _serial = serial();
    let name = "arena-cap";
    let (backend, _installed) = arena(name, Some(2048));
    step_of(name, 1); // a block of 256 bytes
    // Three steps whose 1 KiB arrays escape: three blocks of 1 KiB (the first one grew).
    let kept: Vec<Array<u8>> = (0..3)
        .map(|_| {
            let _scope = gpucache::enter(name);
            filled(DEV, 9u8, 1024)
        })
        .collect();
    assert_eq!(backend.allocs(), 4);
    drop(kept);
    // The spares are the three 1 KiB blocks; the cap keeps the newest two.
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_cached, s.evictions), (2048, 1), "{s}");
    assert_eq!(backend.outstanding_bytes(), 2048);
}

#[test]
fn invalidate_and_empty_cache_release_arena_blocks() {
    let _serial = serial();
    let name = "arena-release";
    let (backend, _installed) = arena(name, None);
    step(name, 10);
    let escaped = {
        let _scope = gpucache::enter(name);
        filled(DEV, 5u8, 10)
    };
    gpucache::empty_cache();
    let s = gpucache::stats(name);
    assert_eq!((s.bytes_cached, s.bytes_in_use), (0, step_bytes(10)), "{s}");
    gpucache::invalidate(name);
    assert!(
        common::all_eq(&escaped, 5),
        "invalidate leaves live arrays alone"
    );
    drop(escaped);
    assert_eq!(
        backend.outstanding_bytes(),
        0,
        "a block of an old generation is freed"
    );
    let s = gpucache::stats(name);
    assert_eq!(
        (s.bytes_cached, s.bytes_in_use, s.invalidations),
        (0, 0, 1),
        "{s}"
    );
    // Invalidating inside a step frees the block of arrays already dropped.
    {
        let _scope = gpucache::enter(name);
        drop(filled(DEV, 1u8, 10));
        gpucache::invalidate(name);
        assert_eq!(backend.outstanding_bytes(), 0);
        let a = filled(DEV, 3u8, 10);
        assert!(common::all_eq(&a, 3));
    }
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn out_of_memory_recovery_releases_spare_blocks() {
    let _serial = serial();
    let name = "arena-oom";
    let (backend, _installed) = arena(name, None);
    // A spare block of 4 KiB: an escaped array's block, back after it dropped.
    let escaped = {
        let _scope = gpucache::enter(name);
        filled(DEV, 1u8, 4096)
    };
    step_of(name, 1);
    drop(escaped);
    let held = backend.outstanding_bytes();
    assert_eq!(held, 4096 + 4096);
    // A device of 10 KiB: the next block (8 KiB) fits only once the spare is released.
    backend.set_limit(Some(10 * 1024));
    {
        let _scope = gpucache::enter(name);
        let big = Array::<u8>::zeros(DEV, 8192).expect("recovered by releasing the spare");
        assert!(common::all_eq(&big, 0));
    }
    assert!(backend.failures() >= 1);
    // With no room at all, a typed error.
    backend.set_limit(Some(0));
    gpucache::empty_cache();
    let _scope = gpucache::enter(name);
    let err = Array::<u8>::zeros(DEV, 1 << 20).unwrap_err();
    assert!(matches!(err, gpucache::Error::OutOfMemory { requested, .. } if requested == 1 << 20));
}

#[test]
fn arrays_outliving_their_thread_free_its_blocks() {
    let _serial = serial();
    let backend = CountingBackend::new();
    let b = Arc::clone(&backend);
    let escaped = thread::spawn(move || {
        let _installed = use_backend(&b);
        configure("arena-exit", |c| c.key = KeyPolicy::Arena);
        let _scope = gpucache::enter("arena-exit");
        (filled(DEV, 1u8, 300), filled(DEV, 2u8, 300))
    })
    .join()
    .unwrap();
    // The thread's caches closed: the blocks of live arrays alone are left.
    assert_eq!(backend.outstanding_bytes(), 512 + 1024);
    assert!(common::all_eq(&escaped.0, 1) && common::all_eq(&escaped.1, 2));
    drop(escaped.0);
    assert_eq!(backend.outstanding_bytes(), 1024);
    drop(escaped.1);
    assert_eq!(backend.outstanding_bytes(), 0);
}

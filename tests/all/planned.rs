//! Planned caches (`KeyPolicy::Planned`) on the CPU backend: the first step allocates each array
//! apart and is recorded; later steps are served from one block laid out from the recorded
//! lifetimes, at the same addresses, with no device allocation; smaller steps fit, larger ones
//! re-plan; arrays kept alive past their planned end or past their step are never overwritten
//! (a dense step's smallest arrays, stacked on top of its plan, included);
//! drops on other threads, the byte cap, invalidation, `empty_cache`, out-of-memory recovery and
//! thread exit give every byte back. On a backend that grows blocks in place (as CUDA's does),
//! a larger step grows the plan's block instead of replacing it, a block given up at a step's
//! end grows into the next plan's or goes back, and a growth the device refuses falls back to a
//! new block.
//!
//! Each test counts device allocations with its own `CountingBackend`, so tests that act on
//! every thread's caches (`empty_cache`, out-of-memory recovery) run one at a time (`serial()`).

use gpucache_suite::common;

use std::sync::Arc;
use std::thread;

use common::{addr, configure, filled, serial};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Array, Device, KeyPolicy};

const DEV: Device = Device::Cpu;

/// A fresh counting backend installed on this thread, and cache `name` made a planned one.
fn planned(
    name: &str,
    cap: Option<usize>,
) -> (Arc<CountingBackend>, gpucache::testing::BackendGuard) {
    let backend = CountingBackend::new();
    let guard = use_backend(&backend);
    configure(name, |c| {
        c.key = KeyPolicy::Planned;
        c.max_cached_bytes = cap;
    });
    (backend, guard)
}

/// One step of a loop: `a` (`rows` x 64 f32) dies before `c` is made, so `c` can take its bytes;
/// `b` (`rows` u8) lives across both. Returns the addresses of a, b and c.
fn step(name: &str, rows: usize) -> [usize; 3] {
    let _scope = gpucache::enter(name);
    let a = Array::<f32>::zeros(DEV, [rows, 64]).unwrap();
    let b = filled(DEV, 5u8, [rows]);
    let at_a = addr(&a);
    assert!(common::all_eq(&a, 0.0));
    drop(a);
    let c = filled(DEV, 7i32, [rows, 64]);
    assert!(common::all_eq(&b, 5) && common::all_eq(&c, 7));
    [at_a, addr(&b), addr(&c)]
}

/// `bytes` rounded up to 256.
fn up(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

#[test]
fn a_repeated_step_allocates_in_its_first_two_steps_only_and_holds_its_peak() {
    let _serial = serial();
    let name = "planned-steady";
    let (backend, _installed) = planned(name, None);
    // The first step allocates each array apart and gives back those that die in it.
    step(name, 64);
    assert_eq!(backend.allocs(), 3);
    assert_eq!(backend.outstanding_bytes(), 0);
    // The second makes the plan's block: a and c share their bytes.
    let second = step(name, 64);
    assert_eq!(backend.allocs(), 4);
    assert_eq!(second[0], second[2], "c is planned over a");
    let peak = up(64 * 64 * 4) + up(64);
    assert_eq!(
        backend.outstanding_bytes(),
        peak,
        "the step's peak, not its sum"
    );
    // Then every step is served at the same addresses, with no device allocation.
    for _ in 0..3 {
        assert_eq!(step(name, 64), second);
    }
    assert_eq!(backend.allocs(), 4);
    let stats = gpucache::stats(name);
    assert_eq!(stats.bytes_in_use, 0);
    assert_eq!(stats.bytes_cached, peak);
}

#[test]
fn smaller_steps_fit_the_plan_and_a_larger_one_plans_again() {
    let _serial = serial();
    let name = "planned-sizes";
    let (backend, _installed) = planned(name, None);
    step(name, 64);
    step(name, 64);
    let allocs = backend.allocs();
    // Smaller at every position: the same plan, no allocation.
    step(name, 16);
    step(name, 40);
    assert_eq!(backend.allocs(), allocs);
    // Larger: the old block given back, the step is served from its plan scaled (in a new
    // block), then planned again.
    step(name, 128);
    assert!(backend.allocs() > allocs);
    step(name, 128);
    let allocs = backend.allocs();
    for rows in [128, 64, 100] {
        step(name, rows);
    }
    assert_eq!(
        backend.allocs(),
        allocs,
        "the new plan fits every size seen"
    );
    // One block: the scaled plan's, which holds the largest step (it is kept while the plans
    // fit it), a sixty-fourth larger and rounded up.
    let exact = up(128 * 64 * 4) + up(128);
    let held = backend.outstanding_bytes();
    assert!(
        exact <= held && held <= exact + exact / 32,
        "{held} bytes held for a step of {exact}"
    );
    assert_eq!(backend.outstanding_allocs(), 1, "one block");
}

/// A step shaped like a model's forward pass over a sequence of `len` tokens: a small array of
/// a fixed size first (with `hold_input`, it lives through the whole step, as a mask used by
/// every layer; else it dies at once), then twelve layers, each making a wide scratch array and
/// the next hidden state, the last layer's output dropped at the step's end. Every array is
/// filled and checked while the next ones are made. Returns the bytes the step's arrays had
/// alive at once, at most, and the layers' addresses.
fn layers(name: &str, len: usize, hold_input: bool) -> (usize, Vec<usize>) {
    layers_after(name, len, 256, hold_input)
}

/// [`layers`] after an input of `input` bytes.
fn layers_after(name: &str, len: usize, input: usize, hold_input: bool) -> (usize, Vec<usize>) {
    let counted = |s: gpucache::CacheStats| s.hits + s.misses;
    let before = counted(gpucache::stats(name));
    let got = layers_in_scope(name, len, input, hold_input);
    // Every allocation is a hit or a miss, whichever way the plan served it.
    assert_eq!(
        counted(gpucache::stats(name)),
        before + 26,
        "hits and misses"
    );
    got
}

/// [`layers_after`], in a scope of its own.
fn layers_in_scope(name: &str, len: usize, input: usize, hold_input: bool) -> (usize, Vec<usize>) {
    let _scope = gpucache::enter(name);
    let held = if hold_input { input } else { 0 };
    let input = filled(DEV, 100u8, [input]);
    let input = hold_input.then_some(input);
    let mut x = filled(DEV, 0u8, [len, 64]);
    let (mut peak, mut at) = (0, Vec::new());
    for layer in 1..=12u8 {
        let wide = filled(DEV, layer, [len, 256]);
        let y = filled(DEV, layer, [len, 64]);
        at.extend([addr(&wide), addr(&y)]);
        assert!(
            common::all_eq(&x, layer - 1),
            "layer {layer}: its input was overwritten"
        );
        assert!(common::all_eq(&wide, layer) && common::all_eq(&y, layer));
        peak = peak.max(held + len * (64 + 256 + 64));
        x = y;
    }
    if let Some(input) = &input {
        assert!(common::all_eq(input, 100), "the input was overwritten");
    }
    (peak, at)
}

/// One step of twelve layers of `rows` x 64 f32 (every other one twice as many rows), each made
/// from the last (two alive at once);
/// before layer `j` a scalar (an empty workspace, a loss's reduction) is made and dropped when
/// `scalar(j)`. Every layer is filled and checked while the next is made. Returns the layers'
/// addresses.
fn layers_and_scalars(name: &str, rows: usize, scalar: impl Fn(u8) -> bool) -> Vec<usize> {
    let _scope = gpucache::enter(name);
    let mut x = filled(DEV, 0f32, [rows, 64]);
    let mut at = vec![addr(&x)];
    for j in 1..=12u8 {
        if scalar(j) {
            let w = filled(DEV, j, [1]);
            assert!(common::all_eq(&w, j));
        }
        let y = filled(DEV, f32::from(j), [rows * (1 + usize::from(j % 2)), 64]);
        assert!(
            common::all_eq(&x, f32::from(j - 1)),
            "layer {j}: input overwritten"
        );
        at.push(addr(&y));
        x = y;
    }
    at
}

#[test]
fn small_arrays_made_in_some_steps_and_not_others_leave_every_layer_at_its_place() {
    let _serial = serial();
    let name = "planned-scalars";
    let (backend, _installed) = planned(name, None);
    // Which layers a scalar comes before changes from step to step (cuDNN's workspace for a
    // convolution is empty or not with the batch).
    let scalars = |before: &'static [u8]| move |j: u8| before.contains(&j);
    layers_and_scalars(name, 128, scalars(&[1, 4, 7]));
    let planned = layers_and_scalars(name, 128, scalars(&[1, 4, 7]));
    let (allocs, held) = (backend.allocs(), backend.outstanding_bytes());
    let every = &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
    for before in [&[2, 5, 8][..], &[3], &[], every] {
        assert_eq!(
            layers_and_scalars(name, 128, scalars(before)),
            planned,
            "scalars before {before:?}: every layer at its planned place"
        );
    }
    // The scalars the plan does not hold (if any) take turns in one block apart, made once and
    // kept: no allocation every step.
    assert!(
        backend.allocs() - allocs <= 1,
        "{}",
        backend.allocs() - allocs
    );
    assert!(backend.outstanding_bytes() <= held + 256);
}

/// Cache `name` made a planned one on a fresh counting backend (growing a plan's block in place,
/// as CUDA's does, if `growable`), and planned from two steps of [`layers`] of length 100
/// (`hold_input` as given).
fn planned_layers(
    name: &str,
    hold_input: bool,
    growable: bool,
) -> (Arc<CountingBackend>, gpucache::testing::BackendGuard) {
    let planned = planned(name, None);
    planned.0.set_growable(growable);
    layers(name, 100, hold_input);
    layers(name, 100, hold_input);
    planned
}

#[test]
fn a_longer_sequence_is_served_from_its_plan_scaled_in_one_new_block() {
    let _serial = serial();
    let name = "planned-scaled";
    let (backend, _installed) = planned_layers(name, false, false);
    let allocs = backend.allocs();
    backend.reset_peak();
    // The layers' arrays are half as large again: the step outgrows its plan at its first
    // layer's array, and the plan scaled by that ratio serves the rest of it, in one new block.
    let (peak, scaled) = layers(name, 150, false);
    let grown = backend.allocs() - allocs;
    assert_eq!(grown, 1, "one block, not one per array");
    assert!(
        backend.peak_bytes() as f64 <= 1.10 * peak as f64,
        "{} bytes held for {peak} live",
        backend.peak_bytes()
    );
    // The scaled plan, which held the step, stays the plan: the next steps up to that length
    // allocate nothing, and that length's arrays keep their addresses.
    assert_eq!(layers(name, 150, false).1, scaled);
    for len in [120, 150] {
        layers(name, len, false);
    }
    assert_eq!(backend.allocs(), allocs + grown);
}

#[test]
fn a_longer_sequence_whose_input_went_apart_is_served_from_the_rest_of_its_plan() {
    let _serial = serial();
    let name = "planned-rest";
    let (backend, _installed) = planned(name, None);
    // The input, as large as a twentieth of the step's arrays, lives through the step.
    for _ in 0..2 {
        layers_after(name, 100, 100 * 20, true);
    }
    let allocs = backend.allocs();
    backend.reset_peak();
    // Half as large again: the input goes apart as it grew, then the first layer outgrows the
    // plan; its block is unused, and goes. The rest of the plan, placed again without the
    // input (served apart), takes the rest of the step: the input is not held twice.
    let (peak, _) = layers_after(name, 150, 150 * 20, true);
    assert!(
        backend.peak_bytes() < peak + 150 * 20,
        "{} bytes held for {peak} live",
        backend.peak_bytes()
    );
    assert!(
        backend.allocs() - allocs <= 3,
        "{}",
        backend.allocs() - allocs
    );
    // The steps after, of that length and shorter, are planned from it (every array checked
    // while the next ones are made: a view kept at a position's offset in the step placed
    // again, and handed out at another's, would break them), and settle.
    for len in [150, 120, 150] {
        layers_after(name, len, len * 20, true);
    }
    let settled = backend.allocs();
    for len in [150, 100, 150] {
        layers_after(name, len, len * 20, true);
    }
    assert_eq!(backend.allocs(), settled);
}

/// Cache `name` planned from two steps of [`layers`] of length 100 (`hold_input` as given),
/// then one of length 150 that keeps its input through every layer, so that the old block stays
/// in use: it takes what fits in the block's free bytes and allocates the rest apart, each array
/// checked, with at most one device allocation for two arrays (serving all of it apart made one
/// per array).
fn longer_step_holding_its_input(
    name: &str,
    hold_input: bool,
) -> (Arc<CountingBackend>, gpucache::testing::BackendGuard) {
    let planned = planned_layers(name, hold_input, false);
    let allocs = planned.0.allocs();
    layers(name, 150, true);
    let grown = planned.0.allocs() - allocs;
    assert!(
        grown > 0 && grown <= 13,
        "{grown} device allocations for 26 arrays: at most one for two"
    );
    planned
}

#[test]
fn a_longer_sequence_whose_input_holds_the_block_is_served_from_its_free_bytes() {
    let _serial = serial();
    let name = "planned-scaled-held";
    // The plan's steps kept their input too: the block is held from the step's divergence on.
    let (backend, _installed) = longer_step_holding_its_input(name, true);
    // Planned again at its end: the next such steps allocate nothing.
    layers(name, 150, true);
    let allocs = backend.allocs();
    layers(name, 150, true);
    assert_eq!(backend.allocs(), allocs);
}

#[test]
fn a_longer_step_whose_first_array_outlives_its_plan_stops_waiting_for_the_block() {
    let _serial = serial();
    // The plan's steps dropped their input at once; this longer one keeps it (as a training
    // step keeps an attention mask), so the plan says the block is about to be unused. The step
    // waits for it only until half the plan's footprint went apart, then takes the block's free
    // bytes.
    let _planned = longer_step_holding_its_input("planned-scaled-wait", false);
}

#[test]
fn constructors_keep_their_guarantees_on_a_reused_block() {
    let _serial = serial();
    let name = "planned-init";
    let (_backend, _installed) = planned(name, None);
    for round in 0..4u8 {
        let _scope = gpucache::enter(name);
        // Dirty the block with nonzero bytes where the next arrays will be.
        let mut dirt = Array::<u8>::zeros(DEV, 4096).unwrap();
        assert!(common::all_eq(&dirt, 0), "round {round}: zeros");
        dirt.as_mut_slice().unwrap().fill(0xAB);
        drop(dirt);
        let flags = Array::<bool>::empty(DEV, 1000).unwrap();
        assert!(common::all_eq(&flags, false), "bool arrays start valid");
        let zeros = Array::<u8>::zeros(DEV, 3000).unwrap();
        assert!(common::all_eq(&zeros, 0), "round {round}: zeros over dirt");
        let data: Vec<f32> = (0..300).map(|i| i as f32).collect();
        let copy = Array::from_slice(DEV, &data, [300]).unwrap();
        assert_eq!(copy.to_vec().unwrap(), data);
    }
}

#[test]
fn an_array_kept_past_its_planned_end_is_never_overwritten() {
    let _serial = serial();
    let name = "planned-kept";
    let (backend, _installed) = planned(name, None);
    step(name, 64);
    step(name, 64);
    // This time `a` stays alive while `c`, planned over it, is made.
    let _scope = gpucache::enter(name);
    let a = filled(DEV, 1.5f32, [64, 64]);
    let b = filled(DEV, 5u8, [64]);
    let c = filled(DEV, 7i32, [64, 64]);
    assert_ne!(addr(&a), addr(&c));
    assert!(common::all_eq(&a, 1.5) && common::all_eq(&b, 5) && common::all_eq(&c, 7));
    drop((a, b, c));
    drop(_scope);
    // The step is planned again, and the next ones follow the plan.
    step(name, 64);
    let allocs = backend.allocs();
    step(name, 64);
    step(name, 64);
    assert_eq!(backend.allocs(), allocs);
}

/// A step whose scratch array (64 x 64 f32) dies first, then `a` and `c` (64 x 16 f32 each):
/// recorded with `a` dropped before `c` is made, all three share the plan's first bytes. With
/// `keep_a`, `a` stays alive while `c` is made. Returns the addresses of the scratch array, a
/// and c.
fn scratch_then_two(name: &str, keep_a: bool) -> [usize; 3] {
    let _scope = gpucache::enter(name);
    let scratch = filled(DEV, 1.0f32, [64, 64]);
    let at_scratch = addr(&scratch);
    drop(scratch);
    let a = filled(DEV, 2.0f32, [64, 16]);
    let at_a = addr(&a);
    let kept = if keep_a {
        Some(a)
    } else {
        drop(a);
        None
    };
    let c = filled(DEV, 3.0f32, [64, 16]);
    if let Some(a) = &kept {
        assert!(common::all_eq(a, 2.0), "a was overwritten");
    }
    assert!(common::all_eq(&c, 3.0));
    [at_scratch, at_a, addr(&c)]
}

#[test]
fn a_step_that_leaves_its_plan_without_growing_is_served_from_the_plans_free_bytes() {
    let _serial = serial();
    let name = "planned-gaps";
    let (backend, _installed) = planned(name, None);
    scratch_then_two(name, false);
    let planned = scratch_then_two(name, false);
    assert!(planned[0] == planned[1] && planned[1] == planned[2]);
    let allocs = backend.allocs();
    // `a` alive over `c`'s planned bytes: the step leaves its plan, and `c` goes where no array
    // is, in the plan's block, with no device allocation.
    let [_, at_a, at_c] = scratch_then_two(name, true);
    assert_eq!(
        backend.allocs(),
        allocs,
        "served from the block's free bytes"
    );
    let block = planned[0]..planned[0] + 64 * 64 * 4;
    assert!(block.contains(&at_c) && block.contains(&(at_c + 64 * 16 * 4 - 1)));
    assert!(at_c >= at_a + 64 * 16 * 4 || at_c + 64 * 16 * 4 <= at_a);
    // Planned again with `a` and `c` alive together: the same block holds the new plan.
    for _ in 0..3 {
        scratch_then_two(name, true);
    }
    assert_eq!(backend.allocs(), allocs);
    assert_eq!(backend.outstanding_bytes(), 64 * 64 * 4);
}

/// A step of `sizes` bytes, each array dropped before the next is made (a step whose arrays
/// all take the same bytes when planned), each filled and checked. Returns their addresses.
fn sequence(name: &str, sizes: &[usize]) -> Vec<usize> {
    let _scope = gpucache::enter(name);
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let a = filled(DEV, i as u8, n);
            assert!(common::all_eq(&a, i as u8));
            addr(&a)
        })
        .collect()
}

#[test]
fn a_smaller_step_in_another_order_is_served_from_the_plans_block() {
    let _serial = serial();
    let name = "planned-order";
    let (backend, _installed) = planned(name, None);
    let recorded = [4096, 65536, 4096, 65536];
    sequence(name, &recorded);
    let planned = sequence(name, &recorded);
    let allocs = backend.allocs();
    // An extra array at the second position: the third allocation is matched with a position
    // smaller than it. The step is not matched with the plan index by index, so that says
    // nothing of its size: it is tried in the block's free bytes, and fits there.
    let other = sequence(name, &[2048, 1024, 32768, 2048, 32768]);
    assert_eq!(backend.allocs(), allocs, "no device allocation");
    let block = planned[1]..planned[1] + 65536;
    assert!(
        other.iter().all(|a| block.contains(a)),
        "{other:x?} in {block:x?}"
    );
    // The recorded order again: its plan (shelved for the smaller one) serves it.
    sequence(name, &recorded);
    sequence(name, &recorded);
    assert_eq!(backend.allocs(), allocs);
    assert_eq!(backend.outstanding_bytes(), 65536);
}

/// A decoding step after `len` tokens: `kv` (outlives the step, replacing the last one), then
/// `a`, `scores` (one byte more every token, like attention over the tokens so far) and `c`,
/// alive together. Returns the addresses of a, scores and c.
fn decode(name: &str, kv: &mut Array<u8>, len: usize) -> [usize; 3] {
    let _scope = gpucache::enter(name);
    *kv = filled(DEV, 1u8, 4096 + len);
    let a = filled(DEV, 2u8, 131072);
    let scores = filled(DEV, 3u8, 8192 + len);
    let c = filled(DEV, 4u8, 131072);
    assert!(common::all_eq(&a, 2) && common::all_eq(&scores, 3) && common::all_eq(&c, 4));
    assert!(common::all_eq(kv, 1));
    [addr(&a), addr(&scores), addr(&c)]
}

#[test]
fn a_position_growing_a_little_every_step_is_planned_with_room_to_grow() {
    let _serial = serial();
    let name = "planned-grow";
    let (backend, _installed) = planned(name, None);
    let mut kv = filled(DEV, 0u8, 1);
    decode(name, &mut kv, 0);
    decode(name, &mut kv, 256);
    // Planned again from the step that grew, with room to grow: the next steps fit.
    let planned = decode(name, &mut kv, 512);
    let allocs = backend.allocs();
    for len in [600, 700, 800] {
        assert_eq!(decode(name, &mut kv, len), planned);
    }
    assert_eq!(backend.allocs(), allocs, "within the room, on the plan");
    // Past the room (within a sixteenth of the footprint): the scores alone go apart, the
    // others stay at their offsets.
    let grown = decode(name, &mut kv, 4096);
    assert_eq!([grown[0], grown[2]], [planned[0], planned[2]]);
    assert_ne!(grown[1], planned[1]);
}

/// A decoding step of a cache of keys and values `len` bytes long: the cache (replacing the
/// last one, so planned apart), then a temporary of 4 MiB. Returns the device
/// allocations the step made.
fn decode_long(backend: &CountingBackend, name: &str, kv: &mut Array<u8>, len: usize) -> u64 {
    let before = backend.allocs();
    let _scope = gpucache::enter(name);
    *kv = filled(DEV, 1u8, len);
    let scratch = filled(DEV, 2u8, 4 << 20);
    assert!(common::all_eq(&scratch, 2) && common::all_eq(kv, 1));
    drop((scratch, _scope));
    backend.allocs() - before
}

#[test]
fn a_cache_of_keys_and_values_growing_apart_gets_blocks_with_room_to_grow() {
    let _serial = serial();
    let name = "planned-kv-room";
    let (backend, _installed) = planned(name, None);
    let mut kv = filled(DEV, 0u8, 1);
    // 16 KiB of keys and values, a KiB more every step. The first two steps record and plan.
    let lens: Vec<usize> = (0..96).map(|t| (16 << 10) + (t << 10)).collect();
    decode_long(&backend, name, &mut kv, lens[0]);
    decode_long(&backend, name, &mut kv, lens[1]);
    let made: Vec<u64> = lens[2..]
        .iter()
        .map(|&len| decode_long(&backend, name, &mut kv, len))
        .collect();
    // Blocks of their size class alone would be outgrown at every class the cache crosses
    // (two blocks each time: the cache of the step before holds the other); with room for as
    // much again as it grew since the plan (at most half its size), a block lasts longer the
    // more the cache has grown.
    let crossed = lens[2..]
        .windows(2)
        .filter(|w| common::size_class(w[1]) > common::size_class(w[0]))
        .count() as u64;
    let total: u64 = made.iter().sum();
    assert!(crossed >= 8, "{crossed} classes crossed");
    assert!(
        total <= crossed,
        "{total} device allocations for {crossed} classes crossed: {made:?}"
    );
    // The second half of the run: at most one class outgrown (two blocks).
    assert!(
        made[made.len() / 2..].iter().sum::<u64>() <= 2,
        "per step: {made:?}"
    );
    drop(kv);
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A prompt step (its first array large, five arrays) or a decoding step (its first array small,
/// three arrays, and one of them more bytes than the prompt's at its position), each array
/// dropped before the next. Returns their addresses.
fn serve(name: &str, prompt: bool) -> Vec<usize> {
    if prompt {
        sequence(name, &[65536, 32768, 65536, 4096, 16384])
    } else {
        sequence(name, &[256, 1024, 8192])
    }
}

#[test]
fn prompt_and_decoding_steps_alternating_in_one_scope_keep_a_plan_each() {
    let _serial = serial();
    let name = "planned-serve";
    let (backend, _installed) = planned(name, None);
    let mut first = None;
    for round in 0..4 {
        let prompt = serve(name, true);
        let decoding: Vec<_> = (0..3).map(|_| serve(name, false)).collect();
        assert_eq!(
            decoding[1], decoding[2],
            "round {round}: decoding follows its plan"
        );
        if round == 1 {
            first = Some((backend.allocs(), prompt, decoding[2].clone()));
        } else if let Some((allocs, p, d)) = &first {
            assert_eq!(
                backend.allocs(),
                *allocs,
                "round {round}: no device allocation"
            );
            assert_eq!(
                (&prompt, &decoding[0]),
                (p, d),
                "round {round}: each on its plan"
            );
        }
    }
    assert_eq!(
        backend.outstanding_bytes(),
        65536,
        "one block serves both plans"
    );
}

/// A model's step: its forward pass makes `activations` arrays; a training step keeps them for
/// its backward pass, which makes a gradient per activation (each dying at once), an evaluation
/// step drops each activation when the next is made. Returns the addresses.
fn model_step(name: &str, training: bool) -> Vec<usize> {
    let _scope = gpucache::enter(name);
    let mut addrs = Vec::new();
    let mut kept = Vec::new();
    let mut last = None;
    for i in 0..6u8 {
        let a = filled(DEV, i, 4096 * (1 + usize::from(i % 3)));
        addrs.push(addr(&a));
        if training {
            kept.push(a);
        } else {
            last = Some(a);
        }
    }
    drop(last);
    for (i, a) in kept.iter().enumerate().rev() {
        let g = filled(DEV, 100 + i as u8, a.len());
        assert!(common::all_eq(&g, 100 + i as u8) && common::all_eq(a, i as u8));
        addrs.push(addr(&g));
    }
    addrs
}

#[test]
fn training_and_evaluation_steps_alternating_in_one_scope_settle() {
    let _serial = serial();
    let name = "planned-train-eval";
    let (backend, _installed) = planned(name, None);
    let mut settled = None;
    for round in 0..6 {
        let train = model_step(name, true);
        let eval = model_step(name, false);
        assert_eq!(eval.len(), 6);
        if round == 2 {
            settled = Some((backend.allocs(), train, eval));
        } else if let Some((allocs, t, e)) = &settled {
            assert_eq!(
                backend.allocs(),
                *allocs,
                "round {round}: no device allocation"
            );
            assert_eq!((&train, &eval), (t, e), "round {round}: the same addresses");
        }
    }
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
}

/// A step that returns an array (it escapes), after a scratch array that dies in the step.
fn escaping(name: &str, value: u8) -> Array<u8> {
    let _scope = gpucache::enter(name);
    let scratch = filled(DEV, 9u8, 2048);
    assert!(common::all_eq(&scratch, 9));
    drop(scratch);
    filled(DEV, value, 1024)
}

#[test]
fn arrays_that_outlive_their_step_are_served_apart_and_never_overwritten() {
    let _serial = serial();
    let name = "planned-escape";
    let (backend, _installed) = planned(name, None);
    let mut kept = Vec::new();
    for i in 0..6u8 {
        kept.push(escaping(name, i));
        for (j, a) in kept.iter().enumerate() {
            assert!(
                common::all_eq(a, j as u8),
                "escaped array {j} after step {i}"
            );
        }
    }
    let mut addrs: Vec<usize> = kept.iter().map(addr).collect();
    addrs.sort_unstable();
    addrs.dedup();
    assert_eq!(
        addrs.len(),
        kept.len(),
        "each escaped array has bytes of its own"
    );
    drop(kept);
    // Dropped after their steps: spares, kept until `empty_cache`.
    escaping(name, 0);
    escaping(name, 0);
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

/// One request of a server in scope `name`: a prompt step whose keys and values (`len` bytes,
/// filled with `value`) outlive it, `decode` decoding steps that read them, and their drop after
/// the last one. Returns the device allocations the request made.
fn request(backend: &CountingBackend, name: &str, value: u8, len: usize, decode: usize) -> u64 {
    let before = backend.allocs();
    let kv = {
        let _scope = gpucache::enter(name);
        let scratch = filled(DEV, 9u8, 2048);
        assert!(common::all_eq(&scratch, 9));
        drop(scratch);
        filled(DEV, value, len)
    };
    for _ in 0..decode {
        let _scope = gpucache::enter(name);
        let logits = filled(DEV, 1u8, 512);
        assert!(common::all_eq(&kv, value) && common::all_eq(&logits, 1));
    }
    drop(kv);
    backend.allocs() - before
}

#[test]
fn a_requests_block_serves_the_next_request_however_many_steps_later() {
    let _serial = serial();
    let name = "planned-server";
    let (backend, _installed) = planned(name, None);
    // Requests of fewer and more decoding steps, their keys and values of other sizes: from the
    // third request on, each takes the block of the one before (kept as a spare through every
    // decoding step between), the smaller ones too, since a new block would take the cache past
    // the most it held; so nothing is allocated and the peak stays.
    let mut allocs = Vec::new();
    let mut peaks = Vec::new();
    for (r, (len, decode)) in [(4096, 3), (4000, 9), (2600, 14), (3900, 6), (2100, 20)]
        .into_iter()
        .enumerate()
    {
        allocs.push(request(&backend, name, r as u8, len, decode));
        peaks.push(backend.peak_bytes());
    }
    assert_eq!(&allocs[2..], &[0, 0, 0], "device allocations per request");
    assert_eq!(
        peaks[4], peaks[1],
        "peak bytes after each request: {peaks:?}"
    );
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn a_shorter_request_takes_the_block_a_longer_one_left() {
    let _serial = serial();
    let name = "planned-server-short";
    let (backend, _installed) = planned(name, None);
    // Two long requests (the second's prompt plan records its keys and values at 64 KiB), a
    // large one between them to raise the most the cache has held, then requests a sixth as
    // long: each takes a block of keys and values a long request left (more than four times
    // its size, within four times its position's recorded size), so none allocates.
    request(&backend, name, 1, 65536, 2);
    request(&backend, name, 2, 1 << 20, 2);
    request(&backend, name, 3, 65536, 2);
    let allocs: Vec<u64> = (4..8)
        .map(|r| request(&backend, name, r, 10240 + 256 * r as usize, 3))
        .collect();
    assert_eq!(allocs, [0, 0, 0, 0], "device allocations per request");
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn a_spare_goes_back_before_an_allocation_that_would_take_the_cache_past_its_peak() {
    let _serial = serial();
    let name = "planned-spare-peak";
    let (backend, _installed) = planned(name, None);
    for r in 0..3 {
        request(&backend, name, r, 4096, 4);
    }
    // A spare of 4096 bytes is kept through steps that hold no more than before...
    let (frees, held) = (backend.frees(), backend.outstanding_bytes());
    for _ in 0..10 {
        let _scope = gpucache::enter(name);
        assert!(common::all_eq(&filled(DEV, 1u8, 512), 1));
    }
    assert_eq!(
        (backend.frees(), backend.outstanding_bytes()),
        (frees, held)
    );
    // ...and goes back before a block that would take the cache past its peak is allocated (an
    // array past the plan's end, served apart while the plan's block serves the rest).
    let big = (16 * backend.peak_bytes()).next_power_of_two();
    let _scope = gpucache::enter(name);
    let logits = filled(DEV, 1u8, 512);
    let a = filled(DEV, 3u8, big);
    assert!(common::all_eq(&a, 3) && common::all_eq(&logits, 1));
    assert_eq!(backend.frees(), frees + 1, "the spare went back");
    assert_eq!(backend.outstanding_bytes(), held - 4096 + big);
    assert_eq!(backend.peak_bytes(), held - 4096 + big);
    drop((a, logits, _scope));
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn escaped_arrays_dropped_on_other_threads_come_home() {
    let _serial = serial();
    let name = "planned-remote";
    let (backend, _installed) = planned(name, None);
    for round in 0..4u8 {
        let a = escaping(name, round);
        let b = escaping(name, round);
        // Dropped on another thread, during and between steps.
        let _scope = gpucache::enter(name);
        thread::spawn(move || {
            assert!(common::all_eq(&a, round) && common::all_eq(&b, round));
        })
        .join()
        .unwrap();
        let c = filled(DEV, 3u8, 4096);
        assert!(common::all_eq(&c, 3));
    }
    gpucache::invalidate(name);
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
    assert_eq!(backend.allocs(), backend.frees());
}

/// Found by the stress test (about one run in a hundred): an array of the plan's block that
/// outlived its step and was dropped on another thread after the step's end stayed counted in
/// use, and its position taken, until the plan changed.
#[test]
fn an_array_of_the_plan_dropped_on_another_thread_after_its_step_is_no_longer_in_use() {
    let _serial = serial();
    let name = "planned-remote-after";
    let (backend, _installed) = planned(name, None);
    let step = |keep: bool| {
        let _scope = gpucache::enter(name);
        let a = filled(DEV, 1u8, 4096);
        let b = filled(DEV, 2u8, 4096);
        let at = (addr(&a), addr(&b));
        drop(b);
        keep.then_some(a).map(|a| (a, at))
    };
    // Two steps make the plan; the third follows it and keeps its first array past its end.
    step(false);
    step(false);
    let (a, at) = step(true).unwrap();
    thread::spawn(move || assert!(common::all_eq(&a, 1)))
        .join()
        .unwrap();
    let stats = gpucache::stats(name);
    assert_eq!(stats.bytes_in_use, 0, "{stats:?}");
    assert_eq!(stats.bytes_cached, backend.outstanding_bytes(), "{stats:?}");
    // Its position is free again: the next step follows the plan, at the same addresses.
    let allocs = backend.allocs();
    let again = {
        let _scope = gpucache::enter(name);
        let a = filled(DEV, 1u8, 4096);
        let b = filled(DEV, 2u8, 4096);
        (addr(&a), addr(&b))
    };
    assert_eq!(again, at);
    assert_eq!(backend.allocs(), allocs, "no device allocation");
    gpucache::invalidate(name);
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn arrays_dropped_on_another_thread_during_the_step_are_never_overwritten() {
    let _serial = serial();
    let name = "planned-midstep";
    let (backend, _installed) = planned(name, None);
    for round in 0..5u8 {
        let _scope = gpucache::enter(name);
        let a = filled(DEV, round, 4096);
        let keep = filled(DEV, 100 + round, 4096);
        // `a` dies on another thread mid-step; the owner does not see its position free.
        thread::spawn(move || drop(a)).join().unwrap();
        let b = filled(DEV, 200 + round, 4096);
        assert!(common::all_eq(&keep, 100 + round) && common::all_eq(&b, 200 + round));
        assert_ne!(addr(&keep), addr(&b));
    }
    gpucache::invalidate(name);
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

/// A step whose arrays, of `sizes` bytes, are all alive together. Returns their addresses.
fn together(name: &str, sizes: &[usize]) -> Vec<usize> {
    let _scope = gpucache::enter(name);
    let arrays: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| filled(DEV, i as u8, n))
        .collect();
    for (i, a) in arrays.iter().enumerate() {
        assert!(common::all_eq(a, i as u8));
    }
    arrays.iter().map(addr).collect()
}

/// A step of `sizes` bytes, each array dropped once the next one is made, each filled and
/// checked.
fn pairs(name: &str, sizes: &[usize]) {
    let _scope = gpucache::enter(name);
    let mut last: Option<(u8, Array<u8>)> = None;
    for (i, &n) in sizes.iter().enumerate() {
        let a = filled(DEV, i as u8, n);
        if let Some((v, b)) = &last {
            assert!(common::all_eq(b, *v), "array {v} was overwritten");
        }
        last = Some((i as u8, a));
    }
}

#[test]
fn a_plan_is_not_merged_with_one_of_another_arrangement_into_more_than_either() {
    let _serial = serial();
    let name = "planned-arrangement";
    let (backend, _installed) = planned(name, None);
    let big = 64 << 10;
    // As many arrays in two arrangements: the large one first, or second. Merged position by
    // position, the plan would hold two large arrays alive together, twice what either needs.
    let first = [big, 4096, 4096, 4096];
    let second = [4096, big, 4096, 4096];
    pairs(name, &first);
    pairs(name, &first);
    for _ in 0..3 {
        pairs(name, &second);
    }
    backend.reset_peak();
    let allocs = backend.allocs();
    pairs(name, &second);
    assert_eq!(
        backend.allocs(),
        allocs,
        "the second arrangement settles on a plan"
    );
    assert!(
        backend.peak_bytes() < big + big / 2,
        "{} bytes held for steps of {} bytes alive at once",
        backend.peak_bytes(),
        big + 4096
    );
}

#[test]
fn a_plan_made_from_a_cold_start_is_picked_only_when_no_other_fits() {
    let _serial = serial();
    let name = "planned-cold";
    let (_backend, _installed) = planned(name, None);
    // The first step allocates something later steps do not (a large buffer).
    together(name, &[4096, 1 << 20]);
    // Another kind of step (another count, a first array not near): the first step's plan goes
    // on the shelf, and this kind gets its own.
    together(name, &[16384, 8192, 512]);
    let warm = together(name, &[16384, 8192, 512]);
    // A first array that both plans fit, the cold one more tightly: the warm plan serves it.
    let small = together(name, &[2048, 8192, 512]);
    assert_eq!(small[1..], warm[1..], "served at the warm plan's offsets");
    assert_eq!(small[0], warm[0]);
}

#[test]
fn arrays_dropped_on_another_thread_keep_the_counts_right_across_plan_switches() {
    let _serial = serial();
    let name = "planned-switch-remote";
    let (backend, _installed) = planned(name, None);
    for round in 0..6 {
        serve(name, true);
        for _ in 0..2 {
            let _scope = gpucache::enter(name);
            let a = filled(DEV, 1u8, 256);
            let b = filled(DEV, 2u8, 1024);
            // Its position stays taken for the owner, who does not see the drop.
            thread::spawn(move || drop(b)).join().unwrap();
            let c = filled(DEV, 3u8, 8192);
            assert!(common::all_eq(&a, 1) && common::all_eq(&c, 3));
        }
        let stats = gpucache::stats(name);
        assert_eq!(
            stats.bytes_in_use + stats.bytes_cached,
            backend.outstanding_bytes(),
            "round {round}: {stats:?}"
        );
        assert!(
            stats.bytes_cached <= backend.outstanding_bytes(),
            "round {round}"
        );
    }
    // Invalidated while an array of the block is alive: the block is retired under it.
    let scope = gpucache::enter(name);
    let alive = filled(DEV, 9u8, 65536);
    gpucache::invalidate(name);
    let stats = gpucache::stats(name);
    assert_eq!(stats.bytes_cached, 0, "{stats:?}");
    assert_eq!(stats.bytes_in_use, backend.outstanding_bytes(), "{stats:?}");
    assert!(common::all_eq(&alive, 9));
    drop((alive, scope));
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn the_byte_cap_bounds_the_spares() {
    let _serial = serial();
    let name = "planned-cap";
    let (backend, _installed) = planned(name, Some(0));
    for i in 0..4u8 {
        drop(escaping(name, i));
    }
    // No spare survives a cap of 0: only the plan's block is left.
    let held = backend.outstanding_bytes();
    assert_eq!(held, gpucache::stats(name).bytes_cached);
    assert!(held <= 2048, "{held}");
    assert!(gpucache::stats(name).evictions > 0);
}

#[test]
fn invalidate_and_empty_cache_release_plan_blocks_and_start_cold() {
    let _serial = serial();
    let name = "planned-release";
    let (backend, _installed) = planned(name, None);
    step(name, 64);
    step(name, 64);
    assert!(backend.outstanding_bytes() > 0);
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
    // Cold again: a step allocates apart, then a plan.
    step(name, 32);
    assert_eq!(backend.outstanding_bytes(), 0);
    step(name, 32);
    assert_eq!(backend.outstanding_bytes(), up(32 * 64 * 4) + up(32));
    // Inside a step, with arrays of the block alive: they stay valid, and the block is freed
    // by the last of them.
    {
        let _scope = gpucache::enter(name);
        let a = filled(DEV, 4u8, 100);
        gpucache::invalidate(name);
        assert!(common::all_eq(&a, 4));
        let b = filled(DEV, 6u8, 100);
        assert!(common::all_eq(&a, 4) && common::all_eq(&b, 6));
    }
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn out_of_memory_recovery_releases_plan_blocks_and_spares() {
    let _serial = serial();
    let name = "planned-oom";
    let (backend, _installed) = planned(name, None);
    step(name, 64);
    step(name, 64);
    let held = backend.outstanding_bytes();
    assert!(held > 0);
    // A device with room for the plan's block and a little more: an array as large as the
    // block fits only once the idle block is released.
    backend.set_limit(Some(held + 1024));
    let big = Array::<u8>::zeros(DEV, held).expect("recovered by releasing the plan's block");
    assert!(common::all_eq(&big, 0));
    assert!(backend.failures() >= 1);
    drop(big);
    // With no room at all, a typed error.
    backend.set_limit(Some(0));
    gpucache::empty_cache();
    let _scope = gpucache::enter(name);
    let err = Array::<u8>::zeros(DEV, 1 << 20).unwrap_err();
    assert!(matches!(err, gpucache::Error::OutOfMemory { requested, .. } if requested == 1 << 20));
}

#[test]
fn a_plan_block_the_device_cannot_give_serves_the_array_alone() {
    let _serial = serial();
    let name = "planned-oom-scaled";
    let (backend, _installed) = planned_layers(name, false, false);
    // The longer step asks for its plan scaled, in one block: the device refuses it, and again
    // once the caches gave back what they hold. The array alone fits: the step goes on, every
    // value checked, served apart from then on (the plan went with the recovery).
    let allocs = backend.allocs();
    backend.fail_nth(1);
    backend.fail_nth(2);
    layers(name, 150, false);
    assert_eq!(backend.failures(), 2, "the scaled block, and its retry");
    assert!(backend.allocs() > allocs + 1);
    // Planned again from that step: the next ones allocate nothing.
    layers(name, 150, false);
    let allocs = backend.allocs();
    layers(name, 150, false);
    assert_eq!(backend.allocs(), allocs);
    // When the array alone does not fit either, a typed error, and nothing held. (A first
    // allocation 62.5 times the plan's first asks for the plan scaled; past 64 times the step
    // would be of another kind, served from the block's free bytes.)
    backend.fail_nth(1);
    backend.fail_nth(2);
    backend.fail_nth(3);
    backend.fail_nth(4);
    let _scope = gpucache::enter(name);
    let err = Array::<u8>::empty(DEV, [250, 64]).unwrap_err();
    assert!(
        matches!(err, gpucache::Error::OutOfMemory { requested, .. } if requested == 250 * 64),
        "{err}"
    );
    assert_eq!(backend.failures(), 6);
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn arrays_outliving_their_thread_free_their_blocks() {
    let _serial = serial();
    let backend = CountingBackend::new();
    let b = Arc::clone(&backend);
    let escaped = thread::spawn(move || {
        let _installed = use_backend(&b);
        configure("planned-exit", |c| c.key = KeyPolicy::Planned);
        let mut last = None;
        for _ in 0..3 {
            let _scope = gpucache::enter("planned-exit");
            let scratch = filled(DEV, 0u8, 300);
            drop(scratch);
            last = Some((filled(DEV, 1u8, 300), filled(DEV, 2u8, 300)));
        }
        last.unwrap()
    })
    .join()
    .unwrap();
    // The thread's caches closed: the blocks of live arrays alone are left.
    assert!(backend.outstanding_bytes() > 0);
    assert!(common::all_eq(&escaped.0, 1) && common::all_eq(&escaped.1, 2));
    drop(escaped);
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
#[allow(deprecated)]
fn the_arena_policy_is_the_planned_one() {
    let _serial = serial();
    let name = "planned-arena-name";
    let backend = CountingBackend::new();
    let _installed = use_backend(&backend);
    configure(name, |c| c.key = KeyPolicy::Arena);
    step(name, 8);
    let second = step(name, 8);
    assert_eq!(second[0], second[2], "planned over each other");
    assert_eq!(backend.allocs(), 4);
}

#[test]
fn a_longer_sequence_grows_its_plans_block_in_place() {
    let _serial = serial();
    let name = "planned-grown";
    let (backend, _installed) = planned_layers(name, false, true);
    let (allocs, frees) = (backend.allocs(), backend.frees());
    let held = backend.outstanding_bytes();
    backend.reset_peak();
    // As for a block given back and one made anew: one device allocation, the plan scaled,
    // but the old block is not freed: it grows by the bytes the scaled plan needs more.
    let (peak, scaled) = layers(name, 150, false);
    assert_eq!(backend.allocs() - allocs, 1, "one growth");
    assert_eq!(backend.frees(), frees, "the old block was kept and grown");
    assert_eq!(backend.outstanding_allocs(), 1, "one block");
    assert!(backend.outstanding_bytes() > held);
    assert!(
        backend.peak_bytes() as f64 <= 1.10 * peak as f64,
        "{} bytes held for {peak} live",
        backend.peak_bytes()
    );
    // The grown block serves the next steps as the new one did.
    assert_eq!(layers(name, 150, false).1, scaled);
    layers(name, 120, false);
    assert_eq!(backend.allocs(), allocs + 1);
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every byte went back");
}

#[test]
fn a_block_given_up_at_a_steps_end_grows_into_the_next_plans_or_goes_back() {
    let _serial = serial();
    let name = "planned-grown-later";
    let (backend, _installed) = planned_layers(name, true, true);
    // The input holds the block through the longer step: it is served from the block's free
    // bytes and apart, and planned again at its end, larger: the block is kept to grow.
    layers(name, 150, true);
    assert_eq!(backend.outstanding_allocs(), 1, "the old block, kept");
    let frees = backend.frees();
    layers(name, 150, true);
    assert_eq!(backend.frees(), frees, "grown into the new plan's block");
    assert_eq!(backend.outstanding_allocs(), 1);
    // The same again, but the next step allocates nothing: the kept block goes back at its end.
    layers(name, 200, true);
    assert_eq!(backend.outstanding_allocs(), 1);
    drop(gpucache::enter(name));
    assert_eq!(
        backend.outstanding_allocs(),
        0,
        "kept through one step at most"
    );
    layers(name, 200, true);
    layers(name, 200, true);
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn a_growth_the_device_refuses_frees_the_old_block_and_makes_a_new_one() {
    let _serial = serial();
    let name = "planned-grown-refused";
    let (backend, _installed) = planned_layers(name, false, true);
    let frees = backend.frees();
    // The growth fails: the old block is freed, and a new block made (each array checked).
    backend.fail_nth(1);
    layers(name, 150, false);
    assert_eq!(backend.failures(), 1);
    assert_eq!(backend.frees(), frees + 1, "the old block, freed");
    assert_eq!(backend.outstanding_allocs(), 1, "one block");
    let allocs = backend.allocs();
    layers(name, 150, false);
    assert_eq!(backend.allocs(), allocs);
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every byte went back");
}

/// One step of ten 1 KiB arrays, each dropped before the next is made, the eighth `big` bytes.
fn one_at_a_time(name: &str, big: usize) {
    let _scope = gpucache::enter(name);
    for i in 0..10u8 {
        let bytes = if i == 7 { big } else { 1024 };
        let a = filled(DEV, i, [bytes]);
        assert!(common::all_eq(&a, i));
    }
}

#[test]
fn a_step_that_outgrows_its_plan_past_its_middle_is_served_from_the_unused_block() {
    let _serial = serial();
    let name = "planned-late-growth";
    let (backend, _installed) = planned(name, None);
    // Ten arrays one at a time, the third four times the others: the plan's block holds the
    // third, and every other array takes its first bytes.
    let sizes = |late: usize| -> Vec<usize> {
        (0..10)
            .map(|i| match i {
                2 => 16384,
                6 => late,
                _ => 4096,
            })
            .collect()
    };
    sequence(name, &sizes(4096));
    sequence(name, &sizes(4096));
    let allocs = backend.allocs();
    // The seventh array is twice its place, past the step's middle: too late for the plan
    // scaled, so the block, unused, serves the rest of the step from its bytes (given back, it
    // made one device allocation per array left), each array filled and checked.
    sequence(name, &sizes(8192));
    assert_eq!(backend.allocs(), allocs, "served from the plan's block");
}

#[test]
fn a_block_given_up_never_raises_the_peak() {
    let _serial = serial();
    let name = "planned-given-up-peak";
    let (backend, _installed) = planned(name, None);
    backend.set_growable(true);
    one_at_a_time(name, 1024);
    one_at_a_time(name, 1024);
    assert_eq!(backend.outstanding_bytes(), 1024, "the plan's block");
    backend.reset_peak();
    // Past the step's middle an array outgrows the plan while no array uses its block: the
    // block is given up, and the rest of the step is served apart. The big array's block would
    // take the cache past the most it has held: the block given up goes back first.
    let big = 64 << 10;
    one_at_a_time(name, big);
    assert_eq!(backend.peak_bytes(), big, "the big array alone");
    one_at_a_time(name, big);
    one_at_a_time(name, big);
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
}

#[test]
fn with_the_devices_granularity_growable_blocks_are_mapped_as_cuda_maps_them() {
    let _serial = serial();
    let name = "planned-granularity";
    let (backend, _installed) = planned(name, None);
    backend.set_growable(true);
    let granule = 2 << 20;
    backend.set_granularity(granule);
    // A plan of 1 KiB: smaller than CUDA maps, so as asked.
    one_at_a_time(name, 1024);
    one_at_a_time(name, 1024);
    assert_eq!(
        backend.outstanding_bytes(),
        1024,
        "the small plan's block, as asked"
    );
    gpucache::invalidate(name);
    // A plan of 33 MiB and a byte: its block is mapped in granules.
    let big = (33 << 20) + 1;
    one_at_a_time(name, big);
    one_at_a_time(name, big);
    assert_eq!(
        backend.outstanding_bytes(),
        34 << 20,
        "the plan's block, in whole granules"
    );
    // A step that outgrows it: a block of whole granules again, grown or new (the position
    // that grew planned a 256th larger, 40 MiB and 160 KiB: 42 MiB).
    one_at_a_time(name, 40 << 20);
    one_at_a_time(name, 40 << 20);
    assert_eq!(backend.outstanding_bytes(), 42 << 20);
    gpucache::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
    // Without it, as asked (aligned to 256 bytes).
    backend.set_granularity(0);
    one_at_a_time(name, big);
    one_at_a_time(name, big);
    assert_eq!(backend.outstanding_bytes(), (33 << 20) + 256);
    gpucache::invalidate(name);
}

/// A training step whose arrays come in another order every step (as a CNN's workspaces do
/// when the batch changes): `n` arrays of 64 KiB, one alive at a time but for an `extra` one
/// after the third, then the loss (a few bytes holding `value`), which outlives the step: a
/// training loop keeps it until the next step's replaces it.
fn step_with_loss(name: &str, n: usize, extra: usize, value: u8) -> Array<u8> {
    let _scope = gpucache::enter(name);
    let mut loss = None;
    for i in 0..n {
        let a = filled(DEV, i as u8, [65536]);
        if i == 3 {
            let extra = filled(DEV, 9u8, [extra]);
            assert!(common::all_eq(&extra, 9));
        }
        if i == n / 2 {
            loss = Some(filled(DEV, value, [4]));
        }
        assert!(common::all_eq(&a, i as u8));
    }
    loss.expect("made mid-step")
}

#[test]
fn a_small_array_kept_past_a_step_that_left_its_plan_keeps_the_block_for_the_next_plan() {
    let _serial = serial();
    let name = "planned-kept-loss";
    let (backend, _installed) = planned(name, None);
    // The first step's extra array is the largest: the block has room beside the next steps'.
    let mut loss = step_with_loss(name, 6, 32768, 0);
    let block = 65536 + 32768;
    let (mut allocs, mut peaks) = (Vec::new(), Vec::new());
    for (step, n) in [8, 5, 9, 6, 7, 8, 5, 9, 6, 7].into_iter().enumerate() {
        let value = step as u8 + 1;
        backend.reset_peak();
        let next = step_with_loss(name, n, 16384, value);
        // The last step's loss, in the block of the plan made since, was never overwritten.
        assert!(common::all_eq(&loss, value - 1), "step {step}");
        loss = next;
        allocs.push(backend.allocs());
        peaks.push(backend.peak_bytes());
    }
    // Every step leaves the plan (its arrays come in another order) and is planned again: the
    // new plan keeps the block, its positions placed around the loss alive there, rather than
    // the block staying with the loss and the next step making another beside it.
    assert_eq!(
        allocs[6], allocs[9],
        "no device allocation once settled: {allocs:?}"
    );
    assert!(
        peaks[6..].iter().all(|&p| p <= block + 2 * 256),
        "one block of {block} bytes and a loss apart: {peaks:?}"
    );
}

/// A small step of three arrays alive together (`first` bytes, `second` bytes and 64 KiB), each
/// filled and checked once all are made; `keep` returns the second instead of dropping it with
/// the others. Returns their addresses.
fn small_step(
    name: &str,
    first: usize,
    second: usize,
    keep: bool,
) -> (Vec<usize>, Option<Array<u8>>) {
    let _scope = gpucache::enter(name);
    let a = filled(DEV, 1u8, [first]);
    let b = filled(DEV, 2u8, [second]);
    let c = filled(DEV, 3u8, [65536]);
    assert!(common::all_eq(&a, 1) && common::all_eq(&b, 2) && common::all_eq(&c, 3));
    (vec![addr(&a), addr(&b), addr(&c)], keep.then_some(b))
}

/// A large step of another kind: one array of 256 KiB. Returns its address.
fn large_step(name: &str) -> usize {
    sequence(name, &[262144])[0]
}

/// Two large steps, whose plan makes the block, then three small ones, whose plan shares it,
/// its bytes past the small plan's footprint (the tail) unused. Returns the block's address.
fn large_then_small(name: &str) -> usize {
    large_step(name);
    let block = large_step(name);
    for _ in 0..3 {
        small_step(name, 2048, 256, false);
    }
    block
}

#[test]
fn a_position_grown_past_a_smaller_plan_is_served_from_the_blocks_tail() {
    let _serial = serial();
    let name = "planned-tail";
    let (backend, _installed) = planned(name, None);
    let block = large_then_small(name);
    let (allocs, held) = (backend.allocs(), backend.outstanding_bytes());
    // The second position grows (within the grown arrays' budget, the step smaller in all):
    // it is served apart, the step staying on its plan, from the tail, with no allocation.
    let (grown, _) = small_step(name, 1536, 512, false);
    assert_eq!(backend.allocs(), allocs, "no device allocation");
    let inside = block..block + 262144;
    assert!(
        grown.iter().all(|a| inside.contains(a)),
        "{grown:x?} in {inside:x?}"
    );
    assert_eq!(backend.outstanding_bytes(), held, "no more memory");
    // The plan, made again with room for the grown position, serves it at its place.
    let (again, _) = small_step(name, 1536, 512, false);
    assert_eq!(small_step(name, 1536, 512, false).0, again);
    assert_eq!(backend.allocs(), allocs);
}

#[test]
fn an_array_from_the_blocks_tail_kept_past_its_step_is_never_overwritten() {
    let _serial = serial();
    let name = "planned-tail-kept";
    let (backend, _installed) = planned(name, None);
    let block = large_then_small(name);
    let (_, kept) = small_step(name, 1536, 512, true);
    let kept = kept.expect("kept");
    let inside = block..block + 262144;
    assert!(inside.contains(&addr(&kept)), "from the tail");
    // The steps after it, of both kinds, are served around it (the large kind's position
    // over it apart).
    for step in 0..9 {
        match step % 3 {
            0 => small_step(name, 2048, 512, false),
            // Grown again: apart, from the tail, around the kept array.
            1 => small_step(name, 1024, 1024 + 256 * step, false),
            _ => (vec![large_step(name)], None),
        };
        assert!(
            common::all_eq(&kept, 2),
            "step {step}: the kept array was overwritten"
        );
    }
    drop(kept);
    // Once it is gone, both kinds settle again on the one block.
    small_step(name, 2048, 512, false);
    large_step(name);
    let settled = backend.allocs();
    for _ in 0..2 {
        small_step(name, 2048, 512, false);
        large_step(name);
    }
    assert_eq!(
        backend.allocs(),
        settled,
        "no device allocation once settled"
    );
    assert!(backend.outstanding_bytes() < 2 * 262144, "one block");
}

/// A dense step (every array alive through most of it, as a training step's activations and
/// gradients): 120 activations of 256 KiB kept to its end, a temporary of the same size made and
/// dropped beside each, and 120 arrays of 256 bytes kept too (a bias's gradient). Each array
/// holds its own value; all are checked at the step's end.
fn dense_step(name: &str) {
    let _scope = gpucache::enter(name);
    let mut big = Vec::new();
    let mut small = Vec::new();
    for i in 0..120u16 {
        big.push(filled(DEV, f32::from(i), [65536]));
        let temporary = filled(DEV, -1.0f32, [65536]);
        assert!(common::all_eq(&temporary, -1.0));
        drop(temporary);
        small.push(filled(DEV, (i % 251) as u8, [256]));
    }
    for (i, (b, s)) in (0..120u16).zip(big.iter().zip(&small)) {
        assert!(
            common::all_eq(b, f32::from(i)),
            "activation {i} overwritten"
        );
        assert!(
            common::all_eq(s, (i % 251) as u8),
            "small array {i} overwritten"
        );
    }
}

#[test]
fn a_dense_steps_small_arrays_stacked_in_its_plan_keep_their_values() {
    let _serial = serial();
    let name = "planned-dense";
    let (backend, _installed) = planned(name, None);
    dense_step(name);
    dense_step(name);
    let allocs = backend.allocs();
    // The step's peak: its activations, a temporary, and the small arrays (stacked on top:
    // each its own bytes, as they are all alive together anyway).
    let peak = 121 * (65536 * 4) + 120 * 256;
    assert_eq!(backend.outstanding_bytes(), peak);
    for _ in 0..3 {
        dense_step(name);
    }
    assert_eq!(backend.allocs(), allocs, "served from the plan");
}

/// One inference step of batch `batch` in scope `name`: its input (made before the step, as a
/// data loader's next batch is, and kept until the next step's is made), two layers'
/// activations, and an output read back. `input` is the previous step's input, dropped once
/// this step's exists; returns this step's, filled with `value`.
fn batch_step(name: &str, input: Option<Array<u8>>, batch: usize, value: u8) -> Array<u8> {
    let _scope = gpucache::enter(name);
    let x = filled(DEV, value, batch * 4096);
    drop(input);
    let h = filled(DEV, 1u8, batch * 16384);
    let y = filled(DEV, 2u8, batch * 8192);
    drop(h);
    let out = filled(DEV, 3u8, batch * 64);
    drop(y);
    assert!(common::all_eq(&x, value) && common::all_eq(&out, 3));
    x
}

/// An inference loop whose batch size changes every step, each step's input alive into the
/// next: the plan serves each input apart, and the blocks of earlier inputs are its spares.
/// Once every batch size has come twice, no step allocates, and no input is ever overwritten.
/// (Taking only a spare within twice the input's size at the cache's high-water mark, a small
/// batch after a large one found none, and a spare went back for a new block: a device
/// allocation in about one step of six, as long as the loop ran.)
#[test]
fn an_input_batch_of_varying_size_kept_into_the_next_step_settles_on_its_spares() {
    let _serial = serial();
    let name = "planned-batches";
    let (backend, _installed) = planned(name, None);
    let sizes = [1, 64, 8, 48, 2, 32, 16, 4];
    let mut rng = common::Rng::with_seed(7);
    let mut input = None;
    let mut order = Vec::new();
    for pass in 0..12 {
        let mut batches = sizes.to_vec();
        rng.shuffle(&mut batches);
        let before = backend.allocs();
        for (i, &batch) in batches.iter().enumerate() {
            let value = (pass * sizes.len() + i) as u8;
            let x = batch_step(name, input.take(), batch, value);
            assert!(common::all_eq(&x, value), "pass {pass}, batch {batch}");
            input = Some(x);
        }
        order.push(backend.allocs() - before);
    }
    assert!(
        order[2..].iter().all(|&n| n == 0),
        "device allocations per pass of the eight batch sizes: {order:?}"
    );
    drop(input);
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

/// A step that left its plan serves the arrays no gap of the plan's block holds apart; those
/// that die within the step, one after another (a detector's larger feature maps), share one
/// device allocation: the first one's block is a spare for the next, until the step ends, when
/// it goes back. Every array keeps its values while alive.
#[test]
fn arrays_apart_one_after_another_in_a_step_that_left_its_plan_share_a_block() {
    let _serial = serial();
    let name = "planned-apart-in-turn";
    let (backend, _installed) = planned(name, None);
    let small_step = || {
        let _scope = gpucache::enter(name);
        let keep = filled(DEV, 1u8, 4096);
        for k in 0..3u8 {
            let t = filled(DEV, 10 + k, 65536);
            assert!(common::all_eq(&t, 10 + k));
        }
        assert!(common::all_eq(&keep, 1));
    };
    small_step();
    small_step();
    let before = (backend.allocs(), backend.outstanding_bytes());
    small_step();
    assert_eq!(backend.allocs(), before.0, "the plan serves the small step");
    {
        // The same start, then arrays far larger than their positions: the step leaves its
        // plan, and no gap of the block holds them.
        let _scope = gpucache::enter(name);
        let keep = filled(DEV, 1u8, 4096);
        let start = backend.allocs();
        for k in 0..4u8 {
            let t = filled(DEV, 20 + k, 1 << 20);
            assert!(common::all_eq(&t, 20 + k));
        }
        assert!(common::all_eq(&keep, 1));
        assert_eq!(
            backend.allocs() - start,
            1,
            "four arrays of 1 MiB, each dead before the next, in one block"
        );
        assert!(backend.outstanding_bytes() >= before.1 + (1 << 20));
    }
    // At the step's end the block kept for the step goes back.
    assert!(
        backend.outstanding_bytes() < 1 << 20,
        "{} bytes held after the step, {} before it",
        backend.outstanding_bytes(),
        before.1
    );
    gpucache::empty_cache();
    assert_eq!(backend.outstanding_bytes(), 0);
}

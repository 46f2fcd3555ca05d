//! Unit tests of what the public API cannot show: how many views and plans the planned caches
//! make.

use crate::backend::VIEWS_MADE;
use crate::cache::{
    MAX_SHELVED_POSITIONS, ONLINE_STEPS, PLANS_MADE, RESTS_KEPT, ROOMS_HELD, SHADOWED_STEPS,
    SHELVED_MOST, SLAB_BYTES, SLABS_MADE, SLOW_TAKES, VIEWS_SOUGHT,
};
use std::sync::Arc;

use crate::testing::{BackendGuard, CountingBackend, use_backend};
use crate::{Array, CacheConfig, Device, KeyPolicy};

/// A counting backend for this thread's CPU allocations and cache `name` planned (the
/// default, stated), with the lock of [`serial`]: hold all three through the test.
fn planned(
    name: &str,
) -> (
    Arc<CountingBackend>,
    BackendGuard,
    std::sync::MutexGuard<'static, ()>,
) {
    // Keeps the unit tests that give back every cache's memory from emptying this cache.
    let serial = crate::sync::global_tests();
    let backend = CountingBackend::new();
    let installed = use_backend(&backend);
    crate::configure(
        name,
        CacheConfig {
            key: KeyPolicy::Planned,
            ..CacheConfig::default()
        },
    );
    (backend, installed, serial)
}

/// The views made on this thread so far.
fn views() -> u64 {
    VIEWS_MADE.with(std::cell::Cell::get)
}

/// A decoder's cache of keys and values, one token longer every step, made in one step and dropped
/// in the next (so planned apart): each comes from the block of the one before last, a spare,
/// through the view that array had, so a step after the first few makes no view at all (on CUDA,
/// with several streams, a view gets a cudarc slice with two events). The values and the bytes held
/// are checked too: the view spans its block, and the block goes back to the device with it.
#[test]
fn a_spare_serves_its_next_array_through_the_view_it_kept() {
    let name = "unit-spare-view";
    let (backend, _installed, _serial) = planned(name);
    let mut kv: Option<(Array<u32>, u32)> = None;
    let mut made = Vec::new();
    for t in 0..10u32 {
        let before = views();
        let _scope = crate::enter(name);
        let x = Array::from_slice(Device::Cpu, &[t; 64], 64).unwrap();
        let n = 4096 + 16 * t as usize;
        let mut next = Array::<u32>::zeros(Device::Cpu, n).unwrap();
        next.as_mut_slice().unwrap().fill(t + 1000);
        drop(x);
        if let Some((old, w)) = kv.take() {
            assert!(holds(&old, w + 1000));
        }
        assert!(holds(&next, t + 1000));
        kv = Some((next, t));
        drop(_scope);
        made.push(views() - before);
    }
    assert!(
        made[4..].iter().all(|&n| n == 0),
        "views made per step: {made:?}"
    );
    let allocs = backend.allocs();
    drop(kv);
    crate::invalidate(name);
    assert_eq!(backend.allocs(), allocs);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// One step of a server: a prompt (a large first array, then a chain of twelve arrays each
/// dropped two later, so that positions share offsets at different times) or a decoding step
/// (a small first array, then a chain of eight larger ones: it does not fit the prompt's plan).
/// Checks the values; returns the views it made.
fn serve_step(name: &str, prompt: bool) -> u64 {
    let before = views();
    let _scope = crate::enter(name);
    let (first, each, n) = if prompt {
        (1 << 16, 4096, 12)
    } else {
        (256, 8192, 8)
    };
    let head = filled(first, 7);
    chain((0..n).map(|i| each + 64 * (i % 3)));
    assert!(holds(&head, 7));
    drop((head, _scope));
    views() - before
}

/// An array of `n` elements, each `v`.
fn filled(n: usize, v: u32) -> Array<u32> {
    Array::from_slice(Device::Cpu, &vec![v; n], n).unwrap()
}

/// Whether every element of `a` is `v`.
fn holds(a: &Array<u32>, v: u32) -> bool {
    a.to_vec().unwrap().iter().all(|&e| e == v)
}

/// Arrays of `lens` elements in order, each filled with its index and dropped two allocations
/// later (its values checked then), in the caller's scope.
fn chain(lens: impl IntoIterator<Item = usize>) {
    let mut chain: Vec<(Array<u32>, u32)> = Vec::new();
    for (i, len) in lens.into_iter().enumerate() {
        let i = i as u32;
        let a = filled(len, i);
        if chain.len() == 2 {
            let (old, v) = chain.remove(0);
            assert!(holds(&old, v));
        }
        chain.push((a, i));
    }
}

/// A scope whose steps alternate between two kinds (a server's prompts and decoding steps)
/// keeps a plan for each, sharing one block: the idle views of the plan shelved meanwhile are
/// kept for it, every one (several at an offset that several positions share at different
/// times), so that once both kinds have run, switching between them makes no view.
#[test]
fn plans_that_take_turns_keep_each_others_views() {
    let name = "unit-serve-views";
    let (backend, _installed, _serial) = planned(name);
    let mut made = Vec::new();
    for request in 0..4 {
        made.push(serve_step(name, true));
        for _ in 0..3 {
            made.push(serve_step(name, false));
        }
        if request == 1 {
            made.clear();
        }
    }
    assert!(
        made.iter().all(|&n| n == 0),
        "views made per step in the last two requests: {made:?}"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// The plans made on this thread so far.
fn plans() -> u64 {
    PLANS_MADE.with(std::cell::Cell::get)
}

/// One step of `name`: a [`chain`] of arrays of `lens` elements.
fn chain_step(name: &str, lens: &[usize]) {
    let _scope = crate::enter(name);
    chain(lens.iter().copied());
}

/// `rounds` rounds of `kinds` kinds of step of `name` taking turns, kind `k` a [`chain_step`] of
/// `kind(k)`.
fn take_turns(name: &str, kind: &impl Fn(usize) -> Vec<usize>, kinds: usize, rounds: usize) {
    for _ in 0..rounds {
        (0..kinds).for_each(|k| chain_step(name, &kind(k)));
    }
}

/// [`take_turns`] for `warm` rounds, then for `later` rounds in which no plan is made and nothing
/// is allocated from `backend` (each kind follows a plan); then every block goes back with
/// `invalidate`.
fn kinds_settle(
    (name, backend): (&str, &CountingBackend),
    kind: impl Fn(usize) -> Vec<usize>,
    kinds: usize,
    (warm, later): (usize, usize),
) {
    take_turns(name, &kind, kinds, warm);
    let (made, allocs) = (plans(), backend.allocs());
    take_turns(name, &kind, kinds, later);
    assert_eq!(plans(), made, "every kind follows its plan");
    assert_eq!(backend.allocs(), allocs, "served from the plans' block");
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Two kinds of step that begin alike (their first arrays the same size): a decoding step, and
/// now and then one that also makes arrays the next steps keep (a Whisper-style decoder
/// projecting the encoder's output for a new request). That step follows the decoding steps'
/// plan, leaves it, and is planned; the decoding step after it goes back to its own plan, which
/// steps followed to their end, rather than follow the other kind's, leave it, and be planned
/// again: one plan a round, not two.
#[test]
fn a_step_after_a_rarer_kind_that_begins_alike_follows_its_own_plan() {
    let name = "unit-begins-alike";
    let (backend, _installed, _serial) = planned(name);
    let decode: Vec<usize> = std::iter::once(256).chain([8192; 8]).collect();
    let mut kept: Vec<Array<u32>> = Vec::new();
    let mut round = |r: u32| {
        for _ in 0..3 {
            chain_step(name, &decode);
        }
        let _scope = crate::enter(name);
        let head = filled(256, 1);
        let mut next = Vec::new();
        for i in 0..6 {
            chain([8192, 4096]);
            next.push(filled(16384 + 64 * i, r));
        }
        drop((head, std::mem::replace(&mut kept, next)));
    };
    (0..3).for_each(&mut round);
    let made = plans();
    (3..6).for_each(&mut round);
    assert!(kept.iter().all(|a| holds(a, 5)));
    assert_eq!(plans() - made, 3, "one plan a round: the other kind's");
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A step much smaller than its plan that leaves it (its sizes in another order: a smaller
/// batch whose workspaces come elsewhere) is served from the plan's block and not planned: a
/// plan of its own would only make the next step, of another kind again, leave that one. A kind
/// of step that comes again soon is planned. No step here allocates from the device after the
/// first two.
#[test]
fn a_much_smaller_step_unlike_the_last_ones_is_not_planned() {
    let name = "unit-unplanned";
    let (backend, _installed, _serial) = planned(name);
    let large: Vec<usize> = (0..12).map(|i| [16384, 256][i % 2]).collect();
    let small = |n: usize| -> Vec<usize> { (0..12).map(|i| [256, n][i % 2]).collect() };
    chain_step(name, &large);
    chain_step(name, &large);
    let (made, allocs) = (plans(), backend.allocs());
    chain_step(name, &small(8192));
    chain_step(name, &small(6144));
    assert_eq!(
        plans(),
        made,
        "a smaller step unlike the last ones is not planned"
    );
    chain_step(name, &large);
    assert_eq!(
        plans(),
        made,
        "the plan stayed, and the large step follows it"
    );
    chain_step(name, &small(8192));
    assert_eq!(
        plans(),
        made + 1,
        "a kind of step that comes again is planned"
    );
    assert_eq!(
        backend.allocs(),
        allocs,
        "every step was served from the plan's block"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Kinds of step taking turns in one scope (inputs whose structure changes with their size:
/// cuDNN picks other algorithms, a model other paths) keep a plan each, up to the shelf's room:
/// six kinds, each of its own count and first size, are planned while they come the first
/// times, then follow their plans, with no plan made and no device allocation (with three
/// shelved, the kind whose plan went last came back to another kind's plan, and was planned
/// again, at every turn).
#[test]
fn six_kinds_of_step_taking_turns_keep_a_plan_each() {
    let name = "unit-six-kinds";
    let (backend, _installed, _serial) = planned(name);
    // The first array four times the kind before's, then one large array that every kind
    // makes (so that none is much smaller than the others), k small ones and a larger one: no
    // kind's step is another's with smaller arrays.
    let kind = |k: usize| -> Vec<usize> {
        (0..k + 4)
            .map(|i| match i {
                0 => 256 << (2 * k),
                1 => 1 << 18,
                i if i == k + 3 => 4096,
                _ => 256,
            })
            .collect()
    };
    kinds_settle((name, &backend), kind, 6, (3, 2));
}

/// Kinds of step taking turns whose arrays come in other orders (a batch of another size, for
/// which cuDNN picks other algorithms and makes its workspaces elsewhere), none much smaller
/// than the others: each kind, once it came again, gets a plan of its own, where a plan merged
/// from two kinds holds neither, and the steps then follow their plans, with no plan made and no
/// device allocation. Before, every step here left its plan and was planned again (merged with
/// the plan it left, or on its own with that plan dropped), two in three with a device
/// allocation.
#[test]
fn kinds_of_step_in_other_orders_that_come_again_get_a_plan_each() {
    let name = "unit-reordered-kinds";
    let (backend, _installed, _serial) = planned(name);
    // The same arrays after the first, every kind's but some small ones in between: a kind's
    // later large arrays k positions after the first kind's, where the other kinds' plans
    // have small ones.
    let (large, small) = (32 << 10, 1 << 10);
    let kind = |k: usize| -> Vec<usize> {
        let body = [large, small, small];
        std::iter::once((16 - 2 * k) << 10)
            .chain(body)
            .chain(std::iter::repeat_n(small, k))
            .chain(body.repeat(3))
            .chain(std::iter::repeat_n(small, 2 - k))
            .collect()
    };
    kinds_settle((name, &backend), kind, 3, (2, 3));
}

/// The shelf of plans is bounded in positions as well as in plans: four kinds of long steps
/// taking turns (1400 to 1700 allocations each, in unit tests a bound of 4096 positions) keep
/// no more of them shelved than the bound allows, the least recently used going, and their
/// arrays keep their values (each checked as it drops) and the memory goes back.
#[test]
fn the_shelf_holds_no_more_positions_than_its_bound() {
    let name = "unit-shelf-positions";
    let (backend, _installed, _serial) = planned(name);
    let kind = |k: usize| -> Vec<usize> {
        (0..1400 + 100 * k)
            .map(|i| match i {
                0 => 256 << (2 * k),
                1 => 1 << 18,
                _ => 256,
            })
            .collect()
    };
    SHELVED_MOST.with(|most| most.set(0));
    take_turns(name, &kind, 4, 3);
    let most = SHELVED_MOST.with(std::cell::Cell::get);
    // Three kinds shelved would be 4500 positions or more: at most two were.
    assert!(most >= 2800, "plans were shelved: {most} positions at most");
    assert!(
        most <= MAX_SHELVED_POSITIONS,
        "{most} positions shelved, more than {MAX_SHELVED_POSITIONS}"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Arrays that outlive their step (a model's inputs, kept into the next step) vary in size: a
/// spare up to four times an array's size serves it while a new block would keep the cache
/// within the most it has held, rather than a device allocation.
#[test]
fn a_spare_four_times_larger_serves_an_array_below_the_high_water_mark() {
    let name = "unit-spare-larger";
    let (backend, _installed, _serial) = planned(name);
    let big = 1 << 14;
    let (a0, b0) = {
        let _scope = crate::enter(name);
        let a = filled(big, 1);
        let b = filled(big, 2);
        (a, b)
    };
    // The cache's high-water mark holds both. A spare at once (`a0`), held at the mark: a
    // smaller array gets a block of its own (a spare four times as large would pass the mark).
    let a1 = {
        let _scope = crate::enter(name);
        drop(a0);
        filled(big / 4, 3)
    };
    // Below the mark now: `b0`'s block, four times as large, serves the next one.
    let allocs = backend.allocs();
    let a2 = {
        let _scope = crate::enter(name);
        drop(b0);
        filled(big / 4, 4)
    };
    assert_eq!(backend.allocs(), allocs, "the spare served it");
    assert!(holds(&a1, 3));
    assert!(holds(&a2, 4));
    drop((a1, a2));
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A step whose plan, merged with the plan before, no longer fits the block, while its own plan
/// does, and which keeps an array of the block alive into the next step (a training loop's
/// loss): its own plan is placed around that array and keeps the block. Merged, the block was
/// retired under the array, and the next step allocated a block beside it (a step's worth of
/// bytes more, and one more allocation).
#[test]
fn a_step_whose_merged_plan_outgrows_the_block_it_holds_keeps_the_block_with_its_own_plan() {
    let name = "unit-own-plan";
    let (backend, _installed, _serial) = planned(name);
    let (a, b, c, d) = (32768, 4096, 8192, 8192);
    // A chain, each array dropped two allocations later; the last one too, or returned.
    let step = |lens: &[usize], keep: bool| -> Option<Array<u32>> {
        let _scope = crate::enter(name);
        let (head, last) = lens.split_at(lens.len() - 1);
        chain(head.iter().copied());
        let loss = filled(last[0], 9);
        keep.then_some(loss)
    };
    let p = [a, b, a, b, a, 512];
    // Larger than `p` at its second array, smaller at its third: its own plan holds less than
    // `p`'s, the two merged more.
    let s = [a, c, a - d, b, a, 512];
    for _ in 0..2 {
        step(&p, false);
    }
    // Its last array, planned to drop within the step, kept into the next one.
    let loss = step(&s, true).unwrap();
    backend.reset_peak();
    let (held, allocs) = (backend.outstanding_bytes(), backend.allocs());
    step(&s, false);
    assert!(holds(&loss, 9));
    drop(loss);
    // One allocation: the last array, apart (the step before kept its position's alive; that
    // step outgrew the plan before it, so the position is not held over).
    assert_eq!(
        backend.allocs(),
        allocs + 1,
        "the block served the next step"
    );
    assert!(
        backend.peak_bytes() <= held + 4096,
        "{} bytes held at most, {held} before",
        backend.peak_bytes()
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A second step that leaves the first step's plan where the first made arrays the later ones
/// do not (a 32 KiB array, then its optimizer's state, kept apart): an allocation far larger
/// than its position's array there is another array, served from the plan's block (not apart
/// as that position grown), and so are the arrays it makes where the plan has the state (not
/// one device allocation each).
#[test]
fn a_second_step_unlike_the_first_is_served_from_the_first_plans_block() {
    let name = "unit-state-run";
    let (backend, _installed, _serial) = planned(name);
    // The first step: a large array, then one only the first step makes, then the state (ten
    // arrays kept), then a temporary.
    let state: Vec<Array<u32>> = {
        let _scope = crate::enter(name);
        drop(filled(16 << 20, 1));
        drop(filled(8 << 10, 2));
        let state = (0..10).map(|k| filled(1024, 10 + k)).collect();
        drop(filled(256 << 10, 3));
        state
    };
    let allocs = backend.allocs();
    {
        let _scope = crate::enter(name);
        drop(filled(12 << 20, 1));
        // Where the first step made its 32 KiB array: 4 MiB.
        let large = filled(1 << 20, 4);
        // Where it made its state: temporaries, alive together.
        let temps: Vec<Array<u32>> = (0..10).map(|k| filled(1024, 20 + k)).collect();
        for (k, t) in temps.iter().enumerate() {
            assert!(holds(t, 20 + k as u32));
        }
        assert!(holds(&large, 4));
    }
    // The plan's block, made at the step's first allocation, and nothing else.
    assert_eq!(backend.allocs(), allocs + 1, "served from the block");
    for (k, s) in state.iter().enumerate() {
        assert!(holds(s, 10 + k as u32));
    }
    drop(state);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A step larger than any before whose first array, its input (a 13th of the plan), outgrows
/// its position: the step leaves its plan at once, and the plan scaled as it grew holds the
/// input too, in one new block (one device allocation). Served apart, the input was held beside
/// that block, a second allocation.
#[test]
fn a_larger_steps_input_is_served_from_the_plan_scaled() {
    let name = "unit-grown-input";
    let (backend, _installed, _serial) = planned(name);
    // The input, alive through the step, then a chain of arrays four times its size.
    let step = |scale: usize| {
        let _scope = crate::enter(name);
        let input = filled(256 * scale, 5);
        chain((0..6).map(|_| 1024 * scale));
        assert!(holds(&input, 5));
    };
    for _ in 0..3 {
        step(1024);
    }
    let allocs = backend.allocs();
    step(1536);
    assert_eq!(
        backend.allocs(),
        allocs + 1,
        "one block for the larger step"
    );
    let allocs = backend.allocs();
    step(1536);
    assert_eq!(
        backend.allocs(),
        allocs,
        "and its plan's block serves the next"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A larger step that leaves its plan with its input alive in the plan's block (so its rest comes
/// from the block's gaps), and whose last array, from the gaps, is kept into the next step (a
/// training loop's loss, which the steps before dropped in the step): its plan, placed around
/// that array, outgrows the block, which grows in place under it, rather than being retired
/// under it while the next step makes a block of the new plan beside it.
#[test]
fn a_block_outgrown_under_an_array_kept_past_its_step_grows_in_place() {
    let name = "unit-grown-under-loss";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    // The input, alive through the step, then a chain, then the loss (kept if `keep`).
    let step = |n: usize, keep: bool| -> Option<Array<u32>> {
        let _scope = crate::enter(name);
        let input = filled(2048, 7);
        chain([n, 1024, n, 1024, n]);
        let loss = filled(64, 9);
        assert!(holds(&input, 7));
        keep.then_some(loss)
    };
    for _ in 0..2 {
        step(8192, false);
    }
    let held = backend.outstanding_bytes();
    // Four times larger past the input: its rest from the gaps, and what they cannot hold apart.
    let loss = step(32768, true).unwrap();
    assert_eq!(backend.grows(), 1, "the block grew under the loss");
    let grown = backend.outstanding_bytes();
    backend.reset_peak();
    let allocs = backend.allocs();
    step(32768, false);
    assert!(holds(&loss, 9));
    drop(loss);
    // No allocation: the loss's position, whose array the step before kept, is held over (in
    // the block, placed around the last loss, pinned), not apart.
    assert_eq!(
        backend.allocs(),
        allocs,
        "the grown block served the next step"
    );
    assert!(
        backend.peak_bytes() <= grown + 1024 && grown < held + 4 * 32768 * 4,
        "one block: {} bytes held at most, {grown} after the growth, {held} before",
        backend.peak_bytes()
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A larger step (an encoder's, its batch and length grown) whose first array, at its position
/// in the plan's block, lives on for a few allocations (not long: the block would soon be
/// unused), but whose arrays meanwhile, grown, are more than half the plan: the rest of the step
/// is placed again around that array, in the block grown in place, with no other device
/// allocation. Before, the step waited for the block, its arrays apart meanwhile (a device
/// allocation each), until half the plan had gone apart, then was served from the gaps of a
/// block too small for it, and apart.
#[test]
fn a_step_that_would_wait_past_half_its_plan_is_placed_around_a_brief_array() {
    let name = "unit-grown-around-brief";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let step = |len: usize| {
        let _scope = crate::enter(name);
        // A mask of the same size at every scale, dropped after two arrays of forty.
        let mask = filled(256, 3);
        chain((0..2).map(|_| len));
        assert!(holds(&mask, 3));
        drop(mask);
        chain((0..38).map(|_| len));
    };
    for _ in 0..3 {
        step(16 * 1024);
    }
    let allocs = backend.allocs();
    step(24 * 1024);
    assert_eq!(backend.grows(), 1, "the block grew in place");
    // The testing backend counts a growth as a device allocation.
    assert_eq!(
        backend.allocs(),
        allocs + 1,
        "its growth, and no array apart"
    );
    let allocs = backend.allocs();
    step(24 * 1024);
    assert_eq!(
        backend.allocs(),
        allocs,
        "and the next step follows its plan"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A training step whose batch, padded to its largest image, grew threefold while its images
/// did not, in a block larger than its plan (kept from a larger kind of step): the step's arrays
/// so far grew less in all than the block holds over the plan, but its largest array, which the
/// rest of the step grows as, grew more. It outgrew its plan: the rest is placed again around its
/// arrays alive in the block, grown in place once. Judged by the total alone, the step was served
/// from the block's gaps, and what they could not hold went apart, a device allocation each
/// (a detector trained on images of varying size: 96 device allocations in one step).
#[test]
fn a_step_whose_largest_array_grew_past_the_block_outgrows_its_plan() {
    let name = "unit-outgrown-by-largest";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    // Two images, their batch of `batch` elements, three activations kept for the backward
    // pass (a larger kind of step makes an extra array among them), then the backward's chain;
    // the images live through the step.
    let step = |batch: usize, extra: bool| {
        let _scope = crate::enter(name);
        let images = (filled(3072, 1), filled(3072, 2));
        let x = filled(batch, 3);
        let acts: Vec<_> = (0..3).map(|i| filled(batch, 10 + i)).collect();
        if extra {
            drop(filled(batch / 2, 4));
        }
        chain((0..4).map(|_| batch));
        assert!(holds(&x, 3) && acts.iter().zip(10..).all(|(a, i)| holds(a, i)));
        assert!(holds(&images.0, 1) && holds(&images.1, 2));
    };
    for _ in 0..3 {
        step(8192, true);
    }
    // A smaller kind: planned again, in the larger kind's block.
    for _ in 0..3 {
        step(4096, false);
    }
    let (allocs, grows) = (backend.allocs(), backend.grows());
    step(12288, false);
    assert_eq!(backend.grows(), grows + 1, "the block grew in place");
    // The testing backend counts a growth as a device allocation.
    assert_eq!(
        backend.allocs(),
        allocs + 1,
        "its growth, and no array apart"
    );
    // The next step follows the plan scaled whole (each position three times its size), which
    // takes more than the rest's placement around the images did: its block may grow once
    // more, but no array goes apart.
    let (allocs, grows) = (backend.allocs(), backend.grows());
    step(12288, false);
    assert_eq!(
        backend.allocs() - allocs,
        backend.grows() - grows,
        "the next step allocates nothing but its block's growth"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A training step's pass in the caller's scope: eight activations of 1 MiB (the last `grow`
/// elements larger) kept through a chain of six more, checked, and returned (the caller drops
/// them).
fn activations_through_a_chain(grow: usize) -> Vec<Array<u32>> {
    let acts: Vec<_> = (0..8)
        .map(|i| filled(262_144 + if i == 7 { grow } else { 0 }, 10 + i))
        .collect();
    chain([262_144; 6]);
    assert!(acts.iter().zip(10..).all(|(a, i)| holds(a, i)));
    acts
}

/// A training loop whose optimizer makes its state at a later step than the first (a gradient
/// scaler skipped the first optimizer steps; a layer dropped until then): 40 arrays, more than
/// the 32 a block keeps under it otherwise but a small share of it, made from the block's gaps
/// and kept for good. The block is kept under them as the next plan's (placed around them, grown
/// in place), and the steps after, of the kind before the state, follow that plan rather than
/// the one shelved before it, whose positions over the state would go apart at every step.
/// Before, the block was retired under the state and the next plan's block made beside it,
/// most of the old one unused for good (ResNet-50 trained in fp16: 1.866x of its peak live
/// bytes); kept, with the shelved plan switched in, four arrays went apart at every step.
#[test]
fn a_block_is_kept_under_an_optimizers_state_made_after_the_first_step() {
    let name = "unit-late-state";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut state: Vec<Array<u32>> = Vec::new();
    // A training step's pass, and at the fourth step the state.
    let mut step = |k: usize| {
        let _scope = crate::enter(name);
        if k == 0 {
            // What only a first step makes (a library's workspace): the second step is planned
            // again, not from a cold start.
            drop(filled(262_144, 9));
        }
        drop(activations_through_a_chain(0));
        if k == 3 {
            state.extend((0..40).map(|i| filled(4096, 100 + i)));
        }
    };
    for k in 0..3 {
        step(k);
    }
    let block = backend.outstanding_bytes();
    step(3);
    let (allocs, held) = (backend.allocs(), backend.outstanding_bytes());
    for k in 4..9 {
        step(k);
    }
    assert_eq!(
        backend.allocs(),
        allocs,
        "no device allocation after the step that made the state"
    );
    assert_eq!(backend.outstanding_bytes(), held);
    // The block, grown by about the state's bytes (640 KiB), not a second block.
    assert!(
        held < block + block / 8,
        "{held} bytes held, {block} before the state"
    );
    assert!(state.iter().zip(100..).all(|(a, i)| holds(a, i)));
    drop(state);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Gradients accumulated over four micro-batches, one step each: the backward pass of the first
/// micro-batch of each optimizer step makes them (40 arrays, kept to the last micro-batch, the
/// step leaving its plan), and the first optimizer step (the fourth micro-batch) made its state
/// (40 more, kept for good). Together they hold a fifth of the block, more than the eighth it
/// kept as pins before: it was retired under them at each optimizer step, the next plan's block
/// made beside it (ResNet-50 on micro-batches of 16: 1.892x of its peak live bytes). The block is
/// kept under them, grown in place.
///
/// The next micro-batches make the same gradients, add them in and drop them: the same
/// allocations, which the plan made from the first micro-batch had apart, so that each took a
/// block of the device at every optimizer step (ResNet-50: ten). Held over, they are served in
/// the block; the first micro-batch, which keeps them, follows a plan that holds them to its
/// end (made at the end of the optimizer's step, which dropped them), and the micro-batches
/// after it follow the last one's plan, made from that step, to their ends; once the block has
/// grown to both kinds of micro-batch, no step needs the device.
/// Micro-batch `k` of a loop that accumulates gradients over four, in scope `name`: eight
/// activations of 1 MiB, a backward pass (a chain of 1 MiB arrays, five gradients of 32 KiB
/// after each: kept in `grads` at the first micro-batch, made where the plan has other arrays,
/// else added in and dropped), and at the last, once the others dropped, an optimizer's step
/// past the others' end: at the
/// first one, its `state` made (`state_len`: the arrays' elements, 40 of them), then a temporary
/// beside each array of the state. Every array's values are checked.
fn micro_batch(
    name: &str,
    k: usize,
    grads: &mut Vec<Array<u32>>,
    state: &mut Vec<Array<u32>>,
    state_len: usize,
) {
    let _scope = crate::enter(name);
    let acts: Vec<_> = (0..8).map(|i| filled(262_144, 10 + i)).collect();
    let mut chain: Vec<(Array<u32>, u32)> = Vec::new();
    for i in 0..8u32 {
        chain.push((filled(262_144, i), i));
        if chain.len() > 2 {
            let (old, v) = chain.remove(0);
            assert!(holds(&old, v));
        }
        let made = (0..5).map(|j| (filled(8192, 200 + 5 * i + j), 200 + 5 * i + j));
        if k.is_multiple_of(4) {
            grads.extend(made.map(|(g, _)| g));
        } else {
            for (g, v) in made {
                assert!(holds(&g, v));
            }
        }
    }
    assert!(acts.iter().zip(10..).all(|(a, i)| holds(a, i)));
    drop((acts, chain));
    if k % 4 == 3 {
        // An optimizer with state (of `state_len` elements an array) makes it at its first step
        // and a temporary for each array at every step; one with none (SGD) updates in place.
        if k == 3 && state_len > 0 {
            state.extend((0..40).map(|i| filled(state_len, 100 + i)));
        }
        for (s, i) in state.iter().zip(100..) {
            let t = filled(state_len, 200 + i);
            assert!(holds(s, i) && holds(&t, 200 + i));
        }
        assert!(grads.iter().zip(200..).all(|(a, i)| holds(a, i)));
        grads.clear();
    }
}

#[test]
fn gradients_accumulated_over_micro_batches_keep_the_block() {
    let name = "unit-accumulated";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut state: Vec<Array<u32>> = Vec::new();
    let mut grads: Vec<Array<u32>> = Vec::new();
    let mut step = |k: usize| micro_batch(name, k, &mut grads, &mut state, 8192);
    for k in 0..4 {
        step(k);
    }
    let block = backend.outstanding_bytes();
    backend.reset_peak();
    for k in 4..12 {
        step(k);
    }
    let allocs = backend.allocs();
    let kept = || RESTS_KEPT.with(std::cell::Cell::get);
    let kept0 = kept();
    let slow = || SLOW_TAKES.with(std::cell::Cell::get);
    let sought = || VIEWS_SOUGHT.with(std::cell::Cell::get);
    for k in 12..32 {
        let (slow0, sought0) = (slow(), sought());
        step(k);
        // The plans of the cycle come again, and with them their positions' views, stashed
        // when each gave way to the next: only the first micro-batch's gradients look for
        // theirs, gone loose when the optimizer's step dropped the arrays that had them (every
        // position of the steps planned again looked, before).
        let wanted = if k % 4 == 0 { 40 } else { 0 };
        assert_eq!(sought() - sought0, wanted, "step {k}: views looked for");
        // Each step follows its plan, the hit path serving all but its first allocation: the
        // first micro-batch's holds its gradients to the step's end (made so at the end of the
        // optimizer's step, which dropped them), none past its planned end; the plan of the
        // micro-batches after it is the last one's, made from that step (the first ended
        // before it), which the optimizer's step follows to its end.
        assert_eq!(slow() - slow0, 1, "step {k}: allocations on the slow path");
    }
    assert_eq!(
        kept() - kept0,
        0,
        "first micro-batches whose rest was placed again"
    );
    let peak = backend.peak_bytes();
    assert!(
        peak < block + block / 2,
        "{peak} bytes held at most, {block} after the first optimizer step"
    );
    assert_eq!(
        backend.allocs(),
        allocs,
        "a device allocation after the third optimizer step"
    );
    assert!(state.iter().zip(100..).all(|(a, i)| holds(a, i)));
    drop(state);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A first micro-batch that keeps its gradients past the ends its plan gave their positions (the
/// other micro-batches drop them within the step; the step before it, an evaluation step here,
/// did not keep them, so the plan does not hold them to its end) places the rest of the step
/// again around them: the hit path serves that rest too, the gradients in no position's way.
/// Before, every allocation after the first gradient kept took the slow path, which looked at
/// each gradient kept (ViT-S: 446 of its 644 allocations, past 152 gradients).
#[test]
fn the_rest_of_a_first_micro_batch_placed_around_its_gradients_takes_the_hit_path() {
    let name = "unit-kept-rest-hits";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut state: Vec<Array<u32>> = Vec::new();
    let mut grads: Vec<Array<u32>> = Vec::new();
    // Four micro-batches, then a step that makes what a middle one does and keeps nothing.
    let mut step = |s: usize| {
        let k = if s % 5 == 4 { 1 } else { s / 5 * 4 + s % 5 };
        micro_batch(name, k, &mut grads, &mut state, 8192);
    };
    for s in 0..15 {
        step(s);
    }
    let slow = || SLOW_TAKES.with(std::cell::Cell::get);
    let kept = || RESTS_KEPT.with(std::cell::Cell::get);
    for s in 15..40 {
        let (slow0, kept0) = (slow(), kept());
        step(s);
        if s % 5 == 0 {
            assert_eq!(kept() - kept0, 1, "step {s}: its rest placed again");
            // Its first allocation, and the one that met a gradient past its end.
            let took = slow() - slow0;
            assert!(
                took <= 2,
                "step {s}: {took} of 56 allocations on the slow path"
            );
        }
    }
    drop(state);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Gradients accumulated over four micro-batches with an optimizer that makes nothing (SGD,
/// updating in place): the step that drops the gradients follows its plan to its end. Its plan,
/// placed around them, is made again around the pins still alive, so that the next first
/// micro-batch keeps its gradients where the one before did: from the fourth optimizer step on,
/// the plans come again, and every view is one kept at its offset (the first cycle finds out
/// that a first micro-batch follows the step that drops the gradients). Before, each first
/// micro-batch kept its gradients where a plan placed around the last ones put them, and no
/// plan came again (ResNet-50 on four micro-batches: two plans from scratch and 700 to 900
/// views made at every optimizer step).
#[test]
fn gradients_an_optimizer_step_drops_leave_the_next_plans_as_they_were() {
    let name = "unit-held-dropped";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut state: Vec<Array<u32>> = Vec::new();
    let mut grads: Vec<Array<u32>> = Vec::new();
    let mut step = |k: usize| micro_batch(name, k, &mut grads, &mut state, 0);
    for k in 0..16 {
        step(k);
    }
    let (views0, allocs) = (views(), backend.allocs());
    for k in 16..40 {
        step(k);
    }
    assert_eq!(
        views() - views0,
        0,
        "views made after the fourth optimizer step"
    );
    assert_eq!(
        backend.allocs(),
        allocs,
        "a device allocation after the fourth optimizer step"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// An optimizer's state made at the first optimizer step, past the plan of the micro-batches
/// before (which the step followed to its end), in the block's gaps: 40 arrays of 192 KiB, 61%
/// of the block (GPT-2's AdamW state on micro-batches: 296 arrays, 56% of its block). Retired
/// under them, as too many pins holding too much of it, the block stayed beside the next plan's
/// for good (25.3 MB held where 21.6 MB do); kept, the plans after are placed around them, the
/// block grown in place.
#[test]
fn an_optimizers_state_made_past_the_plan_keeps_the_block_whatever_its_share() {
    let name = "unit-state-past-plan";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut state: Vec<Array<u32>> = Vec::new();
    let mut grads: Vec<Array<u32>> = Vec::new();
    let mut step = |k: usize| micro_batch(name, k, &mut grads, &mut state, 49_152);
    for k in 0..3 {
        step(k);
    }
    let block = backend.outstanding_bytes();
    for k in 3..12 {
        step(k);
    }
    let (allocs, held) = (backend.allocs(), backend.outstanding_bytes());
    backend.reset_peak();
    for k in 12..24 {
        step(k);
    }
    let state_bytes = 40 * 49_152 * 4;
    let peak = backend.peak_bytes();
    assert!(
        peak < block + state_bytes + block / 8,
        "{peak} bytes held at most: {block} before the state, {state_bytes} of state"
    );
    assert_eq!(
        backend.allocs(),
        allocs,
        "a device allocation after step 12"
    );
    assert_eq!(backend.outstanding_bytes(), held);
    assert!(state.iter().zip(100..).all(|(a, i)| holds(a, i)));
    drop(state);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Arrays kept in the plan's block past their step, pinned by the plan made at its end (more
/// than a 64th of the block: the step left its plan and needed the block), are still alive when
/// the next step is planned again without having left its plan (a position grew a little): the
/// block stays under them, the plan placed around them, whatever their share, since they were
/// pinned already. Before, they counted against a 64th of the block as if pinned anew, and the
/// block was retired under them, the next plan's block made beside it.
#[test]
fn arrays_pinned_already_keep_the_block_when_the_step_is_planned_again() {
    let name = "unit-pinned-again";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let step = |grow: usize| {
        let _scope = crate::enter(name);
        drop(activations_through_a_chain(grow));
    };
    for _ in 0..3 {
        step(0);
    }
    // A step that leaves its plan (arrays past its end) and keeps three of them, 1.5 MiB, about
    // a ninth of the block.
    let kept: Vec<Array<u32>> = {
        let _scope = crate::enter(name);
        drop(activations_through_a_chain(0));
        (0..3).map(|i| filled(131_072, 100 + i)).collect()
    };
    step(0);
    let held = backend.outstanding_bytes();
    // Planned again: a position grew by a 64th.
    step(4096);
    step(4096);
    assert!(
        backend.outstanding_bytes() < held + held / 8,
        "{} bytes held, {held} before",
        backend.outstanding_bytes()
    );
    assert!(kept.iter().zip(100..).all(|(a, i)| holds(a, i)));
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A training step twice as large as the plan's (a larger batch), in a loop whose inputs varied
/// a little before (the plan is scaled at its first allocation, and the block, taken back as it
/// is, grows once, when the first position past its end is served) and in a fixed-shape loop
/// (the step is in doubt and served from the block's gaps, and the block grows once, at the
/// first array they do not hold); every array keeps its values. When the device refuses that
/// growth, arrays of the step being in the block already, the rest of the step goes apart (each
/// checked), and the next step of that size is planned with no loss: every block goes back at
/// the end.
#[test]
fn a_plan_scaled_for_a_larger_step_grows_its_block_when_a_position_needs_it() {
    let name = "unit-scaled-lazily";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    // A training step's pass on `scale` times the smaller batch, its input `less` KiB short.
    let step = |scale: usize, less: usize| train_or_eval(name, 4 * scale, false, false, less);
    for vary in [1, 0] {
        let smaller = || (0..3).for_each(|k| step(1, vary * k));
        smaller();
        let (allocs, grows) = (backend.allocs(), backend.grows());
        step(2, 0);
        assert_eq!(backend.grows(), grows + 1, "the block grew once");
        assert_eq!(
            backend.allocs(),
            allocs + 1,
            "and nothing else was allocated"
        );
        let allocs = backend.allocs();
        step(2, 0);
        assert_eq!(
            backend.allocs(),
            allocs,
            "the scaled plan serves the next step"
        );
        // Again from the smaller kind, but the growth refused.
        crate::invalidate(name);
        smaller();
        let (failures, grows) = (backend.failures(), backend.grows());
        backend.fail_nth(1);
        step(2, 0);
        assert_eq!(backend.failures(), failures + 1, "the growth was refused");
        assert_eq!(backend.grows(), grows);
        step(2, 0);
        let allocs = backend.allocs();
        step(2, 0);
        assert_eq!(
            backend.allocs(),
            allocs,
            "planned again, the step allocates nothing"
        );
        crate::invalidate(name);
        assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
    }
}

/// An evaluation step in the training step's scope: its first allocation, an input twice the
/// training step's, outgrows the training plan, which is scaled twofold for it (the training
/// steps' inputs vary by a row or two, the first the largest: the loop's shapes vary, and the
/// step is taken for the same step larger); but its next allocation is another kind's, and the
/// step leaves that plan. The block, which can grow, is taken back as it is and grows only when
/// a position past its end is served, and the step's first position, placed high in the plan
/// (arrays go largest first), moves to the block's bottom for the step: the evaluation steps
/// never grow it. Before, it grew twofold at the evaluation step's first allocation and stayed
/// so (ViT-S trained with an evaluation step every third step in its scope: 1.968x of its peak
/// live bytes).
#[test]
fn a_step_that_leaves_its_plan_scaled_at_its_second_allocation_does_not_grow_the_block() {
    let name = "unit-eval-in-train";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut k = 0;
    let mut step = |eval: bool| {
        let _scope = crate::enter(name);
        let x = filled(
            if eval {
                131_072
            } else {
                65_536 - 256 * (k % 3)
            },
            1,
        );
        k += 1;
        if eval {
            // A forward pass with no gradients: one large array at a time.
            chain([1_048_576, 262_144, 262_144]);
        } else {
            drop(activations_through_a_chain(0));
        }
        assert!(holds(&x, 1));
    };
    for _ in 0..2 {
        step(false);
    }
    let block = backend.outstanding_bytes();
    backend.reset_peak();
    let grows = backend.grows();
    for _ in 0..3 {
        step(false);
        step(false);
        step(true);
    }
    assert_eq!(backend.grows(), grows, "the block never grew");
    let peak = backend.peak_bytes();
    assert!(
        peak < block + block / 2,
        "{peak} bytes held at most, {block} after the training steps"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A training step's pass on a batch of `batch` 256 KiB rows: the input, eight activations
/// kept for the backward pass, which runs as a chain (each checked, see
/// [`activations_through_a_chain`]); or, for `eval`, the forward pass alone, each activation
/// dropped once the next is made. The `first` step also makes a workspace (what only a first
/// step makes: the second step is planned again, not from a cold start). The input is `less`
/// KiB short of the batch's (inputs that vary a little).
fn train_or_eval(name: &str, batch: usize, eval: bool, first: bool, less: usize) {
    let _scope = crate::enter(name);
    let x = filled(16_384 * batch - 256 * less, 1);
    if first {
        drop(filled(262_144, 9));
    }
    if eval {
        chain([65_536 * batch; 8]);
    } else {
        let acts: Vec<_> = (0..8).map(|i| filled(65_536 * batch, 10 + i)).collect();
        chain([65_536 * batch; 6]);
        assert!(acts.iter().zip(10..).all(|(a, i)| holds(a, i)));
    }
    assert!(holds(&x, 1));
}

/// A fixed-shape training loop with an evaluation step on twice the batch in its scope: the
/// evaluation step begins as a training step twice as large (the input, then activations twice
/// the training step's), but keeps none of its activations. Its first allocation is the first
/// of a new size after steps that were all of one, and the plan is a training step's (most of
/// its peak held by activations kept long): the step is served from the block's gaps rather
/// than from the plan scaled, and the block never grows. Before, the step followed the plan
/// scaled twofold, the block grown to it at the first position past its end, and held so for
/// good (ResNet-50 trained with an evaluation step on twice the batch every fourth step in its
/// scope: 2.006x of its peak live bytes).
#[test]
fn an_evaluation_step_on_a_larger_batch_is_served_from_the_training_steps_block() {
    let name = "unit-eval-doubted";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    for k in 0..3 {
        train_or_eval(name, 4, false, k == 0, 0);
    }
    let block = backend.outstanding_bytes();
    backend.reset_peak();
    let grows = backend.grows();
    train_or_eval(name, 8, true, false, 0);
    let allocs = backend.allocs();
    for _ in 0..3 {
        for _ in 0..3 {
            train_or_eval(name, 4, false, false, 0);
        }
        train_or_eval(name, 8, true, false, 0);
    }
    assert_eq!(backend.grows(), grows, "the block never grew");
    assert_eq!(
        backend.allocs(),
        allocs,
        "nothing allocated after the first evaluation"
    );
    let peak = backend.peak_bytes();
    assert!(
        peak < block + block / 8,
        "{peak} bytes held at most, {block} after the training steps"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// The same fixed-shape training loop, its batch raised: the step twice as large is in doubt
/// as an evaluation step is, and served from the block's gaps; at its first array that no gap
/// holds, the block grows to the plan scaled, once, and serves the rest of the step. No array
/// goes apart, and the steps after allocate nothing.
#[test]
fn a_training_step_on_a_raised_batch_grows_the_block_once() {
    let name = "unit-batch-raised";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    for k in 0..3 {
        train_or_eval(name, 4, false, k == 0, 0);
    }
    let (allocs, grows) = (backend.allocs(), backend.grows());
    train_or_eval(name, 8, false, false, 0);
    assert_eq!(backend.grows(), grows + 1, "the block grew once");
    assert_eq!(
        backend.allocs(),
        allocs + 1,
        "its growth, and no array apart"
    );
    let allocs = backend.allocs();
    for _ in 0..3 {
        train_or_eval(name, 8, false, false, 0);
    }
    assert_eq!(backend.allocs(), allocs, "the steps after allocate nothing");
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A step that leaves its plan keeps arrays it made in the plan's block past its end, for many
/// steps, and they hold most of the block (a Whisper-style decoder's keys and values of the
/// encoder's output, made for a request in the step after the encoder's, which left the
/// encoder's plan): the next plan keeps the block under them, placed in its free bytes around
/// them, the block grown by what those lack, rather than the block being retired under them
/// (held until they drop, most of it theirs) and the next plan's block made beside it.
#[test]
fn a_block_mostly_held_by_arrays_kept_past_the_step_is_kept_under_them() {
    let name = "unit-kept-most";
    let (backend, _installed, _serial) = planned(name);
    // Blocks that grow in place, as CUDA's do (virtual memory management).
    backend.set_growable(true);
    // The encoder's step: eight arrays alive through it, and a chain of as large ones.
    let encoder = || {
        let _scope = crate::enter(name);
        let head = filled(256, 1);
        let xs: Vec<_> = (0..8).map(|i| filled(8192, i)).collect();
        chain([8192; 4]);
        assert!(xs.iter().zip(0..).all(|(x, i)| holds(x, i)));
        drop((head, xs));
    };
    for _ in 0..3 {
        encoder();
    }
    let held = backend.outstanding_bytes();
    backend.reset_peak();
    // The next step: six of those arrays kept past it (in the plan's positions), then larger
    // ones than the plan holds.
    let kept: Vec<Array<u32>> = {
        let _scope = crate::enter(name);
        let head = filled(256, 1);
        let kept = (0..6).map(|i| filled(8192, 100 + i)).collect();
        chain([16384; 4]);
        drop(head);
        kept
    };
    // Decoding steps, while the kept arrays live.
    for _ in 0..6 {
        chain_step(name, &[256, 1024, 1024, 1024, 1024]);
    }
    assert!(kept.iter().zip(100..).all(|(k, i)| holds(k, i)));
    // Retired under them, the block was held beside a new one: 1.58x the bytes held before.
    assert!(
        backend.peak_bytes() < held + held / 4,
        "{} bytes held at most, {held} before",
        backend.peak_bytes()
    );
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Two kinds of step (a batch of 4096 and one of 16384 elements), each with a plan: a step of
/// the first kind keeps its loss, from its plan's block, into the next step, of the second kind.
/// That step switches to its kind's shelved plan with the loss in the block (a pin), its
/// positions over the loss waiting until it drops, rather than following the first kind's plan,
/// which it outgrows (its arrays then from the block's free bytes, and apart what they cannot
/// hold).
#[test]
fn a_step_switches_to_its_kinds_plan_with_an_earlier_steps_loss_in_the_block() {
    let name = "unit-switch-pinned";
    let (backend, _installed, _serial) = planned(name);
    // `pairs` pairs of arrays after the input, in a chain, or all alive to the step's end (the
    // small kind's: the large kind's plan reuses their bytes too early for them).
    let step = |n: usize, pairs: usize, v: u32, keep: bool| -> Option<Array<u32>> {
        let _scope = crate::enter(name);
        let input = filled(n, 7);
        // A step that keeps its loss makes its last array larger than planned: it leaves its
        // plan there, and the loss comes from the block's free bytes (a pin at its end).
        let last = 2 * pairs - 1;
        let lens = (0..2 * pairs).map(|i| match i {
            i if i == last && keep => 2 * n,
            i if i % 2 == 0 => 2 * n,
            _ => n,
        });
        let all: Vec<Array<u32>> = if n > 4096 {
            chain(lens);
            Vec::new()
        } else {
            lens.map(|len| filled(len, 3)).collect()
        };
        assert!(all.iter().all(|a| holds(a, 3)));
        let loss = filled(64, v);
        assert!(holds(&input, 7));
        keep.then_some(loss)
    };
    // A first step of a third kind (a cold start), then the large kind's steps, then the small
    // kind's (another plan: the large one's plan holds them, but they come in another order).
    for (n, pairs) in [(4096, 5), (16384, 3), (16384, 3), (4096, 2), (4096, 2)] {
        step(n, pairs, 0, false);
    }
    let held = backend.outstanding_bytes();
    let loss = step(4096, 2, 1, true).unwrap();
    backend.reset_peak();
    let allocs = backend.allocs();
    step(16384, 3, 2, false);
    assert!(holds(&loss, 1));
    drop(loss);
    // Its plan's position over the loss went apart (128 KiB; the step stays on its plan), its
    // one device allocation (when the gaps took every array from their bottom, the kept loss
    // lay elsewhere, and this step's loss went apart too): where following the small kind's
    // plan held 64 KiB more.
    assert_eq!(backend.allocs(), allocs + 1);
    assert!(
        backend.peak_bytes() <= held + 4 * 2 * 16384 + 512,
        "{} bytes held at most, {held} before",
        backend.peak_bytes()
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A step larger everywhere than its plan (a longer sequence) whose arrays are each smaller than
/// a 64th of the plan's footprint: once the bytes grown this step pass that share, and the
/// plan's block is unused (the grown arrays went apart), the step leaves its plan and the plan
/// scaled serves the rest, in one block, rather than each grown array going apart until the
/// grown arrays' budget is spent (GPT-2 trained on varying lengths, with a budget of an eighth of
/// the footprint: 111 device allocations after its second step, 42 so).
#[test]
fn a_step_grown_everywhere_in_small_arrays_scales_its_plan() {
    let name = "unit-grown-small";
    let (backend, _installed, _serial) = planned(name);
    // Eight arrays of `n` elements in a chain, one of 128 `n` briefly, eight more.
    let step = |n: usize| {
        let _scope = crate::enter(name);
        chain(std::iter::repeat_n(n, 8));
        drop(filled(128 * n, 5));
        chain(std::iter::repeat_n(n, 8));
    };
    for _ in 0..2 {
        step(1024);
    }
    let allocs = backend.allocs();
    step(1280);
    // The first two grown arrays apart (a 104th of the footprint each: two might be a
    // detector's images, which say nothing of the rest), then the scaled plan's block, from the
    // third on; more of them apart without (a device allocation each).
    assert_eq!(
        backend.allocs(),
        allocs + 3,
        "the plan scaled served the step"
    );
    let allocs = backend.allocs();
    step(1280);
    assert_eq!(backend.allocs(), allocs, "and the next");
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Allocates one step of a planned cache `name`: array `k` of `lives[k] = (units, end)` is
/// `units` pages of 4 KiB (a few bytes for 0) made at tick `k` and dropped before tick `end`
/// (at the step's end if no later tick). Returns the step's peak live bytes.
fn lifetimes_step(name: &str, lives: &[(usize, usize)]) -> usize {
    let _scope = crate::enter(name);
    let bytes = |units: usize| (units * 4096).max(12);
    let mut alive: Vec<Option<Array<u8>>> = Vec::new();
    let (mut live, mut peak) = (0, 0);
    for (k, &(units, _)) in lives.iter().enumerate() {
        for (j, array) in alive.iter_mut().enumerate() {
            if lives[j].1 <= k && array.take().is_some() {
                live -= bytes(lives[j].0);
            }
        }
        alive.push(Some(Array::empty(Device::Cpu, bytes(units)).unwrap()));
        live += bytes(units);
        peak = peak.max(live);
    }
    peak
}

/// Two steps of `lives` (see [`lifetimes_step`]) in planned cache `name` on `backend`: the
/// first holds its peak live bytes exactly (no plan yet); returns the most bytes held over the
/// second's peak live bytes. The cache is given back after (every block with it).
fn second_step_held(
    name: &str,
    backend: &CountingBackend,
    first: &[(usize, usize)],
    second: &[(usize, usize)],
) -> f64 {
    let live = lifetimes_step(name, first);
    assert_eq!(
        backend.peak_bytes(),
        live,
        "a first step holds its peak live bytes"
    );
    let live = lifetimes_step(name, second);
    let held = backend.peak_bytes() as f64 / live as f64;
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
    held
}

/// A detector's second step (the first 27 arrays of Faster R-CNN's, as recorded, sizes in
/// quarters of a MiB as pages): its input smaller than the first step's, everything after it a
/// fifth larger, so it leaves its plan at its seventh array and is served from the block's gaps.
/// The plan put the arrays that live long (a feature map through the step, one alive across the
/// two largest) at the top of the block, the largest at its bottom; the gaps keep that
/// arrangement, so one of the two largest still fits the block. Best fit from the bottom put
/// the long-lived arrays in the block's middle, and both largest went apart: 1.63x of the
/// step's peak live bytes (now 1.23x).
#[test]
fn a_step_served_from_the_gaps_keeps_its_plans_long_lived_arrays_at_the_top() {
    let name = "unit-gaps-ends";
    let (backend, _installed, _serial) = planned(name);
    // Each array's size (in pages) and the tick it drops before, in the two steps.
    let sizes = [
        20, 20, 0, 0, 20, 20, 35, 0, 0, 20, 20, 35, 70, 94, 94, 94, 94, 94, 94, 375, 375, 94, 94,
        35, 35, 105, 105,
    ];
    let ends = [
        27, 27, 6, 6, 6, 7, 13, 11, 11, 11, 12, 13, 27, 15, 19, 17, 19, 19, 25, 21, 23, 23, 25, 25,
        27, 27, 27,
    ];
    let first: Vec<(usize, usize)> = sizes.into_iter().zip(ends).collect();
    let sizes = [
        13, 13, 0, 0, 13, 13, 42, 0, 0, 13, 13, 42, 87, 116, 116, 116, 116, 116, 116, 462, 462,
        116, 116, 43, 0, 43, 130,
    ];
    let ends = [
        27, 27, 6, 6, 6, 7, 13, 11, 11, 11, 12, 13, 27, 15, 19, 17, 19, 19, 26, 21, 23, 23, 26, 26,
        25, 27, 27,
    ];
    let second: Vec<(usize, usize)> = sizes.into_iter().zip(ends).collect();
    let held = second_step_held(name, &backend, &first, &second);
    assert!(
        held < 1.25,
        "the second step held {held:.3}x of its peak live bytes"
    );
}

/// A larger step whose inputs grew far more than the rest (the first 30 arrays of RetinaNet's
/// first two steps, as recorded, sizes in quarters of a MiB as pages: its images, padded to the
/// batch's largest, grew 1.6 times, its feature maps 1.1 times): the inputs go apart as grown
/// (each a small share of the plan), and at the first feature map the step outgrows its plan,
/// which is scaled by that array's growth, the largest so far, not by the total's, which the
/// inputs swell (1.33 times: the step held 1.26x of its peak live bytes, now 1.06x).
#[test]
fn a_plan_is_scaled_as_its_largest_array_grew() {
    let name = "unit-scaled-largest";
    let (backend, _installed, _serial) = planned(name);
    // Each array's size (in pages) and the tick it drops before, in the two steps.
    let sizes = [
        8, 8, 0, 0, 8, 8, 40, 0, 0, 8, 8, 40, 82, 438, 520, 438, 109, 219, 109, 109, 109, 219, 109,
        438, 0, 438, 438, 0, 438, 109,
    ];
    let ends = [
        30, 30, 6, 6, 6, 7, 13, 11, 11, 11, 12, 13, 30, 16, 15, 18, 30, 18, 20, 22, 23, 22, 25, 26,
        25, 30, 29, 28, 29, 30,
    ];
    let first: Vec<(usize, usize)> = sizes.into_iter().zip(ends).collect();
    let sizes = [
        13, 13, 0, 0, 13, 13, 45, 0, 0, 13, 13, 45, 91, 483, 574, 483, 121, 242, 121, 121, 121,
        242, 121, 483, 0, 483, 483, 0, 483, 121,
    ];
    let ends = [
        30, 30, 6, 6, 6, 7, 13, 11, 11, 11, 12, 13, 30, 16, 15, 18, 30, 18, 20, 22, 23, 22, 25, 26,
        25, 30, 29, 28, 29, 30,
    ];
    let second: Vec<(usize, usize)> = sizes.into_iter().zip(ends).collect();
    let held = second_step_held(name, &backend, &first, &second);
    assert!(
        held < 1.15,
        "the second step held {held:.3}x of its peak live bytes"
    );
}

/// Two steps larger than the plan's, each scaled from the plan by its first arrays' ratio: in the
/// first, one array grows 4% more than that and misses its scaled place (served from the block's
/// free bytes); in the second, the feature map grows 3% more, past the 64th a plan scaled takes
/// more, but within what the first step's array lacked, which the plans scaled since take too:
/// the map is served at its place. Else it went apart, a block of its own beside the scaled one
/// (1.54x of the step's peak live bytes; wav2vec2 on clips of varying length, whose arrays do not
/// all grow in one ratio: 1.367x of its peak live bytes, 1.085x so).
#[test]
fn a_plan_scaled_after_an_array_outgrew_its_scaled_place_takes_what_it_lacked() {
    let name = "unit-scale-margin";
    let (backend, _installed, _serial) = planned(name);
    // An input alive through the step, two arrays alive across the map, the map, two more: the
    // map and the fifth grown by `map` and `fifth` more than the rest. Returns the step's device
    // allocations and the most bytes held over its peak live bytes.
    let step = |s: usize, map: f64, fifth: f64| {
        let grown = |pages: usize, by: f64| (pages as f64 * by) as usize;
        let lives = [
            (s / 10, 6),
            (25 * s, 4),
            (10 * s, 4),
            (grown(40 * s, map), 6),
            (grown(5 * s, fifth), 6),
            (5 * s, 6),
        ];
        let allocs = backend.allocs();
        backend.reset_peak();
        let live = lifetimes_step(name, &lives);
        (
            backend.allocs() - allocs,
            backend.peak_bytes() as f64 / live as f64,
        )
    };
    for _ in 0..3 {
        step(40, 1.0, 1.0);
    }
    step(50, 1.0, 1.04);
    let (allocs, held) = step(60, 1.03, 1.04);
    // The input grew past its position (apart), and the plan scaled takes a block.
    assert_eq!(allocs, 2, "the map went apart");
    assert!(
        held < 1.05,
        "the step held {held:.3}x of its peak live bytes"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A step whose second input is four times the plan's (its plan's block goes back once unused,
/// for the plan scaled) while its feature maps are smaller than planned: by the time the block is
/// unused the step no longer asks for more than the plan holds, and it follows the plan as it is,
/// in a block of its own; served apart array by array, it made a device allocation per map.
#[test]
fn a_step_that_outgrew_its_plan_then_shrank_follows_it_in_a_new_block() {
    let name = "unit-outgrew-shrank";
    let (backend, _installed, _serial) = planned(name);
    // Two inputs, each dropped after the next map, and a chain of maps.
    let step = |input: usize, second: usize, map: usize| {
        let _scope = crate::enter(name);
        let a = filled(input, 1);
        let m = filled(map, 2);
        drop(a);
        let b = filled(second, 3);
        drop(m);
        chain((0..10).map(|_| map));
        assert!(holds(&b, 3));
    };
    for _ in 0..3 {
        step(4096, 4096, 40 * 1024);
    }
    let allocs = backend.allocs();
    step(4096, 4 * 4096, 30 * 1024);
    assert_eq!(
        backend.allocs() - allocs,
        2,
        "the second input apart and the plan's new block"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A detector's step keeps its outputs (here ten small arrays, five for each of two images) until
/// the next step's replace them, and leaves its plan before making them (its detections vary),
/// so they come from the block's gaps: the next plan keeps the block under them (pins; the
/// block grows in place around them, as CUDA's can), rather than the block being retired under
/// them and the next plan's block made beside it (with eight pins at most: 2.31x of the bytes
/// held before, now 1.41x).
#[test]
fn a_detectors_outputs_kept_into_the_next_step_keep_the_block() {
    let name = "unit-outputs-pinned";
    let (backend, _installed, _serial) = planned(name);
    // Blocks that grow in place, as CUDA's do (virtual memory management).
    backend.set_growable(true);
    // A chain of maps, one larger than planned at `grown` (the step leaves its plan there), then
    // `outputs` small arrays, returned.
    let step = |grown: bool, outputs: usize| -> Vec<Array<u32>> {
        let _scope = crate::enter(name);
        chain((0..8).map(|i| {
            if grown && i == 6 {
                40 * 1024
            } else {
                32 * 1024
            }
        }));
        (0..outputs).map(|i| filled(64, i as u32)).collect()
    };
    let mut kept = step(false, 10);
    for _ in 0..3 {
        kept = step(false, 10);
    }
    let held = backend.outstanding_bytes();
    backend.reset_peak();
    // Two steps that leave their plans with more outputs than the plan had positions for.
    for _ in 0..2 {
        let next = step(true, 12);
        assert!(
            kept.iter().enumerate().all(|(i, a)| a
                .to_vec()
                .unwrap()
                .iter()
                .all(|&e| e == i as u32))
        );
        kept = next;
    }
    // The block and the arrays apart around it, never a second block beside it.
    assert!(
        backend.peak_bytes() < held + held / 2,
        "{} bytes held at most, {held} before",
        backend.peak_bytes()
    );
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// One step of a segmenting detector (see the test below) in `name`'s scope: chains of `n`
/// maps of `len` elements, an output of 64 KiB (filled with `v`, then `v + 1`) after each; the
/// last step's outputs, checked, drop at the end. With `refuse`, the device refuses its next
/// request, made as the step ends (the block's growth).
fn detector_step(
    name: &str,
    (n, len, v): (usize, usize, u32),
    last: Option<[Array<u32>; 2]>,
    refuse: Option<&CountingBackend>,
) -> [Array<u32>; 2] {
    let _scope = crate::enter(name);
    chain(std::iter::repeat_n(len, n));
    let first = filled(16 * 1024, v);
    chain(std::iter::repeat_n(len, n));
    let second = filled(16 * 1024, v + 1);
    if let Some(last) = last {
        assert!(holds(&last[0], v - 2) && holds(&last[1], v - 1));
    }
    if let Some(backend) = refuse {
        backend.fail_nth(1);
    }
    [first, second]
}

/// The steps of [`detector_step`] that follow their plan, then steps that never come again
/// (another `n` and `len` each), leaving it; the step `refused` (if any) with the device
/// refusing the block's growth at its end. Returns the bytes held after the first ones.
fn detector_steps(name: &str, backend: &CountingBackend, refused: Option<u32>) -> usize {
    let mut kept = detector_step(name, (4, 32 * 1024, 0), None, None);
    for v in 1..3 {
        kept = detector_step(name, (4, 32 * 1024, 2 * v), Some(kept), None);
    }
    let held = backend.outstanding_bytes();
    backend.reset_peak();
    for v in 3..9 {
        let shape = (5 + v as usize % 3, 32 * 1024 - 64 * v as usize, 2 * v);
        let refuse = (refused == Some(v)).then_some(backend);
        kept = detector_step(name, shape, Some(kept), refuse);
        if refuse.is_some() {
            assert_eq!(backend.failures(), 1, "the growth was refused");
        }
    }
    drop(kept);
    held
}

/// A segmenting detector's step keeps two large outputs (Mask R-CNN's masks, an image each) until
/// the next step's replace them, and leaves its plan before making them (its steps never come
/// again), so they come from the block's gaps: together far past a 64th of the block, yet the
/// next step needs the block as much as this one did. The next plan keeps the block under them
/// (grown in place around them) rather than the block being retired under them and the next
/// plan's block made beside it, every step.
#[test]
fn a_detectors_large_outputs_kept_into_the_next_step_keep_the_block() {
    let name = "unit-large-outputs-pinned";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let held = detector_steps(name, &backend, None);
    // Retired under the outputs every step, the block stayed beside the next one: 1.59x of the
    // bytes the steps that followed their plan held; kept under them, 1.39x (arrays that no
    // longer fit its gaps go apart).
    assert!(
        backend.peak_bytes() < held + held * 9 / 20,
        "{} bytes held at most, {held} before",
        backend.peak_bytes()
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// The device refuses the growth of a block kept under a detector's outputs: the block is
/// retired under them, as before, and the next step makes its own; every array keeps its values
/// and every byte comes back.
#[test]
fn a_growth_under_a_detectors_outputs_the_device_refuses_retires_the_block() {
    let name = "unit-large-outputs-refused";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    detector_steps(name, &backend, Some(3));
    assert_eq!(backend.failures(), 1);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// One step of a segmenting model in `name`'s scope: a chain of maps, then its two outputs
/// (masks, an image each, each filled with `v`), returned, for the caller to keep into the next
/// step; the step before's outputs (`last`) are checked and dropped after its own are made,
/// before it ends.
fn masks_step(name: &str, v: u32, last: Option<[Array<u32>; 2]>) -> [Array<u32>; 2] {
    let _scope = crate::enter(name);
    chain(std::iter::repeat_n(32 * 1024, 6));
    let masks = [filled(16 * 1024, v), filled(16 * 1024, v)];
    if let Some(last) = last {
        assert!(last.iter().all(|m| holds(m, v - 1)));
    }
    masks
}

/// A step that follows its plan keeps its plan when its outputs, planned apart, are made late in
/// it and kept into the next step (a training step's logits, returned): served from the block's
/// gaps, pinned there and placed around by the next plan, they would have every step leave its
/// plan and be planned again (tried for a detector's outputs: BENCHMARKS.md, "A detector's
/// outputs into the block's gaps: tried, not kept").
#[test]
fn an_output_kept_past_a_step_that_follows_its_plan_leaves_the_plan_alone() {
    let name = "unit-kept-output";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut kept = None;
    for v in 1..4 {
        kept = Some(masks_step(name, v, kept.take()));
    }
    let (made, allocs) = (plans(), backend.allocs());
    for v in 4..10 {
        kept = Some(masks_step(name, v, kept.take()));
    }
    assert_eq!(plans(), made, "no plan made again");
    assert_eq!(backend.allocs(), allocs, "no device allocation");
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A detector's step: two images, each larger than the plan's (together past a 64th of the
/// footprint), and feature maps smaller than planned (the model resizes its images). The images
/// go apart and the rest follows the plan; scaling the plan by the images' growth at the second
/// made a block half as large again for a step that fit the old one.
#[test]
fn two_grown_images_do_not_scale_a_plan_that_holds_the_rest() {
    let name = "unit-two-images";
    let (backend, _installed, _serial) = planned(name);
    let step = |image: usize, map: usize| {
        let _scope = crate::enter(name);
        let images = [filled(image, 1), filled(image, 2)];
        chain((0..8).map(|_| map));
        assert!(holds(&images[1], 2));
    };
    for _ in 0..3 {
        step(600, 32 * 1024);
    }
    let held = backend.outstanding_bytes();
    backend.reset_peak();
    step(900, 29 * 1024);
    // The plan's block and the two images apart.
    assert!(
        backend.peak_bytes() <= held + 2 * 4 * 1024,
        "{} bytes held at most, {held} before",
        backend.peak_bytes()
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A step of another kind than its plan's (a smaller batch: every array so far a quarter of
/// its position's) makes one array larger than its position: the step leaves its plan there
/// and the block's free bytes serve the array. Served apart while the step stayed on its plan,
/// it took a device allocation, the block three quarters free.
#[test]
fn a_step_short_of_its_plan_serves_a_larger_position_from_the_block() {
    let name = "unit-short-of-plan";
    let (backend, _installed, _serial) = planned(name);
    let step = |first: usize, lens: &[usize]| {
        let _scope = crate::enter(name);
        let first = filled(first, 7);
        assert!(holds(&first, 7));
        drop(first);
        chain(lens.iter().copied());
    };
    for _ in 0..3 {
        step(1 << 20, &[8 * 1024; 8]);
    }
    let allocs = backend.allocs();
    let mut short = [2 * 1024; 8];
    // 60 KiB where the plan has 32 KiB: under a 64th of the plan's 4 MiB, which a step that
    // stays on its plan serves apart.
    short[4] = 15 * 1024;
    step(1 << 18, &short);
    assert_eq!(backend.allocs(), allocs, "the block served the step");
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// `invalidate` and `empty_cache` are a cold start: the steps that left their plans in a row
/// before it are forgotten, and the first step after it, which has no plan, left none. With
/// the first step counted as one that left its plan, the second step after the cold start left
/// unplanned a step that left the new plan (one step too early).
#[test]
fn a_cold_start_forgets_the_steps_that_left_their_plans_in_a_row() {
    let name = "unit-settled-cold";
    let (_backend, _installed, _serial) = planned(name);
    let step = |n: usize, len: usize| chain_step(name, &vec![len; n]);
    for k in 0..6 {
        step(5 + k % 3, 15 * 1024 + 64 * k);
    }
    crate::invalidate(name);
    // Recorded, and planned at its end.
    step(4, 16 * 1024);
    // Leaves the plan (its first allocation makes the block), planned again.
    step(5, 15 * 1024);
    let made = plans();
    // Leaves that plan within its block: only the second step in a row to leave its plan.
    step(6, 15 * 1024 + 64);
    assert_eq!(
        plans() - made,
        1,
        "a step that left its plan, the second in a row, is planned"
    );
    crate::invalidate(name);
}

/// Steps that never come again (a detector's: here a chain of `n` arrays of about 60 KiB,
/// another size and another `n` than the step before's), each leaving the plan made from the
/// one before, within its block and with no device allocation: after two such steps in a row
/// they are no longer planned (nine plans for nine steps before: a plan a step, for nothing).
#[test]
fn steps_that_never_come_again_within_the_block_are_not_planned_each() {
    let name = "unit-settled";
    let (backend, _installed, _serial) = planned(name);
    let step = |n: usize, len: usize| chain_step(name, &vec![len; n]);
    // The plan: a chain of four arrays of 64 KiB (two alive at a time).
    step(4, 16 * 1024);
    step(4, 16 * 1024);
    let (made, allocs) = (plans(), backend.allocs());
    for k in 0..9 {
        step(5 + k % 3, 15 * 1024 + 64 * k);
    }
    assert_eq!(backend.allocs(), allocs, "the block held every step");
    assert_eq!(
        plans() - made,
        2,
        "planned until two steps in a row left their plans"
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// The steps served online that ended on this thread so far.
fn online_steps() -> u64 {
    ONLINE_STEPS.with(std::cell::Cell::get)
}

/// A small deterministic generator (xorshift) for the steps below.
struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A step of a detector whose steps never come again: chains of maps of sizes drawn anew each
/// step, with a few large arrays living through most of the step, and two outputs kept by the
/// caller into the next step (checked there, and dropped after this step's are made).
fn unrepeated_step(
    name: &str,
    rng: &mut Xorshift,
    v: u32,
    last: Option<[Array<u32>; 2]>,
) -> [Array<u32>; 2] {
    let outputs = unrepeated_step_keeping(name, rng, v, last.map(Vec::from), (2, 1024, 16 * 1024));
    outputs
        .try_into()
        .unwrap_or_else(|_| unreachable!("two outputs"))
}

/// [`unrepeated_step`] with `outputs.0` outputs kept into the next step, each of `outputs.1`
/// elements and up to `outputs.2` more, the i-th filled with `v + i` (the caller steps `v` by
/// 4, or by the outputs when more).
fn unrepeated_step_keeping(
    name: &str,
    rng: &mut Xorshift,
    v: u32,
    last: Option<Vec<Array<u32>>>,
    outputs: (usize, usize, u64),
) -> Vec<Array<u32>> {
    let _scope = crate::enter(name);
    let features: Vec<Array<u32>> = (0..3)
        .map(|i| filled(8 * 1024 + rng.below(24 * 1024) as usize, v + i))
        .collect();
    for _ in 0..3 {
        let n = 2 + rng.below(5) as usize;
        let lens: Vec<usize> = (0..n)
            .map(|_| 1024 + rng.below(48 * 1024) as usize)
            .collect();
        chain(lens);
    }
    let made: Vec<Array<u32>> = (0..outputs.0 as u32)
        .map(|i| filled(outputs.1 + rng.below(outputs.2) as usize, v + i))
        .collect();
    for (i, f) in features.iter().enumerate() {
        assert!(holds(f, v + i as u32));
    }
    if let Some(last) = last {
        let before = v - last.len().max(4) as u32;
        assert!(last.iter().zip(before..).all(|(a, i)| holds(a, i)));
    }
    made
}

/// A detector's steps as above whose caller keeps 260 small outputs (544 to 800 bytes) into the
/// next step, more than an online block keeps where they are: online for one step, the scope is
/// planned again at its end. A shadow started again at once put it online again four steps
/// later, and so on, for good (ViT-S on gradients accumulated with AdamW: one step in four
/// online, the other three beside a shadow, which reads every step's record): now the next
/// shadow starts later, and later again each time.
#[test]
fn a_scope_online_for_a_single_step_waits_before_its_next_shadow() {
    let name = "unit-online-once";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    let mut kept = None;
    let mut v = 4;
    let shadowed = || SHADOWED_STEPS.with(std::cell::Cell::get);
    let mut step = |v: &mut u32| {
        kept = Some(unrepeated_step_keeping(
            name,
            &mut rng,
            *v,
            kept.take(),
            (260, 136, 64),
        ));
        *v += 260;
    };
    for _ in 0..40 {
        step(&mut v);
    }
    let (shadowed0, online0) = (shadowed(), online_steps());
    for _ in 0..40 {
        step(&mut v);
    }
    assert_eq!(online_steps(), online0, "no step stayed online");
    assert!(
        shadowed() - shadowed0 <= 8,
        "{} of 40 steps fed to a shadow",
        shadowed() - shadowed0
    );
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A scope whose steps never come again goes online once its plans are measured to hold more
/// than online serving would: from then on no plan is made, the arrays kept across steps stay
/// in the block, every value is what was written, and `invalidate` gives every byte back (the
/// next steps starting cold, on plans).
#[test]
fn steps_that_never_come_again_are_served_online_once_plans_hold_more() {
    let name = "unit-online";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    let mut kept = None;
    let mut v = 4;
    let (online0, plans0) = (online_steps(), plans());
    let mut switched = None;
    for step in 0..60 {
        kept = Some(unrepeated_step(name, &mut rng, v, kept.take()));
        v += 4;
        if switched.is_none() && online_steps() > online0 {
            switched = Some((step, plans(), backend.allocs(), backend.peak_bytes()));
            backend.reset_peak();
        }
    }
    let Some((step, plans_then, allocs_then, planned_peak)) = switched else {
        panic!("the scope never went online");
    };
    assert!(step < 40, "online from step {step}");
    assert_eq!(
        online_steps() - online0,
        60 - step,
        "every step since was online"
    );
    assert_eq!(plans(), plans_then, "no plan made online");
    assert!(plans_then > plans0);
    // The block grows rarely; every other allocation is a range of it.
    assert!(
        backend.allocs() - allocs_then <= 4,
        "{} device allocations online",
        backend.allocs() - allocs_then
    );
    assert!(
        backend.peak_bytes() <= planned_peak,
        "online held {} bytes where the plans held {planned_peak}",
        backend.peak_bytes()
    );
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
    // A cold start: plans again.
    let made = plans();
    let mut kept = None;
    for _ in 0..3 {
        kept = Some(unrepeated_step(name, &mut rng, v, kept.take()));
        v += 4;
    }
    assert!(plans() > made);
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0);
}

/// A training loop whose first step makes its optimizer's state (kept for good) and whose later
/// steps, on a larger batch, repeat: the second step outgrows the first's plan (made from a cold
/// start) and is served from the plan scaled, and the cache's peak then, counted with the state,
/// is past what online serving would have held over the steps since. But the plans hold every
/// later step whole, and without the state (which online serving never sees) they held no more:
/// the scope stays on its plans, and the shadow that measured online serving stops once it has
/// measured the steps it needs to say so (each step it measures costs host time). It went online
/// at its fifth step (GPT-2 trained with micro-batches accumulated, whose second step left its
/// first's plan: one device allocation there, and host time at every step).
#[test]
fn a_training_loop_whose_plans_hold_its_steps_stays_on_them() {
    let name = "unit-online-settled";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut state: Vec<Array<u32>> = Vec::new();
    let step = |state: &mut Vec<Array<u32>>, first: bool| {
        let _scope = crate::enter(name);
        let k = if first { 1024 } else { 1280 };
        let input = filled(64 * k, 1);
        chain([256, 192, 256, 128].map(|n| n * k));
        if first {
            state.extend((0..12).map(|i| filled(96 * 1024, 100 + i)));
        }
        chain([128, 256, 192, 64].map(|n| n * k));
        assert!(holds(&input, 1));
    };
    let (online0, shadowed0) = (online_steps(), SHADOWED_STEPS.with(std::cell::Cell::get));
    step(&mut state, true);
    step(&mut state, false);
    let allocs = backend.allocs();
    for _ in 0..12 {
        step(&mut state, false);
    }
    assert_eq!(online_steps(), online0, "the scope went online");
    let shadowed = SHADOWED_STEPS.with(std::cell::Cell::get) - shadowed0;
    assert_eq!(shadowed, 4, "steps measured by a shadow");
    assert_eq!(
        backend.allocs(),
        allocs,
        "device allocations after the second step"
    );
    for (i, a) in (100..).zip(&state) {
        assert!(holds(a, i));
    }
    drop(state);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Runs a detector's steps ([`unrepeated_step`]) in scope `name` until one is served online.
/// Returns the outputs the last step kept and the value the next step starts from.
fn steps_until_online(name: &str, rng: &mut Xorshift) -> (Option<[Array<u32>; 2]>, u32) {
    let (mut kept, mut v) = (None, 4);
    let online0 = online_steps();
    while online_steps() == online0 {
        kept = Some(unrepeated_step(name, rng, v, kept.take()));
        v += 4;
        assert!(v < 4 * 60, "the scope never went online");
    }
    (kept, v)
}

/// Online, a scope keeps working through what the plans' steps go through: an output dropped
/// on another thread (its bytes stay taken until the owner settles them), the cache emptied
/// in the middle of a step (its block retired under the arrays alive, the next steps cold),
/// and the device refusing requests (a growth of the block: the array goes apart). Every value
/// is what was written, and every byte goes back.
#[test]
fn steps_served_online_survive_remote_drops_empty_cache_and_refusals() {
    let name = "unit-online-faults";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut rng = Xorshift(0x2545_f491_4f6c_dd1d);
    let (mut kept, mut v) = steps_until_online(name, &mut rng);
    let step = |kept: &mut Option<[Array<u32>; 2]>, rng: &mut Xorshift, v: &mut u32| {
        *kept = Some(unrepeated_step(name, rng, *v, kept.take()));
        *v += 4;
    };
    // An output dropped on another thread: its bytes come back through the return queue.
    if let Some([a, b]) = kept.take() {
        let v = v - 4;
        assert!(holds(&a, v));
        std::thread::spawn(move || drop(a)).join().unwrap();
        kept = Some([filled(1024, v), b]);
    }
    for _ in 0..3 {
        step(&mut kept, &mut rng, &mut v);
    }
    // Refused requests: each step's next device request fails once.
    let failures = backend.failures();
    for _ in 0..6 {
        backend.fail_nth(1);
        step(&mut kept, &mut rng, &mut v);
    }
    backend.fail_nth(0);
    assert!(backend.failures() > failures, "a request was refused");
    // The cache emptied in the middle of a step, with its arrays alive.
    {
        let _scope = crate::enter(name);
        let a = filled(40 * 1024, 7);
        crate::empty_cache();
        let b = filled(30 * 1024, 8);
        assert!(holds(&a, 7));
        assert!(holds(&b, 8));
    }
    for _ in 0..8 {
        step(&mut kept, &mut rng, &mut v);
    }
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Online, a step's small arrays (a detector's scores, indices, sizes: at most 512 bytes) kept into
/// the next step split the block's free bytes; once the block grows around them, small arrays
/// get slots of a slab, never bytes of the online block, and a slot comes back for the next
/// small array when its array drops, in its step, in the next (kept as an output), or on
/// another thread (once the slab is unused). So the steps make one slab for eleven small
/// arrays alive at once, and no more, and stay online; every value is what was written; a cap
/// on the cached bytes evicts an unused slab (the next one made is recorded as a slab); and
/// `invalidate` gives every byte back.
#[test]
fn small_arrays_online_get_slots_of_a_slab_kept_for_the_next() {
    let name = "unit-online-tiny";
    let (backend, _installed, _serial) = planned(name);
    backend.set_growable(true);
    let mut rng = Xorshift(0x6a09_e667_f3bc_c909);
    let (mut kept, mut v) = steps_until_online(name, &mut rng);
    let slabs = || SLABS_MADE.with(std::cell::Cell::get);
    let (slabs0, mut outputs) = (slabs(), Vec::new());
    let mut made = Vec::new();
    for step in 0..16u32 {
        let (before, online) = (slabs(), online_steps());
        {
            let _scope = crate::enter(name);
            kept = Some(unrepeated_step(name, &mut rng, v, kept.take()));
            // Eight small arrays (1 to 128 elements), three of them kept into the next step.
            let small: Vec<_> = (0..8)
                .map(|k| filled(1 + rng.below(128) as usize, 10_000 + 8 * step + k))
                .collect();
            for (old, w) in outputs.drain(..) {
                // On another thread once they are apart (an array of the block dropped there
                // would take the scope off the online tier until the owner settles it).
                if w % 2 == 0 || step < 8 {
                    assert!(holds(&old, w));
                } else {
                    std::thread::spawn(move || assert!(holds(&old, w)))
                        .join()
                        .unwrap();
                }
            }
            for (k, a) in small.into_iter().enumerate() {
                let w = 10_000 + 8 * step + k as u32;
                assert!(holds(&a, w), "small array {w}");
                if k < 3 {
                    outputs.push((a, w));
                }
            }
        }
        assert_eq!(
            online_steps(),
            online + 1,
            "step {step} was not served online"
        );
        v += 4;
        made.push(slabs() - before);
    }
    assert!(slabs() > slabs0, "no small array went to a slab");
    let first = made.iter().position(|&n| n > 0).unwrap_or(0);
    assert!(
        first < 8,
        "small arrays apart only from step {first}: {made:?}"
    );
    assert!(
        made[first + 2..].iter().all(|&n| n == 0),
        "slabs made for small arrays per step: {made:?}"
    );
    assert_eq!(
        slabs() - slabs0,
        1,
        "one slab for 11 small arrays alive at once"
    );
    // A step that begins with small arrays serves its larger ones from the block all the same
    // (its free ranges open at its first allocation): every array a hit, the step online.
    let counted = || {
        let s = crate::stats(name);
        (s.hits, s.misses)
    };
    let (before, online) = (counted(), online_steps());
    {
        let _scope = crate::enter(name);
        let small: Vec<_> = (0..8).map(|k| filled(1 + 16 * k, k as u32)).collect();
        let large = filled(4096, 9);
        for (k, a) in small.iter().enumerate() {
            assert!(holds(a, k as u32));
        }
        assert!(holds(&large, 9));
    }
    assert_eq!(counted(), (before.0 + 9, before.1));
    assert_eq!(online_steps(), online + 1);
    // Capped at nothing, the cache keeps no slab no array holds a slot of: the next step's
    // small array gets a new slab.
    drop(outputs);
    let s = crate::stats(name);
    let evictions = s.evictions;
    crate::configure(
        name,
        CacheConfig {
            key: KeyPolicy::Planned,
            max_cached_bytes: Some(0),
            ..CacheConfig::default()
        },
    );
    assert!(crate::stats(name).evictions > evictions);
    let (before, hits_misses) = (slabs(), counted());
    // Recorded: the new slab shows as what it is.
    crate::trace::start().expect("no other recording in the unit tests");
    {
        let _scope = crate::enter(name);
        let a = filled(16, 5);
        assert!(holds(&a, 5));
    }
    let trace = crate::trace::stop().expect("recording");
    assert_eq!(slabs(), before + 1, "a small array after the eviction");
    assert_eq!(counted(), (hits_misses.0, hits_misses.1 + 1), "a miss");
    let mine = |kind| {
        let events = trace.events().iter();
        let mine = events.filter(|e| e.kind == kind && e.cache.as_deref() == Some(name));
        mine.map(|e| e.bytes).collect::<Vec<_>>()
    };
    use crate::trace::EventKind::{Miss, PlanBlock, SlabBlock};
    assert_eq!(
        mine(SlabBlock),
        [SLAB_BYTES],
        "the slab, recorded as a slab"
    );
    assert_eq!(mine(Miss), [64], "the miss, of the array's bytes");
    assert!(mine(PlanBlock).is_empty());
    let mut json = Vec::new();
    trace.write_chrome(&mut json).expect("written to memory");
    let json = String::from_utf8(json).expect("JSON is text");
    assert_eq!(json.matches("\"name\":\"slab block\"").count(), 1, "{json}");
    drop(kept);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// Random programs of steps that never come again, served online once the shadow says so:
/// arrays kept across steps (one to three, a third of them small, dropped early or late in the
/// next step, or on another thread), and, once the scope is online, `invalidate` or
/// `empty_cache` in the middle of some steps with arrays alive. Every array holds what was
/// written when it drops, after every step the cache accounts for every byte the device holds
/// for it, and every byte goes back at the end.
#[test]
fn random_programs_served_online_keep_every_value() {
    let (backend, _installed, _serial) = planned("unit-online-random");
    backend.set_growable(true);
    let mut went_online = 0;
    let mut cut_online = 0;
    let tiny0 = SLABS_MADE.with(std::cell::Cell::get);
    for seed in 1..=6u64 {
        let name = format!("unit-online-random-{seed}");
        crate::configure(
            &name,
            CacheConfig {
                key: KeyPolicy::Planned,
                ..CacheConfig::default()
            },
        );
        let mut rng = Xorshift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut kept: Vec<(Array<u32>, u32)> = Vec::new();
        let online0 = online_steps();
        let mut v = 0u32;
        let mut next = |n: usize, v: &mut u32| {
            *v += 1;
            (filled(n, *v), *v)
        };
        let check = |(a, v): (Array<u32>, u32)| {
            assert!(holds(&a, v), "array {v}");
        };
        for _ in 0..40 {
            let online = online_steps() > online0;
            let scope = crate::enter(&name);
            // Some of the last step's arrays drop at once, some on another thread.
            let early = rng.below(kept.len() as u64 + 1) as usize;
            for a in kept.drain(..early) {
                if rng.below(3) == 0 {
                    std::thread::spawn(move || check(a)).join().unwrap();
                } else {
                    check(a);
                }
            }
            let features: Vec<_> = (0..1 + rng.below(3))
                .map(|_| next(4 * 1024 + rng.below(28 * 1024) as usize, &mut v))
                .collect();
            let cut = rng.below(4);
            for c in 0..3 {
                let mut chain = Vec::new();
                for _ in 0..2 + rng.below(4) {
                    if chain.len() == 2 {
                        check(chain.remove(0));
                    }
                    chain.push(next(1024 + rng.below(40 * 1024) as usize, &mut v));
                }
                if online && c == 1 && cut == 0 {
                    cut_online += 1;
                    if rng.below(2) == 0 {
                        crate::invalidate(&name);
                    } else {
                        crate::empty_cache();
                    }
                }
                chain.into_iter().for_each(check);
            }
            features.into_iter().for_each(check);
            // The rest of the last step's arrays drop after this step's are made.
            let made = kept_later(&mut rng, &mut next, &mut v);
            std::mem::replace(&mut kept, made)
                .into_iter()
                .for_each(check);
            drop(scope);
            // The cache accounts for every byte the device holds for it (its blocks grown in
            // place included).
            let s = crate::stats(&name);
            assert_eq!(backend.outstanding_bytes(), s.bytes_in_use + s.bytes_cached);
        }
        kept.into_iter().for_each(check);
        went_online += u64::from(online_steps() > online0);
        crate::invalidate(&name);
    }
    assert!(went_online >= 3, "{went_online} of 6 programs went online");
    assert!(cut_online > 0, "no step served online was cut");
    assert!(
        SLABS_MADE.with(std::cell::Cell::get) > tiny0,
        "no small array went to a slab"
    );
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// One to three arrays made at the end of a step, to be kept into the next: a third of them
/// small (at most 512 bytes, a detector's scores and indices).
fn kept_later(
    rng: &mut Xorshift,
    next: &mut impl FnMut(usize, &mut u32) -> (Array<u32>, u32),
    v: &mut u32,
) -> Vec<(Array<u32>, u32)> {
    (0..1 + rng.below(3))
        .map(|_| {
            let n = if rng.below(3) == 0 {
                1 + rng.below(128)
            } else {
                256 + rng.below(16 * 1024)
            };
            next(n as usize, v)
        })
        .collect()
}

/// One decoding step of a server: a temporary, then each layer's cache of keys and values one
/// token longer (`len` elements, filled with `v`), made while the step before's is alive and
/// kept into the next step (so planned apart); the old ones are checked and dropped.
fn decode_step(name: &str, kv: &mut Vec<(Array<u32>, u32)>, len: usize, v: u32) {
    let _scope = crate::enter(name);
    let x = filled(4096, v);
    let old = std::mem::take(kv);
    for (layer, (old, was)) in old.into_iter().enumerate() {
        kv.push((filled(len, v + layer as u32), v + layer as u32));
        assert!(holds(&old, was));
    }
    if kv.is_empty() {
        kv.extend((0..4).map(|layer| (filled(len, v + layer), v + layer)));
    }
    assert!(holds(&x, v));
}

/// A server's next request, whose caches of keys and values start shorter than where the last
/// one's ended (the size its plan recorded for them), after a longer prompt took the spares the
/// last request left back to the device: each cache gets a block with room up to the recorded
/// size (at most four times its own), which serves its next steps (a spare that large would
/// have served it). With a block of its size class alone, every step crossing a class made a
/// block for each layer (BART serving: 12 device allocations a step).
#[test]
fn a_shorter_cache_of_keys_and_values_gets_room_up_to_its_recorded_size() {
    let name = "unit-kv-room-back";
    let (backend, _installed, _serial) = planned(name);
    // The cache's first step, which makes what later steps do not (whose plan a later step
    // takes only when no other fits).
    {
        let _scope = crate::enter(name);
        let lazy = filled(1 << 15, 3);
        assert!(holds(&lazy, 3));
    }
    let mut kv = Vec::new();
    // The first request: its caches grow to 8 K elements (32 KiB).
    for t in 0..16u32 {
        decode_step(name, &mut kv, 4096 + 256 * t as usize, 10 * t);
    }
    for (a, v) in kv.drain(..) {
        assert!(holds(&a, v));
    }
    // A prompt far larger than anything held before: the spares the request left go back.
    {
        let _scope = crate::enter(name);
        let p = filled(1 << 20, 5);
        assert!(holds(&p, 5));
    }
    let frees = backend.frees();
    assert!(frees > 0, "the prompt freed the spares");
    // The next request, from 2 K elements on.
    let allocs = backend.allocs();
    for t in 0..16u32 {
        decode_step(name, &mut kv, 2048 + 256 * t as usize, 1000 + 10 * t);
    }
    let made = backend.allocs() - allocs;
    // Two blocks a layer at most: the step's caches and the step before's are alive at once.
    assert!(made <= 8, "{made} device allocations in the second request");
    drop(kv);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A device allocation that would take the cache past the most it has held frees spares first,
/// the fewest that make room: the largest first when no one spare does. Freed oldest first,
/// a server's many small blocks of keys and values went before the large blocks of the last
/// request's encoder output, and the next request made each small one again.
#[test]
fn spares_go_back_largest_first_when_none_makes_room_alone() {
    let name = "unit-spares-largest";
    let (backend, _installed, _serial) = planned(name);
    // Eight small arrays, then two large ones, kept past their step: solo blocks.
    let kept: Vec<(Array<u32>, u32)> = {
        let _scope = crate::enter(name);
        let small = (0..8).map(|v| (filled(1024, v), v));
        small
            .chain((8..10).map(|v| (filled(1 << 14, v), v)))
            .collect()
    };
    // Dropped in the next step: ten spares, the small ones the oldest.
    {
        let _scope = crate::enter(name);
        for (a, v) in kept {
            assert!(holds(&a, v));
        }
    }
    // An array of 96 KiB past the cache's mark: a large spare alone does not make room.
    let frees = backend.frees();
    let big = {
        let _scope = crate::enter(name);
        filled(3 << 13, 11)
    };
    assert_eq!(backend.frees() - frees, 2, "the two large spares went back");
    // The small spares serve the small arrays of the next step.
    let allocs = backend.allocs();
    let small: Vec<Array<u32>> = {
        let _scope = crate::enter(name);
        (0..8).map(|v| filled(1024, v)).collect()
    };
    assert_eq!(backend.allocs(), allocs, "the small spares served them");
    assert!(holds(&big, 11));
    drop((big, small));
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// An array more than 64 times the recorded size of the position apart it is matched with is
/// another array (a request's first decoding step matched the keys and values of the encoder's
/// output, 2.2 MiB, with a position apart where the step it was planned from made a token's, 1.5
/// KiB): it gets a block of its size class, not room to grow as the position's array would.
/// With half its size again, Whisper serving's blocks for the encoder's keys and values took the
/// cache past its high-water mark at every request (1.273x -> 1.206x of peak live, recorded).
#[test]
fn an_array_far_larger_than_its_position_apart_gets_no_room_to_grow() {
    let name = "unit-apart-another";
    let (backend, _installed, _serial) = planned(name);
    // The most the cache holds: 64 MiB, once.
    {
        let _scope = crate::enter(name);
        let big = filled(1 << 24, 1);
        assert!(holds(&big, 1));
    }
    // Steps that keep a small array (1 KiB) into the next one: a position apart.
    let mut kept = None;
    for t in 0..4u32 {
        let _scope = crate::enter(name);
        let x = filled(4096, t);
        kept = Some(filled(256, t));
        assert!(holds(&x, t));
    }
    // One whose array there is 1 MiB: a block of 1 MiB, not 1.5.
    let held = backend.outstanding_bytes();
    let large = {
        let _scope = crate::enter(name);
        let x = filled(4096, 9);
        drop(kept);
        let large = filled(1 << 18, 9);
        assert!(holds(&x, 9));
        large
    };
    let grew = backend.outstanding_bytes() - held;
    assert!(grew <= (1 << 20) + (64 << 10), "{grew} bytes more held");
    assert!(holds(&large, 9));
    drop(large);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A decoder's step whose attention over the tokens so far grows by more than a thirty-second
/// a step (its first tokens) outgrew its plan at every step, and was planned again, its block
/// made again: once it has grown at two plans in a row, its plan has room for eight more steps
/// of that growth (at most half of each array), and the steps after follow it.
#[test]
fn a_step_that_grew_at_plans_in_a_row_is_planned_ahead() {
    let name = "unit-grows-ahead";
    let (backend, _installed, _serial) = planned(name);
    // A prompt step, which makes the most the cache holds (16 MiB).
    {
        let _scope = crate::enter(name);
        let prompt = filled(4 << 20, 1);
        assert!(holds(&prompt, 1));
    }
    // Each layer's cache of keys and values, one token longer each step, kept into the next.
    let mut kv: Vec<(Array<u32>, u32)> = Vec::new();
    let (plans_before, allocs_before) = (plans(), backend.allocs());
    for t in 2..34u32 {
        let _scope = crate::enter(name);
        let old = std::mem::take(&mut kv);
        for layer in 0..6 {
            let v = 10 * t + layer;
            let x = filled(1 << 14, v);
            // 8 KiB a token.
            let attention = filled(2048 * t as usize, v + 1);
            let y = filled(1 << 14, v + 2);
            assert!(holds(&attention, v + 1));
            drop(attention);
            assert!(holds(&x, v) && holds(&y, v + 2));
            kv.push((filled(2048 * t as usize, v + 3), v + 3));
        }
        for (a, v) in old {
            assert!(holds(&a, v));
        }
    }
    // 7 plans and 69 device allocations; without the room, 16 and 99.
    let made = plans() - plans_before;
    assert!(made <= 8, "{made} plans in 32 steps");
    let allocs = backend.allocs() - allocs_before;
    assert!(allocs <= 80, "{allocs} device allocations in 32 steps");
    drop(kv);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// The length of request `r`'s keys and values of the encoder's output, four lengths in turn.
fn request_len(r: u32) -> usize {
    [24 << 10, 8 << 10, 16 << 10, 24 << 10][r as usize % 4]
}

/// The retired blocks held as rooms on this thread so far.
fn rooms() -> u64 {
    ROOMS_HELD.with(std::cell::Cell::get)
}

/// One request of a server of an encoder-decoder model (see the test below): the encoder's step
/// (temporaries and its output), then the decoder's first step, which drops the output and makes
/// the request's keys and values of the encoder's output (`kv` arrays of `kv_len` elements, kept
/// for the rest of the request; the last request's are dropped as these are made), then
/// `steps` decoding steps, each replacing the four arrays of the decoder's cache of keys and
/// values by arrays a token longer. Every array's values are checked when it drops. Returns the
/// request's keys and values.
fn request(
    name: &str,
    r: u32,
    last: Vec<(Array<u32>, u32)>,
    (kv, kv_len): (usize, usize),
    steps: usize,
) -> Vec<(Array<u32>, u32)> {
    let v = 1000 * (r + 1);
    let out = {
        let _scope = crate::enter(name);
        chain([64 << 10, 96 << 10, 64 << 10, 96 << 10]);
        filled(16 << 10, v)
    };
    let mut last = last.into_iter();
    let mut keys = Vec::new();
    {
        let _scope = crate::enter(name);
        for k in 0..kv as u32 {
            if let Some((old, w)) = last.next() {
                assert!(holds(&old, w));
            }
            drop(filled(8 << 10, v + 500));
            keys.push((filled(kv_len, v + k), v + k));
        }
        assert!(holds(&out, v));
    }
    // The decoder's cache of keys and values: four arrays, each replaced every step by one a
    // token longer.
    let mut cache: Vec<(Array<u32>, u32)> = Vec::new();
    for t in 0..steps as u32 {
        let _scope = crate::enter(name);
        chain([4 << 10, 6 << 10, 4 << 10]);
        for k in 0..4 {
            let w = v + 100 + 8 * t + k;
            let next = (filled((2 << 10) + 64 * t as usize, w), w);
            if cache.len() == 4 {
                let (old, u) = cache.remove(0);
                assert!(holds(&old, u));
            }
            cache.push(next);
        }
        for (a, w) in &keys {
            assert!(holds(a, *w));
        }
    }
    for (a, w) in cache {
        assert!(holds(&a, w));
    }
    keys
}

/// A server's requests of four lengths in turn (see [`request`]): the decoder's first step of a
/// request leaves the plans (a kind of step of its own), its keys and values go to the block's
/// gaps, and the block, retired under them at the step's end, is held as a *room*: its free
/// bytes serve the arrays the cache serves apart (the next request's keys and values, the
/// decoder's cache of keys and values) until it comes back. From the third request on, one device
/// allocation and no new high; without rooms, 15 and a peak an eighth higher, the arrays apart
/// in blocks of their own beside the retired one. Every array keeps its values (a range of a
/// room is never handed out under a live array), and every block goes back.
#[test]
fn a_retired_blocks_free_bytes_serve_the_arrays_apart() {
    let name = "unit-room";
    let (backend, _installed, _serial) = planned(name);
    let held = rooms();
    let mut kv = Vec::new();
    let (mut allocs, mut peak) = (0, 0);
    for r in 0..8 {
        if r == 2 {
            (allocs, peak) = (backend.allocs(), backend.peak_bytes());
        }
        kv = request(name, r, kv, (6, request_len(r)), 6);
    }
    assert!(
        backend.allocs() - allocs <= 1,
        "{} device allocations from the third request on",
        backend.allocs() - allocs
    );
    assert_eq!(
        backend.peak_bytes(),
        peak,
        "no new high from the third request on"
    );
    assert!(rooms() > held, "no block was held as a room");
    drop(kv);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A room's block comes back once no array of it is alive, wherever they dropped: the last
/// request's keys and values dropped on another thread (their ranges stay taken: the owner
/// does not learn where they were), the owner lets go of the room when its stats are read
/// between steps (as the next step's end would: read before, they counted the block in use
/// with no array alive); and `empty_cache` in the middle of a request leaves the arrays of a
/// room alive and intact. Then nothing of the cache is in use: a hold kept on a block would
/// count the block as in use.
#[test]
fn a_rooms_block_comes_back_when_its_last_array_drops_anywhere() {
    let name = "unit-room-back";
    let (backend, _installed, _serial) = planned(name);
    let held = rooms();
    let mut kv = Vec::new();
    for r in 0..3 {
        kv = request(name, r, kv, (6, request_len(r)), 4);
    }
    assert!(rooms() > held, "no block was held as a room");
    crate::empty_cache();
    for (a, w) in &kv {
        assert!(holds(a, *w));
    }
    let kv = request(name, 3, kv, (6, 8 << 10), 4);
    std::thread::spawn(move || {
        for (a, w) in kv {
            assert!(holds(&a, w));
        }
    })
    .join()
    .unwrap();
    let between = crate::stats(name);
    assert_eq!(between.bytes_in_use, 0, "between steps: {between:?}");
    drop(crate::enter(name));
    assert_eq!(
        crate::stats(name).bytes_in_use,
        0,
        "{:?}",
        crate::stats(name)
    );
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

/// A decoder's cache of keys and values in a room (see [`request`]: four arrays replaced every step
/// by arrays a token longer) goes round the room's ranges kept with their views, as it went round
/// its spares: from the fourth request on, at most a few views made in all (on CUDA, with several
/// streams, a view gets a cudarc slice with two events). Each array taking the smallest free range
/// anew, at a new offset most steps, made 66 there.
#[test]
fn a_decoders_cache_in_a_room_goes_round_ranges_kept_with_their_views() {
    let name = "unit-room-views";
    let (backend, _installed, _serial) = planned(name);
    let held = rooms();
    let mut kv = Vec::new();
    let mut made = 0;
    for r in 0..8 {
        let before = views();
        kv = request(name, r, kv, (6, request_len(r)), 12);
        if r >= 3 {
            made += views() - before;
        }
    }
    assert!(rooms() > held, "no block was held as a room");
    assert!(made <= 4, "{made} views made from the fourth request on");
    drop(kv);
    crate::invalidate(name);
    assert_eq!(backend.outstanding_bytes(), 0, "every block went back");
}

//! Random programs of cache operations, checked after every step against a model of the cache's
//! rules (see the crate docs' "Semantics" and "Threads").
//!
//! A program enters and exits scopes of three cache names (nested, recursive, and exited out of
//! order), allocates arrays of five element types and small shapes (zero-size and scalars
//! included) with every constructor, drops them here or on a helper thread, invalidates,
//! reconfigures (reuse, key policy `Exact` or `SizeClass`, byte cap), empties every cache,
//! allocates through an out-of-memory recovery and reads stats. The model keeps what the rules
//! promise: which buffers are free in which cache, which are waiting for their scope to exit,
//! which were returned by the helper thread and not yet taken in, and which arrays are alive.
//! After every step the test checks, through `snapshot()` (which takes nothing in, unlike
//! `stats()`), that
//!
//! * no two live arrays share storage, and each still holds the pattern written at allocation;
//! * every counter of every cache equals the model's (so `hits + misses` is the number of
//!   non-empty allocations made inside the cache's scopes, `bytes_in_use` the buffers of its live
//!   arrays plus those dropped inside a still-active `Reuse::OnExit` scope and those returned from
//!   the helper thread and not yet taken in, `bytes_cached` its free buffers, all in buffer
//!   capacities: size classes round up);
//! * the backend's outstanding bytes are the caches' bytes plus the live arrays allocated outside
//!   any scope, and its allocation and free counts are the caches' plus those arrays';
//!
//! and after the program that dropping everything, `invalidate` and `empty_cache` give every
//! byte back. A failing program shrinks to a short list of readable operations.
//!
//! The caches are free lists only: each program starts its names as `KeyPolicy::Exact` and
//! configures only `Exact` and `SizeClass`. Planned caches (`KeyPolicy::Planned`, the default,
//! and its deprecated name `KeyPolicy::Arena`) are not modelled: which of their allocations reach
//! the device depends on the plans they make, and their hits and misses are counted
//! heuristically. `prop_planned` checks them instead, for safety (no shared storage, patterns
//! intact, every byte accounted for and given back) and for a repeated step settling on its plan.
//!
//! `empty_cache` reaches every thread's caches, so the tests of this binary run one at a time
//! (`serial()`). `PROPTEST_CASES` sets the number of programs (default [`DEFAULT_CASES`]), shared
//! out among [`PARTS`] tests so that none runs for long.
//!
//! This file is the harness (the tests, and the fixed programs that once mattered); `strategy`
//! draws the programs and `model` applies them and checks the invariants. The tests stay here:
//! proptest finds `prop_programs.proptest-regressions` by the name of the file that holds them.

mod model;
mod strategy;

use crate::programs::{Name, ProgramWorld, cases, run_on_fresh_threads};
use model::World;
use strategy::{Op, program, unroll};

use common::pattern::{Dt, Init};
use common::{configure, serial};
use gpucache::{Array, Device, KeyPolicy, Reuse};
use gpucache_suite::common;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// Programs per run when `PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 256;

/// The random programs run as this many tests, each with its share of the cases (and its own
/// random seed), so that no test runs past libtest's 60-second notice on a 2-core machine.
const PARTS: u32 = 4;

/// The configuration of part `part` (1 to [`PARTS`]). Only part 1 replays the programs kept in
/// the regressions file (and keeps new ones): each part would replay all of them, and under
/// valgrind every replayed program costs seconds. A failure in another part prints its seed.
fn config(part: u32) -> ProptestConfig {
    let mut config = ProptestConfig {
        // Beside this file: tests/all/prop_programs.proptest-regressions.
        failure_persistence: (part == 1).then(|| {
            Box::new(FileFailurePersistence::WithSource("proptest-regressions"))
                as Box<dyn proptest::test_runner::FailurePersistence>
        }),
        ..ProptestConfig::default()
    };
    config.cases = cases(DEFAULT_CASES).div_ceil(PARTS).max(1);
    config
}

proptest! {
    #![proptest_config(config(1))]

    #[test]
    fn random_programs_keep_every_invariant_1(program in program()) {
        let _serial = serial();
        run(&program.0);
    }
}

proptest! {
    #![proptest_config(config(2))]

    #[test]
    fn random_programs_keep_every_invariant_2(program in program()) {
        let _serial = serial();
        run(&program.0);
    }
}

proptest! {
    #![proptest_config(config(3))]

    #[test]
    fn random_programs_keep_every_invariant_3(program in program()) {
        let _serial = serial();
        run(&program.0);
    }
}

proptest! {
    #![proptest_config(config(4))]

    #[test]
    fn random_programs_keep_every_invariant_4(program in program()) {
        let _serial = serial();
        run(&program.0);
    }
}

/// A few programs that once mattered, run on every `cargo test` whatever the random seed.
#[test]
fn fixed_programs() {
    use Op::*;
    let _serial = serial();
    let f32x4x4 = |init| Alloc(Dt::F32, &[4, 4], init);
    // Recursion of one name: the inner exit frees nothing, the outer one frees both.
    run(&[
        Enter(Name::A),
        f32x4x4(Init::Zeros),
        Enter(Name::A),
        f32x4x4(Init::Empty),
        Drop(0),
        Drop(0),
        Exit,
        Exit,
        Enter(Name::A),
        f32x4x4(Init::Empty),
        f32x4x4(Init::FromSlice),
        f32x4x4(Init::Zeros),
    ]);
    // An escaped array dropped on another thread comes home; an invalidated one is freed.
    run(&[
        Enter(Name::B),
        Alloc(Dt::U8, &[300], Init::Empty),
        Exit,
        SendAway(0),
        Enter(Name::B),
        Alloc(Dt::U8, &[300], Init::Empty),
        Invalidate(Name::B),
        SendAway(0),
    ]);
    // Size classes: one buffer serves several shapes and types; a cap evicts it.
    run(&[
        Configure(Name::C, Reuse::Immediate, KeyPolicy::SizeClass, None),
        Enter(Name::C),
        Alloc(Dt::F32, &[100], Init::Zeros),
        Drop(0),
        Alloc(Dt::Bool, &[300], Init::Empty),
        Alloc(Dt::I64, &[7], Init::Empty),
        Drop(0),
        Drop(0),
        Configure(Name::C, Reuse::OnExit, KeyPolicy::SizeClass, Some(0)),
        EmptyCache,
    ]);
    // Out-of-order exit of an outer scope while an inner one stays active.
    run(&[
        Enter(Name::A),
        Enter(Name::B),
        Alloc(Dt::F16, &[2, 3, 4], Init::Empty),
        Drop(0),
        ExitAt(0),
        Alloc(Dt::F16, &[2, 3, 4], Init::Zeros),
        Exit,
        Alloc(Dt::F16, &[2, 3, 4], Init::Zeros),
    ]);
}

/// Found by `random_programs_keep_every_invariant`: with the same name entered twice around
/// another scope, dropping the *outer* guard first must leave the inner entry of that name
/// innermost (the stack is `[a, b, a]`; removing its first entry leaves `[b, a]`).
#[test]
fn dropping_the_outer_guard_of_a_recursive_scope_keeps_the_inner_entry_current() {
    let _serial = serial();
    let outer = gpucache::enter("ooo-a");
    let middle = gpucache::enter("ooo-b");
    let inner = gpucache::enter("ooo-a");
    drop(outer);
    assert_eq!(gpucache::current_scope().as_deref(), Some("ooo-a"));
    drop(inner);
    assert_eq!(gpucache::current_scope().as_deref(), Some("ooo-b"));
    drop(middle);
    assert_eq!(gpucache::current_scope(), None);
}

/// Found by `random_programs_keep_every_invariant`: buffers cached while the cache had no byte
/// cap keep their least-recently-freed order when a cap is set later.
#[test]
fn a_cap_set_later_evicts_the_least_recently_freed_first() {
    let name = "cap-set-later";
    common::free_lists(name);
    let _serial = serial();
    {
        let _scope = gpucache::enter(name);
        let small = Array::<u8>::zeros(Device::Cpu, 300).unwrap(); // the first key
        let big = Array::<i64>::zeros(Device::Cpu, 100).unwrap(); // 800 bytes
        drop(big); // freed first
        drop(small);
    }
    configure(name, |c| c.max_cached_bytes = Some(700));
    let s = gpucache::stats(name);
    assert_eq!(
        (s.evictions, s.bytes_cached),
        (1, 300),
        "the least recently freed buffer alone goes: {s}"
    );
}

/// Runs `program` on a fresh thread (so that its caches start empty and are closed at the end)
/// with a fresh counting backend, and checks the model after every step and after the clean-up.
fn run(program: &[Op]) {
    let mut steps = Vec::new();
    unroll(program, &mut steps);
    run_on_fresh_threads("program", move |backend, helper| {
        let mut world = World::new(backend, helper);
        for (step, op) in steps.iter().enumerate() {
            world.apply(op);
            world.check(&format!("after step {step} ({op:?})"));
        }
        world.clean_up();
    });
}

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

use crate::programs::{NAMES, Name, name};

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread;

use common::pattern::{AnyArray, Dt, Init, first_overlap};
use common::{configure, serial};
use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Array, CacheConfig, CacheStats, Device, KeyPolicy, Reuse, ScopeGuard};
use gpucache_suite::common;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::FileFailurePersistence;

/// Programs per run when `PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 256;

/// The random programs run as this many tests, each with its share of the cases (and its own
/// random seed), so that no test runs past libtest's 60-second notice on a 2-core machine.
const PARTS: u32 = 4;

/// The shapes a program allocates: scalars, zero-size, and a few that repeat often enough to
/// hit. Sizes stay small; under `KeyPolicy::SizeClass` some fall into one class, some do not.
const SHAPES: &[&[usize]] = &[
    &[],
    &[0],
    &[1],
    &[3, 0, 2],
    &[7],
    &[4, 4],
    &[2, 3, 4],
    &[100],
    &[33, 7],
    &[300],
    &[16, 64],
];

/// The byte caps a program configures.
const CAPS: &[Option<usize>] = &[None, Some(0), Some(700), Some(4096)];

/// One operation of a program. Indices into the live arrays or the scope stack are taken
/// modulo their length (an operation on an empty list does nothing).
#[derive(Clone, Debug)]
enum Op {
    /// A loop calling a step `times` times: the step runs `ops` inside a scope of `scope` if it
    /// is set (as a `#[cache_scope]` fn does), then drops the arrays it made that are still
    /// alive, newest first, except the newest one if `returns` (it escapes the step).
    Loop {
        times: usize,
        scope: Option<Name>,
        returns: bool,
        ops: Vec<Op>,
    },
    /// (Unrolled loops only.) A step starts: remember which arrays are new from here on.
    StepStart,
    /// (Unrolled loops only.) A step ends: drop the arrays made since its start, newest first,
    /// except the newest one if `true`.
    StepEnd(bool),
    /// `enter(name)`, left open until an `Exit` (maybe another scope's).
    Enter(Name),
    /// Drop the innermost scope guard.
    Exit,
    /// Drop the scope guard at this depth (outermost is 0), which need not be the innermost.
    ExitAt(usize),
    /// Allocate an array; it gets the next id and that id's pattern.
    Alloc(Dt, &'static [usize], Init),
    /// Drop a live array on this thread.
    Drop(usize),
    /// Send a live array to the helper thread, which checks its pattern and drops it.
    SendAway(usize),
    Invalidate(Name),
    Configure(Name, Reuse, KeyPolicy, Option<usize>),
    EmptyCache,
    /// Allocate as `Alloc`, with the device allocation (if it makes one) failing once: the
    /// out-of-memory recovery gives back what this thread's caches hold, then retries.
    AllocAfterOom(Dt, &'static [usize], Init),
    /// Read `stats` and `summary`.
    Stats(Name),
}

/// Types and shapes that most allocations use, so that programs hit often.
const COMMON: &[(Dt, &[usize])] = &[(Dt::F32, &[4, 4]), (Dt::U8, &[300]), (Dt::I64, &[7])];

/// [`crate::programs::array_type`] over this file's shapes.
fn array_type() -> impl Strategy<Value = (Dt, &'static [usize])> {
    crate::programs::array_type(COMMON, SHAPES)
}

/// Every operation but `Loop`.
fn simple_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => name().prop_map(Op::Enter),
        1 => Just(Op::Exit),
        1 => (0..4usize).prop_map(Op::ExitAt),
        12 => (array_type(), select(&Init::ALL[..])).prop_map(|((d, s), i)| Op::Alloc(d, s, i)),
        8 => (0..16usize).prop_map(Op::Drop),
        2 => (0..16usize).prop_map(Op::SendAway),
        1 => name().prop_map(Op::Invalidate),
        1 => (
            name(),
            select(&[Reuse::OnExit, Reuse::Immediate][..]),
            select(&[KeyPolicy::Exact, KeyPolicy::SizeClass][..]),
            select(CAPS),
        )
            .prop_map(|(n, r, k, c)| Op::Configure(n, r, k, c)),
        1 => Just(Op::EmptyCache),
        1 => array_type().prop_map(|(d, s)| Op::AllocAfterOom(d, s, Init::Zeros)),
        1 => name().prop_map(Op::Stats),
    ]
}

/// A program: simple operations and loops of them, nested up to three deep.
#[derive(Clone)]
struct Program(Vec<Op>);

/// One operation a line, each on one line, so that a shrunk program reads at a glance.
impl fmt::Debug for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[")?;
        for op in &self.0 {
            writeln!(f, "    {op:?},")?;
        }
        write!(f, "]")
    }
}

fn program() -> impl Strategy<Value = Program> {
    let op = simple_op().prop_recursive(3, 64, 8, |inner| {
        let scope = prop::option::weighted(0.9, name());
        (
            1..=3usize,
            scope,
            any::<bool>(),
            prop::collection::vec(inner, 1..8),
        )
            .prop_map(|(times, scope, returns, ops)| Op::Loop {
                times,
                scope,
                returns,
                ops,
            })
    });
    prop::collection::vec(op, 0..16).prop_map(Program)
}

/// The simple operations `ops` runs, in order, loops unrolled.
fn unroll(ops: &[Op], out: &mut Vec<Op>) {
    for op in ops {
        match op {
            Op::Loop {
                times,
                scope,
                returns,
                ops,
            } => {
                for _ in 0..*times {
                    out.extend(scope.map(Op::Enter));
                    out.push(Op::StepStart);
                    unroll(ops, out);
                    out.push(Op::StepEnd(*returns));
                    out.extend(scope.map(|_| Op::Exit));
                }
            }
            simple => out.push(simple.clone()),
        }
    }
}

/// The configuration of part `part` (1 to [`PARTS`]). Only part 1 replays the programs kept in
/// the regressions file (and keeps new ones): each part would replay all of them, and under
/// valgrind every replayed program costs seconds. A failure in another part prints its seed.
fn config(part: u32) -> ProptestConfig {
    let mut config = ProptestConfig {
        // Beside this file: tests/prop_programs.proptest-regressions.
        failure_persistence: (part == 1).then(|| {
            Box::new(FileFailurePersistence::WithSource("proptest-regressions"))
                as Box<dyn proptest::test_runner::FailurePersistence>
        }),
        ..ProptestConfig::default()
    };
    let total = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(DEFAULT_CASES);
    config.cases = total.div_ceil(PARTS).max(1);
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
    let backend = CountingBackend::new();
    thread::scope(|s| {
        let (to_helper, arrays) = channel::<(AnyArray, u64)>();
        let (acks, from_helper) = channel::<bool>();
        let backend = &backend;
        s.spawn(move || {
            let _installed = use_backend(backend);
            for (array, id) in arrays {
                let intact = array.holds(id);
                drop(array);
                if acks.send(intact).is_err() {
                    break;
                }
            }
        });
        let program = thread::Builder::new().name("program".into());
        let main = program.spawn_scoped(s, move || {
            let _installed = use_backend(backend);
            let mut world = World::new(Arc::clone(backend), to_helper, from_helper);
            for (step, op) in steps.iter().enumerate() {
                world.apply(op);
                world.check(&format!("after step {step} ({op:?})"));
            }
            world.clean_up();
        });
        let main = main.expect("spawn");
        // Hand a failure to proptest as it was.
        main.join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    });
    assert_eq!(backend.outstanding_bytes(), 0, "{backend:?}");
    assert_eq!(backend.allocs(), backend.frees(), "{backend:?}");
}

/// A free list key, as `KeyPolicy` defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Exact(Dt, &'static [usize]),
    Class(usize),
}

/// The size class of `bytes > 0` as `KeyPolicy::SizeClass` documents it: 512 bytes and below,
/// then four classes per power of two (`2^k`, `1.25·2^k`, `1.5·2^k`, `1.75·2^k`).
fn size_class(bytes: usize) -> usize {
    (9..usize::BITS - 1)
        .flat_map(|k| (4..8).map(move |m| m << (k - 2)))
        .find(|&c| c >= bytes)
        .expect("test sizes are small")
}

/// Where a live array's buffer belongs.
#[derive(Clone, Copy, Debug)]
struct Home {
    cache: usize,
    generation: u64,
    key: Key,
    capacity: usize,
}

struct LiveArray {
    id: u64,
    array: AnyArray,
    /// `None` for arrays allocated outside any scope (and zero-size arrays).
    home: Option<Home>,
    /// The bytes of the buffer: its capacity, or the array's bytes outside any scope.
    capacity: usize,
}

/// What one cache should hold and have counted.
#[derive(Default)]
struct CacheModel {
    config: CacheConfig,
    /// Active entries (the cache's guards on the scope stack).
    depth: usize,
    generation: u64,
    /// Free buffers, least recently freed first.
    free: VecDeque<(Key, usize)>,
    /// Buffers dropped inside an active `OnExit` scope, in drop order.
    pending: Vec<(Key, usize)>,
    /// Buffers of arrays dropped on the helper thread, not yet taken in, in drop order.
    returned: Vec<Home>,
    /// The event counters (hits, misses, device allocs/frees, invalidations, evictions, peak).
    counted: CacheStats,
}

impl CacheModel {
    fn cached(&self) -> usize {
        self.free.iter().map(|f| f.1).sum()
    }

    fn key(&self, dt: Dt, shape: &'static [usize], bytes: usize) -> (Key, usize) {
        match self.config.key {
            KeyPolicy::Exact => (Key::Exact(dt, shape), bytes),
            KeyPolicy::SizeClass => (Key::Class(size_class(bytes)), size_class(bytes)),
            _ => unreachable!("planned caches are not modelled (see prop_planned)"),
        }
    }

    /// A buffer becomes free; the least recently freed go over the cap.
    fn push_free(&mut self, buffer: (Key, usize)) {
        self.free.push_back(buffer);
        self.evict();
    }

    fn evict(&mut self) {
        let Some(cap) = self.config.max_cached_bytes else {
            return;
        };
        while self.free.iter().map(|f| f.1).sum::<usize>() > cap {
            self.free.pop_front();
            self.counted.evictions += 1;
            self.counted.device_frees += 1;
        }
    }

    /// The buffer of a dropped array with this home comes back, while a scope of the cache is
    /// active or not.
    fn release(&mut self, home: Home, active: bool) {
        if home.generation != self.generation {
            self.counted.device_frees += 1;
        } else if active && self.config.reuse == Reuse::OnExit {
            self.pending.push((home.key, home.capacity));
        } else {
            self.push_free((home.key, home.capacity));
        }
    }

    /// The cache takes in the buffers the helper thread returned.
    fn take_in(&mut self, active: bool) {
        for home in std::mem::take(&mut self.returned) {
            self.release(home, active);
        }
    }

    fn flush(&mut self) {
        self.counted.device_frees += self.free.len() as u64;
        self.free.clear();
    }

    /// Another thread gives the returned buffers back to the device.
    fn free_returned(&mut self) {
        self.counted.device_frees += self.returned.len() as u64;
        self.returned.clear();
    }

    /// Out-of-memory recovery on the owner thread: every buffer that no array owns goes back.
    fn give_back_for_oom(&mut self) {
        self.free_returned();
        self.flush();
        self.counted.device_frees += self.pending.len() as u64;
        self.pending.clear();
    }

    fn enter(&mut self) {
        if self.depth == 0 {
            self.take_in(false);
        }
        self.depth += 1;
    }

    fn invalidate(&mut self) {
        self.flush();
        self.counted.device_frees += self.pending.len() as u64;
        self.pending.clear();
        self.generation += 1;
    }

    fn exit(&mut self) {
        self.depth -= 1;
        if self.depth == 0 {
            self.take_in(false);
            for buffer in std::mem::take(&mut self.pending) {
                self.push_free(buffer);
            }
        }
    }
}

/// The real state (guards, arrays, the helper thread) beside the model of what it should be.
struct World {
    backend: Arc<CountingBackend>,
    /// The cache names (each program runs on a fresh thread, whose caches start empty).
    names: [String; 3],
    /// Caches that exist (entered at least once).
    caches: [Option<CacheModel>; 3],
    /// The options `configure` set for each name (for caches created later).
    configs: [CacheConfig; 3],
    stack: Vec<(usize, ScopeGuard)>,
    /// Live arrays, oldest first.
    live: Vec<LiveArray>,
    /// The first array id of each step under way, innermost last.
    steps: Vec<u64>,
    next_id: u64,
    /// Live arrays allocated outside any scope: their bytes, and allocations/frees of such.
    outside_bytes: usize,
    outside_allocs: u64,
    outside_frees: u64,
    to_helper: Sender<(AnyArray, u64)>,
    from_helper: Receiver<bool>,
}

impl World {
    fn new(
        backend: Arc<CountingBackend>,
        to_helper: Sender<(AnyArray, u64)>,
        from_helper: Receiver<bool>,
    ) -> World {
        let names = NAMES.map(|n| format!("prop/{n:?}"));
        // Options are kept by name for the whole process: start each program from exact free
        // lists (the default policy is `Planned`, which this model does not cover).
        let exact = CacheConfig {
            key: KeyPolicy::Exact,
            ..CacheConfig::default()
        };
        for name in &names {
            gpucache::configure(name, exact);
        }
        World {
            backend,
            names,
            caches: Default::default(),
            configs: [exact; 3],
            stack: Vec::new(),
            live: Vec::new(),
            steps: Vec::new(),
            next_id: 1,
            outside_bytes: 0,
            outside_allocs: 0,
            outside_frees: 0,
            to_helper,
            from_helper,
        }
    }

    /// The model of cache `name`, created (with the name's options) if new.
    fn cache(&mut self, name: Name) -> &mut CacheModel {
        let config = self.configs[name as usize];
        self.caches[name as usize].get_or_insert_with(|| CacheModel {
            config,
            ..CacheModel::default()
        })
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Enter(name) => {
                let guard = gpucache::enter(&self.names[name as usize]);
                self.cache(name).enter();
                self.stack.push((name as usize, guard));
            }
            Op::Exit => {
                if let Some(depth) = self.stack.len().checked_sub(1) {
                    self.exit_at(depth);
                }
            }
            Op::ExitAt(i) => {
                if !self.stack.is_empty() {
                    self.exit_at(i % self.stack.len());
                }
            }
            Op::Alloc(dt, shape, init) => self.alloc(dt, shape, init, false),
            Op::AllocAfterOom(dt, shape, init) => self.alloc(dt, shape, init, true),
            Op::Drop(i) | Op::SendAway(i) => {
                if !self.live.is_empty() {
                    let live = self.live.remove(i % self.live.len());
                    self.drop_array(live, matches!(op, Op::SendAway(_)));
                }
            }
            Op::Invalidate(name) => {
                gpucache::invalidate(&self.names[name as usize]);
                if let Some(cache) = &mut self.caches[name as usize] {
                    cache.take_in(false);
                    cache.invalidate();
                    // Calls count; a change of key policy (below) does not.
                    cache.counted.invalidations += 1;
                }
            }
            Op::Configure(name, reuse, key, max_cached_bytes) => {
                let config = CacheConfig {
                    reuse,
                    key,
                    max_cached_bytes,
                };
                gpucache::configure(&self.names[name as usize], config);
                self.configs[name as usize] = config;
                if let Some(cache) = &mut self.caches[name as usize] {
                    if cache.config.key != key {
                        cache.invalidate();
                    }
                    cache.config = config;
                    cache.evict();
                }
            }
            Op::EmptyCache => {
                gpucache::empty_cache();
                for cache in self.caches.iter_mut().flatten() {
                    cache.free_returned();
                    cache.flush();
                }
            }
            Op::Loop { .. } => unreachable!("loops are unrolled"),
            Op::StepStart => self.steps.push(self.next_id),
            Op::StepEnd(returns) => {
                let first = self.steps.pop().expect("a step started");
                let mut made: Vec<usize> = (0..self.live.len())
                    .filter(|&i| self.live[i].id >= first)
                    .collect();
                if returns {
                    made.pop();
                }
                for i in made.into_iter().rev() {
                    let live = self.live.remove(i);
                    self.drop_array(live, false);
                }
            }
            Op::Stats(name) => {
                let full = &self.names[name as usize];
                let exists = self.caches[name as usize].is_some();
                let table = gpucache::summary();
                assert!(!exists || table.contains(full.as_str()), "{full}:\n{table}");
                let program = thread::current();
                let row = gpucache::snapshot().rows().iter().any(|r| {
                    !r.exited && Some(r.thread.as_str()) == program.name() && &r.cache == full
                });
                assert_eq!(row, exists, "a row for {full} in\n{table}");
                // `stats` takes in what the helper returned; `check` compares the counters.
                let actual = gpucache::stats(full);
                if let Some(cache) = &mut self.caches[name as usize] {
                    let active = cache.depth > 0;
                    cache.take_in(active);
                }
                assert_eq!(actual, self.expected_stats(name as usize), "stats({full})");
            }
        }
        self.note_peaks();
    }

    fn exit_at(&mut self, depth: usize) {
        let (cache, guard) = self.stack.remove(depth);
        drop(guard);
        self.caches[cache].as_mut().expect("entered").exit();
    }

    /// Allocates an array; with `oom`, a device allocation it makes fails once first.
    fn alloc(&mut self, dt: Dt, shape: &'static [usize], init: Init, oom: bool) {
        let id = self.next_id;
        self.next_id += 1;
        let bytes = shape.iter().product::<usize>() * dt.size();
        // Whether a device allocation happens (the model decides before the real call, so that
        // the failure is armed only then), and the free list entry a hit takes.
        let (device_alloc, hit) = match self.stack.last() {
            _ if bytes == 0 => (false, None),
            None => (true, None),
            Some(&(index, _)) => {
                let cache = self.caches[index].as_mut().expect("entered");
                let (key, _) = cache.key(dt, shape, bytes);
                let find = |c: &CacheModel| c.free.iter().rposition(|f| f.0 == key);
                // The hit path looks at the free list alone; a miss takes in what the helper
                // returned and looks again.
                let at = find(cache).or_else(|| {
                    cache.take_in(true);
                    find(cache)
                });
                (at.is_none(), at)
            }
        };
        if oom && device_alloc {
            self.backend.fail_nth(1);
            for cache in self.caches.iter_mut().flatten() {
                cache.give_back_for_oom();
            }
        }
        let array = AnyArray::new(Device::Cpu, dt, shape, init, id)
            .unwrap_or_else(|e| panic!("allocation {id} failed: {e}"));
        let (home, capacity) = match self.stack.last() {
            _ if bytes == 0 => (None, 0),
            None => {
                self.outside_bytes += bytes;
                self.outside_allocs += 1;
                (None, bytes)
            }
            Some(&(index, _)) => {
                let cache = self.caches[index].as_mut().expect("entered");
                let (key, capacity) = cache.key(dt, shape, bytes);
                if let Some(at) = hit {
                    cache.free.remove(at);
                    cache.counted.hits += 1;
                } else {
                    cache.counted.misses += 1;
                    cache.counted.device_allocs += 1;
                }
                let home = Home {
                    cache: index,
                    generation: cache.generation,
                    key,
                    capacity,
                };
                (Some(home), capacity)
            }
        };
        self.live.push(LiveArray {
            id,
            array,
            home,
            capacity,
        });
    }

    fn drop_array(&mut self, live: LiveArray, on_helper: bool) {
        if on_helper {
            self.to_helper
                .send((live.array, live.id))
                .expect("helper alive");
            let intact = self.from_helper.recv().expect("helper alive");
            assert!(
                intact,
                "array {} lost its pattern before it was sent",
                live.id
            );
        } else {
            drop(live.array);
        }
        match live.home {
            Some(home) => {
                let cache = self.caches[home.cache].as_mut().expect("allocated in it");
                if on_helper {
                    // The helper is not the owner: the buffer waits in the return queue.
                    cache.returned.push(home);
                } else {
                    let active = cache.depth > 0;
                    cache.release(home, active);
                }
            }
            None if live.capacity > 0 => {
                self.outside_bytes -= live.capacity;
                self.outside_frees += 1;
            }
            None => {}
        }
    }

    /// Raises each cache's expected peak to the bytes it holds now.
    fn note_peaks(&mut self) {
        for i in 0..self.caches.len() {
            let held = self.in_use(i) + self.caches[i].as_ref().map_or(0, CacheModel::cached);
            if let Some(cache) = &mut self.caches[i] {
                cache.counted.peak_bytes = cache.counted.peak_bytes.max(held);
            }
        }
    }

    /// The bytes cache `i` should count as in use: its live arrays' buffers, of any generation,
    /// the buffers waiting for its scope to exit and those returned but not taken in.
    fn in_use(&self, i: usize) -> usize {
        let live: usize = self
            .live
            .iter()
            .filter(|l| l.home.is_some_and(|h| h.cache == i))
            .map(|l| l.capacity)
            .sum();
        let waiting = self.caches[i].as_ref().map_or(0, |c| {
            let pending: usize = c.pending.iter().map(|p| p.1).sum();
            pending + c.returned.iter().map(|h| h.capacity).sum::<usize>()
        });
        live + waiting
    }

    fn expected_stats(&self, i: usize) -> CacheStats {
        match &self.caches[i] {
            None => CacheStats::default(),
            Some(cache) => CacheStats {
                bytes_in_use: self.in_use(i),
                bytes_cached: cache.cached(),
                ..cache.counted
            },
        }
    }

    fn check(&self, when: &str) {
        let innermost = self.stack.last().map(|&(i, _)| self.names[i].clone());
        assert_eq!(gpucache::current_scope(), innermost, "{when}");

        let mut held = 0;
        let (mut allocs, mut frees) = (self.outside_allocs, self.outside_frees);
        // Read without taking anything in, so that returned buffers stay where they are.
        let snapshot = gpucache::snapshot();
        let program = thread::current();
        let mine = |name: &str| {
            snapshot
                .rows()
                .iter()
                .find(|r| !r.exited && Some(r.thread.as_str()) == program.name() && r.cache == name)
                .map(|r| r.stats)
                .unwrap_or_default()
        };
        for i in 0..self.names.len() {
            let expected = self.expected_stats(i);
            let actual = mine(&self.names[i]);
            assert_eq!(actual, expected, "stats of {} {when}", self.names[i]);
            held += expected.bytes_in_use + expected.bytes_cached;
            allocs += expected.device_allocs;
            frees += expected.device_frees;
        }
        let b = &self.backend;
        assert_eq!(
            b.outstanding_bytes(),
            held + self.outside_bytes,
            "backend bytes {when}"
        );
        assert_eq!(
            (b.allocs(), b.frees()),
            (allocs, frees),
            "backend counts {when}"
        );

        for live in &self.live {
            assert!(
                live.array.holds(live.id),
                "array {} lost its pattern {when}",
                live.id
            );
        }
        let mut ranges: Vec<_> = self
            .live
            .iter()
            .filter_map(|l| Some((l.array.addr()?, l.capacity, l.id)))
            .collect();
        if let Some((a, b)) = first_overlap(&mut ranges) {
            panic!("arrays {a} and {b} share storage {when}");
        }
    }

    /// Drops every array and guard, invalidates every cache and empties them all: the backend
    /// must get every byte back.
    fn clean_up(&mut self) {
        while let Some(live) = self.live.pop() {
            self.drop_array(live, false);
        }
        while let Some(depth) = self.stack.len().checked_sub(1) {
            self.exit_at(depth);
        }
        self.check("after dropping everything");
        for name in NAMES {
            self.apply(&Op::Invalidate(name));
        }
        self.apply(&Op::EmptyCache);
        self.check("after the clean-up");
        assert_eq!(self.backend.outstanding_bytes(), 0);
    }
}

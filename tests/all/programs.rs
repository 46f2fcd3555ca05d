//! What the random-program tests share (`prop_programs`, `prop_planned`): the programs' three
//! cache names, the shapes they allocate and how names and array types are drawn, how a shrunk
//! program prints, the number of programs, the threads a program runs on, the checks of live
//! arrays and of the backend's counts, and the clean-up after a program ([`ProgramWorld`]).

use std::fmt;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread;

use gpucache::testing::{CountingBackend, use_backend};
use gpucache_suite::common::pattern::{AnyArray, Dt, first_overlap};
use proptest::prelude::*;
use proptest::sample::select;

/// A cache name of a program (each test prefixes it, `prop/A`, `planned/A`, ...; each program
/// runs on a fresh thread).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Name {
    A,
    B,
    C,
}

pub const NAMES: [Name; 3] = [Name::A, Name::B, Name::C];

/// Mostly one name, so that scopes are re-entered often and steps repeat.
pub fn name() -> impl Strategy<Value = Name> + Clone {
    prop_oneof![4 => Just(Name::A), 2 => Just(Name::B), 1 => Just(Name::C)]
}

/// The shapes `prop_planned` allocates: scalars, zero-size, and sizes over several 256-byte
/// units (the alignment of a plan's offsets).
pub const SHAPES: &[&[usize]] = &[
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
    &[1000],
];

/// The shapes `prop_programs` allocates: [`SHAPES`] but the largest. Sizes stay small; under
/// `KeyPolicy::SizeClass` some fall into one class, some do not.
pub const SMALL_SHAPES: &[&[usize]] = SHAPES.split_at(SHAPES.len() - 1).0;

/// An element type and shape: mostly one of `common` (so that allocations repeat), else any
/// element type with any of `shapes`.
pub fn array_type(
    common: &'static [(Dt, &'static [usize])],
    shapes: &'static [&'static [usize]],
) -> impl Strategy<Value = (Dt, &'static [usize])> {
    prop_oneof![
        3 => select(common),
        1 => (select(&Dt::ALL[..]), select(shapes)),
    ]
}

/// A program: a list of operations, printed one a line so that a shrunk program reads at a
/// glance.
#[derive(Clone)]
pub struct Program<Op>(pub Vec<Op>);

impl<Op: fmt::Debug> fmt::Debug for Program<Op> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[")?;
        for op in &self.0 {
            writeln!(f, "    {op:?},")?;
        }
        write!(f, "]")
    }
}

/// The number of programs: `PROPTEST_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(default)
}

/// A proptest configuration of [`cases`]`(default)` programs (at least one) whose failures are
/// not persisted (a failing program is printed shrunk, with its seed).
pub fn unpersisted(default: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default).max(1),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// The program thread's way to the helper thread, which checks the pattern of each array sent
/// to it and drops it there.
pub struct Helper {
    arrays: Sender<(AnyArray, u64)>,
    acks: Receiver<bool>,
}

impl Helper {
    /// Drops `array` (of id `id`) on the helper thread, which must find its pattern intact.
    pub fn drop_array(&self, array: AnyArray, id: u64) {
        self.arrays.send((array, id)).expect("helper alive");
        let intact = self.acks.recv().expect("helper alive");
        assert!(intact, "array {id} lost its pattern before it was sent");
    }
}

/// Runs `program` on a fresh thread named `thread_name` (so that its caches start empty and
/// are closed at the end), with a fresh counting backend installed there and on a helper
/// thread that drops the arrays sent to it. A failure is handed on as it was (to proptest);
/// after the program the backend must have every byte back, with as many frees as allocations.
pub fn run_on_fresh_threads(
    thread_name: &str,
    program: impl FnOnce(Arc<CountingBackend>, Helper) + Send,
) {
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
        let main = thread::Builder::new()
            .name(thread_name.into())
            .spawn_scoped(s, move || {
                let _installed = use_backend(backend);
                let helper = Helper {
                    arrays: to_helper,
                    acks: from_helper,
                };
                program(Arc::clone(backend), helper);
            })
            .expect("spawn");
        main.join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    });
    assert_eq!(backend.outstanding_bytes(), 0, "{backend:?}");
    assert_eq!(backend.outstanding_allocs(), 0, "{backend:?}");
}

/// The arrays a program allocated outside any scope (their bytes come from the device
/// directly): the bytes of those alive, and their allocations and frees.
#[derive(Debug, Default)]
pub struct Outside {
    pub bytes: usize,
    pub allocs: u64,
    pub frees: u64,
}

impl Outside {
    /// One of `bytes` bytes was allocated.
    pub fn alloc(&mut self, bytes: usize) {
        self.bytes += bytes;
        self.allocs += 1;
    }

    /// One of `bytes` bytes was freed.
    pub fn free(&mut self, bytes: usize) {
        self.bytes -= bytes;
        self.frees += 1;
    }
}

/// Checks that every live array still holds its pattern and that no two share storage: `live`
/// gives each one's array, id and the bytes its buffer spans.
pub fn check_arrays<'a>(live: impl Iterator<Item = (&'a AnyArray, u64, usize)>, when: &str) {
    let mut ranges = Vec::new();
    for (array, id, bytes) in live {
        assert!(array.holds(id), "array {id} lost its pattern {when}");
        if let Some(addr) = array.addr() {
            ranges.push((addr, bytes, id));
        }
    }
    if let Some((a, b)) = first_overlap(&mut ranges) {
        panic!("arrays {a} and {b} share storage {when}");
    }
}

/// Checks that the backend holds `held` bytes and made `allocs` allocations and `frees` frees:
/// what the caches and the arrays outside any scope account for.
pub fn check_backend(backend: &CountingBackend, held: usize, allocs: u64, frees: u64, when: &str) {
    assert_eq!(
        backend.outstanding_bytes(),
        held,
        "the caches' bytes and the backend's {when}\n{}",
        gpucache::summary()
    );
    // A block grown in place counts in the caches as its old size freed and its new one
    // allocated, in the backend as one allocation (a growth).
    assert_eq!(
        (backend.allocs(), backend.frees() + backend.grows()),
        (allocs, frees),
        "the caches' device allocations and frees and the backend's {when}"
    );
}

/// A random program's world: the real state (scope guards, live arrays) and its checks.
pub trait ProgramWorld {
    /// Drops the newest live array here; `false` when none is alive.
    fn drop_newest(&mut self) -> bool;
    /// How many scopes are entered.
    fn scope_depth(&self) -> usize;
    /// Exits the scope entered at `depth` (0: the outermost), which may not be the innermost.
    fn exit_scope(&mut self, depth: usize);
    /// Invalidates `name`, as a program's operation does.
    fn invalidate(&mut self, name: Name);
    /// Empties every cache, as a program's operation does.
    fn empty_cache(&mut self);
    /// Checks every invariant (`when` says where, for the message).
    fn check(&self, when: &str);
    /// The program's backend.
    fn backend(&self) -> &CountingBackend;

    /// Exits the innermost scope; `false` when none is entered.
    fn exit_innermost(&mut self) -> bool {
        let Some(depth) = self.scope_depth().checked_sub(1) else {
            return false;
        };
        self.exit_scope(depth);
        true
    }

    /// Exits the scope at depth `i` modulo the depth (out of order), if any is entered.
    fn exit_any(&mut self, i: usize) {
        if let Some(depth) = i.checked_rem(self.scope_depth()) {
            self.exit_scope(depth);
        }
    }

    /// Drops every array and guard, invalidates every name and empties every cache: the
    /// backend must get every byte back.
    fn clean_up(&mut self) {
        while self.drop_newest() {}
        while self.exit_innermost() {}
        self.check("after dropping everything");
        for name in NAMES {
            self.invalidate(name);
        }
        self.empty_cache();
        self.check("after the clean-up");
        let b = self.backend();
        assert_eq!(b.outstanding_bytes(), 0, "{b:?}");
        assert_eq!(b.outstanding_allocs(), 0, "{b:?}");
    }
}

/// Implements [`ProgramWorld`] for a world type `$world` whose program operations are `$op`: it
/// has fields `live` (a `Vec`, newest last), `stack` (the entered scopes, innermost last) and
/// `backend`, methods `drop_array(live, on_helper)`, `exit_at(depth)`, `apply(&op)` and
/// `check(when)`, and `$op` has variants `Invalidate(Name)` and `EmptyCache`.
macro_rules! program_world {
    ($world:ty, $op:ty) => {
        impl $crate::programs::ProgramWorld for $world {
            fn drop_newest(&mut self) -> bool {
                let Some(live) = self.live.pop() else {
                    return false;
                };
                self.drop_array(live, false);
                true
            }

            fn scope_depth(&self) -> usize {
                self.stack.len()
            }

            fn exit_scope(&mut self, depth: usize) {
                self.exit_at(depth);
            }

            fn invalidate(&mut self, name: $crate::programs::Name) {
                self.apply(&<$op>::Invalidate(name));
            }

            fn empty_cache(&mut self) {
                self.apply(&<$op>::EmptyCache);
            }

            fn check(&self, when: &str) {
                Self::check(self, when);
            }

            fn backend(&self) -> &gpucache::testing::CountingBackend {
                &self.backend
            }
        }
    };
}
pub(crate) use program_world;

//! What the random-program tests share (`prop_programs`, `prop_planned`): the programs' three
//! cache names, the shapes they allocate and how names and array types are drawn, how a shrunk
//! program prints, the number of programs, and the threads a program runs on.

use std::fmt;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread;

use gpucache::testing::{CountingBackend, use_backend};
use gpucache_suite::common::pattern::{AnyArray, Dt};
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
    assert_eq!(backend.allocs(), backend.frees(), "{backend:?}");
}

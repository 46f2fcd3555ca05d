//! The strategy of `prop_programs`: the operations of a program, how random programs are drawn,
//! and how a program's loops unroll into the simple operations the model applies.

use crate::programs::{Name, Program, SMALL_SHAPES, name};

use gpucache::{KeyPolicy, Reuse};
use gpucache_suite::common::pattern::{Dt, Init};
use proptest::prelude::*;
use proptest::sample::select;

/// The byte caps a program configures.
const CAPS: &[Option<usize>] = &[None, Some(0), Some(700), Some(4096)];

/// One operation of a program. Indices into the live arrays or the scope stack are taken
/// modulo their length (an operation on an empty list does nothing).
#[derive(Clone, Debug)]
pub(super) enum Op {
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

/// [`crate::programs::array_type`] over [`SMALL_SHAPES`].
fn array_type() -> impl Strategy<Value = (Dt, &'static [usize])> {
    crate::programs::array_type(COMMON, SMALL_SHAPES)
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
pub(super) fn program() -> impl Strategy<Value = Program<Op>> {
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
pub(super) fn unroll(ops: &[Op], out: &mut Vec<Op>) {
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

//! What the random-program tests share (`prop_programs`, `prop_planned`): the programs' three
//! cache names and how names and array types are drawn.

use proptest::prelude::*;
use proptest::sample::select;

use gpucache_suite::common::pattern::Dt;

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

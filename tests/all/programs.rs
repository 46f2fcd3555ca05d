//! What the random-program tests share (`prop_programs`, `prop_planned`): the programs' three
//! cache names and how they are drawn.

use proptest::prelude::*;

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

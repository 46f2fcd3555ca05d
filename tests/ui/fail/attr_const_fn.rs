use gpucache::prelude::*;

#[cache_scope(step)]
const fn answer() -> u32 {
    42
}

/// Documented.
#[cache_scope(step)]
pub const unsafe fn unsafe_answer() -> u32 {
    42
}

fn main() {
    const _: u32 = answer(); // still a const fn: no error of its own
}

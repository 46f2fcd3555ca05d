use gpucache::prelude::*;

#[cache_scope(step, reuse = "immediate")]
fn option_after_name() {}

#[cache_scope(name = "step")]
fn option_instead_of_name() {}

fn main() {}

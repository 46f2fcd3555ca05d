use gpucache::prelude::*;

#[cache_scope(42)]
fn a_number() {}

#[cache_scope(b"step")]
fn a_byte_string() {}

#[cache_scope("step"suffix)]
fn a_suffix() {}

fn main() {}

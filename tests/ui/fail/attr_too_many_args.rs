use gpucache::prelude::*;

#[cache_scope(step, epoch)]
fn two_names() {}

#[cache_scope(step epoch)]
fn no_comma() {}

#[cache_scope(model::step)]
fn a_path() {}

fn main() {}

use gpucache::prelude::*;

#[cache_scope("")]
fn empty() {}

fn main() {
    empty();
}

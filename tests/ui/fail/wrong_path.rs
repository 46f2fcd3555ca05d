// The attribute lives in `gpucache::prelude`, the block macro at the crate root: an attribute
// and a function-like macro cannot share one path.

#[gpucache::cache_scope(step)]
fn step() {}

fn main() {
    gpucache::prelude::cache_scope!(step, {});
}

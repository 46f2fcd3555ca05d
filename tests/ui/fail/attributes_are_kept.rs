// The function keeps its attributes: `#[must_use]` and `#[deprecated]` still warn at the call,
// here made errors.
#![deny(unused_must_use, deprecated)]
use gpucache::prelude::*;

#[cache_scope(step)]
#[must_use = "the loss is the point of a step"]
fn step() -> f32 {
    0.5
}

#[deprecated = "use `step`"]
#[cache_scope(step)]
async fn old_step() {}

fn main() {
    step();
    let _ = old_step();
}

use gpucache::prelude::*;

#[cache_scope]
fn no_parentheses() {}

#[cache_scope()]
fn empty_parentheses() {}

fn main() {
    // The functions still exist: their uses add no errors of their own.
    no_parentheses();
    empty_parentheses();
}

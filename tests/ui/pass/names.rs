// Scope names: any identifier (raw or keyword; its text is the name) or a non-empty string
// literal, with an optional trailing comma.
use gpucache::cache_scope;
use gpucache::prelude::*;

#[cache_scope(r#match)]
fn raw() -> Option<String> {
    gpucache::current_scope()
}

#[cache_scope(type)]
fn keyword() -> Option<String> {
    gpucache::current_scope()
}

#[cache_scope("step 1/3",)]
fn trailing_comma() -> Option<String> {
    gpucache::current_scope()
}

fn main() {
    assert_eq!(raw().as_deref(), Some("match"));
    assert_eq!(keyword().as_deref(), Some("type"));
    assert_eq!(trailing_comma().as_deref(), Some("step 1/3"));
    let block = cache_scope!(loop, { gpucache::current_scope() },);
    assert_eq!(block.as_deref(), Some("loop"));
}

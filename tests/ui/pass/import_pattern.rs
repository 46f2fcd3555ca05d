// The documented import pattern makes both macros work bare, and both qualified paths work.
use gpucache::cache_scope;
use gpucache::prelude::*;

#[cache_scope(bare_attr)]
fn bare_attr() -> Option<String> {
    gpucache::current_scope()
}

#[gpucache::prelude::cache_scope("qualified attr")]
fn qualified_attr() -> Option<String> {
    gpucache::current_scope()
}

fn main() {
    assert_eq!(bare_attr().as_deref(), Some("bare_attr"));
    assert_eq!(qualified_attr().as_deref(), Some("qualified attr"));
    let bare = cache_scope!(bare_block, { gpucache::current_scope() });
    assert_eq!(bare.as_deref(), Some("bare_block"));
    let qualified = gpucache::cache_scope!("qualified block", gpucache::current_scope());
    assert_eq!(qualified.as_deref(), Some("qualified block"));
    assert_eq!(gpucache::current_scope(), None);
}

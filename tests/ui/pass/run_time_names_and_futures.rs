// A scope name computed at run time, an `async` body, and a function returning a future.
use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker};

use gpucache::cache_scope;
use gpucache::prelude::*;

#[cache_scope(load)]
fn load() -> impl Future<Output = Option<String>> + Send {
    async { gpucache::current_scope() }
}

#[cache_scope(boxed)]
fn boxed() -> Pin<Box<dyn Future<Output = Option<String>> + Send>> {
    Box::pin(async { gpucache::current_scope() })
}

fn poll<F: Future>(future: F) -> Poll<F::Output> {
    pin!(future).poll(&mut Context::from_waker(Waker::noop()))
}

fn main() {
    let layer = 2;
    let name = format!("layer{layer}");
    let inside = cache_scope!(name = &name, gpucache::current_scope());
    assert_eq!(inside.as_deref(), Some("layer2"));
    let inside = cache_scope!(name, { gpucache::current_scope() }); // the literal name "name"
    assert_eq!(inside.as_deref(), Some("name"));
    let future = cache_scope!(name = name, async move { gpucache::current_scope() });
    assert_eq!(poll(future), Poll::Ready(Some("layer2".to_owned())));
    assert_eq!(poll(load()), Poll::Ready(Some("load".to_owned())));
    assert_eq!(poll(boxed()), Poll::Ready(Some("boxed".to_owned())));
    assert_eq!(gpucache::current_scope(), None);
}

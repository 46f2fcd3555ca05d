//! Runtime behaviour of `#[cache_scope]` and `cache_scope!` in every form: the scope is active
//! inside and not after, on every way out; an `async fn`, a function returning a future and an
//! `async` block given to `cache_scope!` are in their scope only while polled, and their futures
//! stay `Send` and can finish on another thread; a name computed at run time is the value's
//! text; scopes nest and recurse; and the scope really routes allocations through its cache.

use std::borrow::Cow;
use std::fmt::Display;
use std::future::Future;
use std::num::ParseIntError;
use std::panic;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::thread::{self, ThreadId};

use gpucache::cache_scope;
use gpucache::prelude::*;
use gpucache_suite::common;

// ---------------------------------------------------------------------------------------------
// Helpers

/// The calling thread's innermost scope.
fn current() -> Option<String> {
    gpucache::current_scope()
}

fn some(name: &str) -> Option<String> {
    Some(name.to_owned())
}

/// A future that is pending once (after waking itself), then ready.
fn yield_now() -> impl Future<Output = ()> + Send {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
}

fn poll_once<F: Future + ?Sized>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// Polls `future` on this thread until it is ready (the futures here never wait for anything
/// but `yield_now`, which wakes itself at once).
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(value) = poll_once(future.as_mut()) {
            return value;
        }
    }
}

fn assert_send<T: Send>(_: &T) {}

/// Checks a future that reads its scope, yields once, and reads it again: making it entered no
/// scope, it is `Send`, its first poll (here) is in the scope `name` and leaves none behind,
/// and its second poll, on another thread, is in `name` too.
fn assert_in_scope_on_each_poll<F>(future: F, name: &str)
where
    F: Future<Output = (Option<String>, Option<String>)> + Send + 'static,
{
    assert_eq!(current(), None);
    let mut future = Box::pin(future);
    assert!(poll_once(future.as_mut()).is_pending());
    assert_eq!(current(), None);
    let done = thread::spawn(move || block_on(future)).join().unwrap();
    assert_eq!(done, (some(name), some(name)));
}

/// Allocates one small array, in whatever scope is current.
fn alloc() -> gpucache::Result<Array<f32>> {
    Array::<f32>::zeros(Device::Cpu, [16])
}

/// (misses, hits) of this thread's cache `name`.
fn misses_hits(name: &str) -> (u64, u64) {
    let s = gpucache::stats(name);
    (s.misses, s.hits)
}

// ---------------------------------------------------------------------------------------------
// The attribute on sync functions

#[cache_scope(plain)]
fn plain() -> Option<String> {
    current()
}

#[cache_scope("a string name")]
fn string_name() -> Option<String> {
    current()
}

#[cache_scope(r#type)]
fn raw_identifier() -> Option<String> {
    current()
}

#[test]
fn attribute_enters_the_named_scope_and_exits_after() {
    assert_eq!(current(), None);
    assert_eq!(plain(), some("plain"));
    assert_eq!(current(), None);
    assert_eq!(string_name(), some("a string name"));
    assert_eq!(raw_identifier(), some("type"));
    assert_eq!(current(), None);
}

#[cache_scope(parse)]
fn parse(text: &str, seen: &mut Vec<Option<String>>) -> Result<i32, ParseIntError> {
    seen.push(current());
    let n: i32 = text.parse()?;
    seen.push(current());
    if n < 0 {
        return Ok(0);
    }
    Ok(n)
}

#[test]
fn early_question_mark_and_return_exit_the_scope() {
    let mut seen = Vec::new();
    assert!(parse("not a number", &mut seen).is_err());
    assert_eq!(seen, [some("parse")]); // the `?` left before the second push
    assert_eq!(current(), None);

    seen.clear();
    assert_eq!(parse("-3", &mut seen), Ok(0));
    assert_eq!(seen, [some("parse"), some("parse")]);
    assert_eq!(current(), None);

    let _outer = gpucache::enter("outer");
    assert_eq!(parse("12", &mut seen), Ok(12));
    assert_eq!(current(), some("outer"));
}

#[cache_scope(panics)]
fn panics() {
    panic!("inside the scope");
}

#[test]
fn a_panic_exits_the_scope() {
    assert!(panic::catch_unwind(panics).is_err());
    assert_eq!(current(), None);
    assert!(panic::catch_unwind(|| cache_scope!(panics_block, { panics() })).is_err());
    assert_eq!(current(), None);
}

struct Counter {
    count: u32,
}

impl Counter {
    #[cache_scope(new)]
    fn new() -> (Self, Option<String>) {
        (Counter { count: 0 }, current())
    }

    #[cache_scope(by_ref)]
    fn get(&self) -> (u32, Option<String>) {
        (self.count, current())
    }

    #[cache_scope(by_mut)]
    fn bump(&mut self) -> Option<String> {
        self.count += 1;
        current()
    }

    #[cache_scope(by_value)]
    fn into_count(self) -> (u32, Option<String>) {
        (self.count, current())
    }
}

#[test]
fn methods_by_ref_mut_and_value_and_associated_fns() {
    let (mut counter, scope) = Counter::new();
    assert_eq!(scope, some("new"));
    assert_eq!(counter.bump(), some("by_mut"));
    assert_eq!(counter.get(), (1, some("by_ref")));
    assert_eq!(counter.into_count(), (1, some("by_value")));
    assert_eq!(current(), None);
}

trait Describe {
    fn describe(&self) -> String;
}

impl Describe for Counter {
    #[cache_scope(trait_impl)]
    fn describe(&self) -> String {
        format!("{} in {:?}", self.count, current())
    }
}

#[cache_scope(generic)]
fn sum_all<T, I>(items: I) -> (T, Option<String>)
where
    I: IntoIterator<Item = T>,
    T: std::iter::Sum<T>,
{
    (items.into_iter().sum(), current())
}

#[cache_scope(opaque)]
fn show(value: impl Display) -> impl Display {
    format!("{value} in {:?}", current())
}

#[test]
fn generics_where_clauses_impl_trait_and_trait_impls() {
    assert_eq!(sum_all(vec![1, 2, 3]), (6, some("generic")));
    assert_eq!(sum_all([0.5f32, 0.25]), (0.75, some("generic")));
    assert_eq!(show(7).to_string(), "7 in Some(\"opaque\")");
    assert_eq!(Counter { count: 2 }.describe(), "2 in Some(\"trait_impl\")");
    assert_eq!(current(), None);
}

/// Reads `*ptr` in the scope `raw`.
///
/// # Safety
/// `ptr` must be valid for reads.
#[cache_scope(raw)]
unsafe fn read(ptr: *const u32) -> (u32, Option<String>) {
    // SAFETY: the caller promises `ptr` is valid for reads.
    (unsafe { *ptr }, current())
}

#[test]
fn unsafe_fn() {
    let value = 41;
    // SAFETY: `&value` is valid for reads.
    assert_eq!(unsafe { read(&value) }, (41, some("raw")));
    assert_eq!(current(), None);
}

#[track_caller]
#[cache_scope(tracked)]
#[inline]
fn caller_line() -> u32 {
    std::panic::Location::caller().line()
}

#[test]
fn attributes_before_and_after_are_kept() {
    // `#[track_caller]` still works: the location is this line, not the function's.
    assert_eq!(caller_line(), line!());
}

#[cache_scope(outer)]
fn outer(depth: u32, seen: &mut Vec<Option<String>>) {
    seen.push(current());
    inner(seen);
    seen.push(current());
    if depth > 0 {
        outer(depth - 1, seen);
        seen.push(current());
    }
}

#[cache_scope(inner)]
fn inner(seen: &mut Vec<Option<String>>) {
    seen.push(current());
}

#[test]
fn nested_and_recursive_functions() {
    let mut seen = Vec::new();
    outer(1, &mut seen);
    let expected = [
        "outer", "inner", "outer", // depth 1
        "outer", "inner", "outer", // depth 0, inside depth 1
        "outer", // back in depth 1
    ];
    assert_eq!(seen, expected.map(some));
    assert_eq!(current(), None);
}

#[cache_scope(cached_step)]
fn cached_step() -> gpucache::Result<Option<String>> {
    let _x = alloc()?;
    Ok(current())
}

#[test]
fn the_attribute_routes_allocations_through_its_cache() {
    common::free_lists("cached_step");
    let _shared = common::shared();
    for _ in 0..3 {
        assert_eq!(cached_step().unwrap(), some("cached_step"));
    }
    assert_eq!(misses_hits("cached_step"), (1, 2));
}

// ---------------------------------------------------------------------------------------------
// The attribute on async functions

#[cache_scope(fetch)]
async fn fetch(log: &mut Vec<Option<String>>) -> u32 {
    log.push(current());
    yield_now().await;
    log.push(current());
    7
}

#[test]
fn async_fn_is_in_its_scope_only_while_polled() {
    let mut log = Vec::new();
    {
        let _driver = gpucache::enter("driver");
        let mut future = pin!(fetch(&mut log));
        assert_eq!(current(), some("driver")); // creating the future enters nothing
        assert!(poll_once(future.as_mut()).is_pending());
        assert_eq!(current(), some("driver")); // between polls: the caller's scope
        drop(_driver);
        assert_eq!(current(), None);
        assert_eq!(poll_once(future.as_mut()), Poll::Ready(7));
        assert_eq!(current(), None);
    }
    assert_eq!(log, [some("fetch"), some("fetch")]);
}

#[cache_scope(travel)]
async fn travel() -> [(Option<String>, ThreadId); 2] {
    let first = (current(), thread::current().id());
    yield_now().await;
    [first, (current(), thread::current().id())]
}

#[test]
fn async_fn_future_is_send_and_finishes_on_another_thread() {
    let mut future = Box::pin(travel());
    assert_send(&future);
    assert!(poll_once(future.as_mut()).is_pending());
    assert_eq!(current(), None);
    let (polls, after) = thread::spawn(move || (block_on(future), current()))
        .join()
        .unwrap();
    assert_eq!(
        after, None,
        "the other thread is out of the scope once it is done"
    );
    let [(first_scope, first_thread), (second_scope, second_thread)] = polls;
    assert_eq!(
        (first_scope, second_scope),
        (some("travel"), some("travel"))
    );
    assert_eq!(first_thread, thread::current().id());
    assert_ne!(second_thread, first_thread);
}

#[cache_scope(async_panics)]
async fn async_panics() {
    yield_now().await;
    panic!("inside the scope");
}

#[test]
fn a_panic_in_a_poll_exits_the_scope() {
    let mut future = Box::pin(async_panics());
    assert!(poll_once(future.as_mut()).is_pending());
    let poll = panic::catch_unwind(panic::AssertUnwindSafe(|| poll_once(future.as_mut())));
    assert!(poll.is_err());
    assert_eq!(current(), None);
}

#[cache_scope(async_parse)]
async fn async_parse(text: &str, seen: &mut Vec<Option<String>>) -> Result<i32, ParseIntError> {
    seen.push(current());
    yield_now().await;
    let n: i32 = text.parse()?;
    seen.push(current());
    if n < 0 {
        return Ok(0);
    }
    Ok(n)
}

#[test]
fn async_fn_early_question_mark_and_return() {
    let mut seen = Vec::new();
    assert!(block_on(async_parse("x", &mut seen)).is_err());
    assert_eq!(seen, [some("async_parse")]);
    assert_eq!(block_on(async_parse("-1", &mut seen)), Ok(0));
    assert_eq!(block_on(async_parse("5", &mut seen)), Ok(5));
    assert_eq!(current(), None);
}

#[cache_scope(async_outer)]
async fn async_outer(depth: u32) -> Vec<Option<String>> {
    let mut seen = vec![current()];
    seen.push(async_inner().await);
    seen.push(current());
    if depth > 0 {
        // Recursion in an `async fn` needs a box, as without the attribute.
        seen.extend(Box::pin(async_outer(depth - 1)).await);
        seen.push(current());
    }
    seen
}

#[cache_scope(async_inner)]
async fn async_inner() -> Option<String> {
    yield_now().await;
    current()
}

#[test]
fn nested_and_recursive_async_fns() {
    let seen = block_on(async_outer(1));
    let expected = [
        "async_outer",
        "async_inner",
        "async_outer",
        "async_outer",
        "async_inner",
        "async_outer",
        "async_outer",
    ];
    assert_eq!(seen, expected.map(some));
    assert_eq!(current(), None);
}

struct Loader {
    loaded: Vec<u32>,
}

impl Loader {
    #[cache_scope(async_ref)]
    async fn count(&self) -> (usize, Option<String>) {
        yield_now().await;
        (self.loaded.len(), current())
    }

    #[cache_scope(async_mut)]
    async fn load(&mut self, item: u32) -> Option<String> {
        yield_now().await;
        self.loaded.push(item);
        current()
    }

    #[cache_scope(async_value)]
    async fn finish(self) -> (Vec<u32>, Option<String>) {
        yield_now().await;
        (self.loaded, current())
    }
}

#[cache_scope(async_generic)]
async fn async_sum<T, I>(items: I, extra: impl Display + Send) -> (T, String)
where
    I: IntoIterator<Item = T> + Send,
    T: std::iter::Sum<T>,
{
    yield_now().await;
    (
        items.into_iter().sum(),
        format!("{extra} in {:?}", current()),
    )
}

#[cache_scope(async_opaque)]
async fn async_show(value: &str) -> impl Display {
    yield_now().await;
    format!("{value} in {:?}", current())
}

#[test]
fn async_methods_generics_and_impl_trait() {
    let mut loader = Loader { loaded: vec![] };
    assert_eq!(block_on(loader.load(3)), some("async_mut"));
    assert_eq!(block_on(loader.count()), (1, some("async_ref")));
    assert_eq!(block_on(loader.finish()), (vec![3], some("async_value")));
    let future = async_sum(vec![1, 2], "extra");
    assert_send(&future);
    assert_eq!(
        block_on(future),
        (3, "extra in Some(\"async_generic\")".to_owned())
    );
    assert_eq!(
        block_on(async_show("x")).to_string(),
        "x in Some(\"async_opaque\")"
    );
    assert_eq!(current(), None);
}

/// Allocates an array, yields, and drops it, in whatever scope each poll is in.
async fn alloc_across_a_yield() -> gpucache::Result<()> {
    let x = alloc()?;
    yield_now().await;
    drop(x);
    Ok(())
}

#[cache_scope(async_cached)]
async fn async_cached() -> gpucache::Result<()> {
    alloc_across_a_yield().await
}

#[test]
fn async_fn_routes_allocations_through_its_cache() {
    let _shared = common::shared();
    for _ in 0..3 {
        block_on(async_cached()).unwrap();
    }
    assert_eq!(misses_hits("async_cached"), (1, 2));
}

// ---------------------------------------------------------------------------------------------
// The attribute on sync functions that return a future

/// A future that, when polled, is ready with the scope it was polled in.
fn scope_when_polled() -> impl Future<Output = Option<String>> + Send {
    std::future::poll_fn(|_| Poll::Ready(current()))
}

#[cache_scope(opaque_future)]
fn opaque_future(
    log: &mut Vec<Option<String>>,
) -> impl Future<Output = Option<String>> + Send + use<> {
    log.push(current()); // the synchronous part of the body runs in the scope too
    async move {
        yield_now().await;
        current()
    }
}

#[test]
fn fn_returning_impl_future_is_in_its_scope_on_every_poll() {
    let mut log = Vec::new();
    let mut future = Box::pin(opaque_future(&mut log));
    assert_eq!(log, [some("opaque_future")]);
    assert_eq!(current(), None); // made, and the scope exited
    assert_send(&future);
    {
        let _driver = gpucache::enter("driver");
        assert!(poll_once(future.as_mut()).is_pending());
        assert_eq!(current(), some("driver"));
    }
    // The second poll, which reads the scope, on another thread.
    let (scope, after) = thread::spawn(move || (block_on(future), current()))
        .join()
        .unwrap();
    assert_eq!((scope, after), (some("opaque_future"), None));
}

#[cache_scope(early_future)]
fn early_future(early: bool) -> impl Future<Output = Option<String>> + Send {
    if early {
        return scope_when_polled(); // a `return` is wrapped as well as the tail
    }
    scope_when_polled()
}

#[test]
fn fn_returning_impl_future_early_return_is_wrapped_too() {
    assert_eq!(block_on(early_future(true)), some("early_future"));
    assert_eq!(block_on(early_future(false)), some("early_future"));
    assert_eq!(current(), None);
}

/// The shape `async-trait` gives an `async fn` in a trait: a boxed, `Send` future.
trait Fetch {
    fn fetch<'a>(
        &'a self,
        extra: u32,
    ) -> Pin<Box<dyn Future<Output = (u32, Option<String>)> + Send + 'a>>;
    fn local(&mut self) -> Pin<Box<dyn Future<Output = Option<String>> + '_>>;
}

struct Source {
    base: u32,
}

impl Fetch for Source {
    #[cache_scope(boxed_fetch)]
    fn fetch<'a>(
        &'a self,
        extra: u32,
    ) -> Pin<Box<dyn Future<Output = (u32, Option<String>)> + Send + 'a>> {
        Box::pin(async move {
            yield_now().await;
            (self.base + extra, current())
        })
    }

    #[cache_scope(boxed_local)]
    fn local(&mut self) -> Pin<Box<dyn Future<Output = Option<String>> + '_>> {
        self.base += 1;
        let not_send = std::rc::Rc::new(());
        Box::pin(async move {
            yield_now().await;
            drop(not_send);
            current()
        })
    }
}

#[test]
fn fn_returning_a_boxed_future_is_in_its_scope_on_every_poll() {
    let source = Source { base: 1 };
    thread::scope(|threads| {
        let mut future = source.fetch(2);
        assert_send(&future);
        assert!(poll_once(future.as_mut()).is_pending());
        assert_eq!(current(), None);
        let done = threads.spawn(move || block_on(future)).join().unwrap();
        assert_eq!(done, (3, some("boxed_fetch")));
    });
    let mut source = source;
    assert_eq!(block_on(source.local()), some("boxed_local"));
    assert_eq!(source.base, 2);
    assert_eq!(current(), None);
}

#[cache_scope(future_cached)]
fn future_cached() -> impl Future<Output = gpucache::Result<()>> {
    alloc_across_a_yield() // allocates when polled
}

#[test]
fn fn_returning_a_future_routes_allocations_through_its_cache() {
    common::free_lists("future_cached");
    let _shared = common::shared();
    for _ in 0..3 {
        block_on(future_cached()).unwrap();
    }
    assert_eq!(misses_hits("future_cached"), (1, 2));
}

// ---------------------------------------------------------------------------------------------
// The block macro

#[test]
fn block_macro_evaluates_to_the_body_value_in_the_scope() {
    let value = cache_scope!(block, {
        let x = 20;
        (x + 1, current())
    });
    assert_eq!(value, (21, some("block")));
    assert_eq!(current(), None);
    assert_eq!(
        cache_scope!("an expression", current()),
        some("an expression")
    );
    assert_eq!(
        gpucache::cache_scope!(qualified, current()),
        some("qualified")
    );
    assert_eq!(current(), None);
}

fn block_question_mark(text: &str, seen: &mut Vec<Option<String>>) -> Result<i32, ParseIntError> {
    let n = cache_scope!(block_parse, {
        seen.push(current());
        let n: i32 = text.parse()?; // leaves the function, as in a plain block
        seen.push(current());
        if n < 0 {
            return Ok(-1);
        }
        n
    });
    seen.push(current());
    Ok(n * 2)
}

#[test]
fn block_macro_question_mark_and_return_leave_the_enclosing_fn() {
    let mut seen = Vec::new();
    assert!(block_question_mark("x", &mut seen).is_err());
    assert_eq!(seen, [some("block_parse")]);
    seen.clear();
    assert_eq!(block_question_mark("-4", &mut seen), Ok(-1));
    assert_eq!(seen, [some("block_parse"), some("block_parse")]);
    seen.clear();
    assert_eq!(block_question_mark("4", &mut seen), Ok(8));
    assert_eq!(seen, [some("block_parse"), some("block_parse"), None]);
    assert_eq!(current(), None);
}

#[test]
fn block_macro_break_and_continue_the_enclosing_loop() {
    let mut seen = Vec::new();
    let mut i = 0;
    let last = loop {
        i += 1;
        cache_scope!(loop_body, {
            seen.push((i, current()));
            if i == 2 {
                continue;
            }
            if i == 4 {
                break i * 10;
            }
        });
        seen.push((i, current()));
    };
    assert_eq!(last, 40);
    assert_eq!(
        seen,
        [
            (1, some("loop_body")),
            (1, None),
            (2, some("loop_body")),
            (3, some("loop_body")),
            (3, None),
            (4, some("loop_body")),
        ]
    );

    let mut rounds = 0;
    'outer: for _ in 0..3 {
        for _ in 0..3 {
            rounds += 1;
            cache_scope!(labelled, {
                if rounds == 2 {
                    break 'outer;
                }
            });
        }
    }
    assert_eq!(rounds, 2);
    assert_eq!(current(), None);
}

#[test]
fn block_macros_nest_and_restore_the_outer_scope() {
    let seen = cache_scope!(a, {
        let before = current();
        let inner = cache_scope!(b, { cache_scope!(a, current()) });
        (before, inner, current())
    });
    assert_eq!(seen, (some("a"), some("a"), some("a")));
    let seen = cache_scope!(a, (cache_scope!(b, current()), current()));
    assert_eq!(seen, (some("b"), some("a")));
    assert_eq!(current(), None);
}

#[test]
fn block_macro_guard_is_hidden_from_the_body() {
    // A user variable with the guard's name neither clashes with nor drops the guard.
    let __gpucache_scope = 1;
    let value = cache_scope!(hygiene, {
        let __gpucache_scope = __gpucache_scope + 1;
        (__gpucache_scope, current())
    });
    assert_eq!(value, (2, some("hygiene")));
}

#[test]
fn block_macro_await_inside_an_async_body_keeps_the_scope_across_it() {
    async fn body() -> (Option<String>, Option<String>, Option<String>) {
        let seen = cache_scope!(awaiting, {
            let before = current();
            yield_now().await;
            (before, current())
        });
        (seen.0, seen.1, current())
    }
    assert_eq!(block_on(body()), (some("awaiting"), some("awaiting"), None));
}

#[test]
fn block_macro_instruments_an_async_block_around_each_poll() {
    let future = cache_scope!(async_block, async {
        let first = current();
        yield_now().await;
        (first, current())
    });
    assert_in_scope_on_each_poll(future, "async_block");
}

#[test]
fn block_macro_instruments_an_async_move_block_sent_to_another_thread() {
    let data = String::from("abc");
    // The way to `.await` in a scope inside a task that must be `Send`: an `async` body.
    let task = async move {
        let before = current();
        let (sum, inside) = cache_scope!(spawned, async move {
            yield_now().await;
            (data.len(), current())
        })
        .await;
        (before, sum, inside, current())
    };
    assert_send(&task);
    let done = thread::spawn(move || block_on(task)).join().unwrap();
    assert_eq!(done, (None, 3, some("spawned"), None));
}

#[test]
fn block_macro_name_computed_at_run_time() {
    for i in 0..2 {
        let name = format!("layer{i}");
        assert_eq!(cache_scope!(name = &name, current()), some(&name));
        assert_eq!(
            cache_scope!(name = name, { current() }),
            some(&format!("layer{i}"))
        );
    }
    // A bare identifier is the literal name, whatever variable of that name is in scope.
    let name = "not this";
    assert_eq!(cache_scope!(name, current()), some("name"));
    assert_eq!(cache_scope!(name = name, current()), some("not this"));
    // Anything `AsRef<str>`.
    let arc: Arc<str> = Arc::from("arc");
    assert_eq!(cache_scope!(name = arc.clone(), current()), some("arc"));
    assert_eq!(
        cache_scope!(name = Cow::from("cow"), current()),
        some("cow")
    );
    assert_eq!(
        cache_scope!(name = &&String::from("ref"), current()),
        some("ref")
    );
    assert_eq!(current(), None);
}

#[test]
fn block_macro_run_time_name_is_evaluated_once_before_the_body() {
    let mut order = Vec::new();
    let value = cache_scope!(
        name = {
            order.push(("name", current()));
            "once"
        },
        {
            order.push(("body", current()));
            cache_scope!(inner, order.push(("inner", current())));
            order.push(("body", current()));
            7
        }
    );
    assert_eq!(value, 7);
    assert_eq!(
        order,
        [
            ("name", None),
            ("body", some("once")),
            ("inner", some("inner")),
            ("body", some("once")),
        ]
    );
}

fn run_time_name_question_mark(name: &str, text: &str) -> Result<i32, ParseIntError> {
    let n = cache_scope!(name = name, {
        let n: i32 = text.parse()?;
        n + 1
    });
    Ok(n)
}

#[test]
fn block_macro_run_time_name_keeps_the_block_semantics() {
    assert!(run_time_name_question_mark("parse", "x").is_err());
    assert_eq!(run_time_name_question_mark("parse", "1"), Ok(2));
    assert_eq!(current(), None);
}

#[test]
fn block_macro_run_time_name_with_an_async_body() {
    let layer = 3;
    let future = cache_scope!(name = format!("layer{layer}"), async move {
        let first = current();
        yield_now().await;
        (first, current())
    });
    assert_in_scope_on_each_poll(future, "layer3");
}

#[test]
fn block_macro_run_time_name_routes_allocations_through_its_cache() {
    let _shared = common::shared();
    let names = ["run time a".to_owned(), "run time b".to_owned()];
    for _ in 0..3 {
        for name in &names {
            cache_scope!(name = name, alloc()).unwrap();
        }
    }
    assert_eq!(misses_hits("run time a"), (1, 2));
    assert_eq!(misses_hits("run time b"), (1, 2));
}

#[test]
fn block_macro_routes_allocations_through_its_cache() {
    let _shared = common::shared();
    for _ in 0..3 {
        let x = cache_scope!(block_cached, alloc()).unwrap();
        drop(x);
    }
    // Each array escaped its scope and dropped outside it: it went back to the free list
    // when it dropped, and the next entry reused it.
    assert_eq!(misses_hits("block_cached"), (1, 2));
}

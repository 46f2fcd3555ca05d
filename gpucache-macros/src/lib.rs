//! Procedural macros of [`gpucache`](https://docs.rs/gpucache): the attribute
//! `#[cache_scope(name)]` and the block macro `cache_scope!(name, { ... })` (with
//! `cache_scope!(name = <expr>, ..)` for a name computed at run time, and
//! `cache_scope!(name, async { ... })` in async code).
//!
//! Use them through `gpucache`, not from this crate: the attribute is
//! `gpucache::prelude::cache_scope` and the block macro is `gpucache::cache_scope!` (this crate
//! calls it `cache_scope_block`, because an attribute and a function-like macro cannot share a
//! name in one crate). So
//!
//! ```
//! use gpucache::cache_scope;
//! use gpucache::prelude::*;
//! ```
//!
//! makes both work bare. The expansions name `::gpucache::__private`, so the `gpucache` crate
//! must be a dependency under that name.
//!
//! Parsing and every misuse error live in `attr`, code generation in `expand`.

mod attr;
mod expand;

use proc_macro::TokenStream;

/// Runs a function inside the named cache scope: `#[cache_scope(name)]` or
/// `#[cache_scope("name")]`.
///
/// Every [`Array`](https://docs.rs/gpucache/latest/gpucache/struct.Array.html) allocated while
/// the function runs goes through the calling thread's cache `name`, exactly as if the body
/// began with `let _scope = gpucache::enter("name");` — which is what a plain function becomes.
/// The scope exits on every way out of the body: its end, `return`, `?` and a panic. The name
/// is written in the code: an identifier (its text is the name, not a variable's value) or a
/// non-empty string literal. For a name computed at run time, use
/// `cache_scope!(name = <expr>, { ... })` in the body.
///
/// It works on free functions, methods (`&self`, `&mut self`, `self`), associated functions,
/// generic functions with `where` clauses, `impl Trait` arguments and return types, `unsafe fn`,
/// `async fn` and functions that return a future. The function keeps its signature, visibility
/// and attributes (`#[must_use]`, `#[inline]`, doc comments, lints).
///
/// ```
/// use gpucache::prelude::*;
///
/// #[cache_scope(train_step)]
/// fn train_step(x: &Array<f32>) -> gpucache::Result<f32> {
///     assert_eq!(gpucache::current_scope().as_deref(), Some("train_step"));
///     let h = Array::<f32>::zeros(x.device(), x.shape().clone())?; // served again on re-entry
///     Ok(h.len() as f32)
/// }
///
/// let x = Array::from_slice(Device::Cpu, &[1.0f32, 2.0], [2])?;
/// for _ in 0..3 {
///     train_step(&x)?;
/// }
/// assert_eq!(gpucache::current_scope(), None);
/// // The first call allocates, the second makes the plan's block, the third is a hit.
/// assert_eq!((stats("train_step").misses, stats("train_step").hits), (2, 1));
/// # Ok::<(), gpucache::Error>(())
/// ```
///
/// On an **`async fn`** the scope is entered around every poll of the function's future and
/// exited when the poll returns, as `tracing`'s `Instrument` does: a scope belongs to a thread,
/// and between polls the thread runs other tasks. So the future holds no scope while it is
/// pending, it may finish on another thread, and it is `Send` whenever the body's future is.
///
/// ```
/// use std::pin::pin;
/// use std::task::{Context, Poll, Waker};
/// use gpucache::prelude::*;
///
/// #[cache_scope("load batch")]
/// async fn load() -> Option<String> {
///     gpucache::current_scope()
/// }
///
/// let mut future = pin!(load());
/// let mut cx = Context::from_waker(Waker::noop());
/// assert_eq!(future.as_mut().poll(&mut cx), Poll::Ready(Some("load batch".to_owned())));
/// ```
///
/// A **function that returns a future** is treated like an `async fn` written out: when its
/// return type is `impl Future<Output = T>` (with any `+ Send`, `+ 'a`, `+ use<..>`) or
/// `Pin<Box<dyn Future<Output = T> ..>>` (the shape `async-trait` gives an `async fn` in a
/// trait), the body runs in the scope and the future it returns is wrapped so that every poll
/// of it runs in the scope too, on whatever thread polls it. The future stays `Send` when it
/// was. (A boxed future is boxed once more, to keep the declared type.) A future type behind an
/// alias, such as `futures`' `BoxFuture`, cannot be seen from the signature: there, wrap the
/// future in the body with `cache_scope!(name, async move { ... })`.
///
/// ```
/// use std::future::Future;
/// use std::pin::pin;
/// use std::task::{Context, Poll, Waker};
/// use gpucache::prelude::*;
///
/// #[cache_scope(prefetch)]
/// fn prefetch() -> impl Future<Output = Option<String>> + Send {
///     async move { gpucache::current_scope() }
/// }
///
/// let mut future = pin!(prefetch());
/// assert_eq!(gpucache::current_scope(), None); // making the future left the scope
/// let mut cx = Context::from_waker(Waker::noop());
/// assert_eq!(future.as_mut().poll(&mut cx), Poll::Ready(Some("prefetch".to_owned())));
/// ```
///
/// The attribute is not for `const fn` (entering a scope is a run-time effect), for a method
/// declaration without a body, or for any item other than a function: each is a compile error
/// that says so. For a block of code inside a function, use the block macro
/// `gpucache::cache_scope!`.
#[proc_macro_attribute]
pub fn cache_scope(args: TokenStream, item: TokenStream) -> TokenStream {
    let item = proc_macro2::TokenStream::from(item);
    let args = syn::parse::<attr::AttrArgs>(args);
    let func = attr::parse_fn(item.clone());
    let error = match (args, func) {
        (Ok(args), Ok(func)) => return expand::attribute(&args.name, func).into(),
        (Err(mut error), Err(more)) => {
            error.combine(more);
            error
        }
        (Err(error), Ok(_)) | (Ok(_), Err(error)) => error,
    };
    // The item is kept as written, so that its uses report no errors of their own.
    let mut out = error.to_compile_error();
    out.extend(item);
    out.into()
}

/// Runs a block or an expression inside a named cache scope and evaluates to its value:
/// `cache_scope!(name, { ... })`, `cache_scope!("name", expr)`, or with a name computed at run
/// time, `cache_scope!(name = <expr>, { ... })`. In async code, give it an `async` block:
/// `cache_scope!(name, async move { ... })` is a future that is in the scope while it is polled.
///
/// This is `gpucache::cache_scope!` (`gpucache-macros` exports it as `cache_scope_block`,
/// since one crate cannot export an attribute and a function-like macro of the same name).
///
/// # The name
///
/// * `cache_scope!(step, ..)`: **a bare identifier is the literal name**, its text: the scope
///   is `"step"`. It is *not* a variable: after `let name = format!("layer{i}");`,
///   `cache_scope!(name, ..)` is the scope `"name"`, whatever the variable holds.
/// * `cache_scope!("load batch", ..)`: a non-empty string literal is the name.
/// * `cache_scope!(name = <expr>, ..)`: **a name computed at run time.** The expression gives a
///   `&str`, a `String`, or anything `AsRef<str>`; it is evaluated once, before the body, and
///   passed by value (write `name = &names[i]` to lend one). A value of another type is a
///   compile error at the expression. Any string is a name there, as for `gpucache::enter`:
///   an empty one is the cache `""` (only a literal `""`, surely a slip, is refused).
///
/// ```
/// use gpucache::cache_scope;
/// use gpucache::prelude::*;
///
/// for i in 0..2 {
///     let name = format!("layer{i}");
///     cache_scope!(name = &name, {
///         assert_eq!(gpucache::current_scope(), Some(name.clone()));
///     });
///     // A bare identifier is the literal name, not the variable:
///     assert_eq!(cache_scope!(name, gpucache::current_scope()).as_deref(), Some("name"));
/// }
/// ```
///
/// # A block or an expression
///
/// The macro expands to a plain block that enters the scope first,
///
/// ```text
/// { let guard = gpucache::enter("name"); ... }
/// ```
///
/// with no closure in between, so `return`, `?`, `break` and `continue` of an enclosing loop
/// behave as in any block, and the scope exits on every way out.
///
/// ```
/// use gpucache::cache_scope;
/// use gpucache::prelude::*;
///
/// fn epoch(batches: &[Vec<f32>]) -> gpucache::Result<f32> {
///     let mut total = 0.0;
///     for batch in batches {
///         if batch.is_empty() {
///             continue;
///         }
///         total += cache_scope!(step, {
///             let x = Array::from_slice(Device::Cpu, batch, [batch.len()])?; // `?` leaves `epoch`
///             assert_eq!(gpucache::current_scope().as_deref(), Some("step"));
///             x.as_slice()?.iter().sum::<f32>()
///         });
///     }
///     Ok(total)
/// }
///
/// let batches = vec![vec![1.0, 2.0], vec![], vec![3.0, 4.0]];
/// assert_eq!(epoch(&batches)?, 10.0);
/// assert_eq!(gpucache::current_scope(), None);
/// // Each batch went through the cache: the first's array, then the plan's block.
/// assert_eq!(gpucache::stats("step").misses, 2);
///
/// let n = gpucache::cache_scope!("one expression", gpucache::current_scope());
/// assert_eq!(n.as_deref(), Some("one expression"));
/// # Ok::<(), gpucache::Error>(())
/// ```
///
/// # In async code: an `async` block
///
/// **To `.await` inside a scope, give the macro an `async` block** (or `async move`):
/// `cache_scope!(name, async { ... })` evaluates to the block's future, wrapped so that the
/// scope is entered around each of its polls and exited when the poll returns, as
/// `#[cache_scope(name)]` does on an `async fn`. Making the future enters nothing; it holds no
/// scope while it is suspended, it may finish on another thread, and it is `Send` whenever the
/// block's future is, so it can go into a spawned task. `.await` it where the block would
/// have been.
///
/// ```
/// use std::future::Future;
/// use std::pin::pin;
/// use std::task::{Context, Poll, Waker};
/// use gpucache::cache_scope;
///
/// async fn load(batch: Vec<f32>) -> (usize, Option<String>) {
///     std::future::ready(()).await; // e.g. reading the batch
///     (batch.len(), gpucache::current_scope())
/// }
///
/// fn spawn<F: Future + Send + 'static>(task: F) -> F { task } // what an executor asks of a task
///
/// let layer = 1;
/// let task = spawn(async move {
///     let loaded = cache_scope!(load, async { load(vec![1.0; 4]).await }).await;
///     let named = cache_scope!(name = format!("layer{layer}"), async move {
///         gpucache::current_scope()
///     })
///     .await;
///     (loaded, named)
/// });
/// let mut task = pin!(task);
/// let mut cx = Context::from_waker(Waker::noop());
/// let (loaded, named) = match task.as_mut().poll(&mut cx) {
///     Poll::Ready(done) => done,
///     Poll::Pending => unreachable!("nothing here waits"),
/// };
/// assert_eq!(loaded, (4, Some("load".to_owned())));
/// assert_eq!(named.as_deref(), Some("layer1"));
/// ```
///
/// A `{ ... }` body containing `.await` compiles too, but holds the scope across every
/// `.await`: the future is then not `Send` (a spawned task fails to compile with "future cannot
/// be sent between threads safely", as the guard, a `ScopeGuard`, "is not `Send`"), and other
/// tasks that the thread runs meanwhile run inside the scope. Use the `async` block form above.
///
/// A closure body is a compile error (the scope would cover only the closure's creation).
#[proc_macro]
pub fn cache_scope_block(input: TokenStream) -> TokenStream {
    match syn::parse::<attr::BlockArgs>(input) {
        Ok(args) => expand::block(args).into(),
        Err(error) => error.to_compile_error().into(),
    }
}

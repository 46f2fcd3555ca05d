//! Procedural macros of [`gpucache`](https://docs.rs/gpucache): the attribute
//! `#[cache_scope(name)]` and the block macro `cache_scope!(name, { ... })`.
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
/// is an identifier (its text is the name) or a non-empty string literal.
///
/// It works on free functions, methods (`&self`, `&mut self`, `self`), associated functions,
/// generic functions with `where` clauses, `impl Trait` arguments and return types, `unsafe fn`
/// and `async fn`. The function keeps its signature, visibility and attributes (`#[must_use]`,
/// `#[inline]`, doc comments, lints).
///
/// ```
/// use gpucache::prelude::*;
///
/// #[cache_scope(train_step)]
/// fn train_step(x: &Array<f32>) -> gpucache::Result<f32> {
///     assert_eq!(gpucache::current_scope().as_deref(), Some("train_step"));
///     let h = Array::<f32>::zeros(x.device(), x.shape().clone())?; // recycled on re-entry
///     Ok(h.len() as f32)
/// }
///
/// let x = Array::from_slice(Device::Cpu, &[1.0f32, 2.0], [2])?;
/// for _ in 0..3 {
///     train_step(&x)?;
/// }
/// assert_eq!(gpucache::current_scope(), None);
/// assert_eq!((stats("train_step").misses, stats("train_step").hits), (1, 2));
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

/// Runs a block or an expression inside the named cache scope and evaluates to its value:
/// `cache_scope!(name, { ... })` or `cache_scope!("name", expr)`.
///
/// This is `gpucache::cache_scope!` (`gpucache-macros` exports it as `cache_scope_block`,
/// since one crate cannot export an attribute and a function-like macro of the same name). It
/// expands to a plain block that enters the scope first,
///
/// ```text
/// { let guard = gpucache::enter("name"); ... }
/// ```
///
/// with no closure in between, so `return`, `?`, `break` and `continue` of an enclosing loop
/// and `.await` inside the body behave as in any block, and the scope exits on every way out.
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
/// assert_eq!(gpucache::stats("step").hits, 1); // the second batch reused the first's buffer
///
/// let n = gpucache::cache_scope!("one expression", gpucache::current_scope());
/// assert_eq!(n.as_deref(), Some("one expression"));
/// # Ok::<(), gpucache::Error>(())
/// ```
///
/// **In async code** a block containing `.await` holds the scope while the future is suspended,
/// which makes the future `!Send` and lets other tasks of the thread run inside the scope. Put
/// `#[cache_scope(name)]` on an `async fn` instead, or give the macro an `async` block: that is
/// the one special case, `cache_scope!(name, async { ... })` evaluates to the block's future
/// wrapped so that the scope is entered around each of its polls, like the attribute does.
///
/// ```
/// use std::pin::pin;
/// use std::task::{Context, Poll, Waker};
/// use gpucache::cache_scope;
///
/// let future = cache_scope!(load, async { gpucache::current_scope() });
/// assert_eq!(gpucache::current_scope(), None); // making the future entered nothing
/// let mut future = pin!(future);
/// let mut cx = Context::from_waker(Waker::noop());
/// assert_eq!(future.as_mut().poll(&mut cx), Poll::Ready(Some("load".to_owned())));
/// ```
///
/// A closure body is a compile error (the scope would cover only the closure's creation).
#[proc_macro]
pub fn cache_scope_block(input: TokenStream) -> TokenStream {
    match syn::parse::<attr::BlockArgs>(input) {
        Ok(args) => expand::block(args).into(),
        Err(error) => error.to_compile_error().into(),
    }
}

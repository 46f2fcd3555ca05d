//! What the `cache_scope` macros expand to, beyond [`enter`](crate::enter): the future wrapper
//! that enters a scope around every poll of an inner future (behind `#[cache_scope]` on an
//! `async fn` or on a function returning a future, and `cache_scope!` around an `async` block),
//! and the entry points for scope names computed at run time.
//!
//! A scope is a property of a thread ([`enter`](crate::enter) pushes onto the calling thread's
//! scope stack), while a future may be polled on a different thread each time and gives the
//! thread to other tasks while it is pending. So the scope cannot be held across polls: it is
//! entered when [`Instrumented::poll`](std::future::Future::poll) starts and exited when it
//! returns, as `tracing`'s `Instrument` does with spans. Between polls no scope of this future
//! is active, and the wrapper holds no [`ScopeGuard`], so it is `Send` whenever the inner
//! future and the name are.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::scope::{self, ScopeGuard};

pin_project_lite::pin_project! {
    /// A future that runs every poll of `inner` inside the scope `name` (a [`Literal`] for the
    /// names written in the macros, anything [`ScopeName`] for a name computed at run time).
    /// Made by [`instrument`] and [`instrument_fn`].
    #[must_use = "futures do nothing unless you `.await` or poll them"]
    #[derive(Debug)]
    pub struct Instrumented<F, N = Literal> {
        name: N,
        #[pin]
        inner: F,
    }
}

/// A scope name written in the code. (The default type of [`Instrumented`]'s name, so that
/// compiler messages show the wrapper of a future as `Instrumented<F>`.)
#[derive(Debug, Clone, Copy)]
pub struct Literal(pub &'static str);

impl AsRef<str> for Literal {
    #[inline]
    fn as_ref(&self) -> &str {
        self.0
    }
}

/// A scope name computed at run time: anything that gives a `&str` (`&str`, `String`,
/// `Cow<str>`, `Arc<str>`, ...). The macros require it of the expression in
/// `cache_scope!(name = <expr>, ..)`, so that a wrong type is reported there.
#[diagnostic::on_unimplemented(
    message = "a scope name must be a string, not `{Self}`",
    label = "this is not a string: `cache_scope!(name = <expr>, ..)` takes anything `AsRef<str>`",
    note = "write `name = value.to_string()` or `name = format!(\"..\", value)` for a name made \
            from a value"
)]
pub trait ScopeName {
    /// The name.
    fn scope_name(&self) -> &str;
}

impl<N: AsRef<str> + ?Sized> ScopeName for N {
    #[inline]
    fn scope_name(&self) -> &str {
        self.as_ref()
    }
}

/// Enters the scope `name` (computed at run time) until the guard drops.
#[inline]
pub fn enter_named<N: ScopeName>(name: N) -> ScopeGuard {
    scope::enter(name.scope_name())
}

/// Wraps `inner` so that each of its polls runs inside the scope `name`.
pub fn instrument<N: ScopeName, F: Future>(name: N, inner: F) -> Instrumented<F, N> {
    Instrumented { name, inner }
}

/// Runs `make` inside the scope `name`, and wraps the future it returns so that each of its
/// polls runs inside the scope too: the body of a function that returns a future.
pub fn instrument_fn<F: Future>(name: &'static str, make: impl FnOnce() -> F) -> Instrumented<F> {
    let inner = {
        let _scope = scope::enter(name);
        make()
    };
    instrument(Literal(name), inner)
}

impl<F: Future, N: ScopeName> Future for Instrumented<F, N> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let _scope = scope::enter(this.name.scope_name());
        this.inner.poll(cx)
    }
}

//! The future wrapper behind `#[cache_scope]` on an `async fn` (and `cache_scope!` around an
//! `async` block): it enters a scope around every poll of the inner future.
//!
//! A scope is a property of a thread ([`enter`](crate::enter) pushes onto the calling thread's
//! scope stack), while a future may be polled on a different thread each time and gives the
//! thread to other tasks while it is pending. So the scope cannot be held across polls: it is
//! entered when [`Instrumented::poll`](std::future::Future::poll) starts and exited when it
//! returns, as `tracing`'s `Instrument` does with spans. Between polls no scope of this future
//! is active, and the wrapper holds no [`ScopeGuard`](crate::ScopeGuard), so it is `Send`
//! whenever the inner future is.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::scope;

pin_project_lite::pin_project! {
    /// A future that runs every poll of `inner` inside the scope `name`. Made by
    /// [`instrument`].
    #[must_use = "futures do nothing unless you `.await` or poll them"]
    #[derive(Debug)]
    pub struct Instrumented<F> {
        name: &'static str,
        #[pin]
        inner: F,
    }
}

/// Wraps `inner` so that each of its polls runs inside the scope `name`.
pub fn instrument<F: Future>(name: &'static str, inner: F) -> Instrumented<F> {
    Instrumented { name, inner }
}

impl<F: Future> Future for Instrumented<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let _scope = scope::enter(this.name);
        this.inner.poll(cx)
    }
}

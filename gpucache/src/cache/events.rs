//! Feature `tracing`: a cache's `tracing` events (misses, evictions, invalidations), queued on
//! the thread while it holds a cache's state and emitted once it no longer does, so that a
//! subscriber may call into gpucache (`stats`, `summary`, ...) from its handler.
//!
//! The state queues ([`queue`]); the cell emits ([`emit`]) where no reference to any cache state
//! is alive and, outside a scope, after giving the lock up: at the end of each operation
//! outside a scope (`CacheCell::owned`, a `LockGuard`'s drop) and at a scope's outermost exit.
//! Events of an operation inside a scope that does not end there (an eviction caused by a drop,
//! the requests served at a scope's entry) are emitted by the next of those, at the latest when
//! the scope exits. Only the level filters are read under the lock (no subscriber code); events
//! queued while the thread is being torn down may be lost.

use std::cell::RefCell;
use std::mem;
use std::sync::Arc;

use crate::{DType, Device};

/// A queued event.
pub(super) enum Event {
    Miss {
        cache: Arc<str>,
        dtype: DType,
        dims: Box<[usize]>,
        device: Device,
        bytes: usize,
    },
    Invalidated {
        cache: Arc<str>,
    },
    Evicted {
        cache: Arc<str>,
        bytes: usize,
        cap: usize,
    },
}

thread_local! {
    static QUEUE: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

/// Queues the event `make` builds, if debug events are enabled at all (the level filters only:
/// no subscriber code runs here).
#[inline]
pub(super) fn queue(make: impl FnOnce() -> Event) {
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        let _ = QUEUE.try_with(|q| q.borrow_mut().push(make()));
    }
}

/// Emits the queued events. Call with no reference to a cache state alive and no cache lock
/// held but those of this thread's active scopes.
#[inline]
pub(super) fn emit() {
    let events = QUEUE
        .try_with(|q| mem::take(&mut *q.borrow_mut()))
        .unwrap_or_default();
    if !events.is_empty() {
        emit_all(events);
    }
}

#[cold]
#[inline(never)]
fn emit_all(events: Vec<Event>) {
    for event in events {
        match event {
            Event::Miss {
                cache,
                dtype,
                dims,
                device,
                bytes,
            } => tracing::debug!(
                cache = %cache,
                dtype = %dtype,
                dims = ?dims,
                device = %device,
                bytes,
                "cache miss: allocated from the device"
            ),
            Event::Invalidated { cache } => {
                tracing::debug!(cache = %cache, "cache invalidated")
            }
            Event::Evicted { cache, bytes, cap } => tracing::debug!(
                cache = %cache,
                bytes,
                cap,
                "evicted a free buffer to stay within max_cached_bytes"
            ),
        }
    }
}

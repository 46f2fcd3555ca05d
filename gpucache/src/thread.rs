//! Thread identity: a number for each thread that is never reused, and the name shown for it.
//!
//! The bottom of the crate: it imports nothing of gpucache but `sync` (itself a leaf), so every
//! other module may use it (the caches name their owner with it, recorded events their thread,
//! the registry its rows).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A number naming a thread, unique for the life of the process (never reused; never 0).
pub(crate) type ThreadToken = u64;

// `sync`'s: under loom, each modelled thread has its own number, as each OS thread does.
crate::sync::const_thread_local! {
    static TOKEN: Cell<ThreadToken> = Cell::new(0);
}

/// This thread's [`ThreadToken`].
#[inline]
pub(crate) fn token() -> ThreadToken {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    // `TOKEN` has a const initialiser and no destructor, so it can be read at any time, even
    // while the thread's other thread-locals are being destroyed.
    TOKEN.with(|t| match t.get() {
        0 => {
            let token = NEXT.fetch_add(1, Relaxed);
            t.set(token);
            token
        }
        token => token,
    })
}

/// The name shown for this thread: its name, or its `ThreadId` when it has none.
pub(crate) fn name() -> String {
    let thread = std::thread::current();
    match thread.name() {
        Some(name) => name.to_owned(),
        None => format!("{:?}", thread.id()),
    }
}

//! The buffers a step graph keeps: while a run is in progress on this thread (the thread is
//! *holding*, see `backend::capture`), arrays that drop leave their CUDA buffers here instead of
//! going back to their caches; a captured graph then keeps the buffers its step allocated for as
//! long as it lives, so that nothing else gets them while the graph reads and writes them.

use std::cell::RefCell;

use crate::backend::Block;
use crate::cache::{self, Home};
use crate::scope;

/// Buffers with where each goes back to; given back (to their caches, or freed) when dropped.
#[derive(Default)]
pub(crate) struct HeldBuffers(Vec<(Block, Option<Home>)>);

impl HeldBuffers {
    /// The bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.0.iter().map(|(b, _)| b.bytes()).sum()
    }
}

impl Drop for HeldBuffers {
    fn drop(&mut self) {
        for (block, home) in self.0.drain(..) {
            cache::return_block(block, home, scope::current_ptr());
        }
    }
}

thread_local! {
    /// The buffers of the run in progress on this thread (`None`: no run).
    static RUN: RefCell<Option<HeldBuffers>> = const { RefCell::new(None) };
}

/// Starts keeping the buffers of arrays that drop on this thread.
pub(crate) fn start() {
    RUN.with(|run| *run.borrow_mut() = Some(HeldBuffers::default()));
}

/// Stops keeping buffers; returns those kept since [`start`].
pub(crate) fn finish() -> HeldBuffers {
    RUN.with(|run| run.borrow_mut().take()).unwrap_or_default()
}

/// Keeps the block of a dropped array with the run in progress, until the run ends; gives it
/// back as usual if there is no run.
#[cold]
pub(crate) fn hold(block: Block, home: Option<Home>) {
    let mut back = Some((block, home));
    let _ = RUN.try_with(|run| {
        if let Some(run) = run.borrow_mut().as_mut() {
            run.0.extend(back.take());
        }
    });
    if let Some((block, home)) = back {
        cache::return_block(block, home, scope::current_ptr());
    }
}

//! Arena blocks: one device allocation each, in an `Arc` of its own, handed out to arrays as
//! views, with the biased count of the views alive (see the `arena` module for how they are
//! used), and the `slot`s of their arrays' homes. This file holds the data and its `unsafe`
//! handling; it knows nothing of the cache state.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering::*};

use crate::backend::{AllocError, Backend, Block, Storage};
// The view counts are `crate::sync` atomics: loom's under `cfg(loom)`, for `loom_tests`.
use crate::sync::{AtomicBool, AtomicIsize, AtomicUsize};
use crate::{Device, DeviceStats, Result};

/// The `slot` of an arena array's [`Home`](crate::cache::Home) is `VIEW_BASE` plus its position
/// in its step (see the `arena` module), [`NO_POSITION`] when it has none; free lists are
/// numbered below it.
pub(in crate::cache) const VIEW_BASE: u32 = 1 << 31;

/// The position of an array past the most a step records.
pub(in crate::cache) const NO_POSITION: u32 = (1 << 31) - 3;

/// An array served from a gap of its plan's block (a step that left its plan, see the `gaps`
/// module), or from its tail (a step that follows it), has a `slot` of `VIEW_BASE + GAP_BASE`
/// plus the index of its allocation in the step's record (below the most a step records,
/// `1 << 20`).
pub(in crate::cache) const GAP_BASE: u32 = 1 << 30;
const _: () = assert!(GAP_BASE + (1 << 20) < NO_POSITION);

/// The `slot` of a returned block of its own (served apart) whose array dropped on another thread.
pub(in crate::cache) const RETURNED_SOLO: u32 = u32::MAX;

/// The `slot` of a returned retired plan block whose last array dropped on another thread.
pub(in crate::cache) const RETURNED_PLAN: u32 = u32::MAX - 1;

/// Whether a `slot` is an arena array's or a returned arena block's (not a free list's).
#[inline(always)]
pub(in crate::cache) fn is_arena_slot(slot: u32) -> bool {
    slot >= VIEW_BASE
}

/// `bytes` rounded up to [`ALIGN`](crate::planner::ALIGN) (`None` past the largest size).
#[inline]
pub(in crate::cache) fn aligned(bytes: usize) -> Option<usize> {
    crate::planner::aligned(bytes)
}

/// [`aligned`] of a view's `bytes`, which its block holds (no block holds more than
/// `isize::MAX` bytes, so the rounding cannot overflow): the drop's, without the check.
#[inline(always)]
pub(in crate::cache) fn view_size(bytes: usize) -> usize {
    const MASK: usize = crate::planner::ALIGN - 1;
    debug_assert!(bytes <= isize::MAX as usize);
    (bytes + MASK) & !MASK
}

/// One block of an arena cache and the count of arrays bumped from it; the backend of its
/// views.
pub(in crate::cache) struct ArenaBlock {
    pub(in crate::cache) block: Block,
    /// Views made minus views dropped on the owner thread, until retired (lock holder only).
    pub(in crate::cache) local: AtomicUsize,
    /// Until retired: minus the views dropped on other threads. After: the views alive.
    pub(in crate::cache) shared: AtomicIsize,
    /// Set by the lock holder when the block is retired.
    pub(in crate::cache) retired: AtomicBool,
    /// The cache's generation when the block was made.
    pub(in crate::cache) generation: u32,
    /// A block of its own for one array (served apart), retired from the start; else a plan's.
    pub(in crate::cache) solo: bool,
    /// The pointer `Arc::into_raw` gave for this block (set once, when it is made).
    pub(in crate::cache) this: AtomicPtr<ArenaBlock>,
}

impl fmt::Debug for ArenaBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaBlock")
            .field("block", &self.block)
            .finish_non_exhaustive()
    }
}

/// The arena block as the backend of its views, which hold no count of its `Arc`: they are given
/// back with [`Block::drop_view`] by `CacheCell::send_view_home`. `free` is called only if a view
/// is dropped instead, which no path does: it frees nothing (a CUDA view leaks its slice back)
/// and adds the count that the drop of the view's `Arc` takes off, so that the block stays
/// alive (its view count never reaches zero: it is kept, never freed twice).
impl Backend for ArenaBlock {
    fn alloc(&self, _: Device, _: usize, _: bool) -> Result<Storage, AllocError> {
        // Never called: views are made by `Block::view`, not allocated.
        Err(AllocError::OutOfMemory)
    }

    fn free(&self, _: Device, _storage: Storage) {
        debug_assert!(
            false,
            "an arena array's buffer was dropped without its arena"
        );
        // SAFETY: `this` came from `Arc::into_raw`, and the `Arc` is alive: the view being
        // dropped points at it.
        unsafe { Arc::increment_strong_count(self.this.load(Relaxed)) };
    }

    fn stats(&self, _: Device) -> DeviceStats {
        DeviceStats::default()
    }
}

/// A pointer to an [`ArenaBlock`] in its `Arc` (made by [`ArenaBlock::new`], which gives the
/// pointer the one count of the `Arc`; taken back by [`ArenaBlock::into_block`]).
pub(in crate::cache) type BlockPtr = NonNull<ArenaBlock>;

impl ArenaBlock {
    /// A plan's block, with no view yet.
    pub(in crate::cache) fn new(block: Block, generation: u32) -> BlockPtr {
        Self::make(block, generation, false)
    }

    /// A block of its own for one array, retired from the start with that one view counted:
    /// the view's drop, on any thread, takes it back.
    pub(in crate::cache) fn new_solo(block: Block, generation: u32) -> BlockPtr {
        Self::make(block, generation, true)
    }

    fn make(block: Block, generation: u32, solo: bool) -> BlockPtr {
        let arena = Arc::new(ArenaBlock {
            block,
            local: AtomicUsize::new(0),
            shared: AtomicIsize::new(isize::from(solo)),
            retired: AtomicBool::new(solo),
            generation,
            solo,
            this: AtomicPtr::new(std::ptr::null_mut()),
        });
        let this = Arc::into_raw(arena).cast_mut();
        // SAFETY: `Arc::into_raw` gives a valid pointer, never null.
        let this = unsafe { NonNull::new_unchecked(this) };
        // SAFETY: as above; no view exists yet.
        unsafe { this.as_ref() }.this.store(this.as_ptr(), Relaxed);
        this
    }

    /// Takes the block back from its `Arc`, ending the use of the views (their streams' events
    /// are recorded on device memory).
    ///
    /// # Safety
    /// `this` came from [`ArenaBlock::new`], no view of it is alive, and it is not used again.
    pub(in crate::cache) unsafe fn into_block(this: BlockPtr) -> Block {
        // SAFETY: made by `Arc::into_raw` in `new`; the caller gives up the pointer and its count.
        let arena = unsafe { Arc::from_raw(this.as_ptr()) };
        // Views hold no count, so this is the only one.
        let Ok(arena) = Arc::try_unwrap(arena) else {
            unreachable!("a view of an arena block holds a count of it")
        };
        let mut block = arena.block;
        block.end_use();
        block
    }

    /// The block, mutable.
    ///
    /// # Safety
    /// No view of it is alive, and the caller holds the cache's lock (the only way to reach a
    /// block of the cache's): nothing else refers to it while the result lives.
    #[allow(clippy::mut_from_ref)] // no view, no other reference: the caller makes it unique
    pub(in crate::cache) unsafe fn block_mut<'a>(this: BlockPtr) -> &'a mut Block {
        // SAFETY: the pointer came from `Arc::into_raw` (write provenance) and is unaliased
        // (caller).
        unsafe { &mut (*this.as_ptr()).block }
    }

    /// A view of the block was made (lock holder, before retirement).
    #[inline]
    pub(in crate::cache) fn count_view(&self) {
        self.local.store(self.local.load(Relaxed) + 1, Relaxed);
    }

    /// Whether the block is retired (read by the lock holder, who retires it).
    #[inline]
    pub(in crate::cache) fn is_retired(&self) -> bool {
        self.retired.load(Relaxed)
    }

    /// A view dropped on the owner thread before retirement (lock holder).
    #[inline]
    pub(in crate::cache) fn uncount_view(&self) {
        self.local.store(self.local.load(Relaxed) - 1, Relaxed);
    }

    /// A view dropped anywhere but on the owner before retirement: counted down in `shared`.
    /// Returns whether it was the last view of a retired block, whose dropper owns the block
    /// now (synchronised with every other view's drop by `AcqRel`).
    #[inline]
    pub(in crate::cache) fn release_view(&self) -> bool {
        self.shared.fetch_sub(1, AcqRel) == 1
    }

    /// A solo block taken back with its view idle (see `Held::Viewed`) serves an array again
    /// through that view: counted as its one view, as when it was made (lock holder, which
    /// owns the block: its count was zero).
    #[inline]
    pub(in crate::cache) fn reissue_solo(&self) {
        debug_assert!(self.solo && self.retired.load(Relaxed) && self.views() == 0);
        self.shared.store(1, Relaxed);
    }

    /// Retires the block (lock holder): from now on every view's drop goes to
    /// [`ArenaBlock::release_view`]. Returns whether views are alive; `false`: every view was
    /// dropped meanwhile on other threads, and the caller owns the block again.
    pub(in crate::cache) fn retire(&self) -> bool {
        self.retired.store(true, Relaxed);
        let local = self.local.swap(0, Relaxed) as isize;
        self.shared.fetch_add(local, AcqRel) + local > 0
    }

    /// [`ArenaBlock::retire`], with one more view counted: the owner's hold on the block's free
    /// bytes (a `Room`), which keeps the block alive until the owner lets go of it
    /// ([`ArenaBlock::release_view`]), whatever drops meanwhile on other threads. Returns whether
    /// views of arrays are alive; `false`: none is (dropped meanwhile on other threads), the
    /// hold is not taken, and the caller owns the block again.
    pub(in crate::cache) fn retire_held(&self) -> bool {
        self.retired.store(true, Relaxed);
        let local = self.local.swap(0, Relaxed) as isize;
        if self.shared.fetch_add(local + 1, AcqRel) + local > 0 {
            return true;
        }
        // No view anywhere: nothing else touches the count.
        self.shared.store(0, Relaxed);
        false
    }

    /// A view of a retired block held by the owner (see [`ArenaBlock::retire_held`]) was made
    /// (lock holder): counted as alive, as the views counted when it was retired. The hold
    /// keeps the count above zero, so no other thread can be taking the block meanwhile.
    pub(in crate::cache) fn count_held_view(&self) {
        let before = self.shared.fetch_add(1, AcqRel);
        debug_assert!(before > 0, "a view of a retired block nobody holds");
    }

    /// Whether only the owner's hold is left of a retired block's count (lock holder): no
    /// array's view is alive.
    pub(in crate::cache) fn only_held(&self) -> bool {
        self.shared.load(Acquire) == 1
    }

    /// The views alive (lock holder, before retirement).
    pub(in crate::cache) fn views(&self) -> isize {
        self.local.load(Relaxed) as isize + self.shared.load(Acquire)
    }
}

#[cfg(all(test, loom))]
mod loom_tests;

//! The small arrays of steps served online, in *slabs*: one device allocation of [`SLOTS`]
//! slots of [`SMALL`] bytes each, a slot per small array, its view kept idle when the array
//! drops, for the next array in that slot.
//!
//! Online, a small array kept into the next step (a detector's outputs: scores, labels, a few
//! hundred bytes each) sits in the online block where best fit put it, often in its middle, and a
//! later step's largest array may find no range long enough around it (see the arena module's
//! "Steps served online" for when small arrays go to slabs instead). A slab is a block of the
//! cache's, as a plan's block is: its views are counted in the block's biased count (see
//! `block.rs`), dropped on the owner thread they free their slot at once, dropped on another
//! thread they only count down, and their slots come back when no array holds any slot of the
//! slab ([`Slab::reset`]). A slab is given up as a plan's block is (retired while arrays of it
//! are alive, freed by the last of them), by the cache's cold starts, when the scope leaves
//! the online tier, when a view of it was used on another stream (its bytes wait for that
//! work), and, unused, to keep the cache within `max_cached_bytes` (its free slots are cached
//! bytes). A slab last used on another stream is prepared for the thread's only while no array
//! holds a slot of it. This file holds the data; the arena module does what is done with it.

use super::block::BlockPtr;
use super::layout::SMALL;
use crate::backend::Block;

/// The slots of a slab.
pub(super) const SLOTS: usize = 128;

/// The bytes of a slab: [`SLOTS`] of [`SMALL`] bytes (64 KiB).
pub(crate) const SLAB_BYTES: usize = SLOTS * SMALL;

/// The most slabs a device's planned cache keeps (8,192 small arrays alive at once, 4 MiB): past
/// them, small arrays go to the online block as any other.
pub(super) const MAX_SLABS: usize = 64;

// A slot's number fits a byte.
const _: () = assert!(SLOTS <= 1 << 8);

/// A slab: its block, its free slots and their idle views.
pub(in crate::cache) struct Slab {
    /// The slab's block, the cache's (as a plan's block is) until given up.
    pub(super) arena: BlockPtr,
    /// The slots no array holds, the last freed last (taken first).
    free: Vec<u8>,
    /// Each slot's idle view, kept when its array dropped on the owner thread.
    idle: Vec<Option<Block>>,
    /// The bytes of its slots counted in use.
    pub(super) in_use: usize,
    /// A view of it was used on another stream: its bytes wait for that work, and it is given
    /// up at the step's end.
    pub(super) tainted: bool,
}

impl Slab {
    /// A slab of `arena`, every slot free.
    pub(super) fn new(arena: BlockPtr) -> Slab {
        Slab {
            arena,
            free: all_slots(),
            idle: (0..SLOTS).map(|_| None).collect(),
            in_use: 0,
            tainted: false,
        }
    }

    /// The slab's bytes.
    pub(super) fn bytes(&self) -> usize {
        // SAFETY: a slab's block is the cache's, alive until the slab is given up (which
        // consumes it).
        unsafe { self.arena.as_ref() }.block.bytes()
    }

    /// Whether no array holds a slot of it (its views' count is zero).
    pub(super) fn is_unused(&self) -> bool {
        // SAFETY: as in `Slab::bytes`.
        unsafe { self.arena.as_ref() }.views() == 0
    }

    /// Whether a slot is free.
    pub(super) fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// A free slot (the last freed), with its idle view if it kept one.
    pub(super) fn take(&mut self) -> Option<(usize, Option<Block>)> {
        let slot = usize::from(self.free.pop()?);
        Some((slot, self.idle[slot].take()))
    }

    /// The array of `slot` dropped on the owner thread: the slot is free again, with `view`
    /// idle there.
    pub(super) fn put(&mut self, slot: usize, view: Block) {
        debug_assert!(slot < SLOTS && self.idle[slot].is_none());
        self.idle[slot] = Some(view);
        // `slot < SLOTS <= 256`.
        self.free.push(slot as u8);
    }

    /// `slot`, taken, was not used after all (its view could not be made): free again.
    pub(super) fn untake(&mut self, slot: usize) {
        debug_assert!(slot < SLOTS);
        // `slot < SLOTS <= 256`.
        self.free.push(slot as u8);
    }

    /// No array holds a slot of the slab (its count of views is zero): every slot is free, those
    /// of arrays dropped on other threads too.
    pub(super) fn reset(&mut self) {
        self.free = all_slots();
    }

    /// The idle views, taken out (to be dropped before the slab's block goes).
    pub(super) fn take_idle(&mut self) -> impl Iterator<Item = Block> + '_ {
        self.idle.iter_mut().filter_map(Option::take)
    }
}

/// Every slot, slot 0 last (taken first).
fn all_slots() -> Vec<u8> {
    // `SLOTS <= 256`.
    (0..SLOTS).rev().map(|s| s as u8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr::NonNull;

    #[test]
    fn slots_are_taken_last_freed_first_and_all_come_back_on_reset() {
        // The slab's block is never touched here.
        let mut slab = Slab::new(NonNull::dangling());
        let taken: Vec<usize> = (0..3).map(|_| slab.take().unwrap().0).collect();
        assert_eq!(taken, [0, 1, 2]);
        for _ in 3..SLOTS {
            assert!(slab.take().is_some());
        }
        assert!(!slab.has_free() && slab.take().is_none());
        slab.reset();
        assert_eq!(slab.free.len(), SLOTS);
        assert_eq!(slab.take().unwrap().0, 0);
    }
}

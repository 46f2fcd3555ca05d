//! *Rooms*: the free bytes of plan blocks retired under arrays still alive in them, serving the
//! arrays a planned cache serves apart until the blocks come back.
//!
//! A plan's block leaves its plan at a step's end while arrays of the step are alive in it
//! (a decoder's keys and values of the encoder's output, kept for the rest of the request):
//! retired, it is owned by those arrays and goes back to the device when the last of them drops.
//! Until then its other bytes were used by nothing, while the arrays the cache served apart (a
//! server's next request's keys and values, a decoder's logits kept into the next step) took
//! blocks of their own beside it, each a device allocation and more memory held. The owner now
//! keeps a hold on such a block: its free ranges ([`Gaps`], best fit from the bottom) serve
//! those arrays first, through views counted as the block's, and each range is free again when
//! its array drops on the owner thread, used on no other stream: kept with its view at first,
//! for the next array it holds that is at least half its length, as a spare keeps its block and
//! view,
//! then among the free ranges when a range is needed that none of them holds, or past
//! [`KEPT`] such ranges. An array that grew past its recorded size takes room to grow, as its
//! solo block would: a decoder's cache of keys and values goes round a few ranges, and makes
//! no view once they go round (a free range taken at a new offset makes one; with each array
//! taking the smallest free range anew, GPT-2's decoding took 1.51x the host time a step on the
//! H100, the median of 7 rounds, when every view made a cudarc slice with two events).
//!
//! Only a block whose arrays alive take a sixteenth of it or more when it is retired gets a room
//! ([`ROOM_SHARE`]), at most [`MAX_ROOMS`] at once. The hold is one more view in the block's count
//! ([`ArenaBlock::retire_held`](super::block::ArenaBlock::retire_held)), so the block stays alive,
//! and its free ranges known, whatever drops on other threads; the owner lets go when no array's
//! view of the block is alive (at such a drop on the owner thread, or at a step's end, or when the
//! cache's stats are read between steps), and the block comes back as a retired block's does.
//! `invalidate`, `empty_cache` and out-of-memory recovery let go of every room.
//!
//! What a room knows is free: the bytes of the block that no array used when it was retired,
//! and those of its arrays dropped since on the owner thread and used on no other stream. An
//! array dropped on another thread, or used on another stream, keeps its bytes taken until the
//! block comes back. Views of a room are made on the thread's current stream, and only while
//! the block's last use was on that stream, so a range reused is ordered after its earlier use.

use std::ops::Range;

use hashbrown::HashMap;

use super::block::BlockPtr;
use super::gaps::Gaps;
use super::loose::{Loose, drop_views};
use crate::backend::Block;

/// The most rooms a device's planned cache holds at once: a block retired while as many are
/// held is retired without one.
pub(super) const MAX_ROOMS: usize = 4;

/// A block is held as a room only when the arrays alive in it when it is retired take at least
/// this fraction of it: it is held for them anyway. A block almost empty then is about to come
/// back, to be given up and grown for the next plan, and an array apart put in it would keep
/// it retired: ConvNeXt's inference, whose batch's output (4.8 MB) retired its 262 MB block
/// at every step, held 1.59x of its peak live bytes with a room for every such block (the next
/// step's output went there, and every plan made a block beside it), 1.04x without. A Whisper-
/// or BART-style server's block, retired under a request's keys and values of the encoder's
/// output, holds a quarter to most of it in them. (16 and 32 gave the same figures on the logs,
/// measured before a room kept ranges with their views; ConvNeXt's 54th fails at 64.)
pub(super) const ROOM_SHARE: usize = 16;

/// A retired block's free ranges, and the owner's hold on the block.
pub(in crate::cache) struct Room {
    /// The block, held: its count includes the hold.
    pub(super) arena: BlockPtr,
    /// Its bytes that no array uses.
    free: Gaps,
    /// The ranges the room handed out, by offset: their lengths.
    taken: HashMap<usize, usize>,
    /// Ranges whose arrays dropped, kept with their views (offset, length, view), the oldest
    /// first, for the next arrays they hold.
    kept: Vec<(usize, usize, Block)>,
    /// The views of its arrays dropped on the owner thread, idle at their offsets for the next
    /// arrays there (not counted: no array's), as a plan keeps its loose views; dropped before
    /// the hold is let go.
    idle: Loose,
}

/// The most idle views a room keeps when a step ends.
const IDLE_VIEWS: usize = 64;

/// The most ranges a room keeps with their views ([`Room::take_kept`]); past it, the oldest
/// goes back to the free ranges.
const KEPT: usize = 64;

impl Room {
    /// The room of `arena`, retired with the hold taken, whose free bytes are `free`'s.
    pub(super) fn new(arena: BlockPtr, free: Gaps) -> Room {
        Room {
            arena,
            free,
            taken: HashMap::new(),
            kept: Vec::new(),
            idle: Loose::new(IDLE_VIEWS),
        }
    }

    /// The views kept idle, for [`idle_or_new_view`](super::idle_or_new_view).
    pub(super) fn idle(&mut self) -> &mut Loose {
        &mut self.idle
    }

    /// A step ended: the idle views age, the oldest going past the cap.
    pub(super) fn age(&mut self) {
        self.idle.age();
    }

    /// Drops the idle views and those of the kept ranges (before the hold is let go: the block
    /// may go with it).
    pub(super) fn drop_idle(&mut self) {
        drop_views(self.kept.drain(..).map(|(_, _, v)| v));
        drop_views(self.idle.drain());
    }

    /// A range kept with the view of its last array (see [`Room::give_back_viewed`]) that
    /// holds `size` bytes and is at most `most` long, the smallest: handed out again, with the
    /// view. A decoder's cache of keys and values, replaced every step by one a token longer
    /// (its range taken with room to grow), goes round such ranges as it went round its
    /// spares, and makes no view.
    pub(super) fn take_kept(&mut self, size: usize, most: usize) -> Option<(usize, Block)> {
        let k = (0..self.kept.len())
            .filter(|&k| (size..=most).contains(&self.kept[k].1))
            .min_by_key(|&k| self.kept[k].1)?;
        let (offset, len, view) = self.kept.remove(k);
        self.taken.insert(offset, len);
        Some((offset, view))
    }

    /// The `n` oldest kept ranges go back to the free ones, their views idle at their offsets.
    fn unkeep(&mut self, n: usize) {
        for (offset, len, view) in self.kept.drain(..n).collect::<Vec<_>>() {
            self.idle.park(offset, view);
            self.give_back(offset..offset + len);
        }
    }

    /// The offset of `size` aligned bytes for an array, at the bottom of the smallest free
    /// range that holds them, if one does (the kept ranges going back to the free ones first
    /// when none does).
    pub(super) fn take(&mut self, size: usize) -> Option<usize> {
        let offset = match self.free.take_range(size) {
            Some(offset) => offset,
            None => {
                self.unkeep(self.kept.len());
                self.free.take_range(size)?
            }
        };
        self.taken.insert(offset, size);
        Some(offset)
    }

    /// The array at `offset` dropped on the owner thread, used on no other stream: its range
    /// (the one the room handed out there, else `len` bytes: an array the block held when the
    /// room was made) is kept with its view for the next array it holds ([`Room::take_kept`]).
    pub(super) fn give_back_viewed(&mut self, offset: usize, len: usize, view: Block) {
        let len = self.taken.remove(&offset).unwrap_or(len);
        self.kept.push((offset, len, view));
        if self.kept.len() > KEPT {
            self.unkeep(1);
        }
    }

    /// The range at `offset` that [`Room::take`] handed out was not used: free again.
    pub(super) fn untake(&mut self, offset: usize) {
        if let Some(len) = self.taken.remove(&offset) {
            self.give_back(offset..offset + len);
        }
    }

    /// The bytes of `range` are free again.
    fn give_back(&mut self, range: Range<usize>) {
        // Every array alive in the block when the room was made was taken out of its free
        // ranges, and each range goes back once, when its array drops: a range partly free
        // already would be a bug, which stays a byte range lost rather than a panic in a drop.
        if self.free.overlaps_free(&range) {
            debug_assert!(
                false,
                "{range:?} given back to a room where it is partly free"
            );
            return;
        }
        self.free.free(range);
    }
}

//! Steps served *online*, and the [`Shadow`] that says, as a scope's steps come, whether
//! serving them so would hold less than its plans do.
//!
//! A plan holds a step that comes again (a training step, a batch of a size seen before) at
//! about its peak live bytes. A step that never comes again (a detector's: as many proposals
//! as its images give) leaves the plan made from the step before, is served from the block's
//! gaps, and is planned again; the arrays that no gap holds go apart, and in runs of such steps
//! the plans' block and what goes beside it drift up (Mask R-CNN: 1.4x-2.1x of its peak live
//! bytes). Served *online*, every allocation of a step comes from the free ranges of one block
//! per device, best fit ([`Gaps`]), from its first allocation on; an array no range holds grows
//! the block at its top by what its top free range lacks, in whole [`GRANULE`]s; the arrays
//! alive at a step's end stay where they are (pins) and the next step's ranges go around them;
//! no plan is made. That holds Mask R-CNN's long runs at 1.11x-1.27x of their peak live bytes
//! where its plans held up to 2.13x, but holds steps that come again in kind worse than their
//! plans (a CNN whose batch varies: 1.3x-1.4x online where its plans hold 1.01x-1.08x). So a
//! scope is served online only once its plans are measured to hold more than online serving
//! would (the arena module's "Steps served online" says when).
//!
//! Small arrays kept into the next step (a detector's outputs, a few hundred bytes each) sit
//! where best fit put them, often in the block's middle; once the block grows while such arrays
//! are in it, a scope's small arrays get slots of slabs (the arena module's "Steps served
//! online"), and the block holds its larger arrays alone (Keypoint R-CNN's long runs: 1.38x of
//! their peak live bytes in seven of thirteen orders, 1.19x at most since).
//!
//! The [`Shadow`] is that measure: online serving simulated on the steps' records (each
//! allocation's aligned size, in order, and the tick its array dropped) and on the drops of
//! arrays kept from earlier steps, in a block of its own that exists only as numbers. It runs
//! only for a scope whose steps have left their plans (a fixed-shape loop never pays for it).
//! Its block's size is what online serving would have held; the cache's own peak is what the
//! plans held.

use std::mem;

use super::gaps::Gaps;
use super::layout::{OPEN, Rec};

/// The unit an online block grows by: 2 MiB, the granularity in which CUDA maps memory in
/// place. (In unit tests, 64 KiB, so that steps of small arrays show what large ones do.)
pub(super) const GRANULE: usize = if cfg!(test) { 64 << 10 } else { 2 << 20 };

/// The most arrays alive at a step's end that an online block keeps where they are (pins):
/// a detector's outputs and the like. More, and the step is planned again as a plan's would be.
pub(super) const MAX_ONLINE_PINS: usize = 256;

/// The most arrays kept across steps that the shadow tracks: one dropped where the owner does
/// not see it (on another thread) would otherwise stay in it for good.
const MAX_SHADOW_KEPT: usize = 4 * MAX_ONLINE_PINS;

/// An array kept across steps whose name came this many names before the next step's first is
/// let go by the shadow (as when it keeps too many): the gaps keep the ranges out in a window of
/// names from the oldest still out, which an array kept for good would otherwise widen by every
/// step's allocations (a million a step, at most, for sixteen steps).
const MAX_SHADOW_SPAN: u32 = if cfg!(test) { 4096 } else { 1 << 20 };

/// A block grows by at least this fraction of its bytes, so that arrays that grow a little
/// every step (a decoder's cache of keys and values, a token longer) grow it rarely: each
/// growth maps memory (tens of microseconds on CUDA).
pub(super) const GROWTH_SHARE: usize = 32;

/// The bytes by which a block of `bytes` must grow for an array of `size` bytes at its top,
/// where `top_free` bytes are free: what they lack, at least a [`GROWTH_SHARE`]th of the
/// block, in whole granules. `None` when the block would pass `isize::MAX` bytes, as no
/// allocation can (nor can its free ranges be counted).
pub(super) fn growth(size: usize, top_free: usize, bytes: usize) -> Option<usize> {
    let by = size
        .saturating_sub(top_free)
        .max(bytes / GROWTH_SHARE)
        .checked_next_multiple_of(GRANULE)?;
    bytes
        .checked_add(by)
        .filter(|&grown| grown <= isize::MAX as usize)
        .map(|_| by)
}

/// The bytes the block of `gaps` grows to for an array of `size` bytes that no free range
/// holds ([`growth`]: at most `isize::MAX`, so the sum cannot overflow).
pub(super) fn grown_for(gaps: &Gaps, size: usize) -> Option<usize> {
    let bytes = gaps.bytes();
    growth(size, gaps.top_free(), bytes).map(|by| bytes + by)
}

/// Online serving simulated on a scope's steps, one device's: see the module's docs.
#[derive(Default)]
pub(in crate::cache) struct Shadow {
    /// The simulated block's free ranges (none before its first array).
    gaps: Option<Gaps>,
    /// The name of the next array (names only grow: [`Gaps`] keeps the ranges out in a window
    /// of them).
    next: u32,
    /// The arrays alive at the end of their step, the oldest first: the step that made them,
    /// their aligned bytes and their name.
    kept: Vec<(u32, usize, u32)>,
    /// How many steps it has seen.
    steps: u32,
    /// How many of them followed their plans to the end and kept them, with no device
    /// allocation.
    plans_held: u32,
    /// The bytes the cache had in use when it began on arrays of earlier steps, which it never
    /// sees (a training loop's parameters, gradients and optimizer state).
    before: usize,
    /// The bytes of the arrays it holds.
    live: usize,
    /// The most bytes of arrays it held at once: online serving's lower bound.
    peak: usize,
    /// Scratch: the drops of a step, as (tick, name, bytes).
    drops: Vec<(u32, u32, usize)>,
}

impl Shadow {
    /// A shadow beginning at a step's end, when the cache has `before` bytes in use on arrays
    /// of earlier steps.
    pub(super) fn starting(before: usize) -> Shadow {
        Shadow {
            before,
            ..Shadow::default()
        }
    }

    /// The bytes online serving would have held at most, so far.
    pub(super) fn held(&self) -> usize {
        self.gaps.as_ref().map_or(0, Gaps::bytes)
    }

    /// The most bytes of the arrays it has seen alive at once.
    pub(super) fn peak(&self) -> usize {
        self.peak
    }

    /// How many steps it has seen.
    pub(super) fn steps(&self) -> u32 {
        self.steps
    }

    /// The step just seen followed its plan to the end and kept it, with no device allocation.
    pub(super) fn plan_held(&mut self) {
        self.plans_held = self.plans_held.saturating_add(1);
    }

    /// Whether every step it has seen after its first (the one that left its plan) followed
    /// its plan to the end and kept it, with no device allocation.
    pub(super) fn plans_held_since(&self) -> bool {
        self.plans_held.saturating_add(1) >= self.steps
    }

    /// The bytes the cache had in use when it began on arrays of earlier steps.
    pub(super) fn before(&self) -> usize {
        self.before
    }

    /// Step `step` ended: `record` holds its allocations in order (an array still alive has
    /// the end [`OPEN`]), `earlier` the arrays of earlier steps that dropped in it, as the tick
    /// they dropped at, the step that made them and their aligned bytes. Returns `false` when it
    /// can no longer name the step's arrays (after four billion allocations) or its block would
    /// pass `isize::MAX` bytes: it is to be dropped.
    pub(super) fn step(
        &mut self,
        step: u32,
        record: &[Rec],
        earlier: &[(u32, u32, usize)],
    ) -> bool {
        let n = record.len() as u32;
        let Some(next) = self.next.checked_add(n) else {
            return false;
        };
        let base = self.next;
        self.next = next;
        self.steps = self.steps.saturating_add(1);
        let mut drops = mem::take(&mut self.drops);
        drops.clear();
        for &(tick, made, bytes) in earlier {
            // An array made before the shadow began, or served where it does not look, is
            // not in it; one of the same step and size is as good as another.
            if let Some(i) = self
                .kept
                .iter()
                .position(|&(s, b, _)| s == made && b == bytes)
            {
                let (_, _, name) = self.kept.remove(i);
                drops.push((tick, name, bytes));
            }
        }
        for (k, r) in (0..n).zip(record) {
            if r.end != OPEN {
                drops.push((r.end.clamp(k + 1, n), base + k, r.bytes));
            }
        }
        // By tick: each tick's drops are given back before its allocation, in any order (they
        // leave the same free ranges whatever the order).
        drops.sort_unstable_by_key(|&(tick, ..)| tick);
        let mut j = 0;
        for (k, r) in (0..n).zip(record) {
            while let Some(&(_, name, bytes)) = drops.get(j).filter(|d| d.0 <= k) {
                self.give_back(name, bytes);
                j += 1;
            }
            if !self.take(base + k, r.bytes) {
                return false;
            }
        }
        for &(_, name, bytes) in &drops[j..] {
            self.give_back(name, bytes);
        }
        self.drops = drops;
        for (k, r) in (0..n).zip(record) {
            if r.end == OPEN && r.bytes > 0 {
                self.kept.push((step, r.bytes, base + k));
            }
        }
        // Too many kept: the older half goes; and any named too long ago.
        let oldest = self.next.saturating_sub(MAX_SHADOW_SPAN);
        let old = self.kept.iter().take_while(|k| k.2 < oldest).count();
        let n = if self.kept.len() > MAX_SHADOW_KEPT {
            old.max(MAX_SHADOW_KEPT / 2)
        } else {
            old
        };
        let gone: Vec<_> = self.kept.drain(..n).collect();
        for (_, bytes, name) in gone {
            self.give_back(name, bytes);
        }
        true
    }

    /// Array `name` of `size` bytes, made: best fit, the block grown if no range holds it.
    /// Returns `false` when the block would pass `isize::MAX` bytes (requests the device
    /// refused, of nearly that many bytes, kept in the record).
    fn take(&mut self, name: u32, size: usize) -> bool {
        if size == 0 {
            return true;
        }
        let gaps = match &mut self.gaps {
            Some(gaps) => gaps,
            None => match growth(size, 0, 0) {
                Some(bytes) => self.gaps.insert(Gaps::new(bytes, [])),
                None => return false,
            },
        };
        if gaps.take(name, size, false).is_none() {
            let Some(bytes) = grown_for(gaps, size) else {
                return false;
            };
            gaps.grow(bytes);
            let taken = gaps.take(name, size, false);
            debug_assert!(
                taken.is_some(),
                "the grown block holds {size} bytes at its top"
            );
            if taken.is_none() {
                return false;
            }
        }
        // Every array it holds is in its block, of at most `isize::MAX` bytes.
        self.live += size;
        self.peak = self.peak.max(self.live);
        true
    }

    /// Array `name` of `size` bytes dropped.
    fn give_back(&mut self, name: u32, size: usize) {
        if let Some(gaps) = &mut self.gaps
            && gaps.give_back(name, size).is_some()
        {
            self.live -= size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests' arrays are multiples of a granule.
    const G: usize = GRANULE;

    /// A record of arrays of `sizes` (granules), each dropping at the tick given (or kept: `OPEN`).
    fn record(arrays: &[(usize, u32)]) -> Vec<Rec> {
        arrays
            .iter()
            .map(|&(g, end)| Rec {
                bytes: g * G,
                end,
                planned: 0,
            })
            .collect()
    }

    #[test]
    fn growth_is_what_the_top_range_lacks_in_whole_granules() {
        assert_eq!(growth(3 * G, 0, 0), Some(3 * G));
        assert_eq!(growth(3 * G, 2 * G, 8 * G), Some(GRANULE));
        assert_eq!(growth(3 * G, 3 * G, 0), Some(0));
        assert_eq!(growth(1, 0, 0), Some(GRANULE));
        // A large block grows by a 32nd of it at least.
        assert_eq!(growth(1, 0, 640 * G), Some(20 * G));
        assert_eq!(growth(30 * G, 0, 640 * G), Some(30 * G));
        assert_eq!(growth(30 * G - 1, 0, 0), Some(30 * G), "whole granules");
        // Past `isize::MAX` bytes: no growth.
        assert_eq!(growth(usize::MAX - 1, 0, 0), None);
        assert_eq!(growth(1 << 62, 0, 1 << 62), None);
        assert_eq!(growth(1 << 61, 0, 1 << 62), Some(1 << 61));
    }

    #[test]
    fn a_step_is_held_in_its_peak_live_bytes_when_best_fit_allows() {
        let mut s = Shadow::default();
        // 4 and 2 granules alive, the 4 dropped; then 4 more fit where they were.
        assert!(s.step(0, &record(&[(4, 2), (2, 3), (4, 3)]), &[]));
        assert_eq!(s.held(), 6 * G);
        assert_eq!(s.steps(), 1);
        assert_eq!(s.peak(), 6 * G);
        // The same step again: no growth.
        assert!(s.step(1, &record(&[(4, 2), (2, 3), (4, 3)]), &[]));
        assert_eq!(s.held(), 6 * G);
    }

    #[test]
    fn an_array_kept_past_its_step_holds_its_range_until_it_drops() {
        let mut s = Shadow::default();
        // An output of 2 granules kept into the next step.
        s.step(0, &record(&[(4, 1), (2, OPEN)]), &[]);
        assert_eq!(s.held(), 4 * G, "the output fits where the first array was");
        // The next step's first array cannot go where the output is: the block grows by what its
        // top range lacks.
        s.step(1, &record(&[(4, 1), (2, OPEN)]), &[]);
        assert_eq!(s.held(), 6 * G);
        // Its output dropped before this step's first array: the step fits again.
        let before = s.held();
        s.step(
            2,
            &record(&[(4, 1), (2, OPEN)]),
            &[(0, 1, 2 * G), (0, 0, 2 * G)],
        );
        assert_eq!(s.held(), before);
        assert_eq!(s.kept.len(), 1, "only this step's output is kept");
    }

    #[test]
    fn drops_of_arrays_it_never_saw_are_ignored() {
        let mut s = Shadow::default();
        s.step(5, &record(&[(2, OPEN)]), &[(0, 4, 2 * G), (0, 5, 4 * G)]);
        assert_eq!(s.kept.len(), 1);
        assert_eq!(s.held(), 2 * G);
    }

    #[test]
    fn the_arrays_it_keeps_are_bounded() {
        let mut s = Shadow::default();
        for step in 0..(MAX_SHADOW_KEPT as u32 + 1) {
            s.step(step, &record(&[(1, OPEN)]), &[]);
        }
        assert!(s.kept.len() <= MAX_SHADOW_KEPT);
        assert_eq!(s.kept.len(), MAX_SHADOW_KEPT / 2 + 1, "the older half went");
        // The bytes of the arrays it forgot are free again: as many steps more fit them.
        let held = s.held();
        for step in 0..(MAX_SHADOW_KEPT as u32 / 2 - 1) {
            s.step(step, &record(&[(1, OPEN)]), &[]);
        }
        assert_eq!(s.held(), held);
    }

    #[test]
    fn an_array_kept_many_names_ago_is_let_go() {
        let mut s = Shadow::default();
        s.step(0, &record(&[(1, OPEN)]), &[]);
        // Steps of 2500 arrays each, none kept.
        let churn: Vec<(usize, u32)> = (0..2500).map(|k| (1, k + 1)).collect();
        s.step(1, &record(&churn), &[]);
        assert_eq!(s.kept.len(), 1, "2501 names later, still kept");
        s.step(2, &record(&churn), &[]);
        assert!(s.kept.is_empty(), "5001 names later, let go");
        // Its range is free again: no range is out.
        assert_eq!(s.gaps.as_ref().map(Gaps::out), Some(0));
    }

    #[test]
    fn a_block_past_isize_max_stops_it_without_a_panic() {
        let mut s = Shadow::default();
        // Requests of a quarter of the addresses each, refused by any device but kept in the
        // record: the first kept past its step, the second's block would pass `isize::MAX`.
        let huge = Rec {
            bytes: 1 << 62,
            end: OPEN,
            planned: 0,
        };
        assert!(s.step(0, &[huge], &[]));
        assert_eq!(s.held(), 1 << 62);
        assert!(
            !s.step(1, &[huge], &[]),
            "the block would pass isize::MAX bytes"
        );
    }

    #[test]
    fn it_stops_before_its_names_wrap() {
        let mut s = Shadow {
            next: u32::MAX - 1,
            ..Shadow::default()
        };
        assert!(!s.step(0, &record(&[(1, 1), (1, 2)]), &[]));
        assert_eq!(s.held(), 0, "nothing was simulated");
    }
}

//! The rest of a step that left its plan, served inside the plan's block: its free ranges
//! (*gaps*), sub-allocated best fit from either end and coalesced when arrays drop.
//!
//! When a step diverges from its plan (a position larger than planned, more positions than
//! planned, or bytes still taken), the plan's offsets no longer say where its arrays may go. The
//! bytes of the block that no array uses do: at the divergence every position alive is taken out
//! of the block's range, and what is left becomes the gaps ([`Free`]).
//! Each later allocation of the step takes a range from them, and gives it back when its array
//! drops on the owner thread; so does a position that was alive at the divergence. Only what
//! does not fit is allocated from the device. The step is planned again at its end, and the gaps
//! go with the old plan.
//!
//! A range is the smallest gap that holds it, at the gap's bottom, or at its top for an array
//! whose position the plan placed in the block's upper half (the caller says which). The plan
//! was placed from the recorded lifetimes, which the gaps do not know: the largest first, at
//! the bottom, and the arrays that live long around them, mostly above. Best fit from the bottom
//! alone put a long-lived array above the short-lived ones alive when it came, in the block's
//! middle, and split it: a detector's second step (Faster R-CNN's, its arrays a fifth larger
//! than the first step's) found no room for either of its two largest arrays, 1.63x of its peak
//! live bytes; taken from the end the plan chose, the long-lived arrays stay together at the
//! top, and one of the two fits (1.23x).
//!
//! The same structure serves a step that follows its plan from the block's *tail* (its bytes
//! past the plan's footprint, less the pins: see `Plan::tail`), for arrays the plan serves
//! apart; if the step then leaves its plan, the gaps are made with the tail's ranges taken, and
//! take over the tail's record of them ([`Gaps::adopt`]).
//!
//! A range is handed out only from the gaps, and the gaps hold only bytes that no array uses:
//! those free at the divergence, and those of arrays dropped since on the owner thread, not used
//! on another stream (an array dropped on another thread, or used on another stream, keeps its
//! bytes until the block leaves the plan). So a live array's bytes are never handed out twice.

use std::collections::VecDeque;
use std::ops::Range;

/// The free ranges of a plan's block in a diverged step, and the ranges taken from them.
#[derive(Debug)]
pub(super) struct Gaps {
    free: Free,
    /// The ranges handed out, by the index in the step's record of their allocation: the offset
    /// of allocation `first + k` at `k`, [`NOT_OUT`] where there is none (an allocation served
    /// another way, or its range given back). Indices only grow, so this is a window from the
    /// oldest range still out to the newest (a step's gaps last the step; the shadow lets go of
    /// arrays named too long ago): a range is found and given back in O(1). (A sorted
    /// list's binary search took 6% of the host time of GPT-2 trained on varying lengths, served
    /// online: BENCHMARKS.md.)
    taken: VecDeque<usize>,
    /// The index of the allocation at the window's front.
    first: u32,
    /// How many ranges are out.
    out: usize,
}

/// No range out for that allocation.
const NOT_OUT: usize = usize::MAX;

impl Gaps {
    /// The gaps of a block of `bytes` bytes in which the (disjoint or not) ranges `used` are
    /// taken.
    pub(super) fn new(bytes: usize, used: impl IntoIterator<Item = Range<usize>>) -> Gaps {
        let mut used: Vec<Range<usize>> = used.into_iter().filter(|r| r.start < r.end).collect();
        used.sort_unstable_by_key(|r| r.start);
        // The block's bytes between the used ranges, in order.
        let mut ranges = Vec::new();
        let mut top = 0;
        for r in used.iter().chain(std::iter::once(&(bytes..bytes))) {
            let start = r.start.min(bytes);
            if start > top {
                ranges.push((top, start));
            }
            top = top.max(r.end.min(bytes));
        }
        Gaps {
            free: Free {
                ranges,
                end: bytes.max(1),
            },
            taken: VecDeque::new(),
            first: 0,
            out: 0,
        }
    }

    /// The offset of `size` bytes for allocation `rec` of the step, in the smallest gap it fits:
    /// at the gap's bottom, or at its top when `high` (if any gap holds it).
    pub(super) fn take(&mut self, rec: u32, size: usize, high: bool) -> Option<usize> {
        if size == 0 {
            return None;
        }
        let at = self.free.take(size, high)?;
        self.hand_out(rec, at);
        Some(at)
    }

    /// The offset of `size` bytes in the smallest gap that holds them, at its bottom, for an
    /// array whose range goes back by [`Gaps::free`] (not counted as out: see the `room`
    /// module).
    pub(super) fn take_range(&mut self, size: usize) -> Option<usize> {
        if size == 0 {
            return None;
        }
        self.free.take(size, false)
    }

    /// Whether a byte of `range` is free.
    pub(super) fn overlaps_free(&self, range: &Range<usize>) -> bool {
        self.free_ranges()
            .any(|r| r.start < range.end && range.start < r.end)
    }

    /// The free ranges, in the order of their offsets.
    fn free_ranges(&self) -> impl DoubleEndedIterator<Item = Range<usize>> + '_ {
        self.free.ranges.iter().map(|&(start, end)| start..end)
    }

    /// The array of allocation `rec`, of `size` bytes, dropped: its range is free again.
    /// Returns the range's offset, if `rec` had one.
    pub(super) fn give_back(&mut self, rec: u32, size: usize) -> Option<usize> {
        let k = rec.checked_sub(self.first)? as usize;
        let offset = std::mem::replace(self.taken.get_mut(k)?, NOT_OUT);
        if offset == NOT_OUT {
            return None;
        }
        self.out -= 1;
        while self.taken.front() == Some(&NOT_OUT) {
            self.taken.pop_front();
            self.first += 1;
        }
        self.free.give_back(offset, offset + size);
        Some(offset)
    }

    /// Records the range at `offset` as out for allocation `rec` (later than those out before,
    /// as a step's allocations come; an earlier one widens the window at its front).
    fn hand_out(&mut self, rec: u32, offset: usize) {
        if self.taken.is_empty() {
            self.first = rec;
        } else if rec < self.first {
            for _ in rec..self.first {
                self.taken.push_front(NOT_OUT);
            }
            self.first = rec;
        }
        let k = (rec - self.first) as usize;
        if k == self.taken.len() {
            // The next allocation of the step, as most are.
            self.taken.push_back(NOT_OUT);
        } else if k > self.taken.len() {
            self.taken.resize(k + 1, NOT_OUT);
        }
        let slot = &mut self.taken[k];
        // An allocation is handed a range once (were it twice, the first range would stay
        // taken for good: lost to the step, never handed out again).
        debug_assert_eq!(*slot, NOT_OUT, "allocation {rec} handed out twice");
        if *slot == NOT_OUT {
            self.out += 1;
        }
        *slot = offset;
    }

    /// Takes over the ranges `earlier` handed out (the block's tail, while the step followed its
    /// plan: their allocations all came before any of these gaps'), which must be among the
    /// ranges these gaps were made with taken.
    pub(super) fn adopt(&mut self, earlier: Gaps) {
        debug_assert!(self.out == 0);
        (self.taken, self.first, self.out) = (earlier.taken, earlier.first, earlier.out);
    }

    /// The ranges handed out and not given back: the allocation (its index in the step's
    /// record) and the offset of each, in the order they were made.
    pub(super) fn handed_out(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        (self.first..)
            .zip(&self.taken)
            .filter(|&(_, &offset)| offset != NOT_OUT)
            .map(|(rec, &offset)| (rec, offset))
    }

    /// How many ranges are out.
    pub(super) fn out(&self) -> usize {
        self.out
    }

    /// The bytes of a position alive at the divergence, `range`, are free again.
    pub(super) fn free(&mut self, range: Range<usize>) {
        if range.start < range.end {
            self.free.give_back(range.start, range.end);
        }
    }

    /// The block grew to `bytes`: its new bytes are a gap (joined to the top one, if free).
    pub(super) fn grow(&mut self, bytes: usize) {
        self.free.grow(bytes);
    }

    /// The bytes of the block the gaps are of.
    pub(super) fn bytes(&self) -> usize {
        self.free.end
    }

    /// The bytes free at the block's top (the gap that ends where the block does, if any): an
    /// array of `size` bytes that no gap holds needs the block grown by `size` less these.
    pub(super) fn top_free(&self) -> usize {
        self.free_ranges()
            .next_back()
            .filter(|r| r.end == self.bytes())
            .map_or(0, |r| r.len())
    }

    /// The free bytes (tests).
    #[cfg(test)]
    fn available(&self) -> usize {
        self.free_ranges().map(|r| r.len()).sum()
    }
}

/// The free ranges of a block of `end` bytes: disjoint, apart (two that meet are one) and in
/// order of offset, as `(start, end)`. An array takes the smallest that holds it (the lowest of
/// those), at its bottom or its top, in one pass over them; a range given back joins its
/// neighbours, found by a binary search. A step's gaps are a few dozen ranges at most.
///
/// The `range-alloc` crate served here before and chose the same ranges, but generic over the
/// offsets' type, with a sum of every range's bytes at each allocation (for its error) and a
/// linear search for a range given back: the online tier's shadow of BART's beam search took
/// 878 instructions an array with it, 637 now (callgrind; see BENCHMARKS.md).
#[derive(Debug)]
struct Free {
    ranges: Vec<(usize, usize)>,
    end: usize,
}

impl Free {
    /// The offset of `size` bytes taken from the smallest free range that holds them (the
    /// lowest of several), at its bottom, or at its top when `high`.
    fn take(&mut self, size: usize, high: bool) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None;
        for (i, &(start, end)) in self.ranges.iter().enumerate() {
            let len = end - start;
            if len >= size && best.is_none_or(|(_, b)| len < b) {
                best = Some((i, len));
                if len == size {
                    break;
                }
            }
        }
        let (i, len) = best?;
        let range = &mut self.ranges[i];
        let at = if high { range.1 - size } else { range.0 };
        if len == size {
            self.ranges.remove(i);
        } else if high {
            range.1 -= size;
        } else {
            range.0 += size;
        }
        Some(at)
    }

    /// `start..end` is free again, joined to the free ranges it meets. A range that overlaps
    /// one free already (which no caller gives back: a range is given back once) is left out
    /// rather than joined, so that no byte is handed out twice.
    fn give_back(&mut self, start: usize, end: usize) {
        debug_assert!(start < end && end <= self.end);
        let i = self.ranges.partition_point(|r| r.0 < start);
        let left = i.checked_sub(1).map(|l| self.ranges[l]);
        let right = self.ranges.get(i).copied();
        let overlaps =
            left.is_some_and(|l| l.1 > start) || right.is_some_and(|r| r.0 < end) || end > self.end;
        debug_assert!(!overlaps, "{start}..{end} given back twice");
        if overlaps {
            return;
        }
        match (left.filter(|l| l.1 == start), right.filter(|r| r.0 == end)) {
            (Some(_), Some(r)) => {
                self.ranges[i - 1].1 = r.1;
                self.ranges.remove(i);
            }
            (Some(_), None) => self.ranges[i - 1].1 = end,
            (None, Some(_)) => self.ranges[i].0 = start,
            (None, None) => self.ranges.insert(i, (start, end)),
        }
    }

    /// The block grew to `bytes` (if more): its new bytes are free, joined to its top range.
    fn grow(&mut self, bytes: usize) {
        if bytes <= self.end {
            return;
        }
        match self.ranges.last_mut() {
            Some(top) if top.1 == self.end => top.1 = bytes,
            _ => self.ranges.push((self.end, bytes)),
        }
        self.end = bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The free runs of `bytes` (`true`: free), in order, as `(start, end)`.
    fn runs(bytes: &[bool]) -> Vec<(usize, usize)> {
        let mut runs = Vec::new();
        let mut k = 0;
        while k < bytes.len() {
            let start = k;
            while k < bytes.len() && bytes[k] {
                k += 1;
            }
            if k > start {
                runs.push((start, k));
            }
            k += 1;
        }
        runs
    }

    #[test]
    fn free_ranges_serve_best_fit_as_a_byte_by_byte_model_does() {
        // A model of the block byte by byte: best fit is the first of the shortest free runs
        // that hold the array, taken at its bottom or its top; a range given back is free
        // again, whatever it meets.
        let mut rng = fastrand::Rng::with_seed(11);
        for _ in 0..200 {
            let end = rng.usize(1..300);
            let mut model = vec![true; end];
            let mut free = Free {
                ranges: vec![(0, end)],
                end,
            };
            let mut out: Vec<(usize, usize)> = Vec::new();
            for _ in 0..60 {
                if !out.is_empty() && rng.bool() {
                    let (start, stop) = out.swap_remove(rng.usize(..out.len()));
                    model[start..stop].iter_mut().for_each(|b| *b = true);
                    free.give_back(start, stop);
                } else if rng.u8(..8) == 0 {
                    let grown = model.len() + rng.usize(1..40);
                    model.resize(grown, true);
                    free.grow(grown);
                } else {
                    let size = rng.usize(1..80);
                    let high = rng.bool();
                    let fit = runs(&model)
                        .into_iter()
                        .filter(|r| r.1 - r.0 >= size)
                        .min_by_key(|r| r.1 - r.0);
                    let want = fit.map(|r| if high { r.1 - size } else { r.0 });
                    let got = free.take(size, high);
                    assert_eq!(got, want, "{size} bytes, high {high}");
                    if let Some(at) = got {
                        model[at..at + size].iter_mut().for_each(|b| *b = false);
                        out.push((at, at + size));
                    }
                }
                assert_eq!(free.ranges, runs(&model), "apart and in order");
                assert_eq!(free.end, model.len());
            }
        }
    }

    #[test]
    fn the_gaps_are_the_bytes_no_range_uses() {
        let mut g = Gaps::new(1000, [100..200, 150..300, 600..700]);
        assert_eq!(g.available(), 1000 - 200 - 100);
        // Best fit: 300..600 is the smallest gap that holds 250 bytes.
        assert_eq!(g.take(0, 250, false), Some(300));
        assert_eq!(g.take(1, 100, false), Some(0));
        assert_eq!(g.take(2, 400, false), None);
        assert_eq!(g.take(3, 300, false), Some(700));
        assert_eq!(g.available(), 50);
    }

    #[test]
    fn ranges_given_back_coalesce_with_their_neighbours() {
        let mut g = Gaps::new(1000, std::iter::once(0..1000));
        assert_eq!(g.take(0, 10, false), None);
        g.free(0..400);
        g.free(600..1000);
        assert_eq!(g.take(1, 400, false), Some(0));
        assert_eq!(g.take(2, 400, false), Some(600));
        assert!(g.give_back(1, 400).is_some());
        assert!(g.give_back(1, 400).is_none(), "a range is given back once");
        g.free(400..600);
        assert!(g.give_back(2, 400).is_some());
        assert_eq!(
            g.take(3, 1000, false),
            Some(0),
            "the three ranges are one again"
        );
    }

    #[test]
    fn a_high_range_is_at_the_top_of_the_smallest_gap_that_holds_it() {
        // Gaps 0..100, 200..450 and 500..700.
        let mut g = Gaps::new(1000, [100..200, 450..500, 700..1000]);
        assert_eq!(
            g.free_ranges().collect::<Vec<_>>(),
            [0..100, 200..450, 500..700]
        );
        // 150 bytes: 500..700 is the smallest gap that holds them, and they go at its top.
        assert_eq!(g.take(0, 150, true), Some(550));
        assert_eq!(
            g.free_ranges().collect::<Vec<_>>(),
            [0..100, 200..450, 500..550]
        );
        // The bottom of that gap is still free, best fit for 50 bytes from below.
        assert_eq!(g.take(1, 50, false), Some(500));
        assert_eq!(g.take(2, 250, true), Some(200), "a gap of exactly its size");
        assert_eq!(g.take(3, 101, true), None);
        assert_eq!(g.available(), 100);
        assert!(g.give_back(0, 150).is_some());
        assert_eq!(
            g.take(4, 120, true),
            Some(580),
            "given back, at its gap's top again"
        );
    }

    #[test]
    fn ranges_out_are_listed_by_allocation_and_given_back_once_in_any_order() {
        let mut g = Gaps::new(1 << 20, []);
        // Allocations 3, 4, 7 and 9 of a step take ranges, one after the other (the others are
        // served another way).
        for (k, rec) in [3, 4, 7, 9].into_iter().enumerate() {
            assert_eq!(g.take(rec, 256, false), Some(k * 256));
        }
        assert_eq!(g.out(), 4);
        assert!(g.give_back(5, 256).is_none(), "5 took no range");
        assert!(g.give_back(2, 256).is_none(), "2 is before every range out");
        assert!(g.give_back(10, 256).is_none(), "10 is after them");
        // The oldest given back first, then one in the middle.
        assert_eq!(g.give_back(3, 256), Some(0));
        assert_eq!(g.give_back(7, 256), Some(512));
        assert!(g.give_back(7, 256).is_none(), "given back once");
        assert_eq!(g.handed_out().collect::<Vec<_>>(), [(4, 256), (9, 768)]);
        assert_eq!(g.out(), 2);
        // Taken again, after those out (512 bytes fit only above them): listed in the order of
        // their allocations.
        assert_eq!(g.take(12, 512, false), Some(1024));
        assert_eq!(
            g.handed_out().collect::<Vec<_>>(),
            [(4, 256), (9, 768), (12, 1024)]
        );
        // One earlier than every range out (the window widens at its front), in the first
        // range that fits it exactly.
        assert_eq!(g.take(1, 256, false), Some(0));
        assert_eq!(g.handed_out().next(), Some((1, 0)));
        for (rec, bytes, offset) in [(9, 256, 768), (1, 256, 0), (12, 512, 1024), (4, 256, 256)] {
            assert_eq!(g.give_back(rec, bytes), Some(offset), "allocation {rec}");
        }
        assert_eq!(g.out(), 0);
        assert_eq!(g.handed_out().count(), 0);
        assert_eq!(g.available(), 1 << 20, "every range is free again");
    }

    #[test]
    fn a_grown_block_joins_its_new_bytes_to_the_top_gap() {
        let mut g = Gaps::new(1000, [0..600, 800..900]);
        assert_eq!(g.top_free(), 100);
        assert_eq!(g.take(0, 300, false), None);
        // What the top gap lacks for 300 bytes: 200.
        g.grow(1200);
        assert_eq!(g.bytes(), 1200);
        assert_eq!(g.top_free(), 300);
        assert_eq!(
            g.take(1, 300, false),
            Some(900),
            "the top gap, its old bytes and the new"
        );
        assert_eq!(g.top_free(), 0);
        assert_eq!(g.take(2, 200, false), Some(600));
        g.grow(1100);
        assert_eq!(g.bytes(), 1200, "a block does not shrink");
    }
}

//! The rest of a step that left its plan, served inside the plan's block: its free ranges
//! (*gaps*), sub-allocated best fit from either end and coalesced when arrays drop.
//!
//! When a step diverges from its plan (a position larger than planned, more positions than
//! planned, or bytes still taken), the plan's offsets no longer say where its arrays may go. The
//! bytes of the block that no array uses do: at the divergence every position alive is taken out
//! of the block's range, and what is left becomes the gaps ([`range_alloc::RangeAllocator`]).
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

use range_alloc::RangeAllocator;

/// The free ranges of a plan's block in a diverged step, and the ranges taken from them.
#[derive(Debug)]
pub(super) struct Gaps {
    free: RangeAllocator<usize>,
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
        let mut free = RangeAllocator::new(0..bytes.max(1));
        // Everything taken, then each gap between the used ranges given back.
        let all = free.allocate_range(bytes.max(1));
        debug_assert!(all.is_ok());
        let mut top = 0;
        for r in used.iter().chain(std::iter::once(&(bytes..bytes))) {
            let start = r.start.min(bytes);
            if start > top {
                free.free_range(top..start);
            }
            top = top.max(r.end.min(bytes));
        }
        Gaps {
            free,
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
        let at = if high {
            // Best fit takes the whole of a smallest gap that holds `size` (one of exactly that
            // length), and its bottom goes back: the array is at the gap's top.
            let fit = self
                .free_ranges()
                .map(|r| r.len())
                .filter(|&l| l >= size)
                .min()?;
            let gap = self.free.allocate_range(fit).ok()?;
            let top = gap.end - size;
            if top > gap.start {
                self.free.free_range(gap.start..top);
            }
            top
        } else {
            self.take_range(size)?
        };
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
        self.free.allocate_range(size).ok().map(|r| r.start)
    }

    /// Whether a byte of `range` is free.
    pub(super) fn overlaps_free(&self, range: &Range<usize>) -> bool {
        self.free_ranges()
            .any(|r| r.start < range.end && range.start < r.end)
    }

    /// The free ranges, in the order of their offsets (the complement of the allocator's
    /// allocated ranges in the block).
    fn free_ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        let end = self.free.initial_range().end;
        let mut bottom = 0;
        self.free
            .allocated_ranges()
            .chain(std::iter::once(end..end))
            .filter_map(move |used| {
                let gap = bottom..used.start;
                bottom = used.end;
                (gap.start < gap.end).then_some(gap)
            })
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
        self.free.free_range(offset..offset + size);
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
        if k >= self.taken.len() {
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
            self.free.free_range(range);
        }
    }

    /// The block grew to `bytes`: its new bytes are a gap (joined to the top one, if free).
    pub(super) fn grow(&mut self, bytes: usize) {
        if bytes > self.bytes() {
            self.free.grow_to(bytes);
        }
    }

    /// The bytes of the block the gaps are of.
    pub(super) fn bytes(&self) -> usize {
        self.free.initial_range().end
    }

    /// The bytes free at the block's top (the gap that ends where the block does, if any): an
    /// array of `size` bytes that no gap holds needs the block grown by `size` less these.
    pub(super) fn top_free(&self) -> usize {
        self.free_ranges()
            .last()
            .filter(|r| r.end == self.bytes())
            .map_or(0, |r| r.len())
    }

    /// The free bytes (tests).
    #[cfg(test)]
    fn available(&self) -> usize {
        self.free.total_available()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

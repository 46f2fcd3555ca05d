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

use std::ops::Range;

use range_alloc::RangeAllocator;

/// The free ranges of a plan's block in a diverged step, and the ranges taken from them.
#[derive(Debug)]
pub(super) struct Gaps {
    free: RangeAllocator<usize>,
    /// The ranges handed out, by the index in the step's record of their allocation (in the
    /// order they were made: sorted).
    taken: Vec<(u32, usize)>,
}

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
            taken: Vec::new(),
        }
    }

    /// The offset of `size` bytes for allocation `rec` of the step, in the smallest gap it fits:
    /// at the gap's bottom, or at its top when `high` (if any gap holds it).
    pub(super) fn take(&mut self, rec: u32, size: usize, high: bool) -> Option<usize> {
        if size == 0 {
            return None;
        }
        let range = if high {
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
            top..gap.end
        } else {
            self.free.allocate_range(size).ok()?
        };
        debug_assert!(self.taken.last().is_none_or(|&(r, _)| r < rec));
        self.taken.push((rec, range.start));
        Some(range.start)
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
        let i = self.taken.binary_search_by_key(&rec, |&(r, _)| r).ok()?;
        let (_, offset) = self.taken.remove(i);
        self.free.free_range(offset..offset + size);
        Some(offset)
    }

    /// Takes over the ranges `earlier` handed out (the block's tail, while the step followed its
    /// plan: their allocations all came before any of these gaps'), which must be among the
    /// ranges these gaps were made with taken.
    pub(super) fn adopt(&mut self, earlier: Gaps) {
        debug_assert!(self.taken.is_empty());
        self.taken = earlier.taken;
    }

    /// The ranges handed out and not given back: the allocation (its index in the step's
    /// record) and the offset of each, in the order they were made.
    pub(super) fn handed_out(&self) -> &[(u32, usize)] {
        &self.taken
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

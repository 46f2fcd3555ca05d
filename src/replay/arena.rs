//! What one block shared by every step, sub-allocated online, would hold on a log.
//!
//! [`simulate`] serves each allocation of a log, in order, from the free ranges of one block
//! (best fit, from the bottom of the range, coalesced as arrays drop: `range_alloc`, as the
//! planned cache's gaps are), and grows the block at its top when no free range holds an
//! array, by what the top free range lacks, rounded up to a granule (a GPU maps memory in 2 MiB
//! granules). Nothing is planned and nothing is known ahead; the block never shrinks. This is
//! the way of PyTorch's caching allocator with `expandable_segments:True` (one segment per
//! stream, mapped as it grows), with no pool of small blocks apart. The replay report prints it
//! beside the planned steps' simulation ([`super::plan::simulate`]). On the recorded logs, plans
//! hold steps that repeat near their peak live bytes where this fragments (inference on a
//! varying batch or length: 1.25x-1.42x of the peak live bytes for BERT, EfficientNet,
//! ConvNeXt, Faster R-CNN), but on steps that never repeat (a detector's, whose feature maps
//! follow each image's size and whose heads keep a varying count of boxes) and on decoding with
//! its caches growing across steps it held less than the planned cache (BENCHMARKS.md, "One
//! block sub-allocated online").

use std::collections::HashMap;

use range_alloc::RangeAllocator;

use super::Op;

/// A GPU's granule of mapped memory (the H100's and H200's driver maps device memory in
/// 2 MiB): growable blocks on the GPU are whole multiples of it.
pub const GPU_GRANULE: usize = 2 << 20;

/// The block's peak bytes on `ops`: every allocation of the log (at its size aligned as
/// gpucache aligns it) served from one block that grows in `granule`s (see the module docs).
///
/// ```
/// use gpucache_suite::replay::{Op, arena};
/// let alloc = |buffer, bytes| Op::Alloc {
///     cache: "s".into(),
///     buffer,
///     bytes,
///     elem: 1,
///     dims: vec![bytes],
/// };
/// let free = |buffer| Op::Free { buffer };
/// // 1 KiB and 2 KiB alive, the 1 KiB dropped: a 1 KiB array takes its range, a 2 KiB one
/// // grows the block by 2 KiB (its top free range is empty).
/// let ops = [alloc(1, 1024), alloc(2, 2048), free(1), alloc(3, 1024), alloc(4, 2048)];
/// assert_eq!(arena::simulate(&ops, 1024), 5 * 1024);
/// ```
pub fn simulate(ops: &[Op], granule: usize) -> usize {
    let granule = granule.max(1);
    let mut block = RangeAllocator::new(0..0usize);
    let mut live: HashMap<u64, std::ops::Range<usize>> = HashMap::new();
    for op in ops {
        match op {
            Op::Alloc { buffer, bytes, .. } => {
                let size = gpucache::planner::aligned(*bytes).unwrap_or(*bytes);
                if size == 0 {
                    continue;
                }
                let range = block.allocate_range(size).unwrap_or_else(|_| {
                    // The top free range (past the last range in use) grows to hold the array.
                    let end = block.initial_range().end;
                    let used_end = block.allocated_ranges().last().map_or(0, |r| r.end);
                    let grown = (used_end + size).div_ceil(granule) * granule;
                    block.grow_to(grown.max(end));
                    block
                        .allocate_range(size)
                        .expect("the grown top range holds the array")
                });
                if let Some(old) = live.insert(*buffer, range) {
                    block.free_range(old);
                }
            }
            Op::Free { buffer } => {
                if let Some(range) = live.remove(buffer) {
                    block.free_range(range);
                }
            }
            Op::Enter(_) | Op::Exit(_) | Op::Invalidate(_) => {}
        }
    }
    block.initial_range().end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(buffer: u64, bytes: usize) -> Op {
        Op::Alloc {
            cache: "s".into(),
            buffer,
            bytes,
            elem: 1,
            dims: vec![bytes],
        }
    }

    #[test]
    fn a_free_range_is_taken_best_fit_before_the_block_grows() {
        // Ranges of 3 KiB and 1 KiB free, between arrays alive: a 1 KiB array takes the 1 KiB
        // range, then a 3 KiB one the 3 KiB range, and the block stays 7 KiB.
        let ops = [
            alloc(1, 3 << 10),
            alloc(2, 1 << 10),
            alloc(3, 1 << 10),
            alloc(4, 2 << 10),
            Op::Free { buffer: 1 },
            Op::Free { buffer: 3 },
            alloc(5, 1 << 10),
            alloc(6, 3 << 10),
        ];
        assert_eq!(simulate(&ops, 1 << 10), 7 << 10);
        // Freed in the other order, the same.
        let mut swapped = ops.clone();
        swapped.swap(4, 5);
        assert_eq!(simulate(&swapped, 1 << 10), 7 << 10);
    }

    #[test]
    fn the_block_grows_by_what_its_top_range_lacks_in_granules() {
        // 1 KiB in use at the bottom, 3 KiB free above it (granules of 4 KiB): a 5 KiB array
        // grows the block to 1 + 5 KiB, rounded up to 8 KiB, not by 5 KiB.
        let ops = [
            alloc(1, 1 << 10),
            alloc(2, 3 << 10),
            Op::Free { buffer: 2 },
            alloc(3, 5 << 10),
        ];
        assert_eq!(simulate(&ops, 4 << 10), 8 << 10);
        // With a range in use at the top, the array goes above it.
        let ops = [alloc(1, 1 << 10), alloc(2, 3 << 10), alloc(3, 5 << 10)];
        assert_eq!(simulate(&ops, 1 << 10), 9 << 10);
    }

    #[test]
    fn the_peak_is_never_below_the_peak_live_bytes() {
        let mut rng = fastrand::Rng::with_seed(5);
        for case in 0..200 {
            let mut ops = Vec::new();
            let mut alive: Vec<u64> = Vec::new();
            for b in 0..60u64 {
                if !alive.is_empty() && rng.bool() {
                    let k = rng.usize(..alive.len());
                    ops.push(Op::Free {
                        buffer: alive.swap_remove(k),
                    });
                }
                ops.push(alloc(b, 256 * rng.usize(1..64)));
                alive.push(b);
            }
            let peak = simulate(&ops, 256);
            let live = super::super::peak_live(&ops);
            assert!(peak >= live, "case {case}: {peak} < {live}");
            // In granules of 64 KiB, the block is whole granules.
            let coarse = simulate(&ops, 64 << 10);
            assert_eq!(coarse % (64 << 10), 0, "case {case}");
            assert!(coarse >= live, "case {case}: {coarse} < {live}");
        }
    }
}

//! Planning a step's memory from its recorded lifetimes: the layout a planned cache
//! ([`KeyPolicy::Planned`](crate::KeyPolicy::Planned)) gives a step that repeats.
//!
//! A step that repeats allocates the same arrays in the same order with the same lifetimes. Its
//! arrays can then share one block: each gets an offset, chosen once from the recorded
//! lifetimes, such that two arrays alive at the same time never overlap. [`greedy_by_size`]
//! chooses them as TensorFlow Lite's arena planner does: the largest array first, each in a gap
//! left between the arrays already placed whose lifetimes overlap its own, else above them; it
//! tries the lowest-waste gap (best fit) and the lowest one (first fit), and keeps the smaller
//! plan. The block's size (the plan's *footprint*) is at least the step's peak
//! live bytes ([`peak_live`]), and on real steps close to it.
//!
//! The module is public so that tools can plan logs the way the cache does (the replay example
//! prints what plans would hold on a PyTorch model's log).
//!
//! ```
//! use gpucache::planner::{Lifetime, greedy_by_size, peak_live};
//! // a and c are never alive together: c takes a's place, b goes above them.
//! let lives = [
//!     Lifetime { bytes: 256, start: 0, end: 2 },
//!     Lifetime { bytes: 512, start: 1, end: 3 },
//!     Lifetime { bytes: 256, start: 2, end: 4 },
//! ];
//! let plan = greedy_by_size(&lives);
//! assert_eq!(plan.offsets, [512, 0, 512]);
//! assert_eq!(plan.footprint, 768);
//! assert_eq!(peak_live(&lives), 768);
//! ```

/// Offsets and sizes in a plan are multiples of this (as `cudaMalloc` aligns).
pub const ALIGN: usize = 256;

/// `bytes` rounded up to [`ALIGN`] (a zero-byte array takes no room); `None` past the largest
/// `usize`.
pub fn aligned(bytes: usize) -> Option<usize> {
    bytes.checked_next_multiple_of(ALIGN)
}

/// One array of a step: its size, and when it was alive, as `[start, end)` in the step's
/// allocation ticks (it is allocated at `start` and dropped before the allocation at `end`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    /// Its size in bytes (align it to [`ALIGN`] to place arrays at aligned offsets).
    pub bytes: usize,
    /// The tick of its allocation.
    pub start: u32,
    /// The tick of the first allocation after it dropped (exclusive).
    pub end: u32,
}

impl Lifetime {
    /// Whether `self` and `other` are alive at the same time.
    pub fn overlaps(&self, other: &Lifetime) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// Where each array of a step goes in one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The offset of each array, in the order of the lifetimes planned.
    pub offsets: Vec<usize>,
    /// The block's size: the end of the highest array.
    pub footprint: usize,
}

/// The most bytes alive at once among `lives`: the least any plan can take.
pub fn peak_live(lives: &[Lifetime]) -> usize {
    let mut events: Vec<(u32, isize)> = Vec::with_capacity(2 * lives.len());
    for l in lives {
        events.push((l.start, l.bytes as isize));
        events.push((l.end, -(l.bytes as isize)));
    }
    // At one tick, drops come before allocations (`end` is exclusive).
    events.sort_by_key(|&(t, d)| (t, d));
    let (mut live, mut peak) = (0isize, 0isize);
    for (_, d) in events {
        live += d;
        peak = peak.max(live);
    }
    peak as usize
}

/// Offsets for `lives` in one block, greedy by size (see the module docs): placed with best fit
/// and with first fit, the plan with the smaller footprint.
/// Sizes are taken as they are (align them first to place arrays at aligned offsets).
pub fn greedy_by_size(lives: &[Lifetime]) -> Plan {
    let mut by_size: Vec<usize> = (0..lives.len()).collect();
    // Largest first; ties by start, then position, so that the plan is deterministic.
    by_size.sort_by_key(|&i| (std::cmp::Reverse(lives[i].bytes), lives[i].start, i));
    let best = place(lives, &by_size, true);
    let first = place(lives, &by_size, false);
    // Neither fit is always the smaller (on a BERT encoder's steps first fit saves 15%).
    if first.footprint < best.footprint {
        first
    } else {
        best
    }
}

/// Places `lives` in `order`, each at the smallest gap that holds it (`best_fit`) or the lowest
/// (first fit) among the arrays placed whose lifetimes overlap its own, else above them.
fn place(lives: &[Lifetime], order: &[usize], best_fit: bool) -> Plan {
    let mut offsets = vec![0usize; lives.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(lives.len());
    let mut footprint = 0;
    let mut taken: Vec<(usize, usize)> = Vec::new();
    for &i in order {
        let me = lives[i];
        taken.clear();
        taken.extend(
            placed
                .iter()
                .filter(|&&j| lives[j].overlaps(&me) && lives[j].bytes > 0)
                .map(|&j| (offsets[j], offsets[j] + lives[j].bytes)),
        );
        taken.sort_unstable();
        // The gap that holds it (the first of equal ones), else above everything.
        let (mut best, mut best_gap, mut top) = (None, usize::MAX, 0usize);
        for &(lo, hi) in &taken {
            if lo >= top && lo - top >= me.bytes && lo - top < best_gap {
                best = Some(top);
                best_gap = lo - top;
                if !best_fit {
                    break;
                }
            }
            top = top.max(hi);
        }
        let at = best.unwrap_or(top);
        offsets[i] = at;
        footprint = footprint.max(at + me.bytes);
        placed.push(i);
    }
    Plan { offsets, footprint }
}

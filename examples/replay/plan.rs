//! Planning a step's memory from its recorded lifetimes, and what that would hold on a log.
//!
//! A step that repeats allocates the same arrays in the same order with the same lifetimes. Its
//! arrays can then share one block: each gets an offset, chosen once from the recorded
//! lifetimes, such that two arrays alive at the same time never overlap. [`greedy_by_size`]
//! chooses them as TensorFlow Lite's arena planner does: the largest array first, each at the
//! lowest-waste gap left between the arrays already placed whose lifetimes overlap its own (best
//! fit), else above them. The block's size (the plan's *footprint*) is at least the step's peak
//! live bytes, and on real steps close to it.
//!
//! [`simulate`] measures what such plans would hold on a whole log: every step planned from its
//! own lifetimes, the plan remade with each position's largest size as the log goes on (so one
//! block serves a step whose sizes vary), and the arrays that outlive their step served apart
//! at their own size. It is the bound the runtime's planned tier aims at, computed here from
//! the log alone (no allocator runs): the replay report prints it beside the measured policies.

use std::collections::HashMap;

use super::Op;

/// Offsets and sizes in a plan are multiples of this (as `cudaMalloc` aligns).
pub const ALIGN: usize = 256;

/// `bytes` rounded up to [`ALIGN`] (a zero-byte array takes no room).
pub fn aligned(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// One array of a step: its size, and when it was alive, as `[start, end)` in the step's
/// allocation ticks (it is allocated at `start` and dropped before the allocation at `end`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub bytes: usize,
    pub start: u32,
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

/// Offsets for `lives` in one block, greedy by size with best fit (see the module docs).
/// Sizes are taken as they are (align them first to place arrays at aligned offsets).
pub fn greedy_by_size(lives: &[Lifetime]) -> Plan {
    let mut order: Vec<usize> = (0..lives.len()).collect();
    // Largest first; ties by start, then position, so that the plan is deterministic.
    order.sort_by_key(|&i| (std::cmp::Reverse(lives[i].bytes), lives[i].start, i));
    let mut offsets = vec![0usize; lives.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(lives.len());
    let mut footprint = 0;
    let mut taken: Vec<(usize, usize)> = Vec::new();
    for i in order {
        let me = lives[i];
        taken.clear();
        taken.extend(
            placed
                .iter()
                .filter(|&&j| lives[j].overlaps(&me) && lives[j].bytes > 0)
                .map(|&j| (offsets[j], offsets[j] + lives[j].bytes)),
        );
        taken.sort_unstable();
        // The smallest gap that holds it (the first of equal ones), else above everything.
        let (mut best, mut best_gap, mut top) = (None, usize::MAX, 0usize);
        for &(lo, hi) in &taken {
            if lo >= top && lo - top >= me.bytes && lo - top < best_gap {
                best = Some(top);
                best_gap = lo - top;
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

/// What [`simulate`] found on a log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Simulated {
    /// The most bytes held at once: the plan's block (the largest it had to be so far) plus the
    /// arrays served apart that are alive.
    pub peak: usize,
    /// The largest footprint of any step's own plan (aligned sizes).
    pub largest_step_plan: usize,
    /// Steps whose plan had to be remade (a position grew, or the step allocated a different
    /// number of arrays); the first step is not counted.
    pub replans: usize,
}

/// One step as [`simulate`] sees it: the arrays dropped inside it (planned), in allocation
/// order, and the bytes of those that outlived it.
struct Step {
    planned: Vec<Lifetime>,
    /// (buffer, aligned bytes) of the arrays alive at the step's exit.
    escaped: Vec<(u64, usize)>,
}

/// Frees of arrays made in earlier steps: those before a step's entry, and those during it.
#[derive(Default)]
struct Freed {
    before: Vec<u64>,
    during: Vec<u64>,
}

/// Splits `ops` into steps (outermost scopes) with their lifetimes.
fn steps(ops: &[Op]) -> Vec<(Step, Freed)> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut tick = 0u32;
    let mut open: HashMap<u64, usize> = HashMap::new();
    let mut lives: Vec<(u64, Lifetime, bool)> = Vec::new();
    let mut freed = Freed::default();
    for op in ops {
        match op {
            Op::Enter(_) => {
                if depth == 0 {
                    tick = 0;
                    open.clear();
                    lives.clear();
                }
                depth += 1;
            }
            Op::Exit(_) => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    let planned = lives
                        .iter()
                        .filter(|(_, _, done)| *done)
                        .map(|&(_, l, _)| l)
                        .collect();
                    let escaped = lives
                        .iter()
                        .filter(|(_, _, done)| !*done)
                        .map(|&(b, l, _)| (b, l.bytes))
                        .collect();
                    out.push((Step { planned, escaped }, std::mem::take(&mut freed)));
                }
            }
            Op::Alloc { buffer, bytes, .. } if depth > 0 => {
                open.insert(*buffer, lives.len());
                lives.push((
                    *buffer,
                    Lifetime {
                        bytes: aligned(*bytes),
                        start: tick,
                        end: u32::MAX,
                    },
                    false,
                ));
                tick += 1;
            }
            Op::Free { buffer } if depth > 0 => match open.remove(buffer) {
                Some(i) => {
                    lives[i].1.end = tick;
                    lives[i].2 = true;
                }
                None => freed.during.push(*buffer),
            },
            Op::Free { buffer } => freed.before.push(*buffer),
            _ => {}
        }
    }
    out
}

/// What plans would hold on `ops` (see the module docs). Positions are numbered among the arrays
/// that die within their step (known here from the whole log; a runtime numbers every
/// allocation). Arrays that outlive their step are
/// counted at their aligned size from their step's exit until the step that frees them (also
/// during the step that allocates them, through the plan: a conservative overlap).
pub fn simulate(ops: &[Op]) -> Simulated {
    let mut sim = Simulated::default();
    // The plan's sizes per position (each position's largest so far), and its block.
    let mut sizes: Vec<usize> = Vec::new();
    let mut block = 0usize;
    // Arrays served apart, alive: buffer -> bytes.
    let mut apart: HashMap<u64, usize> = HashMap::new();
    for (n, (step, freed)) in steps(ops).into_iter().enumerate() {
        for b in &freed.before {
            apart.remove(b);
        }
        let own = greedy_by_size(&step.planned).footprint;
        sim.largest_step_plan = sim.largest_step_plan.max(own);
        let fits = step.planned.len() == sizes.len()
            && step.planned.iter().zip(&sizes).all(|(l, &s)| l.bytes <= s);
        if !fits {
            if n > 0 {
                sim.replans += 1;
            }
            if step.planned.len() == sizes.len() {
                for (s, l) in sizes.iter_mut().zip(&step.planned) {
                    *s = (*s).max(l.bytes);
                }
            } else {
                sizes = step.planned.iter().map(|l| l.bytes).collect();
            }
            let merged: Vec<Lifetime> = step
                .planned
                .iter()
                .zip(&sizes)
                .map(|(l, &bytes)| Lifetime { bytes, ..*l })
                .collect();
            block = block.max(greedy_by_size(&merged).footprint);
        }
        // During the step: the block, the arrays apart from earlier steps (those it frees are
        // still counted: conservative), and the ones it allocates to outlive it.
        let apart_now: usize = apart.values().sum();
        let escaping: usize = step.escaped.iter().map(|&(_, b)| b).sum();
        sim.peak = sim.peak.max(block + apart_now + escaping);
        for b in &freed.during {
            apart.remove(b);
        }
        apart.extend(step.escaped);
    }
    sim
}

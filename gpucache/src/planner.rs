//! Planning a step's memory from its recorded lifetimes: the layout a planned cache
//! ([`KeyPolicy::Planned`](crate::KeyPolicy::Planned)) gives a step that repeats.
//!
//! A step that repeats allocates the same arrays in the same order with the same lifetimes. Its
//! arrays can then share one block: each gets an offset, chosen once from the recorded
//! lifetimes, such that two arrays alive at the same time never overlap. [`greedy_by_size`]
//! chooses them as TensorFlow Lite's arena planner does: the largest array first, each in a gap
//! left between the arrays already placed whose lifetimes overlap its own, else above them; it
//! tries the lowest-waste gap (best fit) and the lowest one (first fit), and keeps the smaller
//! plan, and while the best is more than a 32nd above the peak live bytes, places the arrays by
//! weight too (size times the square root of lifetime, best fit: long-lived arrays at the
//! bottom), then in the order they were allocated (best fit), and keeps the smallest. The
//! block's size (the plan's *footprint*) is at least the step's peak live bytes
//! ([`peak_live`]), and on real steps close to it.
//!
//! The arrays each one meets in time are listed once, by a sweep over their starts, so that
//! placing an array looks only at those (a step's arrays mostly live briefly): a plan costs
//! about `n log n` plus the number of pairs that overlap, not `n²` (a step of a few hundred
//! arrays, planned again at every step whose order shifts, spent most of its host time here).
//! Past 8 Mi pairs it looks at every placed array instead, to bound the memory. An array that
//! meets many of those placed (a training step's activations meet most of the step) takes them
//! in order of offset from a list of the placed arrays instead of sorting its own: on a
//! BERT training step of a thousand arrays, planned at every step whose sequence length is new,
//! sorting took most of the plan's time. Each range is looked at as it is found, with the
//! ranges of the pins merged in order, rather than gathered first (a quarter fewer instructions
//! for a plan of a GPT-2 training step). A best-fit plan within a 32nd of the step's peak live
//! bytes is kept without trying first fit, which could save at most that. A planned cache tries
//! first the way that gave its last plan within that 32nd (a model's steps are planned alike:
//! Keypoint R-CNN's by first fit at every step, after a best fit that was not kept), and the
//! others only while none came within it. When none came within for a few plans running and
//! one way gave them all (a detector's steps, 3-9% above their peak by weight every time), it
//! places the next plans alone while they fit the cache's block, and every way again every
//! eighth plan (RetinaNet v2's plans took 0.62x of the instructions over a long run, the same
//! plans). It also keeps its last eight plans with what they were placed for, and gives one
//! again, placing nothing, for the same lifetimes around the same ranges (micro-batches that
//! take turns, each planned again around the arrays the other keeps, plan from the same inputs
//! at every turn). `invalidate` and `empty_cache` forget that choice and those plans with the
//! cache's plans (a cold start).
//!
//! A step's smallest arrays, whose bytes together are at most a 1024th of the peak live bytes,
//! are not placed among the rest but *stacked* on top of them, each at bytes of its own (at
//! least 64 of them; a training step has hundreds: biases, norms' statistics and their
//! gradients, scalars; a detector's inference step boxes, scores and indices). The rest is placed
//! without them (a dense step's in about the square of its number: 0.39x-0.88x of the time on
//! the training steps recorded; stacked, a detector's steps took 0.54x-0.87x of their host time
//! on the CPU), and the plan holds at most a 1024th more.
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

use std::cell::Cell;
use std::ops::Range;

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
    // A step's ticks are its allocations: their net changes, tick by tick, need no sort (a
    // sort of the events was most of a plan's time on an inference step of 170 arrays).
    let last = lives.iter().map(|l| l.start.max(l.end)).max().unwrap_or(0) as usize;
    if last <= 4 * lives.len() + 64 {
        let mut net = vec![0isize; last + 1];
        for l in lives {
            net[l.start as usize] += l.bytes as isize;
            net[l.end as usize] -= l.bytes as isize;
        }
        // At one tick, drops come before allocations: the most alive is at a tick's end.
        let (mut live, mut peak) = (0isize, 0isize);
        for d in net {
            live += d;
            peak = peak.max(live);
        }
        return peak as usize;
    }
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

/// Another plan (first fit, by weight, in order) is tried only while the best so far is more than
/// this fraction above the peak live bytes (the most it could save): placing a dense step twice
/// doubled the time of the plans made at every step of training whose batch or length varies
/// (BERT with dynamic padding, MobileNetV3: 25% and 21% of the instructions of their whole
/// replays); the real models' logs held the same without it but BERT with dynamic padding
/// (1.063x, was 1.066x).
const FIRST_FIT_WITHIN: usize = 32;

/// Offsets for `lives` in one block, greedy by size (see the module docs): placed with best fit
/// and, unless that is within a 32nd of the peak live bytes (the most first fit could save),
/// with first fit, then by weight (size times the square root of lifetime) with best fit, then
/// in the order of their starts with best fit, each only while the best plan so far is more
/// than a 32nd above the peak: the plan with the smallest footprint.
/// Sizes are taken as they are (align them first to place arrays at aligned offsets).
pub fn greedy_by_size(lives: &[Lifetime]) -> Plan {
    greedy_by_size_around(lives, &[])
}

/// [`greedy_by_size`] in a block whose byte ranges `taken` are in use throughout the step (arrays
/// of an earlier step still alive there): no array is placed over them, and the least footprint
/// that other orders are measured against counts the ranges taken below it. The footprint is the
/// end of the highest array placed, whatever the ranges taken (the block must hold it). A step's
/// smallest arrays are stacked on top of the rest (see the module docs), above any range taken
/// there.
///
/// ```
/// use gpucache::planner::{Lifetime, greedy_by_size_around};
/// let lives = [
///     Lifetime { bytes: 256, start: 0, end: 2 },
///     Lifetime { bytes: 512, start: 1, end: 3 },
/// ];
/// // b (the largest) does not fit below the bytes taken, and goes above them; a fits below.
/// let plan = greedy_by_size_around(&lives, &[256..512]);
/// assert_eq!(plan.offsets, [0, 512]);
/// assert_eq!(plan.footprint, 1024);
/// ```
pub fn greedy_by_size_around(lives: &[Lifetime], taken: &[Range<usize>]) -> Plan {
    greedy_by_size_from(lives, taken, &Cell::new(Hint::default()), 0)
}

/// [`greedy_by_size_around`] for a planned cache, which passes what its planner learned from
/// its last plans (`hint`, updated here) and `room`: the bytes of the block the cache holds, in
/// which a plan costs no more memory.
///
/// The try that came within a 32nd of the peak live bytes last time is made first, before the
/// others in their usual order (unchanged when none came within: then every try was made,
/// whatever the order). A model's steps are planned alike from step to step: Keypoint R-CNN's by
/// first fit, FCOS's by weight, each after a best fit that was not kept, at every step that left
/// its plan (the planner was half of Keypoint R-CNN's host time on the CPU). The plan is one
/// within a 32nd of the peak if any try is, not always the same one.
///
/// And when one try gave the smallest plan [`WON_IN_A_ROW`] times running with none within (a
/// detector's steps: FCOS's, RetinaNet's and Faster R-CNN's by weight, 3-9% above their peak),
/// it is made alone, as long as its plan fits `room`; and whatever the room once it gave the
/// smallest plan [`BY_FAR_IN_A_ROW`] times running, each smaller than every other try's by more
/// than a [`BY_FAR`]th. Every try is made again for a plan that does not fit the room after
/// wins by less (it sets how much the cache holds) and after [`ALONE_AT_MOST`] plans made alone.
/// A plan that comes within, given by the try that keeps winning, leaves its count of wins as
/// it was. (A detector's steps each leave their plan, whose block goes once it is unused: their
/// plans had no room, and every try was made for almost every plan of FCOS, whose other tries'
/// plans were 7-13% larger than by weight; one CPU replay of FCOS ten passes longer made 38
/// tries for 26 plans where it made 68, with the same peak.)
pub(crate) fn greedy_by_size_from(
    lives: &[Lifetime],
    taken: &[Range<usize>],
    hint: &Cell<Hint>,
    room: usize,
) -> Plan {
    let live = peak_live(lives);
    let within = least_footprint(live, taken) + live / FIRST_FIT_WITHIN;
    let small = stacked(lives, live);
    let bytes: usize = small.iter().map(|&i| lives[i].bytes).sum();
    if small.len() < MIN_STACKED || bytes == 0 {
        return plan_around(lives, &Overlaps::of(lives), taken, (within, room), hint);
    }
    // The rest of a dense step is dense too: it scans (the same plan as listed); a sparse
    // step's rest is listed alone (the whole step's pairs are never needed). Its first try is
    // kept when the whole plan, the stack on top, would be.
    let dense = Overlaps::scans(lives);
    with_stack(lives, &small, taken, |rest| {
        plan_around(
            rest,
            &if dense {
                Overlaps::Scan
            } else {
                Overlaps::of(rest)
            },
            taken,
            (within.saturating_sub(bytes), room.saturating_sub(bytes)),
            hint,
        )
    })
}

/// `lives` placed again after a few of them changed size, the others `kept` at their offsets
/// (`Some`: from a plan in which each had the same lifetime and size, so that no two of them
/// whose lifetimes meet share bytes, and none meets a range `taken`); the rest largest first,
/// best fit, among them and the ranges `taken`. With the bound at which
/// [`greedy_by_size_from`] stops trying (a [`FIRST_FIT_WITHIN`]th above the least footprint),
/// which [`within_slack`] measures the plan against.
fn kept_plan(lives: &[Lifetime], kept: &[Option<usize>], taken: &[Range<usize>]) -> (Plan, usize) {
    debug_assert_eq!(lives.len(), kept.len());
    let live = peak_live(lives);
    let within = least_footprint(live, taken) + live / FIRST_FIT_WITHIN;
    let (mut order, preset): (Vec<usize>, Vec<usize>) = kept
        .iter()
        .enumerate()
        .filter_map(|(i, at)| at.map(|at| (i, at)))
        .unzip();
    let moved: Vec<usize> = (0..lives.len()).filter(|&i| kept[i].is_none()).collect();
    let moved_lives: Vec<Lifetime> = moved.iter().map(|&i| lives[i]).collect();
    order.extend(size_order(&moved_lives).into_iter().map(|i| moved[i]));
    // Each array moved looks at those placed in order of offset (a scan of all: they are few).
    let plan = place_after(lives, &order, &Overlaps::Scan, true, taken, &preset);
    (plan, within)
}

/// The plan of `made` ([`kept_plan`]) when its footprint is at most `slack` bytes above its
/// bound; else `None`: placing every array again may do better.
fn within_slack((plan, within): (Plan, usize), slack: usize) -> Option<Plan> {
    (plan.footprint <= within.saturating_add(slack)).then_some(plan)
}

/// `lives` planned with the arrays `small` (indices, in order; see [`stacked`]) stacked on top
/// of the rest, which `place` plans: the stack goes above the rest's footprint and any range
/// `taken` that it would meet there (in order of their starts, one pass finds the lowest
/// place: the stack only moves up past a range).
fn with_stack(
    lives: &[Lifetime],
    small: &[usize],
    taken: &[Range<usize>],
    place: impl FnOnce(&[Lifetime]) -> Plan,
) -> Plan {
    let mut is_small = vec![false; lives.len()];
    small.iter().for_each(|&i| is_small[i] = true);
    let (index, rest): (Vec<usize>, Vec<Lifetime>) = lives
        .iter()
        .enumerate()
        .filter(|&(i, _)| !is_small[i])
        .map(|(i, l)| (i, *l))
        .unzip();
    let placed = place(&rest);
    let mut offsets = vec![0; lives.len()];
    for (&i, &at) in index.iter().zip(&placed.offsets) {
        offsets[i] = at;
    }
    let bytes: usize = small.iter().map(|&i| lives[i].bytes).sum();
    let mut at = placed.footprint;
    let mut taken: Vec<&Range<usize>> = taken.iter().collect();
    taken.sort_unstable_by_key(|r| r.start);
    for r in taken {
        if r.start < at + bytes && at < r.end {
            at = r.end;
        }
    }
    let footprint = at + bytes;
    for &i in small {
        offsets[i] = at;
        at += lives[i].bytes;
    }
    Plan { offsets, footprint }
}

/// `ranges` sorted, those that meet or touch merged, the empty left out: the same bytes taken,
/// in fewer ranges for the planner to look at (an optimizer's state and gradients pinned in a
/// block, 444 arrays, are some 20 ranges).
pub(crate) fn merged(ranges: impl IntoIterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut ranges: Vec<Range<usize>> = ranges.into_iter().filter(|r| r.start < r.end).collect();
    ranges.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// The least footprint of a plan of `live` peak live bytes in a block whose ranges `taken` are
/// in use throughout the step: the arrays alive at the peak fit only in the bytes below the
/// footprint that no range takes. (Measured from the peak live bytes alone, a plan placed
/// around the ranges taken never came within a 32nd of it, and every order was tried: Mask
/// R-CNN's steps, once planned around the masks of the step before, spent 3.5 times as long in
/// the planner as when they were not.)
fn least_footprint(live: usize, taken: &[Range<usize>]) -> usize {
    let mut taken: Vec<&Range<usize>> = taken.iter().filter(|r| r.start < r.end).collect();
    taken.sort_unstable_by_key(|r| r.start);
    let (mut end, mut counted) = (live, 0);
    for r in taken {
        if r.start >= end {
            break;
        }
        // Ranges may overlap: only the bytes past those counted already.
        let from = r.start.max(counted);
        if r.end > from {
            end += r.end - from;
            counted = r.end;
        }
    }
    end
}

/// A step's smallest arrays, whose bytes together are at most this fraction of its peak live
/// bytes, are stacked rather than placed (see [`stacked`]).
const STACKED_SHARE: usize = 1024;

/// Fewer small arrays than this are placed with the rest.
const MIN_STACKED: usize = 64;

/// The indices of the smallest arrays of `lives`, in order, whose bytes together are at most a
/// [`STACKED_SHARE`]th of `live` (the peak live bytes); none when they would be fewer than
/// [`MIN_STACKED`]. They are *stacked*: each at bytes of its own, in one range on top of the other
/// arrays, which are placed without them. A dense step's plan costs about the square of its arrays
/// (each meets about half the others in time), and a third to a half of a training step's arrays
/// are a few kilobytes (biases, norms' statistics and their gradients, scalars: a thousandth of its
/// bytes or less). Stacked, they cost at most a [`STACKED_SHARE`]th of the peak live bytes, and the
/// plans of the training steps recorded take 0.39x-0.88x of the time. A sparse step's plan costs a
/// sort of each array's few overlaps, and a detector's inference step has hundreds of small arrays
/// too (boxes, scores, indices, anchors' pieces): stacked, Keypoint R-CNN's steps took 0.54x of the
/// host time on the CPU, Faster R-CNN v2's 0.76x, with their peaks within 0.4%.
fn stacked(lives: &[Lifetime], live: usize) -> Vec<usize> {
    let budget = live / STACKED_SHARE;
    // Fewer than [`MIN_STACKED`] arrays within the budget each: fewer would be stacked, and none
    // are, told without sorting the step (a decoder's step of 263 arrays, none stacked, spent a
    // tenth of its plan's instructions sorting them).
    if lives
        .iter()
        .filter(|l| l.bytes <= budget)
        .nth(MIN_STACKED - 1)
        .is_none()
    {
        return Vec::new();
    }
    let mut order: Vec<usize> = (0..lives.len()).collect();
    order.sort_unstable_by_key(|&i| (lives[i].bytes, i));
    let mut sum = 0usize;
    let n = order
        .iter()
        .take_while(|&&i| {
            sum = sum.saturating_add(lives[i].bytes);
            sum <= budget
        })
        .count();
    order.truncate(n);
    order.sort_unstable();
    order
}

/// One way [`greedy_by_size`] places a step's arrays, in the order they are tried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Try {
    /// Largest first, best fit.
    #[default]
    BestFit,
    /// Largest first, first fit.
    FirstFit,
    /// By weight (size times the square root of lifetime), best fit.
    ByWeight,
    /// In the order they were allocated, best fit.
    InOrder,
}

impl Try {
    /// Every try, in the order they are made.
    const ALL: [Try; 4] = [Try::BestFit, Try::FirstFit, Try::ByWeight, Try::InOrder];
}

/// Plans in a row that one try must win, none coming within a 32nd of the peak, before it is
/// made alone (see [`greedy_by_size_from`]).
const WON_IN_A_ROW: u8 = 3;

/// The most plans made by one try alone before every try is made again.
const ALONE_AT_MOST: u8 = 8;

/// Plans in a row that one try must win by far, none coming within, before it is made alone
/// whatever the room (see [`greedy_by_size_from`]).
const BY_FAR_IN_A_ROW: u8 = 2;

/// A try wins by far when every other try's plan is more than this fraction larger than its
/// own (see [`greedy_by_size_from`]).
const BY_FAR: usize = 16;

/// What a planned cache's planner carries from one plan to the next (see
/// [`greedy_by_size_from`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Hint {
    /// The try made first: the last that came within a 32nd of the peak.
    pub(crate) first: Try,
    /// The try that gave the last plan that none came within.
    winner: Try,
    /// How many plans running `winner` gave, none coming within.
    won: u8,
    /// How many plans `winner` made alone since every try was last made.
    alone: u8,
    /// How many of the plans `winner` gave running (counted in `won`) were smaller than every
    /// other try's by far ([`BY_FAR`]).
    by_far: u8,
}

/// The most plans a planned cache keeps with what they were placed for ([`Learned`]). Each of
/// the steps that take turns may make a plan and a try at keeping offsets at its end, and the
/// first micro-batch a rest placed again: with 8, ViT-S's accumulated gradients forgot each
/// before it came again (3.5x the host time of its steps' ends on the CPU).
const RECENT: usize = 16;

/// What a planned cache's planner keeps from its last plans: the [`Hint`], and the last
/// [`RECENT`] plans it made, each with what it was placed for, given again for the same.
///
/// Steps of several kinds that take turns, each planned again at its end around the arrays it
/// keeps in the block, plan from the same inputs at every turn: gradients accumulated over
/// micro-batches, the first keeping them and the last stepping the optimizer, each planned
/// around the other's arrays (ViT-S's two micro-batches around some 300 and 450 arrays: 0.8
/// and 3.1 ms of their step's end in the planner on the CPU), the first placing the rest of
/// its step again around its gradients ([`greedy_by_size_among`]). A plan given again costs a
/// comparison of its inputs.
#[derive(Default)]
pub(crate) struct Learned {
    /// What the planner learned of the ways to place a step ([`greedy_by_size_from`]).
    pub(crate) hint: Cell<Hint>,
    /// The last plans made, the newest last.
    recent: Cell<Vec<Made>>,
}

/// A plan and what it was placed for.
struct Made {
    /// The [`fingerprint`] of `lives`.
    key: u64,
    lives: Vec<Lifetime>,
    around: Around,
    plan: Plan,
}

/// What a plan was placed around.
enum Around {
    /// Ranges taken throughout the step ([`greedy_by_size_from`]).
    Taken(Vec<Range<usize>>),
    /// Arrays placed, each with its lifetime and offset ([`greedy_by_size_among`]).
    Placed(Vec<(Lifetime, usize)>),
    /// Offsets kept and ranges taken ([`kept_plan`]), with the bound the plan is measured
    /// against (not an input: it follows from the lifetimes and the ranges).
    Kept(Vec<Option<usize>>, Vec<Range<usize>>, usize),
}

impl Around {
    /// The bound a try at keeping offsets was measured against ([`Around::Kept`]); 0 for the
    /// others.
    fn bound(&self) -> usize {
        match self {
            Around::Kept(_, _, within) => *within,
            Around::Taken(_) | Around::Placed(_) => 0,
        }
    }
}

impl Learned {
    /// [`greedy_by_size_from`] with the hint and `room`, or the plan made last for the same
    /// `lives` and ranges `taken` (whatever the room).
    pub(crate) fn plan(&self, lives: &[Lifetime], taken: &[Range<usize>], room: usize) -> Plan {
        let same = |a: &Around| matches!(a, Around::Taken(t) if t == taken);
        let make = || {
            let plan = greedy_by_size_from(lives, taken, &self.hint, room);
            (plan, Around::Taken(taken.to_vec()))
        };
        self.recall(lives, same, make).0
    }

    /// [`greedy_by_size_among`], or the plan made last for the same `lives` among the same
    /// arrays `placed`.
    pub(crate) fn plan_among(&self, lives: &[Lifetime], placed: &[(Lifetime, usize)]) -> Plan {
        let same = |a: &Around| matches!(a, Around::Placed(p) if p == placed);
        let make = || {
            (
                greedy_by_size_among(lives, placed),
                Around::Placed(placed.to_vec()),
            )
        };
        self.recall(lives, same, make).0
    }

    /// [`kept_plan`] within `slack` ([`within_slack`]), the plan the one made last for the same
    /// `lives`, offsets `kept` and ranges `taken` (whatever the slack, which only tells whether
    /// it is taken). A step
    /// planned again from the step its plan was made from (the plans of micro-batches that take
    /// turns) keeps most offsets at every turn, from the same inputs, and tries that plan again
    /// each time: ViT-S's two such tries took 300 to 450 µs of their steps' ends on the CPU,
    /// mostly for none (then the plan given again).
    pub(crate) fn around_kept(
        &self,
        lives: &[Lifetime],
        kept: &[Option<usize>],
        taken: &[Range<usize>],
        slack: usize,
    ) -> Option<Plan> {
        let made = self.recall_kept(lives, (kept, taken), || kept_plan(lives, kept, taken));
        within_slack(made, slack)
    }

    /// The plan kept for `lives` with the offsets kept and ranges taken `inputs`, and its
    /// bound ([`kept_plan`]), else what `make` gives, kept for them.
    fn recall_kept(
        &self,
        lives: &[Lifetime],
        (kept, taken): (&[Option<usize>], &[Range<usize>]),
        make: impl FnOnce() -> (Plan, usize),
    ) -> (Plan, usize) {
        let same = |a: &Around| matches!(a, Around::Kept(k, t, _) if k == kept && t == taken);
        self.recall(lives, same, || {
            let (plan, within) = make();
            (plan, Around::Kept(kept.to_vec(), taken.to_vec(), within))
        })
    }

    /// The plan kept for `lives` and what `same` tells (the newest again), else the one `make`
    /// gives with what it was placed for, kept in place of the oldest; with the bound of a try
    /// at keeping offsets ([`Around::bound`]). The lifetimes are compared only with those of the
    /// plans of their fingerprint: the plans kept are mostly of the same arrays in other
    /// arrangements, and each comparison of a thousand lifetimes went most of the way.
    fn recall(
        &self,
        lives: &[Lifetime],
        same: impl Fn(&Around) -> bool,
        make: impl FnOnce() -> (Plan, Around),
    ) -> (Plan, usize) {
        let key = fingerprint(lives);
        let mut recent = self.recent.take();
        let made = match recent
            .iter()
            .position(|m| m.key == key && m.lives == lives && same(&m.around))
        {
            Some(i) => recent.remove(i),
            None => {
                if recent.len() == RECENT {
                    recent.remove(0);
                }
                let (plan, around) = make();
                Made {
                    key,
                    lives: lives.to_vec(),
                    around,
                    plan,
                }
            }
        };
        let found = (made.plan.clone(), made.around.bound());
        recent.push(made);
        self.recent.set(recent);
        found
    }

    /// Forgets the hint and the plans (a cold start).
    pub(crate) fn forget(&self) {
        self.hint.take();
        self.recent.take();
    }
}

/// Hash `h` with `v` mixed in (FxHash's step): fingerprints of plans and layouts, compared
/// before what they stand for.
pub(crate) fn mix(h: u64, v: u64) -> u64 {
    (h.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95)
}

/// A hash of `lives` (equal lifetimes, equal hashes), which tells most that differ apart at once.
fn fingerprint(lives: &[Lifetime]) -> u64 {
    lives.iter().fold(lives.len() as u64, |h, l| {
        let h = mix(h, l.bytes as u64);
        mix(h, (u64::from(l.start) << 32) | u64::from(l.end))
    })
}

/// [`greedy_by_size_around`] with every array placed: `hint`'s first try, then the other tries
/// in order, while the best plan so far is above `within`; or its winner alone, while its plan
/// fits `room` or its wins were by far (see [`greedy_by_size_from`]). `hint` is updated: its
/// first try becomes the try that came within, if one did (its wins counted as they were if it
/// is the winner, else none); else the try that gave the plan counts one more win (and one more
/// by far, if it was), or one more plan made alone.
fn plan_around(
    lives: &[Lifetime],
    overlaps: &Overlaps,
    taken: &[Range<usize>],
    (within, room): (usize, usize),
    hint: &Cell<Hint>,
) -> Plan {
    let by_size = size_order(lives);
    // Neither fit is always the smaller (on a BERT encoder's steps first fit saves 15%), and
    // largest first is not always the better order either: placed as they were allocated,
    // Swin-T's steps take their peak live bytes, where largest first took 1.113 times them.
    // Nor do either order's large arrays that live long always go first: RetinaNet's inference
    // steps keep their feature maps through both heads, and those orders hold 1.14x-1.29x of
    // their peak live bytes (largest first 1.28x-1.29x), where by weight they hold 1.03x.
    let place_by = |t: Try| placed(t, lives, &by_size, overlaps, taken);
    let mut h = hint.get();
    // The try that won the last plans, alone: kept if its plan is above the bound and fits the
    // room, or whatever the room after wins by far (a plan within goes on as every plan does,
    // and stops at once).
    let mut made = None;
    let by_far = h.by_far >= BY_FAR_IN_A_ROW;
    if (h.won >= WON_IN_A_ROW || by_far) && h.alone < ALONE_AT_MOST {
        let plan = place_by(h.winner);
        if plan.footprint > within && (plan.footprint <= room || by_far) {
            h.alone += 1;
            hint.set(h);
            return plan;
        }
        made = Some((plan, h.winner));
    }
    let start = h.first;
    let (mut best, mut won) = made.unwrap_or_else(|| (place_by(start), start));
    // The smallest footprint of the other tries' plans.
    let mut runner_up = usize::MAX;
    let long = lives.len() > LONG_STEP;
    // The others in order, the first one first (not the one made already).
    let done = won;
    let others = Try::ALL.into_iter().filter(|&t| t != start);
    for t in std::iter::once(start).chain(others).filter(|&t| t != done) {
        if best.footprint <= within || long {
            // At the lower bound, or so near it that another plan could save little, or a long
            // step's, whose every try costs milliseconds: kept.
            break;
        }
        let plan = place_by(t);
        if plan.footprint < best.footprint {
            runner_up = best.footprint;
            (best, won) = (plan, t);
        } else {
            runner_up = runner_up.min(plan.footprint);
        }
    }
    // A long step's plan above the bound was its one try: nothing is learned of the others.
    if best.footprint <= within {
        h = if won == h.winner {
            Hint { first: won, ..h }
        } else {
            Hint {
                first: won,
                ..Hint::default()
            }
        };
    } else if !long {
        // Every try was made: the runner-up is the smallest of the others.
        let far = runner_up > best.footprint.saturating_add(best.footprint / BY_FAR);
        if won == h.winner {
            h.won = h.won.saturating_add(1);
            h.by_far = if far { h.by_far.saturating_add(1) } else { 0 };
        } else {
            (h.won, h.by_far) = (1, u8::from(far));
        }
        h.winner = won;
        h.alone = 0;
    }
    hint.set(h);
    best
}

/// `lives` placed by try `t` (`by_size`: their [`size_order`]).
fn placed(
    t: Try,
    lives: &[Lifetime],
    by_size: &[usize],
    overlaps: &Overlaps,
    taken: &[Range<usize>],
) -> Plan {
    match t {
        Try::BestFit => place(lives, by_size, overlaps, true, taken),
        Try::FirstFit => place(lives, by_size, overlaps, false, taken),
        Try::ByWeight => place(lives, &weight_order(lives), overlaps, true, taken),
        Try::InOrder => {
            let mut in_order: Vec<usize> = (0..lives.len()).collect();
            in_order.sort_unstable_by_key(|&i| (lives[i].start, i));
            place(lives, &in_order, overlaps, true, taken)
        }
    }
}

/// The indices of `lives`, largest first; ties by start, then position, so that the plan is
/// deterministic.
fn size_order(lives: &[Lifetime]) -> Vec<usize> {
    heaviest_first(lives, |l| l.bytes as u128)
}

/// The indices of `lives` by weight, the heaviest first: an array's size times the square root
/// of its lifetime in ticks (rounded down), so that an array that lives long is placed before
/// one somewhat larger that lives briefly, and takes the bottom of the block under the short
/// ones that come and go around it.
fn weight_order(lives: &[Lifetime]) -> Vec<usize> {
    heaviest_first(lives, |l| {
        l.bytes as u128 * u128::from(l.end.saturating_sub(l.start).isqrt())
    })
}

/// The indices of `lives`, the largest `weight` first; ties by start, then position, so that
/// the plan is deterministic.
fn heaviest_first(lives: &[Lifetime], weight: impl Fn(&Lifetime) -> u128) -> Vec<usize> {
    // Each key computed once; no two keys are equal (the index is the last), so an unstable
    // sort gives the one order.
    let mut keyed: Vec<(std::cmp::Reverse<u128>, u32, usize)> = lives
        .iter()
        .enumerate()
        .map(|(i, l)| (std::cmp::Reverse(weight(l)), l.start, i))
        .collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(.., i)| i).collect()
}

/// The most pairs of overlapping lifetimes [`Overlaps`] lists; past it, each array's overlaps
/// are found by looking at every other (bounded memory, quadratic time).
const MAX_LISTED_PAIRS: usize = 1 << 23;

/// Past this many overlapping pairs per lifetime on average, and past a [`DENSE_SHARE`]th of
/// the step's lifetimes, a step is dense (most of its arrays meet most others: a training step's
/// activations), and [`Overlaps`] lists none: each array is placed by a scan of those placed
/// before it, in order of offset (see [`place`]).
const DENSE: usize = 32;

/// A step whose lifetimes meet at most this fraction of the others on average lists its pairs,
/// however many (up to [`MAX_LISTED_PAIRS`]): a long step's arrays each meet its few that live
/// through it, and a scan of every array placed costs the square of its length. A generation
/// loop run as one step (T5 searching with four beams, 10,000 arrays, 50 pairs a lifetime;
/// assisted generation, 20,000 and 56) was scanned past 32 pairs a lifetime: 16-66 ms a try,
/// about 95 ms and 70 ms a step on the CPU, slower than CUDA's pool on the GPU; listed, 7-12 ms a
/// try, 0.31x and 0.22x of the planner's time. At a 16th, GPT-2 trained with micro-batches
/// accumulated (5,200 arrays, 297 pairs a lifetime) planned 1.7 times slower listed than
/// scanned; at a 32nd, Mask R-CNN's inference (3,900 arrays, 56 pairs) planned in 0.82x of the
/// time on the CPU but replayed in 1.10x [0.98, 1.28] on an H200. At a 128th, only a step of
/// more than 4,096 arrays lists more than 32 pairs a lifetime.
const DENSE_SHARE: usize = 128;

/// A step of more arrays than this (to be placed, past those stacked) is planned by one try
/// alone, the one made first (see [`greedy_by_size_from`]): each try places every array among
/// those it meets, milliseconds for such a step (T5 searching with four beams, 10,000 arrays:
/// 7-12 ms a try, three or four tries a plan, a plan at most requests). The tries differed by
/// up to 7% there; by one try, that log's plans held 1.110x of its peak live bytes
/// (1.126x by every try), and assisted generation's (20,000 arrays) 1.203x (1.328x).
const LONG_STEP: usize = 4096;

/// Which lifetimes overlap which: listed per lifetime when there are few enough pairs (a step's
/// arrays mostly live briefly, so each meets a few others), else found by a scan of all.
enum Overlaps {
    /// `with[from[i]..from[i + 1]]`: the lifetimes that overlap lifetime `i`.
    Listed {
        from: Vec<usize>,
        with: Vec<u32>,
    },
    Scan,
}

impl Overlaps {
    /// The overlaps of `lives`, by a sweep over their starts: a lifetime overlaps exactly the
    /// ones that started no later and have not ended by its start (for lifetimes that end after
    /// they start; any other makes it scan, as [`Lifetime::overlaps`] defines those).
    fn of(lives: &[Lifetime]) -> Overlaps {
        Overlaps::listed(lives, Overlaps::most(lives))
    }

    /// The most pairs [`Overlaps::of`] lists for `lives`.
    fn most(lives: &[Lifetime]) -> usize {
        let n = lives.len();
        MAX_LISTED_PAIRS.min(n.saturating_mul(DENSE.max(n / DENSE_SHARE)))
    }

    /// Whether [`Overlaps::of`] `lives` scans, when that is told before listing a pair (a dense
    /// step's: its pairs counted over the ticks; else `false`, whatever listing would tell).
    fn scans(lives: &[Lifetime]) -> bool {
        Overlaps::scans_past(lives, Overlaps::most(lives))
    }

    /// [`Overlaps::scans`], listing at most `most` pairs.
    fn scans_past(lives: &[Lifetime], most: usize) -> bool {
        lives.len() > u32::MAX as usize
            || lives.iter().any(|l| l.end <= l.start)
            // A dense step, told without listing its pairs until there are too many.
            || pairs_about(lives).is_some_and(|pairs| pairs > most)
    }

    /// [`Overlaps::of`], listing at most `most` pairs: a step with more scans (told by
    /// [`pairs_about`] before any pair is listed; the plans of the dense training steps took
    /// 0.91x-0.95x of the time so).
    fn listed(lives: &[Lifetime], most: usize) -> Overlaps {
        if Overlaps::scans_past(lives, most) {
            return Overlaps::Scan;
        }
        let mut by_start: Vec<u32> = (0..lives.len() as u32).collect();
        // A step's lifetimes come in the order of their allocations, which is their starts'.
        if !lives.is_sorted_by_key(|l| l.start) {
            by_start.sort_by_key(|&i| lives[i as usize].start);
        }
        // Each pair once, as (later start, earlier start).
        let mut pairs: Vec<(u32, u32)> = Vec::new();
        let mut alive: Vec<u32> = Vec::new();
        for &i in &by_start {
            let start = lives[i as usize].start;
            alive.retain(|&j| lives[j as usize].end > start);
            if pairs.len() + alive.len() > most {
                return Overlaps::Scan;
            }
            pairs.extend(alive.iter().map(|&j| (i, j)));
            alive.push(i);
        }
        let mut from = vec![0usize; lives.len() + 1];
        for &(i, j) in &pairs {
            from[i as usize + 1] += 1;
            from[j as usize + 1] += 1;
        }
        for k in 1..from.len() {
            from[k] += from[k - 1];
        }
        let mut next = from.clone();
        let mut with = vec![0u32; 2 * pairs.len()];
        for (i, j) in pairs {
            for (a, b) in [(i, j), (j, i)] {
                with[next[a as usize]] = b;
                next[a as usize] += 1;
            }
        }
        Overlaps::Listed { from, with }
    }

    /// How many lifetimes overlap `lives[i]`'s, when listed.
    fn count(&self, i: usize) -> Option<usize> {
        match self {
            Overlaps::Listed { from, .. } => Some(from[i + 1] - from[i]),
            Overlaps::Scan => None,
        }
    }

    /// Calls `f` with each lifetime of `order` whose lifetime overlaps `lives[i]`'s.
    fn each(&self, lives: &[Lifetime], i: usize, order: &[usize], mut f: impl FnMut(usize)) {
        match self {
            Overlaps::Listed { from, with } => {
                with[from[i]..from[i + 1]]
                    .iter()
                    .for_each(|&j| f(j as usize));
            }
            Overlaps::Scan => order
                .iter()
                .filter(|&&j| lives[j].overlaps(&lives[i]))
                .for_each(|&j| f(j)),
        }
    }
}

/// The pairs of `lives` (of lifetimes that end after they start) alive together, counted from
/// the lifetimes alive at each one's start over the ticks, in about `n` when the ticks are
/// about as many as the lifetimes (a step's are its allocations; else `None`). Exact when no
/// two start at one tick; else it counts such pairs twice.
fn pairs_about(lives: &[Lifetime]) -> Option<usize> {
    let last = lives.iter().map(|l| l.end).max().unwrap_or(0) as usize;
    if last > 4 * lives.len() + 64 {
        return None;
    }
    let mut net = vec![0isize; last + 1];
    for l in lives {
        net[l.start as usize] += 1;
        net[l.end as usize] -= 1;
    }
    // The lifetimes alive at each tick: started at or before it, ending after it.
    let mut alive = 0isize;
    for n in &mut net {
        alive += *n;
        *n = alive;
    }
    Some(
        lives
            .iter()
            .map(|l| (net[l.start as usize] as usize).saturating_sub(1))
            .sum(),
    )
}

/// An array placed at offset `at`.
#[derive(Clone, Copy)]
struct Placed {
    at: usize,
    life: Lifetime,
}

/// The most arrays of a run of [`ByOffset`]: one placed moves at most as many, where a single
/// sorted vector moved half the arrays placed (Keypoint R-CNN's plans of 800 arrays spent an
/// eighth of their time moving them).
const RUN: usize = 128;

/// The arrays placed, in order of offset, in sorted runs of at most [`RUN`] arrays.
#[derive(Default)]
struct ByOffset {
    runs: Vec<Vec<Placed>>,
    len: usize,
}

impl ByOffset {
    /// How many arrays are placed.
    fn len(&self) -> usize {
        self.len
    }

    /// [`Gap::look_at`] the ranges of the arrays placed whose lifetimes meet `me`'s and the
    /// ranges `fixed` (sorted), merged in order of offset: the planner's hottest loop (a dense
    /// step's array meets most of the step), as plain loops over the runs, in a function of its
    /// own. Inlined as an iterator chain (flattened runs, filtered, merged through a `Peekable`
    /// of `fixed`), its speed depended on how the compiler arranged the function around it: the
    /// same code took 17% more instructions in one build of the crate than in another (GPT-2 on
    /// varying lengths, callgrind), with the array's lifetime reloaded from the stack at each
    /// array placed that it looked at.
    #[inline(never)]
    fn look_at_met(&self, me: &Lifetime, gap: &mut Gap, fixed: &[(usize, usize)]) {
        let mut f = 0;
        for run in &self.runs {
            for p in run {
                if !p.life.overlaps(me) {
                    continue;
                }
                let range = (p.at, p.at + p.life.bytes);
                while let Some(&r) = fixed.get(f)
                    && r < range
                {
                    if gap.see(r) {
                        return;
                    }
                    f += 1;
                }
                if gap.see(range) {
                    return;
                }
            }
        }
        for &r in &fixed[f..] {
            if gap.see(r) {
                return;
            }
        }
    }

    /// Adds `p` after those at its offset or below (their order does not change a gap).
    fn insert(&mut self, p: Placed) {
        self.len += 1;
        // The first run that ends above `p`'s offset, else the last.
        let r = self
            .runs
            .partition_point(|run| run.last().is_some_and(|q| q.at <= p.at))
            .min(self.runs.len().saturating_sub(1));
        let Some(run) = self.runs.get_mut(r) else {
            self.runs.push(vec![p]);
            return;
        };
        let k = run.partition_point(|q| q.at <= p.at);
        run.insert(k, p);
        if run.len() > RUN {
            let upper = run.split_off(RUN / 2);
            self.runs.insert(r + 1, upper);
        }
    }
}

/// Offsets for `lives` in a block where the arrays `placed` (each with its lifetime, at its
/// offset) already are: each of `lives` largest first, among the arrays of both whose lifetimes
/// meet its own, by best fit and by first fit, the smaller plan kept (best fit's on a tie; no
/// other order tried). The footprint counts both. For the rest of a step placed again around the
/// arrays the step made so far, which live on to their own ends.
/// The smallest of `lives` are stacked on top of the rest and of `placed`, as [`greedy_by_size`]
/// stacks them (see the module docs): Mask R-CNN's steps of 3,900 arrays, 3,000 of them small,
/// took 6 ms on the CPU placed one by one, at one allocation.
///
/// ```
/// use gpucache::planner::{Lifetime, greedy_by_size_among};
/// let early = Lifetime { bytes: 512, start: 0, end: 4 };
/// let lives = [
///     Lifetime { bytes: 256, start: 2, end: 5 },
///     Lifetime { bytes: 512, start: 4, end: 6 },
/// ];
/// // The first meets `early` and goes above it; the second comes when `early` has ended.
/// let plan = greedy_by_size_among(&lives, &[(early, 0)]);
/// assert_eq!(plan.offsets, [512, 0]);
/// assert_eq!(plan.footprint, 768);
/// ```
pub fn greedy_by_size_among(lives: &[Lifetime], placed: &[(Lifetime, usize)]) -> Plan {
    let all = with_placed(lives, placed);
    let small = stacked(lives, peak_live(&all));
    if small.len() < MIN_STACKED {
        return among(&all, lives, placed);
    }
    // The rest's footprint counts the arrays placed: above it, the stack meets none.
    with_stack(lives, &small, &[], |rest| {
        among(&with_placed(rest, placed), rest, placed)
    })
}

/// The lifetimes of the arrays `placed`, then `lives`.
fn with_placed(lives: &[Lifetime], placed: &[(Lifetime, usize)]) -> Vec<Lifetime> {
    placed
        .iter()
        .map(|&(l, _)| l)
        .chain(lives.iter().copied())
        .collect()
}

/// [`greedy_by_size_among`], every array placed; `all`: [`with_placed`].
fn among(all: &[Lifetime], lives: &[Lifetime], placed: &[(Lifetime, usize)]) -> Plan {
    let n = placed.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.extend(
        heaviest_first(lives, |l| l.bytes as u128)
            .into_iter()
            .map(|i| i + n),
    );
    let at: Vec<usize> = placed.iter().map(|&(_, at)| at).collect();
    let overlaps = Overlaps::of(all);
    // First fit may take less, as for whole steps (the rest of a BERT encoder's step whose
    // batch and length grew: 298 MB, where best fit took 348 MB and the plan scaled whole, made
    // by the better of the two, 298 MB; the rest placed again is kept only if no larger).
    let best = place_after(all, &order, &overlaps, true, &[], &at);
    let first = place_after(all, &order, &overlaps, false, &[], &at);
    let plan = if first.footprint < best.footprint {
        first
    } else {
        best
    };
    Plan {
        offsets: plan.offsets[n..].to_vec(),
        footprint: plan.footprint,
    }
}

/// Places `lives` in `order`, each at the smallest gap that holds it (`best_fit`) or the lowest
/// (first fit) among the arrays placed whose lifetimes overlap its own and the ranges `fixed`
/// (taken throughout), else above them.
fn place(
    lives: &[Lifetime],
    order: &[usize],
    overlaps: &Overlaps,
    best_fit: bool,
    fixed: &[Range<usize>],
) -> Plan {
    place_after(lives, order, overlaps, best_fit, fixed, &[])
}

/// [`place`], the first arrays of `order` at the offsets `preset` (one each, in that order).
fn place_after(
    lives: &[Lifetime],
    order: &[usize],
    overlaps: &Overlaps,
    best_fit: bool,
    fixed: &[Range<usize>],
    preset: &[usize],
) -> Plan {
    let mut offsets = vec![0usize; lives.len()];
    let mut placed = vec![false; lives.len()];
    let mut footprint = 0;
    let mut taken: Vec<(usize, usize)> = Vec::new();
    let mut fixed: Vec<(usize, usize)> = fixed.iter().map(|r| (r.start, r.end)).collect();
    fixed.sort_unstable();
    // The arrays placed (of more than zero bytes), by offset: an array that meets many of them
    // (a training step's activations meet most of the step) takes its overlaps from here, in
    // order, rather than sorting them.
    let mut by_offset = ByOffset::default();
    for (n, &i) in order.iter().enumerate() {
        let me = lives[i];
        let mut gap = Gap::new(me.bytes, best_fit);
        let meets = overlaps.count(i).unwrap_or(n);
        let at = if let Some(&at) = preset.get(n) {
            at
        } else if meets > 16 && by_offset.len() <= meets * meets.ilog2() as usize {
            // In order of offset already: each range met is looked at as it is found.
            by_offset.look_at_met(&me, &mut gap, &fixed);
            gap.at()
        } else {
            taken.clear();
            overlaps.each(lives, i, &order[..n], |j| {
                if placed[j] && lives[j].bytes > 0 {
                    taken.push((offsets[j], offsets[j] + lives[j].bytes));
                }
            });
            // By offset alone: of two ranges at one offset, the gap below them is the same
            // whichever comes first, and the search rises past both.
            taken.sort_unstable_by_key(|r| r.0);
            gap.look_at(taken.iter().copied(), &fixed);
            gap.at()
        };
        offsets[i] = at;
        footprint = footprint.max(at + me.bytes);
        placed[i] = true;
        if me.bytes > 0 {
            by_offset.insert(Placed { at, life: me });
        }
    }
    Plan { offsets, footprint }
}

/// The search for an array's place among the ranges in use while it lives, looked at in order
/// of offset: the gap that holds it (the smallest, with best fit; else the lowest), else the
/// top of them all.
struct Gap {
    bytes: usize,
    best_fit: bool,
    best: Option<usize>,
    best_gap: usize,
    top: usize,
}

impl Gap {
    fn new(bytes: usize, best_fit: bool) -> Gap {
        Gap {
            bytes,
            best_fit,
            best: None,
            best_gap: usize::MAX,
            top: 0,
        }
    }

    /// Looks at the ranges `met` (in order of offset) and `fixed` (sorted), merged in order,
    /// until the place is found (first fit) or they end.
    fn look_at(&mut self, met: impl Iterator<Item = (usize, usize)>, fixed: &[(usize, usize)]) {
        let mut fixed = fixed.iter().copied().peekable();
        for range in met {
            while let Some(f) = fixed.next_if(|&f| f < range) {
                if self.see(f) {
                    return;
                }
            }
            if self.see(range) {
                return;
            }
        }
        for f in fixed {
            if self.see(f) {
                return;
            }
        }
    }

    /// Looks at the range `[lo, hi)`, at or above the ranges before it; returns whether the
    /// search is over: a gap found, with first fit, or with best fit one of exactly the size
    /// (no later gap is smaller, and an equal one is not taken). A training step has many
    /// arrays of one size, which fill each other's gaps: the plans of BERT trained with dynamic
    /// padding took a tenth less time so (the same plans).
    #[inline]
    fn see(&mut self, (lo, hi): (usize, usize)) -> bool {
        if lo >= self.top && lo - self.top >= self.bytes && lo - self.top < self.best_gap {
            self.best = Some(self.top);
            self.best_gap = lo - self.top;
            if !self.best_fit || self.best_gap == self.bytes {
                return true;
            }
        }
        self.top = self.top.max(hi);
        false
    }

    /// The offset found: the gap's, else the top.
    fn at(&self) -> usize {
        self.best.unwrap_or(self.top)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random steps: `n` lifetimes, each starting at its own tick or not (`distinct`), some
    /// long, some empty or reversed when `degenerate`.
    fn random_lives(rng: &mut fastrand::Rng, n: usize, degenerate: bool) -> Vec<Lifetime> {
        (0..n)
            .map(|i| {
                let start = if rng.bool() {
                    i as u32
                } else {
                    rng.u32(0..n as u32)
                };
                let long = rng.u8(0..8) == 0;
                let len = if long {
                    rng.u32(0..n as u32)
                } else {
                    rng.u32(1..4)
                };
                let end = if degenerate && rng.u8(0..10) == 0 {
                    start.saturating_sub(rng.u32(0..2))
                } else {
                    start + len.max(1)
                };
                let bytes = rng.usize(0..8) * ALIGN;
                Lifetime { bytes, start, end }
            })
            .collect()
    }

    /// [`place`] as written first: every array placed before, filtered by lifetime, sorted.
    fn by_hand(lives: &[Lifetime], order: &[usize], best_fit: bool) -> Plan {
        by_hand_around(lives, order, best_fit, &[])
    }

    /// [`by_hand`] around ranges taken throughout.
    fn by_hand_around(
        lives: &[Lifetime],
        order: &[usize],
        best_fit: bool,
        fixed: &[Range<usize>],
    ) -> Plan {
        let mut offsets = vec![0usize; lives.len()];
        let mut footprint = 0;
        for (n, &i) in order.iter().enumerate() {
            let mut taken: Vec<(usize, usize)> = order[..n]
                .iter()
                .filter(|&&j| lives[j].bytes > 0 && lives[j].overlaps(&lives[i]))
                .map(|&j| (offsets[j], offsets[j] + lives[j].bytes))
                .chain(fixed.iter().map(|r| (r.start, r.end)))
                .collect();
            taken.sort_unstable();
            let (mut best, mut best_gap, mut top) = (None, usize::MAX, 0usize);
            for (lo, hi) in taken {
                if lo >= top && lo - top >= lives[i].bytes && lo - top < best_gap {
                    (best, best_gap) = (Some(top), lo - top);
                    if !best_fit {
                        break;
                    }
                }
                top = top.max(hi);
            }
            offsets[i] = best.unwrap_or(top);
            footprint = footprint.max(offsets[i] + lives[i].bytes);
        }
        Plan { offsets, footprint }
    }

    /// A step whose long-lived arrays are smaller than a short-lived one: largest first (with
    /// either fit) and in the order allocated each put the last array above the rest, 256 bytes
    /// over the peak; by weight the long-lived array goes first, at the bottom, and the plan
    /// takes the peak live bytes.
    #[test]
    fn long_lived_arrays_go_first_by_weight_when_the_other_orders_waste() {
        let life = |bytes, start, end| Lifetime { bytes, start, end };
        let lives = [
            life(768, 0, 2),
            life(768, 1, 5),
            life(512, 2, 5),
            life(512, 3, 5),
        ];
        let overlaps = Overlaps::of(&lives);
        let in_order: Vec<usize> = (0..lives.len()).collect();
        for (order, best_fit) in [
            (size_order(&lives), true),
            (size_order(&lives), false),
            (in_order, true),
        ] {
            assert_eq!(
                place(&lives, &order, &overlaps, best_fit, &[]).footprint,
                2048
            );
        }
        assert_eq!(weight_order(&lives), [1, 0, 2, 3]);
        let plan = greedy_by_size(&lives);
        assert_eq!(plan.offsets, [768, 0, 768, 1280]);
        assert_eq!(plan.footprint, peak_live(&lives));
        assert_eq!(plan.footprint, 1792);
    }

    #[test]
    fn listed_overlaps_plan_as_the_scan_of_every_pair_does() {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut listed = 0;
        for case in 0..2000 {
            // Up to 200 arrays, some long: dense enough to place some from the offset list.
            let n = rng.usize(0..200);
            let lives = random_lives(&mut rng, n, case % 3 == 0);
            // Largest first, and as allocated.
            let order = if case % 2 == 0 {
                size_order(&lives)
            } else {
                (0..n).collect()
            };
            // Listed with room for every pair, and with too little room (then it scans).
            for most in [usize::MAX, rng.usize(0..8)] {
                let overlaps = Overlaps::listed(&lives, most);
                listed += usize::from(matches!(overlaps, Overlaps::Listed { .. }));
                for best_fit in [true, false] {
                    let plan = place(&lives, &order, &overlaps, best_fit, &[]);
                    assert_eq!(
                        plan,
                        place(&lives, &order, &Overlaps::Scan, best_fit, &[]),
                        "case {case}: {lives:?}"
                    );
                    assert_eq!(plan, by_hand(&lives, &order, best_fit), "case {case}");
                }
            }
        }
        assert!(listed > 1000, "the listed overlaps were tried ({listed})");
    }

    #[test]
    fn a_plan_starts_with_the_try_that_came_within_last_time() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (mut kept, mut unchanged) = (0, 0);
        let hint = |first| {
            Cell::new(Hint {
                first,
                ..Hint::default()
            })
        };
        for case in 0..3000 {
            let lives = random_lives(&mut rng, 24, false);
            let overlaps = Overlaps::of(&lives);
            let within = peak_live(&lives) + peak_live(&lives) / FIRST_FIT_WITHIN;
            let tries = Try::ALL.map(|t| {
                let first = hint(t);
                let plan = plan_around(&lives, &overlaps, &[], (within, usize::MAX), &first);
                (t, plan, first.get())
            });
            for (t, plan, after) in &tries {
                // Every plan is sound whatever the try made first.
                assert!(holds(&lives, plan, &[]), "case {case}: {t:?} first");
                if plan.footprint <= within {
                    // Within: the try that gave the plan is tried first next time, and gives it
                    // again at once.
                    let by_size = size_order(&lives);
                    assert_eq!(&placed(after.first, &lives, &by_size, &overlaps, &[]), plan);
                    assert_eq!(
                        *after,
                        Hint {
                            first: after.first,
                            ..Hint::default()
                        }
                    );
                    let again = Cell::new(*after);
                    let plan_again = plan_around(&lives, &overlaps, &[], (within, 0), &again);
                    assert_eq!(&plan_again, plan);
                    assert_eq!(again.get(), *after, "case {case}");
                    kept += usize::from(after.first != Try::BestFit);
                } else {
                    // No try came within: every one was made, the smallest kept (of those as
                    // small, the one tried first), the first unchanged, the winner counted.
                    assert_eq!(after.first, *t, "case {case}");
                    assert_eq!(plan.footprint, tries[0].1.footprint, "case {case}");
                    assert_eq!((after.won, after.alone), (1, 0), "case {case}");
                    unchanged += 1;
                }
            }
        }
        assert!(
            kept > 100 && unchanged > 100,
            "{kept} kept, {unchanged} unchanged"
        );
    }

    /// Every try's plan of `lives`, the index of the one [`plan_around`] keeps when every try
    /// is made in order (the first of the smallest), and whether it wins by far.
    fn every_try(lives: &[Lifetime], overlaps: &Overlaps) -> ([Plan; 4], usize, bool) {
        let by_size = size_order(lives);
        let plans = Try::ALL.map(|t| placed(t, lives, &by_size, overlaps, &[]));
        let best = plans.iter().map(|p| p.footprint).min().unwrap();
        let k = plans.iter().position(|p| p.footprint == best).unwrap();
        let runner_up = (0..plans.len())
            .filter(|&j| j != k)
            .map(|j| plans[j].footprint)
            .min()
            .unwrap();
        (plans, k, runner_up > best + best / BY_FAR)
    }

    /// `h` after a plan that every try was made for, which its winner gave again.
    fn one_more_win(h: Hint) -> Hint {
        Hint {
            won: h.won + 1,
            ..h
        }
    }

    #[test]
    fn a_try_that_keeps_winning_is_made_alone_while_its_plan_fits_the_room() {
        let mut rng = fastrand::Rng::with_seed(13);
        let (mut alone, mut all_again, mut by_far) = (0, 0, 0);
        for case in 0..400 {
            let lives = random_lives(&mut rng, 24, false);
            let overlaps = Overlaps::of(&lives);
            let by_size = size_order(&lives);
            if every_try(&lives, &overlaps).2 {
                // Made alone whatever the room: the next test's.
                by_far += 1;
                continue;
            }
            // A bound no plan comes within: every plan is one no try came within.
            let within = 0;
            let best = plan_around(&lives, &overlaps, &[], (within, 0), &Cell::default());
            let winner = Try::ALL
                .into_iter()
                .find(|&t| placed(t, &lives, &by_size, &overlaps, &[]) == best)
                .unwrap();
            let worst = Try::ALL
                .map(|t| placed(t, &lives, &by_size, &overlaps, &[]).footprint)
                .into_iter()
                .max()
                .unwrap();
            let hint = Cell::new(Hint::default());
            // Every try is made until the winner has won its plans in a row.
            for won in 1..=WON_IN_A_ROW {
                let plan = plan_around(&lives, &overlaps, &[], (within, usize::MAX), &hint);
                assert_eq!(plan.footprint, best.footprint, "case {case}");
                assert_eq!((hint.get().won, hint.get().alone), (won, 0), "case {case}");
            }
            let h = hint.get();
            // Then the winner alone, while its plan fits the room...
            for n in 1..=ALONE_AT_MOST {
                let plan = plan_around(&lives, &overlaps, &[], (within, best.footprint), &hint);
                assert_eq!(plan, placed(h.winner, &lives, &by_size, &overlaps, &[]));
                assert_eq!(hint.get(), Hint { alone: n, ..h }, "case {case}");
                alone += 1;
            }
            // ...and every try again after so many plans made alone,
            let plan = plan_around(&lives, &overlaps, &[], (within, usize::MAX), &hint);
            assert_eq!(plan.footprint, best.footprint, "case {case}");
            assert_eq!(hint.get().alone, 0, "case {case}");
            // or at once for a plan the room does not hold (it sets what the cache holds).
            let hint = Cell::new(Hint { alone: 0, ..h });
            let plan = plan_around(&lives, &overlaps, &[], (within, best.footprint - 1), &hint);
            assert_eq!(plan.footprint, best.footprint, "case {case}");
            assert_eq!(hint.get(), one_more_win(h), "case {case}");
            all_again += usize::from(worst > best.footprint && winner != Try::BestFit);
        }
        // Cases where making every try again matters (another try gave a larger plan).
        assert!(
            alone > 1000 && all_again > 20 && by_far > 10,
            "{alone} alone, {all_again}, {by_far} by far"
        );
    }

    #[test]
    fn a_try_that_keeps_winning_by_far_is_made_alone_whatever_the_room() {
        let mut rng = fastrand::Rng::with_seed(17);
        let (mut far_cases, mut near_cases) = (0, 0);
        for case in 0..400 {
            let lives = random_lives(&mut rng, 24, false);
            let overlaps = Overlaps::of(&lives);
            let (plans, k, far) = every_try(&lives, &overlaps);
            if plans[k].footprint == 0 {
                continue;
            }
            // No room and no plan within (the bound 0): every try is made, and the winner's
            // wins by far are counted, until it has won so often by far.
            let hint = Cell::new(Hint::default());
            for n in 1..=BY_FAR_IN_A_ROW {
                let plan = plan_around(&lives, &overlaps, &[], (0, 0), &hint);
                assert_eq!(plan, plans[k], "case {case}");
                let h = hint.get();
                assert_eq!((h.winner, h.won), (Try::ALL[k], n), "case {case}");
                assert_eq!(h.by_far, if far { n } else { 0 }, "case {case}");
            }
            let h = hint.get();
            let plan = plan_around(&lives, &overlaps, &[], (0, 0), &hint);
            assert_eq!(plan, plans[k], "case {case}");
            if far {
                // Then alone, though its plan does not fit the room.
                assert_eq!(hint.get(), Hint { alone: 1, ..h }, "case {case}");
                far_cases += 1;
            } else {
                // Wins by less: every try again, one more win.
                assert_eq!(hint.get(), one_more_win(h), "case {case}");
                near_cases += 1;
            }
            // A plan within, given by the winner, keeps its wins; by another try, none are left.
            let h = Hint {
                won: WON_IN_A_ROW,
                alone: 0,
                ..hint.get()
            };
            let kept = Cell::new(h);
            let plan = plan_around(&lives, &overlaps, &[], (usize::MAX, 0), &kept);
            assert_eq!(plan, plans[k], "case {case}");
            assert_eq!(
                kept.get(),
                Hint {
                    first: Try::ALL[k],
                    ..h
                },
                "case {case}"
            );
            let other = Try::ALL[(k + 1) % Try::ALL.len()];
            let lost = Cell::new(Hint {
                first: other,
                won: 1,
                by_far: 0,
                ..h
            });
            plan_around(&lives, &overlaps, &[], (usize::MAX, 0), &lost);
            assert_eq!(
                lost.get(),
                Hint {
                    first: other,
                    ..Hint::default()
                },
                "case {case}"
            );
        }
        assert!(
            far_cases > 20 && near_cases > 20,
            "{far_cases} by far, {near_cases} not"
        );
    }

    #[test]
    fn a_plan_made_for_the_same_inputs_is_given_again_and_no_other() {
        let mut rng = fastrand::Rng::with_seed(23);
        let learned = Learned::default();
        let made = Cell::new(0);
        // Each input's plan through `recall`, counting those made.
        let taken_plan = |lives: &[Lifetime], taken: &[Range<usize>]| {
            let same = |a: &Around| matches!(a, Around::Taken(t) if t == taken);
            let make = || {
                made.set(made.get() + 1);
                (
                    greedy_by_size_around(lives, taken),
                    Around::Taken(taken.to_vec()),
                )
            };
            learned.recall(lives, same, make).0
        };
        let inputs: Vec<(Vec<Lifetime>, Vec<Range<usize>>)> = (0..RECENT + 1)
            .map(|i| {
                let taken = vec![i * ALIGN..(i + 1) * ALIGN, 64 * ALIGN..66 * ALIGN];
                (random_lives(&mut rng, 40, false), taken)
            })
            .collect();
        let (lives, taken) = &inputs[0];
        let plan = taken_plan(lives, taken);
        assert_eq!(plan, greedy_by_size_around(lives, taken));
        assert_eq!(made.get(), 1);
        // The same inputs: the same plan, not made again.
        assert_eq!(taken_plan(lives, taken), plan);
        assert_eq!(made.get(), 1);
        // One range moved, one lifetime longer, one array larger: each made.
        let moved = [
            taken[0].clone(),
            taken[1].start + ALIGN..taken[1].end + ALIGN,
        ];
        assert_eq!(
            taken_plan(lives, &moved),
            greedy_by_size_around(lives, &moved)
        );
        let mut longer = lives.clone();
        longer[3].end += 1;
        assert_eq!(
            taken_plan(&longer, taken),
            greedy_by_size_around(&longer, taken)
        );
        let mut larger = lives.clone();
        larger[5].bytes += ALIGN;
        assert_eq!(
            taken_plan(&larger, taken),
            greedy_by_size_around(&larger, taken)
        );
        assert_eq!(made.get(), 4);
        // Placed among arrays rather than around ranges: its own plan, whatever the lives.
        let placed = [(lives[0], 0)];
        let among = learned.plan_among(lives, &placed);
        assert_eq!(among, greedy_by_size_among(lives, &placed));
        assert_eq!(taken_plan(lives, taken), plan);
        assert_eq!(made.get(), 4);
        // The first inputs, then as many others as are kept: the first was the oldest, and is
        // made again; the last ones are not.
        for (lives, taken) in &inputs[1..] {
            taken_plan(lives, taken);
        }
        assert_eq!(made.get(), 4 + RECENT);
        let (lives, taken) = &inputs[RECENT];
        taken_plan(lives, taken);
        assert_eq!(made.get(), 4 + RECENT);
        let (lives, taken) = &inputs[0];
        assert_eq!(taken_plan(lives, taken), plan);
        assert_eq!(made.get(), 5 + RECENT);
        // A cold start forgets them.
        learned.forget();
        taken_plan(lives, taken);
        assert_eq!(made.get(), 6 + RECENT);
    }

    /// [`kept_plan`] within `slack`, as [`Learned::around_kept`] gives it.
    fn around_kept(
        lives: &[Lifetime],
        kept: &[Option<usize>],
        taken: &[Range<usize>],
        slack: usize,
    ) -> Option<Plan> {
        within_slack(kept_plan(lives, kept, taken), slack)
    }

    #[test]
    fn a_try_at_keeping_offsets_is_given_again_whatever_the_slack() {
        let mut rng = fastrand::Rng::with_seed(29);
        let learned = Learned::default();
        let made = Cell::new(0);
        let lives = random_lives(&mut rng, 40, false);
        // Each try through `recall_kept`, counting those made, within `slack`.
        let try_kept = |kept: &[Option<usize>], slack: usize| {
            let got = learned.recall_kept(&lives, (kept, &[]), || {
                made.set(made.get() + 1);
                kept_plan(&lives, kept, &[])
            });
            within_slack(got, slack)
        };
        // Every offset kept from a plan of the same arrays: that plan again.
        let plan = greedy_by_size_around(&lives, &[]);
        let all: Vec<Option<usize>> = plan.offsets.iter().copied().map(Some).collect();
        let got = try_kept(&all, usize::MAX);
        assert_eq!(got, around_kept(&lives, &all, &[], usize::MAX));
        assert!(got.is_some());
        assert_eq!(try_kept(&all, usize::MAX), got);
        assert_eq!(made.get(), 1, "the same try made twice");
        // One array kept far above the others: no plan within no slack, none again, and with
        // all the slack the plan made for the first try (a cache's most held bytes, which the
        // slack follows, grew a little).
        let mut far = vec![None; lives.len()];
        far[0] = Some(1 << 30);
        assert_eq!(try_kept(&far, 0), None);
        assert_eq!(try_kept(&far, 0), None);
        let wide = try_kept(&far, usize::MAX);
        assert_eq!(wide, around_kept(&lives, &far, &[], usize::MAX));
        assert!(wide.is_some());
        assert_eq!(made.get(), 2, "the same try made again");
        assert_eq!(try_kept(&all, usize::MAX), got);
        assert_eq!(made.get(), 2);
    }

    #[test]
    fn ranges_taken_merged_give_the_plans_they_gave_apart() {
        assert_eq!(
            merged([5..9, 0..2, 2..3, 7..12, 14..14, 20..21]),
            [0..3, 5..12, 20..21]
        );
        assert!(merged(std::iter::empty()).is_empty());
        let mut rng = fastrand::Rng::with_seed(29);
        let mut fewer = 0;
        for case in 0..500 {
            let n = rng.usize(1..80);
            let mut lives = random_lives(&mut rng, n, false);
            lives.iter_mut().for_each(|l| l.bytes = l.bytes.max(ALIGN));
            // Ranges that touch, overlap or stand apart, in any order.
            let taken: Vec<Range<usize>> = (0..rng.usize(0..12))
                .map(|_| {
                    let at = rng.usize(0..24) * ALIGN;
                    at..at + rng.usize(1..4) * ALIGN
                })
                .collect();
            let fewer_ranges = merged(taken.clone());
            fewer += usize::from(fewer_ranges.len() < taken.len());
            assert_eq!(
                greedy_by_size_around(&lives, &taken),
                greedy_by_size_around(&lives, &fewer_ranges),
                "case {case}"
            );
        }
        assert!(fewer > 100, "{fewer} cases merged ranges");
    }

    #[test]
    fn the_least_footprint_around_ranges_taken_counts_those_below_it() {
        // Nothing taken: the peak live bytes.
        assert_eq!(least_footprint(100, &[]), 100);
        // A range above the peak's bytes costs nothing; one below them, its bytes.
        assert_eq!(least_footprint(100, std::slice::from_ref(&(200..300))), 100);
        assert_eq!(least_footprint(100, std::slice::from_ref(&(50..300))), 350);
        // A range reached only once the footprint grew past another's; overlaps counted once.
        assert_eq!(least_footprint(100, &[104..110, 90..95]), 111);
        assert_eq!(least_footprint(100, &[10..30, 20..40, 35..36]), 130);
        assert_eq!(least_footprint(100, std::slice::from_ref(&(5..5))), 100);
        // Every plan's footprint is at least it.
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..200 {
            let lives = random_lives(&mut rng, 12, false);
            let taken: Vec<Range<usize>> = (0..rng.usize(0..4))
                .map(|_| {
                    let start = rng.usize(0..4096);
                    start..start + rng.usize(0..1024)
                })
                .collect();
            let plan = greedy_by_size_around(&lives, &taken);
            assert!(plan.footprint >= least_footprint(peak_live(&lives), &taken));
        }
    }

    #[test]
    fn arrays_are_never_placed_over_ranges_taken_throughout() {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut moved = 0;
        for case in 0..1000 {
            let n = rng.usize(0..120);
            let lives = random_lives(&mut rng, n, false);
            let fixed: Vec<Range<usize>> = (0..rng.usize(1..4))
                .map(|_| {
                    let at = rng.usize(0..16) * ALIGN;
                    at..at + rng.usize(1..3) * ALIGN
                })
                .collect();
            let plan = greedy_by_size_around(&lives, &fixed);
            for (i, l) in lives.iter().enumerate() {
                let (lo, hi) = (plan.offsets[i], plan.offsets[i] + l.bytes);
                if l.bytes > 0 {
                    assert!(
                        fixed.iter().all(|r| hi <= r.start || r.end <= lo),
                        "case {case}: array {i} at {lo}..{hi} over {fixed:?}"
                    );
                }
                for (j, m) in lives.iter().enumerate().skip(i + 1) {
                    let (a, b) = (plan.offsets[j], plan.offsets[j] + m.bytes);
                    assert!(
                        l.bytes == 0 || m.bytes == 0 || !l.overlaps(m) || hi <= a || b <= lo,
                        "case {case}: arrays {i} and {j} overlap"
                    );
                }
            }
            let order = size_order(&lives);
            let overlaps = Overlaps::of(&lives);
            for best_fit in [true, false] {
                assert_eq!(
                    place(&lives, &order, &overlaps, best_fit, &fixed),
                    by_hand_around(&lives, &order, best_fit, &fixed),
                    "case {case}"
                );
            }
            moved += usize::from(plan != greedy_by_size(&lives));
        }
        assert!(moved > 100, "the ranges taken moved arrays ({moved})");
    }

    /// Fewer than `most` random arrays already placed, by a plan of their own (so that they are
    /// apart): the plan, and each array with its offset.
    fn random_placed(rng: &mut fastrand::Rng, most: usize) -> (Plan, Vec<(Lifetime, usize)>) {
        let n = rng.usize(0..most);
        let early = random_lives(rng, n, false);
        let plan = greedy_by_size(&early);
        let placed = early
            .into_iter()
            .zip(plan.offsets.iter().copied())
            .collect();
        (plan, placed)
    }

    #[test]
    fn arrays_placed_among_others_take_the_smaller_of_best_fit_and_first_fit() {
        let mut rng = fastrand::Rng::with_seed(13);
        let mut first_smaller = 0;
        for case in 0..1000 {
            let (_, placed) = random_placed(&mut rng, 24);
            let n = rng.usize(1..64);
            let lives = random_lives(&mut rng, n, false);
            let all = with_placed(&lives, &placed);
            let plan = among(&all, &lives, &placed);
            // Each fit alone, in the same order (those placed first, at their offsets).
            let mut order: Vec<usize> = (0..placed.len()).collect();
            order.extend(size_order(&lives).into_iter().map(|i| i + placed.len()));
            let at: Vec<usize> = placed.iter().map(|&(_, at)| at).collect();
            let fit = |best| place_after(&all, &order, &Overlaps::of(&all), best, &[], &at);
            let (best, first) = (fit(true), fit(false));
            assert_eq!(
                plan.footprint,
                best.footprint.min(first.footprint),
                "case {case}"
            );
            first_smaller += usize::from(first.footprint < best.footprint);
        }
        assert!(
            first_smaller > 10,
            "first fit was smaller {first_smaller} times"
        );
    }

    #[test]
    fn arrays_placed_among_others_meet_none_while_they_live() {
        let mut rng = fastrand::Rng::with_seed(12);
        let mut reused = 0;
        for case in 0..1000 {
            let (early_plan, placed) = random_placed(&mut rng, 40);
            let early: Vec<Lifetime> = placed.iter().map(|&(l, _)| l).collect();
            let n = rng.usize(0..80);
            let lives = random_lives(&mut rng, n, false);
            let plan = greedy_by_size_among(&lives, &placed);
            assert_eq!(plan.offsets.len(), lives.len());
            // Together, one plan: every two arrays alive together apart, all in the footprint.
            let all: Vec<Lifetime> = early.iter().chain(&lives).copied().collect();
            let together = Plan {
                offsets: early_plan
                    .offsets
                    .iter()
                    .chain(&plan.offsets)
                    .copied()
                    .collect(),
                footprint: plan.footprint,
            };
            assert!(holds(&all, &together, &[]), "case {case}");
            // An array whose lifetime meets none of those placed may take their bytes.
            reused += lives.iter().zip(&plan.offsets).any(|(l, &at)| {
                l.bytes > 0
                    && placed.iter().any(|(p, o)| {
                        p.bytes > 0 && !p.overlaps(l) && at < o + p.bytes && *o < at + l.bytes
                    })
            }) as usize;
        }
        assert!(
            reused > 100,
            "arrays reuse the bytes of those placed ({reused})"
        );
    }

    #[test]
    fn arrays_kept_stay_where_they_were_and_the_moved_meet_none_while_they_live() {
        let mut rng = fastrand::Rng::with_seed(17);
        let (mut kept_plans, mut refused) = (0, 0);
        for case in 0..1000 {
            let n = rng.usize(1..120);
            let before = random_lives(&mut rng, n, false);
            let old = greedy_by_size(&before);
            // A quarter of the arrays at most grow (a decoder's attention over one token more);
            // the others keep their offsets.
            let mut lives = before.clone();
            let mut kept: Vec<Option<usize>> = old.offsets.iter().copied().map(Some).collect();
            for _ in 0..rng.usize(0..=n / 4) {
                let i = rng.usize(0..n);
                lives[i].bytes += rng.usize(1..4) * ALIGN;
                kept[i] = None;
            }
            // Bytes taken throughout above the old plan, which no array kept meets.
            let mut taken: Vec<Range<usize>> = Vec::new();
            if rng.bool() {
                let at = old.footprint + rng.usize(0..4) * ALIGN;
                taken.push(at..at + ALIGN);
            }
            let Some(plan) = around_kept(&lives, &kept, &taken, usize::MAX) else {
                panic!("case {case}: refused with no bound");
            };
            assert!(holds(&lives, &plan, &taken), "case {case}");
            for (i, at) in kept.iter().enumerate() {
                if let Some(at) = at {
                    assert_eq!(plan.offsets[i], *at, "case {case}: array {i} moved");
                }
            }
            // Held to the bound of a plan made from scratch, it is kept only within it.
            match around_kept(&lives, &kept, &taken, 0) {
                Some(within) => {
                    assert_eq!(within, plan);
                    let live = peak_live(&lives);
                    assert!(within.footprint <= least_footprint(live, &taken) + live / 32);
                    kept_plans += 1;
                }
                None => refused += 1,
            }
        }
        assert!(
            kept_plans > 100 && refused > 100,
            "{kept_plans} kept, {refused} refused"
        );
    }

    /// A dense step (most arrays meet most others: a training step's activations), its arrays
    /// of a mebibyte or two but `small` of them of one [`ALIGN`] each, spread through it.
    fn dense_lives(rng: &mut fastrand::Rng, n: usize, small: usize) -> Vec<Lifetime> {
        // Every `stride`-th array, the first `small` of them.
        let stride = n / small.max(1);
        (0..n)
            .map(|i| {
                let start = i as u32;
                let end = start + 1 + rng.u32(n as u32 / 2..n as u32);
                let bytes = if small > 0 && i % stride == 0 && i / stride < small {
                    ALIGN
                } else {
                    rng.usize(4..8) << 18
                };
                Lifetime { bytes, start, end }
            })
            .collect()
    }

    /// Whether `plan` keeps every two arrays alive together apart, and every array clear of
    /// the ranges `taken`.
    fn holds(lives: &[Lifetime], plan: &Plan, taken: &[Range<usize>]) -> bool {
        let range = |i: usize| plan.offsets[i]..plan.offsets[i] + lives[i].bytes;
        let apart = |a: &Range<usize>, b: &Range<usize>| a.end <= b.start || b.end <= a.start;
        (0..lives.len()).all(|i| {
            lives[i].bytes == 0
                || (plan.offsets[i] + lives[i].bytes <= plan.footprint
                    && taken.iter().all(|t| apart(&range(i), t))
                    && (i + 1..lives.len()).all(|j| {
                        lives[j].bytes == 0
                            || !lives[i].overlaps(&lives[j])
                            || apart(&range(i), &range(j))
                    }))
        })
    }

    #[test]
    fn a_dense_steps_smallest_arrays_are_stacked_on_top_of_the_rest() {
        let mut rng = fastrand::Rng::with_seed(3);
        let lives = dense_lives(&mut rng, 300, 100);
        assert!(matches!(Overlaps::of(&lives), Overlaps::Scan), "dense");
        assert_eq!(stacked_alone(&lives), 100);
        // Too few small arrays are placed with the rest (their stack is not worth it).
        let few = dense_lives(&mut rng, 300, MIN_STACKED - 1);
        let plan = greedy_by_size(&few);
        let overlaps = Overlaps::of(&few);
        let within = peak_live(&few) + peak_live(&few) / FIRST_FIT_WITHIN;
        let hint = Cell::default();
        assert_eq!(plan, plan_around(&few, &overlaps, &[], (within, 0), &hint));
    }

    #[test]
    fn a_sparse_steps_smallest_arrays_are_stacked_on_top_of_the_rest_too() {
        let mut rng = fastrand::Rng::with_seed(4);
        // 300 arrays, each alive for 1-4 ticks (a detector's inference step), every third one
        // of one [`ALIGN`], the others of 16-32 MiB.
        let lives: Vec<Lifetime> = (0..300u32)
            .map(|i| Lifetime {
                bytes: if i % 3 == 0 {
                    ALIGN
                } else {
                    rng.usize(4..8) << 22
                },
                start: i,
                end: i + 1 + rng.u32(0..4),
            })
            .collect();
        assert!(
            matches!(Overlaps::of(&lives), Overlaps::Listed { .. }),
            "sparse"
        );
        assert_eq!(stacked_alone(&lives), 100);
    }

    #[test]
    fn a_long_step_whose_arrays_meet_a_small_share_of_it_lists_its_pairs() {
        let mut rng = fastrand::Rng::with_seed(5);
        // A generation loop as one step: 8,000 arrays alive a few ticks each, and 64 caches of
        // keys and values made through it and alive to its end: 35 pairs a lifetime, past 32,
        // but under a [`DENSE_SHARE`]th of the step.
        let n = 8000u32;
        let lives: Vec<Lifetime> = (0..n)
            .map(|i| Lifetime {
                bytes: rng.usize(1..64) * ALIGN,
                start: i,
                end: if i % (n / 64) == 0 {
                    n
                } else {
                    i + 1 + rng.u32(0..8)
                },
            })
            .collect();
        let pairs = pairs_about(&lives).unwrap();
        assert!(pairs > lives.len() * DENSE && pairs < lives.len() * lives.len() / DENSE_SHARE);
        assert!(matches!(Overlaps::of(&lives), Overlaps::Listed { .. }));
        // As many arrays, each meeting half the step: dense, scanned.
        let dense = dense_lives(&mut rng, n as usize, 0);
        assert!(matches!(Overlaps::of(&dense), Overlaps::Scan));
    }

    #[test]
    fn a_long_steps_plan_is_its_first_try_alone() {
        let mut rng = fastrand::Rng::with_seed(9);
        let lives = random_lives(&mut rng, LONG_STEP + 1, false);
        let overlaps = Overlaps::of(&lives);
        let by_size = size_order(&lives);
        let by = |t| placed(t, &lives, &by_size, &overlaps, &[]);
        // Another try would place this step in less.
        let smallest = Try::ALL.map(|t| by(t).footprint).into_iter().min();
        assert!(smallest < Some(by(Try::InOrder).footprint));
        let first = Hint {
            first: Try::InOrder,
            ..Hint::default()
        };
        let hint = Cell::new(first);
        // No plan within the bound (0): a shorter step would make every try.
        let plan = plan_around(&lives, &overlaps, &[], (0, 0), &hint);
        assert_eq!(plan, by(Try::InOrder));
        assert_eq!(hint.get(), first, "nothing learned of the tries not made");
    }

    /// Checks that [`greedy_by_size`] stacks the arrays of `lives` of one [`ALIGN`] (and only
    /// those) on top of the rest, one after another in the order of the step, and places the
    /// rest as it would alone; returns how many are stacked.
    fn stacked_alone(lives: &[Lifetime]) -> usize {
        let small: Vec<usize> = (0..lives.len())
            .filter(|&i| lives[i].bytes == ALIGN)
            .collect();
        assert_eq!(stacked(lives, peak_live(lives)), small);
        let plan = greedy_by_size(lives);
        assert!(holds(lives, &plan, &[]));
        let at: Vec<usize> = small.iter().map(|&i| plan.offsets[i]).collect();
        let top = stacked_on_top(lives, &plan.offsets, &at, plan.footprint);
        let rest: Vec<Lifetime> = lives.iter().filter(|l| l.bytes > ALIGN).copied().collect();
        assert_eq!(greedy_by_size(&rest).footprint, top);
        small.len()
    }

    #[test]
    fn a_dense_steps_smallest_arrays_placed_among_others_are_stacked_on_top_of_all() {
        let mut rng = fastrand::Rng::with_seed(5);
        let step = dense_lives(&mut rng, 300, 100);
        // The step's first 40 arrays were made already, at the offsets of its plan; the rest
        // (60 of them small) is placed among them.
        let (early, lives) = step.split_at(40);
        let early_plan = greedy_by_size(early);
        let placed: Vec<(Lifetime, usize)> =
            early.iter().copied().zip(early_plan.offsets).collect();
        let plan = greedy_by_size_among(lives, &placed);
        let together = Plan {
            offsets: placed
                .iter()
                .map(|&(_, at)| at)
                .chain(plan.offsets.clone())
                .collect(),
            footprint: plan.footprint,
        };
        assert!(holds(&step, &together, &[]));
        let small: Vec<usize> = (0..lives.len())
            .filter(|&i| lives[i].bytes == ALIGN)
            .collect();
        assert!(small.len() >= MIN_STACKED, "{} small", small.len());
        // On top of every other array, those placed before included, one after another.
        let at: Vec<usize> = small.iter().map(|&i| plan.offsets[i]).collect();
        stacked_on_top(&step, &together.offsets, &at, plan.footprint);
    }

    /// Checks that the arrays of one [`ALIGN`] at the offsets `small_at` are stacked one after
    /// another on top of the other arrays of `lives` (at `offsets`), up to `footprint`; returns
    /// the top of those others.
    fn stacked_on_top(
        lives: &[Lifetime],
        offsets: &[usize],
        small_at: &[usize],
        footprint: usize,
    ) -> usize {
        let top = (0..lives.len())
            .filter(|&i| lives[i].bytes > ALIGN)
            .map(|i| offsets[i] + lives[i].bytes)
            .max()
            .unwrap();
        let stack: Vec<usize> = (0..small_at.len()).map(|k| top + k * ALIGN).collect();
        assert_eq!(small_at, stack);
        assert_eq!(footprint, top + small_at.len() * ALIGN);
        top
    }

    #[test]
    fn arrays_placed_stay_in_order_of_offset_across_runs() {
        let mut rng = fastrand::Rng::with_seed(11);
        for case in 0..20 {
            let (mut runs, mut one) = (ByOffset::default(), Vec::new());
            // Few offsets, so that many arrays share one; enough arrays for several runs.
            let offsets = rng.usize(1..64);
            for n in 0..rng.usize(0..8 * RUN) {
                let at = rng.usize(0..offsets) * ALIGN;
                let life = Lifetime {
                    bytes: ALIGN,
                    start: n as u32,
                    end: n as u32 + 1,
                };
                // The one sorted vector: after those at the same offset or below.
                let k = one.partition_point(|q: &Placed| q.at <= at);
                one.insert(k, Placed { at, life });
                runs.insert(Placed { at, life });
            }
            let key = |p: &Placed| (p.at, p.life.start);
            let got: Vec<_> = runs.runs.iter().flatten().map(key).collect();
            assert_eq!(got, one.iter().map(key).collect::<Vec<_>>(), "case {case}");
            assert_eq!(runs.len(), one.len());
            assert!(runs.runs.iter().all(|r| !r.is_empty() && r.len() <= RUN));
        }
    }

    #[test]
    fn the_loops_over_the_arrays_met_find_what_the_merged_ranges_give() {
        let mut rng = fastrand::Rng::with_seed(17);
        for case in 0..200 {
            let mut runs = ByOffset::default();
            let mut all = Vec::new();
            for _ in 0..rng.usize(0..4 * RUN) {
                let start = rng.u32(0..64);
                let p = Placed {
                    at: rng.usize(0..256) * ALIGN,
                    life: Lifetime {
                        bytes: rng.usize(1..8) * ALIGN,
                        start,
                        end: start + rng.u32(1..16),
                    },
                };
                all.push(p);
                runs.insert(p);
            }
            let mut fixed: Vec<(usize, usize)> = (0..rng.usize(0..4))
                .map(|_| {
                    let at = rng.usize(0..256) * ALIGN;
                    (at, at + rng.usize(1..8) * ALIGN)
                })
                .collect();
            fixed.sort_unstable();
            let start = rng.u32(0..64);
            let me = Lifetime {
                bytes: rng.usize(1..16) * ALIGN,
                start,
                end: start + rng.u32(1..16),
            };
            for best_fit in [false, true] {
                let mut loops = Gap::new(me.bytes, best_fit);
                runs.look_at_met(&me, &mut loops, &fixed);
                // The ranges met, by offset (stable: as the runs keep them).
                all.sort_by_key(|p| p.at);
                let met = all
                    .iter()
                    .filter(|p| p.life.overlaps(&me))
                    .map(|p| (p.at, p.at + p.life.bytes));
                let mut merged = Gap::new(me.bytes, best_fit);
                merged.look_at(met, &fixed);
                assert_eq!(loops.at(), merged.at(), "case {case}, best fit {best_fit}");
            }
        }
    }

    #[test]
    fn a_stack_goes_above_the_ranges_taken_it_would_meet() {
        let mut rng = fastrand::Rng::with_seed(5);
        let mut stacks = 0;
        for case in 0..40 {
            let n = rng.usize(200..320);
            let small = rng.usize(40..120);
            let lives = dense_lives(&mut rng, n, small);
            // Ranges taken anywhere, and one where the stack would begin without it.
            let mut taken: Vec<Range<usize>> = (0..rng.usize(0..3))
                .map(|_| {
                    let at = rng.usize(0..1 << 12) * ALIGN;
                    at..at + rng.usize(1..64) * ALIGN
                })
                .collect();
            let first = lives.iter().position(|l| l.bytes == ALIGN).unwrap();
            let at = greedy_by_size_around(&lives, &taken).offsets[first];
            taken.push(at..at + rng.usize(1..8) * ALIGN);
            let plan = greedy_by_size_around(&lives, &taken);
            assert!(holds(&lives, &plan, &taken), "case {case}: {taken:?}");
            assert!(plan.footprint >= peak_live(&lives));
            stacks += usize::from(stacked(&lives, peak_live(&lives)).len() >= MIN_STACKED);
        }
        assert!(stacks > 20, "stacked in {stacks} cases");
    }

    #[test]
    fn the_pairs_alive_together_are_counted_over_the_ticks() {
        let mut rng = fastrand::Rng::with_seed(13);
        for case in 0..300 {
            let n = rng.usize(1..150);
            // One allocation a tick, as a step's (else pairs starting together count twice).
            let lives: Vec<Lifetime> = (0..n as u32)
                .map(|start| Lifetime {
                    bytes: ALIGN,
                    start,
                    end: start + 1 + rng.u32(0..n as u32),
                })
                .collect();
            let pairs = (0..n)
                .map(|i| (i + 1..n).filter(|&j| lives[i].overlaps(&lives[j])).count())
                .sum::<usize>();
            assert_eq!(pairs_about(&lives), Some(pairs), "case {case}");
            // Listed exactly when they are at most as many as allowed.
            for most in [pairs.saturating_sub(1), pairs] {
                let listed = matches!(Overlaps::listed(&lives, most), Overlaps::Listed { .. });
                assert_eq!(listed, pairs <= most, "case {case}");
            }
        }
        // Ticks far more than the lifetimes: not counted so.
        let sparse = [Lifetime {
            bytes: ALIGN,
            start: 0,
            end: 1000,
        }];
        assert_eq!(pairs_about(&sparse), None);
    }
}

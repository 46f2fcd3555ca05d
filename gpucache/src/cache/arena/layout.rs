//! A plan's positions and the check that makes it safe: where the k-th allocation of a step goes
//! in the plan's block, and whether it may go there now.
//!
//! A [`Layout`] is made from one step's [record](Rec): every position (the k-th allocation of the
//! step on the device) with its aligned size and the tick its array dropped. Positions whose
//! array outlived the step are *apart*: served outside the plan. The others get offsets from
//! [`planner::greedy_by_size`], so that two positions whose recorded lifetimes overlap never
//! share bytes (and none the bytes of an earlier step's array still alive in the block).
//!
//! A step's allocations are matched with the positions in order ([`Layout::next`]); small arrays
//! ([`SMALL`]) extra or missing in a step leave the others matched (see there).
//!
//! In a later step, position k may be served at its offset only if no array the plan placed
//! there is still alive. An array alive at tick k whose planned end is after k overlaps k's
//! planned lifetime, so the plan put it elsewhere: only arrays alive *past their planned end*
//! can be in the way. Those are few, and listed: at each tick the positions planned to end
//! there that are still alive become *overdue*, and so does every position still alive when the
//! step ends. Position k is served when it is not alive itself and its bytes overlap no overdue
//! position's. That holds whatever the step does (an array kept alive, an escape, a drop the
//! owner does not see), so a live array's memory is never handed out twice. The check is O(1)
//! on a step that follows its plan (no overdue position), O(overdue) otherwise. A step whose rest
//! is placed again around the positions alive past their planned ends, each to the step's end
//! ([`Layout::keep_rest`]), has them *cleared*: no position of that rest meets their bytes, so
//! they are in no position's way until the step ends, and the check is O(1) again.
//!
//! A step that outgrows its plan may be served the rest of the way from the plan scaled, in a
//! new block that holds none of its arrays ([`Layout::scale`]); its positions from there on may
//! be placed again, among themselves only ([`Layout::one_step`]): the positions before keep
//! offsets that later ones may share, which is safe because none of them is alive in the new
//! block or served again in the step, and the layout is never used for another step as it is
//! ([`Layout::whole_again`] makes it the plan scaled whole again, a valid plan).

use std::cell::Cell;

use crate::planner::{self, Lifetime};

/// [`Rec::end`] of an array still alive.
pub(super) const OPEN: u32 = u32::MAX;

/// No position: [`Rec::planned`] of an allocation the plan did not match.
pub(super) const NONE: u32 = u32::MAX;

/// The most positions a step records; allocations past them are served apart, and the step is
/// not planned (a scope that never exits must not grow its record without bound).
pub(super) const MAX_POSITIONS: u32 = 1 << 20;

/// [`Margin`]'s unit: a 4096th.
const MARGIN_UNIT: u32 = 4096;

/// How much more than the ratio in which a step grew a plan scaled for it takes (see
/// [`Layout::scale`]), in [`MARGIN_UNIT`]s: a 64th at first (the ratio of aligned sizes is not
/// quite the ratio of the arrays), more once a scaled step's array was found larger than its
/// place ([`Margin::learned`]), at most an eighth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::cache) struct Margin(u32);

impl Default for Margin {
    fn default() -> Margin {
        Margin(MARGIN_UNIT / 64)
    }
}

impl Margin {
    /// `x` with the margin added.
    fn of(self, x: u128) -> u128 {
        x + x * u128::from(self.0) / u128::from(MARGIN_UNIT)
    }

    /// The margin after an array of `size` aligned bytes was larger than its place of `place`
    /// bytes in a plan scaled with this one: the one that would have held it (this one times
    /// the array's ratio to its place, rounded up), when the array lacked at most an eighth of
    /// its place (more says it is another array than the position's, not the same one grown in
    /// another ratio); an eighth at most. A step's arrays do not all grow in one ratio (a
    /// convolution's output length is not quite proportional to its input's), and the scale
    /// is taken from the first ones: wav2vec2 on clips of varying length missed by 1.6% at its
    /// second larger step, then its 300 MB feature map by 0.6% at a later one, which took a
    /// block of its own beside the scaled one (1.367x of its peak live bytes; 1.085x so).
    pub(super) fn learned(self, size: usize, place: usize) -> Margin {
        if place == 0 || size <= place || size - place > place / 8 {
            return self;
        }
        let unit = u128::from(MARGIN_UNIT);
        let held = ((unit + u128::from(self.0)) * size as u128).div_ceil(place as u128) - unit;
        let most = MARGIN_UNIT / 8;
        Margin(u32::try_from(held).map_or(most, |m| m.min(most)))
    }
}

/// A plan scaled for the rest of a step is placed again when the bytes it keeps for arrays made
/// before (not in its block) are more than this fraction of its footprint: see [`Layout::scale`].
const REST_WASTE: usize = 32;

/// The most positions planned apart that one allocation skips to find its own.
const MAX_SKIP: u32 = 256;

/// The fewest positions apart in a row, none recurring, that an allocation skips whatever its
/// size (an optimizer's state, made in the first step only): see [`Layout::skips_run`].
const STATE_RUN: u32 = 8;

/// The most positions such a run may hold: Adam's state of 8192 parameter tensors. (Within
/// [`MAX_SKIP`], T5-small's 262, two for each of its 131 tensors, were matched one by one with
/// the next step's temporaries of its optimizer, which all went apart: 132 device allocations
/// in its second step, and 1.086x of its peak live bytes; 1.001x with the run skipped whole.)
const MAX_STATE_RUN: u32 = 1 << 14;

/// Arrays of at most this many aligned bytes are *small*: a scalar, a few indices. How many a
/// step makes varies where its larger arrays' do not (cuDNN's empty workspaces, a loss's
/// reductions, the shapes of a batch): one more or one fewer shifts every later allocation
/// off its position. So a small array where the plan expects a much larger one is *extra*
/// (served apart, the plan's positions waiting for the next allocation), and small positions
/// the step does not make are skipped; see [`Layout::next`].
pub(super) const SMALL: usize = 2 * planner::ALIGN;

/// Steps whose counts of arrays larger than [`SMALL`] differ by more than this fraction of the
/// larger count are of different kinds ([`Layout::same_kind`]): the layers they run differ (a
/// convolution's algorithm, chosen by cuDNN for the batch, with or without a workspace; a
/// network whose depth depends on its input), and a plan merged from both, position by
/// position, matches neither.
const KIND_COUNT: usize = 64;

/// A small array where a position expects at least this many times [`SMALL`] is extra
/// (expected: the position's size scaled by the step's first allocation).
const SMALL_MISMATCH: u128 = 4;

/// The most by which a step's first allocation may differ from the plan's first position for
/// the plan to tell extra and missing small arrays by it (more: a step of another kind, a
/// decoding step matched with a prompt's plan). A batch of 1 to 64 stays within it.
const SCALES: u128 = 64;

/// The largest position a larger allocation skips as missing from the step: see [`MISSING`].
const SKIPPED: usize = 16 << 10;

/// A position of at most [`SKIPPED`] bytes whose expected size is less than the allocation's by
/// this factor is missing from the step (a quadratic size, attention scores, grows by the
/// square of the first allocation's ratio: by 32 times more on a sequence 32 times longer).
/// An allocation larger than its position by more than this factor is another array than the
/// position's: at a placed position, at the step's scale ([`Layout::another_array`]); at a
/// position apart, than its recorded size (`DeviceArena::apart_capacity`).
pub(super) const MISSING: u128 = 64;

/// A plan made from a step aligned with the plan before it keeps the old offsets of the
/// positions whose lifetime and size did not change when at most this fraction of its positions
/// changed ([`Layout::kept_in`]).
const MOVED_AT_MOST: usize = 4;

/// Such a plan is kept when it is at most this fraction of the most the cache has held above
/// the bound at which a plan made from scratch stops trying other ways (a 32nd above the least
/// footprint).
const KEPT_SLACK: usize = 64;

/// One allocation of a step as recorded: its aligned size, the tick before which it dropped
/// ([`OPEN`] while alive), and the plan's position it was matched with ([`NONE`] if none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Rec {
    pub(super) bytes: usize,
    pub(super) end: u32,
    pub(super) planned: u32,
}

/// One position of a plan.
#[derive(Clone, Copy, Debug)]
struct Spot {
    offset: usize,
    /// The most aligned bytes the position may take; for a position apart, the recorded size.
    size: usize,
    /// The tick its array is planned to drop before.
    end: u32,
    /// Outlived its step in the recorded step: served apart.
    apart: bool,
    /// What the plans before say of its array beyond the recorded step.
    past: Past,
    /// Its array (served from the plan) is alive, or its bytes are still taken.
    live: bool,
    /// Alive past its planned end: listed in [`Layout::overdue`].
    overdue: bool,
    /// The step's allocation (its index in the record) served here this step.
    rec: u32,
    /// The [`Layout::epoch`] of the step that served it last.
    epoch: u32,
    /// The aligned size of the array served here last by [`Layout::hit`], and the tick it
    /// dropped at ([`OPEN`] while alive, or dropped elsewhere than [`Layout::dropped_now`]):
    /// its entry in the step's record until written there ([`Layout::served`]).
    got: usize,
    gone: u32,
    /// How many positions placed in the block are planned to drop before the allocation at
    /// this position's tick (their end at most its position): while a step is served in order,
    /// the position may be handed out once as many arrays dropped ([`Layout::hit`]). Stored
    /// with the position, so that the hit path reads one entry (it fits the spot's padding).
    due: u32,
}

// A spot is read on every planned hit and drop: growing it past 48 bytes shows up here.
const _: () = assert!(std::mem::size_of::<Spot>() == 48);

/// What the plans before a position's say of its array beyond the step it was recorded in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Past {
    /// Nothing more.
    Nothing,
    /// Apart, and matched with a position apart of the plan before: an array that outlives
    /// every step (a cache of keys and values), never skipped however its size changes.
    Recurs,
    /// Placed, though its array outlived one of the two steps this plan and the one before it
    /// were made from and not the other ([`HeldOver`]).
    HeldOver,
}

impl Spot {
    /// Apart, and matched with a position apart of the plan before ([`Past::Recurs`]).
    fn recurs(&self) -> bool {
        self.past == Past::Recurs
    }

    /// Placed, its array kept past some steps and not others ([`Past::HeldOver`]).
    fn held_over(&self) -> bool {
        self.past == Past::HeldOver
    }

    /// Placed in the block: not apart, and of some size.
    fn placed(&self) -> bool {
        !self.apart && self.size > 0
    }

    /// Apart and not recurring: what a first step's optimizer state looks like, which later
    /// steps do not make ([`Layout::skips_run`], [`Layout::in_state_run`]).
    fn is_state(&self) -> bool {
        self.apart && !self.recurs()
    }

    /// The planned lifetime of position `k`, this spot: from its allocation to its end (at
    /// least the next allocation).
    fn lifetime(&self, k: u32) -> Lifetime {
        Lifetime {
            bytes: self.size,
            start: k,
            end: self.end.max(k + 1),
        }
    }

    /// Position `p`, this spot, if still alive: overdue, and listed in `list` (once).
    #[inline]
    fn make_overdue(&mut self, p: u32, list: &mut Vec<u32>) {
        if self.live && !self.overdue {
            self.overdue = true;
            list.push(p);
        }
    }
}

/// What the plan says of one allocation.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Serve {
    /// At this offset of the block.
    At(usize),
    /// Apart, as planned: the recorded array outlived its step.
    Apart,
    /// Not from the plan: larger than planned, past the plan's end, or its bytes are taken.
    Diverged,
    /// A small array the plan does not hold (an extra one, or one past the plan's end): served
    /// apart, the step staying on its plan.
    Extra,
    /// A position over bytes an array of an earlier step still holds, which the plan was not
    /// placed around ([`Layout::block`]): served apart, the step staying on its plan.
    Blocked,
}

/// The positions of a plan, their offsets, and which are alive.
#[derive(Debug)]
pub(super) struct Layout {
    spots: Vec<Spot>,
    /// Every position with its planned end, `(end, position)`, by end.
    by_end: Vec<(u32, u32)>,
    /// The entries of `by_end` before this one have been processed this step (their positions
    /// are overdue if they were still alive).
    ended: u32,
    /// The step has so far served each position at its own tick, from the first, and no array
    /// served this step dropped before its planned end ([`Layout::hit`]).
    pub(super) in_order: bool,
    /// How many arrays served this step at their positions have dropped.
    drops: u32,
    /// Positions alive past their planned end.
    overdue: Vec<u32>,
    /// Positions alive past their planned end that the rest of the step, placed again around
    /// them, keeps clear of ([`Layout::clear_overdue`]): in no position's way until the step
    /// ends (then overdue again).
    cleared: Vec<u32>,
    /// The rest of the step was placed again around the positions held over too, each until
    /// the step's end: one that comes to be alive past its planned end is cleared at once.
    clears_held: bool,
    /// Bytes of the block that arrays of earlier steps hold, which the plan was not placed
    /// around: no position over them is served until they are free ([`Layout::block`]).
    blocked: Vec<std::ops::Range<usize>>,
    /// The next position to match.
    cursor: u32,
    /// This step skipped positions apart, or left positions unmatched.
    pub(super) skipped: bool,
    /// The aligned size of this step's first allocation: the scale at which small arrays are
    /// told from larger ones ([`Layout::expected`]).
    step_first: usize,
    /// The block's size: the end of the highest position.
    pub(super) footprint: usize,
    /// The aligned size of the recorded step's first allocation (scaled with the plan).
    first: usize,
    /// The recorded step's allocations larger than [`SMALL`] ([`Layout::same_kind`]).
    big: usize,
    /// Made from a step that had no plan before it (the cache's first, or the first after
    /// `invalidate` or `empty_cache`): it may hold what only a first step allocates.
    pub(super) cold: bool,
    /// A step followed it from its first position to its last.
    pub(super) confirmed: bool,
    /// A step followed it from its first position to its last and kept it as it was (not
    /// planned again), and since then neither a step that took it for this preference alone
    /// nor the step after one that did so kept it failed to: what
    /// [`DeviceArena::choose_plan`] prefers between plans whose first allocations are the same
    /// size.
    pub(super) followed: bool,
    /// Whether this step took it for that preference (`TIE_TAKEN` in the arena), or the step
    /// before did and kept it (`TIE_FOLLOWED`); else 0.
    pub(super) on_tie: u8,
    /// When the rest of a step that outgrew the plan was placed again ([`Layout::scale`]): the
    /// plan scaled whole, which [`Layout::whole_again`] restores ([`Layout::one_step`]).
    whole: Option<Whole>,
    /// The plan as it was before the latest [`Layout::scale`] ([`Layout::unscale`]).
    unscaled: Option<Box<Unscaled>>,
    /// The steps it has served ([`Layout::end_step`]; wraps).
    epoch: u32,
    /// How far [`Layout::growth`] has read the step's record, and what it found there.
    growth: Cell<Growth>,
    /// The step the plan was made from, its k-th allocation matched with position k.
    made_from: Vec<Rec>,
    /// The positions held over to the step's end though the step the plan was made from
    /// dropped their arrays within it (the step after an optimizer's keeps them:
    /// [`Layout::held_over`]), each with the tick it dropped them at, by position.
    dropped_at: Vec<(u32, u32)>,
    /// Plans in a row, this one the last, made from steps aligned with the plan before them that
    /// outgrew it ([`Layout::new_around`]).
    grew_in_a_row: u32,
    /// The sizes of the step the plan before the first of those was made from (empty when
    /// `grew_in_a_row` is 0): their growth is measured from there ([`growth_ahead`]).
    grew_from: Vec<usize>,
    /// Its positions have room for their growth to go on ([`growth_ahead`]).
    ahead: bool,
}

/// What [`Layout::growth`] found in the first `read` allocations of the step's record. A
/// record only grows within a step, so the next call reads on from there: the fold over the
/// whole record at each call cost a step's length at every array served in the block's tail
/// (Mask R-CNN's long run spent 7.5% of its host time on the CPU there, its steps of 3,900
/// allocations serving 70 positions a step in the tail). Forgotten (`Growth::default()`) when
/// the positions' sizes change, when the layout is switched in, and at the step's end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Growth {
    /// The allocations of the record read.
    read: usize,
    /// The position after the last one matched.
    next: usize,
    /// The bytes asked for at the placed positions matched, and those positions' bytes.
    asked: u128,
    planned: u128,
    /// The same for the largest of those positions.
    largest: (u128, u128),
    /// The step was found not to be matched position by position.
    unmatched: bool,
}

/// A plan scaled whole, of which the rest of a step was placed again ([`Layout::scale`]): the
/// positions placed again, with their offsets and sizes in it, and its footprint.
#[derive(Debug)]
struct Whole {
    spots: Vec<(usize, usize, usize)>,
    footprint: usize,
}

/// A layout's places before it was scaled ([`Layout::unscale`]): each position's offset and
/// size, the footprint and the first allocation's size.
#[derive(Debug)]
struct Unscaled {
    spots: Vec<(usize, usize)>,
    footprint: usize,
    first: usize,
}

/// A step's sizes, in order, as one number: equal for steps that allocated the same sizes in
/// the same order (and, but for a collision, only for those).
pub(super) fn signature(record: &[Rec]) -> u64 {
    record.iter().fold(record.len() as u64, |h, r| {
        (h.rotate_left(5) ^ r.bytes as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    })
}

/// The most aligned bytes of a step's arrays alive at once, from its record (an array still
/// alive counts to the end).
pub(super) fn peak_live(record: &[Rec]) -> usize {
    peak_of(record, |_| true)
}

/// The most aligned bytes alive at once of the step's arrays that dropped within it (those
/// still alive at its end left out).
pub(super) fn peak_within(record: &[Rec]) -> usize {
    peak_of(record, |r| r.end != OPEN)
}

/// The most aligned bytes alive at once of the arrays of `record` that `counted` keeps.
fn peak_of(record: &[Rec], counted: impl Fn(&Rec) -> bool) -> usize {
    let n = record.len() as u32;
    let lives: Vec<Lifetime> = (0..n)
        .zip(record)
        .map(|(k, r)| Lifetime {
            bytes: if counted(r) { r.bytes } else { 0 },
            start: k,
            end: r.end.min(n).max(k + 1),
        })
        .collect();
    planner::peak_live(&lives)
}

/// Whether every allocation of `record` (a step so far) was matched with its own position:
/// the k-th with the k-th.
pub(super) fn aligned_so_far(record: &[Rec]) -> bool {
    (0..).zip(record).all(|(k, r)| r.planned == k)
}

/// The allocations of `record` larger than [`SMALL`].
fn big_count(record: &[Rec]) -> usize {
    record.iter().filter(|r| r.bytes > SMALL).count()
}

/// Whether two sizes are within a factor of two of each other.
fn near(a: usize, b: usize) -> bool {
    a / 2 <= b && b / 2 <= a
}

/// The share of a position's size added as room when it grew by more than a thirty-second since
/// the plan it was matched with (see [`planned_size`]).
const GROWN_ROOM: usize = 256;

/// The size a position is planned with, from its size in the recorded step and in the plan it
/// was matched with (if any): the larger, and when it grew by at most a thirty-second, room for
/// 32 more steps of that growth, at most an eighth of its size (a decoder's attention over the
/// tokens so far grows a little every step; without the room every step would outgrow its
/// plan). When it grew by more, a [`GROWN_ROOM`]th more: steps whose sizes vary come again a
/// little larger than the largest before, where the plan made from that one holds it exactly (a
/// detector's images padded to the same size, with other numbers of proposals: Faster R-CNN's
/// third step, 0.1% to 2% larger than its second, missed the second's plan by 0.3 MiB and put a
/// 115.6 MiB array apart: 1.242x of the log's peak live bytes, 1.084x with a 64th to a 512th,
/// 1.242x with a 1024th; a 256th costs BERT trained with dynamic padding 1.004x -> 1.007x, and
/// the other logs nothing but a thousandth, where a 64th or a 32nd cost 1% to 2%).
fn planned_size(bytes: usize, was: Option<usize>) -> usize {
    let room = match was {
        Some(was) if bytes > was && bytes - was <= bytes / 32 => {
            (bytes - was).saturating_mul(32).min(bytes / 8)
        }
        // Whole alignment units (none below 64 KiB), so that the room is never more than a
        // 256th of the position.
        Some(was) if bytes > was => bytes / GROWN_ROOM / planner::ALIGN * planner::ALIGN,
        Some(was) => return bytes.max(was),
        None => return bytes,
    };
    super::block::aligned(bytes.saturating_add(room)).unwrap_or(bytes)
}

/// Plans in a row made from steps that grew (each matched the plan before it position by
/// position and outgrew it) after which a plan gets room for that growth to go on
/// ([`growth_ahead`]).
const GREW_IN_A_ROW: u32 = 2;

/// The room for growth to go on: as many more steps of each position's average growth over the
/// plans in a row, at most [`GROWTH_AHEAD_PART`] of the position.
const GROWTH_AHEAD: usize = 8;

/// A position's room for its growth to go on is at most this fraction of it.
const GROWTH_AHEAD_PART: usize = 2;

/// The room for growth to go on, in all, is at most this fraction of the most the cache has
/// held: else the plan gets none.
const GROWTH_AHEAD_SHARE: usize = 32;

/// The room each position gets for its growth to go on, when a step grew at each of the
/// [`GREW_IN_A_ROW`] or more plans in a row made from it (`grew_in_a_row`, counting the one
/// being made) from the sizes of `grew_from` (the step before the first of them), to those of
/// `record` (a step aligned with them, its k-th allocation at the k-th position); `None` when
/// the step has not grown so, or when that room would be more than a [`GROWTH_AHEAD_SHARE`]th
/// of `high`, the most the cache has held.
///
/// A decoder whose attention over the tokens so far grows by more than a 32nd a step (its first
/// 32 tokens) outgrows a plan with [`planned_size`]'s room at every step, and each step was
/// planned again and its block made again: T5's decoding log, 36 plans in its 41 steps, most of
/// its host time (0.59x of CUDA's pool at threshold max on an H100). With room for eight more
/// steps of each position's growth (at most half the position): 10 plans, and 131 -> 62 device
/// allocations in the second half of its steps, for 1.388x -> 1.443x of its peak live bytes.
/// Bounded by the most the cache has held, the room is small beside what the cache holds anyway
/// (T5's plan, 0.4 MiB, beside its encoder's 24 MiB), and a large step that grew twice in a
/// row (a batch of images larger at two steps, ResNet-18's input: half its size again, 1.006x
/// -> 1.354x of its peak live bytes without the bound) gets none.
fn growth_ahead(
    record: &[Rec],
    grew_from: &[usize],
    grew_in_a_row: u32,
    high: usize,
) -> Option<Vec<usize>> {
    if grew_in_a_row < GREW_IN_A_ROW || grew_from.len() != record.len() {
        return None;
    }
    let room: Vec<usize> = record
        .iter()
        .zip(grew_from)
        .map(|(r, &from)| {
            // A position apart is no part of the plan's block.
            if r.end == OPEN {
                return 0;
            }
            let each = r.bytes.saturating_sub(from) / grew_in_a_row as usize;
            each.saturating_mul(GROWTH_AHEAD)
                .min(r.bytes / GROWTH_AHEAD_PART)
        })
        .collect();
    let total = room.iter().fold(0usize, |t, &r| t.saturating_add(r));
    (total <= high / GROWTH_AHEAD_SHARE).then_some(room)
}

/// How much of a plan may be held over: positions whose arrays outlive some steps of a kind and
/// not others, placed in the block rather than apart ([`Layout::held_over`]), at the lifetimes of
/// the steps that drop them.
///
/// Gradients accumulated over micro-batches are made by the first micro-batch of each
/// optimizer step, and kept; the next micro-batches make the same arrays, add them in and drop
/// them. Both kinds of step allocate the same sizes in the same order, so one plan serves both,
/// made from whichever came last: planned apart after the first micro-batch, the next one's
/// temporaries each took a block of the device (ResNet-50, four micro-batches a step: ten
/// device allocations at each optimizer step). Held over, the next micro-batches' temporaries
/// are served at their positions; the first micro-batch keeps its gradients there, and is
/// placed again, from the first position that meets one of them, around them
/// ([`Layout::keep_rest`]); at its end they are pinned where they are, and the next plan is
/// placed around them.
#[derive(Clone, Copy, Debug, Default)]
pub(in crate::cache) struct HeldOver {
    /// The most positions that may be held over.
    pub(super) count: usize,
    /// The most bytes they may hold.
    pub(super) bytes: usize,
}

impl HeldOver {
    /// Takes a position of `bytes` from what may be held over, if it has room.
    fn take(&mut self, bytes: usize) -> bool {
        let fits = self.count > 0 && bytes <= self.bytes;
        if fits {
            self.count -= 1;
            self.bytes -= bytes;
        }
        fits
    }
}

impl Layout {
    /// [`Layout::new_around`] with no bytes taken (tests).
    #[cfg(test)]
    pub(super) fn new(record: &[Rec], old: Option<&Layout>) -> Layout {
        Layout::new_around(record, old, &[], &Default::default(), 0, 0, &[])
    }

    /// The plan of a step recorded as `record`, for a block whose byte ranges `taken` hold
    /// arrays of earlier steps: no position is placed over them
    /// ([`planner::greedy_by_size_around`]). An allocation matched with a position of `old`
    /// takes the larger of the two sizes, so that both steps fit, when they are within a factor
    /// of two (measured on the real logs: merging positions whose sizes differ more, where the
    /// two steps' orders differ, held 1.12x and 1.49x of the peak live bytes where taking the new
    /// step's size held 1.07x and 1.21x). The planner takes `learned`, what it learned from the
    /// device's last plans (its last plans among them, given again for the same inputs), and
    /// `room`, the bytes of the block the cache holds ([`planner::Learned::plan`]).
    ///
    /// A step aligned with `old` that outgrew it, made from such a step too, and so on
    /// ([`GREW_IN_A_ROW`] plans or more in a row), gets room for its growth to go on, as long
    /// as that room is small beside `high`, the most the cache has held ([`growth_ahead`]).
    ///
    /// The allocations `held_over` gives an end are placed, not apart, to that end
    /// ([`Layout::held_over`]: for one the step kept past its end, the plan before's).
    ///
    /// A step aligned with `old` in which at most a [`MOVED_AT_MOST`]th of the positions changed
    /// (their size or planned end) keeps the others at their offsets in `old`, and only those
    /// that changed are placed, among them ([`planner::Learned::around_kept`]), when that plan
    /// holds at most a [`KEPT_SLACK`]th of `high` more than the bound at which the planner stops
    /// trying (else the step is planned from scratch). A decoder's attention grows with the
    /// tokens, a few of its arrays (T5's: 18-36 of 263), and each such plan made from scratch took
    /// 114-124 µs of its step's end on the CPU in the planner alone; kept so, the whole layout took
    /// 40-47 µs, every one within the slack, and the positions kept keep the views made at their
    /// offsets. (Within the bound alone, two of T5's seven such plans were kept: its grown arrays
    /// are the step's largest, placed at the top of the others.)
    pub(super) fn new_around(
        record: &[Rec],
        old: Option<&Layout>,
        taken: &[std::ops::Range<usize>],
        learned: &planner::Learned,
        room: usize,
        high: usize,
        held_over: &[Option<u32>],
    ) -> Layout {
        let n = record.len() as u32;
        // The same step with other sizes (a batch or a sequence of another length): its k-th
        // allocation is the plan's k-th.
        let aligned_with = old.filter(|o| o.aligned(record));
        // It outgrew a placed position of the plan: a plan in a row of plans of a growing step.
        let grew = aligned_with.filter(|o| {
            record
                .iter()
                .zip(&o.spots)
                .any(|(r, s)| !s.apart && r.end != OPEN && r.bytes > s.size)
        });
        // An aligned plan recorded as many sizes as the step has (`growth_ahead` checks it).
        let (grew_in_a_row, grew_from) = match grew {
            Some(o) => (
                o.grew_in_a_row.saturating_add(1),
                if o.grew_in_a_row == 0 {
                    o.made_from.iter().map(|r| r.bytes).collect()
                } else {
                    o.grew_from.clone()
                },
            ),
            None => (0, Vec::new()),
        };
        let ahead = growth_ahead(record, &grew_from, grew_in_a_row, high);
        let made_again = old.map_or_else(Vec::new, |o| o.state_made_again(record));
        let mut spots: Vec<Spot> = record
            .iter()
            .enumerate()
            .map(|(k, r)| {
                // The same array: in a step aligned with the plan, or within a factor of two
                // (else the steps' orders differ there, and a merged size would only waste).
                let matched = old.and_then(|o| o.spots.get(r.planned as usize));
                let was = matched
                    .filter(|s| !s.apart && (aligned_with.is_some() || near(s.size, r.bytes)));
                let held_to = held_over.get(k).copied().flatten();
                let held = held_to.is_some();
                let was = was.or(matched.filter(|_| held));
                let apart = r.end == OPEN && !held;
                let recurs =
                    apart && (matched.is_some_and(|s| s.apart) || made_again.get(k) == Some(&true));
                let ahead = ahead.as_ref().map_or(0, |room| room[k]);
                Spot {
                    offset: 0,
                    size: if apart {
                        r.bytes
                    } else {
                        let size = planned_size(r.bytes, was.map(|s| s.size));
                        super::block::aligned(r.bytes.saturating_add(ahead))
                            .map_or(size, |ahead| size.max(ahead))
                    },
                    // Kept past the step, one held over lives as the plan before placed it:
                    // a step that keeps it places its rest again ([`Layout::keep_rest`]).
                    end: match (apart, held_to) {
                        (true, _) => n,
                        (false, Some(end)) => end.min(n),
                        (false, None) => r.end.min(n),
                    },
                    apart,
                    past: if recurs {
                        Past::Recurs
                    } else if held {
                        Past::HeldOver
                    } else {
                        Past::Nothing
                    },
                    live: false,
                    overdue: false,
                    rec: NONE,
                    epoch: 0,
                    got: 0,
                    gone: OPEN,
                    due: 0,
                }
            })
            .collect();
        let dropped_at = (0..n)
            .zip(record)
            .filter_map(|(k, r)| {
                let held_to = held_over.get(k as usize).copied().flatten()?;
                (r.end != OPEN && held_to > r.end).then_some((k, r.end))
            })
            .collect();
        let placed: Vec<u32> = (0..n).filter(|&k| !spots[k as usize].apart).collect();
        let lives: Vec<Lifetime> = placed
            .iter()
            .map(|&k| spots[k as usize].lifetime(k))
            .collect();
        // A layout placed for the rest of its step only is no plan (its positions before the
        // rest may share bytes with those of the rest): nothing is kept from it.
        let plan = aligned_with
            .filter(|o| !o.one_step())
            .and_then(|o| o.kept_in(&spots, &placed, taken))
            .and_then(|kept| learned.around_kept(&lives, &kept, taken, high / KEPT_SLACK))
            .unwrap_or_else(|| learned.plan(&lives, taken, room));
        for (&k, offset) in placed.iter().zip(plan.offsets) {
            spots[k as usize].offset = offset;
        }
        // Positions by planned end (stable: by position among equal ends).
        let mut by_end: Vec<(u32, u32)> = spots
            .iter()
            .enumerate()
            .map(|(k, s)| (s.end, k as u32))
            .collect();
        by_end.sort_unstable();
        // Per tick, the positions placed that end there, then summed up to each position.
        let mut ending = vec![0; n as usize + 1];
        for s in spots.iter().filter(|s| !s.apart) {
            ending[s.end as usize] += 1;
        }
        let mut due = 0;
        for (s, ending) in spots.iter_mut().zip(ending) {
            due += ending;
            s.due = due;
        }
        Layout {
            spots,
            by_end,
            ended: 0,
            in_order: true,
            drops: 0,
            overdue: Vec::new(),
            cleared: Vec::new(),
            clears_held: false,
            blocked: Vec::new(),
            cursor: 0,
            skipped: false,
            step_first: 0,
            footprint: plan.footprint,
            first: record.first().map_or(0, |r| r.bytes),
            big: big_count(record),
            cold: false,
            confirmed: false,
            followed: false,
            on_tie: 0,
            whole: None,
            unscaled: None,
            epoch: 0,
            growth: Cell::default(),
            made_from: (0..)
                .zip(record)
                .map(|(k, r)| Rec { planned: k, ..*r })
                .collect(),
            dropped_at,
            grew_in_a_row,
            grew_from,
            ahead: ahead.is_some(),
        }
    }

    /// Which allocations of `record` the next plan holds over, within `budget` ([`HeldOver`]),
    /// each with the end it is planned to drop before: each that outlived the step at a position
    /// this plan placed (its array pinned in the block now; the position's end, or the tick the
    /// step this plan was made from dropped it at, when the plan held it to its end all the
    /// same), or dropped within it at a position this plan held over (with `to_end`, to the
    /// step's end: the step dropped the arrays kept there before, and the next keeps them
    /// again, a first micro-batch after an optimizer's step) or had outlive its step (its own
    /// end); none when the step and the plan are not aligned as far as both go (the k-th
    /// allocation at the k-th position: one may be longer, an optimizer's step after the
    /// backward pass), or the step outgrew a position there (a step of other sizes, whose
    /// arrays kept past it are another kind's: a decoder's keys and values of the encoder's
    /// output).
    pub(super) fn held_over(
        &self,
        record: &[Rec],
        mut budget: HeldOver,
        to_end: bool,
    ) -> Vec<Option<u32>> {
        let n = record.len() as u32;
        let common = record.len().min(self.spots.len());
        let fits = record
            .iter()
            .zip(&self.spots)
            .all(|(r, s)| r.bytes <= s.size);
        if !aligned_so_far(&record[..common]) || !fits {
            return Vec::new();
        }
        (0..)
            .zip(record.iter().zip(&self.spots))
            .map(|(k, (r, s))| {
                let end = if r.end == OPEN {
                    s.placed().then(|| self.dropped_end(k).unwrap_or(s.end))
                } else if to_end && s.held_over() {
                    Some(n)
                } else {
                    (s.held_over() || s.is_state()).then_some(r.end)
                };
                end.filter(|_| budget.take(r.bytes))
            })
            .collect()
    }

    /// The tick the step this plan was made from dropped position `k`'s array at, if the plan
    /// holds it over to the step's end all the same ([`Layout::dropped_at`]).
    fn dropped_end(&self, k: u32) -> Option<u32> {
        let i = self.dropped_at.binary_search_by_key(&k, |&(p, _)| p).ok()?;
        Some(self.dropped_at[i].1)
    }

    /// The offsets of this plan that a plan of `spots` (made from a step aligned with it) may
    /// keep, for its positions `placed`: each position placed in both with the same lifetime and
    /// size, whose bytes meet no range `taken`; `None` when more than a [`MOVED_AT_MOST`]th of
    /// them would move.
    fn kept_in(
        &self,
        spots: &[Spot],
        placed: &[u32],
        taken: &[std::ops::Range<usize>],
    ) -> Option<Vec<Option<usize>>> {
        let kept: Vec<Option<usize>> = placed
            .iter()
            .map(|&k| {
                let (new, old) = (&spots[k as usize], self.spots.get(k as usize)?);
                let (lo, hi) = (old.offset, old.offset + old.size);
                (!old.apart
                    && old.lifetime(k) == new.lifetime(k)
                    && !taken.iter().any(|r| r.start < hi && lo < r.end))
                .then_some(old.offset)
            })
            .collect();
        let moved = kept.iter().filter(|at| at.is_none()).count();
        (moved <= placed.len() / MOVED_AT_MOST).then_some(kept)
    }

    /// Whether the step recorded as `record` is aligned with the plan: the same step with other
    /// sizes, its k-th allocation matched with the k-th position, as many as there are.
    fn aligned(&self, record: &[Rec]) -> bool {
        self.spots.len() == record.len() && aligned_so_far(record)
    }

    /// Whether the step recorded as `record` goes on growing the step the plan was made from: it
    /// is aligned with the plan, which was made from a step that outgrew the plan before it. Of
    /// the same kind whatever its count of large arrays: a decoder's arrays that grow with the
    /// tokens cross the small arrays' bound one after the other ([`Layout::same_kind`] counts
    /// those above it), and T5's decoding steps were planned from scratch every few steps,
    /// each time losing what the plans in a row had learned of their growth.
    pub(super) fn grows_on(&self, record: &[Rec]) -> bool {
        self.grew_in_a_row > 0 && self.aligned(record)
    }

    /// Whether the plan has room for its step's growth to go on ([`growth_ahead`]).
    pub(super) fn has_room_ahead(&self) -> bool {
        self.ahead
    }

    /// Whether position `k` is placed in the plan's upper half (the middle of its range above
    /// the middle of the footprint); not a position apart, nor one past the plan's end.
    pub(super) fn upper(&self, k: u32) -> bool {
        self.spots
            .get(k as usize)
            .is_some_and(|s| !s.apart && s.offset + s.size / 2 > self.footprint / 2)
    }

    /// A hash of the layout's arrangement: every position's offset, in order (equal for two
    /// layouts that place every position alike). The key of its positions' idle views while
    /// they are stashed (`Loose::stash`).
    pub(super) fn offsets_key(&self) -> u64 {
        let at = |s: &Spot| {
            if s.placed() {
                s.offset as u64
            } else {
                u64::MAX
            }
        };
        (self.spots.iter()).fold(self.spots.len() as u64, |h, s| planner::mix(h, at(s)))
    }

    /// The number of positions.
    pub(super) fn len(&self) -> usize {
        self.spots.len()
    }

    /// The size of the recorded step's first allocation (0 for an empty plan), in the ratio the
    /// plan was scaled: what tells the kind of step a plan was made for, and the largest of that
    /// kind it holds (its first position may be planned larger).
    pub(super) fn first_size(&self) -> usize {
        self.first
    }

    /// Whether the step recorded as `record` is of the kind this plan was made for, to be planned
    /// as its next version (else the plan is kept for steps of its own kind): it made as many
    /// arrays larger than [`SMALL`] as the recorded step, but for a [`KIND_COUNT`]th, and as
    /// many allocations, or a first one within a factor of two of the recorded step's first.
    pub(super) fn same_kind(&self, record: &[Rec]) -> bool {
        let big = big_count(record);
        big.abs_diff(self.big) * KIND_COUNT <= big.max(self.big) && self.same_size_or_count(record)
    }

    fn same_size_or_count(&self, record: &[Rec]) -> bool {
        self.spots.len() == record.len()
            || record
                .first()
                .is_some_and(|r| near(r.bytes, self.first_size()))
    }

    /// Processes the planned ends of the ticks up to `t`: positions planned to end there that
    /// are still alive become overdue. On a step that follows its plan, about one position a
    /// tick: a load and a compare or two.
    #[inline(always)]
    fn tick_to(&mut self, t: u32) {
        while let Some(&(end, p)) = self.by_end.get(self.ended as usize)
            && end <= t
        {
            self.ended += 1;
            if self.spots.get(p as usize).is_some_and(|s| s.live) {
                self.make_overdue(p);
            }
        }
    }

    #[inline]
    fn make_overdue(&mut self, p: u32) {
        let s = &mut self.spots[p as usize];
        let list = if self.clears_held && s.held_over() {
            &mut self.cleared
        } else {
            &mut self.overdue
        };
        s.make_overdue(p, list);
    }

    /// The rest of the step was placed again around the positions alive past their planned
    /// end, and the positions held over, each until the step's end ([`Layout::keep_rest`],
    /// [`Layout::alive_before`]): they are in no position's way until then, and the step's next positions are served as if none were
    /// overdue (by the hit path too, which serves none while one is). Gradients kept by the
    /// first micro-batch of an optimizer step sent every allocation after the first kept one
    /// down the slow path, which looked at each of them (ViT-S: 446 of 644 allocations, past
    /// 152 gradients).
    fn clear_overdue(&mut self) {
        self.cleared.append(&mut self.overdue);
        self.clears_held = true;
    }

    /// The positions cleared ([`Layout::clear_overdue`]) are overdue again: the step ended, or
    /// the layout is placed as it was before its rest was placed again.
    fn unclear(&mut self) {
        self.overdue.append(&mut self.cleared);
        self.clears_held = false;
    }

    /// Matches the step's next allocation, of `size` aligned bytes and index `rec` in the
    /// step's record, with the plan's next position: positions apart that it cannot be are
    /// skipped (the recorded step allocated something there that this one does not), a position
    /// placed is taken even when it does not fit (the same allocation, grown). Returns what the
    /// plan says and the position ([`NONE`] past the plan's end). [`Serve::At`] marks the
    /// position alive.
    ///
    /// Small arrays are told at the step's scale ([`Layout::expected`]): a small array where the
    /// plan expects one more than [`SMALL_MISMATCH`] times [`SMALL`] is [`Serve::Extra`], and
    /// the position waits for the next allocation (unless a small position apart comes soon:
    /// [`Layout::apart_soon`]); a position of at most [`SKIPPED`] bytes expected at less than
    /// 1/[`MISSING`] of the allocation is skipped, as one the step does not make. Neither marks
    /// the step as having skipped positions (no reason to plan it again). A small array past
    /// the plan's end is extra too.
    #[inline]
    pub(super) fn next(&mut self, size: usize, rec: u32) -> (Serve, u32) {
        let got = self.match_next(size, rec);
        // Served at a position of the block ([`Layout::serve`] tells whether in order) or not.
        self.in_order &= matches!(got.0, Serve::At(_));
        got
    }

    /// [`Layout::next`], but for the order of positions served.
    fn match_next(&mut self, size: usize, rec: u32) -> (Serve, u32) {
        if rec == 0 {
            self.step_first = size;
        }
        let small = size <= SMALL;
        let mut c = self.cursor;
        loop {
            self.tick_to(c);
            let Some(s) = self.spots.get(c as usize) else {
                return (if small { Serve::Extra } else { Serve::Diverged }, NONE);
            };
            if s.apart {
                if !s.recurs()
                    && let Some(p) = self.skips_run(c, size)
                {
                    self.skipped = true;
                    c = p;
                    continue;
                }
                if !s.recurs() && !near(size, s.size) && self.skips_to(c, size) {
                    self.skipped = true;
                    c += 1;
                    continue;
                }
                self.cursor = c + 1;
                return (Serve::Apart, c);
            }
            if s.size <= SKIPPED && self.another_array(s.size, size) {
                // A position this step does not make (much smaller than this allocation at
                // the step's scale): a later one is this allocation's.
                c += 1;
                continue;
            }
            if small
                && s.size > SMALL
                && self
                    .expected(s.size)
                    .is_some_and(|e| e > SMALL_MISMATCH * SMALL as u128)
                && !self.apart_soon(c, size)
            {
                // An extra small array, where the recorded step made a larger one: the position
                // waits for the next allocation.
                return (Serve::Extra, NONE);
            }
            self.cursor = c + 1;
            return (self.serve(c, size, rec), c);
        }
    }

    /// The size a position of `size` bytes is expected to hold in this step: scaled by the
    /// ratio of the step's first allocation to the plan's first position. `None` when they
    /// differ by more than [`SCALES`] (a step of another kind), or either is small.
    fn expected(&self, size: usize) -> Option<u128> {
        // The first position's size, as planned: merged from several steps, the positions'
        // sizes are the largest of each, and so is the first's.
        let first = self.spots.first().map_or(0, |s| s.size) as u128;
        let now = self.step_first as u128;
        let small = SMALL as u128;
        (first > small && now > small && now * SCALES >= first && now <= first * SCALES)
            .then(|| size as u128 * now / first)
    }

    /// Whether an allocation of `size` bytes matched with a position of `planned` bytes is
    /// another array than the position's: more than [`MISSING`] times the size expected there
    /// at the step's scale ([`Layout::expected`]; a first step's cuBLAS workspace, or a small
    /// array only a first step makes, where a later step makes an embedding's gradient).
    pub(super) fn another_array(&self, planned: usize, size: usize) -> bool {
        self.expected(planned)
            .is_some_and(|e| e.saturating_mul(MISSING) < size as u128)
    }

    /// Whether position `k` is apart, not recurring, in a run of at least [`STATE_RUN`] such
    /// positions: a first step's optimizer state, which later steps do not make
    /// ([`Layout::skips_run`]).
    pub(super) fn in_state_run(&self, k: u32) -> bool {
        let k = k as usize;
        let state = |s: &&Spot| s.is_state();
        if !self.spots.get(k).is_some_and(Spot::is_state) {
            return false;
        }
        let most = STATE_RUN as usize;
        let before = self.spots[..k]
            .iter()
            .rev()
            .take(most)
            .take_while(state)
            .count();
        let after = self.spots[k..].iter().take(most).take_while(state).count();
        before + after >= most
    }

    /// Whether a position apart near `size` comes within [`STATE_RUN`] positions after `c`: a
    /// small array there is likely that one (a loss kept past its step, made a little earlier
    /// than in the recorded step), not an extra one.
    fn apart_soon(&self, c: u32, size: usize) -> bool {
        let lo = c as usize + 1;
        let hi = (lo + STATE_RUN as usize).min(self.spots.len());
        self.spots
            .get(lo..hi)
            .is_some_and(|after| after.iter().any(|s| s.apart && near(size, s.size)))
    }

    /// Whether an allocation of `size` bytes that is not near position `c`'s size (apart)
    /// skips it: the recorded step allocated something there that this one does not (a training
    /// step's first step makes its optimizer state in the middle of the step). It does when the
    /// first position after `c` that is placed, or apart and near `size`, is near `size`: this
    /// allocation is that one. Else the step's arrays apart are of other sizes than the recorded
    /// ones (a shorter prompt's cache of keys and values), and it takes `c`.
    fn skips_to(&self, c: u32, size: usize) -> bool {
        let lo = c as usize + 1;
        let hi = (c.saturating_add(MAX_SKIP) as usize).min(self.spots.len());
        self.spots
            .get(lo..hi)
            .and_then(|after| after.iter().find(|s| !s.apart || near(size, s.size)))
            .is_some_and(|s| near(size, s.size))
    }

    /// The position past the run of positions apart that begins at `c`, when the run is long
    /// (at least [`STATE_RUN`], none recurring, ending within [`MAX_STATE_RUN`]) and the position
    /// after it is placed, near `size` and fits it: the recorded step made arrays there that
    /// this one does not, however like this allocation's their sizes are. A training step's
    /// first step makes its optimizer's state in the middle of the step, one or two arrays the
    /// size of each parameter, and the next steps make their temporaries the size of each
    /// parameter there; matched with the state's positions, one by one, they would all go
    /// apart. A cache of keys and values comes one or two arrays at a time between a layer's
    /// scratch (too short a run), and recurs once matched.
    fn skips_run(&self, c: u32, size: usize) -> Option<u32> {
        let hi = (c.saturating_add(MAX_STATE_RUN) as usize).min(self.spots.len());
        let after = self.spots.get(c as usize..hi)?;
        let run = after.iter().position(|s| !s.is_state())?;
        let s = &after[run];
        (run as u32 >= STATE_RUN && !s.apart && size <= s.size && near(size, s.size))
            .then_some(c + run as u32)
    }

    /// Which allocations of `record`, a step this plan served, are arrays apart of its own that
    /// the plan had apart too but did not match ([`Layout::skips_run`] skipped them, or the
    /// step left the plan before them), by index in `record` (empty when none): each outlived
    /// the step, was matched with no position, and has the size of a position apart, not
    /// recurring, that no allocation of the step was matched with (each such position counts
    /// once). They are the recorded step's arrays made again, which recur. A step whose first
    /// arrays all outlived it matched its first allocation past them with its first placed
    /// position (the run taken for a first step's optimizer state), left its plan there, and
    /// was planned again the same way at every step, allocating from the device every time.
    fn state_made_again(&self, record: &[Rec]) -> Vec<bool> {
        if !self.spots.iter().any(Spot::is_state) {
            return Vec::new();
        }
        let mut matched = vec![false; self.spots.len()];
        for r in record {
            if let Some(m) = matched.get_mut(r.planned as usize) {
                *m = true;
            }
        }
        let mut unmatched: Vec<usize> = self
            .spots
            .iter()
            .zip(&matched)
            .filter(|(s, m)| s.is_state() && !**m)
            .map(|(s, _)| s.size)
            .collect();
        unmatched.sort_unstable();
        let mut again = Vec::new();
        for (k, r) in record.iter().enumerate() {
            if unmatched.is_empty() {
                break;
            }
            if r.end != OPEN || r.planned != NONE {
                continue;
            }
            if let Ok(i) = unmatched.binary_search(&r.bytes) {
                unmatched.remove(i);
                again.resize(record.len(), false);
                again[k] = true;
            }
        }
        again
    }

    /// The hit path of [`Layout::next`], for the allocation `rec` of the step, of `size`
    /// aligned bytes: when it is the plain case (the next position is placed, fits, is free,
    /// and nothing is overdue), `serve` is given the position's offset and the position, and
    /// what it returns, if anything, takes the position, which is returned with it. `None`
    /// otherwise (nothing marked), and [`Layout::next`] decides.
    ///
    /// While the step serves every position in order ([`Layout::in_order`]), the positions
    /// planned to drop by now are all free when as many arrays dropped as the position's `due`
    /// says: each array that dropped did so at or after its planned end, so it is one of them.
    /// Else the planned ends are walked up to now ([`Layout::tick_to`]), and an allocation at
    /// or past [`MAX_POSITIONS`] is not the hit path's (the step overflowed; in order, the
    /// allocation is at its own position, and a plan has at most that many).
    ///
    /// One call, so that the position is found once: `serve` cannot reach the layout (it is
    /// borrowed here), so the position is marked through the reference the checks used.
    #[inline(always)]
    pub(super) fn hit<T>(
        &mut self,
        size: usize,
        rec: u32,
        serve: impl FnOnce(usize, u32) -> Option<T>,
    ) -> Option<(T, u32)> {
        let c = self.cursor;
        if !self.in_order {
            if rec >= MAX_POSITIONS {
                return None;
            }
            self.tick_to(c);
        }
        let s = self.spots.get_mut(c as usize)?;
        let plain = (!self.in_order || s.due == self.drops)
            && !s.apart
            && size <= s.size
            && (size > SMALL || s.size <= SMALL)
            && !s.live
            && self.overdue.is_empty()
            && self.blocked.is_empty();
        if !plain {
            return None;
        }
        let got = serve(s.offset, c)?;
        // `c` is the cursor: a step served in order is at its own tick there.
        debug_assert!(
            !self.in_order || c == rec,
            "served in order at another tick"
        );
        s.live = true;
        s.rec = rec;
        s.epoch = self.epoch;
        s.got = size;
        s.gone = OPEN;
        self.cursor = c + 1;
        Some((got, c))
    }

    /// The entry in the step's record of the allocation that position `k` served last through
    /// [`Layout::hit`]: its aligned size and the tick it dropped at ([`OPEN`] if it has not
    /// dropped through [`Layout::dropped_now`]).
    pub(super) fn served(&self, k: u32) -> (usize, u32) {
        self.spots
            .get(k as usize)
            .map_or((0, OPEN), |s| (s.got, s.gone))
    }

    /// Whether position `k` of `size` aligned bytes may be served at its offset now (for the
    /// allocation `rec` of the step); [`Serve::At`] marks it alive.
    #[inline]
    pub(super) fn serve(&mut self, k: u32, size: usize, rec: u32) -> Serve {
        let got = self.serve_at(k, size, rec);
        // In order while each allocation is served at the position of its own tick.
        self.in_order &= k == rec && matches!(got, Serve::At(_));
        got
    }

    /// [`Layout::serve`], but for the order of positions served.
    fn serve_at(&mut self, k: u32, size: usize, rec: u32) -> Serve {
        let s = &self.spots[k as usize];
        if size > s.size || s.live {
            return Serve::Diverged;
        }
        let (lo, hi) = (s.offset, s.offset + s.size);
        if !self.overdue.is_empty() && self.overdue.iter().any(|&p| self.overlaps(p, lo, hi)) {
            return Serve::Diverged;
        }
        if self.blocked.iter().any(|r| r.start < hi && lo < r.end) {
            return Serve::Blocked;
        }
        let offset = s.offset;
        let s = &mut self.spots[k as usize];
        s.live = true;
        s.rec = rec;
        s.epoch = self.epoch;
        Serve::At(offset)
    }

    /// Whether position `p`'s bytes meet `[lo, hi)`.
    fn overlaps(&self, p: u32, lo: usize, hi: usize) -> bool {
        let s = &self.spots[p as usize];
        s.offset < hi && lo < s.offset + s.size
    }

    /// The array at position `k`, served from the plan, dropped at tick `tick` of the step: its
    /// bytes are free. Returns the index in the record of the allocation served there last.
    #[inline]
    pub(super) fn dropped(&mut self, k: u32, tick: u32) -> u32 {
        let served_now = self
            .spots
            .get(k as usize)
            .is_some_and(|s| s.live && s.epoch == self.epoch);
        if served_now {
            self.dropped_now(k, tick)
        } else {
            self.freed(k)
        }
    }

    /// [`Layout::dropped`] of an array that position `k` served this step, alive until now (its
    /// position is taken until it drops: no other array of the step was served there, and a
    /// position freed otherwise, by [`Layout::clear_live`] or [`Layout::unserve`], took the step
    /// out of order first).
    #[inline(always)]
    pub(super) fn dropped_now(&mut self, k: u32, tick: u32) -> u32 {
        let Some(s) = self.spots.get_mut(k as usize) else {
            return NONE;
        };
        debug_assert!(s.live && s.epoch == self.epoch, "not an array of this step");
        s.gone = tick;
        self.in_order &= tick >= s.end;
        self.drops += 1;
        self.freed(k)
    }

    /// Position `k`'s bytes are free. Returns the index in the record of the allocation served
    /// there last.
    #[inline(always)]
    fn freed(&mut self, k: u32) -> u32 {
        let Some(s) = self.spots.get_mut(k as usize) else {
            return NONE;
        };
        s.live = false;
        if s.overdue {
            s.overdue = false;
            self.overdue.retain(|&p| p != k);
            self.cleared.retain(|&p| p != k);
        }
        s.rec
    }

    /// Position `k`, just served ([`Layout::serve`]), does not hold the allocation after all (the
    /// step left its plan, or its view or block could not be made): its bytes are free, and
    /// the step no longer serves its positions in order.
    pub(super) fn unserve(&mut self, k: u32) {
        self.in_order = false;
        self.freed(k);
    }

    /// Forgets which positions and bytes are taken, when no array of the block is alive (a plan
    /// switched in may have positions marked taken from the last step it was used in).
    pub(super) fn clear_live(&mut self) {
        self.forget_growth();
        self.in_order = false;
        for s in &mut self.spots {
            s.live = false;
            s.overdue = false;
        }
        self.overdue.clear();
        self.cleared.clear();
        self.clears_held = false;
        self.blocked.clear();
    }

    /// The bytes `range` of the block hold an array of an earlier step, which the plan was not
    /// placed around: no position that meets them is served from the block until
    /// [`Layout::unblock`] ([`Serve::Blocked`]).
    pub(super) fn block(&mut self, range: std::ops::Range<usize>) {
        self.blocked.push(range);
    }

    /// Whether bytes of the block are blocked for its positions ([`Layout::block`]): arrays of
    /// earlier steps it was not placed around.
    pub(super) fn blocks_any(&self) -> bool {
        !self.blocked.is_empty()
    }

    /// Forgets the bytes blocked (the block they are in left the plan).
    pub(super) fn clear_blocked(&mut self) {
        self.blocked.clear();
    }

    /// The array over the bytes `range`, blocked, dropped.
    pub(super) fn unblock(&mut self, range: &std::ops::Range<usize>) {
        if let Some(i) = self.blocked.iter().position(|r| r == range) {
            self.blocked.swap_remove(i);
        }
    }

    /// Whether the step recorded so far as `record` is larger than the plan's block (`block`
    /// bytes, at least the footprint): its k-th allocation has been matched with the plan's
    /// k-th position all along (the same step with other sizes), and those allocations ask for
    /// more bytes in all than their positions hold, in a larger ratio than the block's to the
    /// footprint (a longer sequence: the step will not fit), or the ratio the plan would be
    /// scaled in is larger (its largest array's, which the rest of the step grows as: see
    /// `scaling`). A step matched otherwise (another order, extra or missing allocations) says
    /// nothing of its size that way: it is tried in the block's free bytes.
    ///
    /// By the total alone, a detector trained on images of varying size, whose two images kept
    /// their sizes while their batch, padded to the larger one's shape, grew 1.36x, had grown
    /// 1.057x in all when its block held 1.076x its plan: not outgrown, the step was served from
    /// the block's gaps, and each array they could not hold went apart, 96 device allocations in
    /// that step. Judged by the batch too, its steps are placed around their arrays alive in the
    /// block, grown in place: 114 -> 23 device allocations after its second step.
    pub(super) fn outgrown(&self, record: &[Rec], block: usize) -> bool {
        let past = |(asked, planned): (u128, u128)| {
            asked * self.footprint as u128 > planned * block.max(self.footprint) as u128
        };
        self.growth(record)
            .is_some_and(|(total, _)| past(total) || self.scaling(record).is_some_and(past))
    }

    /// Whether the step recorded so far as `record` asked for more bytes in all than the plan's
    /// positions it was matched with hold, matched position by position (see
    /// [`Layout::outgrown`]): a larger step, which may outgrow the block.
    pub(super) fn larger(&self, record: &[Rec]) -> bool {
        self.growth(record)
            .is_some_and(|((asked, planned), _)| asked > planned)
    }

    /// Whether the step recorded so far as `record`, matched with the plan position by position,
    /// asked for no more bytes in all than the positions it was matched with hold (its arrays
    /// that grew past their positions are outweighed by those that shrank).
    pub(super) fn no_larger(&self, record: &[Rec]) -> bool {
        self.growth(record)
            .is_some_and(|((asked, planned), _)| asked <= planned)
    }

    /// The bytes the step recorded so far as `record` asked for at the plan's placed positions
    /// and the bytes those positions hold, then the same for the largest of those positions,
    /// when the step was matched with the plan position by position, small arrays extra and
    /// small positions skipped aside (`None` otherwise).
    ///
    /// Reads on from where the last call stopped ([`Growth`]), the record being the same
    /// step's, longer.
    fn growth(&self, record: &[Rec]) -> Option<((u128, u128), (u128, u128))> {
        let mut g = self.growth.get();
        if g.read > record.len() {
            g = Growth::default();
        }
        let more = &record[g.read..];
        self.read_growth(&mut g, more);
        self.growth.set(g);
        debug_assert_eq!(
            g,
            {
                let mut whole = Growth::default();
                self.read_growth(&mut whole, record);
                whole
            },
            "the growth read on differs from the whole record's"
        );
        (!g.unmatched).then_some(((g.asked, g.planned), g.largest))
    }

    /// [`Layout::growth`] of `g`, read on over `more`, the record's allocations after those read.
    fn read_growth(&self, g: &mut Growth, more: &[Rec]) {
        g.read += more.len();
        if g.unmatched {
            return;
        }
        for r in more {
            if r.planned == NONE && r.bytes <= SMALL {
                continue;
            }
            // The positions between the next one and the one matched are small ones the step
            // skipped; extra small arrays match none.
            let k = r.planned as usize;
            let matched = self
                .spots
                .get(g.next..k)
                .filter(|skipped| !skipped.iter().any(|s| s.apart || s.size > SMALL))
                .and_then(|_| self.spots.get(k));
            let Some(s) = matched else {
                g.unmatched = true;
                return;
            };
            g.next = k + 1;
            if !s.apart {
                g.asked += r.bytes as u128;
                g.planned += s.size as u128;
                if s.size as u128 > g.largest.1 {
                    g.largest = (r.bytes as u128, s.size as u128);
                }
            }
        }
    }

    /// The positions' sizes changed, or the record is another step's: [`Layout::growth`]
    /// reads it from its start again. The cache calls it when it clears the step's record; the
    /// layout itself when its sizes change, when it is switched in ([`Layout::clear_live`]) and
    /// at the step's end.
    pub(super) fn forget_growth(&mut self) {
        *self.growth.get_mut() = Growth::default();
    }

    /// The ratio (asked, planned) in which the step recorded so far as `record` outgrew the
    /// plan, when [`Layout::scale`] may scale it (see there).
    fn scaling(&self, record: &[Rec]) -> Option<(u128, u128)> {
        let unconfirmed = self.cold && !self.confirmed;
        let ((asked, planned), largest) = self
            .growth(record)
            .filter(|&((a, p), _)| a > p && !(unconfirmed && a > 2 * p))?;
        // More than [`SCALES`] times larger, in all or in its largest array, the step is of
        // another kind than the plan (as its first allocation tells, `Layout::expected`), not
        // the same step larger: a sequence-to-sequence server's encoder step for a longer input
        // than any before, its first allocation larger than every plan's first, followed the
        // decoding steps' plan and scaled it some 470 times, a block of 97 MB for a step whose
        // arrays needed 14 MB at once (BART serving, a check log: 7.89x of its peak live bytes;
        // 1.05x without the scale, served from the block's gaps and apart and planned after).
        if asked > planned * SCALES || largest.0 > largest.1 * SCALES {
            return None;
        }
        // Nor is a step whose array at the largest position so far is less than half of it
        // while the step grew in all: its arrays are not the plan's, larger. A beam search's
        // first step of a request whose source was longer than any before fitted no plan's
        // first allocation, followed the plan of the last request's last step, matched its
        // first 22 positions, 4 times their bytes in all, but 256 bytes at its largest (1.6 MB),
        // and was scaled fourfold: a block of 450 MiB for a step of 88 MiB at once (BART
        // generating with four beams, a check log: 2.448x of its peak live bytes; 1.190x so).
        if 2 * largest.0 < largest.1 {
            return None;
        }
        // The largest position's ratio when it grew: the step's large arrays grow as the rest
        // of the step will, where its first ones may not (a detector's images, padded to the
        // batch's largest, grew 1.69x where its feature maps grew 1.11x: RetinaNet's second
        // step, scaled by the total, 1.29x of its peak live bytes, now 1.09x), and small arrays
        // are rounded up to the alignment, which makes them look as if they grew less.
        Some(if largest.0 > largest.1 {
            largest
        } else {
            (asked, planned)
        })
    }

    /// Whether [`Layout::scale`] would scale the plan for the step recorded so far as `record`.
    pub(super) fn scales(&self, record: &[Rec]) -> bool {
        self.scaling(record).is_some()
    }

    /// The footprint [`Layout::scale`] would give the plan for the step recorded so far as
    /// `record`, `None` when it would not scale it.
    pub(super) fn scaled_footprint(&self, record: &[Rec], margin: Margin) -> Option<usize> {
        self.scaler(record, margin)?(self.footprint)
    }

    /// The map [`Layout::scale`] puts the plan's offsets and ends through for the step recorded
    /// so far as `record` (each multiplied by the ratio, `margin` more, rounded up to the
    /// alignment; `None` past what a size holds), `None` when it would not scale the plan.
    fn scaler(
        &self,
        record: &[Rec],
        margin: Margin,
    ) -> Option<impl Fn(usize) -> Option<usize> + use<>> {
        let (asked, planned) = self.scaling(record)?;
        let asked = margin.of(asked);
        Some(move |x: usize| {
            let x = (x as u128 * asked).div_ceil(planned);
            usize::try_from(x).ok().and_then(super::block::aligned)
        })
    }

    /// Scales the plan by the ratio in which the step recorded so far as `record` outgrew it
    /// (its largest array's, when that grew; else the total's: see `scaling`), for the rest of
    /// that step, from position `from` on, in a new block. Returns whether it
    /// did: the step was matched with the plan position by position and asked for more than
    /// its positions hold, and a plan made from a cold start that no step has followed to its
    /// end grew at most twofold (more says that the step is another one, not the same one
    /// larger).
    ///
    /// Every placed position's offset and end are multiplied by the ratio, `margin` more, and
    /// rounded up to the alignment. That map is monotone, so positions whose ranges were disjoint
    /// stay disjoint, and the layout stays a valid plan whatever the ratio.
    ///
    /// But the arrays of the positions before `from` are not in the new block (in the old one,
    /// or apart), and those planned to live on past `from` keep their bytes there unused: an
    /// input made at the step's first position and used to its end, gone apart as it grew,
    /// holds its place twice. When such bytes are more than [`REST_WASTE`]th of the scaled
    /// footprint, and the block would take the cache past the most it has held (it needs more
    /// than `room` bytes: else there is no peak to save, and a plan costs host time), the
    /// positions from `from` on are placed again: those bytes taken out where no later position
    /// meets them ([`Layout::close_up`]), else from their scaled sizes and planned lifetimes
    /// alone ([`planner::greedy_by_size`]), and the block holds the peak of the rest of the step
    /// rather than the whole step's (ViT-B inference: 1.087x of peak live scaled whole, 1.053x
    /// placed again), when that saves more than a [`REST_WASTE`]th. The layout
    /// is then [`Layout::one_step`]: the positions before `from` keep offsets that the others
    /// may overlap; at the step's end it is the plan scaled whole again
    /// ([`Layout::whole_again`]), or, with arrays of the step alive, planned again.
    pub(super) fn scale(&mut self, record: &[Rec], from: u32, room: usize, margin: Margin) -> bool {
        let Some(rest) = self.scale_whole(record, from, margin) else {
            return false;
        };
        let from = (from as usize).min(self.spots.len());
        // The bytes kept for the arrays before `from` planned to live on past it, scaled.
        let before: Vec<(usize, usize)> = self.spots[..from]
            .iter()
            .filter(|s| s.placed() && s.end as usize > from)
            .map(|s| (s.offset, s.offset + s.size))
            .collect();
        let unused: usize = before.iter().map(|(lo, hi)| hi - lo).sum();
        if self.footprint > room && unused > self.footprint / REST_WASTE {
            self.place_rest(before, &rest);
        }
        true
    }

    /// Whether most of the plan's peak is held by arrays made long before it (more than an
    /// eighth of its positions earlier, and more than two): a training step's activations, kept
    /// from its forward pass for its backward pass. A step of another kind that begins as this
    /// one does, larger (an evaluation step's forward pass on a larger batch), keeps none of
    /// them, and needs a fraction of the plan scaled.
    pub(super) fn kept_at_peak(&self) -> bool {
        let n = self.spots.len();
        // The bytes alive at each tick, as changes: each placed array from its position to its
        // planned end.
        let mut change = vec![0isize; n + 2];
        for (k, s) in self.spots.iter().enumerate().filter(|(_, s)| s.placed()) {
            change[k] += s.size as isize;
            change[(s.end as usize).clamp(k + 1, n + 1)] -= s.size as isize;
        }
        let (mut live, mut peak, mut at) = (0isize, 0isize, 0usize);
        for (t, c) in change.iter().enumerate() {
            live += c;
            if live > peak {
                (peak, at) = (live, t);
            }
        }
        let long = (n / 8).max(2);
        let kept: isize = (self.spots.iter().enumerate())
            .filter(|&(k, s)| s.placed() && k + long < at && s.end as usize > at)
            .map(|(_, s)| s.size as isize)
            .sum();
        peak > 0 && 2 * kept >= peak
    }

    /// Moves position `k`, just unserved, to the bottom of the block for the rest of the step,
    /// the positions below it moved up by its size (those above it stay), when no other position
    /// meets its bytes and no earlier step's array holds bytes of the block: the address space
    /// below its end rotated, so that positions whose bytes were apart stay apart. The layout is
    /// then for that step only ([`Layout::one_step`]; the plan as it was comes back at its end).
    /// Returns whether it moved.
    ///
    /// For a plan scaled at a step's first allocation ([`Layout::scale`]): that position, placed
    /// high in the plan scaled (arrays are placed largest first, and a step's input is not among
    /// them), would grow the block at once, where a step that leaves the plan at its next
    /// allocations (not the same step larger after all) needs no more than the block it has.
    pub(super) fn lower(&mut self, k: u32) -> bool {
        let Some(s) = self.spots.get(k as usize).filter(|s| s.placed()) else {
            return false;
        };
        let (lo, hi) = (s.offset, s.offset + s.size);
        let meets = (0u32..)
            .zip(&self.spots)
            .any(|(j, t)| j != k && t.placed() && t.offset < hi && lo < t.offset + t.size);
        // Nor with bytes of the block held by earlier steps' arrays, which the positions moved
        // could meet.
        if meets || self.one_step() || !self.blocked.is_empty() || !self.overdue.is_empty() {
            return false;
        }
        let size = hi - lo;
        let moved: Vec<(usize, usize, usize)> = (0..self.spots.len())
            .filter_map(|j| {
                let t = &self.spots[j];
                if j == k as usize {
                    Some((j, 0, t.size))
                } else {
                    (t.placed() && t.offset < lo).then_some((j, t.offset + size, t.size))
                }
            })
            .collect();
        let footprint = self.footprint;
        self.for_one_step(moved.into_iter(), footprint);
        true
    }

    /// The arrays alive in the block when a step's rest is placed again from position `from`
    /// on, each with its lifetime and offset: those at the positions before `from`, made this
    /// step, until their planned ends (past them, overdue, through the step: the rest's
    /// positions over them would wait; so too those held over, with `held`: the step keeps
    /// them), and the pins' ranges `pinned`, throughout. `None` when an array of an earlier
    /// step, or one at a position of the rest, is alive at a position: its bytes are where the
    /// rest would move.
    fn alive_before(
        &self,
        from: u32,
        pinned: &[std::ops::Range<usize>],
        held: bool,
    ) -> Option<Vec<(Lifetime, usize)>> {
        let (epoch, n) = (self.epoch, self.spots.len() as u32);
        let mut placed: Vec<(Lifetime, usize)> = Vec::new();
        for (k, s) in (0u32..).zip(&self.spots) {
            if !s.live || s.apart {
                continue;
            }
            if k >= from || s.epoch != epoch {
                return None;
            }
            let end = if s.overdue || held && s.held_over() {
                n + 1
            } else {
                s.end.max(from + 1)
            };
            placed.push((
                Lifetime {
                    bytes: s.size,
                    start: k,
                    end,
                },
                s.offset,
            ));
        }
        let throughout = |r: &std::ops::Range<usize>| Lifetime {
            bytes: r.len(),
            start: 0,
            end: n + 1,
        };
        placed.extend(pinned.iter().map(|r| (throughout(r), r.start)));
        Some(placed)
    }

    /// Whether an array at a position held over ([`HeldOver`]) is alive past its planned end:
    /// the step keeps the arrays held over (the first micro-batch of an optimizer step making
    /// its gradients).
    pub(super) fn keeps_held_over(&self) -> bool {
        self.overdue
            .iter()
            .any(|&p| self.spots[p as usize].held_over())
    }

    /// Places the rest of a step that keeps the arrays held over ([`Layout::keeps_held_over`]),
    /// from position `from` on, again: at their sizes and planned lifetimes, those held over to
    /// the step's end, around the arrays alive in the block, those held over through the step
    /// ([`Layout::alive_before`]; the pins' ranges `pinned`). The layout is then for that step
    /// only ([`Layout::one_step`]).
    /// Returns the bytes the block must hold; `None`, with nothing changed, when an array of an
    /// earlier step or of a position of the rest is alive in the block, or the rest needs more
    /// than `most` bytes. Undone by [`Layout::whole_again`] at the step's end.
    ///
    /// A plan made from a step whose held-over arrays dropped within it has them placed at
    /// those lifetimes, and a step that keeps them meets them, overdue, at a later position:
    /// served from the block's gaps from there on, it needed the device for an array every
    /// other optimizer step (ResNet-50, gradients accumulated over four micro-batches).
    /// Placed again so, the rest follows its plan. Safe as [`Layout::scale_around`] is.
    pub(super) fn keep_rest(
        &mut self,
        from: u32,
        pinned: &[std::ops::Range<usize>],
        most: usize,
        learned: &planner::Learned,
    ) -> Option<usize> {
        if self.one_step() {
            return None;
        }
        let placed = self.alive_before(from, pinned, true)?;
        let n = self.spots.len() as u32;
        let rest: Vec<u32> = (from..n)
            .filter(|&k| self.spots[k as usize].placed())
            .collect();
        let lives: Vec<Lifetime> = rest
            .iter()
            .map(|&k| {
                let s = &self.spots[k as usize];
                let life = s.lifetime(k);
                if s.held_over() {
                    Lifetime { end: n, ..life }
                } else {
                    life
                }
            })
            .collect();
        let plan = learned.plan_among(&lives, &placed);
        if plan.footprint > most {
            return None;
        }
        let moved: Vec<(usize, usize, usize)> = rest
            .iter()
            .zip(plan.offsets)
            .map(|(&k, offset)| (k as usize, offset, self.spots[k as usize].size))
            .collect();
        let footprint = plan.footprint.max(self.footprint);
        self.for_one_step(moved.into_iter(), footprint);
        self.clear_overdue();
        Some(plan.footprint)
    }

    /// Scales the plan for the step recorded so far as `record` as [`Layout::scale`] does, and
    /// places its rest, from position `from` on, again (largest first, best fit: see
    /// [`planner::greedy_by_size_among`]) at its planned lifetimes and scaled sizes, among the
    /// arrays alive in the block it is in: those of the positions before `from`, each until its
    /// planned end (through the step once overdue), and the pins' ranges `pinned`, throughout.
    /// The layout is then for that step only ([`Layout::one_step`]; the plan scaled whole
    /// comes back at its end), the positions before `from` keeping their places, where their
    /// arrays are. Returns the bytes the block must hold; `None`, with nothing changed, when
    /// the plan cannot be scaled for the step, an array of an earlier step or of a position of
    /// the rest is alive in the block, or the rest placed so needs more than the plan scaled
    /// whole (which would hold the step in a block of its own). Undone by
    /// [`Layout::unscale_around`].
    ///
    /// Safe as any plan is: no position of the rest meets a live array's bytes while that
    /// array is planned to live, and one that lives past its planned end is overdue, so the
    /// positions over it wait ([`Layout::serve`]); the positions before `from` are passed,
    /// and the cursor never comes back to them.
    pub(super) fn scale_around(
        &mut self,
        record: &[Rec],
        from: u32,
        pinned: &[std::ops::Range<usize>],
        margin: Margin,
        learned: &planner::Learned,
    ) -> Option<usize> {
        let placed = self.alive_before(from, pinned, false)?;
        let rest = self.scale_whole(record, from, margin)?;
        let lives = self.lives_of(&rest);
        let plan = learned.plan_among(&lives, &placed);
        if plan.footprint > self.footprint {
            // Around the arrays alive, the rest needs more than the plan scaled whole, which
            // would hold the step in a block of its own once they drop (Keypoint R-CNN's larger
            // images: 1.268x -> 1.323x of peak live so).
            self.unscale();
            return None;
        }
        let whole = self
            .spots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.apart)
            .map(|(k, s)| (k, s.offset, s.size))
            .collect();
        self.whole = Some(Whole {
            spots: whole,
            footprint: self.footprint,
        });
        // The positions before `from` back where they were (the places `scale_whole` kept).
        self.forget_growth();
        let was = self.unscaled.as_ref().map_or(&[][..], |u| &u.spots[..]);
        let mut before = 0;
        for (s, &(offset, size)) in self.spots.iter_mut().zip(was).take(from as usize) {
            (s.offset, s.size) = (offset, size);
            before = before.max(offset + size);
        }
        for (&(k, size), offset) in rest.iter().zip(plan.offsets) {
            (self.spots[k].offset, self.spots[k].size) = (offset, size);
        }
        self.footprint = plan.footprint.max(before);
        Some(plan.footprint)
    }

    /// Undoes [`Layout::scale_around`]: the plan as it was before.
    pub(super) fn unscale_around(&mut self) {
        self.whole = None;
        self.unscale();
    }

    /// Scales every placed position of the plan (see [`Layout::scale`]), keeping the plan as it
    /// was for [`Layout::unscale`]; returns the positions from `from` on that are placed, with
    /// their sizes scaled (`None`: it may not be scaled; nothing changed).
    fn scale_whole(
        &mut self,
        record: &[Rec],
        from: u32,
        margin: Margin,
    ) -> Option<Vec<(usize, usize)>> {
        if self.one_step() {
            // Placed again for this step already: its earlier positions' offsets are no plan to
            // scale, and the plan scaled whole must stay the one kept.
            return None;
        }
        let scaled = self.scaler(record, margin)?;
        // The largest value scaled: every offset and end is at most the footprint.
        let footprint = scaled(self.footprint)?;
        self.forget_growth();
        self.unscaled = Some(Box::new(Unscaled {
            spots: self.spots.iter().map(|s| (s.offset, s.size)).collect(),
            footprint: self.footprint,
            first: self.first,
        }));
        // The plan holds a first allocation as much larger (the kind of step it fits).
        self.first = scaled(self.first).unwrap_or(footprint);
        let from = (from as usize).min(self.spots.len());
        // The rest's sizes, each in the ratio (the map below rounds both ends of a range).
        let rest: Vec<(usize, usize)> = (from..self.spots.len())
            .filter(|&k| !self.spots[k].apart)
            .map(|k| (k, scaled(self.spots[k].size).unwrap_or(footprint)))
            .collect();
        for s in self.spots.iter_mut().filter(|s| !s.apart) {
            let start = scaled(s.offset).unwrap_or(footprint);
            let end = scaled(s.offset + s.size).unwrap_or(footprint);
            s.offset = start;
            s.size = end - start;
        }
        self.footprint = footprint;
        Some(rest)
    }

    /// The planned lifetimes of the positions `rest`, each with its size there.
    fn lives_of(&self, rest: &[(usize, usize)]) -> Vec<Lifetime> {
        rest.iter()
            .map(|&(k, bytes)| Lifetime {
                bytes,
                ..self.spots[k].lifetime(k as u32)
            })
            .collect()
    }

    /// Places the positions of `rest` (each with its size) again, for the rest of a step in a
    /// new block (see [`Layout::scale`]), without the ranges `before` that the plan scaled whole
    /// keeps for arrays made earlier: closed up, else at their planned lifetimes by the planner.
    /// The layout is then for that step only.
    fn place_rest(&mut self, before: Vec<(usize, usize)>, rest: &[(usize, usize)]) {
        if self.close_up(before, rest) {
            return;
        }
        let lives = self.lives_of(rest);
        // Placed again, the rest takes at least its peak live bytes: when that is not less by a
        // [`REST_WASTE`]th, it is not placed (a plan's host time saved).
        let least = planner::peak_live(&lives);
        if least + self.footprint / REST_WASTE >= self.footprint {
            return;
        }
        let plan = planner::greedy_by_size(&lives);
        if plan.footprint == 0 || plan.footprint + self.footprint / REST_WASTE >= self.footprint {
            // Nothing placed from there on (the step goes apart), or too little saved for a
            // plan of one step (planned again at its end, its block too small for the next).
            return;
        }
        let placed = rest
            .iter()
            .zip(plan.offsets)
            .map(|(&(k, size), offset)| (k, offset, size));
        self.for_one_step(placed, plan.footprint);
    }

    /// Places the rest of a step (the positions of `rest`) in the plan scaled whole with the
    /// ranges `holes` it keeps for the arrays made before taken out, where no position of the
    /// rest meets them, when that is more than a [`REST_WASTE`]th of the footprint: each
    /// position moves down by the bytes taken out below it (an input alive through the step
    /// leaves its place so; no plan made). Returns whether it did.
    fn close_up(&mut self, mut holes: Vec<(usize, usize)>, rest: &[(usize, usize)]) -> bool {
        holes.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(holes.len());
        for (lo, hi) in holes {
            match merged.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        merged.retain(|&(lo, hi)| {
            !rest.iter().any(|&(k, _)| {
                let s = &self.spots[k];
                s.offset < hi && lo < s.offset + s.size
            })
        });
        let removed: usize = merged.iter().map(|(lo, hi)| hi - lo).sum();
        if removed <= self.footprint / REST_WASTE {
            return false;
        }
        // The bytes taken out below `x` (no position's range straddles a hole).
        let below = |x: usize| -> usize {
            merged
                .iter()
                .take_while(|&&(_, hi)| hi <= x)
                .map(|(lo, hi)| hi - lo)
                .sum()
        };
        let placed: Vec<(usize, usize, usize)> = rest
            .iter()
            .map(|&(k, _)| {
                let s = &self.spots[k];
                (k, s.offset - below(s.offset), s.size)
            })
            .collect();
        let footprint = self.footprint - below(self.footprint);
        self.for_one_step(placed.into_iter(), footprint);
        true
    }

    /// Gives the positions `placed` (each with its offset and size) those places for the rest
    /// of this step, in a block of `footprint` bytes, keeping the plan scaled whole for
    /// [`Layout::whole_again`].
    fn for_one_step(
        &mut self,
        placed: impl Iterator<Item = (usize, usize, usize)>,
        footprint: usize,
    ) {
        self.forget_growth();
        let whole = placed
            .map(|(k, offset, size)| {
                let s = &mut self.spots[k];
                let was = (k, s.offset, s.size);
                (s.offset, s.size) = (offset, size);
                was
            })
            .collect();
        self.whole = Some(Whole {
            spots: whole,
            footprint: self.footprint,
        });
        self.footprint = footprint;
    }

    /// Whether the layout was placed again for the rest of a step that outgrew it
    /// ([`Layout::scale`]): a layout for that step only, never a plan for another.
    pub(super) fn one_step(&self) -> bool {
        self.whole.is_some()
    }

    /// The step a layout was placed for ([`Layout::one_step`]) ended with none of its arrays
    /// alive: the layout is the plan scaled whole again, a plan for the steps after (kept if
    /// it held the step as it was, else merged into the next plan, or shelved). With arrays
    /// alive, it stays as it is (their bytes are where this step put them) and is planned
    /// again. Views kept for its positions must have gone loose before (they were made at the
    /// offsets this step placed them at).
    pub(super) fn whole_again(&mut self) {
        let spots = &self.spots;
        let Some(whole) = self
            .whole
            .take_if(|_| !spots.iter().any(|s| s.live && !s.apart))
        else {
            return;
        };
        self.restore(whole);
    }

    /// Undoes [`Layout::keep_rest`], before any position of the rest is served: the plan as it
    /// was.
    pub(super) fn unkeep_rest(&mut self) {
        if let Some(whole) = self.whole.take() {
            self.restore(whole);
        }
    }

    /// The positions of `whole` back at their places in it.
    fn restore(&mut self, whole: Whole) {
        self.forget_growth();
        self.unclear();
        for (k, offset, size) in whole.spots {
            let s = &mut self.spots[k];
            s.offset = offset;
            s.size = size;
        }
        self.footprint = whole.footprint;
    }

    /// The plan as it was before its latest [`Layout::scale`], when the step that scaled it
    /// turned out to be of another kind ([`Layout::same_kind`]): kept for the steps of its own
    /// kind, it would hold each at that step's scale. Not for a layout placed for one step
    /// ([`Layout::one_step`]), which is never kept.
    pub(super) fn unscale(&mut self) {
        debug_assert!(!self.one_step(), "a layout for one step unscaled");
        let Some(was) = self.unscaled.take() else {
            return;
        };
        self.forget_growth();
        for (s, (offset, size)) in self.spots.iter_mut().zip(was.spots) {
            (s.offset, s.size) = (offset, size);
        }
        self.footprint = was.footprint;
        self.first = was.first;
    }

    /// Whether an array alive at tick `t` is planned to live past the first eighth of the rest
    /// of the step: the block it is in stays in use too long for the step to wait for it (a
    /// training step's first arrays live through its forward pass, an attention mask through
    /// every layer; an inference step's first arrays die within a few layers).
    pub(super) fn held_long(&self, t: u32) -> bool {
        let n = self.spots.len() as u32;
        let soon = t.saturating_add(n.saturating_sub(t) / 8);
        self.spots
            .iter()
            .any(|s| s.live && !s.apart && s.end > soon)
    }

    /// The most bytes a step that outgrew the plan sends apart while it waits for the plan's
    /// block to be unused: half the footprint ([`DeviceArena::wait_for_block`]; past it, the
    /// block's gaps serve the rest, see [`Layout::waits_past_half`]).
    pub(super) fn wait_limit(&self) -> usize {
        self.footprint / 2
    }

    /// Whether the step, waiting for the arrays alive in the block to end as planned, would send
    /// more than half the footprint apart meanwhile (its positions from `t` to the last of their
    /// ends, scaled as the step grew so far): then it would not wait for the block, whose gaps
    /// would serve the rest ([`DeviceArena::wait_for_block`]).
    pub(super) fn waits_past_half(&self, t: u32, record: &[Rec]) -> bool {
        let Some(((asked, planned), _)) = self.growth(record) else {
            return false;
        };
        let live = self
            .spots
            .iter()
            .filter(|s| s.live && !s.apart && s.epoch == self.epoch);
        let until = live.map(|s| s.end as usize).max().unwrap_or(0);
        let meanwhile = self.spots.get(t as usize..until).unwrap_or(&[]);
        let bytes: u128 = meanwhile
            .iter()
            .filter(|s| !s.apart)
            .map(|s| s.size as u128)
            .sum();
        bytes * asked > self.wait_limit() as u128 * planned.max(1)
    }

    /// Whether the plan keeps at most one position apart larger than [`SMALL`]: an array that
    /// outlives its step alone (a step's input batch, made before the one of the step before
    /// is dropped), with no other array apart to compete for its spare blocks.
    pub(super) fn one_large_apart(&self) -> bool {
        let mut large = self.spots.iter().filter(|s| s.apart && s.size > SMALL);
        large.nth(1).is_none()
    }

    /// The recorded size of position `k` when it is apart (0 for a position in the block).
    pub(super) fn recorded_apart(&self, k: u32) -> usize {
        self.spots
            .get(k as usize)
            .filter(|s| s.apart)
            .map_or(0, |s| s.size)
    }

    /// The bytes of position `k` in the block.
    pub(super) fn range(&self, k: u32) -> std::ops::Range<usize> {
        self.spots
            .get(k as usize)
            .filter(|s| !s.apart)
            .map_or(0..0, |s| s.offset..s.offset + s.size)
    }

    /// The bytes of the positions alive (or whose bytes are still taken).
    pub(super) fn live_ranges(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        self.spots
            .iter()
            .filter(|s| s.live && !s.apart)
            .map(|s| s.offset..s.offset + s.size)
    }

    /// The positions alive at the end of the step that just ended ([`Layout::end_step`]) with
    /// the allocation served at each (its index in the step's record) and its range, when the
    /// step served them all; `None` when one is alive from an earlier step.
    pub(super) fn alive_at_end(&self) -> Option<Vec<(u32, u32, std::ops::Range<usize>)>> {
        let last = self.epoch.wrapping_sub(1);
        let mut alive = Vec::new();
        for (k, s) in self.spots.iter().enumerate() {
            if s.live && !s.apart {
                if s.epoch != last {
                    return None;
                }
                alive.push((k as u32, s.rec, s.offset..s.offset + s.size));
            }
        }
        Some(alive)
    }

    /// Whether an array of the step that just ended ([`Layout::end_step`]) is alive at a
    /// position held over ([`HeldOver`]): the step is planned again, so that it is pinned.
    pub(super) fn kept_held_over(&self) -> bool {
        let last = self.epoch.wrapping_sub(1);
        self.spots
            .iter()
            .any(|s| s.held_over() && s.live && s.epoch == last)
    }

    /// Whether position `k` is held over ([`HeldOver`]).
    pub(super) fn is_held_over(&self, k: u32) -> bool {
        self.spots.get(k as usize).is_some_and(Spot::held_over)
    }

    /// Whether the array last served at position `k` is alive (or its bytes still taken).
    pub(super) fn is_live(&self, k: u32) -> bool {
        self.spots.get(k as usize).is_some_and(|s| s.live)
    }

    /// Whether position `k` is apart.
    pub(super) fn is_apart(&self, k: u32) -> bool {
        self.spots.get(k as usize).is_some_and(|s| s.apart)
    }

    /// The index in the record of the allocation served at position `k` last.
    pub(super) fn rec_of(&self, k: u32) -> u32 {
        self.spots.get(k as usize).map_or(NONE, |s| s.rec)
    }

    /// Whether the plan holds the step recorded as `record` as it is: the step matched every
    /// position in order, each array placed is no larger than its position, and each array
    /// apart outlived the step as planned.
    pub(super) fn holds(&self, record: &[Rec]) -> bool {
        record.len() == self.spots.len()
            && record
                .iter()
                .zip(&self.spots)
                .enumerate()
                .all(|(k, (r, s))| {
                    r.planned as usize == k
                        && if s.apart {
                            r.end == OPEN
                        } else {
                            r.bytes <= s.size
                        }
                })
    }

    /// Whether the step recorded as `record` made the allocations of the step the plan was made
    /// from, of the same sizes in the same order, as far as both go (one may go on).
    pub(super) fn same_sizes(&self, record: &[Rec]) -> bool {
        self.made_from
            .iter()
            .zip(record)
            .all(|(m, r)| m.bytes == r.bytes)
    }

    /// The step the plan was made from, as recorded (its k-th allocation matched with position
    /// k): a step that follows the plan as far as it goes, and ends before it, is likely to be
    /// followed by one such as this (see `DeviceArena::end_step`).
    pub(super) fn made_from(&self) -> &[Rec] {
        &self.made_from
    }

    /// Whether the step so far matched every position of the plan, skipping none.
    pub(super) fn reached_end(&self) -> bool {
        !self.skipped && self.cursor as usize == self.spots.len()
    }

    /// The step ended: every position still alive is overdue (it is in the way of the next
    /// step's positions over it until it drops). Returns whether the step matched the plan with
    /// no position skipped, to its end or to a position before it (a prefix of the recorded
    /// step: an evaluation step after a training step that begins as it does).
    ///
    /// A step that served its positions in order, every one of its arrays dropped, leaves
    /// nothing to look at: a position alive from an earlier step was made overdue when that
    /// step ended.
    pub(super) fn end_step(&mut self) -> bool {
        self.unclear();
        if !self.in_order || self.drops != self.cursor {
            for (p, s) in self.spots.iter_mut().enumerate() {
                s.make_overdue(p as u32, &mut self.overdue);
            }
        }
        debug_assert!(
            self.spots
                .iter()
                .enumerate()
                .all(|(p, s)| !s.live || s.overdue && self.overdue.contains(&(p as u32))),
            "a position alive at the step's end is not overdue"
        );
        let followed = !self.skipped && self.cursor > 0;
        self.cursor = 0;
        self.ended = 0;
        self.in_order = true;
        self.drops = 0;
        self.skipped = false;
        self.epoch = self.epoch.wrapping_add(1);
        self.forget_growth();
        followed
    }

    /// The offset and size of position `k` (tests).
    #[cfg(test)]
    fn spot(&self, k: u32) -> (usize, usize) {
        let s = &self.spots[k as usize];
        (s.offset, s.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(bytes: usize, end: u32) -> Rec {
        Rec {
            bytes,
            end,
            planned: NONE,
        }
    }

    /// a [0,2) b [1,3) c [2,4) d escapes: c takes a's bytes, d is apart.
    fn step() -> Vec<Rec> {
        vec![rec(256, 2), rec(512, 3), rec(256, 4), rec(256, OPEN)]
    }

    /// The hit path: the next position's offset, taken for allocation `rec`, if it is the plain
    /// case.
    fn hit(l: &mut Layout, size: usize, rec: u32) -> Option<usize> {
        l.hit(size, rec, |offset, _| Some(offset))
            .map(|(offset, _)| offset)
    }

    /// What [`Layout::hit`] would offer `size` bytes at tick `rec` (offset and position),
    /// taking nothing.
    fn peek(l: &mut Layout, size: usize, rec: u32) -> Option<(usize, u32)> {
        let mut offered = None;
        let taken = l.hit(size, rec, |offset, k| {
            offered = Some((offset, k));
            None::<()>
        });
        assert!(taken.is_none());
        offered
    }

    #[test]
    fn a_hit_whose_serve_gives_nothing_marks_nothing() {
        let record = [rec(256, 2), rec(512, 3), rec(256, 4)];
        let mut l = Layout::new(&record, None);
        // The view could not be had: the position stays free and the cursor where it was.
        assert_eq!(l.hit(256, 0, |_, _| None::<()>), None);
        assert!(!l.is_live(0));
        assert_eq!(l.served(0), (0, OPEN), "nothing recorded at the position");
        assert!(l.in_order);
        // The same allocation then takes it, and the next one the next position.
        assert_eq!(hit(&mut l, 256, 0), Some(l.spot(0).0));
        assert!(l.is_live(0));
        assert_eq!(l.served(0), (256, OPEN));
        assert_eq!(hit(&mut l, 512, 1), Some(l.spot(1).0));
    }

    #[test]
    fn a_step_served_in_order_frees_a_position_once_its_planned_drops_came() {
        // a [0,2) b [1,3) c [2,4): c is planned over a.
        let record = [rec(256, 2), rec(512, 3), rec(256, 4)];
        let mut l = Layout::new(&record, None);
        for round in 0..3 {
            assert_eq!(l.next(256, 0).0, Serve::At(l.spot(0).0), "round {round}");
            assert_eq!(hit(&mut l, 512, 1), Some(l.spot(1).0));
            // Tick 2: a is due and alive; c, over it, is not handed out.
            assert_eq!(peek(&mut l, 256, 2), None, "round {round}");
            l.dropped_now(0, 2);
            assert_eq!(hit(&mut l, 256, 2), Some(l.spot(0).0), "round {round}");
            l.dropped_now(1, 3);
            l.dropped_now(2, 3);
            assert!(l.in_order, "round {round}");
            assert!(l.end_step());
        }
    }

    #[test]
    fn an_array_dropped_before_its_planned_end_leaves_the_order_to_the_ends() {
        // b dropped at tick 2, before its planned end (3): the count of drops no longer tells
        // which are due, and a, alive past its end, still keeps c off its bytes.
        let record = [rec(256, 2), rec(512, 3), rec(256, 4)];
        let mut l = Layout::new(&record, None);
        assert!(matches!(l.next(256, 0).0, Serve::At(_)));
        assert!(hit(&mut l, 512, 1).is_some());
        l.dropped_now(1, 2);
        assert!(!l.in_order);
        assert_eq!(peek(&mut l, 256, 2), None, "a is overdue");
        l.dropped_now(0, 2);
        assert_eq!(hit(&mut l, 256, 2), Some(l.spot(0).0));
        l.dropped_now(2, 3);
        assert!(l.end_step());
        assert!(l.in_order, "a new step starts in order");
    }

    fn at(l: &mut Layout, size: usize) -> Option<usize> {
        match l.next(size, 0).0 {
            Serve::At(o) => Some(o),
            _ => None,
        }
    }

    #[test]
    fn a_repeated_step_is_served_at_its_offsets() {
        let mut l = Layout::new(&step(), None);
        assert_eq!(l.footprint, 768);
        assert_eq!(l.spot(0), l.spot(2));
        for round in 0..3 {
            let a = at(&mut l, 256);
            let b = at(&mut l, 512);
            l.dropped(0, 2);
            let c = at(&mut l, 200);
            assert!(a.is_some() && b.is_some());
            assert_eq!(a, c, "round {round}");
            assert_ne!(a, b);
            assert_eq!(l.next(300, 3), (Serve::Apart, 3));
            l.dropped(1, 4);
            l.dropped(2, 4);
            assert!(l.end_step());
        }
    }

    /// An input of 4096 bytes alive through the step, then five layers of 1024 bytes, two
    /// alive at once.
    fn held_input_step() -> Vec<Rec> {
        let mut record = vec![rec(4096, 7)];
        record.extend((1..6).map(|k| rec(1024, k + 2)));
        record
    }

    #[test]
    fn the_rest_of_a_step_that_outgrew_its_plan_is_placed_around_the_arrays_alive() {
        let mut l = Layout::new(&held_input_step(), None);
        let input = l.spot(0);
        assert_eq!(input.0, 0, "the largest at the bottom");
        // The next step: the input as planned, then a first layer a quarter larger.
        assert_eq!(at(&mut l, 4096), Some(0));
        assert_eq!(l.next(1280, 1), (Serve::Diverged, 1));
        let record = [matched(4096, OPEN, 0), matched(1280, OPEN, 1)];
        let whole_before = l.footprint;
        let bytes = l
            .scale_around(&record, 1, &[], Margin::default(), &Default::default())
            .expect("placed around the input");
        assert!(l.one_step());
        assert_eq!(l.spot(0), input, "the input stays where its array is");
        for k in 1..6 {
            let (offset, size) = l.spot(k);
            assert!(size >= 1280, "layer {k} scaled: {size} bytes");
            assert!(offset >= input.1, "layer {k} at {offset}, over the input");
            assert!(offset + size <= bytes);
        }
        // Two layers alive at once never meet.
        for k in 1..5 {
            let (a, b) = (l.spot(k), l.spot(k + 1));
            assert!(
                a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0,
                "layers {k} and {}",
                k + 1
            );
        }
        // The rest is served there.
        assert_eq!(l.serve(1, 1280, 1), Serve::At(l.spot(1).0));
        // Undone, the plan is as it was.
        let mut undone = Layout::new(&held_input_step(), None);
        assert_eq!(at(&mut undone, 4096), Some(0));
        undone.next(1280, 1);
        assert!(
            undone
                .scale_around(&record, 1, &[], Margin::default(), &Default::default())
                .is_some()
        );
        undone.unscale_around();
        assert!(!undone.one_step());
        assert_eq!(undone.footprint, whole_before);
        assert_eq!(
            undone.spot(3),
            Layout::new(&held_input_step(), None).spot(3)
        );
        // With its arrays dropped, the layout is the plan scaled whole again at the step's end.
        l.dropped(0, 6);
        l.dropped(1, 3);
        l.end_step();
        l.whole_again();
        assert!(!l.one_step());
        assert!(l.footprint > whole_before, "the plan scaled whole");
        assert!(l.footprint >= bytes);
    }

    #[test]
    fn a_layout_placed_for_the_rest_of_its_step_keeps_no_offsets_for_a_plan() {
        // An input alive through the step, an array planned to live to tick 6, then layers.
        let first = [
            rec(4096, 8),
            rec(2048, 6),
            rec(1024, 4),
            rec(1024, 5),
            rec(1024, 6),
            rec(1024, 7),
        ];
        let mut l = Layout::new(&first, None);
        // The next step drops the second array early, and outgrows the plan at position 3.
        assert!(at(&mut l, 4096).is_some());
        assert!(at(&mut l, 2048).is_some());
        l.dropped(1, 2);
        assert!(at(&mut l, 1024).is_some());
        assert_eq!(l.next(1536, 3), (Serve::Diverged, 3));
        let record = [
            matched(4096, OPEN, 0),
            matched(2048, 2, 1),
            matched(1024, OPEN, 2),
            matched(1536, OPEN, 3),
        ];
        assert!(
            l.scale_around(&record, 3, &[], Margin::default(), &Default::default())
                .is_some()
        );
        assert!(l.one_step());
        // The rest may take the dropped array's bytes, though the two are planned to meet.
        let meets = |l: &Layout, i: u32, j: u32| {
            let ((a, m), (b, n)) = (l.spot(i), l.spot(j));
            l.spots[i as usize].end > j && a < b + n && b < a + m
        };
        assert!(
            (3..6).any(|k| meets(&l, 1, k)),
            "the rest over the dropped array"
        );
        // A step of the same sizes and ends, position by position: its plan keeps none of those
        // places, and no two of its positions that meet share bytes.
        let same: Vec<Rec> = (0..6u32)
            .map(|k| matched(l.spot(k).1, l.spots[k as usize].end, k))
            .collect();
        let next = plan(&same, Some(&l), 64 << 20);
        assert!((0..6).all(|i| (i + 1..6).all(|j| !meets(&next, i, j))));
    }

    #[test]
    fn the_rest_is_not_placed_around_an_array_of_an_earlier_step() {
        let mut l = Layout::new(&held_input_step(), None);
        // The input of this step is alive into the next one: its bytes are not this step's.
        assert_eq!(at(&mut l, 4096), Some(0));
        l.end_step();
        let before: Vec<_> = (0..6).map(|k| l.spot(k)).collect();
        let record = [matched(2048, OPEN, 1)];
        assert_eq!(
            l.scale_around(&record, 1, &[], Margin::default(), &Default::default()),
            None
        );
        assert!(!l.one_step());
        assert_eq!((0..6).map(|k| l.spot(k)).collect::<Vec<_>>(), before);
    }

    #[test]
    fn positions_are_placed_around_bytes_taken_and_wait_for_bytes_blocked() {
        // Around an array of an earlier step at 0..256, nothing is placed there.
        let taken = 0..256;
        let l = Layout::new_around(
            &step(),
            None,
            std::slice::from_ref(&taken),
            &Default::default(),
            0,
            0,
            &[],
        );
        assert!((0..3).all(|k| l.spot(k).0 >= 256), "{:?}", l.spots);
        assert_eq!(l.footprint, 768 + 256);
        // Placed as if it were not there, the positions over it are served apart until it drops.
        let mut l = Layout::new(&step(), None);
        let a = l.spot(0).0;
        l.block(a..a + 256);
        assert_eq!(
            peek(&mut l, 256, 0),
            None,
            "not the plain case while bytes are blocked"
        );
        assert_eq!(l.next(256, 0), (Serve::Blocked, 0));
        let b = at(&mut l, 512).expect("b's bytes are not blocked");
        assert!(b >= a + 256 || b + 512 <= a);
        l.unblock(&(a..a + 256));
        assert_eq!(at(&mut l, 256), Some(a), "c takes a's bytes, free again");
    }

    #[test]
    fn an_array_kept_past_its_planned_end_keeps_its_bytes() {
        let mut l = Layout::new(&step(), None);
        assert!(at(&mut l, 256).is_some());
        assert!(at(&mut l, 512).is_some());
        // a is still alive at tick 2: c, planned over it, is not served there.
        assert_eq!(l.next(256, 2), (Serve::Diverged, 2));
        l.dropped(0, 3);
        l.dropped(1, 3);
        l.end_step();
        // Next step: nothing is alive, all served.
        assert!(at(&mut l, 256).is_some());
    }

    #[test]
    fn an_array_alive_across_steps_blocks_its_bytes_and_its_own_position() {
        let mut l = Layout::new(&step(), None);
        assert!(at(&mut l, 256).is_some());
        assert!(at(&mut l, 512).is_some());
        l.dropped(1, 2);
        // a (position 0) is overdue: c over it diverges.
        assert_eq!(l.next(256, 2).0, Serve::Diverged);
        l.end_step();
        // a escaped the step: positions 0 and 2 (same bytes) are taken; b is not.
        assert_eq!(l.next(256, 0).0, Serve::Diverged);
        assert!(at(&mut l, 512).is_some());
        l.dropped(0, 2);
        assert!(at(&mut l, 256).is_some());
    }

    #[test]
    fn positions_apart_that_do_not_recur_are_skipped() {
        // The first step made two arrays that outlived it (1 and 3), the next does not.
        let first = vec![
            rec(256, 2),
            rec(4096, OPEN),
            rec(512, 4),
            rec(8192, OPEN),
            rec(256, 5),
        ];
        let mut l = Layout::new(&first, None);
        assert!(at(&mut l, 256).is_some());
        // 512 is not near 4096: position 1 is skipped, position 2 serves it.
        assert_eq!(l.next(512, 1).1, 2);
        assert_eq!(l.next(256, 2).1, 4);
        assert!(!l.end_step(), "skipped");
    }

    #[test]
    fn larger_sizes_and_extra_positions_diverge_and_a_merged_plan_fits_both() {
        let mut l = Layout::new(&step(), None);
        assert_eq!(l.next(512, 0), (Serve::Diverged, 0));
        let bigger = vec![
            Rec {
                planned: 0,
                ..rec(512, 2)
            },
            Rec {
                planned: 1,
                ..rec(256, 3)
            },
            rec(256, 4),
            rec(256, OPEN),
        ];
        let merged = Layout::new(&bigger, Some(&Layout::new(&step(), None)));
        assert_eq!(merged.spot(0).1, 512);
        assert_eq!(merged.spot(1).1, 512);
        assert!(merged.footprint >= 1024);
        let mut l = Layout::new(&step(), None);
        for _ in 0..4 {
            l.next(256, 0);
        }
        assert_eq!(l.next(1024, 4), (Serve::Diverged, NONE));
        // A small array past the end is extra: the step stays on its plan.
        assert_eq!(l.next(256, 4), (Serve::Extra, NONE));
    }

    #[test]
    fn a_rest_placed_again_keeps_clear_of_a_held_over_array_not_yet_past_its_end() {
        // Two gradients, the first planned to drop after the second; the second's bytes a
        // temporary's after it, the first's another's after it.
        let rec = |bytes, end, k| matched(bytes, end, k);
        let dropped = [
            rec(1024, 7, 0),
            rec(256, 4, 1),
            rec(256, 3, 2),
            rec(256, 5, 3),
            rec(256, 7, 4),
            rec(256, 7, 5),
            rec(256, 7, 6),
        ];
        let held = [None, Some(4), Some(3), None, None, None, None];
        let mut l = plan_held(&dropped, None, &held);
        assert_eq!(
            l.range(3),
            l.range(2),
            "the temporary takes the second's bytes"
        );
        assert_eq!(l.range(4), l.range(1), "the next takes the first's");
        // A step that keeps both meets the second past its end first, while the first is not
        // yet: the rest is placed around both, through the step.
        for (k, size) in [(0, 1024), (1, 256), (2, 256)] {
            serve_next(&mut l, size, k);
        }
        assert_eq!(l.next(256, 3), (Serve::Diverged, 3));
        assert!(
            l.keep_rest(3, &[], usize::MAX, &Default::default())
                .is_some()
        );
        let meets = |a: std::ops::Range<usize>, b: std::ops::Range<usize>| {
            a.start < b.end && b.start < a.end
        };
        for k in 3..7 {
            assert!(
                !meets(l.range(k), l.range(1)) && !meets(l.range(k), l.range(2)),
                "position {k} placed over a gradient kept"
            );
        }
    }

    /// A micro-batch's step: an activation, two gradients with temporaries after each, and a
    /// last array; the gradients kept past the step (`kept`: the first micro-batch of an
    /// optimizer step) or added in and dropped at once (the next ones). Each allocation matched
    /// with its own position.
    fn micro_batch(kept: bool) -> Vec<Rec> {
        let grad = |end| if kept { OPEN } else { end };
        vec![
            matched(4096, 6, 0),
            matched(256, grad(2), 1),
            matched(1024, 4, 2),
            matched(256, grad(4), 3),
            matched(1024, 6, 4),
            matched(512, 6, 5),
        ]
    }

    #[test]
    fn gradients_kept_by_one_micro_batch_and_dropped_by_the_next_are_held_over() {
        let room = HeldOver {
            count: 8,
            bytes: 1 << 20,
        };
        // Made from the first micro-batch, the plan has the gradients apart; the next one drops
        // them within the step: its plan holds them over, at its lifetimes.
        let first = Layout::new(&micro_batch(true), None);
        assert!(first.is_apart(1) && first.is_apart(3));
        let next = micro_batch(false);
        let held = first.held_over(&next, room, false);
        assert_eq!(held, [None, Some(2), None, Some(4), None, None]);
        let old = plan_held(&next, Some(&first), &held);
        assert!(old.is_held_over(1) && !old.is_apart(1) && old.spots[1].end == 2);
        // The first micro-batch of the next optimizer step keeps them: held over again, placed
        // where the plan before placed them, at its lifetimes.
        let kept = micro_batch(true);
        let held = old.held_over(&kept, room, false);
        assert_eq!(held, [None, Some(2), None, Some(4), None, None]);
        let mut l = plan_held(&kept, Some(&old), &held);
        assert!(l.is_held_over(3) && !l.is_apart(3) && l.spots[3].end == 4);
        // Nothing is held over past what may be pinned, nor in a step of other allocations.
        let one = HeldOver {
            count: 1,
            bytes: 1 << 20,
        };
        assert_eq!(
            old.held_over(&kept, one, false),
            [None, Some(2), None, None, None, None]
        );
        let shifted: Vec<Rec> = kept
            .iter()
            .map(|r| matched(r.bytes, r.end, r.planned + 1))
            .collect();
        assert!(old.held_over(&shifted, room, false).is_empty());
        // A step longer than the plan (a micro-batch that also steps the optimizer) or shorter
        // holds over as far as both go.
        let mut longer = kept.clone();
        longer.push(rec(512, 7));
        assert_eq!(old.held_over(&longer, room, false), held);
        assert_eq!(old.held_over(&kept[..3], room, false), held[..3]);
        // A step that keeps the gradients: the first's bytes are a temporary's after its
        // planned end, where the step leaves the plan unless its rest is placed again.
        let a = serve_next(&mut l, 4096, 0);
        let g1 = serve_next(&mut l, 256, 1);
        assert!(!l.keeps_held_over());
        let (got, pos) = l.next(1024, 2);
        assert_eq!((got, pos), (Serve::Diverged, 2));
        assert!(l.keeps_held_over());
        assert!(
            l.keep_rest(2, &[], usize::MAX, &Default::default())
                .is_some()
        );
        assert!(l.one_step());
        let Serve::At(t) = l.serve(2, 1024, 2) else {
            panic!("the rest placed again does not serve its first position");
        };
        let mut live = vec![(a, 4096), (g1, 256), (t, 1024)];
        let g2 = serve_next(&mut l, 256, 3);
        live.push((g2, 256));
        // The temporary drops; the gradients stay.
        l.dropped(2, 4);
        live.retain(|&(at, _)| at != t);
        for (k, size) in [(4u32, 1024), (5, 512)] {
            let at = serve_next(&mut l, size, k);
            assert!(
                live.iter().all(|&(o, n)| at + size <= o || o + n <= at),
                "position {k} at {at} meets an array alive: {live:?}"
            );
            live.push((at, size));
        }
        for k in [0, 4, 5] {
            l.dropped(k, 6);
        }
        // The step ends with the gradients alive at their positions: planned again, to pin
        // them, and the layout placed for that step stays until then.
        assert!(l.end_step());
        assert!(l.kept_held_over());
        l.whole_again();
        assert!(l.one_step());
    }

    fn matched(bytes: usize, end: u32, planned: u32) -> Rec {
        Rec {
            bytes,
            end,
            planned,
        }
    }

    /// A decoding step: a temporary, an attention over `t` tokens (growing by 8 KiB a token,
    /// more than a 32nd a step while `t` is small), a temporary after it, and a cache of keys and
    /// values kept (apart), each matched with its position (`aligned`) or not.
    fn growing_step(t: usize, aligned: bool) -> Vec<Rec> {
        let planned = |k| if aligned { k } else { NONE };
        vec![
            matched(1 << 16, 2, planned(0)),
            matched(t << 13, 3, planned(1)),
            matched(1 << 16, 4, planned(2)),
            matched(t << 13, OPEN, planned(3)),
        ]
    }

    /// A plan made from `record`, merged with `old`, the allocations `held` held over.
    fn plan_held(record: &[Rec], old: Option<&Layout>, held: &[Option<u32>]) -> Layout {
        Layout::new_around(record, old, &[], &Default::default(), 0, 0, held)
    }

    /// Serves the next allocation, `size` bytes at tick `rec`, at its position: its offset.
    fn serve_next(l: &mut Layout, size: usize, rec: u32) -> usize {
        match l.next(size, rec) {
            (Serve::At(offset), _) => offset,
            got => panic!("allocation {rec} not served at its position: {got:?}"),
        }
    }

    /// A plan made in the `new_around` way, from `record`, merged with `old`.
    fn plan(record: &[Rec], old: Option<&Layout>, high: usize) -> Layout {
        Layout::new_around(record, old, &[], &Default::default(), 0, high, &[])
    }

    #[test]
    fn a_step_that_grew_at_plans_in_a_row_gets_room_for_its_growth_to_go_on() {
        let high = 64 << 20;
        let first = plan(&growing_step(8, false), None, high);
        assert_eq!(first.spot(1).1, 8 << 13);
        // One token more: more than a 32nd, a 256th of room (planned_size).
        let second = plan(&growing_step(9, true), Some(&first), high);
        assert_eq!(second.spot(1).1, (9 << 13) + 256);
        assert!(second.grows_on(&growing_step(10, true)));
        assert!(
            !second.has_room_ahead(),
            "one plan of a growing step is no row"
        );
        // Grown at the second plan in a row: room for eight more tokens, at most half its size.
        let mut third = plan(&growing_step(10, true), Some(&second), high);
        assert!(third.has_room_ahead());
        assert_eq!(third.spot(1).1, (10 << 13) + (10 << 13) / 2);
        // The temporaries that did not grow and the cache apart get none.
        assert_eq!(third.spot(0).1, 1 << 16);
        assert_eq!(third.spot(3).1, 10 << 13);
        // Steps up to fifteen tokens fit it: no plan again for five steps.
        assert!(!third.larger(&growing_step(15, true)));
        third.forget_growth();
        assert!(third.larger(&growing_step(16, true)));
        // Growing by a 32nd or less, a step gets room for 32 such steps from its first plan
        // (planned_size; at most an eighth), and the next one fits it: no row.
        let slow = plan(&growing_step(200, false), None, high);
        let slow = plan(&growing_step(201, true), Some(&slow), high);
        assert_eq!(slow.spot(1).1, (201 << 13) + (201 << 13) / 8);
        assert!(!slow.has_room_ahead());
        let slow = plan(&growing_step(202, true), Some(&slow), high);
        assert!(!slow.grows_on(&growing_step(203, true)));
        // The same plans in a cache that has held little: that room would be more than a 32nd of
        // it, and the plan gets none.
        let small = 32 * (10 << 12) - 1;
        let second = plan(&growing_step(9, true), Some(&first), small);
        let third = plan(&growing_step(10, true), Some(&second), small);
        assert!(!third.has_room_ahead());
        assert_eq!(third.spot(1).1, (10 << 13) + 256);
        // A step of another order is no row: the count starts again.
        let other = plan(&growing_step(11, false), Some(&third), high);
        assert!(!other.grows_on(&growing_step(12, true)));
    }

    #[test]
    fn a_plan_of_a_step_that_grew_a_few_positions_keeps_the_others_where_they_were() {
        // Eight arrays, each dropping at the tick given; then the same step with one or three
        // of them larger.
        let ends = [3, 2, 5, 6, 6, 7, 8, 8];
        let sizes = [64, 32, 16, 64, 8, 32, 16, 8].map(|k: usize| k << 10);
        let step = |grown: &[usize]| -> Vec<Rec> {
            (0..8)
                .map(|k| {
                    let more = if grown.contains(&k) { 32 << 10 } else { 0 };
                    matched(sizes[k] + more, ends[k], k as u32)
                })
                .collect()
        };
        let high = 64 << 20;
        let first = plan(&step(&[]), None, high);
        let disjoint = |l: &Layout| {
            (0..8u32).all(|i| {
                (i + 1..8).all(|j| {
                    let ((a, m), (b, n)) = (l.spot(i), l.spot(j));
                    // Position j comes after i: they meet when i is still alive at j's tick.
                    l.spots[i as usize].end <= j || a + m <= b || b + n <= a
                })
            })
        };
        assert!(disjoint(&first));
        // One of eight grew: the seven others keep their offsets.
        let one = plan(&step(&[3]), Some(&first), high);
        assert!(disjoint(&one));
        for k in (0..8).filter(|&k| k != 3) {
            assert_eq!(one.spot(k).0, first.spot(k).0, "position {k} moved");
        }
        assert!(one.spot(3).1 >= (96 << 10));
        // Three of eight: more than a quarter would move, and the step is placed again whole.
        let three = plan(&step(&[1, 3, 5]), Some(&first), high);
        assert!(disjoint(&three));
        assert!(
            first
                .kept_in(&three.spots, &(0..8).collect::<Vec<_>>(), &[])
                .is_none()
        );
    }

    #[test]
    fn an_array_apart_in_two_steps_is_matched_whatever_its_size() {
        // The first step: a cache of keys and values (apart), then scratch.
        let first = vec![rec(4096, OPEN), rec(1024, 2)];
        let once = Layout::new(&first, None);
        // Matched with the apart position in the next step: it recurs.
        let second = vec![matched(8192, OPEN, 0), matched(1024, 2, 1)];
        let mut twice = Layout::new(&second, Some(&once));
        // A much smaller one (a shorter prompt's), near the scratch's size, still takes it,
        // and the scratch its own.
        assert_eq!(twice.next(600, 0), (Serve::Apart, 0));
        assert_eq!(twice.next(1024, 1), (Serve::At(0), 1));
        // Apart in one step only, it is skipped for the scratch's position.
        let mut once = once;
        assert_eq!(once.next(600, 0), (Serve::At(0), 1));
    }

    /// A first training step: scratch, then its optimizer's state (`state_per_param` arrays the
    /// size of each parameter, apart), then temporaries the size of each parameter.
    fn first_training_step(params: &[usize], state_per_param: usize) -> Vec<Rec> {
        let mut first = vec![rec(256, 1)];
        for &p in params {
            first.extend((0..state_per_param).map(|_| rec(p, OPEN)));
        }
        let n = first.len() as u32;
        first.extend(
            params
                .iter()
                .enumerate()
                .map(|(k, &p)| rec(p, n + k as u32 + 1)),
        );
        first
    }

    /// The next step's scratch, then its temporaries, as large as the state's arrays: each
    /// takes the placed position `from + k` past the state.
    fn temporaries_skip_the_state(l: &mut Layout, params: &[usize], from: u32) {
        assert!(at(l, 256).is_some());
        l.dropped(0, 1);
        for (k, &p) in params.iter().enumerate() {
            let (serve, pos) = l.next(p, 1 + k as u32);
            assert!(
                matches!(serve, Serve::At(_)) && pos == from + k as u32,
                "{k}: {serve:?} at {pos}"
            );
            l.dropped(pos, 2 + k as u32);
        }
    }

    #[test]
    fn a_long_run_apart_is_skipped_for_the_placed_position_after_it() {
        // Two arrays of state for each of four parameters: the run of eight apart is skipped.
        let params = [4096, 1024, 4096, 2048];
        let mut l = Layout::new(&first_training_step(&params, 2), None);
        temporaries_skip_the_state(&mut l, &params, 9);
        assert!(l.skipped);
        // Four apart in a row (a layer's keys and values): matched as they are.
        let mut l = Layout::new(&first_training_step(&params, 1), None);
        assert!(at(&mut l, 256).is_some());
        assert_eq!(l.next(4096, 1), (Serve::Apart, 1));
    }

    #[test]
    fn arrays_apart_made_again_after_a_skipped_run_recur() {
        // Nine arrays that outlive the step, then one that drops within it.
        let sizes = [1024, 4096, 2048, 1024, 1024, 2048, 4096, 1024, 1024];
        let n = sizes.len() as u32;
        let mut first: Vec<Rec> = sizes.iter().map(|&b| rec(b, OPEN)).collect();
        first.push(rec(1280, n + 1));
        let mut l = Layout::new(&first, None);
        // The next step's first array skips the run as a first step's optimizer state...
        assert_eq!(l.next(1024, 0), (Serve::At(0), n));
        // ...and the step makes the same arrays again, matched with no position.
        let mut again = first.clone();
        again[0].planned = n;
        l.end_step();
        let mut l = Layout::new(&again, Some(&l));
        // The first is the placed position's, the others the run's made again: they recur.
        let recurs: Vec<bool> = l.spots.iter().map(Spot::recurs).collect();
        let mut expected = vec![true; sizes.len()];
        expected[0] = false;
        expected.push(false);
        assert_eq!(recurs, expected);
        // So the step after is matched with them one by one, and follows the plan.
        for (k, &size) in sizes.iter().enumerate() {
            assert_eq!(l.next(size, k as u32), (Serve::Apart, k as u32));
        }
        assert_eq!(l.next(1280, n), (Serve::At(0), n));
    }

    #[test]
    fn an_optimizer_state_longer_than_a_skip_is_skipped_whole() {
        // Adam's state of 150 parameters: 300 arrays apart, past `MAX_SKIP`.
        let params: Vec<usize> = (0..150).map(|k| 1024 << (k % 3)).collect();
        let state = 1 + 2 * params.len() as u32;
        assert!(state > 1 + MAX_SKIP);
        let mut l = Layout::new(&first_training_step(&params, 2), None);
        temporaries_skip_the_state(&mut l, &params, state);
    }

    #[test]
    fn an_array_apart_is_skipped_only_for_a_later_position_near_the_request() {
        let first = vec![rec(65536, OPEN), rec(1024, 2), rec(4096, 3)];
        // 1024 is not near 65536 but is the next placed position's size: skipped.
        let mut l = Layout::new(&first, None);
        assert_eq!(l.next(1024, 0), (Serve::At(0), 1));
        assert!(l.skipped);
        // 256 is near neither: the position apart takes it.
        let mut l = Layout::new(&first, None);
        assert_eq!(l.next(256, 0), (Serve::Apart, 0));
        assert!(!l.skipped);
    }

    #[test]
    fn a_position_that_grew_a_little_is_planned_with_room() {
        // Grew by 256 on 64 KiB: room for 32 more such steps.
        assert_eq!(planned_size(65536, Some(65280)), 65536 + 32 * 256);
        // The room is at most an eighth.
        assert_eq!(planned_size(8192, Some(7936)), 8192 + 1024);
        // Grew a lot: a 256th more, in whole alignment units (none below 64 KiB).
        assert_eq!(planned_size(65536, Some(16384)), 65536 + 256);
        assert_eq!(planned_size(131072 + 512, Some(65536)), 131072 + 512 + 512);
        assert_eq!(planned_size(32768, Some(1024)), 32768);
        // Shrank, or new: the larger size, no room.
        assert_eq!(planned_size(4096, Some(65536)), 65536);
        assert_eq!(planned_size(4096, None), 4096);
    }

    #[test]
    fn a_step_outgrows_the_block_when_matched_in_order_and_larger_in_all() {
        let mut l = Layout::new(&[rec(1024, 1), rec(1024, 2), rec(512, OPEN)], None);
        assert_eq!(l.footprint, 1024);
        let larger = [matched(1536, 1, 0), matched(1024, 2, 1)];
        assert!(l.outgrown(&larger, 1024));
        // Not when the block holds that ratio, nor when matched out of order (each record
        // another step's, as far as the layout knows).
        assert!(!l.outgrown(&larger, 2048));
        let shifted = [matched(1536, 1, 0), matched(1024, 2, 2)];
        l.forget_growth();
        assert!(!l.outgrown(&shifted, 1024));
        let smaller = [matched(512, 1, 0), matched(1024, 2, 1)];
        l.forget_growth();
        assert!(!l.outgrown(&smaller, 1024));
    }

    #[test]
    fn a_step_outgrows_the_block_when_its_largest_array_grew_past_it() {
        // Two images, then their batch (the largest array), then a layer.
        let recorded = [rec(1024, 3), rec(1024, 3), rec(4096, 4), rec(4096, 5)];
        let mut l = Layout::new(&recorded, None);
        // The images the same, the batch 1.5x: 1.25x in all.
        let larger = [
            matched(1024, 3, 0),
            matched(1024, 3, 1),
            matched(6144, 4, 2),
        ];
        let footprint = l.footprint;
        let at = |ratio: f64| (footprint as f64 * ratio) as usize;
        // A block 1.4x the footprint holds the total's ratio, not the batch's.
        let block = at(1.4);
        assert!(l.outgrown(&larger, block));
        l.forget_growth();
        assert!(
            !l.outgrown(&larger, at(1.6)),
            "a block that holds both ratios"
        );
        // The total alone, as before, said the step fits.
        l.forget_growth();
        let ((asked, planned), _) = l.growth(&larger).unwrap();
        assert!(asked * footprint as u128 <= planned * block as u128);
        // An image larger, the batch the same: the total's ratio alone, 7/6.
        let images = [
            matched(2048, 3, 0),
            matched(1024, 3, 1),
            matched(4096, 4, 2),
        ];
        l.forget_growth();
        assert!(l.outgrown(&images, at(1.1)) && !l.outgrown(&images, at(1.2)));
    }

    /// Three layers of 64 KiB, each alive until the next but one is made.
    fn layers() -> Vec<Rec> {
        vec![rec(65536, 2), rec(65536, 3), rec(65536, 4)]
    }

    #[test]
    fn an_extra_small_array_leaves_the_next_position_to_the_next_allocation() {
        let mut l = Layout::new(&layers(), None);
        assert!(matches!(l.next(65536, 0).0, Serve::At(_)));
        // A scalar where the second layer is expected (an empty workspace): served apart.
        assert_eq!(l.next(256, 1), (Serve::Extra, NONE));
        assert!(peek(&mut l, 256, 2).is_none(), "not on the hit path either");
        assert_eq!(l.next(65536, 2).1, 1, "the second layer takes its position");
        assert_eq!(l.next(65536, 3).1, 2);
        assert!(l.end_step(), "followed: no plan is made again for it");
    }

    #[test]
    fn a_small_position_the_step_does_not_make_is_skipped() {
        // A scalar between the first two layers in the recorded step only.
        let mut recorded = layers();
        recorded.insert(1, rec(256, 2));
        let mut l = Layout::new(&recorded, None);
        assert!(matches!(l.next(65536, 0).0, Serve::At(_)));
        assert_eq!(l.next(65536, 1).1, 2, "the scalar's position is skipped");
        assert_eq!(l.next(65536, 2).1, 3);
        for k in [0, 2, 3] {
            l.dropped(k, 3);
        }
        assert!(
            l.end_step(),
            "a small position skipped is no reason to plan again"
        );
        // A step that makes it takes it.
        assert!(matches!(l.next(65536, 0).0, Serve::At(_)));
        assert_eq!(l.next(256, 1).1, 1);
    }

    #[test]
    fn small_arrays_are_told_apart_at_the_scale_of_their_step() {
        // Recorded with a batch of 48: a layer and an array of 48 x 128 bytes.
        let recorded = vec![rec(48 * 4096, 2), rec(48 * 512, 3), rec(48 * 4096, 4)];
        // A batch of 1: its 512 bytes are the same array, 48 times smaller.
        let mut l = Layout::new(&recorded, None);
        assert!(matches!(l.next(4096, 0).0, Serve::At(_)));
        assert_eq!(l.next(512, 1).1, 1);
        // A step of another kind (its first allocation 1/192 of the recorded one's): its
        // sizes say nothing of extra arrays, which take the positions as they come.
        let mut l = Layout::new(&recorded, None);
        assert!(matches!(l.next(1024, 0).0, Serve::At(_)));
        assert_eq!(l.next(256, 1).1, 1);
    }

    #[test]
    fn a_step_with_small_arrays_extra_and_missing_may_still_outgrow_and_scale() {
        let mut recorded = layers();
        recorded.insert(1, rec(256, 2));
        let l = Layout::new(&recorded, None);
        // Twice as large, one scalar extra and the recorded one missing.
        let larger = [
            matched(2 * 65536, 2, 0),
            matched(256, 2, NONE),
            matched(2 * 65536, 3, 2),
        ];
        assert!(l.outgrown(&larger, l.footprint));
        assert!(l.scales(&larger));
        // A larger position skipped: not matched in order.
        let skipped = [matched(2 * 65536, 2, 0), matched(2 * 65536, 3, 3)];
        assert!(!l.outgrown(&skipped, l.footprint));
    }

    /// Whether two positions' planned lifetimes overlap.
    fn overlap_in_time(l: &Layout, a: usize, b: usize) -> bool {
        let life = |k: usize| l.spots[k].lifetime(k as u32);
        life(a).overlaps(&life(b))
    }

    #[test]
    fn a_plan_scaled_as_its_step_grew_still_keeps_arrays_alive_together_apart() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (mut whole, mut rest_only) = (0, 0);
        for _ in 0..300 {
            let n = rng.u32(2..42);
            let record: Vec<Rec> = (0..n)
                .map(|k| {
                    let end = if rng.u8(0..8) == 0 {
                        OPEN
                    } else {
                        rng.u32(k + 1..=n)
                    };
                    rec(512 * rng.usize(1..=64), end)
                })
                .collect();
            let mut l = Layout::new(&record, None);
            if l.footprint == 0 {
                continue;
            }
            l.confirmed = true;
            // The next step grew by 1 + g/8 so far, position by position; its latest
            // allocation, at position `from`, is the first of the rest.
            let g = rng.usize(1..=16);
            let seen = rng.usize(1..=n as usize);
            let from = seen - 1;
            let grown: Vec<Rec> = record[..seen]
                .iter()
                .enumerate()
                .map(|(k, r)| matched(r.bytes + r.bytes * g / 8, r.end, k as u32))
                .collect();
            let ((asked, planned), _) = l.growth(&grown).unwrap();
            let old = l.spots.clone();
            let before = l.footprint;
            if asked <= planned {
                assert!(!l.scale(&grown, from as u32, 0, Margin::default()));
                continue;
            }
            assert!(l.scale(&grown, from as u32, 0, Margin::default()));
            // Placed again, the rest is the plan of this step only; else the whole plan is
            // scaled, and holds the whole step in the ratio it grew.
            let first = if l.one_step() {
                rest_only += 1;
                from
            } else {
                whole += 1;
                assert!(l.footprint as u128 * planned >= before as u128 * asked);
                0
            };
            for (a, (&sa, was)) in l.spots.iter().zip(&old).enumerate().skip(first) {
                if sa.apart {
                    continue;
                }
                // Each position takes its size in the step's ratio (placed again), or the
                // range its bytes map to (scaled whole, or closed up: both ends rounded to the
                // alignment).
                let slack = planner::ALIGN as u128 * planned;
                assert!(sa.size as u128 * planned + slack >= was.size as u128 * asked);
                assert!(sa.offset + sa.size <= l.footprint);
                for b in a + 1..l.spots.len() {
                    let sb = l.spots[b];
                    if !sb.apart && overlap_in_time(&l, a, b) {
                        assert!(
                            sa.offset + sa.size <= sb.offset || sb.offset + sb.size <= sa.offset,
                            "positions {a} and {b} share bytes after scaling"
                        );
                    }
                }
            }
        }
        assert!(whole > 20 && rest_only > 20, "{whole} {rest_only}");
    }

    #[test]
    fn the_rest_of_a_step_scaled_leaves_out_the_arrays_made_before_it() {
        // a lives through the step; b and c take turns above it.
        let record = [rec(1024, 3), rec(512, 2), rec(512, 3)];
        let mut l = Layout::new(&record, None);
        assert_eq!(l.footprint, 1536);
        l.confirmed = true;
        // Twice as large so far; a went apart, b is served now: b and c (twice as large) share
        // their bytes, a's place taken out below them.
        let grown = [matched(2048, OPEN, 0), matched(1024, OPEN, 1)];
        assert!(l.scale(&grown, 1, 0, Margin::default()));
        assert!(l.one_step());
        let ((b, b_size), (c, c_size)) = (l.spot(1), l.spot(2));
        assert_eq!((b, c), (0, 0));
        assert!(b_size >= 1024 && c_size >= 1024);
        assert_eq!(l.footprint, b_size.max(c_size));
        // Scaled from its first position on, nothing is kept for an array made before: the
        // whole plan is scaled, a valid plan for the steps after.
        let mut l = Layout::new(&record, None);
        l.confirmed = true;
        assert!(l.scale(&grown[..1], 0, 0, Margin::default()));
        assert!(!l.one_step() && l.footprint >= 3120);
        // With room for the plan scaled whole under the most the cache has held, nothing is
        // saved by placing the rest again.
        let mut l = Layout::new(&record, None);
        l.confirmed = true;
        assert!(l.scale(&grown, 1, 4096, Margin::default()));
        assert!(!l.one_step() && l.footprint >= 3120);
    }

    #[test]
    fn a_plan_scaled_tells_the_first_size_it_holds_and_unscales_to_what_it_was() {
        let record = [rec(1024, 3), rec(512, 2), rec(512, 3)];
        let mut l = Layout::new(&record, None);
        l.confirmed = true;
        let was: Vec<(usize, usize)> = (0..3).map(|k| l.spot(k)).collect();
        let footprint = l.footprint;
        assert!(l.scale(&[matched(2048, OPEN, 0)], 0, 0, Margin::default()));
        // Twice as large, a 64th more, aligned: a step whose first array is twice as large is
        // of the size it holds.
        assert!(l.first_size() >= 2048 && l.first_size() < 2 * 2048);
        assert!(l.footprint >= 2 * footprint);
        l.unscale();
        assert_eq!((0..3).map(|k| l.spot(k)).collect::<Vec<_>>(), was);
        assert_eq!((l.footprint, l.first_size()), (footprint, 1024));
        // Once only: a second call leaves it as it is.
        l.unscale();
        assert_eq!(l.footprint, footprint);
    }

    #[test]
    fn a_plan_is_scaled_only_for_a_step_that_grew_in_order() {
        let mut l = Layout::new(&step(), None);
        // Made from a cold start and followed by no step: at most twofold.
        l.cold = true;
        assert!(
            !l.scale(&[matched(1024, 2, 0)], 0, 0, Margin::default()),
            "fourfold on a cold plan"
        );
        // Each record another step's, as far as the layout knows.
        l.forget_growth();
        assert!(
            l.scale(&[matched(512, 2, 0)], 0, 0, Margin::default()),
            "twofold"
        );
        assert!(l.footprint >= 2 * 768 && l.spot(0).1 >= 512);
        let mut l = Layout::new(&step(), None);
        assert!(
            !l.scale(&[matched(256, 2, 0)], 0, 0, Margin::default()),
            "not larger"
        );
        l.forget_growth();
        assert!(
            !l.scale(&[matched(512, 2, 1)], 1, 0, Margin::default()),
            "out of order"
        );
        l.confirmed = true;
        l.cold = true;
        l.forget_growth();
        assert!(
            l.scale(&[matched(1024, 2, 0)], 0, 0, Margin::default()),
            "a confirmed plan scales fourfold"
        );
        // More than 64 times larger: a step of another kind, not this one larger.
        let mut l = Layout::new(&step(), None);
        assert!(
            !l.scale(&[matched(256 * 65, 2, 0)], 0, 0, Margin::default()),
            "65-fold"
        );
        l.forget_growth();
        assert!(
            l.scale(&[matched(256 * 64, 2, 0)], 0, 0, Margin::default()),
            "64-fold"
        );
        // Larger in all, but less than half of the largest position so far: another step's
        // arrays.
        let plan = [rec(1024, 2), rec(4096, 3), rec(1024, 3)];
        let mut l = Layout::new(&plan, None);
        let shrunk = [matched(8192, 2, 0), matched(1024, 3, 1)];
        assert!(
            !l.scale(&shrunk, 1, 0, Margin::default()),
            "its largest array a quarter of its position"
        );
        l.forget_growth();
        let grown = [matched(8192, 2, 0), matched(4096, 3, 1)];
        assert!(
            l.scale(&grown, 1, 0, Margin::default()),
            "its largest array as planned"
        );
    }

    #[test]
    fn a_plan_holds_a_step_that_matched_it_in_order_within_its_sizes() {
        let l = Layout::new(&step(), None);
        let same = [
            matched(256, 2, 0),
            matched(512, 3, 1),
            matched(100, 4, 2),
            matched(4096, OPEN, 3),
        ];
        assert!(l.holds(&same));
        let mut larger = same;
        larger[1].bytes = 768;
        assert!(!l.holds(&larger), "larger than its position");
        let mut died = same;
        died[3].end = 4;
        assert!(!l.holds(&died), "planned apart, died in the step");
        assert!(!l.holds(&same[..3]), "ended early");
        let mut shifted = same;
        shifted[2].planned = 3;
        assert!(!l.holds(&shifted), "out of order");
    }

    #[test]
    fn a_block_is_held_by_an_array_planned_to_live_past_an_eighth_of_the_rest() {
        // Of 18 positions, a lives to tick 4 (past the first eighth of the rest after tick 1,
        // 1 + 17/8 = 3), b to tick 3.
        let mut record = vec![rec(256, 4), rec(256, 3)];
        record.extend((2..18).map(|t| rec(256, t + 1)));
        let mut l = Layout::new(&record, None);
        assert!(at(&mut l, 256).is_some());
        assert!(l.held_long(1), "a ends at 4, past 1 + 17/8");
        l.dropped(0, 1);
        assert!(at(&mut l, 256).is_some());
        assert!(!l.held_long(1), "b ends at 3");
    }

    #[test]
    fn the_kind_of_a_step_is_its_count_or_its_first_size() {
        let l = Layout::new(&step(), None);
        assert_eq!(l.first_size(), 256);
        let same_count = [rec(256, 1), rec(1, 2), rec(1, 3), rec(1, 4)];
        assert!(l.same_kind(&same_count));
        assert!(l.same_kind(&[rec(400, 1)]), "first within a factor of two");
        assert!(
            !l.same_kind(&[rec(512, 1), rec(8192, 2)]),
            "one more large array"
        );
        assert!(!l.same_kind(&[]));
    }

    #[test]
    fn a_run_of_positions_apart_is_a_first_steps_state_and_a_far_larger_array_another() {
        // A 64 KiB array, 8 KiB, then eight kept (apart) and one more, then two kept.
        let mut record = vec![rec(65536, 1), rec(8192, 2)];
        record.extend((0..8).map(|_| rec(4096, OPEN)));
        record.push(rec(4096, 11));
        record.extend((0..2).map(|_| rec(4096, OPEN)));
        let mut l = Layout::new(&record, None);
        assert!(!l.in_state_run(1), "placed");
        assert!((2..10).all(|k| l.in_state_run(k)), "a run of eight");
        assert!(
            !l.in_state_run(10) && !l.in_state_run(11),
            "placed, or a run of two"
        );
        assert!(!l.in_state_run(99));
        // At the scale of a step whose first array is half the recorded one's, 8 KiB is
        // expected as 4 KiB: 64 times that is the same array grown, more is another.
        assert!(!l.another_array(8192, 1 << 20), "no step yet: no scale");
        assert!(at(&mut l, 32768).is_some());
        assert!(!l.another_array(8192, 64 * 4096));
        assert!(l.another_array(8192, 64 * 4096 + 1));
    }

    #[test]
    fn steps_whose_counts_of_larger_arrays_differ_are_of_different_kinds() {
        // `big` arrays of 4 KiB, then 2 small ones.
        let steps = |big: u32| -> Vec<Rec> {
            (0..big + 2)
                .map(|k| rec(if k < big { 4096 } else { 512 }, k + 1))
                .collect()
        };
        let l = Layout::new(&steps(128), None);
        assert!(l.same_kind(&steps(128)));
        // Within a 64th of 128: as many allocations, or a first within a factor of two.
        assert!(l.same_kind(&steps(126)));
        assert!(l.same_kind(&steps(130)));
        // Three fewer or more: another kind, however alike the first allocations.
        assert!(!l.same_kind(&steps(125)));
        assert!(!l.same_kind(&steps(131)));
        // Small arrays do not count.
        let mut more_small = steps(128);
        more_small.extend((0..40).map(|k| rec(256, 131 + k)));
        assert!(l.same_kind(&more_small));
        assert!(!Layout::new(&[rec(65536, 1)], None).same_kind(&[rec(256, 1)]));
    }

    #[test]
    fn clearing_the_live_positions_frees_them_all() {
        let mut l = Layout::new(&step(), None);
        assert!(at(&mut l, 256).is_some());
        l.end_step();
        assert_eq!(l.next(256, 0).0, Serve::Diverged, "still taken");
        l.end_step();
        l.clear_live();
        assert!(at(&mut l, 256).is_some());
    }

    #[test]
    fn a_margin_learned_holds_the_array_that_lacked_it() {
        let m = Margin::default();
        let scaled = |m: Margin, x: usize| m.of(x as u128) as usize;
        // 1% over its place in a plan scaled with a 64th: the next plan scaled the same way
        // holds it.
        let place = scaled(m, 100_000);
        let size = place + place / 100;
        let learned = m.learned(size, place);
        assert!(learned.0 > m.0);
        assert!(scaled(learned, 100_000) >= size);
        assert!(
            scaled(Margin(learned.0 - 1), 100_000) < size,
            "no more than it lacked"
        );
        // Not from an array that fits, nor one more than an eighth over its place (another
        // array), and never past an eighth in all.
        assert_eq!(m.learned(place, place), m);
        assert_eq!(m.learned(place + place / 8 + 1, place), m);
        let mut m = m;
        for _ in 0..20 {
            m = m.learned(place + place / 9, place);
        }
        assert_eq!(m, Margin(MARGIN_UNIT / 8));
    }
}

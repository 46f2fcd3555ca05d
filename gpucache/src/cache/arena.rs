//! Planned caches ([`KeyPolicy::Planned`](crate::KeyPolicy::Planned), the default): a step's
//! arrays share one block per device, laid out from the step's own recorded lifetimes.
//!
//! # A step, its record and its plan
//!
//! Per device, a cache counts the allocations of the current step (the time between two exits of
//! its outermost scope): the k-th is *position* k. It records every position's aligned size
//! and the tick its array dropped ([`layout::Rec`]). The first step has no plan: every array gets
//! a block of its own from the device (*solo*), freed when it drops, so the step holds exactly
//! what its arrays need at once. At the step's end the record becomes a plan ([`Layout`]): an
//! offset per position in one block, the arrays that outlived the step left apart. Later steps
//! follow it: position k gets a view of the plan's block at its offset when
//! [`Layout::serve`] says it may (no larger than planned, no array alive over those bytes).
//! Else the step is marked *diverged*, and is planned again at its end, with each position's
//! largest size. Until then, a step that outgrew the plan (matched with it position by position,
//! and larger than the block allows, in all or in the ratio it would be scaled in: its largest
//! array's, when that grew; [`Layout::outgrown`]) gets solo blocks while the plan's block is in
//! use, and the block goes back to the device once no array uses it; then the plan, scaled by
//! that ratio ([`Layout::scale`]; its rest placed again when the arrays made before would keep
//! bytes of it unused), a [`Margin`] more
//! (raised when a step's array missed its scaled place: [`DeviceArena::learn_margin`]), serves the
//! rest of the step from one new block (the plan as it is, when by then the step no longer asks for
//! more than the plan holds). The scaled plan stays the plan if it held the step as it was
//! ([`Layout::holds`]: its offsets, and the views made at them, stay); else the next plan keeps the
//! block when it fits. Any other step (another order, extra or missing allocations, an array kept
//! alive) is served from the block's free ranges ([`Gaps`]: best fit, each array toward the end of
//! the block where the plan placed its position, so that the plan's long-lived arrays keep together
//! as it arranged them; from the bottom only in a step that outgrew its plan and is served from its
//! block), and so is a step that outgrew its plan when waiting for the block would cost too much:
//! arrays planned to live past the first eighth of the rest of the step hold it (a training step's
//! forward pass, an attention mask; but first, then and whenever waiting for the arrays that hold
//! it would send half the footprint apart, [`Layout::waits_past_half`], the plan scaled as the step
//! grew is placed again for the rest of the step, around the arrays alive in the block, each until
//! its planned end, and serves it from the block, grown in place if need be, when that needs no
//! more bytes than the plan scaled whole: [`Layout::scale_around`], [`DeviceArena::rest_around`]),
//! or half the plan's footprint went apart while waiting, or by the time the block is unused the
//! step can no longer follow the plan scaled (it left the plan's order, or passed its middle; the
//! block goes back after all if it holds nothing when an array apart would take the cache past its
//! peak). An allocation the gaps cannot hold gets a solo block; the gaps close for it only when no
//! array uses the block and the plan can be scaled (then the block goes back, and the scaled plan
//! serves the rest). A plan made again is merged with the old one position by position (each
//! position's largest size) when the step matched it so, but not when the merged plan would hold an
//! eighth more than both the old plan and the step's peak (as many allocations in another
//! arrangement). So a fixed-shape loop settles on one plan after its second step, and a loop whose
//! sizes vary settles on one that fits its largest step, with one block allocated per step larger
//! than every one before it rather than one per array.
//!
//! # Positions that grow, and kinds of step
//!
//! A position larger than planned does not always make the step leave its plan: while the
//! arrays that outgrew their positions this step stay within a [`GROWN_BUDGET`]th of the
//! footprint, each goes apart on its own and the step stays on the plan, which is made again at
//! its end. Not one of at least a [`GROWN_SHARE`]th of the footprint that, apart, would take the
//! cache past the most it has held (a larger batch's input): the step leaves its plan at once, to
//! be served from the plan scaled as it grew, the array included; nor, once the arrays grown this
//! step pass that share together, while the plan's block is unused and the plan can be scaled (a
//! longer sequence, grown everywhere in small arrays). A position that grew by at most a
//! thirty-second since the last plan is planned with room for 32 more such steps (at most an
//! eighth more): a decoder's attention over the tokens so far grows every step, and would
//! otherwise outgrow every plan. One that grew by more is planned a 256th larger: steps whose
//! sizes vary come again a little larger than the largest before. A step that grew so at two
//! plans in a row (aligned with each, its k-th allocation at the k-th position) is planned with
//! room for eight more steps of each position's average growth, at most half the position, when
//! that room is at most a 32nd of the most the cache has held (`layout::growth_ahead`: a
//! decoder's first tokens grow its attention by more than a 32nd a step). Nor in a step short
//! of its plan ([`DeviceArena::short_of_plan`], a step of another kind): a position larger than
//! planned there is out of line, and the step leaves its plan for the block's gaps.
//!
//! Apart is the block's *tail* when it holds the array (the bytes past the plan's footprint in a
//! block kept for a larger plan, less the pins; [`Plan::tail`]), else a range of a [`Room`] (see
//! below), else a solo block; so for a position over pinned bytes ([`Serve::Blocked`]). The
//! tail costs no memory (the block is held anyway) and no device allocation. It serves nothing
//! in a step larger in all than its positions so far ([`Layout::larger`]): such a step may
//! outgrow the block, which must then be free to go back. A tail array alive at the step's end
//! has the step planned again, to be pinned; one alive when the step leaves its plan is the
//! gaps' from then on.
//!
//! A step's small arrays ([`layout::SMALL`]: a scalar, a few indices) come and go where its
//! larger ones do not (cuDNN's empty workspaces, with the batch): one more or one fewer would
//! shift every later allocation off its position. So a small array where the plan expects a
//! much larger one (at the step's scale: its first allocation over the plan's first position)
//! is *extra*: it goes apart, and the position waits for the next allocation; a small position
//! the step does not make is skipped ([`Layout::next`]). Neither makes the plan be made again.
//! An extra array's solo block stays as a spare when its array drops, for the next one.
//!
//! One scope may run steps of several kinds: a server's prompt steps and decoding steps, a CNN's
//! batches whose convolutions cuDNN runs with other algorithms. A step is of its plan's kind when
//! it made as many arrays larger than small, but for a 64th, and as many allocations or a first
//! allocation within a factor of two of the recorded step's first ([`Layout::same_kind`]); a step
//! of another kind is planned apart from it, and the old plan goes on a *shelf* (32 at most, the
//! least recently used going first, but never the one of the largest footprint: a step larger than
//! every shelved kind's first allocation is served by it, where a smaller plan would leave it to
//! the gaps). The plans share the device's one block. At a step's first allocation, the plan whose
//! recorded first allocation fits it most tightly is switched in (only when no array uses the block
//! but pins, and the plan fits the block: a plan knows only its own arrays' positions, and its
//! positions over the pins are served apart until they drop); none fitting, the largest, one made
//! from a cold start last. A plan scaled for a step of another kind is shelved as it was before
//! ([`Layout::unscale`]). A step of the same kind whose plan comes out much smaller (a smaller
//! batch in another order) also shelves the old plan, for the larger steps. The block is kept while
//! the plans fit it; a step that outgrows it gives it back. A step that follows its plan in order
//! and ends early (an evaluation step that begins as the training step it alternates with) is not
//! planned again: the plan holds it. Nor is a step that left its plan within its block, much
//! smaller than the plan (its peak a quarter below the footprint), unlike the last four such steps
//! (its sizes in their order, as a [signature](layout::signature)), with no array of the block
//! alive at its end: a smaller batch of a CNN whose cuDNN workspaces come in another order, which
//! the next step, another batch, would leave again; planning it cost a plan and a switch of plans
//! every step. It is remembered, so that a kind that comes again soon (steps taking turns, a new
//! batch size from now on) is planned. A step of the plan's kind that left it by the order of
//! its allocations (it did not outgrow it), with another first allocation, is planned merged
//! with the plan the first time; when a step of the same sizes in the same order does so again,
//! it is a kind of its own that comes again (a batch size of a CNN whose cuDNN workspaces come
//! elsewhere): it gets a plan of its own, and the old plan is shelved
//! ([`DeviceArena::recurs_reordered`]), so that once each batch size came twice, every step
//! follows its own plan.
//!
//! Arrays that outlive their step (apart) are matched by position too. One apart in the recorded
//! step and not near the request's size is skipped only when a later position is near it (a
//! training step's first step makes its optimizer state in the middle of the step, the next steps
//! do not); one apart in two steps running (a cache of keys and values) is never skipped, whatever
//! its size; nor is one the step it was skipped in made again, of its size and matched with no
//! position ([`Layout::state_made_again`]: a step whose first arrays all outlive it took its first
//! array past them, as a first step's optimizer state, left its plan there, and was planned the
//! same way again). In a step that left its plan, an allocation matched with a run of such
//! positions (a first step's optimizer state, [`Layout::in_state_run`]) is another array, a
//! temporary: the gaps serve it. And an allocation far larger than its placed position expects at
//! the step's scale ([`Layout::another_array`]) is another array, not the position's grown: the
//! step leaves its plan there.
//!
//! Arrays planned apart (they outlived the recorded step) get solo blocks rounded up to their size
//! class; one that grew past its recorded size, and is small beside the most the cache has held (a
//! decoder's cache of keys and values, a token longer every step), with room for as much again as
//! it grew since the plan, up to half its size ([`DeviceArena::apart_capacity`]), so that the
//! blocks made for it grow rarer as it grows. When such a block's array drops in a later step than
//! it was made in (or, for a small array, in the step it was made in while a plan serves the
//! steps), the block is kept as a *spare*, for the next solo array it fits (at most four times as
//! large as the array or as its position's recorded size, so that a server's shorter request takes
//! the blocks a longer one left; at most twice as large as the array when a new block would take
//! the cache past the most it has held); one shorter than its recorded size (a server's next
//! request) with room up to that size, at most four times its own, within that mark. Spares stay
//! until a device allocation of the cache would take it past that mark ([`DeviceArena::high`]):
//! then they go back to the device first (the smallest that makes room alone, else the largest,
//! and again: the fewest; small spares stay, at most
//! [`MAX_SMALL_SPARES`]), so that keeping them never raises the cache's peak by more than 32 KiB,
//! and a server's next request finds its predecessor's keys and values however many steps later it
//! comes. In a step a plan serves, a large solo block whose array dropped within the step is a
//! spare too until the step ends, for the step's next arrays apart, and then goes back: such a
//! step's arrays apart come one after another (a detector's step that left its plan serves its
//! largest feature maps apart when no gap holds them; a step over an earlier step's arrays still
//! alive in the block serves the positions over them apart), each a device allocation before.
//! Any other solo block whose array dropped within its step (the first step's) goes back at
//! once: the next plan holds its bytes. A solo block's view spans the whole block, and a spare
//! whose array dropped on the owner thread, used on no other stream, keeps that view
//! ([`Held::Viewed`]): the next array it serves on the same stream takes it again, so a
//! decoder's cache of keys and values, replaced every step, makes no view at all once its spares
//! go round (a spare served on another stream first orders that stream after its earlier work,
//! as a recycled buffer is, and gets a new view there).
//!
//! # Steps served online
//!
//! A scope whose steps never come again (a detector's) leaves every plan made from the step
//! before, and its plans drift up. From the first step that leaves its plan, an
//! [`online::Shadow`] simulates serving the steps *online* on their records; once, after
//! [`ONLINE_AFTER`] steps, the cache's peak (over the most bytes alive at once in a step) is
//! more than an [`ONLINE_MARGIN`]th above the shadow's (over the most bytes it held alive), and
//! the plan's block can grow in place, the scope is served online ([`DeviceArena::online`]):
//! every allocation from the block's free ranges ([`Gaps`], best fit, opened at the step's
//! first allocation around the pins), the block grown at its top when none holds an array
//! ([`online::growth`]), the arrays alive at a step's end pinned where they are
//! ([`online::MAX_ONLINE_PINS`] at most), no plan made. A step whose arrays cannot all be
//! pinned (an array dropped on another thread not settled yet, a view used on another stream)
//! has the plans serve the scope again; `invalidate`, `empty_cache` and out-of-memory recovery
//! forget the shadow and the choice with the plans. A shadow that measured [`SHADOW_STEPS`]
//! steps without the scope going online stops, the next starting later and later (a CNN whose
//! batch varies: its plans hold it better). Nor does a scope go online whose plans held every
//! step since the shadow's first whole when their peak, less the arrays made before the shadow
//! began (which it never sees: a training loop's optimizer state, which made the step that left
//! a cold plan look worse than it was), is within that margin; its shadow stops then, after
//! [`ONLINE_AFTER`] steps (it costs host time at every step it measures). See the `online`
//! module.
//!
//! Small arrays (at most [`layout::SMALL`] bytes: a detector's scores, indices, sizes) kept in
//! the block from earlier steps split its free bytes where best fit put them. Once the block
//! grows while such arrays are in it ([`DeviceArena::tiny_apart`]), every small array of the
//! online steps gets a slot of a *slab* instead ([`DeviceArena::slabs`], the `slab` module: a
//! block of 128 slots of [`layout::SMALL`] bytes, each slot's view kept for its next array): the
//! online block then holds the larger arrays alone. Not before: a scope whose small arrays cost
//! it no growth would pay a device allocation for a slab (MobileNetV3 trained on a varying
//! batch goes online in the second half of one shuffled run, where no device allocation is
//! allowed).
//!
//! # Off the free-list paths
//!
//! A planned cache sets the [`ARENA`] flag of its cell, so it is never
//! [plain](CacheCell::is_plain): the hit path, the release of a dropped array on the owner
//! thread and the scope exit all test that one byte anyway (for closed and traced caches). The
//! hit path sends a cache whose flags are `ARENA` alone to [`CacheCell::plan_hit`] (the next
//! position of a plan the step follows); everything else goes to the slow paths, which serve a
//! planned cache here: an allocation in [`CacheCell::take`], the drop of a view in
//! [`CacheCell::send_view_home`], the end of a step in [`CacheCell::exit_slow`]. The flag stays
//! set while arrays of a planned cache may be alive (after a change of key policy), so that a
//! view always finds its way back here.
//!
//! # Blocks and their arrays
//!
//! An [`ArenaBlock`] holds one device allocation, in an `Arc` allocation of its own. Arrays get
//! *views* of it ([`Block::view`]) whose [`Home`] says where they come from (`slot`:
//! [`VIEW_BASE`] plus the position, or plus [`GAP_BASE`] and the index in the step's record for
//! a view from a gap; `generation`: the number of the step that made them) and
//! whose backend is the arena block: it frees nothing when a view drops, and the view holds no
//! count of its `Arc` (see [`Block::view`]). A plan's block is the cache's until the plan is
//! remade, invalidated or emptied; then, if arrays of it are alive, it is *retired*: owned by
//! those arrays, and freed by the last of them to drop. A solo block is retired from the start.
//!
//! A plan's block retired at a step's end under arrays that hold at least a sixteenth of it (a
//! request's keys and values of the encoder's output) is held by the owner as a *room* (the
//! `room` module): its free bytes serve the arrays served apart, before spares and device
//! allocations, until no array of it is alive.
//!
//! A plan remade keeps its block under arrays still alive there when they are few (at most
//! [`MAX_PINS`]; in a block that can grow, up to [`MAX_SMALL_PINS`] holding at most a
//! [`SMALL_PINS_SHARE`]th of it: an optimizer's state made after the first step, gradients
//! accumulated over micro-batches), small (those pinned this step at most a
//! [`PIN_SHARE`]th of the block; those pinned by an earlier plan stay pins) and all known: served
//! this step, at a position or from the gaps (a training loop's loss, kept until the next step's
//! replaces it, in a step that left its plan). Larger ones, up to half a block that can grow,
//! when the step left its plan and its own arrays needed at least half the block at once
//! ([`LEFT_PIN_SHARE`]: a detector's outputs, kept by the caller into the next step, which needs
//! the block as much). They are the new plan's *pins* ([`DeviceArena::pins_for`]): its
//! positions are placed around them ([`crate::planner::greedy_by_size_around`]), or, when that no
//! longer fits the block, placed as if they were not there, and a position over them is served
//! apart until they drop (the step staying on its plan: [`Serve::Blocked`]); the gaps leave them
//! out; each goes when its array drops (named by its home: the step that made it and its slot; a
//! pin older than [`MAX_PIN_AGE`] steps makes the block leave the plan, since step numbers wrap).
//! Retired under the loss instead, a block of 2.6 GB stayed alive into the next step beside the
//! next plan's new block, every step (MobileNetV3 trained with a varying batch held 2.01x of its
//! peak live bytes; with pins, 1.11x).
//!
//! A position whose array one step keeps past its end and the next drops within it, in steps of
//! the same allocations in the same order as far as both go, no larger than the plan's there
//! (gradients accumulated over micro-batches, one step each: the first micro-batch of an
//! optimizer step makes them and keeps them, the next ones make the same arrays, add them in and
//! drop them, and the last steps the optimizer after them), is *held over*
//! ([`layout::HeldOver`]): placed in the block rather than apart, at the lifetime the step that
//! drops it gave it, while the arrays kept there could all be pinned (as many and as large as
//! pins may be, less the pins of earlier steps; none when the block could not keep the arrays
//! alive in it). A step that keeps them meets one past its planned end at a later position: the
//! rest of the step is placed again around the arrays alive in the block, those held over to the
//! step's end ([`Layout::keep_rest`]; the block grown in place by at most a [`KEPT_REST_GROWTH`]th
//! if need be, else the gaps serve the rest), and follows that layout; at its end they are
//! pinned, and it is planned again around them. Planned apart after the first micro-batch, the
//! next one's temporaries took a device block each at every optimizer step (ResNet-50 on four
//! micro-batches: 60 device allocations after the second step, 23 in the second half; held over,
//! 7 and 3, and 1.033x -> 1.020x of its peak live bytes; ViT-S on two, AdamW: 624 and 352 -> 2
//! and 0, 1.020x -> 1.039x). The rest placed so clears the arrays past their ends
//! ([`Layout::clear_overdue`]): the hit path serves it. A step that drops arrays pinned at
//! positions held over (the optimizer's step) is planned again at its end around the pins still
//! alive, those positions held over to the step's end while the step after such a drop keeps
//! arrays there ([`DeviceArena::kept_after_drop`]): the next first micro-batch follows its plan
//! with no rest placed again, keeps its gradients where the one before did, and the cycle's plans
//! come again (see `DeviceArena::end_step`).
//!
//! A view costs something to make (a backend buffer; on CUDA also a cudarc `CudaSlice` with two
//! events of its own, made at its first use while the context has several streams), so views
//! outlive their arrays: a view spans from its offset to the end of the block, and its
//! length is set to each array's ([`Block::set_view_len`]). When an array drops on the owner
//! thread, its view stays *idle* at its offset: kept for its position, or *loose* (by offset)
//! in a step served from the gaps. The next array at that offset takes it, in this step or a
//! later one. When another layout takes the block (a plan made again, a shelved one switched
//! in), the positions' idle views go loose, and each position of the new layout takes the one
//! at its offset the first time it is served: a switch moves only the views in use, with no
//! search or sort over the loose ones.
//! Loose views are kept several to an offset, up to twice as many as the plan and its shelved
//! plans have positions when a step ends, so that plans taking turns on the block (a server's
//! prompts and decoding steps) keep each other's views, and steps served from the gaps find views
//! at the offsets earlier such steps used; past that, those parked the most steps ago go first
//! (the `loose` module). Idle views are no array's: they are not counted, and they
//! are dropped before the block leaves the plan.
//!
//! Views are counted with a biased count, so that a plan hit and a drop on the owner thread touch
//! no atomic read-modify-write: `local` (views made minus views dropped on the owner thread) is
//! written only by the holder of the cache's lock, and `shared` counts the drops on other threads
//! (down from 0). Retiring the block adds `local` into `shared`; from then on every drop
//! decrements `shared`, and the one that takes it to zero owns the block again: on the owner
//! thread it is taken back at once, on another thread through the cache's return queue (or freed
//! once the cache is closed), like any returned buffer. A retired block counts as one buffer in
//! the cell's `live`, which keeps the cell alive for it.
//!
//! A view dropped on another thread is only counted: the owner does not learn that its position
//! is free, so the plan keeps those bytes taken (a later position over them is served apart and
//! the step is planned again), which is safe. Once no view of the block is alive anywhere (at a
//! step's end, or when the cache's stats are read), those bytes are cached again and every
//! position is free.
//!
//! # A block given up, and grown
//!
//! A plan's block is made growable where its backend can grow memory in place (CUDA's virtual
//! memory management, for blocks of 32 MiB or more; see `backend/cuda/vmm.rs`). When the plan
//! gives its block up while no array uses it and no stream's work on it is pending (the step
//! outgrew or left its plan, a larger plan was made or switched in, or the block retired under
//! its arrays came back), a growable block is not freed: the device keeps it as *given up*
//! ([`DeviceArena::given_up`]), counted as cached. The next plan's block is that block: as it
//! is when it holds the plan (it is made ready for the step's stream as any plan's block is),
//! else grown in place to the new footprint ([`Make::Grow`]), which maps only the new bytes and
//! counts as the old size freed and the new one allocated. A step longer than every one before
//! it then costs the growth, not a new block of the whole footprint and the old one's free.
//! The block given up is freed before any other device allocation of the cache that would take
//! it past the most it has held ([`DeviceArena::high`]; after the spares), and at the end of a
//! step after the one it was given up in, so that keeping it never raises the cache's peak;
//! `invalidate`, `empty_cache` and out-of-memory recovery free it with the rest.
//!
//! A growable block also grows under arrays of the step still alive in it, when they are all
//! pins (see above) and the new plan, placed around them, outgrows it
//! ([`DeviceArena::grow_block`], at the step's end): a training loop's loss, kept until the
//! next step's replaces it, would otherwise retire the block, and the next step make the new
//! plan's block beside it (EfficientNet-B0 trained on a varying batch: 1.187x of peak live ->
//! 1.048x). The backend maps the new bytes after the block's end; the arrays' views, on any
//! thread, stay valid. Not while another stream may still use the block, nor while the thread
//! captures a step graph; should the device refuse, the block is retired as before.
//!
//! # Stream order
//!
//! A plan's block is made ready for the thread's current stream at the first hit of each step
//! (`prepare_reuse`, as a recycled buffer is), and its views are made on that stream, so a
//! position reused within the step is ordered after its earlier use. A view used on another
//! stream (its stream changed, or `Array::record_stream`) keeps its bytes taken for the rest of
//! the step when it drops, and at the step's end the block leaves the plan (freed after the
//! recorded events, or retired): the next step gets another.
//!
//! # Stats and recorded events
//!
//! A plan hit, a spare or a slab's slot is a hit; a new solo block, plan block or slab a miss
//! (one device allocation). The bytes of a plan's block that no array uses, spares, and a slab's
//! free slots count as cached. While recording ([`crate::trace`]) a hit and a miss are recorded
//! with the array's bytes and address, the plan's block when it is allocated
//! ([`EventKind::PlanBlock`]), a slab when it is ([`EventKind::SlabBlock`]), a drop as back to
//! the cache (or returned, from another thread), and every block given back to the device.

pub(super) mod block;
pub(super) mod device;
pub(super) mod gaps;
pub(super) mod layout;
pub(super) mod loose;
pub(super) mod online;
pub(super) mod room;
pub(super) mod slab;

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::Ordering::*;

use super::counters::{Counters, GaugeIx, add, sub};
use super::state::{CacheState, ConfigSeq};
use super::{ARENA, CacheCell, Got, HitPath, Home, Make, Request, Take};
use crate::backend::{self, Backend, Block};
use crate::config::{CacheConfig, size_class_within};
use crate::trace::record::{self, CellName, EventKind, Note};
use crate::{Device, Result};
use block::{
    ArenaBlock, BlockPtr, GAP_BASE, NO_POSITION, RETURNED_PLAN, RETURNED_SOLO, VIEW_BASE, aligned,
    is_arena_slot, view_size,
};
use device::{Awaiting, DeviceArena, Firsts, Held, Pin, Plan, Shelved, Tally};
use gaps::Gaps;
use layout::{HeldOver, Layout, MAX_POSITIONS, Margin, NONE, OPEN, Rec, Serve};
use loose::{Loose, drop_views};
use online::{MAX_ONLINE_PINS, Shadow};
use room::{MAX_ROOMS, ROOM_SHARE, Room};
use slab::{MAX_SLABS, SLAB_BYTES, Slab};

/// The most small spares a device's planned cache keeps (see
/// [`DeviceArena::free_spares_for`]): 32 KiB at most.
const MAX_SMALL_SPARES: usize = 64;

// A plan has at most `MAX_POSITIONS` positions: a slot at or past `GAP_BASE` is never one.
const _: () = assert!(MAX_POSITIONS < GAP_BASE);

/// The most plans of other kinds of step a device keeps besides its current one. With three,
/// EfficientNet trained on a varying batch (cuDNN's algorithms, and with them the step's
/// structure, change with the batch) and replayed longer in shuffled orders held up to 1.719x of
/// its peak live bytes, 1.533x with eight. Thirty-two since a kind of step that comes again in
/// another order gets a plan of its own ([`DeviceArena::recurs_reordered`]): a CNN trained on
/// batches of many sizes keeps a plan per size (MobileNetV3's twelve recorded steps replayed
/// ten times longer, shuffled: 186 µs a step on the CPU with eight, 125 µs with sixteen or
/// more). A shelved plan is its layout, host memory only (see [`MAX_SHELVED_POSITIONS`]).
const MAX_SHELVED: usize = 32;

/// The most positions a device's shelved plans hold together (besides the one shelved last):
/// about 40 bytes of host memory each, 40 MiB in all, however long the steps. (In unit tests,
/// 4096, so that a few steps reach it.)
pub(crate) const MAX_SHELVED_POSITIONS: usize = if cfg!(test) { 1 << 12 } else { 1 << 20 };

/// The most arrays of a step that left its plan that may stay alive in the plan's block while
/// the next plan keeps the block ([`DeviceArena::pins_for`]). A detector's outputs, kept by the
/// caller until the next step's replace them, are five arrays an image for Keypoint R-CNN: with
/// eight, its block of two images' step was retired under them and the next plan's block made
/// beside it (1.938x of its peak live bytes in the H100's granules; 1.268x with sixteen, the
/// block grown in place under them; on blocks that cannot grow, the plan placed as if they were
/// not there, 1.935x -> 2.049x). A Whisper-style decoder's step that projects the encoder's
/// output for a request keeps seventeen arrays (keys and values of each layer and a few more):
/// with sixteen, its block was retired under them (see [`LEFT_PIN_SHARE`]). More in a block
/// that can grow, when they hold little of it: see [`MAX_SMALL_PINS`].
const MAX_PINS: usize = 32;

/// The most arrays alive in a plan's block that can grow that it may keep as pins when they
/// hold at most a [`SMALL_PINS_SHARE`]th of it, however many more than [`MAX_PINS`]: an
/// optimizer's state made by a later step than the first, one or two arrays a parameter (SGD's
/// momentum at the first step that a gradient scaler did not skip: ResNet-50 trained in fp16
/// made its 161 buffers, 97 MiB, at its fourth step, from its 1.4 GiB block's gaps; AdamW's
/// state of a layer that layer drop had skipped until then, 32 arrays, 57 MB of an 800 MiB
/// block). Retired under them, the block stayed beside the next plan's block for good, most of
/// it unused: 1.866x and 1.320x of those logs' peak live bytes; kept (and the steps after
/// following the plan placed around them: [`DeviceArena::choose_plan`]), 1.024x and 1.249x.
/// Whatever their share when every array pinned anew was made past the plan's end by a step
/// that followed the plan to there: AdamW's state, made at the first optimizer step after
/// micro-batches (GPT-2 on four: 296 arrays, 949 MiB of a 1.7 GiB block, in one range), the
/// block grown in place to the next plan around it: 1.619x -> 1.038x of the log's peak live
/// bytes (not so, with pins up to half a block, 1.282x). A prompt step whose keys and values
/// are kept for the request (BART's beam search: 69 arrays, 75% of its block) did not follow the
/// plan of the step before; kept under them, its decoding steps' arrays made apart lost the
/// room the retired block gave them (1.190x -> 2.467x). Not in a block that cannot grow, whose
/// next plan is placed as if they were not there, with every position over them checked against
/// each at every step (see [`Layout::block`]).
const MAX_SMALL_PINS: usize = 512;

/// See [`MAX_SMALL_PINS`]: the share of the block that arrays pinned anew may hold (those
/// pinned before or at positions held over, the block keeps already). A half: gradients
/// accumulated over micro-batches, made by the first micro-batch of each optimizer step and kept
/// to its last, beside the optimizer's state, hold a parameters' worth, and more than a quarter
/// of BERT-base's block on dynamic padding (201 arrays, 418 MiB of a 1.5 GiB block), which was
/// retired under them and held beside the next plan's block: 1.456x of the log's peak live
/// bytes, 1.272x at a half (and 1.464x -> 1.276x twenty passes longer in its recorded order).
/// With an eighth, ResNet-50's on micro-batches of 16 (322 arrays, 195 MiB of a 1.4 GiB block)
/// retired it at each optimizer step: 1.892x (2.786x at worst in shuffled orders); 1.033x at a
/// quarter. An optimizer's state made past the plan's end, whatever its share, is pinned too
/// (see [`DeviceArena::pins_for`]).
const SMALL_PINS_SHARE: usize = 2;

/// A scope is served online only after its [`online::Shadow`] has measured this many steps.
const ONLINE_AFTER: u32 = 4;

/// A scope is served online when its plans have held more than the [`online::Shadow`]'s block
/// by more than this fraction of it.
const ONLINE_MARGIN: usize = 16;

/// Steps that outgrew their plans as the one before whose rest could not be placed again
/// around the arrays alive in the block skip the try, up to this many in a row
/// ([`DeviceArena::skips_around`]).
const AROUND_RETRY: u8 = 4;

/// A [`online::Shadow`] that has measured this many steps without the scope going online
/// stops; the next starts [`SHADOW_STEPS`] steps later, twice as late after each that stopped
/// so (at most 64 times), or that put the scope online for a single step.
const SHADOW_STEPS: u32 = 16;

/// The most drops of earlier steps' arrays a step records for the [`online::Shadow`].
const MAX_EARLIER_DROPS: usize = 4096;

/// The arrays grown past their positions in a step (each smaller than a [`GROWN_SHARE`]th of
/// the footprint) make it leave its plan for the plan scaled only once they are at least this
/// many, together past that share: a longer sequence grows in many small arrays, but a
/// detector's images (an array each, resized inside the model) say nothing of the rest of its
/// step (FCOS, two images a step: its plan scaled by its images' growth held 1.887x of its peak
/// live bytes; its feature maps were smaller; 1.321x when three arrays must have grown).
const GROWN_TO_SCALE: usize = 3;

/// After this many steps in a row that left their plans, a step that leaves its plan within
/// its block, with no device allocation, is not planned again
/// ([`DeviceArena::settled_in_block`]).
const LEFT_IN_A_ROW: usize = 2;

/// An array that outgrows its position and is at least this fraction of the plan's footprint
/// makes the step leave its plan, when serving it apart would raise the cache's peak
/// ([`DeviceArena::grows_in_place`]).
const GROWN_SHARE: usize = 64;

/// The arrays that outgrow their positions in a step go apart on their own, the step staying on
/// its plan, while they hold at most this fraction of the plan's footprint
/// ([`DeviceArena::grows_in_place`]): each is held beside its unused position, so the budget is
/// what such a step may hold over its plan. An eighth let EfficientNet-B0's largest batches,
/// trained in shuffled orders, hold 1.146x of peak live (every array of a step 5% larger than its
/// position, apart); a sixteenth 1.064x (and Faster R-CNN 13 device allocations after its second
/// step instead of 21); a thirty-second sends the steps that grow a little everywhere to the
/// block's gaps (Faster R-CNN 1.436x -> 1.753x, RetinaNet 1.448x -> 1.621x).
const GROWN_BUDGET: usize = 16;

/// A step whose allocations so far take at most this share (numerator, denominator) of the
/// bytes of the positions they were matched with is short of its plan
/// ([`DeviceArena::short_of_plan`]). Three quarters: at nine tenths Mask R-CNN's inference,
/// whose steps grow in their first allocations and fall short later, held 1.268x of its peak
/// live bytes instead of 1.159x in the H100's granules.
const SHORT_OF_PLAN: (usize, usize) = (3, 4);

/// The arrays a plan's block keeps for the next plan hold at most this fraction of it (but see
/// [`LEFT_PIN_SHARE`]).
const PIN_SHARE: usize = 64;

/// A block that can grow is kept for the next plan under arrays of a step that left its plan
/// when they hold more than this fraction of it, or when the step's own arrays, those that
/// dropped within it, took at least this fraction of the block at once
/// ([`DeviceArena::keeps_block_under`]). The first: a Whisper-style decoder's step after the
/// encoder's left the encoder's plan and kept the keys and values of the encoder's output for
/// the rest of the request, 46 of the block's 57 MB; retired under them, the block stayed beside
/// the next plan's (1.452x of the log's peak live bytes, 10 device allocations in its second
/// half; kept, with [`MAX_PINS`] raised to 32 for them, 1.209x and none). The second: a
/// detector's outputs, kept by the caller until the next step's replace them. Mask R-CNN's masks
/// (two arrays of 54-214 MiB a step, made in the gaps of a step that left its plan, in a block
/// of about 950 MiB) retired its block every step, and the next step made its block beside it:
/// 1.931x of its peak live bytes in the H100's granules; 1.206x kept under them (the next plan
/// placed around them, the block grown in place). A block that cannot grow would not hold that
/// plan, whose positions over them would go apart until they drop: 1.930x -> 1.662x, but 80 ->
/// 231 device allocations after the second step, and 2.8 times the host time on the CPU. A
/// decoder's prompt step (a block of 25 MiB) whose first decoding step keeps its cache of keys
/// and values (8 MiB) is neither: its own arrays took 0.2 MiB, and the prompt's block is retired
/// as before (kept, Mistral's decoding held 1.231x instead of 1.174x, replayed shuffled).
const LEFT_PIN_SHARE: usize = 2;

/// An array planned apart that grew past its recorded size gets a solo block with room to grow
/// more ([`DeviceArena::apart_capacity`]) only while it is at most this fraction of the most the
/// cache has held: a decoder's cache of keys and values (GPT-2's 24 arrays of 0.8-1.4 MiB, 1.7%
/// of the most its cache held; Whisper's 8 of 3-120 KiB), not a detector's outputs kept into the
/// next step (Mask R-CNN's masks of 54 MiB, 5%: with room, 1.159x -> 1.212x of its peak live
/// bytes in the H100's granules) nor a CNN's output at a larger batch (ConvNeXt 1.043x ->
/// 1.061x).
const GROWN_APART_SHARE: usize = 32;

/// [`Layout::on_tie`]: the step took the plan over the one it had for [`Layout::followed`]
/// alone.
const TIE_TAKEN: u8 = 2;

/// [`Layout::on_tie`]: the step before took the plan so, followed it to its end and kept it
/// as it was (the next step not keeping it takes the preference away too).
const TIE_FOLLOWED: u8 = 1;

/// The most steps a pin is kept: a pin is named by its step's number, which wraps (at `2^32`);
/// kept no longer than this, it is never taken for an array of a later step with the same slot
/// (its block leaves the plan instead, retired under it, as a block another stream used does).
const MAX_PIN_AGE: u32 = 1 << 24;

/// A step's rest placed again around the arrays it keeps held over grows the block by at most
/// this fraction of it ([`DeviceArena::keep_rest`]); else the block's gaps serve the rest. The
/// rests of ResNet-50's first micro-batches needed up to 3% more than the plans they left;
/// unbounded, one of ResNet-18's (AMP, two micro-batches a step) needed about a 17th more, at
/// step 80 of a long run, and the block kept it for good (1.065x -> 1.125x of its peak live
/// bytes).
const KEPT_REST_GROWTH: usize = 32;

#[cfg(test)]
thread_local! {
    /// The plans made from a step's record at its end on this thread (unit tests count them).
    pub(crate) static PLANS_MADE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The retired blocks held as rooms on this thread so far.
    pub(crate) static ROOMS_HELD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The most positions a device's shelf held on this thread, just after a plan was shelved.
    pub(crate) static SHELVED_MOST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// The steps served online that ended on this thread.
    pub(crate) static ONLINE_STEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The steps fed to a shadow on this thread.
    pub(crate) static SHADOWED_STEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The slabs asked of the device for small arrays of steps served online on this thread.
    pub(crate) static SLABS_MADE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The steps on this thread whose rest was placed again around arrays held over.
    pub(crate) static RESTS_KEPT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The allocations of planned caches on this thread that the hit path did not serve.
    pub(crate) static SLOW_TAKES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The positions on this thread whose array found no view kept for the position (it looked
    /// among the loose views, or made one).
    pub(crate) static VIEWS_SOUGHT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl Pin {
    /// Its home's `generation` and `slot`, which name it (the order `DeviceArena::pins_for`
    /// keeps the pins in).
    fn home(&self) -> (u32, u32) {
        (self.step, self.slot)
    }

    /// Whether the pin was made more than [`MAX_PIN_AGE`] steps before step `step`.
    fn is_old(&self, step: u32) -> bool {
        step.wrapping_sub(self.step) > MAX_PIN_AGE
    }
}

impl Plan {
    /// A plan of `layout` in `block` (if it has one yet), keeping at most `loose_cap` idle
    /// views loose.
    fn new(layout: Layout, block: Option<BlockPtr>, loose_cap: usize) -> Plan {
        let views = no_views(&layout);
        Plan {
            layout,
            block,
            in_use: 0,
            ready: false,
            tainted: false,
            gaps: None,
            tail: None,
            views,
            loose: Loose::new(loose_cap),
            pins: Vec::new(),
            around_pins: false,
            held_dropped: false,
        }
    }

    /// Whether the arrays alive in the plan's block, if any, are its pins, none of them used
    /// on another stream. As many views alive as pins is not enough: a pin dropped on another
    /// thread stays listed (the owner does not learn of it), and an array kept at a position
    /// would make up the count (the layout switched in under it would then hand its bytes out
    /// again). So no position may be alive, nor any range the gaps or the tail handed out.
    fn holds_only_pins(&self) -> bool {
        !self.tainted
            && self.layout.live_ranges().next().is_none()
            && self.out() == 0
            && self.block.is_some_and(|b| {
                // SAFETY: the plan's block is the cache's, alive until the lock holder detaches
                // it.
                unsafe { b.as_ref() }.views() == self.pins.len() as isize
            })
    }

    /// Whether an array uses the plan's block (one exists, with views alive).
    fn block_in_use(&self) -> bool {
        // SAFETY: the plan's block is the cache's, alive until the lock holder detaches it.
        self.block
            .is_some_and(|b| unsafe { b.as_ref() }.views() != 0)
    }

    /// Arrays of the block dropped on other threads are only counted there: the owner does not
    /// learn which positions they had, and still counts their bytes in use. Once no view of the
    /// block is alive anywhere, those bytes are cached (in gauge `g` of `st`) and every position
    /// is free again.
    fn settle_remote_drops(&mut self, st: &Counters, g: GaugeIx) {
        if self.in_use != 0 && self.block.is_some() && !self.block_in_use() {
            cached(st, g, std::mem::take(&mut self.in_use));
            self.layout.clear_live();
            self.pins.clear();
            self.tail = None;
        }
    }

    /// Makes `layout` the plan's, leaving the one it replaces in `layout`. Only when no array
    /// uses the block, and its positions' idle views went loose ([`Plan::loosen_views`]), were
    /// stashed ([`Plan::stash_views`]) or were dropped with the block ([`Plan::take_block`]): so
    /// every position of the new layout is free, whatever it last counted as taken (arrays
    /// dropped on other threads, or on a block since replaced), and it has no idle view of its
    /// own yet (those it stashed come back after: [`Plan::unstash_views`]).
    fn swap_layout(&mut self, layout: &mut Layout) {
        std::mem::swap(&mut self.layout, layout);
        self.layout.clear_live();
        self.pins.clear();
        self.views = no_views(&self.layout);
    }

    /// The array of `home` dropped: if it is one of the plan's [pins](Plan::pins), it is one no
    /// more, and its bytes are returned.
    #[inline]
    fn unpin(&mut self, home: &Home) -> Option<Pin> {
        if self.pins.is_empty() {
            return None;
        }
        // By home, as `DeviceArena::pins_for` sorts them: an optimizer's step drops hundreds
        // of gradients, each looked up among hundreds of pins.
        let k = self
            .pins
            .binary_search_by_key(&(home.generation, home.slot), Pin::home)
            .ok()?;
        Some(self.pins.remove(k))
    }

    /// The positions' idle views go loose, at their offsets (within `loose_cap`; the others
    /// are dropped): when the step leaves the plan (the gaps hand out offsets, not positions),
    /// and before another layout takes the block. A position of the next layout takes the
    /// loose view at its offset the first time it is served ([`Plan::view`]), so a layout
    /// switched in or made again costs nothing for the views whose offsets did not change, and
    /// nothing at all for those it never uses.
    fn loosen_views(&mut self) {
        for (_, offset, view) in idle_views(&mut self.views, &self.layout) {
            self.loose.park(offset, view);
        }
    }

    /// The positions' idle views are stashed for the layout's arrangement ([`Loose::stash`],
    /// by [`Layout::offsets_key`]), which is about to give way to another while the block stays
    /// (shelved, made again, or its rest placed again): a layout of that arrangement that takes
    /// the block later (switched in again, or made again as it was: a plan given again) takes
    /// them back ([`Plan::unstash_views`]). Steps that take turns (micro-batches) make the same
    /// few layouts again and again: gone loose, each view was parked at the step's end and found
    /// again at its position's first array, two hash lookups a position every step.
    fn stash_views(&mut self) {
        let views = idle_views(&mut self.views, &self.layout).collect();
        self.loose.stash(self.layout.offsets_key(), views);
    }

    /// The idle views stashed for the arrangement of the layout just taken ([`Plan::stash_views`])
    /// are its positions' again, each where its position still starts at the offset it was made
    /// at (else loose, at that offset).
    fn unstash_views(&mut self) {
        let Some(stashed) = self.loose.unstash(self.layout.offsets_key()) else {
            return;
        };
        for (k, offset, view) in stashed {
            match self.views.get_mut(k as usize) {
                Some(slot) if slot.is_none() && self.layout.range(k).start == offset => {
                    *slot = Some(view);
                }
                _ => self.loose.park(offset, view),
            }
        }
    }

    /// The step its layout was placed again for ended ([`Layout::whole_again`]): the idle views
    /// of its positions go loose first, at the offsets they were made at.
    fn whole_again(&mut self) {
        if self.layout.one_step() {
            self.loosen_views();
            self.layout.whole_again();
        }
    }

    /// Takes the loose views out of the plan (after [`Plan::loosen_views`], every idle view),
    /// for a plan made again on the same block ([`Plan::adopt_loose`]).
    fn take_loose(&mut self) -> Loose {
        std::mem::take(&mut self.loose)
    }

    /// Keeps `loose`, idle views of this plan's block that [`Plan::take_loose`] took out of the
    /// plan it replaces, within this plan's cap.
    fn adopt_loose(&mut self, mut loose: Loose) {
        debug_assert!(self.loose.len() == 0);
        loose.set_cap(self.loose.cap());
        self.loose = loose;
    }

    /// The size of the plan's block (0 before it is made).
    fn block_bytes(&self) -> usize {
        // SAFETY: the plan's block is the cache's, alive until the lock holder detaches it.
        self.block
            .map_or(0, |b| unsafe { b.as_ref() }.block.bytes())
    }

    /// Takes the block out of the plan, with the bytes its arrays use, after dropping the views
    /// kept for positions (they must not outlive the block).
    fn take_block(&mut self) -> Option<(BlockPtr, usize)> {
        drop_views(self.views.iter_mut().filter_map(Option::take));
        drop_views(self.loose.drain());
        // The arrays pinned in the block, or served from its tail, are the block's (retired
        // under them, if alive).
        self.pins.clear();
        self.tail = None;
        self.layout.clear_blocked();
        let block = self.block.take()?;
        Some((block, std::mem::take(&mut self.in_use)))
    }

    /// A view for an array of `bytes` bytes (`size` aligned) at position `pos` (at `offset`) of
    /// the plan's block `arena`, counted (in gauge `g` of `st`) as in use: the view kept for the
    /// position, else a loose one at its offset, else a new one ([`idle_or_new_view`]).
    fn view(
        &mut self,
        st: &Counters,
        g: GaugeIx,
        arena: BlockPtr,
        (pos, offset): (u32, usize),
        (bytes, size): (usize, usize),
    ) -> Result<Block> {
        let kept = self.views.get_mut(pos as usize).and_then(Option::take);
        self.counted_view(kept, (st, g), arena, offset, (bytes, size))
    }

    /// [`idle_or_new_view`] (`kept`, else a loose view at `offset`, else a new one) for an array
    /// of `bytes` bytes (`size` aligned) at `offset` of the plan's block `arena`, counted (in
    /// gauge `g` of `st`) as in use.
    fn counted_view(
        &mut self,
        kept: Option<Block>,
        (st, g): (&Counters, GaugeIx),
        arena: BlockPtr,
        offset: usize,
        (bytes, size): (usize, usize),
    ) -> Result<Block> {
        let view = idle_or_new_view(kept, &mut self.loose, arena, offset, bytes)?;
        Ok(counted(
            &mut self.in_use,
            st,
            g,
            arena,
            offset,
            (bytes, size),
            view,
        ))
    }

    /// Makes the plan's block `arena` ready for the step's stream, once a step: prepared for
    /// reuse when no array uses it. `Ok(false)`: arrays of an earlier step are alive and the
    /// stream changed, so the block cannot be handed to the new stream under them.
    fn make_ready(&mut self, arena: BlockPtr) -> Result<bool> {
        if self.ready {
            return Ok(true);
        }
        // SAFETY: the plan's block is the cache's, alive until the lock holder detaches it.
        let counts = unsafe { arena.as_ref() };
        if counts.views() == 0 {
            // SAFETY: no view is alive, and we hold the lock.
            let block = unsafe { ArenaBlock::block_mut(arena) };
            block.prepare_reuse()?;
        } else if !counts.block.on_current_stream() {
            return Ok(false);
        }
        self.ready = true;
        Ok(true)
    }

    /// The step leaves the plan: the block's bytes that no array uses become its gaps, for the
    /// rest of the step (when the block exists and may be used on the step's stream). The
    /// ranges the block's tail handed out (`record` has their sizes) are the gaps' from then on.
    fn open_gaps(&mut self, record: &[Rec]) -> Result<()> {
        let Some(arena) = self.block else {
            return Ok(());
        };
        if self.make_ready(arena)? {
            // SAFETY: the plan's block is the cache's, alive until the lock holder detaches it.
            let bytes = unsafe { arena.as_ref() }.block.bytes();
            let tail = self.tail.take();
            let mut gaps = self.unused(bytes, tail.as_ref(), record);
            if let Some(tail) = tail {
                gaps.adopt(tail);
            }
            self.gaps = Some(gaps);
            // The gaps hand out offsets, not positions: the positions' idle views go loose.
            self.loosen_views();
        }
        Ok(())
    }

    /// The bytes of the plan's block (`bytes` long) that no array uses, as gaps: all but the
    /// positions alive (those dropped on other threads too: the owner does not know), the pins,
    /// and the ranges `tail` handed out (`record` has their sizes).
    fn unused(&self, bytes: usize, tail: Option<&Gaps>, record: &[Rec]) -> Gaps {
        let handed = tail
            .iter()
            .flat_map(|t| t.handed_out())
            .map(|(rec, offset)| {
                offset..offset + record.get(rec as usize).map_or(bytes, |r| r.bytes)
            });
        let pinned = self.pins.iter().map(|p| p.range.clone());
        let used = self.layout.live_ranges().chain(pinned).chain(handed);
        Gaps::new(bytes, used)
    }

    /// The free bytes of the plan's block, about to leave the plan under arrays alive in it (the
    /// caller knows they are not all to be pinned: it is to be retired under them), when no
    /// other stream used it this step and its last use was on the thread's current stream: a
    /// [`Room`] for the arrays served apart until it comes back. The gaps, when the step left
    /// the plan (they hold just those bytes).
    fn room(&mut self, record: &[Rec]) -> Option<Gaps> {
        let arena = self.block?;
        // SAFETY: the plan's block is the cache's, alive until the lock holder detaches it.
        let counts = unsafe { arena.as_ref() };
        if self.tainted || capturing() || !counts.block.on_current_stream() {
            return None;
        }
        let bytes = counts.block.bytes();
        Some(match self.gaps.take() {
            Some(gaps) => gaps,
            None => self.unused(bytes, self.tail.as_ref(), record),
        })
    }

    /// An offset of `size` aligned bytes in the block's tail (its bytes past the plan's
    /// footprint, but the pins') for allocation `rec` of a step that follows its plan, if the
    /// tail holds them: the tail is made at the step's first such allocation, when the block
    /// exists and may be used on the step's stream.
    fn tail_offset(&mut self, rec: u32, size: usize) -> Result<Option<usize>> {
        let Some(arena) = self.block else {
            return Ok(None);
        };
        let footprint = self.layout.footprint;
        let tail = self.block_bytes().saturating_sub(footprint);
        if self.gaps.is_some() || tail < size {
            return Ok(None);
        }
        if self.tail.is_none() {
            if !self.make_ready(arena)? {
                return Ok(None);
            }
            // Below the footprint, the positions; past it, no array of the block but pins (a
            // block kept for the next plan holds only pins, and the tail is made once a step).
            let pinned = self.pins.iter().map(|p| p.range.clone());
            let used = std::iter::once(0..footprint).chain(pinned);
            self.tail = Some(Gaps::new(self.block_bytes(), used));
        }
        Ok(self.tail.as_mut().and_then(|t| t.take(rec, size, false)))
    }

    /// Position `pos`, served at `offset` of the plan's block `arena` (ready for the step's
    /// stream) for an array of `bytes` bytes of step `step`: its view, or the failure to make
    /// one (the position is then free again).
    fn position_view(
        &mut self,
        st: &Counters,
        g: GaugeIx,
        arena: BlockPtr,
        (pos, offset): (u32, usize),
        bytes: usize,
        step: u32,
    ) -> Planned {
        let size = aligned(bytes).unwrap_or(bytes);
        match self.view(st, g, arena, (pos, offset), (bytes, size)) {
            Ok(view) => Planned::View(view, view_slot(pos), step),
            Err(e) => {
                self.layout.unserve(pos);
                Planned::Failed(e)
            }
        }
    }

    /// What allocation `rec` of step `step` gets for its array of `bytes` bytes (`size`
    /// aligned) at `offset` of the block `arena`, handed out by the gaps or the tail: a hit, the
    /// idle view there (else a new one), with its home a gap slot. Should the view fail, the
    /// range goes back.
    fn hand_out(
        &mut self,
        (st, g): (&Counters, GaugeIx),
        arena: BlockPtr,
        (rec, offset): (u32, usize),
        (bytes, size): (usize, usize),
        step: u32,
    ) -> Planned {
        match self.counted_view(None, (st, g), arena, offset, (bytes, size)) {
            Ok(view) => {
                add(&st.hits, 1);
                Planned::View(view, gap_slot(rec), step)
            }
            Err(e) => {
                self.give_back(rec, size);
                Planned::Failed(e)
            }
        }
    }

    /// Whether arrays of at most [`layout::SMALL`] bytes kept from earlier steps are in the
    /// block.
    fn small_pins(&self) -> bool {
        self.pins.iter().any(|p| p.range.len() <= layout::SMALL)
    }

    /// Whether the plan's block can grow in place now, under the arrays alive in it: the
    /// backend can grow it, no view of it was used on another stream (every array in it is on
    /// the step's stream), and the thread captures no step graph.
    fn grows_now(&self) -> bool {
        // SAFETY: a plan's block is the cache's until detached, and alive while it is.
        let growable = |b: BlockPtr| unsafe { b.as_ref() }.block.is_growable();
        !self.tainted && !capturing() && self.block.is_some_and(growable)
    }

    /// The array of allocation `rec` (`size` aligned bytes), handed out by the gaps or the
    /// tail, dropped: its range is free again. Returns the range's offset, if `rec` had one.
    fn give_back(&mut self, rec: u32, size: usize) -> Option<usize> {
        match (&mut self.gaps, &mut self.tail) {
            (Some(gaps), _) => gaps.give_back(rec, size),
            (None, Some(tail)) => tail.give_back(rec, size),
            (None, None) => None,
        }
    }

    /// The gaps, else the tail: what hands out ranges this step.
    fn handing_out(&self) -> Option<&Gaps> {
        self.gaps.as_ref().or(self.tail.as_ref())
    }

    /// The ranges the gaps or the tail handed out and not given back, with their allocations.
    fn handed_out(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.handing_out().into_iter().flat_map(Gaps::handed_out)
    }

    /// How many ranges the gaps or the tail handed out and not given back.
    fn out(&self) -> usize {
        self.handing_out().map_or(0, Gaps::out)
    }
}

/// The most idle views a plan of `layout` keeps loose: twice as many as it and the `shelf`'s
/// plans, which share its block, have positions (at least 128). Steps served from the gaps
/// put arrays at other offsets than the positions': on EfficientNet's and ConvNeXt's shuffled
/// steps a cap of as many views as positions made twice as many views, and twice that cap keeps
/// every view those runs make.
fn loose_cap(layout: &Layout, shelf: &[Shelved]) -> usize {
    let shelved: usize = shelf.iter().map(|s| s.layout.len()).sum();
    2 * (layout.len() + shelved).max(64)
}

/// The idle views kept for the positions of `layout` (`views`, by position), taken out: each
/// with its position and the offset it was made at (its position's).
fn idle_views<'a>(
    views: &'a mut [Option<Block>],
    layout: &'a Layout,
) -> impl Iterator<Item = (u32, usize, Block)> + 'a {
    (0..)
        .zip(views)
        .filter_map(|(k, view)| Some((k, layout.range(k).start, view.take()?)))
}

/// No view kept for any of `layout`'s positions.
fn no_views(layout: &Layout) -> Vec<Option<Block>> {
    std::iter::repeat_with(|| None).take(layout.len()).collect()
}

impl Held {
    /// The block's bytes.
    fn bytes(&self) -> usize {
        self.block().bytes()
    }

    /// The block's device.
    fn device(&self) -> Device {
        self.block().device()
    }

    /// Whether the block's work on other streams is done (see `Block::is_idle`).
    fn is_idle(&self) -> bool {
        self.block().is_idle()
    }

    /// The block, wherever it is held.
    fn block(&self) -> &Block {
        match self {
            Held::Bare(block) => block,
            // SAFETY: a spare's block is the cache's, alive until taken out of the spares.
            Held::Viewed { arena, .. } => &unsafe { arena.as_ref() }.block,
        }
    }

    /// The block alone: its idle view, if any, dropped first.
    fn into_block(self) -> Block {
        match self {
            Held::Bare(block) => block,
            Held::Viewed { arena, view } => {
                // SAFETY: the view was made by `Block::view` of this block, which is alive, and
                // is no array's.
                unsafe { view.drop_view() };
                // SAFETY: the block came from `ArenaBlock::new_solo`, its one view is gone (its
                // count is zero), and the spare, its only holder, is consumed here.
                unsafe { ArenaBlock::into_block(arena) }
            }
        }
    }
}

/// What a recorded event says of a buffer (a view or a block): its bytes, address, device and
/// stream.
#[derive(Clone, Copy)]
struct BufferNote {
    bytes: usize,
    buffer: u64,
    device: Device,
    stream: Option<u64>,
}

impl BufferNote {
    #[cold]
    #[inline(never)]
    fn of(buffer: &Block) -> BufferNote {
        BufferNote {
            bytes: buffer.bytes(),
            buffer: buffer.id(),
            device: buffer.device(),
            stream: buffer.stream_id(),
        }
    }

    /// Records `kind` about the buffer, for the cache numbered `cell`, with the cache's bytes on
    /// the device after it (if known).
    fn push(self, kind: EventKind, cell: u32, bytes_after: Option<(usize, usize)>) {
        record::push(Note {
            bytes: self.bytes,
            buffer: Some(self.buffer),
            device: Some(self.device),
            stream: self.stream,
            bytes_after,
            ..Note::about(kind, Some(cell))
        });
    }
}

/// What the planned path gives [`CacheCell::take`].
enum Planned {
    /// A view, with its home's `slot` and step.
    View(Block, u32, u32),
    /// Allocate a block of `capacity` bytes as `make` says and pass it to
    /// [`CacheCell::adopt`] (a block the array gets a view of, when `view`).
    Alloc {
        capacity: usize,
        view: bool,
        make: Make,
    },
    /// The cache tracks its most devices: allocate without it.
    Bypass,
    Failed(crate::Error),
}

/// Counts `bytes` of gauge `g` as cached.
#[inline]
fn cached(st: &Counters, g: GaugeIx, bytes: usize) {
    add(st.gauge(g).cached, bytes);
}

/// Counts `bytes` of gauge `g` as no longer cached.
#[inline]
fn uncached(st: &Counters, g: GaugeIx, bytes: usize) {
    sub(st.gauge(g).cached, bytes);
}

/// Records `kind` about `block`, of gauge `g` of the cache named `trace`, with the cache's bytes
/// on the device after it.
#[cold]
#[inline(never)]
fn note_block(st: &Counters, g: GaugeIx, trace: &CellName, kind: EventKind, block: &Block) {
    note_buffer(st, g, trace, kind, BufferNote::of(block));
}

/// [`note_block`] of a buffer as `note` says it was (a block since grown).
#[cold]
#[inline(never)]
fn note_buffer(st: &Counters, g: GaugeIx, trace: &CellName, kind: EventKind, note: BufferNote) {
    let after = super::traced::gauge_bytes(st, g);
    note.push(kind, trace.id(), Some(after));
}

/// Gives `block`, of gauge `g` of the cache named `trace`, back to the device (recorded).
fn free_block(st: &Counters, g: GaugeIx, trace: &CellName, block: Block) {
    uncount_block(st, g, trace, &block);
}

/// Counts `block`, of gauge `g` of the cache named `trace`, as given back to the device
/// (recorded): it is being freed, or grown in place, which counts as a free of its old size and
/// an allocation of its new one.
fn uncount_block(st: &Counters, g: GaugeIx, trace: &CellName, block: &Block) {
    st.freed(g, block.bytes());
    if record::on() {
        note_block(st, g, trace, EventKind::DeviceFree, block);
    }
}

/// Whether a plan's block that no array uses may be kept for the next plan's block
/// ([`DeviceArena::given_up`]): it can grow, no stream's work on it is pending, and the thread
/// captures no step graph.
fn may_keep(block: &Block) -> bool {
    block.is_idle() && block.is_growable() && !capturing()
}

/// Whether this thread captures a step graph (no block may be made or freed meanwhile).
fn capturing() -> bool {
    #[cfg(feature = "cuda")]
    return backend::capture::capturing();
    #[cfg(not(feature = "cuda"))]
    false
}

/// [`DeviceArena::settle_record`] of `record`, the step's record up to tick `tick`, whose
/// allocations past its end were served in order from `layout` (the `k`-th at position `k`).
#[inline]
fn settle_record(record: &mut Vec<Rec>, tick: u32, layout: &Layout) {
    for k in record.len() as u32..tick {
        let (bytes, end) = layout.served(k);
        record.push(Rec {
            bytes,
            end,
            planned: k,
        });
    }
}

/// A view at `offset` of the plan's block `arena` that reaches `bytes` bytes from there: `kept`
/// (an idle view made at that offset), else a loose one there, else a new one. A view spans
/// from its offset to the end of the block, so that it serves any array there later: a view (on
/// CUDA with a `CudaSlice` of two events of its own once it is used with several streams) is
/// made once per offset, not once per array.
/// The end is the block's when the view was made: a block grown since (under the arrays a step
/// kept) may place a larger array at the offset, and an idle view too short for it is dropped
/// and made again (EfficientNet trained on a varying batch, replayed in the H100's granules:
/// four arrays of up to 64 MiB were handed views of 1.2 MiB, whose cudarc slices would have
/// refused them). Cold: the hit path calls it only at a position's first array of a layout (or
/// one its view is too short for), so that its call stays out of the hit's way.
#[cold]
#[inline(never)]
fn idle_or_new_view(
    kept: Option<Block>,
    loose: &mut Loose,
    arena: BlockPtr,
    offset: usize,
    bytes: usize,
) -> Result<Block> {
    #[cfg(test)]
    if kept.is_none() {
        VIEWS_SOUGHT.with(|n| n.set(n.get() + 1));
    }
    match kept.or_else(|| loose.unpark(offset)) {
        Some(view) if view.spans(bytes) => Ok(view),
        short => {
            drop_views(short);
            new_view(arena, offset)
        }
    }
}

/// A new view of the cache's block `arena` (a plan's block, a slab, or a retired block held as
/// a room) from `offset` to its end.
fn new_view(arena: BlockPtr, offset: usize) -> Result<Block> {
    // SAFETY: the block is the cache's, alive until the lock holder detaches it (or, a room's,
    // lets go of it).
    let counts = unsafe { arena.as_ref() };
    let span = counts.block.bytes() - offset;
    let owner: *const dyn Backend = arena.as_ptr().cast_const();
    // SAFETY: `offset < block bytes` (the layout placed the position and it fits in the
    // footprint, the block's gaps or a room's free ranges held the range, or it is a slab's
    // slot), `owner` is the `Arc::into_raw` pointer of the block's `Arc`, whose backend is not
    // counted, and the block stays alive, unmoved and untouched through `&mut` while views of
    // it live: it is prepared only with no array's view alive (kept views touch only their own
    // state until dropped, by the lock holder, before the block goes), and freed only once no
    // view is (`views() == 0` and kept views dropped before retirement, `shared` reaching 0
    // after; a room's idle views are dropped before its hold, one count, is let go).
    unsafe { counts.block.view(owner, offset, span) }
}

/// The array of a view of `size` aligned bytes dropped on the owner thread: its bytes leave
/// `in_use` (a plan's or a slab's) and count as cached again (in gauge `g` of `st`), as
/// [`counted`] moved them the other way.
#[inline]
fn uncounted(in_use: &mut usize, st: &Counters, g: GaugeIx, size: usize) {
    *in_use -= size;
    cached(st, g, size);
}

/// The hit path's view for an array of `bytes` bytes (`size` aligned) at position `pos` (at
/// `offset`) of a plan's block `arena`, whose kept views are `views`, loose ones `loose`, and
/// whose bytes in use `in_use` counts, counted (in gauge `g` of `st`) as in use: the view kept
/// for the position when it reaches them; else, out of line, as [`Plan::view`] finds or makes
/// one. `None` if that fails: the slow path then meets the error.
#[inline(always)]
fn kept_view(
    views: &mut [Option<Block>],
    loose: &mut Loose,
    in_use: &mut usize,
    (st, g): (&Counters, GaugeIx),
    arena: BlockPtr,
    (pos, offset): (u32, usize),
    (bytes, size): (usize, usize),
) -> Option<Block> {
    let kept = views.get_mut(pos as usize)?;
    let view = match kept.take_if(|v| v.spans(bytes)) {
        Some(view) => view,
        None => idle_or_new_view(kept.take(), loose, arena, offset, bytes).ok()?,
    };
    Some(counted(in_use, st, g, arena, offset, (bytes, size), view))
}

/// `view`, at `offset` of a plan's block `arena` (whose bytes in use `in_use` counts) and
/// reaching `bytes` bytes (`size` aligned) from there (made over the rest of the block, or kept
/// idle at that offset and checked with [`Block::spans`]), cut to them and counted (in gauge `g`
/// of `st`) as in use.
#[inline(always)]
fn counted(
    in_use: &mut usize,
    st: &Counters,
    g: GaugeIx,
    arena: BlockPtr,
    offset: usize,
    (bytes, size): (usize, usize),
    mut view: Block,
) -> Block {
    debug_assert_eq!(aligned(bytes), Some(size));
    // SAFETY: the plan's block is the cache's, alive until the lock holder detaches it.
    let counts = unsafe { arena.as_ref() };
    debug_assert_eq!(
        view.address(),
        counts.block.address() + offset,
        "a view kept for another offset"
    );
    debug_assert!(0 < bytes && offset + bytes <= counts.block.bytes());
    // SAFETY: the view is at `offset`, the block holds `offset + bytes` (`bytes` fit there),
    // and the view reaches them: made just now over the rest of the block, or kept idle at
    // that offset and checked (`spans`: a device view's slice ends where the block did when
    // it was made; a host view points into the block's memory, which holds them).
    unsafe { view.set_view_len(bytes) };
    counts.count_view();
    *in_use += size;
    uncached(st, g, size);
    view
}

/// The `slot` of the home of an array at `pos`.
#[inline]
fn view_slot(pos: u32) -> u32 {
    VIEW_BASE + pos.min(NO_POSITION)
}

/// The `slot` of the home of an array served from a gap or the tail, allocation `rec` of its
/// step.
#[inline]
fn gap_slot(rec: u32) -> u32 {
    VIEW_BASE + GAP_BASE + rec
}

impl DeviceArena {
    /// [`CacheState::plan_hit`] past its checks of the device and the plan, for an array of
    /// `bytes` bytes, on a step that serves its positions in order (`IN_ORDER`, as the layout
    /// says) or not. In order, the allocation's entry in the record stays in its position until
    /// read ([`DeviceArena::settle_record`]); else the record is written as the step goes.
    #[inline(always)]
    fn plan_hit<const IN_ORDER: bool>(
        &mut self,
        st: &Counters,
        bytes: usize,
    ) -> Option<(Block, u32, u32)> {
        let plan = self.plan.as_mut()?;
        debug_assert_eq!(plan.layout.in_order, IN_ORDER);
        let arena = plan.block?;
        let size = aligned(bytes)?;
        let rec = self.tick;
        if !IN_ORDER {
            settle_record(&mut self.record, rec, &plan.layout);
        }
        let (views, in_use) = (&mut plan.views, &mut plan.in_use);
        let loose = &mut plan.loose;
        let gauge = self.gauge;
        let (view, pos) = plan.layout.hit(
            size,
            rec,
            #[inline(always)]
            |offset, pos| {
                kept_view(
                    views,
                    loose,
                    in_use,
                    (st, gauge),
                    arena,
                    (pos, offset),
                    (bytes, size),
                )
            },
        )?;
        self.tick = rec + 1;
        if !IN_ORDER {
            self.record.push(Rec {
                bytes: size,
                end: OPEN,
                planned: pos,
            });
        }
        add(&st.hits, 1);
        // A position of a plan is below `MAX_POSITIONS` (see `view_slot`).
        debug_assert!(pos < MAX_POSITIONS);
        Some((view, VIEW_BASE + pos, self.step))
    }

    /// [`DeviceArena::plan_hit`] on a step that left the order of its positions.
    #[inline(never)]
    fn plan_hit_out_of_order(&mut self, st: &Counters, bytes: usize) -> Option<(Block, u32, u32)> {
        self.plan_hit::<false>(st, bytes)
    }

    fn new(device: Device, gauge: GaugeIx, trace: Arc<CellName>) -> DeviceArena {
        DeviceArena {
            device,
            gauge,
            trace,
            step: 0,
            tick: 0,
            record: Vec::new(),
            diverged: false,
            step_spares: Vec::new(),
            slabs: Vec::new(),
            tiny_apart: false,
            replan: false,
            overflowed: false,
            grown: 0,
            grown_arrays: 0,
            tally: Tally::default(),
            allocated: 0,
            left_in_a_row: 0,
            waited: 0,
            outgrew: false,
            scaled: false,
            keep_gaps: false,
            plan: None,
            shelf: Vec::new(),
            spares: Vec::new(),
            given_up: None,
            high: 0,
            planner: Default::default(),
            awaiting: None,
            unplanned: [0; device::UNPLANNED],
            reordered: Vec::new(),
            online: false,
            shadow: None,
            earlier_drops: Vec::new(),
            peak_most: 0,
            shadow_wait: 0,
            around_missed: 0,
            firsts: Firsts::None,
            in_doubt: false,
            shadow_misses: 0,
            online_from: 0,
            held_dropped_last: false,
            kept_after_drop: true,
            margin: Margin::default(),
            rooms: Vec::new(),
        }
    }

    /// The plan the step that just ended left within its block: the step did not outgrow it,
    /// was not served from it scaled nor allocated past the most positions, and no other stream
    /// used the block (`tainted`), in which no array is alive. `None` otherwise.
    fn left_within_block(&self, tainted: bool) -> Option<&Plan> {
        let within = self.diverged && !self.outgrew && !self.scaled && !self.overflowed;
        self.plan
            .as_ref()
            .filter(|p| within && !tainted && p.block.is_some() && !p.block_in_use())
    }

    /// Whether the step that just ended left its plan within its block with no device
    /// allocation, after at least [`LEFT_IN_A_ROW`] steps in a row that left theirs: then it is
    /// not planned again. A detector's steps never come again (as many proposals as its images
    /// give): each leaves the plan made from the one before, and planning each again cost a plan
    /// a step for nothing (FCOS: 760 µs a step on the CPU, 531 µs so, and 1.319x -> 1.267x of
    /// its peak live bytes: the plan keeps the larger steps' sizes). A step that needed the
    /// device (its arrays did not fit the block's gaps) is planned, and a step that follows its
    /// plan ends the run; so is a step whose plan was placed around arrays of an earlier step
    /// (pins: their bytes may be free now, and the plan made again uses them). Counts the run.
    fn settled_in_block(&mut self, tainted: bool, tail_alive: bool) -> bool {
        let settled = self.left_in_a_row >= LEFT_IN_A_ROW
            && self.allocated == 0
            && !tail_alive
            && self
                .left_within_block(tainted)
                .is_some_and(|p| !p.around_pins);
        self.left_in_a_row = if self.diverged {
            self.left_in_a_row.saturating_add(1)
        } else {
            0
        };
        settled
    }

    /// Whether the step that just ended, which left its plan, is served as well by the plan it
    /// left as by a plan of its own: it stayed within the plan's block (nothing went apart for
    /// want of room, nothing grew, no other stream used the block), no array of the block is
    /// alive, and no step of the last few that left the plan unplanned had its sizes in its
    /// order. A step like that (a batch of another size whose workspaces come in another order,
    /// a step that does something extra once) is mostly not followed by another of its kind:
    /// planned again, it would make the next step leave that plan too, and cost a plan and a
    /// switch of views every step. Its signature is remembered, so that a kind of step that
    /// comes again soon (steps that take turns, a new batch size from now on) is planned.
    fn served_unplanned(&mut self, tainted: bool) -> bool {
        let fits = !self.replan
            && self.left_within_block(tainted).is_some_and(|p| {
                let peak = layout::peak_live(&self.record);
                p.layout.footprint > peak + peak / 4
            });
        if !fits {
            return false;
        }
        let signature = layout::signature(&self.record);
        if self.unplanned.contains(&signature) {
            return false;
        }
        // The newest first; the oldest goes.
        self.unplanned.rotate_right(1);
        self.unplanned[0] = signature;
        true
    }

    /// Whether the step that just ended, of the kind of its plan `old`, is a kind of its own
    /// that comes again: it left the plan by the order of its allocations (it did not outgrow
    /// the plan, and was not served from it scaled), with another first allocation (another
    /// batch or length, which [`DeviceArena::choose_plan`] tells apart), and a step of the same
    /// sizes in the same order ([`layout::signature`]) did so before, among the last
    /// [`device::REORDERED`] that did, or was left unplanned. Such a step gets a plan of its own,
    /// and the old one is shelved, where merged with the old plan position by position it would
    /// make the next step of either kind leave the plan again: cuDNN picks its algorithms, and
    /// with them the step's workspaces, by the batch, so a CNN trained on batches of several
    /// sizes made a plan at almost every step (EfficientNet's twelve recorded steps replayed ten
    /// times longer in shuffled orders, on the CPU: 325 µs a step, 417 device allocations after
    /// the second step, 1.053x of peak live; with a plan per batch size, every step on its own
    /// plan once each size came twice: 163 µs, 358 allocations, all in the first passes, and
    /// 1.026x). A step seen once is merged as before: the steps of a detector (as many proposals
    /// as the image gives) do not come again, and their merged plans hold them best (Faster
    /// R-CNN 1.431x -> 1.640x of peak live when every such step got a plan of its own).
    fn recurs_reordered(&mut self, old: &Layout) -> bool {
        let reordered = self.diverged
            && !self.outgrew
            && !self.scaled
            && self
                .record
                .first()
                .is_some_and(|r| r.bytes != old.first_size());
        if !reordered {
            return false;
        }
        let signature = layout::signature(&self.record);
        if let Some(i) = self.reordered.iter().position(|&s| s == signature) {
            self.reordered.remove(i);
            return true;
        }
        if self.reordered.len() >= device::REORDERED {
            self.reordered.pop();
        }
        self.reordered.insert(0, signature);
        self.unplanned.contains(&signature)
    }

    /// A new block of `capacity` bytes for the cache, the plan's block (`plan`) or a solo one.
    /// The plan's block grows the block the plan last gave up ([`DeviceArena::given_up`]), if
    /// any. Before any device allocation that would take the cache past the most it has held
    /// ([`DeviceArena::high`]), what it keeps for later goes back to the device, the spares
    /// first ([`DeviceArena::free_spares_for`]) and the block given up last, so that keeping
    /// them never raises the cache's peak. While the thread captures a step graph (which
    /// refuses the allocation) they stay.
    fn alloc(&mut self, st: &Counters, capacity: usize, plan: bool) -> Planned {
        self.allocated += 1;
        self.note_held(st);
        let capturing = capturing();
        let grown = self
            .given_up
            .take_if(|_| plan && !capturing)
            .map(|(old, _)| {
                // Handed over: counted as freed until adopted at its new size.
                uncached(st, self.gauge, old.bytes());
                uncount_block(st, self.gauge, &self.trace, &old);
                old
            });
        if !capturing {
            self.make_room(st, capacity);
        }
        let make = match grown {
            Some(old) => Make::Grow(old),
            None if plan => Make::Growable,
            None => Make::Plain,
        };
        Planned::Alloc {
            capacity,
            view: true,
            make,
        }
    }

    /// Before a device allocation of `capacity` bytes that would take the cache past the most
    /// it has held ([`DeviceArena::high`]), what it keeps for later goes back to the device: the
    /// spares first ([`DeviceArena::free_spares_for`]), then the block given up last.
    fn make_room(&mut self, st: &Counters, capacity: usize) {
        self.free_spares_for(st, capacity);
        if self.would_pass_high(st, capacity)
            && let Some((given_up, _)) = self.given_up.take()
        {
            self.free_cached(st, given_up);
        }
    }

    /// The bytes the cache holds on the device now.
    fn held(&self, st: &Counters) -> usize {
        st.gauge(self.gauge).held.load(Relaxed) as usize
    }

    /// Takes the bytes the cache holds on the device now into [`DeviceArena::high`].
    fn note_held(&mut self, st: &Counters) {
        self.high = self.high.max(self.held(st));
    }

    /// Gives `block`, counted as cached, back to the device.
    fn free_cached(&self, st: &Counters, block: Block) {
        uncached(st, self.gauge, block.bytes());
        free_block(st, self.gauge, &self.trace, block);
    }

    /// A spare of at least `size` bytes, idle, the smallest such: at most four times as large
    /// as `expected` (the array's size, or for a position apart its recorded size, if larger)
    /// while a new block of `capacity` bytes would keep the cache within the most it has held
    /// (the spare serves the array with fewer bytes held than a new block, and saves a device
    /// allocation: 150-600 µs on an H100 at the pool's release threshold 0), at most twice as
    /// large as the array when the new block would take the cache past that mark (there a
    /// larger spare taken by a small array sends the next large one past the mark with no spare
    /// left to free: ConvNeXt's shuffled steps held 1.084x of peak live with four times, 1.070x
    /// with twice). Measured against the position's recorded size, a server's request with a
    /// shorter prompt than the one its plan was made from takes the blocks of keys and values
    /// an earlier request left (Llama-style serving: 35 -> 2 device allocations in the second
    /// half of its steps, OPT 29 -> 2; but in their worst shuffled orders 1.201x -> 1.243x and
    /// 1.125x -> 1.193x of peak live, a short request holding a long one's block when another
    /// needs one).
    ///
    /// Past the mark, the array of a position `apart` takes any larger spare when it is the
    /// plan's only array apart larger than small ([`Layout::one_large_apart`]): no other array
    /// apart needs the spares, which are the blocks its earlier steps' arrays left. An inference
    /// step's input batch of another size every step, alive into the next step, found no spare
    /// within twice its size, and the spares went back for a new block: EfficientNet-B0's and
    /// ConvNeXt-T's long runs allocated in their second half (9 and 6 times; none and once so).
    /// A server's caches of keys and values, many arrays apart, must not take each other's
    /// blocks so (OPT serving held 1.91x of peak live). The plan's positions are looked at only
    /// there, where a device allocation follows otherwise.
    fn take_spare(
        &mut self,
        st: &Counters,
        size: usize,
        capacity: usize,
        expected: usize,
        apart: bool,
    ) -> Option<Held> {
        let past_mark = self.would_pass_high(st, capacity);
        let most = if past_mark {
            size.saturating_mul(2)
        } else {
            expected.saturating_mul(4)
        };
        let smallest = |most: usize| {
            self.spares
                .iter()
                .enumerate()
                .filter(|(_, s)| (size..=most).contains(&s.bytes()) && s.is_idle())
                .min_by_key(|(_, s)| s.bytes())
                .map(|(i, _)| i)
        };
        let i = smallest(most).or_else(|| {
            let alone = past_mark
                && apart
                && size > layout::SMALL
                && self
                    .plan
                    .as_ref()
                    .is_some_and(|p| p.layout.one_large_apart());
            alone.then(|| smallest(usize::MAX)).flatten()
        })?;
        // In order: the oldest stay first.
        let held = self.remove_spare(i);
        uncached(st, self.gauge, held.bytes());
        Some(held)
    }

    /// Takes spare `i` out of the spares (and out of [`DeviceArena::step_spares`]: a block
    /// allocated later at the same address must not be taken for it).
    fn remove_spare(&mut self, i: usize) -> Held {
        let held = self.spares.remove(i);
        if !self.step_spares.is_empty() {
            let id = held.block().id();
            self.step_spares.retain(|&s| s != id);
        }
        held
    }

    /// The bytes a new block may take without taking the cache past the most it has held on
    /// the device ([`DeviceArena::high`]), once what it keeps for later (the spares, the block
    /// given up) goes back or grows.
    fn room(&self, st: &Counters) -> usize {
        let kept: usize = self.spares.iter().map(Held::bytes).sum::<usize>()
            + self.given_up.as_ref().map_or(0, |(b, _)| b.bytes());
        self.high.saturating_sub(self.held(st).saturating_sub(kept))
    }

    /// The bytes of a new solo block for an array of `size` aligned bytes at a position planned
    /// apart (it outlived the recorded step) with `recorded` bytes: its size class, and, when it
    /// grew past its recorded size and is at most a [`GROWN_APART_SHARE`]th of the most the
    /// cache has held ([`DeviceArena::high`]), room for as much again as it grew since the plan
    /// was made, up to half its size. A decoder's cache of keys and values grows by a token
    /// every step and is replaced every step, so each block made for it lasts about as many
    /// steps again as it has grown since the plan (at most half as many bytes again), and the
    /// blocks made for it become rarer as it grows, where blocks of its size class alone were
    /// outgrown every time it crossed a class, all of its layers at once. Not an array more
    /// than [`layout::MISSING`] times its recorded size: another array than the position's, not
    /// its array grown (a Whisper-style server's first decoding step of a request matched the
    /// encoder output's keys and values, 2.2 MiB, with a position where the step it was planned
    /// from made a token's, 1.5 KiB; given half their size again, their blocks took the cache
    /// past its high-water mark at every request: 1.273x of peak live recorded, 1.206x so,
    /// twelve long runs 1.200x -> 1.154x on average).
    ///
    /// An array of that share *shorter* than its recorded size (a server's next request, whose
    /// cache starts short again) gets room up to the recorded size, at most four times its own,
    /// when a block that large keeps the cache within the most it has held: a spare that large
    /// would have served it ([`DeviceArena::take_spare`]), and the array likely grows back to
    /// where the plan saw it. After a longer prompt took the last request's spares back to the
    /// device, a block of its size class alone was outgrown at every class the cache crossed:
    /// BART serving, recorded, made 12 device allocations a decoding step, 400 in the second
    /// half of its steps; 129 with the room (and 87 with spares freed largest first).
    fn apart_capacity(&self, st: &Counters, size: usize, recorded: usize) -> usize {
        let share = size <= self.high / GROWN_APART_SHARE;
        let grown = if share && size as u128 / layout::MISSING <= recorded as u128 {
            size.saturating_sub(recorded).min(size / 2)
        } else {
            0
        };
        let class = size_class_within(size.saturating_add(grown));
        if share && recorded > class {
            let back = size_class_within(recorded.min(size.saturating_mul(4)));
            if !self.would_pass_high(st, back) {
                return back;
            }
        }
        class
    }

    /// Whether a new block of `capacity` bytes would take the cache past the most it has held
    /// on the device ([`DeviceArena::high`]).
    fn would_pass_high(&self, st: &Counters, capacity: usize) -> bool {
        self.excess(st, capacity) > 0
    }

    /// The bytes by which a new block of `capacity` bytes would take the cache past the most it
    /// has held on the device.
    fn excess(&self, st: &Counters, capacity: usize) -> usize {
        self.held(st)
            .saturating_add(capacity)
            .saturating_sub(self.high)
    }

    /// Frees spares while a new block of `capacity` bytes would take the cache past the most it
    /// has held, so that keeping them never raises its peak: the smallest spare that makes room
    /// alone, else the largest (the oldest of those), and again, so that the fewest spares go
    /// back (each is a device allocation again when an array needs it; oldest first, a server's
    /// dozens of small blocks of keys and values went before the last request's large ones, and
    /// the next request made each small one again: BART serving 129 -> 87 device allocations in
    /// the second half of its recorded steps, Whisper serving 1316 -> 1224 in twelve long runs).
    /// Small spares stay (at most [`MAX_SMALL_SPARES`] of [`layout::SMALL`] bytes): freeing them
    /// would save next to nothing and cost a device allocation at the next small array the plan
    /// does not hold.
    fn free_spares_for(&mut self, st: &Counters, capacity: usize) {
        loop {
            let excess = self.excess(st, capacity);
            if excess == 0 {
                return;
            }
            // Small spares past the most kept (arrays apart, dropped after their step) may go.
            let smalls = self.small_spares();
            let may_go = |s: &Held| s.bytes() > layout::SMALL || smalls > MAX_SMALL_SPARES;
            let alone = (0..self.spares.len())
                .filter(|&i| may_go(&self.spares[i]) && self.spares[i].bytes() >= excess)
                .min_by_key(|&i| self.spares[i].bytes());
            // Newest first: of equal sizes, `max_by_key` takes the last, the oldest.
            let largest = || {
                (0..self.spares.len())
                    .rev()
                    .filter(|&i| may_go(&self.spares[i]))
                    .max_by_key(|&i| self.spares[i].bytes())
            };
            let Some(i) = alone.or_else(largest) else {
                return;
            };
            let spare = self.remove_spare(i);
            self.free_cached(st, spare.into_block());
        }
    }

    /// Whether a small solo block whose array dropped within its step is kept as a spare: a
    /// plan serves the steps (the small arrays it does not hold come every step; the first
    /// step's are all apart, and go back), and fewer than [`MAX_SMALL_SPARES`] small spares
    /// are kept.
    fn keeps_small_spare(&self) -> bool {
        self.plan.is_some() && self.small_spares() < MAX_SMALL_SPARES
    }

    /// Whether a solo block of `bytes` whose array dropped within its step is kept as a spare
    /// until the step's end ([`DeviceArena::step_spares`]): it is larger than small, and a plan
    /// serves the step (not the first step, whose arrays all go apart and whose blocks the plan
    /// replaces). Such a step's arrays apart come one after another: a detector's larger feature
    /// maps where no gap of the block holds them, positions that grew past their places, or
    /// positions over an earlier step's arrays still alive in the block (Mask R-CNN's masks).
    /// Kept across steps, such blocks crowded the next plans' blocks (GPT-2 training 1.000x ->
    /// 1.175x of peak live).
    fn keeps_step_spare(&self, bytes: usize) -> bool {
        bytes > layout::SMALL && self.plan.is_some()
    }

    /// Gives back the spares kept for this step alone ([`DeviceArena::step_spares`]) that are
    /// still spares.
    fn free_step_spares(&mut self, st: &Counters) {
        if self.step_spares.is_empty() {
            return;
        }
        let ids = std::mem::take(&mut self.step_spares);
        let gone: Vec<Held> = self
            .spares
            .extract_if(.., |s| ids.contains(&s.block().id()))
            .collect();
        for spare in gone {
            self.free_cached(st, spare.into_block());
        }
    }

    /// Allocation `rec` of the step, a small array of `req.bytes`: a free slot of slab `k`,
    /// through the view the slot kept when it is on the thread's current stream, else a new one
    /// (the caller counts the hit, or the miss that made the slab).
    /// `None`: the slab's block is on another stream with arrays of it alive (the online block
    /// serves the array).
    fn slab_slot(
        &mut self,
        st: &Counters,
        k: usize,
        req: &Request<'_>,
        rec: u32,
    ) -> Option<Planned> {
        let (step, g) = (self.step, self.gauge);
        let slab = &mut self.slabs[k];
        let arena = slab.arena;
        // SAFETY: a slab's block is the cache's until given up.
        let counts = unsafe { arena.as_ref() };
        if !counts.block.on_current_stream() {
            if counts.views() != 0 {
                return None;
            }
            // SAFETY: no view of it is alive (its idle views touch only their own state), and
            // we hold the lock.
            let block = unsafe { ArenaBlock::block_mut(arena) };
            if let Err(e) = block.prepare_reuse() {
                return Some(Planned::Failed(e));
            }
        }
        let (slot, idle) = slab.take()?;
        let offset = slot * layout::SMALL;
        let view = match idle {
            Some(view) if view.on_current_stream() => Ok(view),
            other => {
                drop_views(other);
                new_view(arena, offset)
            }
        };
        match view {
            Ok(view) => {
                let size = aligned(req.bytes).unwrap_or(layout::SMALL);
                let view = counted(
                    &mut slab.in_use,
                    st,
                    g,
                    arena,
                    offset,
                    (req.bytes, size),
                    view,
                );
                Some(Planned::View(view, gap_slot(rec), step))
            }
            Err(e) => {
                slab.untake(slot);
                Some(Planned::Failed(e))
            }
        }
    }

    /// Small arrays no longer get slots of slabs: the slabs are given up (freed, or retired
    /// while arrays of them are alive). Returns how many were retired.
    fn stop_slabs(&mut self, st: &Counters) -> usize {
        self.tiny_apart = false;
        let slabs = std::mem::take(&mut self.slabs);
        slabs
            .into_iter()
            .map(|s| usize::from(self.give_up_slab(st, s)))
            .sum()
    }

    /// Gives slab `slab` up: its idle views dropped, its block freed, or retired while arrays of
    /// it are alive (returns `true`; the last of them frees it).
    fn give_up_slab(&mut self, st: &Counters, mut slab: Slab) -> bool {
        drop_views(slab.take_idle());
        self.detach(st, slab.arena, slab.in_use, false)
    }

    /// At a step's end (and when the stats are read): a slab no array holds a slot of gets
    /// every slot back, its bytes all cached (those of arrays dropped on other threads were not
    /// counted back); a slab one of whose views was used on another stream is given up, its
    /// bytes waiting for that work. Returns how many slabs were retired.
    fn settle_slabs(&mut self, st: &Counters) -> usize {
        let mut retired = 0;
        let mut k = 0;
        while k < self.slabs.len() {
            if self.slabs[k].tainted {
                let slab = self.slabs.swap_remove(k);
                retired += usize::from(self.give_up_slab(st, slab));
                continue;
            }
            let slab = &mut self.slabs[k];
            if slab.is_unused() {
                cached(st, self.gauge, std::mem::take(&mut slab.in_use));
                slab.reset();
            }
            k += 1;
        }
        retired
    }

    /// The spares of at most [`layout::SMALL`] bytes.
    fn small_spares(&self) -> usize {
        let small = |s: &&Held| s.bytes() <= layout::SMALL;
        self.spares.iter().filter(small).count()
    }

    /// Keeps `layout`, the plan of another kind of step, for when such a step comes again (the
    /// least recently used shelved plans go while the shelf is full: [`MAX_SHELVED`] plans, or
    /// [`MAX_SHELVED_POSITIONS`] positions with `layout`'s).
    fn shelve(&mut self, layout: Layout) {
        debug_assert!(!layout.one_step(), "a layout for one step shelved");
        let mut positions: usize = self.shelf.iter().map(|s| s.layout.len()).sum();
        while self.shelf.len() >= MAX_SHELVED
            || !self.shelf.is_empty() && positions + layout.len() > MAX_SHELVED_POSITIONS
        {
            // The least recently used goes, but never the plan of the largest footprint (unless
            // `layout` is larger): a step of a kind no shelved plan fits (a larger batch than
            // any of theirs) is served by it, where a smaller plan would leave the step to its
            // block's gaps, and what they cannot hold to blocks of their own.
            let largest = (0..self.shelf.len())
                .max_by_key(|&i| self.shelf[i].layout.footprint)
                .filter(|&i| self.shelf[i].layout.footprint > layout.footprint);
            let Some(i) = (0..self.shelf.len())
                .filter(|&i| Some(i) != largest)
                .min_by_key(|&i| self.shelf[i].used)
            else {
                break;
            };
            positions -= self.shelf.swap_remove(i).layout.len();
        }
        #[cfg(test)]
        SHELVED_MOST.with(|most| most.set(most.get().max(positions + layout.len())));
        let used = self.step;
        self.shelf.push(Shelved { layout, used });
    }

    /// The first allocation of a step, of `size` aligned bytes, picks the plan to follow: of
    /// the current plan and the shelved ones, the one whose recorded first allocation fits it
    /// most tightly, a plan made from a cold start only if no other fits (else the one whose
    /// first allocation is largest, again one from a cold start last: the second step's plan
    /// scales as the step grows, where the first step's holds what only a first step makes).
    /// Between plans whose first allocations are the same size, a plan that a step followed
    /// from its first position to its last goes before one made from a step that left its
    /// plan and followed by none since: kinds of step that begin alike (a Whisper-style
    /// decoder's step that projects the encoder's output for a new request, then a decoding
    /// step, both beginning with the token's embedding) are told apart only later, and the
    /// decoding steps after the rarer kind followed its plan, left it, and were planned again
    /// (Whisper's decoding, five passes longer in shuffled orders: 282 device allocations in
    /// the second halves of twelve runs, 121 so); and that the step kept as it was (not
    /// planned again). Unless a step took it for that alone and it or the next step did not
    /// keep it so ([`Layout::followed`]): then the two kinds that begin alike are the steps'
    /// own and the plan's, and the steps stay on their own plan (taken again, it was left or
    /// planned again at every step or every other, for good). Then the current plan. But
    /// before that preference, the current plan when it was placed around pins still alive: a
    /// shelved plan's positions over them would go apart at every step while they live (an
    /// optimizer's state made after the first step, see the code). A shelved
    /// plan is switched in only when no array uses the block, which the layouts share (a
    /// layout knows only its own arrays), but pins of the current plan (a loss from the last
    /// step, kept until this one replaces it) in a block that holds the shelved plan: the pins
    /// stay the plan's, and the positions over them are served apart until they drop. A step
    /// that cannot switch follows a plan of another kind, and leaves it (ResNet-50 trained on a
    /// varying batch, its loss in the block: 1.070x of peak live, 1.182x in the worst order,
    /// against 1.052x switching). Returns whether the block was retired (never: no array uses
    /// it).
    fn choose_plan(&mut self, st: &Counters, size: usize) -> bool {
        let Some(plan) = &mut self.plan else {
            return false;
        };
        // Fitting first, then one not made from a cold start (a first step allocates what
        // later steps do not), then the tightest; else, again not from a cold start first,
        // the largest. Between plans whose first allocations are the same size, one that a
        // step followed to its end ([`Layout::followed`]).
        // Arrays of earlier steps alive in the block that the current plan was placed around
        // (none of their bytes blocked for it): a shelved plan's positions over them would be
        // served apart, each a device allocation, at every step while they live (an
        // optimizer's state made after the first step: ResNet-50 trained in fp16 took the plan
        // of its steps before the state over the plan made around it, and allocated four arrays
        // apart a step until a plan was made again, 1.072x of its peak live bytes; 1.024x and
        // none so).
        let around = !plan.pins.is_empty() && !plan.layout.blocks_any();
        let rank = |l: &Layout, shelved: bool| {
            let first = l.first_size();
            let over = around && shelved;
            if size <= first {
                (false, l.cold, first, over, !l.followed)
            } else {
                (true, l.cold, usize::MAX - first, over, !l.followed)
            }
        };
        let current = rank(&plan.layout, false);
        let mut best = current;
        let mut pick = None;
        for (i, s) in self.shelf.iter().enumerate() {
            let r = rank(&s.layout, true);
            if r < best {
                (best, pick) = (r, Some(i));
            }
        }
        let Some(i) = pick else {
            return false;
        };
        let fits = plan.block_bytes() >= self.shelf[i].layout.footprint;
        // Arrays of earlier steps alive in the block, every one a pin (a loss, or gradients,
        // kept until the next step's): the shelved plan takes the block if it holds it, its
        // positions over the pins served apart until they drop. Else it waits for an unused
        // block.
        if plan.block_in_use() && !(fits && plan.holds_only_pins()) {
            return false;
        }
        // The block stays if it holds the shelved plan, with every idle view: the positions'
        // stashed for the layout shelved, which takes back its own (if it stashed any); the
        // loose ones for the positions that have none, as they are served.
        let block = if fits {
            plan.stash_views();
            None
        } else {
            plan.take_block()
        };
        let pins = std::mem::take(&mut plan.pins);
        let shelved = &mut self.shelf[i];
        plan.swap_layout(&mut shelved.layout);
        plan.unstash_views();
        shelved.used = self.step;
        // Only this swap makes a shelved plan current again: what it was watched for before
        // counts no more.
        let tie = (best.0, best.1, best.2) == (current.0, current.1, current.2);
        plan.layout.on_tie = if tie { TIE_TAKEN } else { 0 };
        plan.loose.set_cap(loose_cap(&plan.layout, &self.shelf));
        if plan.block.is_some() {
            // No array but the pins uses the block: what else is still counted in use was
            // dropped on other threads, and its bytes may be handed out again, so they are
            // cached again.
            let held: usize = pins.iter().map(|p| p.range.len()).sum();
            cached(st, self.gauge, plan.in_use.saturating_sub(held));
            plan.in_use = held;
            for p in &pins {
                plan.layout.block(p.range.clone());
            }
            plan.pins = pins;
        }
        let Some((b, in_use)) = block else {
            return false;
        };
        // The shelved plan needs a larger block.
        self.detach(st, b, in_use, true)
    }

    /// Position `pos` of a plan scaled for the step, which it followed so far, is too small for
    /// the allocation of `size` aligned bytes made there: the step's arrays grew in more than
    /// the scale's ratio, and the next plans scaled take what it lacked more
    /// ([`Margin::learned`]). Not from a position under a 256th of the footprint (small
    /// arrays are rounded to the alignment, and their ratios say little).
    fn learn_margin(&mut self, pos: u32, size: usize) {
        let Some(plan) = &self.plan else {
            return;
        };
        let place = plan.layout.range(pos).len();
        if place >= plan.layout.footprint / 256 {
            self.margin = self.margin.learned(size, place);
        }
    }

    /// Whether position `pos`, which `size` aligned bytes outgrow, is served apart on its own
    /// while the step stays on its plan: it is placed and free, and the bytes grown so far this
    /// step stay within a [`GROWN_BUDGET`]th of the plan's footprint (a step that grows
    /// everywhere, a longer sequence, goes apart as a whole, and its plan's block back to the
    /// device). A few
    /// positions growing a little every step (a decoder's attention over the tokens so far)
    /// then leave the plan's other positions on it. Not an allocation that is another array
    /// than the position's ([`Layout::another_array`]): the step left the plan there. Nor one
    /// of at least a [`GROWN_SHARE`]th of the footprint that would take the cache past the most
    /// it has held, while no array of an earlier step holds the block (no pins): a larger batch's
    /// input, served apart, was held beside the plan scaled for the rest of the step (ViT-B
    /// 1.053x of peak live, DenseNet 1.110x); the step leaves its plan at once, and the plan
    /// scaled holds the array too (1.016x both). Nor, when the block is unused (the arrays
    /// grown went apart) and the plan can be scaled for the step, one that takes the bytes grown
    /// this step past that share: a longer sequence grows everywhere, in arrays each smaller
    /// than the share, which went apart one by one until an eighth of the footprint (the budget
    /// then) had (GPT-2 trained on varying lengths: 113 device allocations after its second
    /// step, 42 so; ViT-S on a varying batch 24 and 1.051x of peak live, 7 and 1.041x).
    fn grows_in_place(&self, st: &Counters, pos: u32, size: usize) -> bool {
        let Some(plan) = &self.plan else {
            return false;
        };
        let l = &plan.layout;
        let planned = l.range(pos).len();
        let share = l.footprint / GROWN_SHARE;
        // The step's record is looked at last, only when the bytes grown pass the share.
        let scales_instead = || {
            plan.pins.is_empty()
                && self.would_pass_high(st, size)
                && (size >= share
                    || self.grown + size >= share
                        && self.grown_arrays + 1 >= GROWN_TO_SCALE
                        && !plan.block_in_use()
                        && l.scales(&self.record))
        };
        planned > 0
            && size > planned
            && !l.is_live(pos)
            && self.grown + size <= l.footprint / GROWN_BUDGET
            && !l.another_array(planned, size)
            && !scales_instead()
    }

    /// Whether the step's allocations so far, this one included, take at most
    /// [`SHORT_OF_PLAN`] of the bytes of the positions they were matched with: a step of
    /// another kind than the plan's (a smaller batch, whose cuDNN workspaces differ in number:
    /// its allocations matched with positions further on), where a position larger than planned
    /// is not an array that grew but one out of line. Such a step leaves its plan there, and its
    /// block's gaps serve it (ResNet-50 trained on a varying batch: its tenth step, a third of
    /// its plan's bytes so far, took two blocks of 13 and 16 MiB apart, then left the plan ten
    /// allocations later all the same), rather than a device allocation apart. Tallied from
    /// where the last call stopped: once per step's entry in the record.
    fn short_of_plan(&mut self) -> bool {
        let Some(plan) = &self.plan else {
            return false;
        };
        let t = &mut self.tally;
        for r in self.record.get(t.counted..).unwrap_or_default() {
            t.got += r.bytes;
            t.planned += plan.layout.range(r.planned).len();
        }
        t.counted = self.record.len();
        t.got.saturating_mul(SHORT_OF_PLAN.1) <= t.planned.saturating_mul(SHORT_OF_PLAN.0)
    }

    /// Takes the plan's block out of the plan: freed if no array uses it, else retired (then
    /// owned by its arrays). With `keep` (a plan will want a block again, maybe a larger
    /// one), a block that no array or stream uses and that can grow is kept for it instead
    /// ([`DeviceArena::given_up`]). Returns whether it was retired.
    fn detach(&mut self, st: &Counters, arena: BlockPtr, in_use: usize, keep: bool) -> bool {
        self.detach_with_room(st, arena, in_use, keep, None)
    }

    /// [`DeviceArena::detach`], the block's free bytes `room` (see [`Plan::room`]) kept as a
    /// [`Room`] if it is retired under arrays that hold at least a [`ROOM_SHARE`]th of it, while
    /// the device holds fewer than [`MAX_ROOMS`].
    fn detach_with_room(
        &mut self,
        st: &Counters,
        arena: BlockPtr,
        in_use: usize,
        keep: bool,
        room: Option<Gaps>,
    ) -> bool {
        // SAFETY: a plan's block is the cache's until detached.
        let counts = unsafe { arena.as_ref() };
        let bytes = counts.block.bytes();
        debug_assert!(
            in_use <= bytes,
            "{in_use} bytes in use in a block of {bytes}"
        );
        if counts.views() > 0 {
            // The rest of the block is not handed out again: in use until it comes back (a
            // room hands it out as the block's).
            uncached(st, self.gauge, bytes - in_use);
            let roomy = self.rooms.len() < MAX_ROOMS && in_use.saturating_mul(ROOM_SHARE) >= bytes;
            match room.filter(|_| roomy) {
                Some(free) if counts.retire_held() => {
                    #[cfg(test)]
                    ROOMS_HELD.with(|n| n.set(n.get() + 1));
                    self.rooms.push(Room::new(arena, free));
                    return true;
                }
                None if counts.retire() => return true,
                _ => {}
            }
            // Every array dropped meanwhile on another thread: it is ours again.
            cached(st, self.gauge, bytes);
        } else {
            // Arrays dropped on other threads were not counted back.
            cached(st, self.gauge, in_use);
        }
        // SAFETY: no view is alive (counted zero, synchronised with the drops by `Acquire`).
        let block = unsafe { ArenaBlock::into_block(arena) };
        self.give_up(st, block, keep);
        false
    }

    /// Takes `block`, a plan's block that no array uses, counted as cached, out of use: with
    /// `keep`, kept for the next plan's block ([`DeviceArena::given_up`]) when it can grow and
    /// no stream's work on it is pending; else freed, or while another stream may still use
    /// it, kept as a spare (not reused) until that work is done. Returns whether it was freed.
    fn give_up(&mut self, st: &Counters, block: Block, keep: bool) -> bool {
        if keep && may_keep(&block) {
            let step = self.step;
            if let Some((old, _)) = self.given_up.replace((block, step)) {
                self.free_cached(st, old);
            }
            false
        } else if block.is_idle() {
            self.free_cached(st, block);
            true
        } else {
            // Another stream may still use it: kept with the spares (not reused until that work
            // is done).
            self.spares.push(Held::Bare(block));
            false
        }
    }

    /// Grows the plan's block `arena` in place to `bytes` under the arrays of the step still
    /// alive in it (views stay valid: the backend maps more memory after its end), when a new
    /// plan, placed around them, outgrows it: the block and those arrays stay, where else it
    /// would be retired under them and a new block made beside it (EfficientNet trained on a
    /// varying batch: its loss, a few bytes from the block's gaps, kept a 694 MiB block out of
    /// the next plan's 1366 MiB). Spares, and the block given up, go back first if the growth
    /// would take the cache past the most it has held. Counted as a block grown for a plan is:
    /// its old size freed, its new one allocated. Returns whether it grew.
    fn grow_block(&mut self, st: &Counters, arena: BlockPtr, bytes: usize) -> bool {
        // SAFETY: a plan's block is the cache's until detached, and alive while it is.
        let block = &unsafe { arena.as_ref() }.block;
        let old = block.bytes();
        self.make_room(st, bytes.saturating_sub(old));
        let note = record::on().then(|| BufferNote::of(block));
        if !matches!(block.grow(bytes), Ok(true)) {
            // Out of memory, or no room to grow: the caller retires the block as before.
            return false;
        }
        st.freed(self.gauge, old);
        if let Some(note) = note {
            note_buffer(st, self.gauge, &self.trace, EventKind::DeviceFree, note);
        }
        st.allocated(self.gauge, block.bytes());
        cached(st, self.gauge, block.bytes() - old);
        self.note_held(st);
        if record::on() {
            note_block(st, self.gauge, &self.trace, EventKind::PlanBlock, block);
        }
        true
    }

    /// The step outgrew its plan at position `pos`, and arrays planned to live on hold the plan's
    /// block (or arrays hold it, however briefly, and waiting for them would send half the
    /// footprint apart: [`Layout::waits_past_half`]): the plan is scaled as the step grew, and the
    /// rest of the step, from `pos` on, placed again around the arrays alive in the block
    /// ([`Layout::scale_around`]), which grows in place if the rest needs more bytes (where it can:
    /// see [`DeviceArena::grow_block`]). Returns whether it was: the step then follows that layout,
    /// with no array apart and no device allocation but the growth. Not when the gaps or the tail
    /// handed out ranges this step, nor when the block was used on another stream.
    ///
    /// Served from the block's gaps instead, such a step (a detector's larger image, a training
    /// step's longer batch) found no gap for many of its arrays, in a block sized for a smaller
    /// step: each went apart, a device allocation and bytes beside the block. So did an
    /// encoder's step whose batch and length grew while its block held one array of 2 KiB,
    /// dropped 12 allocations later: waiting for it sent the step's first hidden states apart,
    /// then the gaps of a block a third of the step's size served the rest (29 device
    /// allocations in the step; 4 placed around it).
    fn rest_around(&mut self, st: &Counters, pos: u32) -> bool {
        let margin = self.margin;
        self.place_rest(
            st,
            |layout, record, pinned, learned| {
                layout.scale_around(record, pos, pinned, margin, learned)
            },
            Layout::unscale_around,
        )
    }

    /// Places the rest of the step again in the plan's block with `place` (given the layout,
    /// the step's record and the pins' ranges; it returns the bytes the block must hold, or
    /// `None` with the layout unchanged), the block grown in place if the rest needs more bytes
    /// (where it can: see [`DeviceArena::grow_block`]), else the layout taken back with `undo`.
    /// Returns whether it was. Not when the gaps or the tail handed out ranges this step, nor
    /// when the block was used on another stream. Serves [`DeviceArena::rest_around`] and
    /// [`DeviceArena::keep_rest`].
    fn place_rest(
        &mut self,
        st: &Counters,
        place: impl FnOnce(
            &mut Layout,
            &[Rec],
            &[std::ops::Range<usize>],
            &crate::planner::Learned,
        ) -> Option<usize>,
        undo: fn(&mut Layout),
    ) -> bool {
        let Some(plan) = &mut self.plan else {
            return false;
        };
        let Some(arena) = plan.block else {
            return false;
        };
        if plan.tainted || plan.gaps.is_some() || plan.out() != 0 {
            return false;
        }
        let pinned = crate::planner::merged(plan.pins.iter().map(|p| p.range.clone()));
        // The positions may move: their idle views go loose first, at the offsets they were
        // made at; the tail (it handed nothing out) is past a footprint that may change.
        plan.loosen_views();
        plan.tail = None;
        let Some(bytes) = place(&mut plan.layout, &self.record, &pinned, &self.planner) else {
            return false;
        };
        if bytes > plan.block_bytes() && (!plan.grows_now() || !self.grow_block(st, arena, bytes)) {
            if let Some(plan) = &mut self.plan {
                undo(&mut plan.layout);
            }
            return false;
        }
        true
    }

    /// Whether the rest of the step, which keeps the arrays held over (its allocation at `pos`,
    /// of `size` aligned bytes, meets one alive past its planned end:
    /// [`Layout::keeps_held_over`]), is placed again around them in the plan's block as it is
    /// ([`Layout::keep_rest`]), grown in place if it needs more bytes (where it can: see
    /// [`DeviceArena::grow_block`]). Not when the array is larger than its position, nor when an
    /// array the block's gaps or tail handed out is alive, or another stream used the block.
    fn keep_rest(&mut self, st: &Counters, pos: u32, size: usize) -> bool {
        let Some(plan) = &self.plan else {
            return false;
        };
        if pos == NONE || size > plan.layout.range(pos).len() || !plan.layout.keeps_held_over() {
            return false;
        }
        let block = plan.block_bytes();
        let most = if plan.grows_now() {
            block.saturating_add(block / KEPT_REST_GROWTH)
        } else {
            block
        };
        let kept = self.place_rest(
            st,
            |layout, _, pinned, learned| layout.keep_rest(pos, pinned, most, learned),
            Layout::unkeep_rest,
        );
        #[cfg(test)]
        if kept {
            RESTS_KEPT.with(|n| n.set(n.get() + 1));
        }
        kept
    }

    /// Whether a step that outgrew its plan, held long in its block, does not try to place the
    /// rest again around the arrays alive there ([`DeviceArena::rest_around`]): it matched the
    /// plan position by position so far (a decoder's step, its attention over one token more),
    /// and the last such try failed, fewer than [`AROUND_RETRY`] such steps ago (counted here).
    /// A try is a plan of the rest of the step, and T5's decoding steps that grew failed it at
    /// every step but one (the rest needed 8-11% more than the plan scaled whole): 60-130 µs a
    /// step on the CPU for nothing, before the rest was served from the block's gaps.
    fn skips_around(&mut self) -> bool {
        let skips = (1..=AROUND_RETRY).contains(&self.around_missed)
            && layout::aligned_so_far(&self.record);
        if skips {
            self.around_missed += 1;
        }
        skips
    }

    /// Whether the step, which outgrew its plan, is in doubt: the steps so far, this one too,
    /// began with at most two sizes (a fixed-shape loop, of one or two kinds of step), and a
    /// step followed the plan, which is a training step's (most of its peak held by activations
    /// kept for the backward pass: [`Layout::kept_at_peak`]). The step may be another kind that
    /// begins as the training step does, larger: an evaluation step on a larger batch, whose
    /// forward pass keeps no activation. Such a step is served from the block's gaps rather than
    /// from the plan scaled, until one does not hold an array ([`DeviceArena::doubted`]).
    /// ResNet-50 trained on batches of 32 with an evaluation step on 64 every fourth step in its
    /// scope: the evaluation step matched the training plan scaled twofold for ten allocations,
    /// its block grown to twice the training step's at the fifth and held so for good (2.006x of
    /// the log's peak live bytes; 1.024x so).
    fn doubts(&self) -> bool {
        self.firsts.few()
            && self
                .plan
                .as_ref()
                .is_some_and(|p| p.layout.confirmed && p.layout.kept_at_peak())
    }

    /// Allocation `rec` of `size` aligned bytes of a step in doubt ([`DeviceArena::doubts`]),
    /// which no gap of the plan's block holds: the step is the training step larger after all
    /// (the batch raised), and the block grows in place to the plan scaled as the step grew (at
    /// least by the array), as scaling would have grown it; its new bytes are a gap, which
    /// serves the array. Once: a growth refused, or too little, sends the rest apart. Returns
    /// the array's offset.
    fn doubted(&mut self, st: &Counters, rec: u32, size: usize) -> Option<usize> {
        self.in_doubt = false;
        let plan = self.plan.as_ref()?;
        let arena = plan.block?;
        // SAFETY: a plan's block is the cache's until detached, and alive while it is.
        let bytes = unsafe { arena.as_ref() }.block.bytes();
        let scaled = plan.layout.scaled_footprint(&self.record, self.margin);
        let want = scaled.unwrap_or(0).max(bytes + size);
        self.grow_with_gaps(st, arena, want)?.take(rec, size, false)
    }

    /// Grows the plan's block `arena`, whose gaps are open, in place to `bytes` (when it can
    /// grow now: [`Plan::grows_now`]; see [`DeviceArena::grow_block`]): its new bytes are a gap.
    /// Returns the gaps, `None` when it did not grow.
    fn grow_with_gaps(
        &mut self,
        st: &Counters,
        arena: BlockPtr,
        bytes: usize,
    ) -> Option<&mut Gaps> {
        if !self.plan.as_ref()?.grows_now() || !self.grow_block(st, arena, bytes) {
            return None;
        }
        // SAFETY: a plan's block is the cache's until detached, and alive while it is.
        let grown = unsafe { arena.as_ref() }.block.bytes();
        let gaps = self.plan.as_mut()?.gaps.as_mut()?;
        gaps.grow(grown);
        Some(gaps)
    }

    /// Frees the plan's block if no array uses it (a step that left its plan uses it no more).
    /// Returns whether it was retired (never: it has no views).
    fn release_unused_block(&mut self, st: &Counters) -> bool {
        let Some(plan) = &mut self.plan else {
            return false;
        };
        if plan.gaps.is_some() {
            // The rest of the step is served from it.
            return false;
        }
        if plan.block.is_none() || plan.block_in_use() {
            return false;
        }
        let doubt = self.outgrew && self.doubts();
        if self.outgrew && (doubt || !self.may_scale()) && self.gaps_instead() {
            self.in_doubt = doubt;
            return false;
        }
        let Some(plan) = &mut self.plan else {
            return false;
        };
        plan.take_block()
            .is_some_and(|(b, in_use)| self.detach(st, b, in_use, true))
    }

    /// Whether a step that outgrew its plan may go on from the plan scaled as it grew, in a new
    /// block, once the plan's block is unused: it has not reached the middle of the plan, and it
    /// matched the plan position by position ([`Layout::scales`]). Else the block, once unused,
    /// is kept, and serves the rest of the step from its gaps ([`DeviceArena::gaps_instead`]).
    fn may_scale(&self) -> bool {
        // The step's latest allocation, as the scaled plan's first one is checked.
        let rec = u64::from(self.tick.saturating_sub(1));
        self.plan
            .as_ref()
            .is_some_and(|p| 2 * rec < p.layout.len() as u64 && p.layout.scales(&self.record))
    }

    /// The step outgrew its plan and gave up waiting for its block to be unused, or cannot
    /// follow the plan scaled: the block's free bytes serve the rest of the step, and stay open
    /// however many arrays do not fit them (unless the block holds nothing when one would take
    /// the cache past its peak: [`DeviceArena::close_unused_gaps`]). Returns whether the gaps
    /// opened (the block exists and may be used on the step's stream).
    fn gaps_instead(&mut self) -> bool {
        let Some(plan) = &mut self.plan else {
            return false;
        };
        if plan.open_gaps(&self.record).is_err() || plan.gaps.is_none() {
            return false;
        }
        self.outgrew = false;
        self.keep_gaps = true;
        true
    }

    /// The plan's block, serving the rest of the step from its gaps, goes back to the device
    /// if no array uses it: an allocation apart would take the cache past the most it has held
    /// ([`DeviceArena::high`]), and a block that holds nothing must not raise the peak. Returns
    /// whether the block was retired.
    fn close_unused_gaps(&mut self, st: &Counters) -> bool {
        let Some(plan) = &mut self.plan else {
            return false;
        };
        if plan.gaps.is_none() || plan.block_in_use() {
            return false;
        }
        plan.gaps = None;
        self.keep_gaps = false;
        self.outgrew = true;
        plan.take_block()
            .is_some_and(|(b, in_use)| self.detach(st, b, in_use, true))
    }

    /// An allocation of `size` aligned bytes goes apart while the step, which outgrew its plan,
    /// waits for the plan's block to be unused: once half the plan's footprint went apart so,
    /// the block's gaps serve the rest instead (a detection model's feature maps hold the block
    /// through its heads; an inference step's first arrays die within a few layers).
    fn wait_for_block(&mut self, size: usize) {
        let Some(plan) = &self.plan else {
            return;
        };
        if !self.outgrew || plan.block.is_none() || plan.gaps.is_some() {
            return;
        }
        self.waited += size;
        if self.waited > plan.layout.wait_limit() {
            self.gaps_instead();
        }
    }

    /// The arrays of `plan`'s block alive at the end of a step that is planned again, as pins
    /// for the next plan of the block, when every one is known (served this step, at a position
    /// or from the block's gaps, or pinned before), they are at most [`MAX_PINS`] (or
    /// [`MAX_SMALL_PINS`], see there), and those not pinned before nor held over hold at most a
    /// [`PIN_SHARE`]th of the block: a training loop's loss, kept until the next step's
    /// replaces it (in a scope served online: at most [`MAX_ONLINE_PINS`], whatever their
    /// bytes). Empty when no array uses the block. `None` otherwise (a position
    /// alive since an earlier step, an array dropped on another thread whose bytes are not
    /// settled yet, a view used on another stream, or arrays too many or too large): the block
    /// is retired under them. Called after the layout's [`Layout::end_step`].
    fn pins_for(&self, plan: &Plan) -> Option<Vec<Pin>> {
        let arena = plan.block?;
        // SAFETY: a plan's block is the cache's until detached.
        let counts = unsafe { arena.as_ref() };
        let views = usize::try_from(counts.views()).ok()?;
        if views == 0 {
            return Some(Vec::new());
        }
        let most = if self.online {
            MAX_ONLINE_PINS
        } else {
            MAX_PINS
        };
        let grows = counts.block.is_growable();
        // More than `most` only in a block that can grow, off the online tier, when they hold
        // little of it (below).
        let many = if grows && !self.online {
            MAX_SMALL_PINS
        } else {
            most
        };
        if plan.tainted || views > many {
            return None;
        }
        let positions = plan.layout.alive_at_end()?;
        // Every view alive is a pin, a position or a range handed out from the gaps or the tail
        // (each may count one dropped on another thread: then the numbers differ).
        if plan.out() + positions.len() + plan.pins.len() != views {
            return None;
        }
        let mut pins = plan.pins.clone();
        // The bytes the block keeps already: those of earlier steps' pins still alive, and
        // those of positions held over, which the plan placed to be kept.
        let mut kept: usize = pins.iter().map(|p| p.range.len()).sum();
        kept += positions
            .iter()
            .filter(|(pos, ..)| plan.layout.is_held_over(*pos))
            .map(|(_, rec, _)| self.record.get(*rec as usize).map_or(0, |r| r.bytes))
            .sum::<usize>();
        // Every array pinned anew made past the plan's last position by a step that followed
        // the plan to there: an optimizer's state, made at its first step after micro-batches.
        let len = plan.layout.len();
        let made_past_plan = len > 0
            && self.record.len() > len
            && layout::aligned_so_far(&self.record[..len])
            && positions
                .iter()
                .all(|&(pos, ..)| plan.layout.is_held_over(pos))
            && plan.handed_out().all(|(rec, _)| rec as usize >= len);
        let served = plan
            .handed_out()
            .map(|(rec, offset)| (gap_slot(rec), rec, offset, false));
        let placed = positions.into_iter().map(|(pos, rec, range)| {
            let held = plan.layout.is_held_over(pos);
            (view_slot(pos), rec, range.start, held)
        });
        for (slot, rec, offset, held) in served.chain(placed) {
            let bytes = self.record.get(rec as usize)?.bytes;
            pins.push(Pin {
                step: self.step,
                slot,
                range: offset..offset + bytes,
                held,
            });
        }
        pins.sort_unstable_by_key(Pin::home);
        let bytes: usize = pins.iter().map(|p| p.range.len()).sum();
        let block = counts.block.bytes();
        // Many only when those pinned anew hold little of a block that can grow, or were made
        // past the plan's end ([`MAX_SMALL_PINS`]); and the budget of a [`PIN_SHARE`]th is
        // for the arrays pinned anew too: those pinned by an earlier plan, or at positions held
        // over, the block keeps already, and retired under them it would stay beside the next
        // plan's block until they drop (a Whisper-style decoder replayed in shuffled orders:
        // 2-4 device allocations in the second half of each of twelve runs when they counted;
        // none so, though 26 after the second step instead of 13-14).
        let new = bytes - kept;
        let few = views <= most || new <= block / SMALL_PINS_SHARE || grows && made_past_plan;
        let small = new <= block / PIN_SHARE;
        (few && (self.online || small || grows && self.keeps_block_under(bytes, block)))
            .then_some(pins)
    }

    /// What the next plan, made from the step that just ended on `old`'s block with `pins`
    /// pinned, may hold over ([`HeldOver`]): as many arrays as a block's pins may be, less those
    /// of earlier steps, and the share of the block that pins made anew may hold (those of
    /// earlier steps, which the block keeps already, do not count against it: an optimizer's
    /// state, pinned since its first step, and the gradients held over beside it hold more than
    /// half of GPT-2's block); nothing when the block cannot keep its arrays (it has none, or
    /// those alive in it cannot all be pinned: held over again, they would retire it every
    /// time).
    fn held_over(&self, old: &Plan, pins: Option<&[Pin]>) -> HeldOver {
        let (Some(block), Some(pins)) = (old.block, pins) else {
            return HeldOver::default();
        };
        // SAFETY: a plan's block is the cache's until detached.
        let counts = unsafe { block.as_ref() };
        let (count, share) = if counts.block.is_growable() && !self.online {
            (MAX_SMALL_PINS, SMALL_PINS_SHARE)
        } else {
            (MAX_PINS, PIN_SHARE)
        };
        let earlier = pins.iter().filter(|p| p.step != self.step).count();
        HeldOver {
            count: count.saturating_sub(earlier),
            bytes: counts.block.bytes() / share,
        }
    }

    /// Whether the step that just ended, having left its plan, keeps its block (of `block`
    /// bytes, one that can grow) under arrays alive there that hold `pinned` bytes, more than a
    /// [`PIN_SHARE`]th of it: when they hold more than a [`LEFT_PIN_SHARE`]th (retired under
    /// them, the block would stay held beside the next plan's block until they drop, most of it
    /// theirs), or when the step's own arrays that dropped within it took at least that much
    /// of the block at once, so that the next step, like it, needs the block.
    fn keeps_block_under(&self, pinned: usize, block: usize) -> bool {
        let share = block / LEFT_PIN_SHARE;
        self.diverged && (pinned > share || layout::peak_within(&self.record) >= share)
    }

    /// Whether the step that just ended, served online, leaves the scope online: its arrays
    /// alive in the block are all known and at most [`MAX_ONLINE_PINS`], whatever their bytes
    /// (a detector's outputs, kept by the caller into the next step), and become the block's
    /// pins. Else (an array dropped on another thread not settled yet, a view used on another
    /// stream, too many allocations or arrays) the plans serve the steps again, from this
    /// step's plan. Called after the layout's [`Layout::end_step`].
    fn stays_online(&mut self, tainted: bool) -> bool {
        if self.tick == 0 {
            return true;
        }
        let pins = self
            .plan
            .as_ref()
            .filter(|p| !tainted && !self.overflowed && p.gaps.is_some())
            .and_then(|p| self.pins_for(p));
        match (pins, &mut self.plan) {
            (Some(pins), Some(plan)) => {
                plan.gaps = None;
                plan.layout.clear_live();
                plan.around_pins = !pins.is_empty();
                plan.pins = pins;
                true
            }
            _ => {
                self.online = false;
                if self.step == self.online_from.wrapping_add(1) {
                    // Online for one step: the arrays it left alive cannot stay where they
                    // are. A shadow started again at once would put the scope online again
                    // four steps later, and so on: ViT-S on gradients accumulated with AdamW,
                    // whose micro-batches end with 304 or 456 arrays alive (its state and
                    // gradients, more than [`MAX_ONLINE_PINS`]), ran one step in four online
                    // and the other three beside a shadow, for good. It counts as a shadow that
                    // held not enough less: the next starts later.
                    self.missed_shadow();
                }
                false
            }
        }
    }

    /// Feeds the step that just ended to the [`online::Shadow`] (started at the first step that
    /// left its plan), and serves the scope online from the next step on when its plans have
    /// held more than online serving would have: the cache's peak past the shadow's block by
    /// more than an [`ONLINE_MARGIN`]th, after at least [`ONLINE_AFTER`] steps measured, with a
    /// plan whose block the next step can start from.
    fn weigh_online(&mut self, st: &Counters) {
        if self.online || self.overflowed {
            self.shadow = None;
            self.earlier_drops.clear();
            return;
        }
        self.shadow_wait = self.shadow_wait.saturating_sub(1);
        let shadow = match &mut self.shadow {
            Some(shadow) => shadow,
            None if (self.diverged || self.scaled) && self.shadow_wait == 0 => {
                // The arrays of earlier steps alive now, which the shadow never sees (those of
                // this step alive at its end, it does).
                let (in_use, _) = super::traced::gauge_bytes(st, self.gauge);
                let open = self.record.iter().filter(|r| r.end == OPEN);
                let before = in_use.saturating_sub(open.map(|r| r.bytes).sum());
                self.shadow.insert(Box::new(Shadow::starting(before)))
            }
            None => return,
        };
        let fed = shadow.step(self.step, &self.record, &self.earlier_drops);
        #[cfg(test)]
        SHADOWED_STEPS.with(|n| n.set(n.get() + 1));
        self.earlier_drops.clear();
        if !fed {
            self.shadow = None;
            return;
        }
        if !self.diverged && !self.replan && !self.scaled && self.allocated == 0 {
            shadow.plan_held();
        }
        // Each way's peak against the most bytes alive at once that it had to hold: the plans'
        // since the cache's cold start, the shadow's since its first step (a step larger than
        // every one before, made before the shadow began, would make the plans look worse
        // than they are).
        let (held, live) = (shadow.held() as u128, shadow.peak().max(1) as u128);
        let most = self.peak_most.max(shadow.peak()).max(1) as u128;
        let margin = ONLINE_MARGIN as u128;
        // Whether the plans' peak of `plans` bytes is past the shadow's by the margin.
        let past = |plans: usize| plans as u128 * live * margin > held * most * (margin + 1);
        // The plans held every step since the shadow's first as it was, and their peak is
        // within the margin once the arrays made before the shadow began are left out (the
        // shadow never sees them): the steps repeat, and the plans' peak was the step that left
        // a plan, which online serving would not have held less (GPT-2 trained with four
        // micro-batches accumulated, a check log: its second step left the first step's plan,
        // made from a cold start, and its peak then, counted with the parameters, gradients and
        // optimizer state, went online at its fifth step: host time, and one device allocation
        // where its plans made none).
        let settled = shadow.plans_held_since() && !past(self.high.saturating_sub(shadow.before()));
        // The plan's block, when its backend can grow it, and whether it can grow now.
        let block = self.plan.as_ref().and_then(|p| {
            // SAFETY: a plan's block is the cache's until detached, and alive while it is.
            let growable = unsafe { p.block?.as_ref() }.block.is_growable();
            growable.then_some((p.block?, p.grows_now()))
        });
        if shadow.steps() >= ONLINE_AFTER
            && !settled
            && let Some((arena, grows_now)) = block
            && past(self.high)
        {
            // The block starts at the shadow's size, if larger: grown to it step by step
            // instead, from a smaller plan's block, its ranges came another way and took more
            // (RetinaNet, shuffled: 1.53x of its peak live bytes where the shadow held 1.22x).
            let want = shadow.held();
            // SAFETY: a plan's block is the cache's until detached, and alive while it is.
            let bytes = unsafe { arena.as_ref() }.block.bytes();
            // Not past the most the cache has held (arrays apart hold memory beside it).
            let past = self.held(st) + want.saturating_sub(bytes) > self.high;
            if bytes < want && (!grows_now || past || !self.grow_block(st, arena, want)) {
                return;
            }
            self.online = true;
            self.online_from = self.step;
            self.shadow = None;
        } else if shadow.steps() >= SHADOW_STEPS || settled && shadow.steps() >= ONLINE_AFTER {
            // Online serving held not enough less than the plans on these steps: they recur in
            // kind (a CNN whose batch varies). The next shadow starts later, and later again
            // each time, so that such a scope pays for it less and less. (A shadow stopped as soon
            // as its block held more than the plans, after four steps, kept Faster R-CNN v2 on
            // plans: 1.363x of its peak live bytes in runs five passes longer, where it holds
            // 1.217x online.) Plans that held the steps since the shadow's first stop it at once:
            // each step measured reads its record and simulates online serving on it, which took
            // two thirds of the host time of GPT-2's steps trained with micro-batches accumulated
            // (1.40 ms a step on the CPU, 0.49 ms without the shadow).
            self.shadow = None;
            self.missed_shadow();
        }
    }

    /// Counts a shadow that held not enough less than the plans (or put the scope online for a
    /// single step): the next starts [`SHADOW_STEPS`] steps later, twice as late after each such
    /// shadow (at most 64 times).
    fn missed_shadow(&mut self) {
        self.shadow_wait = SHADOW_STEPS << self.shadow_misses.min(6);
        self.shadow_misses = self.shadow_misses.saturating_add(1);
    }

    /// Allocation `rec` of `size` aligned bytes of a step served online (see the `online`
    /// module): a view of the smallest free range of the plan's block that holds it,
    /// the block grown in place at its top by what its top range lacks when none does. The
    /// free ranges were opened at the step's first allocation (`CacheState::planned`, the block
    /// made ready for the step's stream), around the arrays of earlier steps alive in the block
    /// (its pins). `None`: the block cannot be used on this stream, or cannot grow (the array
    /// goes apart).
    fn online_view(&mut self, st: &Counters, req: &Request<'_>, size: usize) -> Option<Planned> {
        let rec = self.tick - 1;
        let plan = self.plan.as_mut()?;
        let arena = plan.block?;
        let gaps = plan.gaps.as_mut()?;
        let offset = match gaps.take(rec, size, false) {
            Some(offset) => offset,
            None => {
                let bytes = online::grown_for(gaps, size)?;
                // The backend maps the new bytes after the block's end: the arrays' views stay
                // valid.
                self.grow_with_gaps(st, arena, bytes)?;
                // Small arrays kept in the block from earlier steps split its free bytes: from
                // now on small arrays get slots of slabs (not before: a scope whose small pins
                // cost it no growth would pay a device allocation for a slab).
                self.tiny_apart |= self.plan.as_ref().is_some_and(Plan::small_pins);
                self.plan.as_mut()?.gaps.as_mut()?.take(rec, size, false)?
            }
        };
        let plan = self.plan.as_mut()?;
        let step = self.step;
        Some(plan.hand_out(
            (st, self.gauge),
            arena,
            (rec, offset),
            (req.bytes, size),
            step,
        ))
    }

    /// Drops the plan (its block detached). Returns whether the block was retired.
    fn drop_plan(&mut self, st: &Counters) -> bool {
        self.settle_record();
        self.shelf.clear();
        let Some(mut plan) = self.plan.take() else {
            return false;
        };
        // Within a step, the rest of it is served apart, and it is planned at its end; between
        // steps, the next starts cold.
        self.diverged |= self.tick > 0;
        plan.take_block()
            .is_some_and(|(b, in_use)| self.detach(st, b, in_use, false))
    }

    /// Writes into the step's record the allocations the hit path served in order and left in
    /// their positions ([`Layout::hit`]): the record is read only after this.
    #[inline]
    fn settle_record(&mut self) {
        if let Some(plan) = &self.plan {
            settle_record(&mut self.record, self.tick, &plan.layout);
        }
        debug_assert_eq!(
            self.record.len() as u32,
            self.tick,
            "allocations missing from the record"
        );
    }

    /// The step ended: plans it again if it left its plan (keeping the block when it fits the
    /// new plan and no array uses it, or only arrays it may pin), and gives back the spares that
    /// a whole step did not use.
    /// Returns the number of blocks retired.
    fn end_step(&mut self, st: &Counters) -> usize {
        self.free_step_spares(st);
        // The record is read when the step left its plan or changed it; a step that followed its
        // plan in order leaves its allocations in their positions, and the record unwritten.
        let in_order = self.plan.as_ref().is_some_and(|p| p.layout.in_order);
        let shadowed = self.shadow.is_some();
        if !in_order || self.diverged || self.replan || self.scaled || self.overflowed || shadowed {
            self.settle_record();
            // A step that followed its plan in order held no more than the step it was made
            // from, whose record was read.
            self.peak_most = self.peak_most.max(layout::peak_live(&self.record));
        }
        let mut retired = 0;
        let n = self.tick;
        let mut followed = false;
        let (mut held_dropped, mut replan_dropped) = (false, false);
        let mut to_end = false;
        // The step is planned again from the step its plan was made from (see below).
        let mut as_made = false;
        if let Some(plan) = &mut self.plan {
            plan.settle_remote_drops(st, self.gauge);
            to_end = !self.diverged && plan.layout.reached_end();
            plan.layout.confirmed |= to_end;
            followed = plan.layout.end_step();
            // An array kept at a position held over: pinned by the next plan.
            let kept = plan.layout.kept_held_over();
            // One pinned so that dropped: see below; planned again for it alone when the step
            // made the sizes the plan was made from (a fixed-shape loop, whose plans may come
            // again: with sizes that vary, a plan made from scratch every optimizer step).
            held_dropped = std::mem::take(&mut plan.held_dropped);
            // Both ask whether the step made its plan's sizes (its record read for it).
            let sized = (kept || held_dropped) && !self.diverged && {
                settle_record(&mut self.record, self.tick, &plan.layout);
                plan.layout.same_sizes(&self.record)
            };
            // A step that followed its plan, in its sizes, and ended before it (a first
            // micro-batch, where the plan's step went on to the optimizer's), planned again for
            // the arrays it kept alone: the next step, of the plan's kind (the micro-batch
            // after, or the last, with the optimizer's step), gets that step's plan, placed
            // around them. Planned from the first micro-batch instead, the last micro-batch went
            // past that plan's end, and the block's gaps served the optimizer's step, every
            // optimizer step (ViT-S on two micro-batches, AdamW: 152 of its 796 allocations).
            // Not when what the plan's step made past this one's end outlived it (the first
            // optimizer step makes the state, which the next ones find alive).
            as_made = kept
                && sized
                && !self.replan
                && !self.scaled
                && followed
                && !to_end
                && plan
                    .layout
                    .made_from()
                    .get(n as usize..)
                    .is_some_and(|rest| !rest.is_empty() && rest.iter().all(|r| r.end != OPEN));
            self.replan |= kept;
            replan_dropped = held_dropped && sized;
            if self.held_dropped_last {
                self.kept_after_drop = kept;
            }
            self.held_dropped_last = held_dropped;
            plan.whole_again();
            plan.ready = false;
        }
        // Arrays the block's tail served, alive at the step's end: the step is planned again,
        // so that they are pinned in the block (or it leaves the plan, retired under them).
        // With none alive, the tail closes with the step.
        let tail_alive = self.plan.as_mut().is_some_and(|p| {
            let alive = p.tail.as_ref().is_some_and(|t| t.out() != 0);
            if !alive {
                p.tail = None;
            }
            alive
        });
        // The plan keeps the preference on a tie of first sizes when the step followed it to
        // its end and it stays as it is; one taken on the tie loses it when the step that took
        // it or the next one did not: the two kinds that begin alike are the steps' own and the
        // plan's (steps that took an earlier kind's plan on the tie and left it, followed it
        // and were planned again, or followed it and left it at the next step, a kept array in
        // its block, did so for good: a device allocation at every step or every other).
        if let Some(plan) = &mut self.plan {
            let stays = to_end && followed && !self.replan && !replan_dropped && !tail_alive;
            let l = &mut plan.layout;
            if stays {
                l.followed = true;
            } else if l.on_tie > 0 {
                l.followed = false;
            }
            l.on_tie = if l.on_tie == TIE_TAKEN && stays {
                TIE_FOLLOWED
            } else {
                0
            };
        }
        // A block that another stream used, or whose pins are old, leaves the plan.
        let step = self.step;
        let tainted = self
            .plan
            .as_ref()
            .is_some_and(|p| p.tainted || p.pins.iter().any(|pin| pin.is_old(step)));
        // A step served from its plan scaled, which holds it as it was: the scaled plan is kept
        // (planned again, its offsets would change, and every view be made again), unless it
        // is still placed for the rest of the step only (arrays of the step are alive).
        let kept = self.scaled
            && !self.diverged
            && !tail_alive
            && self
                .plan
                .as_ref()
                .is_some_and(|p| !p.layout.one_step() && p.layout.holds(&self.record));
        // A kept plan's block smaller than the plan (one made for the rest of a step placed
        // again, the plan scaled whole again) goes (kept to grow, if it can).
        if kept
            && let Some(plan) = &mut self.plan
            && plan.block_bytes() < plan.layout.footprint
            && let Some((b, in_use)) = plan.take_block()
        {
            retired += usize::from(self.detach(st, b, in_use, true));
        }
        let settled = self.settled_in_block(tainted, tail_alive);
        let online = self.online && self.stays_online(tainted);
        retired += if online {
            self.settle_slabs(st)
        } else {
            self.stop_slabs(st)
        };
        if online {
            // Its arrays alive in the block are its pins; the next step's free ranges go
            // around them. No plan is made.
            #[cfg(test)]
            ONLINE_STEPS.with(|n| n.set(n.get() + 1));
        } else if (settled || self.served_unplanned(tainted))
            && let Some(plan) = &mut self.plan
        {
            // The plan stays as it was; no array of the block is alive, so every position is
            // free, and the gaps close with the step.
            plan.gaps = None;
            plan.layout.clear_live();
        } else if self.overflowed {
            retired += usize::from(self.drop_plan(st));
        } else if n > 0
            && (self.diverged || self.replan || replan_dropped || tail_alive || !followed)
            && !kept
        {
            // A step that dropped arrays pinned at positions held over (an optimizer's step
            // dropped the gradients a first micro-batch kept) held its plan as it was, but the
            // plan was placed around them: it is made again around the pins still alive, the
            // positions held over to the step's end (the next step, a first micro-batch, keeps
            // them: `Layout::held_over`). Each first micro-batch then keeps its gradients where
            // the one before did, and the plans come again (a plan given again, the views at
            // their offsets kept). Before, it kept them where a plan placed around the last
            // ones put them, and was planned around them, and no plan came again (ResNet-50 on
            // four micro-batches: two plans from scratch and 700 to 900 views made at every
            // optimizer step; 1.038x of its peak live bytes twenty passes longer, 1.016x now).
            self.settle_record();
            let old = self.plan.take();
            // Arrays still alive in the old plan's block, if it may keep them: the new plan is
            // placed around them, to keep the block.
            let pins = old.as_ref().and_then(|p| self.pins_for(p));
            // The step's own record, when the step its plan was made from is planned in its
            // place (`as_made`).
            let own_record = old
                .as_ref()
                .filter(|_| as_made)
                .map(|p| std::mem::replace(&mut self.record, p.layout.made_from().to_vec()));
            let same = old.as_ref().is_none_or(|p| {
                (p.layout.same_kind(&self.record) || p.layout.grows_on(&self.record))
                    && !self.recurs_reordered(&p.layout)
            });
            let merged = old.as_ref().filter(|_| same).map(|p| &p.layout);
            let pinned = crate::planner::merged(pins.iter().flatten().map(|p| p.range.clone()));
            // The block the plans may fit in, with no more memory.
            let block_bytes = old.as_ref().map_or(0, Plan::block_bytes);
            let held_over = old.as_ref().map_or_else(Vec::new, |p| {
                let budget = self.held_over(p, pins.as_deref());
                p.layout
                    .held_over(&self.record, budget, held_dropped && self.kept_after_drop)
            });
            let (learned, high) = (&self.planner, self.high);
            let plan_step = |merged: Option<&Layout>, taken: &[std::ops::Range<usize>]| {
                let layout = Layout::new_around(
                    &self.record,
                    merged,
                    taken,
                    learned,
                    block_bytes,
                    high,
                    &held_over,
                );
                match merged {
                    // Merged with the old plan position by position, a plan may hold more
                    // than either (as many allocations in another arrangement: each position
                    // takes the larger of two unrelated sizes): then the step's own plan. Not
                    // one with room for the step's growth to go on, which holds more on
                    // purpose.
                    Some(o) => {
                        let bound = o.footprint.max(layout::peak_live(&self.record));
                        if layout.footprint > bound + bound / 8 && !layout.has_room_ahead() {
                            Layout::new_around(
                                &self.record,
                                None,
                                taken,
                                learned,
                                block_bytes,
                                high,
                                &held_over,
                            )
                        } else {
                            layout
                        }
                    }
                    None => layout,
                }
            };
            // A block that can grow under its arrays, all pinned (not used on another stream, no
            // graph captured), grows to a plan placed around them, if that outgrows it (with no
            // array in it, it is given up instead, and grows when the next plan wants a block).
            let only_pinned = |b: BlockPtr| {
                // SAFETY: a plan's block is the cache's until detached.
                let counts = unsafe { b.as_ref() };
                pins.as_ref()
                    .is_some_and(|pins| !pins.is_empty() && counts.views() == pins.len() as isize)
            };
            let growable = !tainted
                && !capturing()
                && old.as_ref().and_then(|p| p.block).is_some_and(|b| {
                    // SAFETY: as above.
                    only_pinned(b) && unsafe { b.as_ref() }.block.is_growable()
                });
            // Placed around the pinned arrays, the plan no longer fits the block, which cannot
            // grow: it is placed as if they were not there, and its positions over them are
            // served apart until they drop (if that does not fit the block either, the block is
            // not kept). With whether it is so.
            let place = |merged: Option<&Layout>| {
                let layout = plan_step(merged, &pinned);
                if !pinned.is_empty() && block_bytes < layout.footprint && !growable {
                    (plan_step(merged, &[]), true)
                } else {
                    (layout, false)
                }
            };
            let (mut layout, mut blocked) = place(merged);
            // Merged with the old plan, the plan may not fit the block where the step's own
            // would: the block, which arrays of the step keep alive (a loss, kept until the
            // next step's), would be retired under them, and the next step would allocate a
            // block beside it (EfficientNet trained on a varying batch, replayed in other
            // orders: 1.53x of peak live at worst, 1.19x with the step's own plan).
            if !pinned.is_empty() && block_bytes < layout.footprint && merged.is_some() {
                let (own, own_blocked) = place(None);
                if own.footprint <= block_bytes {
                    (layout, blocked) = (own, own_blocked);
                }
            }
            #[cfg(test)]
            PLANS_MADE.with(|n| n.set(n.get() + 1));
            layout.cold = old.is_none();
            let mut keep = None;
            // A step of another kind, or one of the same kind that fit the block and plans
            // much smaller (a smaller batch whose allocations come in another order): the old
            // plan is kept for the steps it was made for.
            let smaller = |old: &Layout| old.footprint > layout.footprint + layout.footprint / 4;
            let keep_old =
                !same || !self.outgrew && old.as_ref().is_some_and(|p| smaller(&p.layout));
            let mut loose = None;
            let mut room = None;
            let block = match old {
                Some(mut old) => {
                    old.stash_views();
                    loose = Some(old.take_loose());
                    // Arrays alive in the block that are not all to be pinned: unless it is
                    // given back or kept, it is retired under them, with its free bytes a room.
                    let pinned = pins.as_ref().map_or(0, Vec::len) as isize;
                    // SAFETY: a plan's block is the cache's until detached.
                    let views = old.block.map_or(0, |b| unsafe { b.as_ref() }.views());
                    if views > pinned {
                        room = old.room(own_record.as_deref().unwrap_or(&self.record));
                    }
                    let block = old.take_block();
                    // A layout placed for the rest of its step is no plan for another; one
                    // scaled for this step, of another kind, is kept as it was before.
                    if keep_old && !old.layout.one_step() {
                        if self.scaled {
                            old.layout.unscale();
                        }
                        self.shelve(old.layout);
                    }
                    block
                }
                None => None,
            };
            if let Some((b, in_use)) = block {
                // SAFETY: a plan's block is the cache's until detached.
                let counts = unsafe { b.as_ref() };
                let bytes = counts.block.bytes();
                // A larger block is kept too: the steps it was made for may come again (a batch
                // of another size), and a step that outgrows it gives it back.
                let mut fits = bytes >= layout.footprint;
                if !fits && growable {
                    // (Should the device refuse, the plan placed around the pins goes to a new
                    // block with their bytes unused.)
                    fits = self.grow_block(st, b, layout.footprint);
                }
                if fits
                    && !tainted
                    && let Some(pins) = pins
                    && counts.views() == pins.len() as isize
                {
                    // Every array alive in the block is pinned: their bytes stay in use.
                    let held: usize = pins.iter().map(|p| p.range.len()).sum();
                    debug_assert!(held <= in_use, "{held} bytes pinned, {in_use} in use");
                    cached(st, self.gauge, in_use.saturating_sub(held));
                    keep = Some((b, pins, held));
                } else {
                    if let Some(loose) = loose.take() {
                        loose.drop_all();
                    }
                    let keep = !fits && !tainted;
                    retired += usize::from(self.detach_with_room(st, b, in_use, keep, room));
                }
            }
            let cap = loose_cap(&layout, &self.shelf);
            let mut plan = Plan::new(layout, keep.as_ref().map(|k| k.0), cap);
            if let Some((_, pins, held)) = keep {
                if blocked {
                    for p in &pins {
                        plan.layout.block(p.range.clone());
                    }
                }
                plan.around_pins = !pins.is_empty();
                plan.pins = pins;
                plan.in_use = held;
            }
            if let Some(loose) = loose {
                plan.adopt_loose(loose);
                plan.unstash_views();
            }
            self.plan = Some(plan);
            // The step as it was, for the shadow that may measure it (`weigh_online`).
            if let Some(own) = own_record {
                self.record = own;
            }
        } else if tainted && let Some(plan) = &mut self.plan {
            plan.tainted = false;
            if let Some((b, in_use)) = plan.take_block() {
                retired += usize::from(self.detach(st, b, in_use, false));
            }
        }
        self.weigh_online(st);
        self.record.clear();
        if let Some(plan) = &mut self.plan {
            plan.layout.forget_growth();
            plan.loose.age();
        }
        self.tick = 0;
        self.diverged = false;
        self.replan = false;
        self.overflowed = false;
        self.grown = 0;
        self.grown_arrays = 0;
        self.tally = Tally::default();
        self.allocated = 0;
        self.outgrew = false;
        self.scaled = false;
        self.waited = 0;
        self.keep_gaps = false;
        self.in_doubt = false;
        self.awaiting = None;
        let step = self.step;
        self.step = step.wrapping_add(1);
        if let Some((old, _)) = self.given_up.take_if(|(_, given_up)| *given_up != step) {
            self.free_cached(st, old);
        }
        retired
    }
}

impl CacheState {
    /// The index of `device`'s planned cache, made if new (`None` when the cache tracks its most
    /// devices).
    fn arena_for(&mut self, st: &Counters, device: Device) -> Option<usize> {
        if let Some(i) = self.arenas.index(device) {
            return Some(i);
        }
        let gauge = st.gauge_for(device)?;
        let trace = Arc::clone(&self.trace);
        self.arenas
            .devices
            .push(DeviceArena::new(device, gauge, trace));
        Some(self.arenas.devices.len() - 1)
    }

    /// An allocation in a planned cache: from the plan, a spare, or a new block.
    fn planned(&mut self, st: &Counters, req: &Request<'_>) -> Planned {
        #[cfg(test)]
        SLOW_TAKES.with(|n| n.set(n.get() + 1));
        let Some(size) = aligned(req.bytes) else {
            // No block can hold it; the device will say so.
            return Planned::Alloc {
                capacity: req.bytes,
                view: false,
                make: Make::Plain,
            };
        };
        let Some(i) = self.arena_for(st, req.device) else {
            return Planned::Bypass;
        };
        let a = &mut self.arenas.devices[i];
        a.settle_record();
        let rec = a.tick;
        let mut capacity = size;
        // The size a spare is measured against: the array's, or its position's recorded size.
        let mut expected = size;
        // Whether the array is of a position the plan serves apart (it outlived its step).
        let mut apart = false;
        if rec == 0 && a.online && a.plan.as_ref().is_none_or(|p| p.block.is_none()) {
            // The online block is gone (given back while no array used it, when a step could
            // not use it on its stream): the plans serve the steps again, their small arrays
            // as theirs are.
            a.online = false;
            self.live += a.stop_slabs(st);
        }
        if rec >= MAX_POSITIONS {
            a.overflowed = true;
        } else if a.online {
            a.tick += 1;
            a.diverged = true;
            a.record.push(Rec {
                bytes: size,
                end: OPEN,
                planned: NONE,
            });
            // The block's free ranges open at the step's first allocation, whatever serves it.
            if rec == 0
                && let Some(plan) = &mut a.plan
                && plan.gaps.is_none()
                && let Err(e) = plan.open_gaps(&a.record)
            {
                return Planned::Failed(e);
            }
            if size <= layout::SMALL
                && a.tiny_apart
                && let Some(got) = self.slab_view(st, i, req, rec)
            {
                return got;
            }
            let a = &mut self.arenas.devices[i];
            if let Some(got) = a.online_view(st, req, size) {
                return got;
            }
        } else {
            a.tick += 1;
            if rec == 0 {
                a.firsts.note(size);
            }
            if rec == 0 && !a.shelf.is_empty() {
                self.live += usize::from(a.choose_plan(st, size));
            }
            let a = &mut self.arenas.devices[i];
            let (mut serve, pos) = match &mut a.plan {
                Some(plan) => plan.layout.next(size, rec),
                None => (Serve::Diverged, NONE),
            };
            if a.diverged
                && let (Serve::At(_), Some(plan)) = (&serve, &mut a.plan)
            {
                // The step left its plan: the rest of it is served apart (and still matched
                // with the plan's positions, for the next plan's sizes).
                plan.layout.unserve(pos);
                serve = Serve::Diverged;
            }
            a.record.push(Rec {
                bytes: size,
                end: OPEN,
                planned: pos,
            });
            if a.scaled && !a.diverged && matches!(serve, Serve::Diverged) {
                a.learn_margin(pos, size);
            }
            // A position larger than planned, in a step that stays on its plan: the block's
            // tail, else apart on its own ([`DeviceArena::grows_in_place`]), unless the step is
            // short of its plan so far: then it leaves the plan here.
            let mut grown = false;
            if matches!(serve, Serve::Diverged) && !a.diverged && a.grows_in_place(st, pos, size) {
                a.grown += size;
                a.grown_arrays += 1;
                a.replan = true;
                if let Some(got) = self.tail_view(st, i, req, rec, size) {
                    return got;
                }
                grown = !self.arenas.devices[i].short_of_plan();
            }
            let a = &mut self.arenas.devices[i];
            match serve {
                Serve::At(offset) => return self.served_at(st, i, req, pos, offset, rec),
                // In a step that left its plan, a position of a first step's optimizer state: the
                // step does not make that array (the state lives on, apart), this allocation is
                // another one, likely a temporary of the optimizer's step: from the gaps.
                Serve::Apart
                    if a.diverged
                        && a.plan
                            .as_ref()
                            .is_some_and(|p| p.gaps.is_some() && p.layout.in_state_run(pos)) =>
                {
                    if let Some(got) = self.gap_view(st, i, req, rec, size) {
                        return got;
                    }
                    capacity = size_class_within(size);
                }
                // Arrays that outlive their step may grow from step to step (a cache of keys
                // and values in decoding): their blocks leave room.
                Serve::Apart => {
                    let recorded = a.plan.as_ref().map_or(0, |p| p.layout.recorded_apart(pos));
                    capacity = a.apart_capacity(st, size, recorded);
                    expected = size.max(recorded);
                    apart = true;
                }
                // A small array the plan does not hold: apart, from a spare once warm, the step
                // staying on its plan.
                Serve::Extra if !a.diverged => {}
                // A position over bytes an earlier step's array still holds, or one that grew
                // past its place: apart, the step staying on its plan (a position blocked so is
                // no reason to plan the step again). In the block's tail, if it has one.
                Serve::Blocked if !a.diverged => {
                    if let Some(got) = self.tail_view(st, i, req, rec, size) {
                        return got;
                    }
                }
                Serve::Diverged if grown => {}
                // A step that keeps the arrays held over meets one past its planned end: the
                // rest of the step is placed again around them, and follows its plan.
                Serve::Diverged
                    if !a.diverged
                        && a.keep_rest(st, pos, size)
                        && let Some(plan) = &mut a.plan
                        && let Serve::At(offset) = plan.layout.serve(pos, size, rec) =>
                {
                    return self.served_at(st, i, req, pos, offset, rec);
                }
                Serve::Diverged | Serve::Extra | Serve::Blocked => {
                    // The array of its position in an earlier step is still alive: this one
                    // likely outlives its step too, and goes apart (in the block it would keep
                    // the whole block from the next step).
                    let again = a.plan.as_ref().is_some_and(|p| p.layout.is_live(pos));
                    let mut around = false;
                    if !a.diverged
                        && let Some(plan) = &a.plan
                    {
                        a.diverged = true;
                        // Larger than planned (or past the plan's end), the step outgrows the
                        // plan: its block goes back once unused, and the rest of the step is
                        // served apart until then, then from the plan scaled as the step grew,
                        // in a new block. When arrays planned to live past the first eighth of
                        // the rest hold the block (or any do, and waiting for them would send
                        // half the footprint apart), the plan scaled for the rest of the step is
                        // placed around them in the block, grown if need be. Else, or when the
                        // step outgrows a scaled plan, the block's free bytes serve it.
                        let grew = size > plan.layout.range(pos).len()
                            && plan.layout.outgrown(&a.record, plan.block_bytes());
                        let held = grew && plan.layout.held_long(rec);
                        // Or waiting for the arrays in the block to end, however soon, would send
                        // more than half the footprint apart: the step would then not wait, and
                        // the block's gaps, a smaller step's, would serve the rest, and apart.
                        let brief = grew && plan.layout.waits_past_half(rec, &a.record);
                        let tries = (held || brief)
                            && !a.scaled
                            && !again
                            && pos != NONE
                            && 2 * rec < plan.layout.len() as u32
                            && !a.skips_around();
                        around = tries && a.rest_around(st, pos);
                        if tries {
                            a.around_missed = u8::from(!around);
                        }
                        if around {
                            // The step follows the layout placed around its arrays: it waits for
                            // no block (an array that outgrew the step's earlier layout may have
                            // marked it so), and its block's gaps stay closed while it does.
                            a.diverged = false;
                            a.outgrew = false;
                            a.scaled = true;
                            a.replan = true;
                        } else if let Some(plan) = &mut a.plan {
                            if (!grew || held || a.scaled)
                                && let Err(e) = plan.open_gaps(&a.record)
                            {
                                return Planned::Failed(e);
                            }
                            a.outgrew = plan.gaps.is_none();
                            a.keep_gaps = held || a.scaled;
                            self.live += usize::from(a.release_unused_block(st));
                        }
                    }
                    let a = &mut self.arenas.devices[i];
                    if around
                        && let Some(plan) = &mut a.plan
                        && let Serve::At(offset) = plan.layout.serve(pos, size, rec)
                    {
                        return self.served_at(st, i, req, pos, offset, rec);
                    }
                    // Only a step that outgrew its plan is scaled.
                    let room = if a.outgrew { a.room(st) } else { 0 };
                    if a.outgrew
                        && !again
                        && pos != NONE
                        && let Some(plan) = &mut a.plan
                        && plan.block.is_none()
                        && 2 * rec < plan.layout.len() as u32
                        && let Some(scaled) = if plan.layout.scale(&a.record, pos, room, a.margin) {
                            Some(true)
                        } else {
                            plan.layout.no_larger(&a.record).then_some(false)
                        }
                    {
                        // The step outgrew its plan and the old block is gone: the plan scaled
                        // serves the rest of the step (in a new block, made for this
                        // allocation; not past the step's middle, where a block would serve
                        // too little). No array is in the new block: no position is taken
                        // there. At the step's end it is planned again, unless the scaled plan
                        // held it. A step that no longer asks for more than the plan holds (a
                        // detector's input grew, where its feature maps shrank) follows the
                        // plan as it is, in a block of its own: served apart array by array
                        // instead, a smaller step than the plan took 365 device allocations
                        // (RetinaNet, shuffled).
                        plan.layout.clear_live();
                        a.diverged = false;
                        a.replan = true;
                        a.scaled |= scaled;
                        if let Serve::At(offset) = plan.layout.serve(pos, size, rec) {
                            return self.served_at(st, i, req, pos, offset, rec);
                        }
                    }
                    if again {
                        capacity = size_class_within(size);
                    } else {
                        self.arenas.devices[i].wait_for_block(size);
                        if let Some(got) = self.gap_view(st, i, req, rec, size) {
                            return got;
                        }
                    }
                }
            }
        }
        let a = &mut self.arenas.devices[i];
        let pos = rec.min(NO_POSITION);
        if a.keep_gaps && a.would_pass_high(st, capacity) {
            self.live += usize::from(a.close_unused_gaps(st));
        }
        // An array that grew past its recorded size takes room to grow there too, as its solo
        // block would (see `DeviceArena::apart_capacity`).
        let room_size = if capacity > size_class_within(size) {
            capacity
        } else {
            size
        };
        if let Some(got) = self.room_view(st, i, req, pos, room_size) {
            return got;
        }
        let a = &mut self.arenas.devices[i];
        if let Some(held) = a.take_spare(st, size, capacity, expected, apart) {
            return self.serve_held(st, held, req, i, pos);
        }
        a.awaiting = Some(Awaiting::Solo { pos });
        a.alloc(st, capacity, false)
    }

    /// A range of one of device `i`'s [rooms](Room) serves `req`, an array apart at `pos`, a
    /// hit: one kept with its view that holds it (at most twice `size`), else a free one of
    /// `size` aligned bytes with a view made on the thread's current stream (where the block was
    /// last used); the view counted as alive in the block. `None`: no room holds it (or the
    /// thread captures a step graph).
    fn room_view(
        &mut self,
        st: &Counters,
        i: usize,
        req: &Request<'_>,
        pos: u32,
        size: usize,
    ) -> Option<Planned> {
        if capturing() {
            return None;
        }
        let a = &mut self.arenas.devices[i];
        let step = a.step;
        for room in &mut a.rooms {
            let arena = room.arena;
            // SAFETY: a room holds its block (one count of its views): alive while held.
            let counts = unsafe { arena.as_ref() };
            if !counts.block.on_current_stream() {
                continue;
            }
            // A range kept with its view (at most twice as large), else a free one.
            let (offset, kept) = match room.take_kept(aligned(req.bytes)?, 2 * size) {
                Some((offset, view)) => (offset, Some(view)),
                None => match room.take(size) {
                    Some(offset) => (offset, None),
                    None => continue,
                },
            };
            match idle_or_new_view(kept, room.idle(), arena, offset, req.bytes) {
                Ok(mut view) => {
                    // SAFETY: at `offset` (kept there, or made there), reaching the range's
                    // `req.bytes > 0` bytes, which the block holds: made just now over the rest
                    // of the block, or kept and checked (`spans`).
                    unsafe { view.set_view_len(req.bytes) };
                    counts.count_held_view();
                    add(&st.hits, 1);
                    return Some(Planned::View(view, view_slot(pos), step));
                }
                Err(e) => {
                    room.untake(offset);
                    return Some(Planned::Failed(e));
                }
            }
        }
        None
    }

    /// A spare (a solo block kept for later) serves `req`, a hit: through the view it kept when
    /// that view is on the thread's current stream, else through a new one.
    fn serve_held(
        &mut self,
        st: &Counters,
        held: Held,
        req: &Request<'_>,
        i: usize,
        pos: u32,
    ) -> Planned {
        add(&st.hits, 1);
        match held {
            Held::Viewed { arena, view } if view.on_current_stream() => {
                self.reissue(arena, view, req, i, pos)
            }
            held => self.solo_view(st, held.into_block(), req, pos),
        }
    }

    /// Allocation `rec` of device `i`, a small array (at most [`layout::SMALL`] aligned bytes)
    /// of a step served online once [`DeviceArena::tiny_apart`]: a slot of a slab (see the
    /// `slab` module), through the view it kept if it did, else a new slab made for it. Such
    /// arrays come and go by the hundred (a detector's scores, indices, sizes: 38% of Keypoint
    /// R-CNN's allocations, 76% of Mask R-CNN's), and some live into the next step: in the
    /// online block, best fit put those where a large array dropped, and a later step's largest
    /// array found no range long enough among them (Keypoint R-CNN's block grew to 1.38x of the
    /// peak live bytes, 1.19x at most with them apart; BENCHMARKS.md). `None`: no slab can
    /// serve it (the most slabs are made, or none may be used on the thread's stream): the
    /// online block does.
    fn slab_view(
        &mut self,
        st: &Counters,
        i: usize,
        req: &Request<'_>,
        rec: u32,
    ) -> Option<Planned> {
        let a = &mut self.arenas.devices[i];
        let k = match a.slabs.iter().rposition(Slab::has_free) {
            Some(k) => k,
            None if a.slabs.len() < MAX_SLABS => {
                #[cfg(test)]
                SLABS_MADE.with(|n| n.set(n.get() + 1));
                a.awaiting = Some(Awaiting::Slab { rec });
                return Some(a.alloc(st, SLAB_BYTES, false));
            }
            None => return None,
        };
        let got = a.slab_slot(st, k, req, rec)?;
        if matches!(got, Planned::View(..)) {
            add(&st.hits, 1);
        }
        Some(got)
    }

    /// Position `pos` at `offset` of device `i`'s plan (marked alive by [`Layout::serve`]): a
    /// view of the plan's block, made first if need be (a miss, counted when the block is
    /// allocated). A view of a block that was there is counted as a hit. A plan scaled for the
    /// step may have a block smaller than its footprint (taken back as it was, to grow when a
    /// position past its end is served, see below): such a block is never made ready for the
    /// hit path, so that every position of the step is checked here.
    fn served_at(
        &mut self,
        st: &Counters,
        i: usize,
        req: &Request<'_>,
        pos: u32,
        offset: usize,
        rec: u32,
    ) -> Planned {
        let generation = self.generation;
        let a = &mut self.arenas.devices[i];
        let Some(plan) = &mut a.plan else {
            unreachable!("served from a plan")
        };
        let footprint = plan.layout.footprint;
        let size = aligned(req.bytes).unwrap_or(req.bytes);
        // A plan scaled for this step grows its block only when a position past the block's end
        // is served: a step scaled from its first allocation alone may leave the plan at its
        // next (an evaluation step, twice the training step's batch, in the training step's
        // scope: the block grown at once to the training plan scaled twofold held 1.968x of the
        // log's peak live bytes for good, for a step whose arrays needed a fifth of it; 1.011x
        // so).
        let lazily = a.scaled && !capturing();
        let arena = match plan.block {
            Some(arena) => arena,
            None => match a
                .given_up
                .take_if(|(b, _)| b.bytes() >= footprint || lazily && b.is_growable())
            {
                // The block given up last holds the plan as it is (or can grow to, as above): it
                // is the plan's block again (counted as cached all along, as a plan's block with
                // no array is), made ready for the step's stream below.
                Some((block, _)) => {
                    let arena = ArenaBlock::new(block, generation);
                    plan.block = Some(arena);
                    plan.ready = false;
                    arena
                }
                None => {
                    plan.layout.unserve(pos);
                    a.awaiting = Some(Awaiting::Plan { pos, offset, rec });
                    return a.alloc(st, footprint, true);
                }
            },
        };
        // SAFETY: a plan's block is the cache's until detached, and alive while it is.
        let bytes = |arena: BlockPtr| unsafe { arena.as_ref() }.block.bytes();
        // Whether the position's range (the most it may take, which the step's gaps take and
        // give back whole) passes the block's end.
        let past = |plan: &Plan| plan.layout.range(pos).end > bytes(arena);
        let mut at = Some(offset);
        if past(plan) && rec == 0 {
            // The step's first position, past the block's end: moved to the block's bottom for
            // this step, where it can be ([`Layout::lower`]).
            plan.layout.unserve(pos);
            plan.layout.lower(pos);
            at = match plan.layout.serve(pos, size, rec) {
                Serve::At(offset) => Some(offset),
                _ => None,
            };
        }
        let grows = plan.grows_now();
        let ready = match at {
            Some(offset) if past(plan) => {
                if grows && a.grow_block(st, arena, footprint) {
                    a.plan.as_mut().map_or(Ok(false), |p| p.make_ready(arena))
                } else if !a.plan.as_ref().is_some_and(Plan::block_in_use) {
                    // The device refused the growth, with no array in the block: it goes back,
                    // and the plan gets a new one (as a block given up that cannot grow).
                    if let Some((b, in_use)) = a.plan.as_mut().and_then(Plan::take_block) {
                        self.live += usize::from(a.detach(st, b, in_use, false));
                    }
                    if let Some(plan) = &mut a.plan {
                        plan.layout.unserve(pos);
                    }
                    a.awaiting = Some(Awaiting::Plan { pos, offset, rec });
                    return a.alloc(st, footprint, true);
                } else {
                    // Refused with arrays in the block, or it cannot grow now (another stream
                    // used it, or a graph is captured): the step goes apart, as below.
                    Ok(false)
                }
            }
            Some(_) => plan.make_ready(arena),
            None => Ok(false),
        };
        let Some(plan) = &mut a.plan else {
            unreachable!("served from a plan")
        };
        match ready {
            Ok(true) => {}
            Ok(false) => {
                // The step goes apart and re-plans.
                plan.layout.unserve(pos);
                a.diverged = true;
                a.awaiting = Some(Awaiting::Solo { pos: rec });
                return a.alloc(st, aligned(req.bytes).unwrap_or(req.bytes), false);
            }
            Err(e) => {
                plan.layout.unserve(pos);
                return Planned::Failed(e);
            }
        }
        if footprint > bytes(arena) {
            // The block does not hold the plan yet: every position comes here, where one past its
            // end grows it ([`CacheState::plan_hit`] serves only a block made ready).
            plan.ready = false;
        }
        let offset = at.unwrap_or(offset);
        let got = plan.position_view(st, a.gauge, arena, (pos, offset), req.bytes, a.step);
        if matches!(got, Planned::View(..)) {
            add(&st.hits, 1);
        }
        got
    }

    /// Allocation `rec` of `size` aligned bytes, in a step that left its plan: a view of a gap
    /// of device `i`'s plan's block, if one holds it (`None`: there is none, or no gap fits).
    fn gap_view(
        &mut self,
        st: &Counters,
        i: usize,
        req: &Request<'_>,
        rec: u32,
        size: usize,
    ) -> Option<Planned> {
        let a = &mut self.arenas.devices[i];
        let plan = a.plan.as_mut()?;
        let arena = plan.block?;
        // Placed toward the end of the block where the plan put its position (by the middle of
        // its planned range), so that the step's long-lived arrays keep together away from its
        // churn, as the plan arranged them from the recorded lifetimes; not in a step that
        // outgrew the plan and is served from its block (its arrangement is a smaller step's;
        // a plan scaled for the step is the step's).
        let high = (!a.keep_gaps || a.scaled)
            && a.record
                .get(rec as usize)
                .is_some_and(|r| plan.layout.upper(r.planned));
        let mut got = plan.gaps.as_mut()?.take(rec, size, high);
        if got.is_none() && a.in_doubt {
            got = a.doubted(st, rec, size);
        }
        let a = &mut self.arenas.devices[i];
        let plan = a.plan.as_mut()?;
        let Some(offset) = got else {
            if a.keep_gaps || plan.block_in_use() || !a.may_scale() {
                // The step outgrew its plan, or its arrays hold the block, or it cannot follow
                // the plan scaled: this array goes apart, and the gaps serve the rest while
                // they can.
                return None;
            }
            let Some(plan) = &mut a.plan else {
                return None;
            };
            // The step outgrows the block, which no array uses: the block goes back to the
            // device, and the plan scaled serves the rest of the step.
            plan.gaps = None;
            a.outgrew = true;
            self.live += usize::from(a.release_unused_block(st));
            return None;
        };
        let step = a.step;
        Some(plan.hand_out((st, a.gauge), arena, (rec, offset), (req.bytes, size), step))
    }

    /// Allocation `rec` of `size` aligned bytes, which device `i`'s plan serves apart in a step
    /// that follows it (a position grown, or one over pinned bytes): a view of the block's
    /// tail, its bytes past the plan's footprint, if they hold it (`None`: no tail, it is full,
    /// or the step is larger in all so far). The tail is a block kept for a larger plan than the
    /// current one (a larger batch's, or another kind of step's), held whether used or not:
    /// what it holds takes no device allocation and no more memory.
    fn tail_view(
        &mut self,
        st: &Counters,
        i: usize,
        req: &Request<'_>,
        rec: u32,
        size: usize,
    ) -> Option<Planned> {
        let a = &mut self.arenas.devices[i];
        let plan = a.plan.as_mut()?;
        if plan.layout.larger(&a.record) {
            // A larger step (a longer sequence, a larger batch) may outgrow the block, which
            // must then be free to go back: its arrays go apart.
            return None;
        }
        let arena = plan.block?;
        let offset = match plan.tail_offset(rec, size) {
            Ok(offset) => offset?,
            Err(e) => return Some(Planned::Failed(e)),
        };
        let step = a.step;
        Some(plan.hand_out((st, a.gauge), arena, (rec, offset), (req.bytes, size), step))
    }

    /// The hit path of a planned cache: the next position of the plan, when it is the plain
    /// case ([`Layout::hit`]) on the cache's first device and the plan's block is ready for the
    /// step. `None`: [`CacheState::planned`] decides.
    #[inline(always)]
    fn plan_hit(&mut self, st: &Counters, req: &Request<'_>) -> Option<(Block, u32, u32)> {
        let a = self.arenas.devices.first_mut()?;
        if a.device != req.device || a.diverged {
            return None;
        }
        let plan = a.plan.as_ref()?;
        // Not ready at a step's first allocation (made ready there, on the slow path, which
        // also picks the plan among the shelved ones).
        debug_assert!(a.tick != 0 || !plan.ready);
        if !plan.ready {
            return None;
        }
        // Two copies: the one for steps served in order (which neither settles nor writes the
        // record) inlined here, the other out of line, so that its calls, and the request in
        // memory that a call would need, stay off the common path.
        if plan.layout.in_order {
            a.plan_hit::<true>(st, req.bytes)
        } else {
            a.plan_hit_out_of_order(st, req.bytes)
        }
    }

    /// A view of all of `block`, a solo block for the array at `pos`.
    fn solo_view(
        &mut self,
        st: &Counters,
        mut block: Block,
        req: &Request<'_>,
        pos: u32,
    ) -> Planned {
        let Some(i) = self.arenas.index(block.device()) else {
            unreachable!("a solo block of a device the cache has no arena for")
        };
        // A spare last used on another stream: the thread's current stream, which the view is
        // made on, waits for that work first (a new block is already on it).
        if let Err(e) = block.prepare_reuse() {
            self.free_arena_block(st, block);
            return Planned::Failed(e);
        }
        let arena = ArenaBlock::new_solo(block, self.generation);
        // SAFETY: just made; ours alone until the view exists.
        let counts = unsafe { arena.as_ref() };
        let owner: *const dyn Backend = arena.as_ptr().cast_const();
        let bytes = counts.block.bytes();
        // SAFETY: the block's bytes are more than zero (no block is empty), `owner` is the
        // `Arc::into_raw` pointer of the block's `Arc`, whose backend is not counted, and the
        // block is retired with this one view counted: it is taken back only by that view's
        // drop (and then freed after the view, or kept with it as a spare).
        match unsafe { counts.block.view(owner, 0, bytes) } {
            Ok(mut view) => {
                // SAFETY: `req.bytes <= bytes` (the block was chosen or made for it), and the
                // view was just made over all `bytes`: spanning the block, it serves any array
                // the block does later, as a spare (see `Held::Viewed`).
                unsafe { view.set_view_len(req.bytes) };
                self.live += 1;
                Planned::View(view, view_slot(pos), self.arenas.devices[i].step)
            }
            Err(e) => {
                counts.shared.store(0, Relaxed);
                // SAFETY: the view was not made; nothing else points at the block.
                let block = unsafe { ArenaBlock::into_block(arena) };
                self.free_arena_block(st, block);
                Planned::Failed(e)
            }
        }
    }

    /// A spare held with its idle view (`arena` and `view`, on the thread's current stream)
    /// serves the array at `pos` on device `i`, through that view.
    fn reissue(
        &mut self,
        arena: BlockPtr,
        mut view: Block,
        req: &Request<'_>,
        i: usize,
        pos: u32,
    ) -> Planned {
        // SAFETY: a spare's block is the cache's until taken out of the spares, as this one was.
        let counts = unsafe { arena.as_ref() };
        debug_assert!(req.bytes <= counts.block.bytes());
        // SAFETY: the view was made over the whole block (`solo_view`), and the spare was taken
        // for `req.bytes > 0` bytes no more than the block's.
        unsafe { view.set_view_len(req.bytes) };
        counts.reissue_solo();
        self.live += 1;
        Planned::View(view, view_slot(pos), self.arenas.devices[i].step)
    }

    /// Accounts `block`, allocated after [`Planned::Alloc`], and makes the view for `req`.
    /// `Err(block)` when the cache cannot track the device (the caller uses the block alone).
    fn adopt_planned(
        &mut self,
        st: &Counters,
        req: &Request<'_>,
        block: Block,
    ) -> std::result::Result<Planned, Block> {
        let Some(i) = self.arena_for(st, req.device) else {
            return Err(block);
        };
        let generation = self.generation;
        let a = &mut self.arenas.devices[i];
        st.allocated(a.gauge, block.bytes());
        a.note_held(st);
        add(&st.misses, 1);
        let awaiting = a.awaiting.take();
        let size = aligned(req.bytes).unwrap_or(req.bytes);
        if let Some(Awaiting::Plan { pos, offset, rec }) = awaiting
            && let Some(plan) = &mut a.plan
            && plan.block.is_none()
            && block.bytes() >= plan.layout.footprint
            && plan.layout.serve(pos, size, rec) == Serve::At(offset)
        {
            cached(st, a.gauge, block.bytes());
            if record::on() {
                note_block(st, a.gauge, &a.trace, EventKind::PlanBlock, &block);
            }
            let arena = ArenaBlock::new(block, generation);
            plan.block = Some(arena);
            // A new block has no earlier work to order after.
            plan.ready = true;
            let step = a.step;
            return Ok(plan.position_view(st, a.gauge, arena, (pos, offset), req.bytes, step));
        }
        if let Some(Awaiting::Slab { rec }) = awaiting
            && block.bytes() >= SLAB_BYTES
        {
            // Every slot is free: the whole slab cached, as a plan's new block is.
            cached(st, a.gauge, block.bytes());
            if record::on() {
                note_block(st, a.gauge, &a.trace, EventKind::SlabBlock, &block);
            }
            a.slabs.push(Slab::new(ArenaBlock::new(block, generation)));
            let k = a.slabs.len() - 1;
            if let Some(got) = a.slab_slot(st, k, req, rec) {
                return Ok(got);
            }
            unreachable!("a new slab on the thread's stream serves its first array")
        }
        let pos = match awaiting {
            Some(
                Awaiting::Plan { rec: pos, .. }
                | Awaiting::Solo { pos }
                | Awaiting::Slab { rec: pos },
            ) => pos,
            None => NO_POSITION,
        };
        Ok(self.solo_view(st, block, req, pos))
    }

    /// Settles every device's plan and slabs for the arrays of their blocks dropped on other
    /// threads ([`Plan::settle_remote_drops`], [`DeviceArena::settle_slabs`]), so that the bytes
    /// in use count live arrays only. Between steps (`between`), the rooms whose last arrays
    /// dropped on other threads since the last step's end go too, as they would have at that
    /// end (within a step, such a room still serves the step's arrays apart): their blocks were
    /// counted in use with no array alive (an 8-thread stress test found one).
    pub(super) fn settle_remote_drops(&mut self, st: &Counters, between: bool) {
        let mut retired = 0;
        for a in &mut self.arenas.devices {
            if let Some(plan) = &mut a.plan {
                plan.settle_remote_drops(st, a.gauge);
            }
            retired += a.settle_slabs(st);
        }
        self.live += retired;
        if between {
            for i in 0..self.arenas.devices.len() {
                self.let_go_unused_rooms(st, i, false);
            }
        }
    }

    /// The outermost scope exited: every device's step ends.
    fn end_step(&mut self, st: &Counters) {
        for i in 0..self.arenas.devices.len() {
            self.let_go_rooms(st, i, false);
        }
        let retired: usize = self.arenas.devices.iter_mut().map(|a| a.end_step(st)).sum();
        self.live += retired;
        self.evict_spares(st, self.config.max_cached_bytes);
    }

    /// Gives back what the planned caches hold (on `device`, or all) that no array uses: the
    /// spares, and the plans' blocks (retired while arrays of them are alive). The plans go too:
    /// the next step starts cold, and is planned again.
    pub(super) fn free_arenas(&mut self, st: &Counters, device: Option<Device>) {
        for i in 0..self.arenas.devices.len() {
            if device.is_none_or(|d| d == self.arenas.devices[i].device) {
                self.let_go_rooms(st, i, true);
            }
        }
        let mut retired = 0;
        for a in &mut self.arenas.devices {
            if device.is_some_and(|d| d != a.device) {
                continue;
            }
            a.step_spares.clear();
            for spare in std::mem::take(&mut a.spares) {
                a.free_cached(st, spare.into_block());
            }
            retired += a.stop_slabs(st);
            retired += usize::from(a.drop_plan(st));
            if let Some((old, _)) = a.given_up.take() {
                a.free_cached(st, old);
            }
            // A cold start: what the cache held before does not let it keep more, and the steps
            // it left unplanned are forgotten with the plans.
            a.high = 0;
            a.awaiting = None;
            a.unplanned = [0; device::UNPLANNED];
            a.reordered.clear();
            a.left_in_a_row = 0;
            a.online = false;
            a.shadow = None;
            a.earlier_drops.clear();
            a.peak_most = 0;
            a.shadow_wait = 0;
            a.shadow_misses = 0;
            a.around_missed = 0;
            a.firsts = Firsts::None;
            a.margin = Margin::default();
            a.held_dropped_last = false;
            a.kept_after_drop = true;
            // Nor does the planner's choice of its first way to place a step's arrays.
            a.planner.forget();
        }
        self.live += retired;
    }

    /// Takes back a block whose last array dropped: a solo block whose array outlived its step
    /// becomes a spare (within the byte cap) if it is of this generation; anything else is freed.
    /// Returns whether it was freed.
    pub(super) fn take_back(
        &mut self,
        st: &Counters,
        block: Block,
        generation: u32,
        solo: bool,
        escaped: bool,
    ) -> bool {
        self.take_back_held(st, Held::Bare(block), generation, solo, escaped)
    }

    /// [`CacheState::take_back`] of a block as it is held: a solo block with its idle view
    /// stays so as a spare.
    fn take_back_held(
        &mut self,
        st: &Counters,
        held: Held,
        generation: u32,
        solo: bool,
        escaped: bool,
    ) -> bool {
        self.live -= 1;
        let current = generation == self.generation && self.config.key.is_planned();
        let keep = solo && current;
        match self.arenas.index(held.device()) {
            // A small array's block is kept too when its array dropped within its step, if a
            // plan serves the step: small arrays the plan does not hold come every step (see
            // `layout::SMALL`).
            Some(i)
                if keep
                    && (escaped
                        || held.bytes() <= layout::SMALL
                            && self.arenas.devices[i].keeps_small_spare()
                        || self.arenas.devices[i].keeps_step_spare(held.bytes())) =>
            {
                let a = &mut self.arenas.devices[i];
                cached(st, a.gauge, held.bytes());
                if !escaped && a.keeps_step_spare(held.bytes()) {
                    // Kept for this step alone: it goes back at the step's end.
                    a.step_spares.push(held.block().id());
                }
                a.spares.push(held);
                self.evict_spares(st, self.config.max_cached_bytes);
                false
            }
            // A plan's block retired under its arrays, now unused, that can grow and no
            // stream uses: kept for the next plan's block.
            Some(i) if !solo && current && may_keep(held.block()) => {
                let a = &mut self.arenas.devices[i];
                let block = held.into_block();
                cached(st, a.gauge, block.bytes());
                a.give_up(st, block, true)
            }
            _ => {
                self.free_arena_block(st, held.into_block());
                true
            }
        }
    }

    /// Gives an arena block that is not counted as cached back to the device.
    pub(super) fn free_arena_block(&mut self, st: &Counters, block: Block) {
        // Every arena block was made in an arena, so its device has a gauge.
        if let Some(g) = st.find_gauge(block.device()) {
            free_block(st, g, &self.trace, block);
        }
    }

    /// Frees the oldest spares, then the slabs no array holds a slot of, until what the cache
    /// keeps for later (the spares, the slabs' free slots) fits in `cap`.
    fn evict_spares(&mut self, st: &Counters, cap: Option<usize>) {
        let Some(cap) = cap else {
            return;
        };
        let mut spare: usize = self
            .arenas
            .devices
            .iter()
            .map(|a| {
                let spares: usize = a.spares.iter().map(Held::bytes).sum();
                let slabs: usize = a.slabs.iter().map(|s| s.bytes() - s.in_use).sum();
                spares + slabs
            })
            .sum();
        let mut retired = 0;
        for a in &mut self.arenas.devices {
            while spare > cap && !a.spares.is_empty() {
                let block = a.remove_spare(0).into_block();
                spare -= block.bytes();
                add(&st.evictions, 1);
                a.free_cached(st, block);
            }
            let mut k = 0;
            while spare > cap && k < a.slabs.len() {
                if !a.slabs[k].is_unused() {
                    k += 1;
                    continue;
                }
                let slab = a.slabs.swap_remove(k);
                spare -= slab.bytes() - slab.in_use;
                add(&st.evictions, 1);
                retired += usize::from(a.give_up_slab(st, slab));
            }
        }
        self.live += retired;
    }

    /// [`CacheState::drop_view`] of the common case, inlined into the array's drop: an array of
    /// this step, served at its position of the first device's plan, which the step follows,
    /// dropped on the owner thread and used on no other stream. Its view (taken from `view`) is
    /// kept for the position's next array, the position freed, and the drop recorded. Returns
    /// whether it was that case (else `view` is left, and [`CacheState::drop_view`] takes it).
    #[inline(always)]
    fn drop_in_plan(
        &mut self,
        st: &Counters,
        arena: BlockPtr,
        home: &Home,
        view: &mut Option<Block>,
    ) -> bool {
        let Some(a) = self.arenas.devices.first_mut() else {
            return false;
        };
        let pos = home.slot - VIEW_BASE;
        let Some(plan) = a.plan.as_mut() else {
            return false;
        };
        // The plan's block, not retired (a plan's block is retired only once out of the plan),
        // and an array of this step (an escaped one may be pinned) at a position of the plan
        // (not from the gaps, which are closed; a position at or past `GAP_BASE` is past the
        // positions of any plan, `MAX_POSITIONS`, and has no view kept).
        if plan.block != Some(arena)
            || home.generation != a.step
            || a.diverged
            || plan.gaps.is_some()
        {
            return false;
        }
        let Some(kept) = plan.views.get_mut(pos as usize) else {
            return false;
        };
        let Some(view) = view.take() else {
            return false;
        };
        let size = view_size(view.bytes());
        if let Some(old) = kept.replace(view) {
            // SAFETY: a kept view was made by `Block::view`, and its block is alive.
            unsafe { old.drop_view() };
        }
        // SAFETY: a view of the block was alive until now, so the block is.
        unsafe { arena.as_ref() }.uncount_view();
        uncounted(&mut plan.in_use, st, a.gauge, size);
        let rec = plan.layout.dropped_now(pos, a.tick);
        if let Some(r) = a.record.get_mut(rec as usize) {
            r.end = a.tick;
        }
        true
    }

    /// Takes back a view on the owner thread (lock holder): records when it dropped, frees its
    /// position (unless it was used on another stream: then `tainted`), and takes back a
    /// retired block whose last view it was. Returns whether that block went back to the device.
    #[inline(always)]
    fn drop_view(
        &mut self,
        st: &Counters,
        arena: BlockPtr,
        home: &Home,
        view: Block,
        tainted: bool,
    ) -> bool {
        // SAFETY: a view of the block was alive until now, so the block is.
        let counts = unsafe { arena.as_ref() };
        let bytes = view.bytes();
        let mut view = Some(view);
        // A plan's array: its position in the plan; a solo array: its index in the record.
        let pos = home.slot - VIEW_BASE;
        let mut escaped = true;
        let device = counts.block.device();
        let i = match self.arenas.devices.first() {
            Some(a) if a.device == device => Some(0),
            _ => self.arenas.index(device),
        };
        // A view of a retired block the owner holds as a room: the device and the room.
        let room = i
            .filter(|_| !counts.solo && counts.is_retired())
            .and_then(|i| Some((i, self.arenas.devices[i].room_of(arena)?)));
        if let Some(i) = i {
            let a = &mut self.arenas.devices[i];
            a.settle_record();
            escaped = home.generation != a.step;
            if escaped && a.shadow.is_some() && a.earlier_drops.len() < MAX_EARLIER_DROPS {
                a.earlier_drops
                    .push((a.tick, home.generation, view_size(bytes)));
            }
            let mut rec = pos;
            if !counts.is_retired() {
                counts.uncount_view();
                // A block that is not retired is a slab (a small array of a step served
                // online), else its plan's.
                let size = view_size(bytes);
                if let Some(slab) = a.slabs.iter_mut().find(|s| s.arena == arena) {
                    uncounted(&mut slab.in_use, st, a.gauge, size);
                    rec = pos - GAP_BASE;
                    if tainted {
                        // Its bytes wait for the other stream's work: the slot stays taken, and
                        // the slab is given up at the step's end.
                        slab.tainted = true;
                    } else if let Some(view) = view.take() {
                        let slot = (view.address() - counts.block.address()) / layout::SMALL;
                        slab.put(slot, view);
                    }
                } else if let Some(plan) = &mut a.plan {
                    uncounted(&mut plan.in_use, st, a.gauge, size);
                    rec = if escaped && let Some(Pin { range, held, .. }) = plan.unpin(home) {
                        plan.held_dropped |= held;
                        // Pinned (made in an earlier step, so escaped: the common drop, of
                        // this step's array, does not look): its bytes join the gaps, if open,
                        // and the positions over them may be served (unless another stream may
                        // still use them: then they stay taken through the step); its view goes
                        // loose.
                        if tainted {
                            plan.tainted = true;
                        } else {
                            plan.layout.unblock(&range);
                            if let Some(gaps) = &mut plan.gaps {
                                gaps.free(range.clone());
                            }
                            if let Some(view) = view.take() {
                                plan.loose.park(range.start, view);
                            }
                        }
                        NONE
                    } else if pos >= GAP_BASE {
                        // Served from a gap or the tail: its range is free again (unless another
                        // stream may still use it: then it stays taken through the step), and its
                        // view idle there.
                        let rec = pos - GAP_BASE;
                        if tainted {
                            plan.tainted = true;
                        } else if let Some(offset) = plan.give_back(rec, size)
                            && let Some(view) = view.take()
                        {
                            plan.loose.park(offset, view);
                        }
                        rec
                    } else if tainted {
                        plan.tainted = true;
                        plan.layout.rec_of(pos)
                    } else {
                        if let Some(gaps) = &mut plan.gaps {
                            // Alive when the step left the plan: its bytes join the gaps, and
                            // its view goes loose.
                            let range = plan.layout.range(pos);
                            gaps.free(range.clone());
                            if let Some(view) = view.take() {
                                plan.loose.park(range.start, view);
                            }
                        } else if let Some(kept) = plan.views.get_mut(pos as usize) {
                            // Kept for the position's next array.
                            std::mem::swap(kept, &mut view);
                        }
                        plan.layout.dropped(pos, a.tick)
                    };
                }
                if let Some(view) = view.take() {
                    // SAFETY: `view` was made by `Block::view`, and its block is alive.
                    unsafe { view.drop_view() };
                }
            }
            // Served apart: a solo block, or a room's range.
            let apart = counts.solo || room.is_some();
            if !escaped && let Some(r) = a.record.get_mut(rec as usize) {
                r.end = a.tick;
                // Planned apart, yet it died in its step: the next plan places it.
                if apart
                    && a.plan
                        .as_ref()
                        .is_some_and(|p| p.layout.is_apart(r.planned))
                {
                    a.replan = true;
                }
            }
            if !counts.is_retired() {
                if a.diverged {
                    self.live += usize::from(a.release_unused_block(st));
                }
                return false;
            }
        }
        // A room's array: its range is free again there (unless another stream may still use
        // it).
        if let Some((i, k)) = room
            && !tainted
            && let Some(v) = view.take()
        {
            let offset = v.address() - counts.block.address();
            self.arenas.devices[i].rooms[k].give_back_viewed(offset, view_size(bytes), v);
        }
        let (generation, solo) = (counts.generation, counts.solo);
        // A solo block's view stays with it, unless its array was used on another stream: then
        // the marks it handed the block are recorded when the block is taken out.
        if let Some(view) = view.take_if(|_| solo && !tainted) {
            // A solo block has one view, this one: its drop makes the block ours, and the view
            // stays with it, idle, in case the block is kept as a spare.
            if !counts.release_view() {
                unreachable!("a solo block with more than one view");
            }
            let held = Held::Viewed { arena, view };
            return self.take_back_held(st, held, generation, solo, escaped);
        }
        if let Some(view) = view.take() {
            // SAFETY: `view` was made by `Block::view`, and its block is alive until counted.
            unsafe { view.drop_view() };
        }
        if counts.release_view() {
            // SAFETY: the last view is gone; nothing else points at a retired block.
            let block = unsafe { ArenaBlock::into_block(arena) };
            return self.take_back(st, block, generation, solo, escaped);
        }
        // The last array of a room's block: the owner lets go of it, and takes it back.
        if let Some((i, k)) = room
            && counts.only_held()
        {
            return self.let_go_room(st, i, k);
        }
        false
    }

    /// Lets go of room `k` of device `i` (see the `room` module): its block stays retired
    /// under the arrays alive in it, or, when none is, comes back as a retired block whose
    /// last array dropped does. Returns whether the block went back to the device.
    fn let_go_room(&mut self, st: &Counters, i: usize, k: usize) -> bool {
        let mut room = self.arenas.devices[i].rooms.swap_remove(k);
        room.drop_idle();
        let arena = room.arena;
        // SAFETY: the room held the block until now.
        let generation = unsafe { arena.as_ref() }.generation;
        // SAFETY: as above; the hold is counted down here, once.
        if !unsafe { arena.as_ref() }.release_view() {
            return false;
        }
        // SAFETY: the hold was the last count: no view is alive, nothing else points at the
        // block.
        let block = unsafe { ArenaBlock::into_block(arena) };
        self.take_back(st, block, generation, false, true)
    }

    /// Ages device `i`'s rooms, and lets go of those whose blocks no array uses any more (their
    /// last arrays dropped on other threads), or of all of them with `all`.
    fn let_go_rooms(&mut self, st: &Counters, i: usize, all: bool) {
        for room in &mut self.arenas.devices[i].rooms {
            room.age();
        }
        self.let_go_unused_rooms(st, i, all);
    }

    /// Lets go of device `i`'s rooms whose blocks no array uses any more, or of all of them
    /// with `all`.
    fn let_go_unused_rooms(&mut self, st: &Counters, i: usize, all: bool) {
        for k in (0..self.arenas.devices[i].rooms.len()).rev() {
            let arena = self.arenas.devices[i].rooms[k].arena;
            // SAFETY: a room holds its block: alive while held.
            if all || unsafe { arena.as_ref() }.only_held() {
                self.let_go_room(st, i, k);
            }
        }
    }

    /// Records a hit or a miss (`kind`) that made `view`.
    #[cold]
    #[inline(never)]
    fn note_view(&self, st: &Counters, kind: EventKind, view: &Block) {
        let note = BufferNote::of(view);
        let after = st
            .find_gauge(note.device)
            .map(|g| super::traced::gauge_bytes(st, g));
        // On the thread's current stream, where the array goes.
        let stream = backend::current_stream_id(note.device);
        BufferNote { stream, ..note }.push(kind, self.trace.id(), after);
    }
}

impl CacheCell {
    /// Applies the options of `configure` call `seq`, unless the cache applied a later call's.
    pub(super) fn configure_locked(
        &self,
        state: &mut CacheState,
        seq: ConfigSeq,
        config: CacheConfig,
    ) {
        if seq < state.config_seq {
            return;
        }
        state.config_seq = seq;
        state.configure(&self.stats, config);
        state.evict_spares(&self.stats, config.max_cached_bytes);
        self.sync_arena_flag(state);
    }

    /// Sets the [`ARENA`] flag for a planned cache, and clears it once a cache that is no longer
    /// one holds no plan block or spare and no array of it is alive (`live` counts retired and
    /// solo blocks, and arrays of free lists: a conservative test).
    fn sync_arena_flag(&self, state: &mut CacheState) {
        let set = self.flags.load(Relaxed) & ARENA != 0;
        if state.config.key.is_planned() {
            if !set {
                self.flags.fetch_or(ARENA, Relaxed);
            }
        } else if set {
            state.free_arenas(&self.stats, None);
            if state.arenas.is_empty() && state.live == 0 {
                self.flags.fetch_and(!ARENA, Relaxed);
            }
        }
    }

    /// The hit path of a planned cache ([`CacheState::plan_hit`]). Call only on this thread's
    /// current (hence active) cache, with only the [`ARENA`] flag set (not traced or closed).
    #[inline(always)]
    pub(crate) fn plan_hit(&self, req: &Request<'_>) -> Option<(Block, Home)> {
        debug_assert!(self.is_owned_here() && self.is_active());
        // SAFETY: (see `locked`) the owner thread, inside a scope of the cell.
        let state = unsafe { self.locked() };
        let (view, slot, step) = state.plan_hit(&self.stats, req)?;
        Some((view, self.home(slot, step)))
    }

    /// Records the drop of a planned array (`kind`: on the owner thread, back to its cache,
    /// with the cache's bytes on the device after it; else returned from another thread, as a
    /// free list records it, with no bytes: the owner's counts are not final until it takes
    /// the block back).
    fn note_view_dropped(&self, kind: EventKind, n: BufferNote) {
        let after = (kind == EventKind::FreeToCache)
            .then(|| self.stats.find_gauge(n.device))
            .flatten()
            .map(|g| super::traced::gauge_bytes(&self.stats, g));
        n.push(kind, self.trace_id(), after);
    }

    /// [`CacheCell::take`] of a cache with the [`ARENA`] flag: for a planned cache the whole
    /// allocation. A cache that is no longer one (its arrays keep the flag set) first looks up
    /// its free list as the hit path does (`None`: go on as for any cache).
    #[inline(never)]
    pub(super) fn take_flagged(&self, state: &mut CacheState, req: &Request<'_>) -> Option<Take> {
        if state.config.key.is_planned() {
            let planned = state.planned(&self.stats, req);
            return Some(self.planned_take(state, planned, EventKind::Hit));
        }
        if self.traced() {
            return None;
        }
        let slot = state.find(state.key(req))?;
        let block = state.pop(&self.stats, slot)?;
        Some(Take::Hit(block, self.home(slot, state.generation)))
    }

    /// What the planned path gives the caller (a view recorded as `kind` when tracing).
    #[inline(always)]
    fn planned_take(&self, state: &mut CacheState, planned: Planned, kind: EventKind) -> Take {
        match planned {
            Planned::View(view, slot, step) => {
                if self.traced() {
                    state.note_view(&self.stats, kind, &view);
                }
                Take::Hit(view, self.home(slot, step))
            }
            Planned::Alloc {
                capacity,
                view,
                make,
            } => Take::Miss {
                capacity,
                view,
                make,
            },
            Planned::Bypass => Take::Bypass,
            Planned::Failed(e) => Take::Failed(e),
        }
    }

    /// [`CacheCell::adopt`] for a planned cache: a view of `block`, which becomes the plan's
    /// block or a solo block.
    pub(super) fn adopt_arena(
        &self,
        state: &mut CacheState,
        req: &Request<'_>,
        block: Block,
    ) -> Result<Got> {
        match state.adopt_planned(&self.stats, req, block) {
            Ok(planned) => match self.planned_take(state, planned, EventKind::Miss) {
                Take::Hit(view, home) => Ok(Got::Recycled(view, home)),
                Take::Failed(e) => Err(e),
                Take::Miss { .. } | Take::Bypass => unreachable!("an adopted block makes a view"),
            },
            Err(block) => Ok(Got::Fresh(block, None)),
        }
    }

    /// [`CacheCell::exit`] of a cache that is not [plain](CacheCell::is_plain): the outermost
    /// exit of a planned cache ends its step first, and a traced cache records the exit.
    #[cold]
    #[inline(never)]
    pub(crate) fn exit_slow(&self) {
        if self.flags.load(Relaxed) & ARENA != 0 && self.depth.load(Relaxed) == 1 {
            // SAFETY: (see `locked`) the owner thread, inside the outermost scope of the cell.
            let state = unsafe { self.locked() };
            // Blocks returned meanwhile first: they may be spares for the next step.
            self.drain_returned(state, false);
            state.end_step(&self.stats);
            self.sync_arena_flag(state);
        }
        if self.traced() {
            self.exit_traced();
        } else {
            self.exit();
        }
    }

    /// The common drop of a planned array, served in the array's drop before its buffer leaves
    /// the array ([`CacheState::drop_in_plan`]), when [`super::drop_here`] found the cell
    /// (`self`) the thread's current cache and a planned cache neither recorded nor closed (its
    /// flags `ARENA` alone), so nothing to record: an array of its plan, whose view was used on
    /// no other stream. `view` is taken when the drop is served; returns whether it was.
    ///
    /// # Safety
    ///
    /// The cell is the calling thread's current cache (so this is its owner thread, inside a
    /// scope of it: see `locked`).
    #[inline(always)]
    pub(super) unsafe fn drop_in_plan_here(&self, view: &mut Option<Block>, home: &Home) -> bool {
        if !is_arena_slot(home.slot) {
            return false;
        }
        // SAFETY: the thread's current cache (the caller's contract), which is on its scope
        // stack, so this is the owner thread, inside a scope of the cell (see `locked`).
        let state = unsafe { self.locked() };
        let Some(v) = view.as_mut() else {
            return false;
        };
        // The view's backend is its arena block (see `Plan::counted_view`).
        let Some(arena) = NonNull::new(v.backend_ptr().cast::<ArenaBlock>().cast_mut()) else {
            return false;
        };
        // A device view used on its block's stream alone (the common case) has no marks to hand
        // to the block.
        #[cfg(feature = "cuda")]
        if v.cuda().is_some() {
            v.end_use();
            // SAFETY: the block is alive while a view of it is.
            let block = unsafe { arena.as_ref() }.block.cuda();
            if !v
                .cuda_mut()
                .is_some_and(|c| block.is_some_and(|b| c.used_on_stream_of(b)))
            {
                return false;
            }
        }
        state.drop_in_plan(&self.stats, arena, home, view)
    }

    /// Returns a view from any thread. On the owner thread (cell open) it goes back under the
    /// lock; elsewhere only the block's count changes, and the last view of a retired block
    /// sends the block home. (The common drop was served before, in the array's drop:
    /// [`CacheCell::drop_in_plan_here`].)
    #[inline]
    pub(super) fn send_view_home(home: Home, view: Block, current: *const CacheCell) {
        // The view's backend is its arena block (see `Plan::counted_view`).
        let Some(arena) = NonNull::new(view.backend_ptr().cast::<ArenaBlock>().cast_mut()) else {
            return;
        };
        #[cfg(feature = "cuda")]
        if view.cuda().is_some() {
            return Self::send_cuda_view_home(home, view, arena, current);
        }
        Self::view_dropped(home, arena, current, view, false);
    }

    /// The cell's state, when it is the thread's current cache (`current`) and a planned cache
    /// neither recorded nor closed (its flags `ARENA` alone): a view's drop there goes straight
    /// to the state, with nothing to record.
    #[allow(clippy::mut_from_ref)] // the lock, not the borrow, makes it unique (see `locked`)
    #[inline(always)]
    fn planned_owner(&self, current: *const CacheCell) -> Option<&mut CacheState> {
        (std::ptr::eq(current, self) && self.hit_path() == HitPath::Plan).then(|| {
            // SAFETY: (see `locked`) the thread's current cache is on its scope stack, so this
            // is the owner thread, inside a scope of the cell.
            unsafe { self.locked() }
        })
    }

    /// [`CacheCell::send_view_home`] of a view of device memory: the streams it was used on
    /// order the block's next use.
    #[cfg(feature = "cuda")]
    #[inline(never)]
    fn send_cuda_view_home(
        home: Home,
        mut view: Block,
        arena: BlockPtr,
        current: *const CacheCell,
    ) {
        let mut tainted = false;
        if let Some(v) = view.cuda_mut() {
            // SAFETY: the block is alive while a view of it is.
            if let Some(parent) = unsafe { arena.as_ref() }.block.cuda() {
                tainted = v.hand_marks_to(parent);
            }
        }
        Self::view_dropped(home, arena, current, view, tainted);
    }

    /// The array of `view`, a view of `arena`, dropped: the owner keeps the view for the
    /// position or drops it, and counts it; the last view of a retired block sends the block
    /// home.
    #[inline(never)]
    fn view_dropped(
        home: Home,
        arena: BlockPtr,
        current: *const CacheCell,
        view: Block,
        tainted: bool,
    ) {
        // SAFETY: the block is alive while it is the plan's or retired with views (this one was
        // alive until now), and the cell is alive while the block is (see the module docs).
        let cell = unsafe { home.cell.as_ref() };
        // The common case first: nothing to record.
        if let Some(state) = cell.planned_owner(current) {
            state.drop_view(&cell.stats, arena, &home, view, tainted);
            return;
        }
        let noted = record::on().then(|| BufferNote::of(&view));
        // On the owner thread: whether the view's block went back to the device.
        let freed = if std::ptr::eq(current, cell) && !cell.is_closed() {
            // SAFETY: (see `locked`) the thread's current cache is on its scope stack, so this
            // is the owner thread, inside a scope of the cell.
            let state = unsafe { cell.locked() };
            state.drop_view(&cell.stats, arena, &home, view, tainted)
        } else if cell.is_owned_here() && !cell.is_closed() {
            cell.owned(|state, st| state.drop_view(st, arena, &home, view, tainted))
        } else {
            if let Some(n) = noted {
                // Before the count: once it is down, the cell may go.
                cell.note_view_dropped(EventKind::Returned, n);
            }
            // SAFETY: the block is alive until this view is counted down (below).
            let counts = unsafe { arena.as_ref() };
            // Not while the owner captures a graph on the streams this makes wait.
            #[cfg(feature = "cuda")]
            if let Some(v) = view.cuda() {
                v.wait_out_capture();
            }
            // Used on other streams: the owner, which will hand its bytes out again without
            // learning that (it only counts the view gone), must use them after that work.
            // Before the count, while the view holds the block.
            #[cfg(feature = "cuda")]
            if tainted && let Some(parent) = counts.block.cuda() {
                parent.wait_out_capture();
                parent.order_after_marks();
            }
            // SAFETY: `view` was made by `Block::view`, and its block is alive until counted.
            unsafe { view.drop_view() };
            if counts.release_view() {
                let home = Home {
                    generation: counts.generation,
                    slot: if counts.solo {
                        RETURNED_SOLO
                    } else {
                        RETURNED_PLAN
                    },
                    ..home
                };
                // SAFETY: that was the last view of a retired block.
                let block = unsafe { ArenaBlock::into_block(arena) };
                super::remote::send_home_remote(home, block);
            }
            return;
        };
        // A block that went back to the device was recorded as such instead, as a free list
        // records a stale buffer.
        if let Some(n) = noted
            && !freed
        {
            cell.note_view_dropped(EventKind::FreeToCache, n);
        }
    }
}

//! The state of a planned cache, per device: the step's record, its plan and the plan's block,
//! the spares (data only; the `arena` module holds what is done with it). It sits below the
//! cache state, which holds one [`Arenas`].

use std::sync::Arc;

use super::block::BlockPtr;
use super::gaps::Gaps;
use super::layout::{Layout, Margin, Rec};
use super::loose::Loose;
use super::online::Shadow;
use super::room::Room;
use super::slab::Slab;
use crate::Device;
use crate::backend::Block;
use crate::cache::counters::GaugeIx;
use crate::planner::Learned;
use crate::trace::record::CellName;

/// A plan of one device: its layout and its block.
pub(in crate::cache) struct Plan {
    pub(super) layout: Layout,
    /// Made at the plan's first hit.
    pub(super) block: Option<BlockPtr>,
    /// Aligned bytes of the block's arrays alive, as the owner counts them.
    pub(super) in_use: usize,
    /// The block was made ready for this step's stream.
    pub(super) ready: bool,
    /// A view of the block was used on another stream this step: the block leaves the plan at
    /// the step's end.
    pub(super) tainted: bool,
    /// The step left the plan: the block's free ranges, for the rest of the step.
    pub(super) gaps: Option<Gaps>,
    /// The block's *tail*, while the step follows its plan: its bytes past the plan's footprint
    /// (a block kept for a larger plan of the same scope), free but for pins, from which the
    /// arrays the plan serves apart take their ranges (made at the first of them, this step).
    pub(super) tail: Option<Gaps>,
    /// Per position, the view its last array dropped, kept for the next array there (a cudarc
    /// view is a `CudaSlice` with events of its own: made once, not every step). Views of the
    /// block, but no array's: not counted as alive. A view spans from its offset to the end of
    /// the block, so any array at that offset can use it.
    pub(super) views: Vec<Option<Block>>,
    /// Idle views at offsets that are no position's, or dropped in a step that left the plan:
    /// by offset, for the arrays the block's gaps (or the next layout's positions) put there.
    /// Several at one offset: the positions of a plan that share an offset at different times
    /// each had one, and a shelved plan switched in again finds them all. At most twice the
    /// positions of this plan and of the shelved ones, which share the block (at least 128),
    /// when a step ends.
    pub(super) loose: Loose,
    /// Arrays of the block made before the plan, still alive (a few small ones: a training
    /// loop's loss, kept until the next step's replaces it): the plan's positions are placed
    /// around them, and their bytes are free once they drop.
    pub(super) pins: Vec<Pin>,
    /// The layout was placed around the pins it was made with (they may have dropped since):
    /// its arrangement is this block's of that moment.
    pub(super) around_pins: bool,
    /// A pin made at a position held over ([`Pin::held`]) dropped this step (an optimizer's
    /// step dropped the gradients).
    pub(super) held_dropped: bool,
}

/// An array of a plan's block made before the plan (in the step the plan was made from, or
/// before, served at a position or from the block's gaps) and alive when it was made: its home,
/// which names it among the block's arrays, and its bytes.
#[derive(Clone, Debug)]
pub(in crate::cache) struct Pin {
    /// The `generation` of its home: the step that made it.
    pub(super) step: u32,
    /// The `slot` of its home.
    pub(super) slot: u32,
    /// Its aligned bytes in the block.
    pub(super) range: std::ops::Range<usize>,
    /// Made at a position held over (see `layout::HeldOver`): a gradient kept by the first
    /// micro-batch of an optimizer step.
    pub(super) held: bool,
}

/// A plan of another kind of step than the current plan's, kept (without a block: the current
/// plan's serves whichever layout is in use) for when such a step comes again.
pub(in crate::cache) struct Shelved {
    pub(super) layout: Layout,
    /// The last step it was the plan of.
    pub(super) used: u32,
}

/// How a spare (a solo block no array uses, kept for the next solo array it fits) is held.
pub(in crate::cache) enum Held {
    /// The block alone: it came back from another thread, its array was used on another stream,
    /// or it is a plan's block that another stream may still use.
    Bare(Block),
    /// Still in its solo arena block, with the view its array had, idle: the next array the spare
    /// serves takes that view again (made once, with its cudarc `CudaSlice` and two events once
    /// used with several streams, not every time the spare is reused). The view spans the whole
    /// block; it is no array's, and not counted (the block's count is zero).
    Viewed { arena: BlockPtr, view: Block },
}

/// What a device allocation that the cache asked for (a `Take::Miss`) is for.
#[derive(Clone, Copy)]
pub(super) enum Awaiting {
    /// The plan's block, for position `pos` at `offset`, allocation `rec` of the step.
    Plan { pos: u32, offset: usize, rec: u32 },
    /// A solo block for position `pos`.
    Solo { pos: u32 },
    /// A slab, for allocation `rec` of the step, a small array of a step served online.
    Slab { rec: u32 },
}

/// A tally of a step's allocations so far, each against the position it was matched with.
#[derive(Default)]
pub(super) struct Tally {
    /// How many entries of the step's record are counted.
    pub(super) counted: usize,
    /// Their aligned bytes.
    pub(super) got: usize,
    /// The bytes of their positions (none for one matched with no position, or apart).
    pub(super) planned: usize,
}

/// The planned cache of one device.
pub(in crate::cache) struct DeviceArena {
    pub(super) device: Device,
    pub(super) gauge: GaugeIx,
    /// The cache's name, for recorded events.
    pub(super) trace: Arc<CellName>,
    /// The number of the current step (wraps).
    pub(super) step: u32,
    /// The current step's allocations so far.
    pub(super) tick: u32,
    pub(super) record: Vec<Rec>,
    /// The step left its plan: plan it again at its end.
    pub(super) diverged: bool,
    /// The step followed its plan, yet the plan must change: an array served apart as planned
    /// (it outlived the recorded step) dropped within this step, or a position grew past its
    /// size ([`DeviceArena::grown`]). Plan again at the step's end.
    pub(super) replan: bool,
    /// The step allocated more than the most positions a step records: it is not planned.
    pub(super) overflowed: bool,
    /// Aligned bytes of this step's positions that grew past their plan and were served apart
    /// while the step stayed on its plan.
    pub(super) grown: usize,
    /// How many arrays make up [`DeviceArena::grown`].
    pub(super) grown_arrays: usize,
    /// The step's allocations tallied so far ([`DeviceArena::short_of_plan`]).
    pub(super) tally: Tally,
    /// Device allocations of this step (blocks, and arrays apart that no spare served).
    pub(super) allocated: usize,
    /// Steps in a row that left their plans, up to the last that ended.
    pub(super) left_in_a_row: usize,
    /// The step left its plan for want of room: served apart from there, its plan's block given
    /// back once unused.
    pub(super) outgrew: bool,
    /// The step outgrew its plan and follows the plan scaled as it grew.
    pub(super) scaled: bool,
    /// Aligned bytes the step served apart since it outgrew its plan, while waiting for the
    /// plan's block to be unused.
    pub(super) waited: usize,
    /// The step outgrew its plan (or its scaled plan) and is served from a block's gaps: an
    /// allocation no gap holds goes apart, and the gaps stay open.
    pub(super) keep_gaps: bool,
    pub(super) plan: Option<Plan>,
    /// Plans of other kinds of step (a server's prompt steps and decoding steps), the least
    /// recently used first to go.
    pub(super) shelf: Vec<Shelved>,
    /// Blocks no array uses, kept for solo arrays, the oldest first: freed, oldest first, before
    /// a device allocation of the cache that would take it past [`DeviceArena::high`]. Counted
    /// as cached.
    pub(super) spares: Vec<Held>,
    /// The spares kept from arrays apart that dropped within this step, a step a plan serves
    /// (by [`Block::id`]): they serve the step's next arrays apart, and go back to the device at
    /// the step's end. A spare leaves this list as it leaves the spares
    /// ([`DeviceArena::remove_spare`]), so that no block made later at its address is taken for
    /// it.
    pub(super) step_spares: Vec<u64>,
    /// Online, the slabs of the steps' small arrays (at most [`SMALL`](super::layout::SMALL)
    /// bytes: a scalar, a few indices): once [`DeviceArena::tiny_apart`], such an array gets a
    /// slot of a slab, never bytes of the online block (see the `slab` module). Their free slots
    /// count as cached; given up with the online tier and by the cache's cold starts.
    pub(super) slabs: Vec<Slab>,
    /// Online, small arrays get slots of slabs ([`DeviceArena::slabs`]): set when the online
    /// block grows while small arrays kept from earlier steps are in it, until the steps leave
    /// the online tier or the cache gives its blocks back.
    pub(super) tiny_apart: bool,
    /// The plan's block, given up while no array used it and no stream's work on it was
    /// pending (the step left its plan, or outgrew it, or a larger plan was made or switched
    /// in), when its backend can grow it in place, with the step it was given up in: the next
    /// plan's block is this one, as it is when it holds the plan, else grown (mapping only the
    /// new bytes) rather than allocated anew. Freed before another device allocation of the
    /// cache that would take it past [`DeviceArena::high`], or once a whole step passed with
    /// no plan block made. Counted as cached.
    pub(super) given_up: Option<(Block, u32)>,
    /// The most bytes the cache has held on the device at once (since it last gave everything
    /// back): a block given up is kept through other allocations only while the cache stays
    /// within it.
    pub(super) high: usize,
    /// What the planner learned from this device's last plans: the way that came within a 32nd
    /// of the peak live bytes, made first, and the way that gave the plans when none did, made
    /// alone once it won a few in a row (see [`crate::planner::greedy_by_size_from`]), and its
    /// last plans with what they were placed for ([`Learned::plan`]). A model's steps are
    /// planned alike.
    pub(super) planner: Learned,
    pub(super) awaiting: Option<Awaiting>,
    /// The [signatures](super::layout::signature) of the last steps that left their plan and
    /// were not planned again (see `DeviceArena::end_step`), the newest first.
    pub(super) unplanned: [u64; UNPLANNED],
    /// The signatures of the last steps that left their plan by the order of their
    /// allocations (see `DeviceArena::recurs_reordered`), the newest first, at most
    /// [`REORDERED`].
    pub(super) reordered: Vec<u64>,
    /// The steps are served online (see the `online` module): every allocation from the
    /// plan's block's free ranges, grown at its top when none holds it, and no plan made.
    pub(super) online: bool,
    /// Online serving simulated on the steps since one left its plan, while they are served
    /// from plans ([`Shadow`]).
    pub(super) shadow: Option<Box<Shadow>>,
    /// While the shadow runs: the arrays of earlier steps that dropped in this one, as the
    /// tick they dropped at, the step that made them and their aligned bytes.
    pub(super) earlier_drops: Vec<(u32, u32, usize)>,
    /// The most aligned bytes alive at once in a step whose record was read (one that left its
    /// plan or made one), since the cache's cold start.
    pub(super) peak_most: usize,
    /// Steps to wait before another shadow may start (one stopped without the scope going
    /// online).
    pub(super) shadow_wait: u32,
    /// Whether the rest of the last step that outgrew its plan could not be placed again
    /// around the arrays alive in the block (0: it could, or none was tried), and since then,
    /// how many steps did not try ([`AROUND_RETRY`](super::AROUND_RETRY)).
    pub(super) around_missed: u8,
    /// How many shadows stopped without the scope going online, or with it online for a single
    /// step.
    pub(super) shadow_misses: u32,
    /// The step at whose end the scope last went online.
    pub(super) online_from: u32,
    /// The last step dropped arrays pinned at positions held over ([`Plan::held_dropped`]).
    pub(super) held_dropped_last: bool,
    /// The step after the last that dropped arrays pinned at positions held over kept arrays at
    /// positions held over: a first micro-batch after an optimizer's step, the steps' order
    /// of a loop that accumulates gradients.
    pub(super) kept_after_drop: bool,
    /// The sizes of the first allocations of the steps since the cache's cold start, while they
    /// are at most two.
    pub(super) firsts: Firsts,
    /// The step outgrew its plan in doubt, and its block's gaps serve it: at its first array
    /// that no gap holds, the block grows to the plan scaled (`DeviceArena::doubted`).
    pub(super) in_doubt: bool,
    /// What a plan scaled for a step takes more than the step's ratio: raised when an array of
    /// a step scaled so was larger than its place, until the cache's cold start.
    pub(super) margin: Margin,
    /// Plan blocks retired under arrays alive in them, held by the owner: their free bytes
    /// serve the arrays served apart until they come back (see the `room` module). At most
    /// [`MAX_ROOMS`](super::room::MAX_ROOMS).
    pub(super) rooms: Vec<Room>,
}

impl DeviceArena {
    /// The index of the room of `arena`, if the device holds one.
    pub(super) fn room_of(&self, arena: BlockPtr) -> Option<usize> {
        self.rooms.iter().position(|r| r.arena == arena)
    }
}

/// How many steps that left their plan unplanned a device remembers.
pub(super) const UNPLANNED: usize = 4;

/// How many steps that left their plan by the order of their allocations a device remembers:
/// twice as many as it shelves plans.
pub(super) const REORDERED: usize = 2 * super::MAX_SHELVED;

// SAFETY: a `DeviceArena` is part of a cache's state, reached only by the holder of its lock (on
// any thread); its `BlockPtr` stands for the cache's count of an `Arc<ArenaBlock>`, whose fields
// are `Send` and `Sync` (a block, and atomics).
unsafe impl Send for DeviceArena {}

/// The planned caches of a cache: one per device it has allocated on.
#[derive(Default)]
pub(in crate::cache) struct Arenas {
    pub(super) devices: Vec<DeviceArena>,
}

impl Arenas {
    /// The index of `device`'s, if it has one.
    #[inline]
    pub(super) fn index(&self, device: Device) -> Option<usize> {
        self.devices.iter().position(|a| a.device == device)
    }

    /// Whether no device has a plan or a spare (retired blocks aside).
    pub(super) fn is_empty(&self) -> bool {
        self.devices.iter().all(|a| {
            a.plan.as_ref().is_none_or(|p| p.block.is_none())
                && a.spares.is_empty()
                && a.given_up.is_none()
        })
    }
}

/// The sizes of the steps' first allocations since a planned cache's cold start, while they
/// are at most two.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Firsts {
    /// No step yet.
    #[default]
    None,
    /// Every step's first allocation was this many aligned bytes.
    One(usize),
    /// Every step's first allocation was of one of these sizes.
    Two(usize, usize),
    /// Of more sizes.
    Varied,
}

impl Firsts {
    /// Notes a step's first allocation, of `size` aligned bytes.
    pub(super) fn note(&mut self, size: usize) {
        *self = match *self {
            Firsts::None => Firsts::One(size),
            Firsts::One(a) if a != size => Firsts::Two(a, size),
            Firsts::Two(a, b) if a != size && b != size => Firsts::Varied,
            same => same,
        };
    }

    /// Whether the steps so far began with at most two sizes: a fixed-shape loop of one kind of
    /// step, or of two (training and evaluation steps), not a loop whose shapes vary.
    pub(super) fn few(self) -> bool {
        self != Firsts::Varied
    }
}

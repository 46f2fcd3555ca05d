//! The idle views of a plan's block that no position keeps: *loose*, by offset, the least
//! recently parked dropped first when there are too many.
//!
//! A view of a plan's block is made once per offset and kept idle when its array drops, for the
//! next array there (a cudarc view is a `CudaSlice` with a read and a write event of its own:
//! making one, and dropping it, costs more than the rest of a hit). A position keeps its own
//! view; the views of arrays the block's gaps placed, or of positions when another layout takes
//! the block, go loose, at their offsets, and an array placed at one of those offsets later
//! takes the view there.
//!
//! A plan's positions come back at the same offsets; the arrays of steps served from the gaps,
//! or online, do not all: best fit places a step's arrays where the step before left room, and
//! a detector's steps bring a few hundred offsets never seen before each. Their views are kept
//! within a cap (twice the positions of the plans that share the block), and when a step ends
//! with more, those parked the most steps ago go first: an offset used lately is the one most
//! likely to come again. (Dropping the newest view instead, once the cap was reached, kept the
//! offsets of the first steps for good: Keypoint R-CNN's long run, served online, made a new
//! view for half of its arrays, 21,935 of 43,097; 11,239 now. See BENCHMARKS.md.)
//!
//! The positions' views of a layout that gives way to another while the block stays (shelved for
//! a kind of step that takes turns with another on the block, or made again at a step's end) are
//! *stashed* apart, by position, for that arrangement alone ([`Loose::stash`], keyed by a hash of
//! the layout's offsets): a layout of the same arrangement that takes the block later (switched
//! in again, or a plan given again) takes them back at once, with no hash lookup each.

use hashbrown::HashMap;
use smallvec::SmallVec;

use crate::backend::Block;

/// A layout's idle views, each with its position and the offset it was made at.
pub(super) type Stashed = Vec<(u32, usize, Block)>;

/// The loose views of a plan's block, by offset.
#[derive(Default)]
pub(in crate::cache) struct Loose {
    at: HashMap<usize, Idle>,
    /// The idle views of the positions of layouts shelved while the block stays (see
    /// [`Loose::stash`]), the most recently stashed last: the arrangement's key, and its views.
    stashed: Vec<(u64, Stashed)>,
    /// The views in `at`.
    len: usize,
    /// The most views kept when a step ends ([`Loose::age`]).
    cap: usize,
    /// The steps ended since the views were first kept (wraps).
    clock: u32,
}

/// The loose views at one offset: mostly one (no allocation for it), several where positions of
/// the plans that take turns on the block share the offset; and when the last was parked.
struct Idle {
    views: SmallVec<[Block; 1]>,
    parked: u32,
}

impl Idle {
    /// The steps ended since the last view was parked here, when the clock reads `clock` (the
    /// oldest of [`AGES`] for any older).
    fn age(&self, clock: u32) -> usize {
        (clock.wrapping_sub(self.parked) as usize).min(AGES - 1)
    }
}

/// The most layouts whose positions' views are stashed ([`Loose::stash`]).
const MAX_STASHED: usize = 4;

/// Views parked this many steps ago or longer are of one age when the oldest go
/// ([`Loose::trim`]).
const AGES: usize = 64;

/// Drops idle views of a plan's block (before the block leaves the plan).
pub(super) fn drop_views(views: impl IntoIterator<Item = Block>) {
    for view in views {
        // SAFETY: a kept view was made by `Block::view`, is no array's, and its block is alive
        // (kept views are dropped before their block leaves the plan).
        unsafe { view.drop_view() };
    }
}

impl Loose {
    /// No views, keeping at most `cap` when a step ends.
    pub(super) fn new(cap: usize) -> Loose {
        Loose {
            cap,
            ..Loose::default()
        }
    }

    /// How many views are kept.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The most views kept when a step ends.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Keeps `view`, idle at `offset` of the block. Past twice the cap (more views dropped within
    /// one step than a step of the plans has arrays), the view is dropped instead.
    pub(super) fn park(&mut self, offset: usize, view: Block) {
        if self.len >= self.cap.saturating_mul(2) {
            drop_views([view]);
            return;
        }
        let clock = self.clock;
        let idle = self.at.entry(offset).or_insert_with(|| Idle {
            views: SmallVec::new(),
            parked: clock,
        });
        idle.views.push(view);
        idle.parked = clock;
        self.len += 1;
    }

    /// Keeps the idle views of a layout's positions, `views` (each with its position and the
    /// offset it was made at), for a layout of the arrangement `layout` (its key) that takes the
    /// same block again ([`Loose::unstash`]): parked one by one, each view went into the map, and
    /// came out again at the layout's next step, where a step of one of the kinds that take
    /// turns on a block (a batch size that comes again) switched every step (Swin-T trained on
    /// a varying batch: about a thousand positions a switch, two hash lookups each). The
    /// layouts stashed longest ago, past [`MAX_STASHED`], have their views parked.
    pub(super) fn stash(&mut self, layout: u64, views: Stashed) {
        if views.is_empty() {
            return;
        }
        // Views stashed for the arrangement before (none took it since) go loose.
        if let Some(before) = self.unstash(layout) {
            self.park_all(before);
        }
        self.stashed.push((layout, views));
        if self.stashed.len() > MAX_STASHED {
            let (_, oldest) = self.stashed.remove(0);
            self.park_all(oldest);
        }
    }

    /// Parks each of `views` at the offset it was made at.
    fn park_all(&mut self, views: Stashed) {
        for (_, offset, view) in views {
            self.park(offset, view);
        }
    }

    /// The views [`Loose::stash`] kept for the arrangement `layout` (its key), if any.
    pub(super) fn unstash(&mut self, layout: u64) -> Option<Stashed> {
        let i = self.stashed.iter().position(|(id, _)| *id == layout)?;
        Some(self.stashed.remove(i).1)
    }

    /// A view idle at `offset`, if one is.
    #[inline]
    pub(super) fn unpark(&mut self, offset: usize) -> Option<Block> {
        if self.len == 0 {
            return None;
        }
        let idle = self.at.get_mut(&offset)?;
        let view = idle.views.pop();
        if idle.views.is_empty() {
            self.at.remove(&offset);
        }
        self.len -= usize::from(view.is_some());
        view
    }

    /// A step ended: the views parked this step are a step older, and when more than a quarter
    /// past the cap are kept, the oldest go until the cap is met (so that the views are counted
    /// by age once every few steps, not every step).
    pub(super) fn age(&mut self) {
        self.clock = self.clock.wrapping_add(1);
        if self.len > self.cap + self.cap / 4 {
            self.trim();
        }
    }

    /// The cap is `cap` from now on; the oldest views past it go.
    pub(super) fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
        self.trim();
    }

    /// Drops the views past the cap, the least recently parked first.
    fn trim(&mut self) {
        if self.len <= self.cap {
            return;
        }
        let clock = self.clock;
        let mut per_age = [0usize; AGES];
        for idle in self.at.values() {
            per_age[idle.age(clock)] += idle.views.len();
        }
        // The views younger than `limit` fit; of those of age `limit`, as many as still fit.
        let (mut limit, mut younger) = (0, 0);
        while limit < AGES && younger + per_age[limit] <= self.cap {
            younger += per_age[limit];
            limit += 1;
        }
        let mut room = self.cap - younger;
        self.at.retain(|_, idle| {
            let age = idle.age(clock);
            if age > limit {
                drop_views(idle.views.drain(..));
            } else if age == limit {
                let keep = idle.views.len().min(room);
                room -= keep;
                drop_views(idle.views.drain(keep..));
            }
            !idle.views.is_empty()
        });
        self.len = self.at.values().map(|idle| idle.views.len()).sum();
        debug_assert!(self.len <= self.cap);
    }

    /// Takes every view out, the stashed ones too (the block leaves the plan: they are dropped).
    pub(super) fn drain(&mut self) -> impl Iterator<Item = Block> + '_ {
        self.len = 0;
        let stashed = std::mem::take(&mut self.stashed);
        self.at.drain().flat_map(|(_, idle)| idle.views).chain(
            stashed
                .into_iter()
                .flat_map(|(_, views)| views.into_iter().map(|(.., view)| view)),
        )
    }

    /// Drops every view (before their block leaves the plan).
    pub(super) fn drop_all(mut self) {
        drop_views(self.drain());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::Device;
    use crate::backend::Backend;
    use crate::backend::cpu::CpuBackend;
    use crate::cache::arena::block::{ArenaBlock, BlockPtr};

    const BYTES: usize = 1 << 12;

    /// A plan's block of [`BYTES`] bytes, with no view yet.
    fn block() -> BlockPtr {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::default());
        ArenaBlock::new(
            Block::alloc(&backend, Device::Cpu, BYTES, false).unwrap(),
            0,
        )
    }

    /// A view of `block` at `offset`, as a plan makes one (not counted: no array's).
    fn view(block: BlockPtr, offset: usize) -> Block {
        let owner: *const dyn Backend = block.as_ptr().cast_const();
        // SAFETY: the range is inside the block, `owner` is its `Arc::into_raw` pointer, and
        // the block stays alive until `give_back`, after every view is dropped.
        unsafe { block.as_ref().block.view(owner, offset, BYTES - offset) }.unwrap()
    }

    /// Takes the block back once no view of it is alive.
    fn give_back(block: BlockPtr) {
        // SAFETY: made by `ArenaBlock::new`; the tests drop every view first.
        drop(unsafe { ArenaBlock::into_block(block) });
    }

    #[test]
    fn the_views_parked_longest_ago_go_first() {
        let b = block();
        let mut loose = Loose::new(4);
        // Offsets 0-3 parked in a step, then 4-8 in the next: nine views, past the cap and a
        // quarter at that step's end. The four newest stay.
        for offset in 0..4 {
            loose.park(offset * 256, view(b, offset * 256));
        }
        loose.age();
        assert_eq!(loose.len(), 4, "at the cap, nothing goes");
        // Offset 0 taken and parked again: parked now.
        let again = loose.unpark(0).unwrap();
        loose.park(0, again);
        for offset in 5..8 {
            loose.park(offset * 256, view(b, offset * 256));
        }
        loose.age();
        assert_eq!(loose.len(), 4);
        for offset in [1, 2, 3] {
            assert!(loose.unpark(offset * 256).is_none(), "offset {offset} kept");
        }
        for offset in [0, 5, 6, 7] {
            let view = loose
                .unpark(offset * 256)
                .expect("a recent view was dropped");
            // SAFETY: the block is alive until `give_back`.
            let base = unsafe { b.as_ref() }.block.address();
            assert_eq!(view.address(), base + offset * 256);
            drop_views([view]);
        }
        assert_eq!(loose.len(), 0);
        give_back(b);
    }

    #[test]
    fn a_step_keeps_at_most_twice_the_cap_and_a_lower_cap_trims_at_once() {
        let b = block();
        let mut loose = Loose::new(3);
        for offset in 0..10 {
            loose.park(offset * 64, view(b, offset * 64));
        }
        assert_eq!(loose.len(), 6, "within a step, twice the cap at most");
        // Several views at one offset are kept and taken one by one.
        loose.park(0, view(b, 0));
        assert_eq!(loose.len(), 6);
        loose.set_cap(2);
        assert_eq!(loose.len(), 2);
        let taken: Vec<Block> = loose.drain().collect();
        assert_eq!(taken.len(), 2);
        assert_eq!(loose.len(), 0);
        drop_views(taken);
        give_back(b);
    }

    /// Two views stashed for `layout`, at positions 0 and 2 (none at 1), at offsets of its own.
    fn stash_two(loose: &mut Loose, b: BlockPtr, layout: u64) {
        let at = |k: u64| (layout * 3 + k) as usize * 64;
        loose.stash(
            layout,
            vec![(0, at(0), view(b, at(0))), (2, at(2), view(b, at(2)))],
        );
    }

    /// Checks that `views` are the two [`stash_two`] stashed for `layout`, and drops them.
    fn are_two(b: BlockPtr, layout: u64, views: Stashed) {
        // SAFETY: the block is alive until `give_back`.
        let base = unsafe { b.as_ref() }.block.address();
        let positions: Vec<u32> = views.iter().map(|&(k, ..)| k).collect();
        assert_eq!(positions, [0, 2], "position 1 has none");
        for (k, offset, view) in &views {
            let at = (layout as usize * 3 + *k as usize) * 64;
            assert_eq!((*offset, view.address()), (at, base + at));
        }
        drop_views(views.into_iter().map(|(.., v)| v));
    }

    #[test]
    fn a_shelved_layouts_views_come_back_whole_and_the_oldest_go_loose() {
        let b = block();
        let mut loose = Loose::new(64);
        // A layout with no idle view stashes nothing.
        loose.stash(99, Vec::new());
        assert!(loose.unstash(99).is_none());
        // Layouts 0 to MAX_STASHED stash two views each: past the most stashed, the first
        // layout's went loose, at their offsets.
        for layout in 0..=MAX_STASHED as u64 {
            stash_two(&mut loose, b, layout);
        }
        assert!(loose.unstash(0).is_none());
        assert_eq!(loose.len(), 2);
        drop_views(loose.unpark(0));
        drop_views(loose.unpark(2 * 64));
        assert_eq!(loose.len(), 0);
        // The last comes back as it was stashed, position by position.
        are_two(
            b,
            MAX_STASHED as u64,
            loose.unstash(MAX_STASHED as u64).unwrap(),
        );
        // Stashed twice with no unstash between, a layout's earlier views go loose.
        stash_two(&mut loose, b, 1);
        assert_eq!(loose.len(), 2);
        let first = loose.unpark(3 * 64).expect("position 0's earlier view");
        let second = loose.unpark(5 * 64).expect("position 2's earlier view");
        drop_views([first, second]);
        are_two(b, 1, loose.unstash(1).unwrap());
        // The block leaving the plan takes the stashed views with the loose ones.
        loose.park(4096 - 64, view(b, 4096 - 64));
        let drained: Vec<Block> = loose.drain().collect();
        assert_eq!(
            drained.len(),
            1 + 2 * 2,
            "one loose, layouts 2 and 3 stashed"
        );
        drop_views(drained);
        assert!(loose.unstash(2).is_none());
        give_back(b);
    }

    #[test]
    fn views_of_one_offset_are_kept_together() {
        let b = block();
        let mut loose = Loose::new(8);
        for _ in 0..3 {
            loose.park(512, view(b, 512));
        }
        assert_eq!(loose.len(), 3);
        for left in (0..3).rev() {
            drop_views(loose.unpark(512));
            assert_eq!(loose.len(), left);
        }
        assert!(loose.unpark(512).is_none());
        loose.drop_all();
        give_back(b);
    }
}

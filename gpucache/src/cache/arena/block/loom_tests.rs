//! Loom models of the biased view count of arena blocks (`RUSTFLAGS="--cfg loom" cargo test -p
//! gpucache --lib --release loom`; see CONTRIBUTING.md).
//!
//! Each model runs on a real [`ArenaBlock`] (made by [`ArenaBlock::new`] from a block of the
//! CPU backend; its `local`, `shared` and `retired` are loom atomics under `cfg(loom)`), with
//! real views of it ([`Block::view`], given back with [`Block::drop_view`]). The count's updates
//! are the [`ArenaBlock`] methods that `cache/arena.rs` calls, driven in the order it calls them
//! (its cache state, which loom cannot build, is left out):
//! * [`Model::make_view`]: `Plan::view` (owner, lock held): [`ArenaBlock::count_view`];
//! * [`Model::drop_on_owner`]: `CacheState::drop_view` (owner, lock held, reached from
//!   `CacheCell::view_dropped`): before retirement [`ArenaBlock::uncount_view`], after it
//!   [`ArenaBlock::release_view`], whose last drop takes the block back;
//! * [`Model::drop_on_other`]: the other-thread branch of `CacheCell::view_dropped`:
//!   [`ArenaBlock::release_view`];
//! * [`Model::detach`]: `DeviceArena::detach` (owner, lock held): with `views()` at 0 the block
//!   is taken back at once; else [`ArenaBlock::retire`], and the block is taken back if that
//!   leaves no view.
//! * [`Model::settle`]: `Plan::settle_remote_drops` and `DeviceArena::settle_slabs` (owner, lock
//!   held, at a step's end and when the stats are read): a block still the cache's whose
//!   `views()` read 0 has every position, or every slot of a slab, free again, those of arrays
//!   dropped on other threads included, and the next arrays use their bytes.
//!
//! Every model checks that exactly one party takes the block back, that it does so only once
//! every view is gone (a count of the views alive reads zero), and, through loom `UnsafeCell`s
//! standing for the views' bytes (each written by its array before it drops, and all of them
//! by the party that takes the block back to reuse it), that the taking is ordered after every
//! use of every view. The block itself goes back ([`ArenaBlock::into_block`]) once every
//! thread has joined, so that a model that found two takers fails its assertion rather than
//! free the block twice.

use std::sync::Arc as StdArc;
use std::sync::atomic::Ordering::*;

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::AtomicUsize;
use loom::thread;

use super::{ArenaBlock, BlockPtr};
use crate::Device;
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, Block};
use crate::sync::model;

/// Bytes of each view.
const VIEW_BYTES: usize = 64;

/// An arena block with room for `N` views, and what the model watches.
struct Model<const N: usize> {
    block: BlockPtr,
    /// Per view, the bytes it uses.
    bytes: [UnsafeCell<u8>; N],
    /// Views alive (made and not yet dropped).
    alive: AtomicUsize,
    /// Parties that took the block back.
    taken: AtomicUsize,
}

// SAFETY: as `DeviceArena`'s: `block` stands for the count of an `Arc<ArenaBlock>`, whose
// fields are `Send` and `Sync` (a block, and atomics); it stays alive until `Model::finish`,
// after every thread has joined. The rest are loom cells and atomics, whose accesses loom checks.
unsafe impl<const N: usize> Send for Model<N> {}
// SAFETY: as above.
unsafe impl<const N: usize> Sync for Model<N> {}

impl<const N: usize> Model<N> {
    /// A plan's block (`ArenaBlock::new`), with no view yet.
    fn new() -> Model<N> {
        let backend: StdArc<dyn Backend> = StdArc::new(CpuBackend::default());
        let block = Block::alloc(&backend, Device::Cpu, N * VIEW_BYTES, false).unwrap();
        Model {
            block: ArenaBlock::new(block, 0),
            bytes: std::array::from_fn(|_| UnsafeCell::new(0)),
            alive: AtomicUsize::new(0),
            taken: AtomicUsize::new(0),
        }
    }

    fn counts(&self) -> &ArenaBlock {
        // SAFETY: the block is alive until `finish`.
        unsafe { self.block.as_ref() }
    }

    /// `Plan::view` (owner): view `i` of the block, counted in `local`.
    fn make_view(&self, i: usize) -> Block {
        let counts = self.counts();
        let owner: *const dyn Backend = self.block.as_ptr().cast_const();
        // SAFETY: as in `Plan::view`: the range is inside the block (`N` views of
        // `VIEW_BYTES`), `owner` is the block's `Arc::into_raw` pointer, and the block stays
        // alive, unmoved and untouched through `&mut` while the view lives (until `finish`).
        let view = unsafe { counts.block.view(owner, i * VIEW_BYTES, VIEW_BYTES) }.unwrap();
        counts.count_view();
        self.alive.fetch_add(1, Relaxed);
        view
    }

    /// The array of view `i` uses its bytes, then drops.
    fn use_and_drop(&self, i: usize) {
        // SAFETY: the cell stands for view `i`'s bytes; loom checks that no other access to
        // it is unordered with this one.
        self.bytes[i].with_mut(|b| unsafe { *b += 1 });
        self.alive.fetch_sub(1, Relaxed);
    }

    /// `CacheState::drop_view` on the owner thread, lock held.
    fn drop_on_owner(&self, i: usize, view: Block) {
        self.use_and_drop(i);
        let counts = self.counts();
        if !counts.is_retired() {
            counts.uncount_view();
            // SAFETY: made by `Block::view`, and its block is alive.
            unsafe { view.drop_view() };
            return;
        }
        // SAFETY: as above.
        unsafe { view.drop_view() };
        if counts.release_view() {
            self.take_back();
        }
    }

    /// `CacheCell::view_dropped` on another thread.
    fn drop_on_other(&self, i: usize, view: Block) {
        self.use_and_drop(i);
        // SAFETY: made by `Block::view`, and its block is alive.
        unsafe { view.drop_view() };
        let counts = self.counts();
        if counts.release_view() {
            self.take_back();
        }
    }

    /// `DeviceArena::detach` (owner, lock held): takes the block out of its plan; returns
    /// whether it was retired (else taken back at once).
    fn detach(&self) -> bool {
        let counts = self.counts();
        if counts.views() > 0 && counts.retire() {
            return true;
        }
        self.take_back();
        false
    }

    /// `DeviceArena::detach_with_room` (owner, lock held): as [`Model::detach`], retiring the
    /// block with the owner's hold on it ([`ArenaBlock::retire_held`]). Returns whether it is
    /// held (retired with views alive), else taken back at once.
    fn detach_held(&self) -> bool {
        let counts = self.counts();
        if counts.views() > 0 && counts.retire_held() {
            return true;
        }
        self.take_back();
        false
    }

    /// `CacheState::room_view` (owner, lock held, the block held): view `i` of a room's free
    /// bytes, counted in `shared` ([`ArenaBlock::count_held_view`]).
    fn make_held_view(&self, i: usize) -> Block {
        let counts = self.counts();
        let owner: *const dyn Backend = self.block.as_ptr().cast_const();
        // SAFETY: as in `make_view`; the hold keeps the block alive.
        let view = unsafe { counts.block.view(owner, i * VIEW_BYTES, VIEW_BYTES) }.unwrap();
        counts.count_held_view();
        self.alive.fetch_add(1, Relaxed);
        view
    }

    /// `CacheState::drop_view` of a view of a held block on the owner thread: counted down
    /// (never the last count: the hold is one), then, when only the hold is left, the owner lets
    /// go of it ([`Model::let_go`]). Returns whether it let go.
    fn drop_held_on_owner(&self, i: usize, view: Block) -> bool {
        self.use_and_drop(i);
        // SAFETY: made by `Block::view`, and its block is alive (held).
        unsafe { view.drop_view() };
        let counts = self.counts();
        assert!(!counts.release_view(), "a held block's view took it back");
        counts.only_held() && self.let_go()
    }

    /// `CacheState::let_go_room` (owner, lock held): the hold counted down, the block taken
    /// back if it was the last count. Returns whether it was.
    fn let_go(&self) -> bool {
        if self.counts().release_view() {
            self.take_back();
            return true;
        }
        false
    }

    /// `Plan::settle_remote_drops`, `DeviceArena::settle_slabs` (owner, lock held, the block
    /// not retired): when no view is alive, every position (or slot) is free again, and its
    /// bytes serve the next arrays (written here). Returns whether it settled.
    fn settle(&self) -> bool {
        let counts = self.counts();
        assert!(!counts.is_retired(), "a block settled is the cache's");
        if counts.views() != 0 {
            return false;
        }
        self.reuse_bytes("settled");
        true
    }

    /// Every view of the block is gone (`what` says how the caller learned it): its bytes are
    /// the caller's to hand out again, and are written here; loom checks that every view's use
    /// is ordered before.
    fn reuse_bytes(&self, what: &str) {
        assert_eq!(self.alive.load(Relaxed), 0, "{what} with a view alive");
        for bytes in &self.bytes {
            // SAFETY: the cell stands for the block's bytes, the caller's now; loom checks
            // that no access to it is unordered with this one.
            bytes.with_mut(|b| unsafe { *b = 0 });
        }
    }

    /// What the party whose count said "no view left" does: takes the block back (counted
    /// here; see `finish`) and reuses its bytes.
    fn take_back(&self) {
        assert_eq!(self.taken.fetch_add(1, Relaxed), 0, "taken back twice");
        self.reuse_bytes("taken back");
    }

    /// After every thread has joined: the block was taken back once, and goes back.
    fn finish(self) {
        assert_eq!(self.alive.load(Relaxed), 0);
        assert_eq!(self.taken.load(Relaxed), 1, "never taken back");
        // SAFETY: made by `ArenaBlock::new`; no view is alive (all dropped, checked above), and
        // the pointer is not used again.
        drop(unsafe { ArenaBlock::into_block(self.block) });
    }
}

impl Model<1> {
    /// A solo block (`ArenaBlock::new_solo`: retired from the start, its one view counted in
    /// `shared`) and that view, made as `CacheState::solo_view` makes it.
    fn solo() -> (Arc<Model<1>>, Block) {
        let backend: StdArc<dyn Backend> = StdArc::new(CpuBackend::default());
        let block = Block::alloc(&backend, Device::Cpu, VIEW_BYTES, false).unwrap();
        let m = Arc::new(Model::<1> {
            block: ArenaBlock::new_solo(block, 0),
            bytes: [UnsafeCell::new(0)],
            alive: AtomicUsize::new(0),
            taken: AtomicUsize::new(0),
        });
        let owner: *const dyn Backend = m.block.as_ptr().cast_const();
        // SAFETY: as in `Model::make_view`.
        let view = unsafe { m.counts().block.view(owner, 0, VIEW_BYTES) }.unwrap();
        m.alive.fetch_add(1, Relaxed);
        (m, view)
    }
}

/// Three views: one dropped on the owner before the block is retired, one on another thread
/// at any time, one on the owner after retirement. The taker is the owner's `detach`, its last
/// drop, or the other thread.
#[test]
fn loom_block_retired_with_views_on_both_threads() {
    model("block_retired_with_views_on_both_threads", || {
        let m = Arc::new(Model::<3>::new());
        let (a, b, c) = (m.make_view(0), m.make_view(1), m.make_view(2));
        let other = Arc::clone(&m);
        let t = thread::spawn(move || other.drop_on_other(1, b));
        m.drop_on_owner(0, a);
        m.detach();
        m.drop_on_owner(2, c);
        t.join().unwrap();
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// A view made while another thread drops an older one, both of the owner's views dropped
/// before `detach`: the block is freed at once if the other thread's drop was seen (`views()`
/// is 0), else retired with its count at 0 or 1, and taken back by whichever drop ends it.
#[test]
fn loom_block_detached_after_owner_drops() {
    model("block_detached_after_owner_drops", || {
        let m = Arc::new(Model::<3>::new());
        let (a, b) = (m.make_view(0), m.make_view(1));
        let other = Arc::clone(&m);
        let t = thread::spawn(move || other.drop_on_other(1, b));
        let c = m.make_view(2);
        m.drop_on_owner(0, a);
        m.drop_on_owner(2, c);
        m.detach();
        t.join().unwrap();
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// The block retired first, then its views dropped on both threads at once: the last
/// `fetch_sub`, on either thread, takes it back.
#[test]
fn loom_block_views_dropped_after_retirement() {
    model("block_views_dropped_after_retirement", || {
        let m = Arc::new(Model::<3>::new());
        let (a, b, c) = (m.make_view(0), m.make_view(1), m.make_view(2));
        assert!(m.detach(), "retired: views are alive");
        let other = Arc::clone(&m);
        let t = thread::spawn(move || {
            other.drop_on_other(1, b);
            other.drop_on_other(2, c);
        });
        m.drop_on_owner(0, a);
        t.join().unwrap();
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// Views dropped on two other threads while the owner retires the block and drops its own
/// view: any of the three may be the last.
#[test]
fn loom_block_retired_while_two_threads_drop() {
    model("block_retired_while_two_threads_drop", || {
        let m = Arc::new(Model::<3>::new());
        let (a, b, c) = (m.make_view(0), m.make_view(1), m.make_view(2));
        let others: Vec<_> = [(1, b), (2, c)]
            .into_iter()
            .map(|(i, view)| {
                let other = Arc::clone(&m);
                thread::spawn(move || other.drop_on_other(i, view))
            })
            .collect();
        m.detach();
        m.drop_on_owner(0, a);
        for t in others {
            t.join().unwrap();
        }
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// A solo block (`ArenaBlock::new_solo`: retired from the start, its one view counted in
/// `shared`) whose view drops on another thread while the owner does nothing with it.
#[test]
fn loom_solo_block_taken_back_once() {
    model("solo_block_taken_back_once", || {
        let (m, view) = Model::solo();
        let other = Arc::clone(&m);
        let t = thread::spawn(move || other.drop_on_other(0, view));
        t.join().unwrap();
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// A solo block whose array drops on the owner: the block is the owner's again with the view
/// kept, idle (a spare held with its view), and serves a second array through that view
/// (`ArenaBlock::reissue_solo`), which is sent to another thread and dropped there: that drop,
/// and only it, takes the block back again, after both arrays' uses.
#[test]
fn loom_solo_block_reissued_through_its_kept_view() {
    model("solo_block_reissued_through_its_kept_view", || {
        let (m, view) = Model::solo();
        let counts = m.counts();
        // `CacheState::drop_view` of a solo view on the owner, kept: the count, then the block.
        m.use_and_drop(0);
        assert!(counts.release_view(), "a solo block's one view is its last");
        m.take_back();
        // Kept as a spare, then reissued: the block's again, so a second taking is due.
        m.taken.store(0, Relaxed);
        counts.reissue_solo();
        m.alive.fetch_add(1, Relaxed);
        let other = Arc::clone(&m);
        let t = thread::spawn(move || other.drop_on_other(0, view));
        t.join().unwrap();
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// A slab's step end (or a plan's) while another thread drops a view of it: the owner's view
/// dropped, `settle` frees every slot if it sees the other drop, else a later one does (after
/// the join, as a later step's end would); the slot of the array dropped elsewhere then serves
/// a new array, and the block, still the cache's, is taken back at once when detached.
#[test]
fn loom_block_settled_when_remote_drops_are_seen() {
    model("block_settled_when_remote_drops_are_seen", || {
        let m = Arc::new(Model::<2>::new());
        let (a, b) = (m.make_view(0), m.make_view(1));
        let other = Arc::clone(&m);
        let t = thread::spawn(move || other.drop_on_other(1, b));
        m.drop_on_owner(0, a);
        // Frees every slot if the other drop is seen (its use ordered before, loom checks).
        m.settle();
        t.join().unwrap();
        assert!(m.settle(), "no view alive after the join");
        let c = m.make_view(1);
        m.drop_on_owner(1, c);
        assert!(!m.detach(), "no view alive: taken back at once");
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// A settle while the owner still holds a view and another thread drops one: nothing is freed
/// (the owner's array holds its slot, whatever the other thread did); once the owner's array
/// drops too, a later settle frees every slot, after both uses.
#[test]
fn loom_block_not_settled_while_a_view_lives() {
    model("block_not_settled_while_a_view_lives", || {
        let m = Arc::new(Model::<2>::new());
        let (a, b) = (m.make_view(0), m.make_view(1));
        let other = Arc::clone(&m);
        let t = thread::spawn(move || other.drop_on_other(1, b));
        assert!(!m.settle(), "settled under the owner's view");
        m.drop_on_owner(0, a);
        let early = m.settle();
        t.join().unwrap();
        assert!(early || m.settle(), "no view alive after the join");
        assert!(!m.detach(), "no view alive: taken back at once");
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// A plan's block retired with the owner's hold (a room) while another thread drops one of its
/// arrays: the other thread never takes it back (the hold is counted); a room's array made and
/// dropped on the owner, and the owner's last array dropped, leave only the hold, and the owner
/// lets go of it and takes the block back, after every use.
#[test]
fn loom_room_held_while_another_thread_drops() {
    model("room_held_while_another_thread_drops", || {
        let m = Arc::new(Model::<3>::new());
        let (a, b) = (m.make_view(0), m.make_view(1));
        let other = Arc::clone(&m);
        let t = thread::spawn(move || other.drop_on_other(1, b));
        assert!(m.detach_held(), "held: the owner's view is alive");
        let c = m.make_held_view(2);
        assert!(
            !m.drop_held_on_owner(2, c),
            "let go under the owner's array"
        );
        let let_go = m.drop_held_on_owner(0, a);
        t.join().unwrap();
        // At the step's end: only the hold is left.
        assert!(
            let_go || m.counts().only_held() && m.let_go(),
            "the hold was kept"
        );
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

/// A held block whose arrays all drop on other threads: none of them takes it back; the owner,
/// at a step's end, lets go once it sees only the hold (before the joins or after), and the
/// taking is ordered after both uses.
#[test]
fn loom_room_let_go_after_remote_drops() {
    model("room_let_go_after_remote_drops", || {
        let m = Arc::new(Model::<2>::new());
        let (a, b) = (m.make_view(0), m.make_view(1));
        assert!(m.detach_held(), "held: views are alive");
        let others: Vec<_> = [(0, a), (1, b)]
            .into_iter()
            .map(|(i, view)| {
                let other = Arc::clone(&m);
                thread::spawn(move || other.drop_on_other(i, view))
            })
            .collect();
        let early = m.counts().only_held() && m.let_go();
        for t in others {
            t.join().unwrap();
        }
        assert!(
            early || m.counts().only_held() && m.let_go(),
            "the hold was kept"
        );
        Arc::try_unwrap(m).ok().unwrap().finish();
    });
}

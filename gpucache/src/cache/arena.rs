//! Arena caches ([`KeyPolicy::Arena`](crate::KeyPolicy::Arena)): every array of a scope is
//! bump-allocated from one block per device, and all of them become free together when the
//! scope's outermost entry exits.
//!
//! # Blocks and their arrays
//!
//! An [`ArenaBlock`] is a heap object holding one device allocation. Arrays get *views* of it
//! ([`Block::view`]) whose [`Home`](super::Home) names the arena (`slot` [`ARENA`]); the view
//! points at the block, so a view never outlives it (see below). A block is either the cache's
//! (the block bumped from, the *extra* blocks of a step that overflowed, or a spare) or, once a
//! scope exited while arrays of it were alive, *retired*: owned by those arrays, and handed back
//! by the last of them to drop.
//!
//! Views are counted with a biased count, so that a bump and a drop on the owner thread touch no
//! atomic read-modify-write: `local` (views made minus views dropped on the owner thread) is
//! written only by the holder of the cache's lock, and `shared` counts the drops on other threads
//! (down from 0). Retiring the block adds `local` into `shared`; from then on every drop
//! decrements `shared`, and the one that takes it to zero owns the block again: on the owner
//! thread it goes back to the cache at once, on another thread through the cache's return queue
//! (or to the device once the cache is closed), like any returned buffer. A retired block counts
//! as one buffer in the cell's `live`, which keeps the cell alive for it.
//!
//! # Stats
//!
//! A bump is a hit, and a bump that needs a new block a miss (the block is one device
//! allocation). The bytes of a block not yet bumped from, and whole blocks that no array uses
//! (spares, and the block between steps), count as cached; the rest as in use.

use std::mem;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering::*};

use super::lists::Inner;
use super::{CacheCell, Home, Request};
use crate::backend::Block;
use crate::stats::{Counters, add, sub};
use crate::{Device, Result};

/// The `slot` of the [`Home`] of every arena array.
pub(super) const ARENA: u32 = u32::MAX;

/// Arrays start at multiples of this many bytes in their block (as `cudaMalloc` aligns).
pub(crate) const ALIGN: usize = 256;

/// `bytes` rounded up to [`ALIGN`] (`None` past the largest size).
#[inline]
fn aligned(bytes: usize) -> Option<usize> {
    bytes.checked_next_multiple_of(ALIGN)
}

/// One block of an arena cache and the count of arrays bumped from it.
///
/// `block` is first, and the struct `repr(C)`, so that the views' parent pointer (made from a
/// pointer to the whole `ArenaBlock`) leads back to it.
#[repr(C)]
pub(super) struct ArenaBlock {
    block: Block,
    /// Views made minus views dropped on the owner thread, until retired (lock holder only).
    local: AtomicUsize,
    /// Until retired: minus the views dropped on other threads. After: the views alive.
    shared: AtomicIsize,
    /// Set by the lock holder when the block is retired.
    retired: AtomicBool,
    /// The cache's generation when the block was made.
    generation: u32,
}

/// A pointer to an [`ArenaBlock`] on the heap (made by [`ArenaBlock::new`], freed by
/// [`ArenaBlock::into_block`]).
type BlockPtr = NonNull<ArenaBlock>;

impl ArenaBlock {
    fn new(block: Block, generation: u32) -> BlockPtr {
        let boxed = Box::new(ArenaBlock {
            block,
            local: AtomicUsize::new(0),
            shared: AtomicIsize::new(0),
            retired: AtomicBool::new(false),
            generation,
        });
        NonNull::from(Box::leak(boxed))
    }

    /// The arena block a view of it points at.
    ///
    /// # Safety
    /// `view` was made from an [`ArenaBlock`] by [`bump`](Inner::bump) and is still alive.
    unsafe fn of_view(view: &Block) -> Option<BlockPtr> {
        // `block` is the first field of the `repr(C)` `ArenaBlock` the pointer was made from,
        // with that allocation's provenance.
        Some(view.parent_ptr()?.cast::<ArenaBlock>())
    }

    /// Takes the block back from the heap, ending the use of the views (their streams' events
    /// are recorded on device memory).
    ///
    /// # Safety
    /// `this` came from [`ArenaBlock::new`], no view of it is alive, and it is not used again.
    unsafe fn into_block(this: BlockPtr) -> Block {
        // SAFETY: made by `Box::leak` in `new`; the caller gives up the pointer.
        let arena = unsafe { Box::from_raw(this.as_ptr()) };
        let mut block = arena.block;
        block.end_use();
        block
    }

    /// The views alive (lock holder, before retirement).
    fn views(&self) -> isize {
        self.local.load(Relaxed) as isize + self.shared.load(Acquire)
    }
}

/// A block of the current step and the bytes bumped from it.
struct Used {
    arena: BlockPtr,
    top: usize,
}

// SAFETY: a `Used` is part of a cache's state, reached only by the holder of its lock (on any
// thread); it stands for the cache's ownership of a heap `ArenaBlock`, whose fields are `Send`
// and `Sync` (a block, and atomics).
unsafe impl Send for Used {}

/// The arena of one device.
pub(super) struct DeviceArena {
    pub(super) device: Device,
    pub(super) gauge: u8,
    /// The block bumped from; `None` until the first bump of a step finds one.
    current: Option<Used>,
    /// Earlier blocks of this step (it overflowed them).
    extra: Vec<Used>,
    /// Whether `current` has not been bumped from since it became current.
    fresh: bool,
    /// Bytes bumped in this step.
    step: usize,
    /// The size of the next block: the most bytes a step has bumped.
    want: usize,
    /// Blocks no array uses, oldest first (a device may still be using those waiting for
    /// events on other streams).
    spares: Vec<Block>,
}

impl DeviceArena {
    fn new(device: Device, gauge: u8) -> DeviceArena {
        DeviceArena {
            device,
            gauge,
            current: None,
            extra: Vec::new(),
            fresh: false,
            step: 0,
            want: 0,
            spares: Vec::new(),
        }
    }
}

/// What the arena's slow path asks the caller to do.
pub(super) enum Grow {
    /// Allocate a block of this many bytes and pass it to [`CacheCell::adopt`].
    Alloc(usize),
    /// The cache tracks its most devices: allocate without it.
    Bypass,
}

impl Inner {
    /// The arena of `device`, if it has one.
    #[inline]
    fn arena(&mut self, device: Device) -> Option<&mut DeviceArena> {
        self.arenas.iter_mut().find(|a| a.device == device)
    }

    /// The hit path of an arena cache: a view of the current block, if `req` fits in it.
    #[inline]
    pub(super) fn bump(&mut self, st: &Counters, req: &Request<'_>) -> Option<Result<Block>> {
        let a = self.arena(req.device)?;
        let size = aligned(req.bytes)?;
        let used = a.current.as_mut()?;
        // SAFETY: the current block is the cache's, alive until the lock holder frees it.
        let cap = unsafe { used.arena.as_ref() }.block.bytes();
        if cap - used.top < size {
            return None;
        }
        if mem::take(&mut a.fresh) {
            // SAFETY: no view of a fresh block is alive, and the lock holder is the only thread
            // that can reach it: this `&mut` is unique.
            let block = unsafe { &mut used.arena.as_mut().block };
            if let Err(e) = block.prepare_reuse() {
                a.fresh = true;
                return Some(Err(e));
            }
        }
        let offset = used.top;
        let arena = used.arena;
        // SAFETY: `offset + req.bytes <= cap`, a block is never a view, and the block stays
        // alive, unmoved and shared while views of it live: it is freed only once no view is
        // alive (`views() == 0` before retirement, `shared` reaching 0 after).
        let view = unsafe { Block::view(arena.cast::<Block>(), offset, req.bytes) };
        let view = match view {
            Ok(view) => view,
            Err(e) => return Some(Err(e)),
        };
        used.top += size;
        a.step += size;
        // SAFETY: as above; `local` is the lock holder's.
        let counts = unsafe { arena.as_ref() };
        counts.local.store(counts.local.load(Relaxed) + 1, Relaxed);
        add(&st.hits, 1);
        sub(&st.gauge(a.gauge).cached, size);
        Some(Ok(view))
    }

    /// After [`Inner::bump`] found no room: makes an idle spare big enough current and bumps
    /// from it, or says how big a new block must be.
    pub(super) fn bump_slow(
        &mut self,
        st: &Counters,
        req: &Request<'_>,
    ) -> std::result::Result<Result<Block>, Grow> {
        let Some(size) = aligned(req.bytes) else {
            // No block can hold it; the device will say so.
            return Err(Grow::Alloc(req.bytes));
        };
        if self.arena(req.device).is_none() {
            let gauge = st.gauge_for(req.device).ok_or(Grow::Bypass)?;
            self.arenas.push(DeviceArena::new(req.device, gauge));
        }
        let generation = self.generation;
        let a = self.arena(req.device).ok_or(Grow::Bypass)?;
        let need = size.max(if a.current.is_some() { 0 } else { a.want });
        let spare = a
            .spares
            .iter()
            .position(|b| b.bytes() >= need && b.is_idle());
        match spare {
            Some(i) => {
                let block = a.spares.remove(i);
                a.install(block, generation);
                self.bump(st, req).ok_or(Grow::Alloc(need))
            }
            None => {
                // A step that outgrows its block continues in one twice as large (the step's
                // blocks are replaced by one sized to it when it ends).
                let cap = a.current.as_ref().map_or(0, |u| {
                    // SAFETY: the current block is the cache's.
                    unsafe { u.arena.as_ref() }.block.bytes()
                });
                let grown = cap.saturating_mul(2).min(crate::shape::MAX_BYTES);
                Err(Grow::Alloc(need.max(grown).max(a.want)))
            }
        }
    }

    /// Makes a freshly allocated `block` current and bumps `req` from it (a miss).
    /// `Err(block)` when the cache cannot track the device (the caller uses the block alone).
    pub(super) fn adopt_block(
        &mut self,
        st: &Counters,
        req: &Request<'_>,
        block: Block,
    ) -> std::result::Result<Result<Block>, Block> {
        let generation = self.generation;
        if self.arena(req.device).is_none() {
            let Some(gauge) = st.gauge_for(req.device) else {
                return Err(block);
            };
            self.arenas.push(DeviceArena::new(req.device, gauge));
        }
        let Some(a) = self.arena(req.device) else {
            return Err(block);
        };
        st.allocated(a.gauge, block.bytes());
        add(&st.gauge(a.gauge).cached, block.bytes());
        a.install(block, generation);
        // The block holds at least the request (the caller allocated what `bump_slow` said).
        let got = self.bump(st, req).unwrap_or_else(|| {
            Err(crate::Error::ShapeOverflow {
                dims: req.dims.to_vec(),
                dtype: Some(req.dtype),
            })
        });
        if got.is_ok() {
            // The bump counted a hit; it was a miss.
            sub(&st.hits, 1);
            add(&st.misses, 1);
        }
        Ok(got)
    }

    /// The outermost scope exited: resets the blocks no array uses, retires the others, and
    /// after an overflow keeps one block sized to the step.
    pub(super) fn end_step(&mut self, st: &Counters) {
        let generation = self.generation;
        let cap = self.config.max_cached_bytes;
        let mut retired = 0;
        for a in &mut self.arenas {
            if a.current.is_none() && a.extra.is_empty() {
                continue;
            }
            let overflowed = !a.extra.is_empty();
            a.want = a.want.max(a.step);
            a.step = 0;
            if !overflowed && a.reset_current(st) {
                continue;
            }
            let mut keep = None;
            let used: Vec<Used> = a.extra.drain(..).chain(a.current.take()).collect();
            for u in used.into_iter().rev() {
                match a.finish(st, u) {
                    Finished::Retired => retired += 1,
                    Finished::Free(block) => {
                        // After an overflow only a block close to the step's size stays (the
                        // doubled extra blocks are given back).
                        let fits = block.bytes() >= a.want
                            && (!overflowed || block.bytes() - a.want <= a.want / 8);
                        if keep.is_none() && fits && block.is_idle() {
                            keep = Some(block);
                        } else if fits && !overflowed {
                            a.spares.push(block);
                        } else {
                            sub(&st.gauge(a.gauge).cached, block.bytes());
                            st.freed(a.gauge, block.bytes());
                        }
                    }
                }
            }
            if let Some(block) = keep {
                a.install(block, generation);
            }
        }
        self.live += retired;
        self.evict_spares(st, cap);
    }

    /// Frees what the arenas hold (on `device`, or all) that no array uses: spares and, with
    /// `busy` (no scope active, or out-of-memory recovery), the step's blocks whose arrays have
    /// all dropped. With `retire`, blocks that arrays still use are retired (invalidation).
    pub(super) fn release_arenas(
        &mut self,
        st: &Counters,
        device: Option<Device>,
        busy: bool,
        retire: bool,
    ) {
        let mut retired = 0;
        for a in &mut self.arenas {
            if device.is_some_and(|d| d != a.device) {
                continue;
            }
            for block in a.spares.drain(..) {
                sub(&st.gauge(a.gauge).cached, block.bytes());
                st.freed(a.gauge, block.bytes());
            }
            if !busy {
                continue;
            }
            let current = a.current.take();
            let used: Vec<(Used, bool)> = mem::take(&mut a.extra)
                .into_iter()
                .map(|u| (u, false))
                .chain(current.map(|u| (u, true)))
                .collect();
            for (u, is_current) in used {
                // SAFETY: the step's blocks are the cache's.
                let views = unsafe { u.arena.as_ref() }.views();
                if views > 0 && !retire {
                    // Its arrays are alive: it stays where it was.
                    if is_current {
                        a.current = Some(u);
                    } else {
                        a.extra.push(u);
                    }
                    continue;
                }
                match a.finish(st, u) {
                    Finished::Retired => retired += 1,
                    Finished::Free(block) => {
                        sub(&st.gauge(a.gauge).cached, block.bytes());
                        st.freed(a.gauge, block.bytes());
                    }
                }
            }
        }
        self.live += retired;
    }

    /// Takes back a retired block whose last array dropped: a spare, within the byte cap, if it
    /// is of this generation and large enough; else freed.
    pub(super) fn take_back(&mut self, st: &Counters, block: Block, generation: u32) {
        self.live -= 1;
        let current = self.generation;
        let cap = self.config.max_cached_bytes;
        let device = block.device();
        let keep = generation == current
            && matches!(self.config.key, crate::KeyPolicy::Arena)
            && self.arena(device).is_some_and(|a| block.bytes() >= a.want);
        match self.arena(device) {
            Some(a) if keep => {
                add(&st.gauge(a.gauge).cached, block.bytes());
                a.spares.push(block);
                self.evict_spares(st, cap);
            }
            _ => {
                // Every retired block was made in an arena, so its device has a gauge.
                if let Some(g) = st.find_gauge(device) {
                    st.freed(g, block.bytes());
                }
            }
        }
    }

    /// Frees the oldest spare blocks until the spares fit in `cap`.
    pub(super) fn evict_spares(&mut self, st: &Counters, cap: Option<usize>) {
        let Some(cap) = cap else {
            return;
        };
        let mut spare: usize = self
            .arenas
            .iter()
            .flat_map(|a| &a.spares)
            .map(Block::bytes)
            .sum();
        for a in &mut self.arenas {
            while spare > cap && !a.spares.is_empty() {
                let block = a.spares.remove(0);
                spare -= block.bytes();
                sub(&st.gauge(a.gauge).cached, block.bytes());
                add(&st.evictions, 1);
                st.freed(a.gauge, block.bytes());
            }
        }
    }

    /// Takes back a view of an arena block on the owner thread (lock holder).
    pub(super) fn drop_view(&mut self, st: &Counters, arena: BlockPtr) {
        // SAFETY: a view of the block was alive until now, so the block is.
        let counts = unsafe { arena.as_ref() };
        if !counts.retired.load(Relaxed) {
            counts.local.store(counts.local.load(Relaxed) - 1, Relaxed);
        } else if counts.shared.fetch_sub(1, AcqRel) == 1 {
            let generation = counts.generation;
            // SAFETY: the last view is gone; nothing else points at a retired block.
            let block = unsafe { ArenaBlock::into_block(arena) };
            self.take_back(st, block, generation);
        }
    }
}

/// What became of a block at the end of a step.
enum Finished {
    /// Arrays of it are alive: they own it now.
    Retired,
    /// No array uses it; still counted in the gauges as the cache's, fully cached.
    Free(Block),
}

impl DeviceArena {
    /// Makes `block` the current block, empty.
    fn install(&mut self, block: Block, generation: u32) {
        if let Some(old) = self.current.take() {
            self.extra.push(old);
        }
        self.current = Some(Used {
            arena: ArenaBlock::new(block, generation),
            top: 0,
        });
        self.fresh = true;
    }

    /// Makes the current block empty again if no array of it is alive and no device work on
    /// another stream may still use it (the usual end of a step); says whether it did.
    fn reset_current(&mut self, st: &Counters) -> bool {
        let Some(u) = &mut self.current else {
            return false;
        };
        // SAFETY: the current block is the cache's.
        if unsafe { u.arena.as_ref() }.views() != 0 {
            return false;
        }
        // SAFETY: no view is alive (counted zero, synchronised with the drops by `Acquire`) and
        // the lock holder is the only thread that reaches the block: this `&mut` is unique.
        let arena = unsafe { u.arena.as_mut() };
        arena.block.end_use();
        if !arena.block.is_idle() {
            return false;
        }
        *arena.local.get_mut() = 0;
        *arena.shared.get_mut() = 0;
        add(&st.gauge(self.gauge).cached, u.top);
        u.top = 0;
        self.fresh = true;
        true
    }

    /// Ends `u`'s part in the step: retired if arrays of it are alive, else reset.
    fn finish(&mut self, st: &Counters, u: Used) -> Finished {
        // SAFETY: the step's blocks are the cache's.
        let counts = unsafe { u.arena.as_ref() };
        let cap = counts.block.bytes();
        let views = counts.views();
        if views > 0 {
            // The rest of the block is not bumped from again: in use until it comes back.
            sub(&st.gauge(self.gauge).cached, cap - u.top);
            counts.retired.store(true, Relaxed);
            let local = counts.local.swap(0, Relaxed) as isize;
            if counts.shared.fetch_add(local, AcqRel) + local > 0 {
                return Finished::Retired;
            }
            // Every array dropped meanwhile on another thread: it is ours again.
            add(&st.gauge(self.gauge).cached, cap);
        } else {
            add(&st.gauge(self.gauge).cached, u.top);
        }
        // SAFETY: no view is alive (counted zero, synchronised with the drops by `Acquire`).
        Finished::Free(unsafe { ArenaBlock::into_block(u.arena) })
    }
}

impl CacheCell {
    /// Returns a view of an arena block from any thread. On the owner thread (cell open) it
    /// goes back under the lock; elsewhere only the block's count changes, and the last view of
    /// a retired block sends the block home. Out of line, so that `release` stays small.
    #[inline(never)]
    pub(super) fn release_view(home: Home, view: Block, current: *const CacheCell) {
        // SAFETY: `view` was made by `bump` from an arena block and is alive.
        let Some(arena) = (unsafe { ArenaBlock::of_view(&view) }) else {
            return;
        };
        drop(view);
        // SAFETY: the block is alive while it is current or retired with views (this one was
        // alive until now), and the cell is alive while the block is (see the module docs).
        let cell = unsafe { home.cell.as_ref() };
        if std::ptr::eq(current, cell) && !cell.is_closed() {
            // SAFETY: (see `locked`) the thread's current cache is on its scope stack, so this
            // is the owner thread, inside a scope of the cell.
            let inner = unsafe { cell.locked() };
            inner.drop_view(&cell.stats, arena);
        } else if cell.is_owned_here() && !cell.is_closed() {
            cell.owned(|inner, st| inner.drop_view(st, arena));
        } else {
            // SAFETY: as above.
            let counts = unsafe { arena.as_ref() };
            if counts.shared.fetch_sub(1, AcqRel) == 1 {
                let home = Home {
                    generation: counts.generation,
                    ..home
                };
                // SAFETY: that was the last view of a retired block.
                let block = unsafe { ArenaBlock::into_block(arena) };
                super::remote::release_remote(home, block);
            }
        }
    }
}

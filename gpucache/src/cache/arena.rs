//! Arena caches ([`KeyPolicy::Arena`]): every array of a scope is
//! bump-allocated from one block per device, and all of them become free together when the
//! scope's outermost entry exits.
//!
//! # Off the free-list paths
//!
//! An arena cache sets the [`ARENA`] flag of its cell, so it is never
//! [plain](CacheCell::is_plain): the free-list hit, the release of a dropped array on the owner
//! thread and the scope exit all test that one byte anyway (for closed and traced caches), and
//! send an arena cache to their slow paths, which serve it here: a bump in [`CacheCell::take`],
//! the drop of a view in [`CacheCell::send_view_home`], the end of a step in
//! [`CacheCell::exit_slow`]. Nothing on the paths of other caches tests for arenas or views.
//! The flag stays set while arrays of an arena may be alive (after a change of key policy),
//! so that a view always finds its way back here.
//!
//! # Blocks and their arrays
//!
//! An [`ArenaBlock`] holds one device allocation, in an `Arc` allocation of its own. Arrays get
//! *views* of it ([`Block::view`]) whose [`Home`] names the arena (`slot` [`VIEW_SLOT`]) and whose
//! backend is the arena block: it frees nothing when a view drops, and the view holds no count
//! of its `Arc` (see [`Block::view`]). A block is either the cache's (the block bumped from,
//! the *extra* blocks of a step that overflowed, or a spare) or, once a scope exited while
//! arrays of it were alive, *retired*: owned by those arrays, and handed back by the last of them
//! to drop.
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
//! # Stats and recorded events
//!
//! A bump is a hit, and a bump that needs a new block a miss (the block is one device
//! allocation). The bytes of a block not yet bumped from, and whole blocks that no array uses
//! (spares, and the block between steps), count as cached; the rest as in use. While recording
//! ([`crate::trace`]), a bump is recorded as a hit and a new block as a miss, with the array's
//! bytes and address; the drop of an arena array is not recorded (its bytes come back when the
//! scope exits, which is recorded with the cache's bytes).

pub(super) mod block;

use std::mem;
use std::ptr::NonNull;
use std::sync::atomic::Ordering::*;

use super::counters::{Counters, GaugeIx, add, sub};
use super::state::{CacheState, ConfigSeq};
use super::{ARENA, CacheCell, Got, Home, Request, Take};
use crate::backend::{self, Backend, Block};
use crate::config::{CacheConfig, KeyPolicy};
use crate::trace::record::{self, EventKind, Note};
use crate::{Device, Result};
use block::{ArenaBlock, BlockPtr, DeviceArena, Used, VIEW_SLOT, aligned};

/// What the arena's slow path asks the caller to do.
pub(super) enum Grow {
    /// Allocate a block of this many bytes and pass it to [`CacheCell::adopt`].
    Alloc(usize),
    /// The cache tracks its most devices: allocate without it.
    Bypass,
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

/// Gives `block`, cached in gauge `g`, back to the device.
fn free_cached(st: &Counters, g: GaugeIx, block: Block) {
    uncached(st, g, block.bytes());
    st.freed(g, block.bytes());
}

impl CacheState {
    /// The hit path of an arena cache: a view of the current block, if `req` fits in it.
    #[inline(always)]
    fn bump(&mut self, st: &Counters, req: &Request<'_>) -> Option<Result<Block>> {
        let a = self.arenas.of(req.device)?;
        let size = aligned(req.bytes)?;
        let used = a.current.as_mut()?;
        // SAFETY: the current block is the cache's, alive until the lock holder frees it.
        let cap = unsafe { used.arena.as_ref() }.block.bytes();
        if cap - used.top < size {
            return None;
        }
        if a.fresh {
            // SAFETY: no view of a fresh block is alive, and we hold the lock.
            let block = unsafe { ArenaBlock::block_mut(used.arena) };
            if let Err(e) = block.prepare_reuse() {
                return Some(Err(e));
            }
            a.fresh = false;
        }
        // SAFETY: as above.
        let arena = unsafe { used.arena.as_ref() };
        let owner: *const dyn Backend = used.arena.as_ptr().cast_const();
        // SAFETY: `top + req.bytes <= cap`, `owner` is the `Arc::into_raw` pointer of the
        // block's `Arc`, whose backend is not counted, and the block stays alive, unmoved and
        // untouched through `&mut` while views of it live: it is reset or freed only once no
        // view is alive (`views() == 0` before retirement, `shared` reaching 0 after).
        let view = match unsafe { arena.block.view(owner, used.top, req.bytes) } {
            Ok(view) => view,
            Err(e) => return Some(Err(e)),
        };
        used.top += size;
        a.step += size;
        arena.local.store(arena.local.load(Relaxed) + 1, Relaxed);
        add(&st.hits, 1);
        uncached(st, a.gauge, size);
        Some(Ok(view))
    }

    /// After [`CacheState::bump`] found no room: makes an idle spare big enough current and bumps
    /// from it, or says how big a new block must be.
    fn bump_slow(
        &mut self,
        st: &Counters,
        req: &Request<'_>,
    ) -> std::result::Result<Result<Block>, Grow> {
        let Some(size) = aligned(req.bytes) else {
            // No block can hold it; the device will say so.
            return Err(Grow::Alloc(req.bytes));
        };
        let generation = self.generation;
        let a = self.arena_for(st, req.device).ok_or(Grow::Bypass)?;
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

    /// The arena of `device`, made if new (`None` when the cache tracks its most devices).
    fn arena_for(&mut self, st: &Counters, device: Device) -> Option<&mut DeviceArena> {
        if self.arenas.of(device).is_none() {
            let gauge = st.gauge_for(device)?;
            self.arenas.devices.push(DeviceArena {
                device,
                gauge,
                current: None,
                extra: Vec::new(),
                fresh: false,
                step: 0,
                want: 0,
                spares: Vec::new(),
            });
        }
        self.arenas.of(device)
    }

    /// Makes a freshly allocated `block` current and bumps `req` from it (a miss).
    /// `Err(block)` when the cache cannot track the device (the caller uses the block alone).
    fn adopt_block(
        &mut self,
        st: &Counters,
        req: &Request<'_>,
        block: Block,
    ) -> std::result::Result<Result<Block>, Block> {
        let generation = self.generation;
        let Some(a) = self.arena_for(st, req.device) else {
            return Err(block);
        };
        st.allocated(a.gauge, block.bytes());
        cached(st, a.gauge, block.bytes());
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
    fn end_step(&mut self, st: &Counters) {
        let generation = self.generation;
        let mut retired = 0;
        for a in &mut self.arenas.devices {
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
            let used: Vec<Used> = mem::take(&mut a.extra)
                .into_iter()
                .chain(a.current.take())
                .collect();
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
                            free_cached(st, a.gauge, block);
                        }
                    }
                }
            }
            if let Some(block) = keep {
                a.install(block, generation);
            }
        }
        self.live += retired;
        self.evict_spares(st, self.config.max_cached_bytes);
    }

    /// Frees what the arenas hold (on `device`, or all) that no array uses: spares and, with
    /// `pending` (no scope active, or out-of-memory recovery), the step's blocks whose arrays
    /// have all dropped. With `retire`, blocks
    /// that arrays still use are retired (invalidation, closing).
    pub(super) fn free_arenas(
        &mut self,
        st: &Counters,
        device: Option<Device>,
        pending: bool,
        retire: bool,
    ) {
        let mut retired = 0;
        for a in &mut self.arenas.devices {
            if device.is_some_and(|d| d != a.device) {
                continue;
            }
            for block in mem::take(&mut a.spares) {
                free_cached(st, a.gauge, block);
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
                let free = views == 0 && pending;
                if !(free || views > 0 && retire) {
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
                    Finished::Free(block) => free_cached(st, a.gauge, block),
                }
            }
        }
        self.live += retired;
    }

    /// Takes back a retired block whose last array dropped: a spare, within the byte cap, if it
    /// is of this generation and large enough; else freed.
    pub(super) fn take_back(&mut self, st: &Counters, block: Block, generation: u32) {
        self.live -= 1;
        let keep = generation == self.generation && self.config.key == KeyPolicy::Arena;
        let cap = self.config.max_cached_bytes;
        match self.arenas.of(block.device()) {
            Some(a) if keep && block.bytes() >= a.want => {
                cached(st, a.gauge, block.bytes());
                a.spares.push(block);
                self.evict_spares(st, cap);
            }
            _ => self.free_arena_block(st, block),
        }
    }

    /// Gives an arena block that is not counted as cached back to the device.
    pub(super) fn free_arena_block(&mut self, st: &Counters, block: Block) {
        // Every arena block was made in an arena, so its device has a gauge.
        if let Some(g) = st.find_gauge(block.device()) {
            st.freed(g, block.bytes());
        }
    }

    /// Frees the oldest spare blocks until the spares fit in `cap`.
    fn evict_spares(&mut self, st: &Counters, cap: Option<usize>) {
        let Some(cap) = cap else {
            return;
        };
        let mut spare: usize = self
            .arenas
            .devices
            .iter()
            .flat_map(|a| &a.spares)
            .map(Block::bytes)
            .sum();
        for a in &mut self.arenas.devices {
            while spare > cap && !a.spares.is_empty() {
                let block = a.spares.remove(0);
                spare -= block.bytes();
                add(&st.evictions, 1);
                free_cached(st, a.gauge, block);
            }
        }
    }

    /// Takes back a view of an arena block on the owner thread (lock holder).
    #[inline]
    fn drop_view(&mut self, st: &Counters, arena: BlockPtr) {
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

    /// Records a bump (`kind` [`EventKind::Hit`]) or a bump from a new block
    /// ([`EventKind::Miss`]) that made `view`.
    #[cold]
    #[inline(never)]
    fn note_bump(&self, st: &Counters, kind: EventKind, view: &Block) {
        let device = view.device();
        let gauge = st.find_gauge(device);
        record::push(Note {
            bytes: view.bytes(),
            buffer: Some(view.id()),
            device: Some(device),
            stream: backend::current_stream_id(device),
            bytes_after: gauge.map(|g| super::traced::gauge_bytes(st, g)),
            ..Note::about(kind, Some(self.trace.id()))
        });
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
        // we hold the lock.
        let block = unsafe { ArenaBlock::block_mut(u.arena) };
        block.end_use();
        if !block.is_idle() {
            return false;
        }
        // SAFETY: as above.
        let counts = unsafe { u.arena.as_ref() };
        counts.local.store(0, Relaxed);
        counts.shared.store(0, Relaxed);
        cached(st, self.gauge, u.top);
        u.top = 0;
        self.fresh = true;
        true
    }

    /// Ends `u`'s part in the step: retired if arrays of it are alive, else reset.
    fn finish(&mut self, st: &Counters, u: Used) -> Finished {
        // SAFETY: the step's blocks are the cache's.
        let counts = unsafe { u.arena.as_ref() };
        let cap = counts.block.bytes();
        if counts.views() > 0 {
            // The rest of the block is not bumped from again: in use until it comes back.
            uncached(st, self.gauge, cap - u.top);
            counts.retired.store(true, Relaxed);
            let local = counts.local.swap(0, Relaxed) as isize;
            if counts.shared.fetch_add(local, AcqRel) + local > 0 {
                return Finished::Retired;
            }
            // Every array dropped meanwhile on another thread: it is ours again.
            cached(st, self.gauge, cap);
        } else {
            cached(st, self.gauge, u.top);
        }
        // SAFETY: no view is alive (counted zero, synchronised with the drops by `Acquire`).
        Finished::Free(unsafe { ArenaBlock::into_block(u.arena) })
    }
}

impl CacheCell {
    /// Applies `config` (lock holder): the arena flag follows the key policy, and stays set
    /// while arrays of an arena may be alive.
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

    /// Sets the [`ARENA`] flag for an arena cache, and clears it once a cache that is no longer
    /// one holds no arena block and no array of it is alive (`live` counts retired arena
    /// blocks, and arrays of free lists: a conservative test).
    fn sync_arena_flag(&self, state: &mut CacheState) {
        let set = self.flags.load(Relaxed) & ARENA != 0;
        if state.config.key == KeyPolicy::Arena {
            if !set {
                self.flags.fetch_or(ARENA, Relaxed);
            }
        } else if set {
            state.free_arenas(&self.stats, None, true, false);
            if state.arenas.is_empty() && state.live == 0 {
                self.flags.fetch_and(!ARENA, Relaxed);
            }
        }
    }

    /// The hit path of an arena cache: a bump from the current block. Call only on this
    /// thread's current (hence active) cache. `None` for any other cache, a recorded or closed
    /// one, and when the block has no room (or preparing it failed): [`CacheCell::take`] then
    /// serves the request (and reports the failure).
    #[inline]
    pub(crate) fn bump(&self, req: &Request<'_>) -> Option<(Block, Home)> {
        if self.flags.load(Relaxed) != ARENA {
            return None;
        }
        debug_assert!(self.is_owned_here() && self.is_active());
        // SAFETY: (see `locked`) the owner thread, inside a scope of the cell.
        let state = unsafe { self.locked() };
        if state.config.key != KeyPolicy::Arena {
            return None;
        }
        let view = state.bump(&self.stats, req)?.ok()?;
        Some((view, self.home(VIEW_SLOT, state.generation)))
    }

    /// [`CacheCell::take`] of a cache with the [`ARENA`] flag: for an arena cache a bump, or
    /// the size of a new block. A cache that is no longer one (its arrays keep the flag set)
    /// first looks up its free list as the hit path does (`None`: go on as for any cache).
    #[inline(never)]
    pub(super) fn take_flagged(&self, state: &mut CacheState, req: &Request<'_>) -> Option<Take> {
        if state.config.key == KeyPolicy::Arena {
            // A bump is the hit path: it takes nothing in, as a free-list hit does not.
            if let Some(got) = state.bump(&self.stats, req) {
                return Some(self.bumped(state, Ok(got)));
            }
            self.drain_returned(state, true);
            state.poll_deferred(&self.stats);
            let got = match state.bump(&self.stats, req) {
                Some(got) => Ok(got),
                None => state.bump_slow(&self.stats, req),
            };
            return Some(self.bumped(state, got));
        }
        if self.traced() {
            return None;
        }
        let slot = state.find(state.key(req))?;
        let block = state.pop(&self.stats, slot)?;
        Some(Take::Hit(block, self.home(slot, state.generation)))
    }

    /// What a bump (or the slow path's) gives the caller.
    #[inline(always)]
    fn bumped(
        &self,
        state: &mut CacheState,
        got: std::result::Result<Result<Block>, Grow>,
    ) -> Take {
        match got {
            Ok(Ok(view)) => {
                if self.traced() {
                    state.note_bump(&self.stats, EventKind::Hit, &view);
                }
                Take::Hit(view, self.home(VIEW_SLOT, state.generation))
            }
            Ok(Err(e)) => Take::Failed(e),
            Err(Grow::Alloc(capacity)) => Take::Miss {
                capacity,
                shared: true,
            },
            Err(Grow::Bypass) => Take::Bypass,
        }
    }

    /// [`CacheCell::adopt`] for an arena cache: `block` becomes the current block.
    pub(super) fn adopt_arena(
        &self,
        state: &mut CacheState,
        req: &Request<'_>,
        block: Block,
    ) -> Result<Got> {
        match state.adopt_block(&self.stats, req, block) {
            Ok(view) => {
                let view = view?;
                if self.traced() {
                    state.note_bump(&self.stats, EventKind::Miss, &view);
                }
                Ok(Got::Recycled(view, self.home(VIEW_SLOT, state.generation)))
            }
            Err(block) => Ok(Got::Fresh(block, None)),
        }
    }

    /// [`CacheCell::exit`] of a cache that is not [plain](CacheCell::is_plain): the outermost
    /// exit of an arena cache ends its step first, and a traced cache records the exit.
    #[cold]
    #[inline(never)]
    pub(crate) fn exit_slow(&self) {
        if self.flags.load(Relaxed) & ARENA != 0 && self.depth.load(Relaxed) == 1 {
            // SAFETY: (see `locked`) the owner thread, inside the outermost scope of the cell.
            let state = unsafe { self.locked() };
            // Retired blocks returned meanwhile first: they may be spares for the next step.
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

    /// Returns a view of an arena block from any thread. On the owner thread (cell open) it
    /// goes back under the lock; elsewhere only the block's count changes, and the last view of
    /// a retired block sends the block home.
    ///
    /// Inlined, so that the view is taken apart in the drop's own frame rather than moved into
    /// another one; the rest is out of line, in [`CacheCell::view_dropped`]. (The `hit_path`
    /// bench and an instruction count of alloc + drop show what such moves cost.)
    #[inline(always)]
    pub(super) fn send_view_home(home: Home, view: Block, current: *const CacheCell) {
        // The view's backend is its arena block (see `CacheState::bump`).
        let Some(arena) = NonNull::new(view.backend_ptr().cast::<ArenaBlock>().cast_mut()) else {
            return;
        };
        #[cfg(feature = "cuda")]
        if view.cuda().is_some() {
            return Self::send_cuda_view_home(home, view, arena, current);
        }
        // SAFETY: `view` was made by `Block::view`.
        unsafe { view.drop_view() };
        Self::view_dropped(home, arena, current);
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
        if let Some(v) = view.cuda_mut() {
            // SAFETY: the block is alive while a view of it is.
            if let Some(parent) = unsafe { arena.as_ref() }.block.cuda() {
                v.hand_marks_to(parent);
            }
        }
        // SAFETY: `view` was made by `Block::view`.
        unsafe { view.drop_view() };
        Self::view_dropped(home, arena, current);
    }

    /// A view of `arena` was dropped: counts it, and the last view of a retired block sends the
    /// block home.
    #[inline(never)]
    fn view_dropped(home: Home, arena: BlockPtr, current: *const CacheCell) {
        // SAFETY: the block is alive while it is current or retired with views (this one was
        // alive until now), and the cell is alive while the block is (see the module docs).
        let cell = unsafe { home.cell.as_ref() };
        if std::ptr::eq(current, cell) && !cell.is_closed() {
            // SAFETY: (see `locked`) the thread's current cache is on its scope stack, so this
            // is the owner thread, inside a scope of the cell.
            let state = unsafe { cell.locked() };
            state.drop_view(&cell.stats, arena);
        } else if cell.is_owned_here() && !cell.is_closed() {
            cell.owned(|state, st| state.drop_view(st, arena));
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
                super::remote::send_home_remote(home, block);
            }
        }
    }
}

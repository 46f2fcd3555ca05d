//! One named cache of one thread: free lists by key, busy accounting, configuration, eviction.
//!
//! This file holds the cell and the hit path; [`key`] the free-list keys and their hash;
//! [`state`] the state behind the lock (key table, free lists, least-recently-freed order,
//! buffers waiting for the scope's exit); [`lock`] the cell's lock and the hints other threads
//! leave with it; [`remote`] what other threads write (returned buffers, requests, the state
//! after the owner exits).
//!
//! # Who touches what
//!
//! A [`CacheCell`] belongs to the thread that created it (its *owner*). Its state ([`CacheState`]: the
//! key map, the free lists, the buffers waiting for the scope to exit) sits behind `lock`, a
//! one-byte lock with a twist: the owner takes it when the cache's outermost scope is entered and
//! keeps it until that scope exits. Inside a scope every allocation and every drop on the owner
//! thread therefore works on `CacheState` directly, with no atomic read-modify-write and nothing
//! another thread contends for. Outside a scope the owner takes the lock for each operation.
//!
//! Other threads touch a cache in three ways only:
//! * Dropping an array whose buffer came from it: the buffer goes into the cache's `remote`
//!   queue (its own mutex, on its own cache lines), and a hint is set in the lock's byte. The
//!   owner takes the queue in when a scope of the cache is entered (those buffers are free for
//!   the step), when it misses (they become free when the scope exits), when a scope exits and
//!   when it reads its stats. The owner's hits never look at the queue.
//! * Giving the queue back to the device ([`CacheCell::free_returned`]: `empty_cache`,
//!   `invalidate` and out-of-memory recovery). The queue is not the scope's state, so any thread
//!   may do this at any time; the bytes it freed are accounted by the next holder of the lock.
//! * Requests (`empty_cache`, `invalidate`, `configure`, out-of-memory recovery): they are left
//!   in the remote state, with a hint in the lock's byte, and served by whichever thread holds
//!   the lock next, at once if it is free (see [`CacheCell::request`]). The lock bit and the
//!   hint are one atomic, so a request is never missed, nobody blocks on a busy cache, and a
//!   scope's entry and exit each cost one compare-exchange.
//!
//! # Lifetime
//!
//! Arrays point at their home cache with a raw pointer ([`Home`]), not an `Arc`, so a hit costs
//! no reference count. The owner's registry keeps the cell alive while the thread lives. When the
//! thread exits it *closes* the cell: free buffers go back to the device, and if arrays from it
//! are still alive elsewhere (`live > 0`) the cell keeps an `Arc` to itself, which the last of
//! those arrays to drop releases (a biased reference count: the owner counts without atomics,
//! other threads count under the `remote` mutex once the cell is closed).
//!
//! Requests that reach a closed cell are dropped unserved (see [`CacheCell::serve_requests`]):
//! the exited thread's row in the registry may already hold the cell's final counters.

mod arena;
#[cfg(test)]
pub(crate) use arena::slab::SLAB_BYTES;
#[cfg(test)]
pub(crate) use arena::{
    MAX_SHELVED_POSITIONS, ONLINE_STEPS, PLANS_MADE, RESTS_KEPT, ROOMS_HELD, SHADOWED_STEPS,
    SHELVED_MOST, SLABS_MADE, SLOW_TAKES, VIEWS_SOUGHT,
};
pub(crate) mod counters;
#[cfg(feature = "tracing")]
mod events;
mod key;
mod lock;
#[cfg(all(test, loom))]
pub(crate) mod loom_tests;
mod remote;
mod state;
mod traced;

use std::mem;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::*};

use crate::backend::Block;
use crate::config::CacheConfig;
use crate::metrics::CacheStats;
// The flags and the state's cell are `crate::sync`'s: loom's under `cfg(loom)`, for the loom
// models of `loom_tests` (`depth`, which only the owner touches, stays std's).
use crate::sync::{AtomicU8, UnsafeCell};
use crate::thread;
use crate::trace::record::{self, EventKind};
use crate::{DType, Device, Shape};
use counters::{Counters, DeviceBytes, add};

use arena::block::is_arena_slot;
use lock::{CellLock, REQUESTED};
pub(crate) use remote::Requests;
use remote::{RemoteSide, send_home_remote};
use state::CacheState;
pub(crate) use state::ConfigSeq;

/// [`CacheCell::flags`]: the owner thread has exited.
const CLOSED: u8 = 1;
/// [`CacheCell::flags`]: events are being recorded.
const TRACED: u8 = 2;
/// [`CacheCell::flags`]: an arena cache, or arrays of its arena may still be alive (see the
/// `arena` module): allocations, drops and exits take the slow paths, which serve arenas.
const ARENA: u8 = 4;
/// [`CacheCell::flags`]: `GPUCACHE_DISABLE` turned caching off for the process (read once, when
/// the cell is made): no hit path serves the cell, so the hit paths need not read the switch.
const DISABLED: u8 = 8;

/// Which hit path may serve a cache ([`CacheCell::hit_path`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum HitPath {
    /// A plain cache: its free lists ([`CacheCell::hit`]).
    FreeList,
    /// A planned cache, not recorded or closed: its plan ([`CacheCell::plan_hit`]).
    Plan,
    /// Recorded, closed, or caching is off: no hit path, the slow path serves it.
    None,
}

/// What an allocation asks for.
pub(crate) struct Request<'a> {
    pub(crate) dtype: DType,
    /// The array's shape: its dimensions are read only where needed ([`Request::dims`]; a plan's
    /// hit never does).
    pub(crate) shape: &'a Shape,
    pub(crate) device: Device,
    /// The array's size in bytes, `> 0`.
    pub(crate) bytes: usize,
}

impl<'a> Request<'a> {
    /// The array's dimensions, outermost first.
    #[inline]
    pub(crate) fn dims(&self) -> &'a [usize] {
        self.shape.dims()
    }
}

/// Where an array's buffer goes back to: its cache, the free list it came from, and the
/// generation of the cache it belongs to.
///
/// Invariant: while a `Home` exists, the block it came with is counted in its cell's `live`
/// (or, once the cell is closed, in `orphans`), so the cell is alive.
///
/// An array of a planned cache has a `slot` at or above `VIEW_BASE` (its position in its step) and
/// the number of that step as `generation`, and its block is a view of an arena block (see the
/// `arena` module).
///
/// Free lists are never removed or renumbered (invalidation empties them), so `slot` always
/// names the free list of this block's key, and a generation that wrapped around could at worst
/// cache a buffer that should have been freed.
#[derive(Debug)]
pub(crate) struct Home {
    cell: NonNull<CacheCell>,
    slot: u32,
    generation: u32,
}

// SAFETY: a `Home` only gives its holder the right to return one block to a `CacheCell`, which is
// `Sync`; `release` checks which thread it runs on and takes the remote path on any but the
// owner. The pointee outlives the `Home` by the invariant above.
unsafe impl Send for Home {}
// SAFETY: `&Home` allows nothing (all use goes through `release`, which takes the `Home` by value).
unsafe impl Sync for Home {}

/// The result of looking for a free buffer on the slow path.
pub(crate) enum Take {
    /// A recycled buffer, now busy.
    Hit(Block, Home),
    /// None free: allocate a buffer of `capacity` bytes as `make` says and
    /// [`CacheCell::adopt`] it. With `view`, the buffer is an arena block that reaches the
    /// array as a view, zeroed (when the array asks) as recycled memory is, not as a whole.
    Miss {
        capacity: usize,
        view: bool,
        make: Make,
    },
    /// The cache cannot take more keys (2^32 of them) or devices: allocate without it.
    Bypass,
    /// Preparing a recycled buffer failed.
    Failed(crate::Error),
}

/// How the device allocation after a [`Take::Miss`] is made.
pub(crate) enum Make {
    /// A buffer of its own.
    Plain,
    /// A planned cache's block: growable in place where the backend can
    /// ([`Block::alloc_growable`]).
    Growable,
    /// A planned cache's block, grown in place from this one (the block the plan last gave up
    /// for a larger one, handed over with it: no longer counted by the cache) when its backend
    /// can; else that block is freed and a new one made as for [`Make::Growable`].
    Grow(Block),
}

/// A buffer a cache hands out.
pub(crate) enum Got {
    /// It held an earlier array's data (a free-list hit, or a view of an arena block): the
    /// array prepares it for reuse on its stream, and zeroes it if asked.
    Recycled(Block, Home),
    /// New from the device, zeroed as the allocation asked; its cache, or `None` when the
    /// cache could not take it.
    Fresh(Block, Option<Home>),
}

/// One named cache of one thread.
pub(crate) struct CacheCell {
    thread_name: Box<str>,
    owner: thread::ThreadToken,
    /// The lock, and the hints other threads leave for its holder (see [`lock`]).
    lock: CellLock,
    /// Active scope entries; written and read by the owner only.
    depth: AtomicU32,
    /// [`CLOSED`]: set by the owner when its thread exits. [`TRACED`]: events of the cache are
    /// being recorded (set by `trace::start` and `trace::stop`, from any thread). [`ARENA`]:
    /// set by the owner (see the `arena` module). One byte, so that the hot paths, which must
    /// test `CLOSED` anyway, send a traced or arena cache to the slow path with the same test
    /// ([`CacheCell::is_plain`]).
    flags: AtomicU8,
    state: UnsafeCell<CacheState>,
    stats: Counters,
    remote: RemoteSide,
    /// The cache's name and number in recorded events.
    trace: Arc<record::CellName>,
}

// SAFETY: `state` is only accessed by the thread holding `lock` (the owner during an active scope
// or an operation, another thread after `try_lock`), and `CacheState` is `Send`. `depth` and `closed`
// are atomics; the rest is immutable or behind its own mutex.
unsafe impl Sync for CacheCell {}

/// Holds a cell's lock; releasing it serves the requests left meanwhile.
struct LockGuard<'a>(&'a CacheCell);

impl LockGuard<'_> {
    fn state(&mut self) -> &mut CacheState {
        // SAFETY: (see `CacheCell::locked`) this `LockGuard` holds the lock; `&mut self` makes the
        // reference unique for as long as it lives.
        unsafe { self.0.locked() }
    }
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: a `LockGuard` is only made after taking the lock, which it still holds.
        unsafe { self.0.unlock() };
        // The lock is given up and the state no longer borrowed.
        #[cfg(feature = "tracing")]
        events::emit();
    }
}

impl CacheCell {
    /// A new, empty cache with `config`, owned by the calling thread.
    pub(crate) fn new(
        name: &str,
        thread_name: &str,
        (config_seq, config): (ConfigSeq, CacheConfig),
    ) -> CacheCell {
        let owner = thread::token();
        let trace = Arc::new(record::CellName::new(name, owner));
        CacheCell {
            thread_name: thread_name.into(),
            owner,
            lock: CellLock::default(),
            depth: AtomicU32::new(0),
            flags: AtomicU8::new(
                if record::on() { TRACED } else { 0 }
                    | if config.key.is_planned() { ARENA } else { 0 }
                    | if crate::config::caching_disabled() {
                        DISABLED
                    } else {
                        0
                    },
            ),
            state: UnsafeCell::new(CacheState::new(config, config_seq, Arc::clone(&trace))),
            stats: Counters::default(),
            remote: RemoteSide::default(),
            trace,
        }
    }

    /// The cache's name.
    pub(crate) fn name(&self) -> &str {
        self.trace.name()
    }

    /// The name of the owner thread.
    pub(crate) fn thread_name(&self) -> &str {
        &self.thread_name
    }

    /// The cache's number in recorded events.
    pub(crate) fn trace_id(&self) -> u32 {
        self.trace.id()
    }

    /// The number of the owner thread (its [`thread::ThreadToken`]).
    pub(crate) fn thread_number(&self) -> thread::ThreadToken {
        self.owner
    }

    /// Whether the calling thread owns this cache.
    pub(crate) fn is_owned_here(&self) -> bool {
        self.owner == thread::token()
    }

    /// The counters, read without stopping the owner (exact when read by the lock holder).
    /// Buffers another thread gave back to the device count as freed at once.
    pub(crate) fn snapshot(&self) -> CacheStats {
        let mut stats = self.stats.snapshot();
        let remote = self.remote.state.lock();
        for &(_, bytes) in &remote.released {
            stats.device_frees += 1;
            stats.bytes_in_use = stats.bytes_in_use.saturating_sub(bytes);
        }
        stats
    }

    /// The bytes the cache holds on each device it has used, read as [`CacheCell::snapshot`]
    /// reads its counters; `waiting` includes buffers other threads returned.
    pub(crate) fn device_bytes(&self) -> Vec<(Device, DeviceBytes)> {
        let mut devices: Vec<_> = self.stats.device_bytes().collect();
        let remote = self.remote.state.lock();
        fn on(devices: &mut [(Device, DeviceBytes)], device: Device) -> Option<&mut DeviceBytes> {
            devices
                .iter_mut()
                .find(|(d, _)| *d == device)
                .map(|(_, b)| b)
        }
        for &(g, bytes) in &remote.released {
            if let Some(b) = on(&mut devices, self.stats.gauge_device(g)) {
                b.held = b.held.saturating_sub(bytes);
            }
        }
        for r in &remote.queue {
            if let Some(b) = on(&mut devices, r.block.device()) {
                b.waiting += r.block.bytes();
            }
        }
        devices
    }

    /// Whether the owner thread has exited (or is exiting) and closed the cache.
    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.flags.load(Relaxed) & CLOSED != 0
    }

    /// Neither closed, recorded, an arena nor made with caching off: the hot paths may serve it.
    #[inline]
    pub(crate) fn is_plain(&self) -> bool {
        self.flags.load(Relaxed) == 0
    }

    /// Whether events of this cache are being recorded.
    #[inline]
    pub(crate) fn traced(&self) -> bool {
        self.flags.load(Relaxed) & TRACED != 0
    }

    /// Turns recording of this cache's events on or off (any thread).
    pub(crate) fn set_traced(&self, on: bool) {
        if on {
            self.flags.fetch_or(TRACED, Relaxed);
        } else {
            self.flags.fetch_and(!TRACED, Relaxed);
        }
    }

    #[inline]
    fn is_active(&self) -> bool {
        self.depth.load(Relaxed) > 0
    }

    /// The cache state, for the thread that holds the lock. This is the one place the state
    /// is reached; every call site cites it.
    ///
    /// # Safety
    /// The calling thread holds `lock`, and no other reference to the state is alive while the
    /// returned one is. At every call site two facts give this:
    /// * **Who holds the lock.** The owner takes it at the outermost [`CacheCell::enter`] and
    ///   keeps it until the matching [`CacheCell::exit`], so on the owner thread, while a scope
    ///   of the cell is active (`depth > 0`), the owner holds it. Otherwise a [`LockGuard`] guard
    ///   does (the owner outside a scope, or another thread after `try_lock`).
    /// * **Nothing nests.** A cache operation takes this reference once, calls only the
    ///   backend (which knows nothing of caches and scopes) and its own helpers while it holds
    ///   it, and drops it before it returns. Array drops and allocations inside a scope are
    ///   separate operations, one after the other, on the owner thread.
    #[allow(clippy::mut_from_ref)] // the lock, not the borrow, makes it unique
    #[inline(always)]
    unsafe fn locked(&self) -> &mut CacheState {
        // SAFETY: the caller upholds the conditions above.
        unsafe { &mut *self.state.get() }
    }

    /// Gives the lock up, after serving the requests other threads left meanwhile. The common
    /// case (no hint) is one compare-exchange, inlined.
    ///
    /// # Safety
    /// The calling thread holds `lock`, and no reference to the state is alive.
    #[inline(always)]
    unsafe fn unlock(&self) {
        if !self.lock.try_unlock_plain() {
            // SAFETY: the caller's conditions.
            unsafe { self.serve_and_unlock() };
        }
    }

    /// Serves requests until the lock can be given up with none waiting. Returned buffers stay
    /// queued (their hint set) for the next [`CacheCell::drain_returned`].
    ///
    /// # Safety
    /// As [`CacheCell::unlock`].
    #[cold]
    #[inline(never)]
    unsafe fn serve_and_unlock(&self) {
        loop {
            // SAFETY: (see `locked`) we hold the lock, and no other reference to the state is
            // alive.
            self.serve_requests(unsafe { self.locked() });
            if self.lock.unlock_unless_requested() {
                return;
            }
        }
    }

    /// Carries out what other threads asked for, if the [`REQUESTED`] hint is set (lock holder).
    fn serve_requests(&self, state: &mut CacheState) {
        if !self.lock.take(REQUESTED) {
            return;
        }
        let requests = {
            let mut remote = self.remote.state.lock();
            let requests = mem::take(&mut remote.requests);
            if remote.closed {
                // The owner has exited: the cache holds nothing to serve them on, and its exited
                // row may have read its final counters already (`registry::exit_thread`), which
                // a request served now would change behind it. A call that reaches a closed
                // cache is one that reached no cache (found by the loom model
                // `loom_exit_while_invalidated`).
                return;
            }
            requests
        };
        self.drain_returned(state, false);
        if let Some((seq, config)) = requests.config {
            self.configure_locked(state, seq, config);
        }
        if requests.invalidate > 0 {
            // One invalidation serves them all; each call counts.
            state.invalidate(&self.stats);
            add(&self.stats.invalidations, requests.invalidate);
        }
        // Requests are served with no scope of the cache active.
        for device in requests.flush {
            state.give_back(&self.stats, device, true);
        }
    }

    /// Leaves a request for the holder of the lock, from a thread other than the owner. It is
    /// served at once if the lock is free (by this thread), else when the holder unlocks: the
    /// owner when its scope exits. Returns whether it was served at once.
    pub(crate) fn request(&self, add: impl FnOnce(&mut Requests)) -> bool {
        add(&mut self.remote.state.lock().requests);
        // If the lock is held, its holder sees the hint when it unlocks (see `lock`).
        // Dropping the `LockGuard` serves the request.
        self.lock.set(REQUESTED) && self.try_hold().is_some()
    }

    fn hold(&self) -> LockGuard<'_> {
        self.lock.lock();
        LockGuard(self)
    }

    fn try_hold(&self) -> Option<LockGuard<'_>> {
        self.lock.try_lock().then(|| LockGuard(self))
    }

    /// Runs `f` on the cache state. Owner thread only; `f` must not call back into any cache.
    /// With feature `tracing`, the events `f` queued are emitted after it (outside a scope,
    /// after the lock is given up).
    fn owned<R>(&self, f: impl FnOnce(&mut CacheState, &Counters) -> R) -> R {
        debug_assert!(self.is_owned_here());
        if self.is_active() {
            // SAFETY: (see `locked`) the owner thread, inside a scope of the cell.
            let r = f(unsafe { self.locked() }, &self.stats);
            #[cfg(feature = "tracing")]
            events::emit();
            r
        } else {
            let mut held = self.hold();
            f(held.state(), &self.stats)
        }
    }

    /// Enters a scope of this cache on the owner thread. The outermost entry takes the lock and
    /// the buffers other threads returned meanwhile: they were dropped while the cache was not
    /// in a scope, so they are free for this step.
    pub(crate) fn enter(&self) {
        debug_assert!(self.is_owned_here());
        let depth = self.depth.load(Relaxed);
        if depth == 0 && !self.lock.try_lock_plain() {
            self.enter_slow();
        }
        self.depth.store(depth + 1, Relaxed);
    }

    /// The outermost entry when the lock is held elsewhere or a hint is set: takes the lock,
    /// then what other threads left.
    #[cold]
    #[inline(never)]
    fn enter_slow(&self) {
        self.lock.lock();
        // SAFETY: (see `locked`) we just took the lock.
        let state = unsafe { self.locked() };
        self.drain_returned(state, false);
        self.serve_requests(state);
    }

    /// Exits a scope entered with [`CacheCell::enter`]. The outermost exit frees the buffers
    /// dropped during the scope (under `Reuse::OnExit`) and takes in those returned by other
    /// threads, then gives the lock up, serving what other threads asked meanwhile.
    pub(crate) fn exit(&self) {
        debug_assert!(self.is_owned_here());
        let depth = self.depth.load(Relaxed);
        debug_assert!(depth > 0, "exit without enter");
        if depth > 1 {
            self.depth.store(depth - 1, Relaxed);
            return;
        }
        {
            // SAFETY: (see `locked`) the owner thread, inside the outermost scope of the cell.
            let state = unsafe { self.locked() };
            self.drain_returned(state, false);
            state.settle(&self.stats);
        }
        self.depth.store(0, Relaxed);
        // SAFETY: the lock was taken by the outermost `enter`; the borrow above has ended.
        unsafe { self.unlock() };
        // What the scope queued (see `events`), now that the lock is given up.
        #[cfg(feature = "tracing")]
        events::emit();
    }

    /// Which hit path may serve this cache, from one read of its flags.
    #[inline(always)]
    pub(crate) fn hit_path(&self) -> HitPath {
        match self.flags.load(Relaxed) {
            0 => HitPath::FreeList,
            ARENA => HitPath::Plan,
            _ => HitPath::None,
        }
    }

    /// The hit path: a free buffer for `req`, if the free list of its key has one. Call only
    /// on this thread's current (hence active) cache.
    /// The caller passes only a [plain](CacheCell::is_plain) cache: a recorded one goes to
    /// [`CacheCell::take`], which records the hit.
    #[inline]
    pub(crate) fn hit(&self, req: &Request<'_>) -> Option<(Block, Home)> {
        debug_assert!(self.is_owned_here() && self.is_active());
        // SAFETY: (see `locked`) the owner thread, inside a scope of the cell.
        let state = unsafe { self.locked() };
        let slot = state.find(state.key(req))?;
        let block = state.pop(&self.stats, slot)?;
        Some((block, self.home(slot, state.generation)))
    }

    /// After [`CacheCell::hit`] found nothing: takes in the buffers other threads returned and
    /// those whose device work has completed, and looks again. Same conditions as `hit`.
    pub(crate) fn take(&self, req: &Request<'_>) -> Take {
        debug_assert!(self.is_owned_here() && self.is_active());
        // SAFETY: (see `locked`) as in `hit`.
        let state = unsafe { self.locked() };
        if self.flags.load(Relaxed) & ARENA != 0
            && let Some(took) = self.take_flagged(state, req)
        {
            return took;
        }
        self.drain_returned(state, true);
        state.poll_deferred(&self.stats);
        match state.slot_of(&self.stats, req) {
            None => Take::Bypass,
            Some(slot) => match state.pop(&self.stats, slot) {
                Some(block) => {
                    if self.traced() {
                        state.note_hit(&self.stats, slot, &block);
                    }
                    Take::Hit(block, self.home(slot, state.generation))
                }
                None => Take::Miss {
                    capacity: state.config.key.capacity(req.bytes),
                    view: false,
                    make: Make::Plain,
                },
            },
        }
    }

    /// Accounts a buffer freshly allocated for `req` after a [`Take::Miss`]. Returns what the
    /// array gets: the block, or for an arena cache a view of it.
    pub(crate) fn adopt(&self, req: &Request<'_>, block: Block) -> crate::Result<Got> {
        self.owned(|state, st| {
            if state.config.key.is_planned() {
                return self.adopt_arena(state, req, block);
            }
            let Some(slot) = state.slot_of(st, req) else {
                return Ok(Got::Fresh(block, None));
            };
            state.live += 1;
            add(&st.misses, 1);
            st.allocated(state.slots[slot as usize].gauge, block.bytes());
            #[cfg(feature = "tracing")]
            events::queue(|| events::Event::Miss {
                cache: Arc::clone(self.trace.name()),
                dtype: req.dtype,
                dims: req.dims().into(),
                device: req.device,
                bytes: block.bytes(),
            });
            if record::on() {
                state.note_block(st, EventKind::Miss, slot, &block);
            }
            Ok(Got::Fresh(block, Some(self.home(slot, state.generation))))
        })
    }

    #[inline]
    fn home(&self, slot: u32, generation: u32) -> Home {
        Home {
            cell: NonNull::from(self),
            slot,
            generation,
        }
    }

    /// Frees this cache's free lists (on `device`, or all) from the owner thread; with
    /// `pending`, also the buffers dropped inside the active scope and not yet free (what
    /// out-of-memory recovery may take back from its own thread).
    pub(crate) fn give_back_owned(&self, device: Option<Device>, pending: bool) {
        let active = self.is_active();
        self.owned(|state, st| {
            self.drain_returned(state, active);
            state.give_back(st, device, pending || !active);
        });
    }

    /// Frees the free lists and the buffers waiting for the scope to exit, and starts a new
    /// generation: buffers of live arrays are freed, not cached, when they drop (owner thread).
    pub(crate) fn invalidate(&self) {
        self.owned(|state, st| {
            self.drain_returned(state, false);
            state.invalidate(st);
            add(&st.invalidations, 1);
        });
    }

    /// Applies the options of `configure` call `seq` (owner thread), unless the cache applied a
    /// later call's. Changing the key policy invalidates the cache.
    pub(crate) fn configure(&self, seq: ConfigSeq, config: CacheConfig) {
        self.owned(|state, _| self.configure_locked(state, seq, config));
    }

    /// The configuration and the generation (owner thread): a new generation starts at each
    /// invalidation, whether a call or a change of key policy asked for it.
    #[cfg(feature = "cuda")]
    pub(crate) fn config(&self) -> (CacheConfig, u32) {
        self.owned(|state, _| (state.config, state.generation))
    }

    /// Restarts the peak from the bytes held now (any thread), unless the cache is closed: its
    /// exited thread's row may hold its final counters already, and a call that reaches a
    /// closed cache reaches no cache (as requests do, see [`CacheCell::serve_requests`]). Under
    /// the remote side's mutex, which the close holds when it marks the cache closed.
    pub(crate) fn reset_peak(&self) {
        let remote = self.remote.state.lock();
        if !remote.closed {
            self.stats.reset_peak();
        }
    }

    /// The counters after taking in buffers returned by other threads, and settling a planned
    /// cache's arrays dropped on other threads (owner thread).
    pub(crate) fn stats_owned(&self) -> CacheStats {
        let active = self.is_active();
        self.owned(|state, st| {
            self.drain_returned(state, active);
            state.settle_remote_drops(st, !active);
        });
        self.snapshot()
    }

    /// Closes the cache when its owner thread exits: frees what is cached, and from now on
    /// buffers of arrays still alive are freed when they drop, on any thread.
    pub(crate) fn close(self: &Arc<Self>) {
        self.owned(|state, st| {
            state.flush(st, None);
            state.free_waiting(st, None);
            state.free_arenas(st, None);
            let mut remote = self.remote.state.lock();
            for (g, bytes) in remote.released.drain(..) {
                state.live -= 1;
                st.freed(g, bytes);
            }
            for r in remote.queue.drain(..) {
                state.live -= 1;
                if is_arena_slot(r.slot) {
                    state.free_arena_block(st, r.block);
                } else {
                    state.free(st, r.slot, r.block);
                }
            }
            remote.closed = true;
            remote.orphans = state.live;
            if state.live > 0 {
                remote.keepalive = Some(Arc::clone(self));
            }
            self.flags.fetch_or(CLOSED, Relaxed);
            if self.traced() {
                self.note_closed();
            }
        });
    }
}

/// Takes back the block of a dropped array, from any thread: its work on the device is over
/// (see `Block::end_use`), and it goes to its home cache, or to the device when it has none.
/// `current` is the calling thread's innermost entered cache (null if none).
#[inline(always)]
pub(crate) fn return_block(mut block: Block, home: Option<Home>, current: *const CacheCell) {
    block.end_use();
    match home {
        Some(home) => send_home(home, block, current),
        None => drop(block),
    }
}

/// The common drops, served in the array's drop before its buffer leaves the array (`block`,
/// taken when served): on the owner thread (`current`, the thread's innermost entered cache, is
/// the array's), a plain cache's buffer goes back to its free list, and a planned cache's
/// view to its plan ([`CacheCell::drop_in_plan_here`]). Returns whether it was served; any
/// other drop goes to [`return_block`].
#[inline(always)]
pub(crate) fn drop_here(block: &mut Option<Block>, home: &Home, current: *const CacheCell) -> bool {
    // SAFETY: `home` is alive (see `Home`), and so is its cell while the array is.
    let cell = unsafe { home.cell.as_ref() };
    if !ptr::eq(current, cell) {
        return false;
    }
    match cell.hit_path() {
        HitPath::FreeList => {
            let Some(mut block) = block.take() else {
                return false;
            };
            block.end_use();
            // SAFETY: (see `locked`) the thread's current cache is on its scope stack, so this
            // is the owner thread, inside a scope of the cell.
            let state = unsafe { cell.locked() };
            state.put_back(&cell.stats, true, home.slot, home.generation, block);
            true
        }
        // SAFETY: the cell is the thread's current cache (`current`), checked above.
        HitPath::Plan => unsafe { cell.drop_in_plan_here(block, home) },
        HitPath::None => false,
    }
}

/// Returns a block to its home cache, from any thread. `current` is the calling thread's
/// innermost entered cache (null if none): when it is the block's home, the block goes straight
/// back, with no check of the thread and no lock ([`drop_here`], which an array's drop tries
/// first).
#[inline]
fn send_home(home: Home, block: Block, current: *const CacheCell) {
    let mut block = Some(block);
    if drop_here(&mut block, &home, current) {
        return;
    }
    // Not served, so not taken.
    let Some(block) = block else {
        return;
    };
    // SAFETY: `home` is alive (see `Home`), and the reference is not used after the cell could
    // have been freed (the remote path drops its last use before releasing the keep-alive).
    let cell = unsafe { home.cell.as_ref() };
    if is_arena_slot(home.slot) {
        CacheCell::send_view_home(home, block, current);
    } else if cell.traced() {
        traced::send_home_traced(home, block, current);
    } else if cell.is_owned_here() && !cell.is_closed() {
        let active = cell.is_active();
        cell.owned(|state, st| state.put_back(st, active, home.slot, home.generation, block));
    } else {
        send_home_remote(home, block);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Found while model-checking a thread's exit: a `reset_peak` that listed the cache before
    /// its owner exited must not change the counters of the closed cache, which its exited
    /// row may have read as final.
    #[test]
    fn reset_peak_leaves_a_closed_cache_alone() {
        let cell = Arc::new(CacheCell::new(
            "closed",
            "owner",
            (0, CacheConfig::default()),
        ));
        let g = cell.stats.gauge_for(Device::Cpu).expect("a gauge");
        cell.stats.allocated(g, 4096);
        cell.stats.freed(g, 4096);
        cell.reset_peak();
        assert_eq!(
            cell.snapshot().peak_bytes,
            0,
            "an open cache's peak restarts"
        );
        cell.stats.allocated(g, 4096);
        cell.stats.freed(g, 4096);
        cell.close();
        cell.reset_peak();
        assert_eq!(
            cell.snapshot().peak_bytes,
            4096,
            "the closed cache's peak stays"
        );
    }
}

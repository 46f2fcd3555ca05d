//! One named cache of one thread: free lists by key, busy accounting, configuration, eviction.
//!
//! # Who touches what
//!
//! A [`CacheCell`] belongs to the thread that created it (its *owner*). Its state ([`Inner`]: the
//! key map, the free lists, the buffers waiting for the scope to exit) sits behind `lock`, a raw
//! mutex with a twist: the owner takes it when the cache's outermost scope is entered and keeps
//! it until that scope exits. Inside a scope every allocation and every drop on the owner thread
//! therefore works on `Inner` directly, with no atomic read-modify-write and nothing another
//! thread contends for. Outside a scope the owner takes the lock for each operation.
//!
//! Other threads touch a cache in two ways only:
//! * Dropping an array whose buffer came from it: the buffer goes into the cache's `remote`
//!   queue (its own mutex, on its own cache lines), which the owner drains when it misses, when a
//!   scope exits and when it reads its stats. The owner's hits never look at the queue.
//! * Releasing free buffers (`empty_cache`, out-of-memory recovery): they `try_lock`. If the
//!   owner is inside a scope of the cache they leave a request that the owner honours when the
//!   scope exits (a Dekker handshake on `flush_requested` and the lock, with SeqCst fences).
//!
//! # Lifetime
//!
//! Arrays point at their home cache with a raw pointer ([`Home`]), not an `Arc`, so a hit costs
//! no reference count. The owner's registry keeps the cell alive while the thread lives. When the
//! thread exits it *closes* the cell: free buffers go back to the device, and if arrays from it
//! are still alive elsewhere (`live > 0`) the cell keeps an `Arc` to itself, which the last of
//! those arrays to drop releases (a biased reference count: the owner counts without atomics,
//! other threads count under the `remote` mutex once the cell is closed).

use std::cell::{Cell, UnsafeCell};
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::mem;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*, fence};

use hashbrown::{Equivalent, HashMap};
use parking_lot::lock_api::RawMutex as _;
use parking_lot::{Mutex, RawMutex};

use crate::backend::Block;
use crate::config::{CacheConfig, Reuse};
use crate::stats::{CacheStats, Counters, add, sub};
use crate::{DType, Device, Shape};

/// A number naming a thread, unique for the life of the process (never reused).
pub(crate) type ThreadToken = u64;

thread_local! {
    static TOKEN: Cell<ThreadToken> = const { Cell::new(0) };
}

/// This thread's [`ThreadToken`].
#[inline]
pub(crate) fn thread_token() -> ThreadToken {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    // `TOKEN` has a const initialiser and no destructor, so it can be read at any time, even
    // while the thread's other thread-locals are being destroyed.
    TOKEN.with(|t| match t.get() {
        0 => {
            let token = NEXT.fetch_add(1, Relaxed);
            t.set(token);
            token
        }
        token => token,
    })
}

/// What an allocation asks for.
pub(crate) struct Request<'a> {
    pub(crate) dtype: DType,
    pub(crate) dims: &'a [usize],
    pub(crate) device: Device,
    /// The array's size in bytes, `> 0`.
    pub(crate) bytes: usize,
}

/// The key of a free list.
#[derive(Clone, PartialEq, Eq)]
enum Key {
    Exact {
        dtype: DType,
        device: Device,
        shape: Shape,
    },
    Class {
        bytes: usize,
        device: Device,
    },
}

/// A borrowed [`Key`], to look a request up without building a `Shape`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum KeyRef<'a> {
    Exact {
        dtype: DType,
        device: Device,
        dims: &'a [usize],
    },
    Class {
        bytes: usize,
        device: Device,
    },
}

impl Key {
    fn as_ref(&self) -> KeyRef<'_> {
        match self {
            Key::Exact {
                dtype,
                device,
                shape,
            } => KeyRef::Exact {
                dtype: *dtype,
                device: *device,
                dims: shape.dims(),
            },
            Key::Class { bytes, device } => KeyRef::Class {
                bytes: *bytes,
                device: *device,
            },
        }
    }
}

// A key hashes as its borrowed form, so `KeyRef` lookups find `Key` entries.
impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_ref().hash(state);
    }
}

impl Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        *self == key.as_ref()
    }
}

impl KeyRef<'_> {
    fn to_owned(self) -> Key {
        match self {
            KeyRef::Exact {
                dtype,
                device,
                dims,
            } => Key::Exact {
                dtype,
                device,
                shape: Shape::from(dims),
            },
            KeyRef::Class { bytes, device } => Key::Class { bytes, device },
        }
    }
}

/// Where an array's buffer goes back to: its cache, the free list it came from, and the
/// generation of the cache it belongs to.
///
/// Invariant: while a `Home` exists, the block it came with is counted in its cell's `live`
/// (or, once the cell is closed, in `orphans`), so the cell is alive.
#[derive(Debug)]
pub(crate) struct Home {
    cell: NonNull<CacheCell>,
    slot: usize,
    generation: u64,
}

// SAFETY: a `Home` only gives its holder the right to return one block to a `CacheCell`, which is
// `Sync`; `release` checks which thread it runs on and takes the remote path on any but the
// owner. The pointee outlives the `Home` by the invariant above.
unsafe impl Send for Home {}
// SAFETY: `&Home` allows nothing (all use goes through `release`, which takes the `Home` by value).
unsafe impl Sync for Home {}

/// The result of looking for a free buffer.
pub(crate) enum Take {
    /// A recycled buffer, now busy.
    Hit(Block, Home),
    /// None free: allocate a buffer of this capacity and [`CacheCell::adopt`] it.
    Miss { capacity: usize },
}

/// A free buffer and when it was freed (a stamp of the cache's clock).
struct Free {
    block: Block,
    stamp: u64,
}

/// The free list of one key.
struct Slot {
    device: Device,
    free: VecDeque<Free>,
}

/// A buffer returned by another thread, waiting for the owner.
struct Returned {
    block: Block,
    slot: usize,
    generation: u64,
}

/// The part of a cache that other threads write.
#[derive(Default)]
struct Remote {
    /// Buffers dropped on other threads while the cell was open.
    queue: Vec<Returned>,
    /// Set once, by the owner, when its thread exits.
    closed: bool,
    /// After `closed`: blocks still owned by arrays.
    orphans: usize,
    /// After `closed`, while `orphans > 0`: keeps the cell alive for them.
    keepalive: Option<Arc<CacheCell>>,
}

/// Keeps what other threads write off the owner's cache lines.
#[repr(align(128))]
#[derive(Default)]
struct RemoteSide {
    state: Mutex<Remote>,
    /// `state.queue` is not empty (a hint, read without the mutex).
    returned: AtomicBool,
    /// Another thread asked for the free lists to be released while the owner held the lock.
    flush_requested: AtomicBool,
}

/// The state of a cache, behind the cell's lock.
struct Inner {
    config: CacheConfig,
    generation: u64,
    keys: HashMap<Key, usize>,
    slots: Vec<Slot>,
    /// Buffers dropped inside an active scope under `Reuse::OnExit`: free when it exits.
    pending: Vec<(usize, Block)>,
    /// Buffers whose memory a device may still be using on another stream (see
    /// `Block::is_idle`): free once that work completes, polled when the cache misses and when a
    /// scope exits.
    deferred: Vec<(usize, Block)>,
    /// Free buffers, least recently freed first, as (stamp, slot); kept only with a byte cap.
    /// Entries whose buffer has left the free list are skipped when met.
    lru: VecDeque<(u64, usize)>,
    clock: u64,
    free_blocks: usize,
    /// Blocks handed to arrays and not yet back.
    live: usize,
}

/// One named cache of one thread.
pub(crate) struct CacheCell {
    name: Box<str>,
    thread_name: Box<str>,
    owner: ThreadToken,
    lock: RawMutex,
    /// Active scope entries; written and read by the owner only.
    depth: AtomicU32,
    /// Set by the owner when its thread exits; read by the owner only.
    closed: AtomicBool,
    inner: UnsafeCell<Inner>,
    stats: Counters,
    remote: RemoteSide,
}

// SAFETY: `inner` is only accessed by the thread holding `lock` (the owner during an active scope
// or an operation, another thread after `try_lock`), and `Inner` is `Send`. `depth` and `closed`
// are atomics; the rest is immutable or behind its own mutex.
unsafe impl Sync for CacheCell {}

/// Holds a cell's lock; releasing it honours flush requests left meanwhile.
struct Held<'a>(&'a CacheCell);

impl Held<'_> {
    fn inner(&mut self) -> &mut Inner {
        // SAFETY: this `Held` holds the cell's lock, and `&mut self` makes the borrow unique.
        unsafe { &mut *self.0.inner.get() }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // SAFETY: a `Held` is only made after taking the lock, which it still holds.
        unsafe { self.0.unlock() };
    }
}

impl CacheCell {
    /// A new, empty cache owned by the calling thread.
    pub(crate) fn new(name: &str, thread_name: &str) -> CacheCell {
        CacheCell {
            name: name.into(),
            thread_name: thread_name.into(),
            owner: thread_token(),
            lock: RawMutex::INIT,
            depth: AtomicU32::new(0),
            closed: AtomicBool::new(false),
            inner: UnsafeCell::new(Inner {
                config: CacheConfig::default(),
                generation: 0,
                keys: HashMap::default(),
                slots: Vec::new(),
                pending: Vec::new(),
                deferred: Vec::new(),
                lru: VecDeque::new(),
                clock: 0,
                free_blocks: 0,
                live: 0,
            }),
            stats: Counters::default(),
            remote: RemoteSide::default(),
        }
    }

    /// The cache's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The name of the owner thread, as `summary` prints it.
    pub(crate) fn thread_name(&self) -> &str {
        &self.thread_name
    }

    /// Whether the calling thread owns this cache.
    pub(crate) fn is_owned_here(&self) -> bool {
        self.owner == thread_token()
    }

    /// The counters, read without synchronisation (exact when read by the owner).
    pub(crate) fn snapshot(&self) -> CacheStats {
        self.stats.snapshot()
    }

    /// Whether the owner thread has exited (or is exiting) and closed the cache.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Relaxed)
    }

    fn is_active(&self) -> bool {
        self.depth.load(Relaxed) > 0
    }

    /// Unlocks, then serves any flush request left while the lock was held.
    ///
    /// # Safety
    /// The calling thread holds `lock`.
    unsafe fn unlock(&self) {
        loop {
            // SAFETY: the caller holds the lock (first iteration) or we re-took it below.
            unsafe { self.lock.unlock() };
            // Pairs with the fence in `flush_from_other_thread`: either that thread's `try_lock`
            // sees the lock free, or we see its request here.
            fence(SeqCst);
            if !self.remote.flush_requested.load(Relaxed) {
                return;
            }
            self.lock.lock();
            if self.remote.flush_requested.swap(false, Relaxed) {
                // SAFETY: we hold the lock again.
                let inner = unsafe { &mut *self.inner.get() };
                inner.flush(&self.stats, None);
            }
        }
    }

    fn hold(&self) -> Held<'_> {
        self.lock.lock();
        Held(self)
    }

    fn try_hold(&self) -> Option<Held<'_>> {
        self.lock.try_lock().then(|| Held(self))
    }

    /// Runs `f` on the cache state. Owner thread only; `f` must not call back into any cache.
    fn owned<R>(&self, f: impl FnOnce(&mut Inner, &Counters) -> R) -> R {
        debug_assert!(self.is_owned_here());
        if self.is_active() {
            // SAFETY: the owner holds the lock for as long as a scope of this cache is active,
            // and no other `&mut Inner` exists: the owner's operations do not nest.
            f(unsafe { &mut *self.inner.get() }, &self.stats)
        } else {
            let mut held = self.hold();
            f(held.inner(), &self.stats)
        }
    }

    /// Enters a scope of this cache on the owner thread.
    pub(crate) fn enter(&self) {
        debug_assert!(self.is_owned_here());
        let depth = self.depth.load(Relaxed);
        if depth == 0 {
            self.lock.lock();
        }
        self.depth.store(depth + 1, Relaxed);
    }

    /// Exits a scope entered with [`CacheCell::enter`]. The outermost exit frees the buffers
    /// dropped during the scope (under `Reuse::OnExit`) and takes in those returned by other
    /// threads, then gives the lock up.
    pub(crate) fn exit(&self) {
        debug_assert!(self.is_owned_here());
        let depth = self.depth.load(Relaxed);
        debug_assert!(depth > 0, "exit without enter");
        if depth > 1 {
            self.depth.store(depth - 1, Relaxed);
            return;
        }
        {
            // SAFETY: depth is 1, so this thread holds the lock, and no other borrow of `inner`
            // is alive: scope exits do not nest inside cache operations.
            let inner = unsafe { &mut *self.inner.get() };
            self.drain_returned(inner, false);
            inner.settle(&self.stats);
        }
        self.depth.store(0, Relaxed);
        // SAFETY: the lock was taken by the outermost `enter`.
        unsafe { self.unlock() };
    }

    /// Takes a free buffer for `req`, or reports a miss. Call only on this thread's current
    /// (hence active) cache.
    #[inline]
    pub(crate) fn take(&self, req: &Request<'_>) -> Take {
        debug_assert!(self.is_owned_here() && self.is_active());
        // SAFETY: the cell is active on its owner thread, which therefore holds the lock, and no
        // other borrow of `inner` is alive (cache operations do not nest).
        let inner = unsafe { &mut *self.inner.get() };
        let slot = inner.slot_of(req);
        if let Some(block) = inner.pop(&self.stats, slot) {
            return Take::Hit(block, self.home(slot, inner.generation));
        }
        if self.remote.returned.load(Acquire) {
            self.drain_returned(inner, true);
        }
        inner.poll_deferred(&self.stats);
        if let Some(block) = inner.pop(&self.stats, slot) {
            return Take::Hit(block, self.home(slot, inner.generation));
        }
        Take::Miss {
            capacity: inner.config.key.capacity(req.bytes),
        }
    }

    /// Accounts a buffer freshly allocated for `req` after a [`Take::Miss`].
    pub(crate) fn adopt(&self, req: &Request<'_>, block: &Block) -> Home {
        self.owned(|inner, st| {
            let slot = inner.slot_of(req);
            inner.live += 1;
            add(&st.misses, 1);
            add(&st.device_allocs, 1);
            add(&st.bytes_in_use, block.bytes());
            st.note_peak();
            self.home(slot, inner.generation)
        })
    }

    fn home(&self, slot: usize, generation: u64) -> Home {
        Home {
            cell: NonNull::from(self),
            slot,
            generation,
        }
    }

    /// Takes in the buffers other threads returned.
    fn drain_returned(&self, inner: &mut Inner, active: bool) {
        let returned = {
            let mut remote = self.remote.state.lock();
            self.remote.returned.store(false, Relaxed);
            mem::take(&mut remote.queue)
        };
        for r in returned {
            inner.release(&self.stats, active, r.slot, r.generation, r.block);
        }
    }

    /// Frees this cache's free buffers (on `device`, or all), from the owner thread.
    pub(crate) fn flush_owned(&self, device: Option<Device>) {
        self.owned(|inner, st| inner.flush(st, device));
    }

    /// Frees this cache's free buffers (on `device`, or all) from a thread other than the owner.
    /// Returns `false` when the owner is inside a scope of the cache: then it frees them (all
    /// devices) when that scope exits.
    pub(crate) fn flush_from_other_thread(&self, device: Option<Device>) -> bool {
        if let Some(mut held) = self.try_hold() {
            held.inner().flush(&self.stats, device);
            return true;
        }
        self.remote.flush_requested.store(true, Relaxed);
        // Pairs with the fence in `unlock`.
        fence(SeqCst);
        // Dropping the `Held` serves the request.
        self.try_hold().is_some()
    }

    /// Frees the free lists and the buffers waiting for the scope to exit, and starts a new
    /// generation: buffers of live arrays are freed, not cached, when they drop.
    pub(crate) fn invalidate(&self) {
        self.owned(|inner, st| {
            self.drain_returned(inner, false);
            inner.invalidate(st);
        });
    }

    /// Applies `config` (owner thread). Changing the key policy invalidates the cache.
    pub(crate) fn configure(&self, config: CacheConfig) {
        self.owned(|inner, st| {
            if config.key != inner.config.key {
                inner.invalidate(st);
            }
            inner.config = config;
            inner.rebuild_lru();
            inner.evict(st);
        });
    }

    /// The counters after taking in buffers returned by other threads (owner thread).
    pub(crate) fn stats_owned(&self) -> CacheStats {
        let active = self.is_active();
        self.owned(|inner, _| self.drain_returned(inner, active));
        self.snapshot()
    }

    /// Closes the cache when its owner thread exits: frees what is cached, and from now on
    /// buffers of arrays still alive are freed when they drop, on any thread.
    pub(crate) fn close(self: &Arc<Self>) {
        self.owned(|inner, st| {
            inner.flush(st, None);
            inner.free_pending(st);
            let mut remote = self.remote.state.lock();
            for r in remote.queue.drain(..) {
                inner.live -= 1;
                inner.free(st, r.block);
            }
            remote.closed = true;
            remote.orphans = inner.live;
            if inner.live > 0 {
                remote.keepalive = Some(Arc::clone(self));
            }
            self.closed.store(true, Relaxed);
        });
    }
}

/// Returns a block to its home cache, from any thread.
pub(crate) fn release(home: Home, block: Block) {
    // SAFETY: `home` is alive (see `Home`), and the reference is not used after the cell could
    // have been freed (the remote path drops its last use before releasing the keep-alive).
    let cell = unsafe { home.cell.as_ref() };
    if cell.is_owned_here() && !cell.closed.load(Relaxed) {
        let active = cell.is_active();
        cell.owned(|inner, st| inner.release(st, active, home.slot, home.generation, block));
    } else {
        release_remote(home, block);
    }
}

/// Returns a block from a thread other than the owner (or from the owner after it closed).
fn release_remote(home: Home, block: Block) {
    let keepalive = {
        // SAFETY: as in `release`; this borrow ends before `keepalive` can free the cell.
        let cell = unsafe { home.cell.as_ref() };
        let mut remote = cell.remote.state.lock();
        if remote.closed {
            remote.orphans -= 1;
            let keepalive = if remote.orphans == 0 {
                remote.keepalive.take()
            } else {
                None
            };
            drop(remote);
            drop(block);
            keepalive
        } else {
            remote.queue.push(Returned {
                block,
                slot: home.slot,
                generation: home.generation,
            });
            cell.remote.returned.store(true, Release);
            None
        }
    };
    // May free the cell; nothing borrows it any more.
    drop(keepalive);
}

impl Inner {
    /// The free list for `req`, created if new.
    #[inline]
    fn slot_of(&mut self, req: &Request<'_>) -> usize {
        let key = match self.config.key {
            crate::KeyPolicy::Exact => KeyRef::Exact {
                dtype: req.dtype,
                device: req.device,
                dims: req.dims,
            },
            crate::KeyPolicy::SizeClass => KeyRef::Class {
                bytes: self.config.key.capacity(req.bytes),
                device: req.device,
            },
        };
        if let Some(&slot) = self.keys.get(&key) {
            return slot;
        }
        let slot = self.slots.len();
        self.slots.push(Slot {
            device: req.device,
            free: VecDeque::new(),
        });
        self.keys.insert(key.to_owned(), slot);
        slot
    }

    /// Pops the most recently freed buffer of `slot` (a hit).
    #[inline]
    fn pop(&mut self, st: &Counters, slot: usize) -> Option<Block> {
        let Free { block, .. } = self.slots[slot].free.pop_back()?;
        self.free_blocks -= 1;
        self.live += 1;
        add(&st.hits, 1);
        sub(&st.bytes_cached, block.bytes());
        add(&st.bytes_in_use, block.bytes());
        Some(block)
    }

    /// Takes back the block of a dropped array.
    #[inline]
    fn release(&mut self, st: &Counters, active: bool, slot: usize, generation: u64, block: Block) {
        self.live -= 1;
        if generation != self.generation {
            sub(&st.bytes_in_use, block.bytes());
            self.free(st, block);
        } else if active && self.config.reuse == Reuse::OnExit {
            self.pending.push((slot, block));
        } else if !block.is_idle() {
            self.deferred.push((slot, block));
        } else {
            sub(&st.bytes_in_use, block.bytes());
            self.push_free(st, slot, block);
        }
    }

    /// Moves the deferred buffers whose device work has completed to the free lists.
    fn poll_deferred(&mut self, st: &Counters) {
        if self.deferred.is_empty() {
            return;
        }
        let (idle, busy): (Vec<_>, Vec<_>) = mem::take(&mut self.deferred)
            .into_iter()
            .partition(|(_, b)| b.is_idle());
        self.deferred = busy;
        for (slot, block) in idle {
            sub(&st.bytes_in_use, block.bytes());
            self.push_free(st, slot, block);
        }
    }

    fn push_free(&mut self, st: &Counters, slot: usize, block: Block) {
        let stamp = self.clock;
        self.clock += 1;
        add(&st.bytes_cached, block.bytes());
        self.slots[slot].free.push_back(Free { block, stamp });
        self.free_blocks += 1;
        if self.config.max_cached_bytes.is_some() {
            self.lru.push_back((stamp, slot));
            if self.lru.len() > 2 * self.free_blocks + 64 {
                self.rebuild_lru();
            }
            self.evict(st);
        }
    }

    /// Gives a block back to the device.
    fn free(&mut self, st: &Counters, block: Block) {
        add(&st.device_frees, 1);
        drop(block);
    }

    /// Moves the buffers dropped during the scope to the free lists (or, if a device may still
    /// be using them, to the deferred list).
    fn settle(&mut self, st: &Counters) {
        let mut pending = mem::take(&mut self.pending);
        for (slot, block) in pending.drain(..) {
            if block.is_idle() {
                sub(&st.bytes_in_use, block.bytes());
                self.push_free(st, slot, block);
            } else {
                self.deferred.push((slot, block));
            }
        }
        // Keep the capacity for the next step.
        self.pending = pending;
        self.poll_deferred(st);
    }

    /// Frees the buffers dropped during an active scope and those deferred (freeing waits for
    /// their device work, as the backend's free does).
    fn free_pending(&mut self, st: &Counters) {
        let pending = mem::take(&mut self.pending);
        let deferred = mem::take(&mut self.deferred);
        for (_, block) in pending.into_iter().chain(deferred) {
            sub(&st.bytes_in_use, block.bytes());
            self.free(st, block);
        }
    }

    /// Frees the free lists (of `device`, or all).
    fn flush(&mut self, st: &Counters, device: Option<Device>) {
        let mut freed = Vec::new();
        for slot in &mut self.slots {
            if device.is_none_or(|d| d == slot.device) {
                freed.extend(slot.free.drain(..));
            }
        }
        self.free_blocks -= freed.len();
        for Free { block, .. } in freed {
            sub(&st.bytes_cached, block.bytes());
            self.free(st, block);
        }
    }

    fn invalidate(&mut self, st: &Counters) {
        self.flush(st, None);
        self.free_pending(st);
        self.keys.clear();
        self.slots.clear();
        self.lru.clear();
        self.generation += 1;
        add(&st.invalidations, 1);
    }

    /// Frees the least recently freed buffers until the cache is within its byte cap.
    fn evict(&mut self, st: &Counters) {
        let Some(cap) = self.config.max_cached_bytes else {
            return;
        };
        while st.bytes_cached.load(Relaxed) as usize > cap {
            let Some((stamp, slot)) = self.lru.pop_front() else {
                break;
            };
            // Stamps grow, and every older entry has been handled, so the buffer is still free
            // exactly when it is the oldest of its list.
            let list = &mut self.slots[slot].free;
            if list.front().is_some_and(|f| f.stamp == stamp)
                && let Some(Free { block, .. }) = list.pop_front()
            {
                self.free_blocks -= 1;
                sub(&st.bytes_cached, block.bytes());
                add(&st.evictions, 1);
                self.free(st, block);
            }
        }
    }

    /// Rebuilds the LRU order from the free lists (or drops it when there is no cap).
    fn rebuild_lru(&mut self) {
        self.lru.clear();
        if self.config.max_cached_bytes.is_none() {
            return;
        }
        let mut all: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.free.iter().map(move |f| (f.stamp, i)))
            .collect();
        all.sort_unstable();
        self.lru.extend(all);
    }
}

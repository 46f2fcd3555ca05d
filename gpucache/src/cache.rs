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
//! Other threads touch a cache in three ways only:
//! * Dropping an array whose buffer came from it: the buffer goes into the cache's `remote`
//!   queue (its own mutex, on its own cache lines). The owner takes the queue in when a scope of
//!   the cache is entered (those buffers are free for the step), when it misses (they become
//!   free when the scope exits), when a scope exits and when it reads its stats. The owner's
//!   hits never look at the queue.
//! * Giving the queue back to the device ([`CacheCell::free_returned`]: `empty_cache`,
//!   `invalidate` and out-of-memory recovery). The queue is not the scope's state, so any thread
//!   may do this at any time; the bytes it freed are accounted by the next holder of the lock.
//! * Requests (`empty_cache`, `invalidate`, `configure`, out-of-memory recovery): they are left
//!   in the remote state and served by whichever thread holds the lock next, at once if it is
//!   free (see [`CacheCell::request`]): a Dekker handshake on `requested` and the lock, with
//!   SeqCst fences, so that a request is never missed and nobody blocks on a busy cache.
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
use std::mem;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*, fence};

use hashbrown::HashTable;
use parking_lot::lock_api::RawMutex as _;
use parking_lot::{Mutex, RawMutex};

use crate::backend::Block;
use crate::config::{CacheConfig, KeyPolicy, Reuse};
use crate::stats::{CacheStats, Counters, DeviceBytes, add, sub};
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
#[derive(Clone, Debug)]
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
#[derive(Clone, Copy)]
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

/// An entry of the key table: a key, its hash (kept for rehashing) and its free list.
struct Entry {
    hash: u64,
    key: Key,
    slot: u32,
}

/// Mixes `x` into the running hash `h` (a multiply-fold step, as in foldhash and wyhash).
#[inline]
fn mix(h: u64, x: u64) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let m = u128::from(h ^ x) * u128::from(K);
    (m as u64) ^ ((m >> 64) as u64)
}

impl Key {
    #[inline]
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

impl KeyRef<'_> {
    /// The key's hash. Written out rather than derived (this is on every allocation): one
    /// multiply-fold per word, the device, element type, rank and kind packed in the first.
    #[inline]
    fn hash(self) -> u64 {
        let (device, first, rest): (Device, u64, &[usize]) = match self {
            KeyRef::Exact {
                dtype,
                device,
                dims,
            } => (device, (dtype as u64) << 32 | dims.len() as u64, dims),
            KeyRef::Class { bytes, device } => (device, 1 << 40 | bytes as u64, &[]),
        };
        let device = match device {
            Device::Cpu => 0,
            Device::Cuda(n) => n as u64 + 1,
        };
        let mut h = mix(device, first);
        for &d in rest {
            h = mix(h, d as u64);
        }
        h
    }

    /// Whether `key` is this key.
    #[inline]
    fn matches(self, key: &Key) -> bool {
        match (self, key.as_ref()) {
            (
                KeyRef::Exact {
                    dtype: t1,
                    device: d1,
                    dims: s1,
                },
                KeyRef::Exact {
                    dtype: t2,
                    device: d2,
                    dims: s2,
                },
            ) => {
                t1 == t2
                    && d1 == d2
                    && s1.len() == s2.len()
                    && s1.iter().zip(s2).all(|(a, b)| a == b)
            }
            (
                KeyRef::Class {
                    bytes: b1,
                    device: d1,
                },
                KeyRef::Class {
                    bytes: b2,
                    device: d2,
                },
            ) => b1 == b2 && d1 == d2,
            _ => false,
        }
    }

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
    /// None free: allocate a buffer of this capacity and [`CacheCell::adopt`] it.
    Miss { capacity: usize },
    /// The cache cannot take more keys (2^32 of them): allocate without it.
    Bypass,
}

/// A free buffer and when it was freed (a stamp of the cache's clock).
struct Free {
    block: Block,
    stamp: u64,
}

/// The free list of one key.
struct Slot {
    device: Device,
    /// The device's gauge in the cache's counters.
    gauge: u8,
    /// Oldest first; hits take the newest.
    free: Vec<Free>,
}

/// A buffer returned by another thread, waiting for the owner.
struct Returned {
    block: Block,
    slot: u32,
    generation: u32,
}

/// What other threads asked of the cache, for the next holder of its lock.
#[derive(Default)]
pub(crate) struct Requests {
    /// New options (`configure`).
    pub(crate) config: Option<CacheConfig>,
    /// Invalidate the cache.
    pub(crate) invalidate: bool,
    /// Free the free lists of these devices (`None`: every device).
    pub(crate) flush: Vec<Option<Device>>,
}

/// The part of a cache that other threads write.
#[derive(Default)]
struct Remote {
    /// Buffers dropped on other threads while the cell was open.
    queue: Vec<Returned>,
    /// Buffers of the queue that a thread gave back to the device and the lock holder has not
    /// accounted yet: (gauge, bytes).
    released: Vec<(u8, usize)>,
    requests: Requests,
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
    /// `state.queue` or `state.released` is not empty (a hint, read without the mutex).
    returned: AtomicBool,
    /// `state.requests` may hold a request (read without the mutex; SeqCst, see `unlock`).
    requested: AtomicBool,
}

/// The state of a cache, behind the cell's lock.
struct Inner {
    config: CacheConfig,
    generation: u32,
    keys: HashTable<Entry>,
    slots: Vec<Slot>,
    /// Buffers dropped inside an active scope under `Reuse::OnExit`: free when it exits.
    pending: Vec<(u32, Block)>,
    /// Buffers whose memory a device may still be using on another stream (see
    /// `Block::is_idle`): free once that work completes, polled when the cache misses and when a
    /// scope exits.
    deferred: Vec<(u32, Block)>,
    /// Free buffers, least recently freed first, as (stamp, slot); kept only with a byte cap.
    /// Entries whose buffer has left the free list are skipped when met.
    lru: VecDeque<(u64, u32)>,
    /// Stamps buffers as they are freed (with or without a cap, so that a cap set later evicts
    /// the least recently freed first).
    clock: u64,
    /// Rebuild `lru` when it grows past this (it holds stale entries for buffers since taken).
    lru_limit: usize,
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

/// Holds a cell's lock; releasing it serves the requests left meanwhile.
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
    /// A new, empty cache with `config`, owned by the calling thread.
    pub(crate) fn new(name: &str, thread_name: &str, config: CacheConfig) -> CacheCell {
        CacheCell {
            name: name.into(),
            thread_name: thread_name.into(),
            owner: thread_token(),
            lock: RawMutex::INIT,
            depth: AtomicU32::new(0),
            closed: AtomicBool::new(false),
            inner: UnsafeCell::new(Inner {
                config,
                generation: 0,
                keys: HashTable::new(),
                slots: Vec::new(),
                pending: Vec::new(),
                deferred: Vec::new(),
                lru: VecDeque::new(),
                clock: 0,
                lru_limit: 0,
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

    /// The name of the owner thread.
    pub(crate) fn thread_name(&self) -> &str {
        &self.thread_name
    }

    /// The number of the owner thread (its [`ThreadToken`]).
    pub(crate) fn thread_number(&self) -> ThreadToken {
        self.owner
    }

    /// Whether the calling thread owns this cache.
    pub(crate) fn is_owned_here(&self) -> bool {
        self.owner == thread_token()
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
        self.closed.load(Relaxed)
    }

    #[inline]
    fn is_active(&self) -> bool {
        self.depth.load(Relaxed) > 0
    }

    /// The cache state, for the thread that holds the lock.
    ///
    /// # Safety
    /// The calling thread holds `lock`, and no other reference to the state is alive: cache
    /// operations do not nest, and each takes this reference once.
    #[allow(clippy::mut_from_ref)] // the lock, not the borrow, makes it unique
    #[inline(always)]
    unsafe fn locked(&self) -> &mut Inner {
        // SAFETY: the caller holds the lock and no other reference exists (see above).
        unsafe { &mut *self.inner.get() }
    }

    /// Serves the requests other threads left, then unlocks; serves those left meanwhile.
    ///
    /// # Safety
    /// The calling thread holds `lock`, and no reference to the state is alive.
    unsafe fn unlock(&self) {
        loop {
            if self.remote.requested.load(SeqCst) {
                // SAFETY: we hold the lock (the caller's, or re-taken below).
                self.serve_requests(unsafe { self.locked() });
            }
            // SAFETY: as above.
            unsafe { self.lock.unlock() };
            // Pairs with the fence in `request`: either the requester's `try_lock` sees the lock
            // free, or we see its request here. If another thread holds the lock again, it
            // serves the request when it unlocks.
            fence(SeqCst);
            if !self.remote.requested.load(SeqCst) || !self.lock.try_lock() {
                return;
            }
        }
    }

    /// Carries out what other threads asked for (lock holder).
    fn serve_requests(&self, inner: &mut Inner) {
        self.remote.requested.store(false, SeqCst);
        let requests = mem::take(&mut self.remote.state.lock().requests);
        self.drain_returned(inner, false);
        if let Some(config) = requests.config {
            inner.configure(&self.stats, config);
        }
        if requests.invalidate {
            inner.invalidate(&self.stats);
        }
        for device in requests.flush {
            inner.give_back(&self.stats, device, false);
        }
    }

    /// Leaves a request for the holder of the lock, from a thread other than the owner. It is
    /// served at once if the lock is free (by this thread), else when the holder unlocks: the
    /// owner when its scope exits. Returns whether it was served at once.
    pub(crate) fn request(&self, add: impl FnOnce(&mut Requests)) -> bool {
        add(&mut self.remote.state.lock().requests);
        self.remote.requested.store(true, SeqCst);
        // Pairs with the fence in `unlock`.
        fence(SeqCst);
        // Dropping the `Held` serves the request.
        self.try_hold().is_some()
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
            // and the owner's operations do not nest.
            f(unsafe { self.locked() }, &self.stats)
        } else {
            let mut held = self.hold();
            f(held.inner(), &self.stats)
        }
    }

    /// Enters a scope of this cache on the owner thread. The outermost entry takes the lock and
    /// the buffers other threads returned meanwhile: they were dropped while the cache was not
    /// in a scope, so they are free for this step.
    pub(crate) fn enter(&self) {
        debug_assert!(self.is_owned_here());
        let depth = self.depth.load(Relaxed);
        if depth == 0 {
            self.lock.lock();
            // SAFETY: we just took the lock, and no scope (hence no cache operation) is active.
            self.drain_returned(unsafe { self.locked() }, false);
        }
        self.depth.store(depth + 1, Relaxed);
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
            // SAFETY: depth is 1, so this thread holds the lock, and scope exits do not nest
            // inside cache operations.
            let inner = unsafe { self.locked() };
            self.drain_returned(inner, false);
            inner.settle(&self.stats);
        }
        self.depth.store(0, Relaxed);
        // SAFETY: the lock was taken by the outermost `enter`; the borrow above has ended.
        unsafe { self.unlock() };
    }

    /// The hit path: a free buffer for `req`, if the free list of its key has one. Call only
    /// on this thread's current (hence active) cache.
    #[inline]
    pub(crate) fn hit(&self, req: &Request<'_>) -> Option<(Block, Home)> {
        debug_assert!(self.is_owned_here() && self.is_active());
        // SAFETY: the cell is active on its owner thread, which therefore holds the lock, and
        // cache operations do not nest.
        let inner = unsafe { self.locked() };
        let slot = inner.find(inner.key(req))?;
        let block = inner.pop(&self.stats, slot)?;
        Some((block, self.home(slot, inner.generation)))
    }

    /// After [`CacheCell::hit`] found nothing: takes in the buffers other threads returned and
    /// those whose device work has completed, and looks again. Same conditions as `hit`.
    pub(crate) fn take(&self, req: &Request<'_>) -> Take {
        debug_assert!(self.is_owned_here() && self.is_active());
        // SAFETY: as in `hit`.
        let inner = unsafe { self.locked() };
        self.drain_returned(inner, true);
        inner.poll_deferred(&self.stats);
        match inner.slot_of(&self.stats, req) {
            None => Take::Bypass,
            Some(slot) => match inner.pop(&self.stats, slot) {
                Some(block) => Take::Hit(block, self.home(slot, inner.generation)),
                None => Take::Miss {
                    capacity: inner.config.key.capacity(req.bytes),
                },
            },
        }
    }

    /// Accounts a buffer freshly allocated for `req` after a [`Take::Miss`].
    pub(crate) fn adopt(&self, req: &Request<'_>, block: &Block) -> Option<Home> {
        self.owned(|inner, st| {
            let slot = inner.slot_of(st, req)?;
            inner.live += 1;
            add(&st.misses, 1);
            st.allocated(inner.slots[slot as usize].gauge, block.bytes());
            Some(self.home(slot, inner.generation))
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

    /// Takes in the buffers other threads returned (lock holder), and accounts those another
    /// thread gave back to the device. Cheap when there are none: the mutex is taken only when
    /// the `returned` hint is set.
    fn drain_returned(&self, inner: &mut Inner, active: bool) {
        if !self.remote.returned.load(Acquire) {
            return;
        }
        let (returned, released) = {
            let mut remote = self.remote.state.lock();
            self.remote.returned.store(false, Relaxed);
            (
                mem::take(&mut remote.queue),
                mem::take(&mut remote.released),
            )
        };
        for (g, bytes) in released {
            inner.live -= 1;
            self.stats.freed(g, bytes);
        }
        for r in returned {
            inner.release(&self.stats, active, r.slot, r.generation, r.block);
        }
    }

    /// Gives the buffers other threads returned to this cache (on `device`, or all) back to the
    /// device, from any thread, whatever the owner is doing: they belong to no array and to no
    /// scope. The next holder of the lock accounts them.
    pub(crate) fn free_returned(&self, device: Option<Device>) {
        let freed: Vec<Block> = {
            let mut remote = self.remote.state.lock();
            let (freed, kept) = mem::take(&mut remote.queue)
                .into_iter()
                .partition(|r| device.is_none_or(|d| d == r.block.device()));
            remote.queue = kept;
            let freed: Vec<Block> = freed.into_iter().map(|r: Returned| r.block).collect();
            for block in &freed {
                // Every returned block has a slot, hence a gauge for its device.
                if let Some(g) = self.stats.find_gauge(block.device()) {
                    remote.released.push((g, block.bytes()));
                }
            }
            freed
        };
        if !freed.is_empty() {
            // The lock holder accounts them when it next takes the queue in.
            self.remote.returned.store(true, Release);
        }
        // Freed outside the mutex: a device free may wait for the device.
        drop(freed);
    }

    /// Frees this cache's free lists (on `device`, or all) from the owner thread; with
    /// `pending`, also the buffers dropped inside the active scope and not yet free (what
    /// out-of-memory recovery may take back from its own thread).
    pub(crate) fn give_back_owned(&self, device: Option<Device>, pending: bool) {
        self.owned(|inner, st| {
            self.drain_returned(inner, self.is_active());
            inner.give_back(st, device, pending);
        });
    }

    /// Frees the free lists and the buffers waiting for the scope to exit, and starts a new
    /// generation: buffers of live arrays are freed, not cached, when they drop (owner thread).
    pub(crate) fn invalidate(&self) {
        self.owned(|inner, st| {
            self.drain_returned(inner, false);
            inner.invalidate(st);
        });
    }

    /// Applies `config` (owner thread). Changing the key policy invalidates the cache.
    pub(crate) fn configure(&self, config: CacheConfig) {
        self.owned(|inner, st| inner.configure(st, config));
    }

    /// Restarts the peak from the bytes held now (any thread).
    pub(crate) fn reset_peak(&self) {
        self.stats.reset_peak();
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
            inner.free_waiting(st, None);
            let mut remote = self.remote.state.lock();
            for (g, bytes) in remote.released.drain(..) {
                inner.live -= 1;
                st.freed(g, bytes);
            }
            for r in remote.queue.drain(..) {
                inner.live -= 1;
                let g = inner.slots[r.slot as usize].gauge;
                inner.free(st, g, r.block);
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

/// Returns a block to its home cache, from any thread. `current` is the calling thread's
/// innermost entered cache (null if none): when it is the block's home, the block goes straight
/// back, with no check of the thread and no lock.
#[inline]
pub(crate) fn release(home: Home, block: Block, current: *const CacheCell) {
    // SAFETY: `home` is alive (see `Home`), and the reference is not used after the cell could
    // have been freed (the remote path drops its last use before releasing the keep-alive).
    let cell = unsafe { home.cell.as_ref() };
    if ptr::eq(current, cell) && !cell.is_closed() {
        // SAFETY: the thread's current cache is owned by this thread and active (it is on the
        // thread's scope stack), so this thread holds its lock; cache operations do not nest.
        let inner = unsafe { cell.locked() };
        inner.release(&cell.stats, true, home.slot, home.generation, block);
    } else if cell.is_owned_here() && !cell.is_closed() {
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
    /// The key of `req` under this cache's policy.
    #[inline]
    fn key<'a>(&self, req: &Request<'a>) -> KeyRef<'a> {
        match self.config.key {
            KeyPolicy::Exact => KeyRef::Exact {
                dtype: req.dtype,
                device: req.device,
                dims: req.dims,
            },
            KeyPolicy::SizeClass => KeyRef::Class {
                bytes: self.config.key.capacity(req.bytes),
                device: req.device,
            },
        }
    }

    /// The free list of `key`, if it has one.
    #[inline]
    fn find(&self, key: KeyRef<'_>) -> Option<u32> {
        let hash = key.hash();
        self.keys
            .find(hash, |e| e.hash == hash && key.matches(&e.key))
            .map(|e| e.slot)
    }

    /// The free list for `req`, created if new (`None` once there are 2^32 of them, or when the
    /// cache already tracks its most devices).
    fn slot_of(&mut self, st: &Counters, req: &Request<'_>) -> Option<u32> {
        let key = self.key(req);
        if let Some(slot) = self.find(key) {
            return Some(slot);
        }
        let slot = u32::try_from(self.slots.len()).ok()?;
        let gauge = st.gauge_for(req.device)?;
        self.slots.push(Slot {
            device: req.device,
            gauge,
            free: Vec::new(),
        });
        let entry = Entry {
            hash: key.hash(),
            key: key.to_owned(),
            slot,
        };
        self.keys.insert_unique(entry.hash, entry, |e| e.hash);
        Some(slot)
    }

    /// The gauge of `slot`'s device.
    #[inline(always)]
    fn gauge(&self, slot: u32) -> u8 {
        self.slots[slot as usize].gauge
    }

    /// Pops the most recently freed buffer of `slot` (a hit).
    #[inline]
    fn pop(&mut self, st: &Counters, slot: u32) -> Option<Block> {
        let list = &mut self.slots[slot as usize];
        let Free { block, .. } = list.free.pop()?;
        self.live += 1;
        add(&st.hits, 1);
        sub(&st.gauge(list.gauge).cached, block.bytes());
        Some(block)
    }

    /// Takes back the block of a dropped array.
    #[inline(always)]
    fn release(&mut self, st: &Counters, active: bool, slot: u32, generation: u32, block: Block) {
        self.live -= 1;
        let g = self.gauge(slot);
        if generation != self.generation {
            self.free(st, g, block);
        } else if active && self.config.reuse == Reuse::OnExit {
            add(&st.gauge(g).waiting, block.bytes());
            self.pending.push((slot, block));
        } else if !block.is_idle() {
            add(&st.gauge(g).waiting, block.bytes());
            self.deferred.push((slot, block));
        } else {
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
            sub(&st.gauge(self.gauge(slot)).waiting, block.bytes());
            self.push_free(st, slot, block);
        }
    }

    #[inline(always)]
    fn push_free(&mut self, st: &Counters, slot: u32, block: Block) {
        add(&st.gauge(self.gauge(slot)).cached, block.bytes());
        self.clock += 1;
        let stamp = self.clock;
        self.slots[slot as usize].free.push(Free { block, stamp });
        if self.config.max_cached_bytes.is_some() {
            self.note_free_capped(st, stamp, slot);
        }
    }

    /// Under a byte cap: records a freed buffer in the LRU order and evicts down to the cap.
    #[cold]
    fn note_free_capped(&mut self, st: &Counters, stamp: u64, slot: u32) {
        self.lru.push_back((stamp, slot));
        if self.lru.len() > self.lru_limit {
            self.rebuild_lru();
        }
        self.evict(st);
    }

    /// Gives a block of gauge `g` back to the device.
    fn free(&mut self, st: &Counters, g: u8, block: Block) {
        st.freed(g, block.bytes());
        drop(block);
    }

    /// Moves the buffers dropped during the scope to the free lists (or, if a device may still
    /// be using them, to the deferred list).
    fn settle(&mut self, st: &Counters) {
        let mut pending = mem::take(&mut self.pending);
        for (slot, block) in pending.drain(..) {
            if block.is_idle() {
                sub(&st.gauge(self.gauge(slot)).waiting, block.bytes());
                self.push_free(st, slot, block);
            } else {
                self.deferred.push((slot, block));
            }
        }
        // Keep the capacity for the next step.
        self.pending = pending;
        self.poll_deferred(st);
    }

    /// Frees the buffers (on `device`, or all) dropped during an active scope and those
    /// deferred (freeing waits for their device work, as the backend's free does).
    fn free_waiting(&mut self, st: &Counters, device: Option<Device>) {
        let on =
            |slots: &[Slot], slot: u32| device.is_none_or(|d| d == slots[slot as usize].device);
        let mut freed = Vec::new();
        for list in [&mut self.pending, &mut self.deferred] {
            let (take, keep) = mem::take(list)
                .into_iter()
                .partition(|&(slot, _)| on(&self.slots, slot));
            *list = keep;
            freed.extend::<Vec<_>>(take);
        }
        for (slot, block) in freed {
            let g = self.gauge(slot);
            sub(&st.gauge(g).waiting, block.bytes());
            self.free(st, g, block);
        }
    }

    /// Frees the free lists (of `device`, or all).
    fn flush(&mut self, st: &Counters, device: Option<Device>) {
        let mut freed = Vec::new();
        for list in &mut self.slots {
            if device.is_none_or(|d| d == list.device) {
                freed.extend(list.free.drain(..).map(|f| (list.gauge, f.block)));
            }
        }
        for (g, block) in freed {
            sub(&st.gauge(g).cached, block.bytes());
            self.free(st, g, block);
        }
    }

    /// Frees what the cache holds on `device` (or all devices) that no array owns and no scope
    /// needs: the free lists, the deferred buffers and, with `pending`, the buffers dropped
    /// inside the active scope.
    fn give_back(&mut self, st: &Counters, device: Option<Device>, pending: bool) {
        self.flush(st, device);
        let kept = if pending {
            Vec::new()
        } else {
            mem::take(&mut self.pending)
        };
        self.free_waiting(st, device);
        self.pending = kept;
    }

    /// Frees every buffer the cache has back (free, pending, deferred) and starts a new
    /// generation. The keys and their (now empty) free lists stay, so `Home::slot` stays valid.
    fn invalidate(&mut self, st: &Counters) {
        self.flush(st, None);
        self.free_waiting(st, None);
        self.lru.clear();
        self.generation = self.generation.wrapping_add(1);
        add(&st.invalidations, 1);
    }

    /// Applies `config`; changing the key policy invalidates the cache.
    fn configure(&mut self, st: &Counters, config: CacheConfig) {
        if config.key != self.config.key {
            self.invalidate(st);
        }
        self.config = config;
        self.rebuild_lru();
        self.evict(st);
    }

    /// Frees the least recently freed buffers until the cache is within its byte cap.
    fn evict(&mut self, st: &Counters) {
        let Some(cap) = self.config.max_cached_bytes else {
            return;
        };
        while st.cached() > cap {
            let Some((stamp, slot)) = self.lru.pop_front() else {
                break;
            };
            // Stamps grow, and every older entry has been handled, so the buffer is still free
            // exactly when it is the oldest of its list.
            let list = &mut self.slots[slot as usize];
            if list.free.first().is_some_and(|f| f.stamp == stamp) {
                let Free { block, .. } = list.free.remove(0);
                let g = list.gauge;
                sub(&st.gauge(g).cached, block.bytes());
                add(&st.evictions, 1);
                self.free(st, g, block);
            }
        }
    }

    /// Rebuilds the LRU order from the free lists (or drops it when there is no cap).
    fn rebuild_lru(&mut self) {
        self.lru.clear();
        if self.config.max_cached_bytes.is_none() {
            return;
        }
        let mut all: Vec<(u64, u32)> = self
            .slots
            .iter()
            .zip(0u32..)
            .flat_map(|(s, i)| s.free.iter().map(move |f| (f.stamp, i)))
            .collect();
        // Stable, so that equal stamps keep list order (oldest first).
        all.sort_by_key(|&(stamp, _)| stamp);
        self.lru_limit = 2 * all.len() + 64;
        self.lru.extend(all);
    }
}

//! The state behind a cache's lock: the key table, the free lists (newest last, stamped for the
//! least-recently-freed order a byte cap evicts in), the buffers waiting for the scope to exit or
//! for other streams, and how buffers move between them.

use std::collections::VecDeque;
use std::mem;
use std::sync::Arc;

use hashbrown::HashTable;

use super::Request;
use super::arena::device::Arenas;
use super::counters::{Counters, GaugeIx, add, sub};
use super::key::{Entry, Key, KeyRef};
use crate::Device;
use crate::backend::Block;
use crate::config::{CacheConfig, KeyPolicy, Reuse};
use crate::trace::record::{self, EventKind};

/// The number of a `configure` call, in the order the calls took the registry's lock (0: the
/// default options). A cache applies options only from a call later than those it applied, so
/// that a request served late never undoes a later call.
pub(crate) type ConfigSeq = u64;

/// A free buffer and when it was freed (a stamp of the cache's clock).
pub(super) struct Free {
    block: Block,
    stamp: u64,
}

/// The free list of one key: what the hit path and the drop path touch, kept small (the rest
/// is in [`SlotMeta`]).
pub(super) struct Slot {
    /// Oldest first; hits take the newest.
    free: Vec<Free>,
    /// The device's gauge in the cache's counters.
    pub(super) gauge: GaugeIx,
}

/// What else is known of a free list, off the hot paths.
pub(super) struct SlotMeta {
    pub(super) device: Device,
    /// The key (for recorded events).
    pub(super) key: Key,
}

/// The state of a cache, behind the cell's lock.
pub(super) struct CacheState {
    pub(super) config: CacheConfig,
    /// The `configure` call `config` came from.
    pub(super) config_seq: ConfigSeq,
    /// The cache's name and number in recorded events.
    pub(super) trace: Arc<record::CellName>,
    pub(super) generation: u32,
    keys: HashTable<Entry>,
    pub(super) slots: Vec<Slot>,
    /// Indexed like `slots`.
    pub(super) meta: Vec<SlotMeta>,
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
    /// Blocks handed to arrays and not yet back (and retired arena blocks).
    pub(super) live: usize,
    /// The arenas of an arena cache.
    pub(super) arenas: Arenas,
}

impl CacheState {
    /// An empty cache state with `config`.
    pub(super) fn new(
        config: CacheConfig,
        config_seq: ConfigSeq,
        trace: Arc<record::CellName>,
    ) -> CacheState {
        CacheState {
            config,
            config_seq,
            trace,
            generation: 0,
            keys: HashTable::new(),
            slots: Vec::new(),
            meta: Vec::new(),
            pending: Vec::new(),
            deferred: Vec::new(),
            lru: VecDeque::new(),
            clock: 0,
            lru_limit: 0,
            live: 0,
            arenas: Arenas::default(),
        }
    }

    /// The key of `req` under this cache's policy.
    #[inline]
    pub(super) fn key<'a>(&self, req: &Request<'a>) -> KeyRef<'a> {
        if self.config.key == KeyPolicy::SizeClass {
            KeyRef::Class {
                bytes: self.config.key.capacity(req.bytes),
                device: req.device,
            }
        } else {
            // (Planned caches do not look keys up; their key is never used.)
            KeyRef::Exact {
                dtype: req.dtype,
                device: req.device,
                dims: req.dims(),
            }
        }
    }

    /// The free list of `key`, if it has one.
    #[inline]
    pub(super) fn find(&self, key: KeyRef<'_>) -> Option<u32> {
        let hash = key.hash();
        self.keys
            .find(hash, |e| e.hash == hash && key.matches(&e.key))
            .map(|e| e.slot)
    }

    /// The free list for `req`, created if new (`None` once there are 2^32 of them, or when the
    /// cache already tracks its most devices).
    pub(super) fn slot_of(&mut self, st: &Counters, req: &Request<'_>) -> Option<u32> {
        let key = self.key(req);
        if let Some(slot) = self.find(key) {
            return Some(slot);
        }
        // Slots from `VIEW_BASE` up are planned arrays' (see the `arena` module).
        let slot = u32::try_from(self.slots.len())
            .ok()
            .filter(|&s| !super::arena::block::is_arena_slot(s))?;
        let gauge = st.gauge_for(req.device)?;
        let entry = Entry {
            hash: key.hash(),
            key: key.to_owned(),
            slot,
        };
        self.slots.push(Slot {
            free: Vec::new(),
            gauge,
        });
        self.meta.push(SlotMeta {
            device: req.device,
            key: entry.key.clone(),
        });
        self.keys.insert_unique(entry.hash, entry, |e| e.hash);
        Some(slot)
    }

    /// The gauge of `slot`'s device.
    #[inline(always)]
    pub(super) fn gauge(&self, slot: u32) -> GaugeIx {
        self.slots[slot as usize].gauge
    }

    /// Pops the most recently freed buffer of `slot` (a hit).
    #[inline]
    pub(super) fn pop(&mut self, st: &Counters, slot: u32) -> Option<Block> {
        let list = &mut self.slots[slot as usize];
        let Free { block, .. } = list.free.pop()?;
        self.live += 1;
        add(&st.hits, 1);
        sub(st.gauge(list.gauge).cached, block.bytes());
        Some(block)
    }

    /// Takes back the block of a dropped array.
    #[inline(always)]
    pub(super) fn put_back(
        &mut self,
        st: &Counters,
        active: bool,
        slot: u32,
        generation: u32,
        block: Block,
    ) {
        self.live -= 1;
        if generation != self.generation {
            self.free(st, slot, block);
        } else if active && self.config.reuse == Reuse::OnExit {
            add(st.gauge(self.gauge(slot)).waiting, block.bytes());
            self.pending.push((slot, block));
        } else if !block.is_idle() {
            self.defer(st, slot, block);
        } else {
            self.push_free(st, slot, block, false);
        }
    }

    /// [`CacheState::put_back`] of a block a device may still be using on another stream.
    #[cold]
    #[inline(never)]
    fn defer(&mut self, st: &Counters, slot: u32, block: Block) {
        add(st.gauge(self.gauge(slot)).waiting, block.bytes());
        self.deferred.push((slot, block));
    }

    /// Moves the deferred buffers whose device work has completed to the free lists.
    #[inline(always)]
    pub(super) fn poll_deferred(&mut self, st: &Counters) {
        if !self.deferred.is_empty() {
            self.poll_deferred_some(st);
        }
    }

    #[inline(never)]
    fn poll_deferred_some(&mut self, st: &Counters) {
        let (idle, busy): (Vec<_>, Vec<_>) = mem::take(&mut self.deferred)
            .into_iter()
            .partition(|(_, b)| b.is_idle());
        self.deferred = busy;
        let moved = !idle.is_empty();
        for (slot, block) in idle {
            self.push_free(st, slot, block, true);
        }
        if moved && record::on() {
            self.note_bytes(st);
        }
    }

    /// Puts `block` on the free list `slot`; `waited`: it was counted as waiting until now.
    #[inline(always)]
    pub(super) fn push_free(&mut self, st: &Counters, slot: u32, block: Block, waited: bool) {
        let list = &mut self.slots[slot as usize];
        let gauge = st.gauge(list.gauge);
        if waited {
            sub(gauge.waiting, block.bytes());
        }
        add(gauge.cached, block.bytes());
        self.clock += 1;
        let free = Free {
            block,
            stamp: self.clock,
        };
        // The cap is tested first, so that nothing stays live across the push.
        if self.config.max_cached_bytes.is_none() {
            list.free.push(free);
        } else {
            self.push_free_capped(st, slot, free);
        }
    }

    /// Under a byte cap: pushes a freed buffer, records it in the LRU order and evicts down to
    /// the cap.
    #[cold]
    #[inline(never)]
    fn push_free_capped(&mut self, st: &Counters, slot: u32, free: Free) {
        self.lru.push_back((free.stamp, slot));
        self.slots[slot as usize].free.push(free);
        if self.lru.len() > self.lru_limit {
            self.rebuild_lru();
        }
        self.evict(st);
    }

    /// Gives a block of free list `slot` back to the device. Out of line: never on a hot path
    /// (and the drop path, which frees blocks of an invalidated generation, then does not
    /// prepare for it).
    #[cold]
    #[inline(never)]
    pub(super) fn free(&mut self, st: &Counters, slot: u32, block: Block) {
        st.freed(self.gauge(slot), block.bytes());
        if record::on() {
            self.note_block(st, EventKind::DeviceFree, slot, &block);
        }
        drop(block);
    }

    /// Moves the buffers dropped during the scope to the free lists (or, if a device may still
    /// be using them, to the deferred list).
    #[inline]
    pub(super) fn settle(&mut self, st: &Counters) {
        // In drop order. Reversed, then popped: this loop is on every scope exit, and a
        // `Drain` would add its drop (which need not be inlined) to it; the scope cycle of the
        // `hit_path` bench measures it.
        self.pending.reverse();
        while let Some((slot, block)) = self.pending.pop() {
            if block.is_idle() {
                self.push_free(st, slot, block, true);
            } else {
                self.deferred.push((slot, block));
            }
        }
        self.poll_deferred(st);
    }

    /// Frees the buffers (on `device`, or all) dropped during an active scope and those
    /// deferred (freeing waits for their device work, as the backend's free does).
    pub(super) fn free_waiting(&mut self, st: &Counters, device: Option<Device>) {
        let on =
            |meta: &[SlotMeta], slot: u32| device.is_none_or(|d| d == meta[slot as usize].device);
        let mut freed = Vec::new();
        for list in [&mut self.pending, &mut self.deferred] {
            let (take, keep) = mem::take(list)
                .into_iter()
                .partition(|&(slot, _)| on(&self.meta, slot));
            *list = keep;
            freed.extend::<Vec<_>>(take);
        }
        for (slot, block) in freed {
            let g = self.gauge(slot);
            sub(st.gauge(g).waiting, block.bytes());
            self.free(st, slot, block);
        }
    }

    /// Frees the free lists (of `device`, or all).
    pub(super) fn flush(&mut self, st: &Counters, device: Option<Device>) {
        let mut freed = Vec::new();
        for ((list, meta), slot) in self.slots.iter_mut().zip(&self.meta).zip(0u32..) {
            if device.is_none_or(|d| d == meta.device) {
                freed.extend(list.free.drain(..).map(|f| (slot, list.gauge, f.block)));
            }
        }
        for (slot, g, block) in freed {
            sub(st.gauge(g).cached, block.bytes());
            self.free(st, slot, block);
        }
    }

    /// Frees what the cache holds on `device` (or all devices) that no array owns and no scope
    /// needs: the free lists, the deferred buffers, the arena blocks no array uses and, with
    /// `pending`, the buffers dropped inside the active scope.
    pub(super) fn give_back(&mut self, st: &Counters, device: Option<Device>, pending: bool) {
        self.flush(st, device);
        self.free_arenas(st, device);
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
    /// The caller counts the `invalidate` calls it serves (a change of key policy is none).
    pub(super) fn invalidate(&mut self, st: &Counters) {
        self.flush(st, None);
        self.free_waiting(st, None);
        self.free_arenas(st, None);
        self.lru.clear();
        self.generation = self.generation.wrapping_add(1);
        #[cfg(feature = "tracing")]
        super::events::queue(|| super::events::Event::Invalidated {
            cache: Arc::clone(self.trace.name()),
        });
        if record::on() {
            record::push(record::Note::about(
                EventKind::Invalidate,
                Some(self.trace.id()),
            ));
        }
    }

    /// Applies `config`; changing the key policy invalidates the cache.
    pub(super) fn configure(&mut self, st: &Counters, config: CacheConfig) {
        if config.key != self.config.key {
            self.invalidate(st);
        }
        self.config = config;
        self.rebuild_lru();
        self.evict(st);
    }

    /// Frees the least recently freed buffers until the cache is within its byte cap.
    pub(super) fn evict(&mut self, st: &Counters) {
        let Some(cap) = self.config.max_cached_bytes else {
            return;
        };
        while st.cached_total() > cap {
            let Some((stamp, slot)) = self.lru.pop_front() else {
                break;
            };
            // Stamps grow, and every older entry has been handled, so the buffer is still free
            // exactly when it is the oldest of its list.
            let list = &mut self.slots[slot as usize];
            if list.free.first().is_some_and(|f| f.stamp == stamp) {
                let Free { block, .. } = list.free.remove(0);
                let g = list.gauge;
                sub(st.gauge(g).cached, block.bytes());
                add(&st.evictions, 1);
                #[cfg(feature = "tracing")]
                super::events::queue(|| super::events::Event::Evicted {
                    cache: Arc::clone(self.trace.name()),
                    bytes: block.bytes(),
                    cap,
                });
                if record::on() {
                    self.note_block(st, EventKind::Evict, slot, &block);
                }
                self.free(st, slot, block);
            }
        }
    }

    /// Rebuilds the LRU order from the free lists (or drops it when there is no cap).
    pub(super) fn rebuild_lru(&mut self) {
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

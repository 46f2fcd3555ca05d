//! The part of a cache that other threads write: buffers returned by arrays dropped on other
//! threads, what they asked of the cache (requests), and the state after the owner has exited.
//!
//! The return queue is not the scope's state: any thread may give queued buffers back to the
//! device at any time ([`CacheCell::free_returned`]); the bytes freed that way are accounted by
//! the next holder of the cell's lock, which takes the queue in ([`CacheCell::drain_returned`]).

use std::mem;
use std::sync::Arc;

// `parking_lot`'s mutex, or loom's under `cfg(loom)` (see `crate::sync`).
use crate::sync::Mutex;

use super::arena::block::{RETURNED_SOLO, is_arena_slot};
use super::counters::GaugeIx;
use super::lock::RETURNED;
use super::state::{CacheState, ConfigSeq};
use super::{CacheCell, Home};
use crate::Device;
use crate::backend::Block;
use crate::config::CacheConfig;
use crate::trace::record;

/// A buffer returned by another thread, waiting for the owner (`slot` `RETURNED_SOLO` or
/// `RETURNED_PLAN`: an arena block whose last array dropped).
pub(super) struct Returned {
    pub(super) block: Block,
    pub(super) slot: u32,
    pub(super) generation: u32,
}

/// What other threads asked of the cache, for the next holder of its lock.
#[derive(Default)]
pub(crate) struct Requests {
    /// New options (`configure`), with the number of that call (see [`ConfigSeq`]).
    pub(crate) config: Option<(ConfigSeq, CacheConfig)>,
    /// Invalidate the cache: the number of `invalidate` calls that asked (one invalidation
    /// serves them all; each counts in the cache's `invalidations`).
    pub(crate) invalidate: usize,
    /// Free the free lists of these devices (`None`: every device), each at most once, and
    /// `None` alone (see [`Requests::flush`]): bounded by the devices, however long the owner's
    /// scope.
    pub(super) flush: Vec<Option<Device>>,
}

/// The part of a cache that other threads write.
#[derive(Default)]
pub(super) struct Remote {
    /// Buffers dropped on other threads while the cell was open.
    pub(super) queue: Vec<Returned>,
    /// Buffers of the queue that a thread gave back to the device and the lock holder has not
    /// accounted yet: (gauge, bytes).
    pub(super) released: Vec<(GaugeIx, usize)>,
    pub(super) requests: Requests,
    /// Set once, by the owner, when its thread exits.
    pub(super) closed: bool,
    /// After `closed`: blocks still owned by arrays.
    pub(super) orphans: usize,
    /// After `closed`, while `orphans > 0`: keeps the cell alive for them.
    pub(super) keepalive: Option<Arc<CacheCell>>,
}

/// Keeps what other threads write off the owner's cache lines. What it holds is announced to
/// the holder of the cell's lock by hints in the lock's byte (see [`super::lock`]).
#[repr(align(128))]
#[derive(Default)]
pub(super) struct RemoteSide {
    pub(super) state: Mutex<Remote>,
}

impl Requests {
    /// Asks for the free lists of `device` (`None`: every device) to be freed. A device asked
    /// for already, or every device, subsumes it; every device subsumes the rest.
    pub(crate) fn flush(&mut self, device: Option<Device>) {
        if self.flush.contains(&None) || self.flush.contains(&device) {
            return;
        }
        if device.is_none() {
            self.flush.clear();
        }
        self.flush.push(device);
    }

    /// Asks for the options of `configure` call `seq` (kept if a later call already asked).
    pub(crate) fn configure(&mut self, seq: ConfigSeq, config: CacheConfig) {
        if self.config.is_none_or(|(queued, _)| queued < seq) {
            self.config = Some((seq, config));
        }
    }
}

impl CacheCell {
    /// The flush requests waiting for the lock holder.
    #[cfg(test)]
    pub(crate) fn queued_flushes(&self) -> usize {
        self.remote.state.lock().requests.flush.len()
    }

    /// Takes in the buffers other threads returned (lock holder), and accounts those another
    /// thread gave back to the device. Cheap when there are none: one load of the lock's
    /// [`RETURNED`] hint, inlined; the mutex is taken only when it is set.
    #[inline(always)]
    pub(super) fn drain_returned(&self, state: &mut CacheState, active: bool) {
        if self.lock.has(RETURNED) {
            self.take_in_returned(state, active);
        }
    }

    #[cold]
    #[inline(never)]
    fn take_in_returned(&self, state: &mut CacheState, active: bool) {
        // The hint goes first: what is returned after this sets it again.
        self.lock.take(RETURNED);
        let (returned, released) = {
            let mut remote = self.remote.state.lock();
            (
                mem::take(&mut remote.queue),
                mem::take(&mut remote.released),
            )
        };
        for (g, bytes) in released {
            state.live -= 1;
            self.stats.freed(g, bytes);
        }
        let traced = record::on();
        for r in returned {
            if is_arena_slot(r.slot) {
                let solo = r.slot == RETURNED_SOLO;
                state.take_back(&self.stats, r.block, r.generation, solo, true);
            } else if traced {
                state.put_back_traced(&self.stats, active, r.slot, r.generation, r.block);
            } else {
                state.put_back(&self.stats, active, r.slot, r.generation, r.block);
            }
        }
        if traced {
            state.note_bytes(&self.stats);
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
            self.lock.set(RETURNED);
            if record::on() {
                self.note_freed_returned(&freed);
            }
        }
        // Freed outside the mutex: a device free may wait for the device.
        drop(freed);
    }
}

impl CacheCell {
    /// Whether arrays of this cache are still alive after its owner thread exited.
    pub(crate) fn has_orphans(&self) -> bool {
        let remote = self.remote.state.lock();
        remote.closed && remote.orphans > 0
    }
}

/// Returns a block from a thread other than the owner (or from the owner after it closed).
pub(super) fn send_home_remote(home: Home, block: Block) {
    let keepalive = {
        // SAFETY: as in `release`; this borrow ends before `keepalive` can free the cell.
        let cell = unsafe { home.cell.as_ref() };
        let mut remote = cell.remote.state.lock();
        if remote.closed {
            remote.orphans -= 1;
            // Counted as freed by the cache it came from, whose thread has exited: with no lock
            // holder left, the counters are written under this mutex, as every such drop is.
            if let Some(g) = cell.stats.find_gauge(block.device()) {
                cell.stats.freed(g, block.bytes());
            }
            let keepalive = if remote.orphans == 0 {
                remote.keepalive.take()
            } else {
                None
            };
            drop(remote);
            if record::on() {
                cell.note_freed_returned(std::slice::from_ref(&block));
            }
            drop(block);
            keepalive
        } else {
            let r = Returned {
                block,
                slot: home.slot,
                generation: home.generation,
            };
            // A planned array's drop was recorded as returned already (its block follows it
            // home only when it was the block's last array).
            if record::on() && !is_arena_slot(r.slot) {
                cell.note_returned(&r);
            }
            remote.queue.push(r);
            cell.lock.set(RETURNED);
            None
        }
    };
    // May free the cell; nothing borrows it any more.
    drop(keepalive);
}

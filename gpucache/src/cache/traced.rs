//! Recording a cache's events (see [`crate::trace`]): the out-of-line halves of the hooks. The
//! hot paths test [`record::on`] and call these only when recording is on.

use super::state::CacheState;
use std::ptr;

use super::counters::{Counters, GaugeIx};
use super::remote::Returned;
use super::remote::send_home_remote;
use super::{CacheCell, Home};
use crate::backend::{self, Block};
use crate::trace::record::{self, EventKind, Note};

/// (in use, cached) bytes of gauge `g`.
pub(super) fn gauge_bytes(st: &Counters, g: GaugeIx) -> (usize, usize) {
    let gauge = st.gauge(g);
    let held = gauge.held.load(std::sync::atomic::Ordering::Relaxed) as usize;
    let cached = gauge.cached.load(std::sync::atomic::Ordering::Relaxed) as usize;
    (held.saturating_sub(cached), cached)
}

impl CacheState {
    /// Records `kind` about `block` of free list `slot`, with the cache's bytes after it.
    #[cold]
    #[inline(never)]
    pub(super) fn note_block(&self, st: &Counters, kind: EventKind, slot: u32, block: &Block) {
        self.note_slot(
            st,
            kind,
            slot,
            (block.bytes(), block.id(), block.stream_id()),
        );
    }

    /// Records a hit on `slot` that handed `block` out (on the thread's current stream, where
    /// the buffer goes).
    #[cold]
    #[inline(never)]
    pub(super) fn note_hit(&self, st: &Counters, slot: u32, block: &Block) {
        let stream = backend::current_stream_id(self.meta[slot as usize].device);
        self.note_slot(
            st,
            EventKind::Hit,
            slot,
            (block.bytes(), block.id(), stream),
        );
    }

    /// Records `kind` about a buffer (`bytes`, `buffer`, `stream`) of free list `slot`, with
    /// the cache's bytes after it.
    fn note_slot(
        &self,
        st: &Counters,
        kind: EventKind,
        slot: u32,
        (bytes, buffer, stream): (usize, u64, Option<u64>),
    ) {
        let meta = &self.meta[slot as usize];
        record::push(Note {
            kind,
            cell: Some(self.trace.id()),
            key: Some(meta.key.traced()),
            bytes,
            buffer: Some(buffer),
            device: Some(meta.device),
            stream,
            bytes_after: Some(gauge_bytes(st, self.gauge(slot))),
        });
    }

    /// Records the cache's bytes on every device it uses ([`EventKind::Settled`]).
    #[cold]
    #[inline(never)]
    pub(super) fn note_bytes(&self, st: &Counters) {
        note_gauges(st, self.trace.id());
    }

    /// [`CacheState::put_back`], recorded.
    pub(super) fn put_back_traced(
        &mut self,
        st: &Counters,
        active: bool,
        slot: u32,
        generation: u32,
        block: Block,
    ) {
        let stale = generation != self.generation;
        let buffer = (block.bytes(), block.id(), block.stream_id());
        self.put_back(st, active, slot, generation, block);
        // A buffer of an earlier generation was freed (and recorded as such) instead.
        if !stale {
            self.note_slot(st, EventKind::FreeToCache, slot, buffer);
        }
    }
}

/// Records the bytes of the cache `trace_id` (counters `st`) on every device it uses.
fn note_gauges(st: &Counters, trace_id: u32) {
    for (device, b) in st.device_bytes() {
        record::push(Note {
            device: Some(device),
            bytes_after: Some((b.held.saturating_sub(b.cached), b.cached)),
            ..Note::about(EventKind::Settled, Some(trace_id))
        });
    }
}

/// [`send_home`](super::send_home), recorded.
#[cold]
#[inline(never)]
pub(super) fn send_home_traced(home: Home, block: Block, current: *const CacheCell) {
    // SAFETY: as in `release`.
    let cell = unsafe { home.cell.as_ref() };
    if ptr::eq(current, cell) && !cell.is_closed() {
        // SAFETY: (see `locked`) as in `release`.
        let state = unsafe { cell.locked() };
        state.put_back_traced(&cell.stats, true, home.slot, home.generation, block);
    } else if cell.is_owned_here() && !cell.is_closed() {
        let active = cell.is_active();
        cell.owned(|state, st| {
            state.put_back_traced(st, active, home.slot, home.generation, block);
        });
    } else {
        send_home_remote(home, block);
    }
}

impl CacheCell {
    /// [`CacheCell::enter`], recorded.
    #[cold]
    #[inline(never)]
    pub(crate) fn enter_traced(&self) {
        self.enter();
        record::push(Note::about(EventKind::ScopeEnter, Some(self.trace.id())));
    }

    /// [`CacheCell::exit`], recorded, with the bytes the cache holds after it.
    #[cold]
    #[inline(never)]
    pub(crate) fn exit_traced(&self) {
        self.exit();
        record::push(Note::about(EventKind::ScopeExit, Some(self.trace.id())));
        note_gauges(&self.stats, self.trace.id());
    }

    /// Records that the cache closed (its thread exited): it holds nothing any more, for the
    /// counters (as [`snapshot`](crate::snapshot) counts live threads' caches only).
    #[cold]
    pub(super) fn note_closed(&self) {
        for (device, _) in self.stats.device_bytes() {
            record::push(Note {
                device: Some(device),
                bytes_after: Some((0, 0)),
                ..Note::about(EventKind::Settled, Some(self.trace.id()))
            });
        }
    }

    /// Records the bytes the cache holds (any thread: when recording starts).
    pub(crate) fn note_all_bytes(&self) {
        note_gauges(&self.stats, self.trace.id());
    }

    /// Records buffers returned by other threads that a thread gave back to the device.
    #[cold]
    #[inline(never)]
    pub(super) fn note_freed_returned(&self, freed: &[Block]) {
        for block in freed {
            record::push(Note {
                bytes: block.bytes(),
                buffer: Some(block.id()),
                device: Some(block.device()),
                stream: block.stream_id(),
                ..Note::about(EventKind::DeviceFree, Some(self.trace.id()))
            });
        }
    }

    /// Records a buffer an array dropped on this thread returned to this (another thread's)
    /// cache.
    #[cold]
    #[inline(never)]
    pub(super) fn note_returned(&self, r: &Returned) {
        record::push(Note {
            bytes: r.block.bytes(),
            buffer: Some(r.block.id()),
            device: Some(r.block.device()),
            stream: r.block.stream_id(),
            ..Note::about(EventKind::Returned, Some(self.trace.id()))
        });
    }
}

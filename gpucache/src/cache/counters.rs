//! The live counters of a cache: hits, misses, device allocations and frees, and bytes held,
//! cached and waiting per device. Only the holder of the cache's lock writes them (plain load
//! and store: no read-modify-write on the hot paths); any thread may read a snapshot.

use std::sync::atomic::{AtomicU64, Ordering::*};

use crate::Device;
use crate::metrics::CacheStats;

/// The most devices one cache tracks (on one thread). An allocation on a further device inside a
/// scope of that cache bypasses it: it is allocated from the device and freed when it drops.
pub(crate) const MAX_DEVICES: usize = 16;

/// The index of a gauge in [`Counters`]. An enum, so that the compiler knows it is below
/// [`MAX_DEVICES`]: the hot paths index the gauge arrays with it, with neither a bounds check
/// nor a mask.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[rustfmt::skip]
pub(crate) enum GaugeIx {
    G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10, G11, G12, G13, G14, G15,
}

impl GaugeIx {
    const ALL: [GaugeIx; MAX_DEVICES] = {
        use GaugeIx::*;
        [
            G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10, G11, G12, G13, G14, G15,
        ]
    };

    /// The `i`th gauge, if `i < MAX_DEVICES`.
    fn new(i: usize) -> Option<GaugeIx> {
        Self::ALL.get(i).copied()
    }

    #[inline(always)]
    fn index(self) -> usize {
        self as usize
    }
}

/// The byte gauges of one cache on one device (borrowed from [`Counters`], which keeps each
/// field in an array of its own, so that the hot paths reach one with a scaled index). Written
/// only by the holder of the cache's lock.
#[derive(Clone, Copy)]
pub(crate) struct Gauge<'a> {
    /// Bytes of every buffer the cache holds from the device, busy or free.
    pub(crate) held: &'a AtomicU64,
    /// Bytes of buffers in the free lists.
    pub(crate) cached: &'a AtomicU64,
    /// Bytes of buffers whose arrays dropped but that are not free yet: dropped inside a scope
    /// that has not exited (`Reuse::OnExit`), or waiting for work on another stream.
    pub(crate) waiting: &'a AtomicU64,
}

/// A number for `device`, never 0.
fn device_code(device: Device) -> u64 {
    match device {
        Device::Cpu => 1,
        Device::Cuda(n) => (n as u64).saturating_add(2),
    }
}

/// The inverse of [`device_code`].
fn device_of(code: u64) -> Device {
    match code {
        1 => Device::Cpu,
        n => Device::Cuda((n - 2) as usize),
    }
}

/// The bytes of one cache on one device, as read by any thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DeviceBytes {
    pub(crate) held: usize,
    pub(crate) cached: usize,
    pub(crate) waiting: usize,
}

/// The live counters of a cache. Only the thread holding the cache's lock writes them (plain
/// load and store, no read-modify-write on the hot path); any thread may read a snapshot.
///
/// Bytes are kept per device ([`Gauge`]); bytes in use are derived (`held - cached`), so a hit
/// and a drop each update one byte counter.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) device_allocs: AtomicU64,
    pub(crate) device_frees: AtomicU64,
    /// Raised with `fetch_max` (on misses only), so that [`Counters::reset_peak`] may run on
    /// any thread.
    pub(crate) peak_bytes: AtomicU64,
    pub(crate) invalidations: AtomicU64,
    pub(crate) evictions: AtomicU64,
    /// Per gauge: 0 while unused, otherwise its device's [`device_code`]. Set once, before the
    /// gauge's bytes are written.
    tags: [AtomicU64; MAX_DEVICES],
    /// Per gauge: the fields of [`Gauge`].
    held: [AtomicU64; MAX_DEVICES],
    cached: [AtomicU64; MAX_DEVICES],
    waiting: [AtomicU64; MAX_DEVICES],
}

/// Adds `n` to a counter written only by the lock holder.
#[inline]
pub(crate) fn add(c: &AtomicU64, n: usize) {
    c.store(c.load(Relaxed).wrapping_add(n as u64), Relaxed);
}

/// Subtracts `n` from a counter written only by the lock holder.
#[inline]
pub(crate) fn sub(c: &AtomicU64, n: usize) {
    c.store(c.load(Relaxed).wrapping_sub(n as u64), Relaxed);
}

impl Counters {
    /// The gauge of `device`, if the cache has one (any thread).
    pub(crate) fn find_gauge(&self, device: Device) -> Option<GaugeIx> {
        let code = device_code(device);
        self.used()
            .position(|(c, _)| c == code)
            .and_then(GaugeIx::new)
    }

    /// The gauge of `device`, claimed if new (lock holder only). `None` once [`MAX_DEVICES`]
    /// devices have one.
    pub(crate) fn gauge_for(&self, device: Device) -> Option<GaugeIx> {
        if let Some(g) = self.find_gauge(device) {
            return Some(g);
        }
        let g = GaugeIx::new(self.used().count())?;
        self.tags[g.index()].store(device_code(device), Release);
        Some(g)
    }

    /// The claimed gauges with their device codes, in claim order.
    fn used(&self) -> impl Iterator<Item = (u64, Gauge<'_>)> {
        self.tags
            .iter()
            .zip(GaugeIx::ALL)
            .map(|(tag, g)| (tag.load(Acquire), self.gauge(g)))
            .take_while(|&(code, _)| code != 0)
    }

    /// The gauge `g`.
    #[inline(always)]
    pub(crate) fn gauge(&self, g: GaugeIx) -> Gauge<'_> {
        let i = g.index();
        Gauge {
            held: &self.held[i],
            cached: &self.cached[i],
            waiting: &self.waiting[i],
        }
    }

    /// The device of gauge `g` (a claimed one).
    pub(crate) fn gauge_device(&self, g: GaugeIx) -> Device {
        device_of(self.tags[g.index()].load(Acquire))
    }

    /// Bytes in the free lists, over every device.
    pub(crate) fn cached_total(&self) -> usize {
        self.used()
            .map(|(_, g)| g.cached.load(Relaxed) as usize)
            .sum()
    }

    /// Accounts a buffer newly allocated from the device, raising the peak if needed.
    #[inline]
    pub(crate) fn allocated(&self, g: GaugeIx, bytes: usize) {
        add(&self.device_allocs, 1);
        add(self.gauge(g).held, bytes);
        let held: u64 = self.used().map(|(_, g)| g.held.load(Relaxed)).sum();
        self.peak_bytes.fetch_max(held, Relaxed);
    }

    /// Accounts a buffer given back to the device.
    #[inline]
    pub(crate) fn freed(&self, g: GaugeIx, bytes: usize) {
        add(&self.device_frees, 1);
        sub(self.gauge(g).held, bytes);
    }

    /// Restarts the peak from the bytes held now (any thread).
    pub(crate) fn reset_peak(&self) {
        let held: u64 = self.used().map(|(_, g)| g.held.load(Relaxed)).sum();
        self.peak_bytes.store(held, Relaxed);
    }

    /// The bytes on each device the cache has used (fields read one by one).
    pub(crate) fn device_bytes(&self) -> impl Iterator<Item = (Device, DeviceBytes)> {
        self.used().map(|(code, g)| {
            (
                device_of(code),
                DeviceBytes {
                    held: g.held.load(Relaxed) as usize,
                    cached: g.cached.load(Relaxed) as usize,
                    waiting: g.waiting.load(Relaxed) as usize,
                },
            )
        })
    }

    /// A snapshot (fields read one by one: exact when read by the lock holder).
    pub(crate) fn snapshot(&self) -> CacheStats {
        let (held, cached) = self
            .device_bytes()
            .fold((0, 0), |(h, c), (_, b)| (h + b.held, c + b.cached));
        CacheStats {
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            device_allocs: self.device_allocs.load(Relaxed),
            device_frees: self.device_frees.load(Relaxed),
            bytes_in_use: held.saturating_sub(cached),
            bytes_cached: cached,
            peak_bytes: self.peak_bytes.load(Relaxed) as usize,
            invalidations: self.invalidations.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
        }
    }
}

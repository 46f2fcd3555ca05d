//! What the caches report: [`CacheStats`] (one cache), [`DeviceStats`] (a backend),
//! [`Snapshot`] (every cache of every thread). The table [`summary`](crate::summary) prints is
//! in [`table`](mod@table); the live counters a cache keeps are the cache's own (`cache::counters`).

mod table;

use std::fmt;

use crate::Device;
pub(crate) use table::Bytes;
use table::table;

/// A snapshot of one cache's counters (see [`stats`](crate::stats)).
///
/// Bytes are buffer capacities: under [`KeyPolicy::SizeClass`](crate::KeyPolicy::SizeClass) a
/// buffer can be larger than the array in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheStats {
    /// Allocations inside a scope of this cache served from its free lists.
    pub hits: u64,
    /// Allocations inside a scope of this cache that had to go to the device.
    pub misses: u64,
    /// Buffers this cache allocated from the device (one per miss).
    pub device_allocs: u64,
    /// Buffers this cache gave back to the device (invalidation, eviction, `empty_cache`,
    /// out-of-memory release, and arrays of an invalidated generation dropping).
    pub device_frees: u64,
    /// Bytes of buffers handed out and not yet free: owned by live arrays, or dropped inside a
    /// scope that has not exited yet (under [`Reuse::OnExit`](crate::Reuse::OnExit)).
    pub bytes_in_use: usize,
    /// Bytes of buffers in the free lists, ready for reuse.
    pub bytes_cached: usize,
    /// The most device memory this cache has held at once (`bytes_in_use + bytes_cached`).
    pub peak_bytes: usize,
    /// Calls of [`invalidate`](crate::invalidate) that reached this cache, each counted once
    /// (calls from other threads while the owner was inside a scope count when the scope exits,
    /// all served by one invalidation). A change of [`KeyPolicy`](crate::KeyPolicy) through
    /// [`configure`](crate::configure) empties the cache too but is no call, and is not counted.
    pub invalidations: u64,
    /// Free buffers given back because the cache was over its `max_cached_bytes`.
    pub evictions: u64,
}

impl CacheStats {
    /// The fraction of allocations served from the cache, in `[0, 1]` (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

impl fmt::Display for CacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hits {} misses {} ({:.1}% hit), device allocs {} frees {}, in use {}, cached {}, \
             peak {}, invalidations {}, evictions {}",
            self.hits,
            self.misses,
            self.hit_rate() * 100.0,
            self.device_allocs,
            self.device_frees,
            Bytes(self.bytes_in_use),
            Bytes(self.bytes_cached),
            Bytes(self.peak_bytes),
            self.invalidations,
            self.evictions,
        )
    }
}

/// What gpucache has done on one device, counted by the backend that serves it (see
/// [`device_stats`](crate::device_stats)): every allocation and free gpucache made there, cached
/// or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceStats {
    /// Buffers allocated from the device.
    pub allocs: u64,
    /// Buffers given back to the device.
    pub frees: u64,
    /// Bytes allocated and not yet given back.
    pub bytes_allocated: usize,
}

impl fmt::Display for DeviceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device allocs {} frees {}, {} allocated",
            self.allocs,
            self.frees,
            Bytes(self.bytes_allocated)
        )
    }
}

/// One row of a [`Snapshot`]: one cache of one thread.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotRow {
    /// The thread's name (`ThreadId(..)` for an unnamed thread).
    pub thread: String,
    /// A number that tells threads apart for the life of the process, also when they share a
    /// name (every tokio worker is `tokio-rt-worker`).
    pub thread_number: u64,
    /// Whether the thread has exited: the row holds the cache's counters since, which change
    /// only as its arrays still alive elsewhere drop (each is freed).
    pub exited: bool,
    /// The cache's name.
    pub cache: String,
    /// The cache's counters.
    pub stats: CacheStats,
}

/// What the caches of every thread hold on one device (see [`Snapshot::devices`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct DeviceUsage {
    /// The device.
    pub device: Device,
    /// Bytes of buffers handed out by caches and not yet free, summed over every live thread.
    pub bytes_in_use: usize,
    /// Bytes of buffers in the free lists of every live thread's caches.
    pub bytes_cached: usize,
}

/// A reading of every cache on every thread: made by [`snapshot`](crate::snapshot).
///
/// Counters of other threads are read without stopping them, so a row can be a few operations
/// behind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub(crate) rows: Vec<SnapshotRow>,
    pub(crate) devices: Vec<DeviceUsage>,
}

impl Snapshot {
    /// One row per (thread, cache), live threads first, each group sorted by thread and cache.
    pub fn rows(&self) -> &[SnapshotRow] {
        &self.rows
    }

    /// The counters of cache `name` summed over every thread, exited ones included. Counters
    /// and byte gauges are sums; `peak_bytes` is the sum of the threads' peaks (an upper bound of
    /// the process's peak for the name).
    pub fn total(&self, name: &str) -> CacheStats {
        self.rows
            .iter()
            .filter(|r| r.cache == name)
            .fold(CacheStats::default(), |acc, r| acc.plus(&r.stats))
    }

    /// Bytes in use and cached per device, summed over every cache of every live thread.
    pub fn devices(&self) -> &[DeviceUsage] {
        &self.devices
    }

    /// The usage of `device` (zero if no cache has used it).
    pub fn device(&self, device: Device) -> DeviceUsage {
        self.devices
            .iter()
            .find(|d| d.device == device)
            .copied()
            .unwrap_or(DeviceUsage {
                device,
                ..DeviceUsage::default()
            })
    }
}

impl fmt::Display for Snapshot {
    /// The table [`summary`](crate::summary) prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&table(&self.rows))
    }
}

impl CacheStats {
    /// What happened since `earlier` (a reading of the same cache): counters (hits, misses,
    /// device allocations and frees, invalidations, evictions) as the difference, byte gauges
    /// (`bytes_in_use`, `bytes_cached`, `peak_bytes`) as they are now. For per-epoch figures:
    ///
    /// ```
    /// use gpucache::{Array, Device};
    /// let before = gpucache::stats("since-doc");
    /// for _ in 0..3 {
    ///     let _scope = gpucache::enter("since-doc");
    ///     let _a = Array::<u8>::zeros(Device::Cpu, 64)?;
    /// }
    /// let epoch = gpucache::stats("since-doc").since(&before);
    /// // Two misses (the first step's array, then the plan's block, 256-byte aligned), one hit.
    /// assert_eq!((epoch.misses, epoch.hits, epoch.bytes_cached), (2, 1, 256));
    /// # Ok::<(), gpucache::Error>(())
    /// ```
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            device_allocs: self.device_allocs.saturating_sub(earlier.device_allocs),
            device_frees: self.device_frees.saturating_sub(earlier.device_frees),
            invalidations: self.invalidations.saturating_sub(earlier.invalidations),
            evictions: self.evictions.saturating_sub(earlier.evictions),
            ..*self
        }
    }

    /// Every field summed.
    pub(crate) fn plus(&self, other: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            device_allocs: self.device_allocs + other.device_allocs,
            device_frees: self.device_frees + other.device_frees,
            bytes_in_use: self.bytes_in_use + other.bytes_in_use,
            bytes_cached: self.bytes_cached + other.bytes_cached,
            peak_bytes: self.peak_bytes + other.peak_bytes,
            invalidations: self.invalidations + other.invalidations,
            evictions: self.evictions + other.evictions,
        }
    }
}

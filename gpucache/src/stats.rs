//! [`CacheStats`]: what a cache did, and the table [`summary`](crate::summary) prints.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

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
    /// Calls of [`invalidate`](crate::invalidate) on this cache.
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

/// A byte count printed in binary units (`1.5 MiB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bytes(pub usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut v = self.0 as f64;
        let mut unit = 0;
        while v >= 1024.0 && unit + 1 < UNITS.len() {
            v /= 1024.0;
            unit += 1;
        }
        let s = if unit == 0 {
            format!("{} B", self.0)
        } else {
            format!("{v:.1} {}", UNITS[unit])
        };
        f.pad(&s)
    }
}

/// The live counters of a cache. Only the thread holding the cache's lock writes them (plain
/// load and store, no read-modify-write on the hot path); any thread may read a snapshot.
///
/// Bytes in use are derived (`bytes_held - bytes_cached`), so a hit and a drop each update one
/// byte counter.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) device_allocs: AtomicU64,
    pub(crate) device_frees: AtomicU64,
    /// Bytes of every buffer this cache holds from the device, busy or free.
    pub(crate) bytes_held: AtomicU64,
    pub(crate) bytes_cached: AtomicU64,
    pub(crate) peak_bytes: AtomicU64,
    pub(crate) invalidations: AtomicU64,
    pub(crate) evictions: AtomicU64,
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
    /// Accounts a buffer newly allocated from the device, raising the peak if needed.
    #[inline]
    pub(crate) fn allocated(&self, bytes: usize) {
        add(&self.device_allocs, 1);
        add(&self.bytes_held, bytes);
        let held = self.bytes_held.load(Relaxed);
        if held > self.peak_bytes.load(Relaxed) {
            self.peak_bytes.store(held, Relaxed);
        }
    }

    /// Accounts a buffer given back to the device.
    #[inline]
    pub(crate) fn freed(&self, bytes: usize) {
        add(&self.device_frees, 1);
        sub(&self.bytes_held, bytes);
    }

    /// A snapshot (fields read one by one: exact when read by the lock holder).
    pub(crate) fn snapshot(&self) -> CacheStats {
        let cached = self.bytes_cached.load(Relaxed);
        CacheStats {
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            device_allocs: self.device_allocs.load(Relaxed),
            device_frees: self.device_frees.load(Relaxed),
            bytes_in_use: self.bytes_held.load(Relaxed).saturating_sub(cached) as usize,
            bytes_cached: cached as usize,
            peak_bytes: self.peak_bytes.load(Relaxed) as usize,
            invalidations: self.invalidations.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
        }
    }
}

/// One row of [`summary`](crate::summary).
pub(crate) struct Row {
    pub(crate) thread: String,
    pub(crate) cache: String,
    pub(crate) stats: CacheStats,
}

/// Formats rows as an aligned text table.
pub(crate) fn table(rows: &[Row]) -> String {
    use std::fmt::Write;
    let tw = rows
        .iter()
        .map(|r| r.thread.len())
        .max()
        .unwrap_or(0)
        .max(6);
    let cw = rows.iter().map(|r| r.cache.len()).max().unwrap_or(0).max(5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<tw$}  {:<cw$}  {:>10}  {:>8}  {:>6}  {:>8}  {:>8}  {:>10}  {:>10}  {:>10}  {:>5}  {:>6}",
        "thread",
        "cache",
        "hits",
        "misses",
        "hit%",
        "allocs",
        "frees",
        "in use",
        "cached",
        "peak",
        "inval",
        "evict",
    );
    for r in rows {
        let s = &r.stats;
        let _ = writeln!(
            out,
            "{:<tw$}  {:<cw$}  {:>10}  {:>8}  {:>6.1}  {:>8}  {:>8}  {:>10}  {:>10}  {:>10}  {:>5}  {:>6}",
            r.thread,
            r.cache,
            s.hits,
            s.misses,
            s.hit_rate() * 100.0,
            s.device_allocs,
            s.device_frees,
            Bytes(s.bytes_in_use),
            Bytes(s.bytes_cached),
            Bytes(s.peak_bytes),
            s.invalidations,
            s.evictions,
        );
    }
    if rows.is_empty() {
        out.push_str("(no caches)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_print_in_binary_units() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1536).to_string(), "1.5 KiB");
        assert_eq!(Bytes(64 << 20).to_string(), "64.0 MiB");
        assert_eq!(format!("{:>9}", Bytes(2048)), "  2.0 KiB");
    }

    #[test]
    fn display_names_every_counter() {
        let s = CacheStats {
            hits: 3,
            misses: 1,
            device_allocs: 1,
            device_frees: 0,
            bytes_in_use: 4096,
            bytes_cached: 0,
            peak_bytes: 4096,
            invalidations: 2,
            evictions: 5,
        };
        let text = s.to_string();
        for needle in [
            "hits 3",
            "misses 1",
            "75.0% hit",
            "in use 4.0 KiB",
            "invalidations 2",
            "evictions 5",
        ] {
            assert!(text.contains(needle), "{text:?} lacks {needle:?}");
        }
        let t = table(&[Row {
            thread: "main".into(),
            cache: "step".into(),
            stats: s,
        }]);
        assert!(t.lines().nth(1).unwrap().starts_with("main"), "{t}");
    }
}

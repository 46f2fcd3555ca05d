//! [`CacheStats`]: what a cache did, and the table [`summary`](crate::summary) prints.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::*};

use crate::Device;

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

/// One row of a [`Snapshot`]: one cache of one thread.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotRow {
    /// The thread's name (`ThreadId(..)` for an unnamed thread).
    pub thread: String,
    /// A number that tells threads apart for the life of the process, also when they share a
    /// name (every tokio worker is `tokio-rt-worker`).
    pub thread_number: u64,
    /// Whether the thread has exited: the row holds the cache's final counters.
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
    /// assert_eq!((epoch.misses, epoch.hits, epoch.bytes_cached), (1, 2, 64));
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

/// The widest a thread or cache name is printed in the table; longer ones are shortened.
const NAME_WIDTH: usize = 40;

/// `name`, shortened to at most `NAME_WIDTH` characters (with a `…` in the middle).
fn shorten(name: &str) -> String {
    let n = name.chars().count();
    if n <= NAME_WIDTH {
        return name.to_owned();
    }
    let head = (NAME_WIDTH - 1) / 2;
    let tail = NAME_WIDTH - 1 - head;
    let mut out: String = name.chars().take(head).collect();
    out.push('…');
    out.extend(name.chars().skip(n - tail));
    out
}

/// Formats rows as an aligned text table.
pub(crate) fn table(rows: &[SnapshotRow]) -> String {
    use std::fmt::Write;
    let threads: Vec<String> = rows
        .iter()
        .map(|r| {
            let exited = if r.exited { " (exited)" } else { "" };
            format!("{}#{}{exited}", shorten(&r.thread), r.thread_number)
        })
        .collect();
    let caches: Vec<String> = rows.iter().map(|r| shorten(&r.cache)).collect();
    let width = |names: &[String], min: usize| {
        names
            .iter()
            .map(|n| n.chars().count())
            .max()
            .unwrap_or(0)
            .max(min)
    };
    let (tw, cw) = (width(&threads, 6), width(&caches, 5));
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
    for ((r, thread), cache) in rows.iter().zip(&threads).zip(&caches) {
        let s = &r.stats;
        let _ = writeln!(
            out,
            "{thread:<tw$}  {cache:<cw$}  {:>10}  {:>8}  {:>6.1}  {:>8}  {:>8}  {:>10}  {:>10}  {:>10}  {:>5}  {:>6}",
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
    fn long_names_are_shortened_in_the_table() {
        let long = "x".repeat(70_000);
        let t = table(&[SnapshotRow {
            thread: long.clone(),
            thread_number: 7,
            exited: true,
            cache: format!("{long}end"),
            stats: CacheStats::default(),
        }]);
        let row = t.lines().nth(1).unwrap();
        assert!(row.len() < 200, "{row}");
        assert!(
            row.contains("…") && row.contains("#7 (exited)") && row.contains("xend"),
            "{row}"
        );
        assert_eq!(shorten("short"), "short");
        assert_eq!(shorten(&"é".repeat(41)).chars().count(), NAME_WIDTH);
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
        let t = table(&[SnapshotRow {
            thread: "main".into(),
            thread_number: 1,
            exited: false,
            cache: "step".into(),
            stats: s,
        }]);
        assert!(t.lines().nth(1).unwrap().starts_with("main#1 "), "{t}");
    }
}

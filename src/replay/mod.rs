//! An allocation log (a compact CSV made from a recorded `gpucache::trace::Trace`, as RMM's
//! logging adaptor writes one) and its replay, through gpucache with the recorded scopes or
//! through the bare backend.
//!
//! The log has one operation per line, in the order they happened (one thread's view: the
//! replay runs them on one thread):
//!
//! ```text
//! op,cache,buffer,bytes,elem,dims
//! enter,train_step,,,,
//! alloc,train_step,7,16777216,4,1024x4096
//! free,train_step,7,16777216,,
//! exit,train_step,,,,
//! invalidate,train_step,,,,
//! ```
//!
//! `buffer` numbers the live buffers (an `alloc` and the `free` that ends it share it); `elem`
//! is the element size in bytes and `dims` the array's shape (`x`-separated; empty for a
//! scalar), or, for a size-class cache, 1 and the class's bytes. Allocations outside any scope are not recorded, so not in
//! the log.
//!
//! Logs may be gzip-compressed (`*.csv.gz`). `examples/replay/record_torch.py` writes them from a
//! PyTorch model's device trace (elem 1, dims the block's bytes: torch gives no shape).
//!
//! A log is one thread's and one stream's view: a recording made with several threads or streams
//! (torch's trace holds every stream of the device) is replayed in the order it was written, on
//! one thread and the device's default stream. An `alloc` of a buffer number that is live is an
//! error when the log is read; a `free` of a buffer the log never allocated (one allocated before
//! the recording, or outside its scopes) is skipped. Zero-byte allocations are fine.

pub mod arena;
pub mod plan;

use std::collections::{HashMap, HashSet};
use std::error::Error;
use std::fmt::Write as _;
use std::path::Path;

use gpucache::trace::{EventKind, Trace, TraceKey};
use gpucache::{Array, CacheConfig, Device, KeyPolicy, Reuse, ScopeGuard, Shape};

/// The gpucache configurations the report replays every log under (a new policy is one line).
pub const CONFIGS: &[(&str, CacheConfig)] = &[
    (
        "planned (default)",
        config(Reuse::OnExit, KeyPolicy::Planned),
    ),
    ("exact/on-exit", config(Reuse::OnExit, KeyPolicy::Exact)),
    (
        "exact/immediate",
        config(Reuse::Immediate, KeyPolicy::Exact),
    ),
    (
        "size-class/on-exit",
        config(Reuse::OnExit, KeyPolicy::SizeClass),
    ),
    (
        "size-class/immediate",
        config(Reuse::Immediate, KeyPolicy::SizeClass),
    ),
];

const fn config(reuse: Reuse, key: KeyPolicy) -> CacheConfig {
    CacheConfig {
        reuse,
        key,
        max_cached_bytes: None,
    }
}

/// What reading and replaying a log return.
pub type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// One operation of a log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `enter`: a scope of the cache named.
    Enter(String),
    /// `exit`: the innermost scope, of the cache named.
    Exit(String),
    /// `alloc`: an array, in the cache of the innermost scope.
    Alloc {
        /// The cache the allocation was recorded in.
        cache: String,
        /// The buffer's number (its `free` names it too).
        buffer: u64,
        /// The bytes allocated.
        bytes: usize,
        /// The element size in bytes (with `dims`, the cache's key).
        elem: usize,
        /// The array's shape (empty for a scalar).
        dims: Vec<usize>,
    },
    /// `free`: the array of a live buffer drops.
    Free {
        /// The buffer's number.
        buffer: u64,
    },
    /// `invalidate` of the cache named.
    Invalidate(String),
}

/// The log of the events of `trace` recorded on `thread` (`None`: the thread with the most).
pub fn from_trace(trace: &Trace, thread: Option<u64>) -> Vec<Op> {
    let thread = thread.unwrap_or_else(|| {
        let mut counts: HashMap<u64, usize> = HashMap::new();
        for e in trace.events() {
            *counts.entry(e.thread).or_default() += 1;
        }
        counts
            .into_iter()
            .max_by_key(|&(_, n)| n)
            .map_or(0, |(t, _)| t)
    });
    // Buffers are renumbered 1, 2, ... in the order they are allocated.
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut next = 0;
    let mut ops = Vec::new();
    for e in trace.events().iter().filter(|e| e.thread == thread) {
        let cache = e.cache.as_deref().unwrap_or("").to_owned();
        match e.kind {
            EventKind::ScopeEnter => ops.push(Op::Enter(cache)),
            EventKind::ScopeExit => ops.push(Op::Exit(cache)),
            EventKind::Invalidate => ops.push(Op::Invalidate(cache)),
            EventKind::Miss | EventKind::Hit => {
                let Some(id) = e.buffer else { continue };
                next += 1;
                live.insert(id, next);
                let (elem, dims) = match &e.key {
                    Some(TraceKey::Exact { dtype, shape }) => {
                        (dtype.size_in_bytes(), shape.dims().to_vec())
                    }
                    _ => (1, vec![e.bytes]),
                };
                ops.push(Op::Alloc {
                    cache,
                    buffer: next,
                    bytes: e.bytes,
                    elem,
                    dims,
                });
            }
            // The drop of a live array: back to its cache, to another thread's, or (an earlier
            // generation's) to the device.
            EventKind::FreeToCache | EventKind::Returned | EventKind::DeviceFree => {
                if let Some(buffer) = e.buffer.and_then(|id| live.remove(&id)) {
                    ops.push(Op::Free { buffer });
                }
            }
            _ => {}
        }
    }
    ops
}

/// The log as CSV text.
pub fn to_csv(ops: &[Op]) -> String {
    let mut out = String::from("op,cache,buffer,bytes,elem,dims\n");
    for op in ops {
        let _ = match op {
            Op::Enter(c) => writeln!(out, "enter,{c},,,,"),
            Op::Exit(c) => writeln!(out, "exit,{c},,,,"),
            Op::Invalidate(c) => writeln!(out, "invalidate,{c},,,,"),
            Op::Alloc {
                cache,
                buffer,
                bytes,
                elem,
                dims,
            } => {
                let dims: Vec<String> = dims.iter().map(ToString::to_string).collect();
                writeln!(
                    out,
                    "alloc,{cache},{buffer},{bytes},{elem},{}",
                    dims.join("x")
                )
            }
            Op::Free { buffer } => writeln!(out, "free,,{buffer},,,"),
        };
    }
    out
}

/// Reads a log written by [`to_csv`], gzip-compressed when its name ends in `.gz`.
pub fn read(path: &Path) -> Result<Vec<Op>> {
    let text = if path.extension().is_some_and(|e| e == "gz") {
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut flate2::read::GzDecoder::new(std::fs::File::open(path)?),
            &mut text,
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
        text
    } else {
        std::fs::read_to_string(path)?
    };
    let mut ops = Vec::new();
    let mut live = std::collections::HashSet::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        let bad = || format!("{}:{}: not a log line: {line:?}", path.display(), n + 1);
        let f: Vec<&str> = line.split(',').collect();
        let [op, cache, buffer, bytes, elem, dims] = f.as_slice() else {
            return Err(bad().into());
        };
        let num = |s: &str| s.parse::<u64>().map_err(|_| bad());
        let cache = (*cache).to_owned();
        ops.push(match *op {
            "enter" => Op::Enter(cache),
            "exit" => Op::Exit(cache),
            "invalidate" => Op::Invalidate(cache),
            "alloc" if !live.insert(num(buffer)?) => {
                return Err(format!("{}: buffer {buffer} allocated while live", bad()).into());
            }
            "alloc" => Op::Alloc {
                cache,
                buffer: num(buffer)?,
                bytes: num(bytes)? as usize,
                elem: num(elem)? as usize,
                dims: dims
                    .split('x')
                    .filter(|d| !d.is_empty())
                    .map(|d| num(d).map(|d| d as usize))
                    .collect::<std::result::Result<_, _>>()?,
            },
            "free" => {
                let buffer = num(buffer)?;
                live.remove(&buffer);
                Op::Free { buffer }
            }
            _ => return Err(bad().into()),
        });
    }
    Ok(ops)
}

/// Where the replay's allocations go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Through gpucache, in the recorded scopes, as the caches are configured.
    Gpucache,
    /// Through gpucache, every cache of the log configured so first (see [`CONFIGS`]). On CUDA
    /// its device allocations go to the device's default pool at cudarc's release threshold, 0:
    /// memory freed is unmapped at each step's synchronisation.
    Configured(CacheConfig),
    /// CUDA only: as `Configured`, over the default pool with its release threshold at
    /// `threshold` bytes (trimmed first); the peak is the device memory in use above the
    /// replay's start (`cuMemGetInfo`, read after every allocation): what the pool keeps of
    /// gpucache's freed blocks is held too, and so are the plan blocks gpucache maps outside
    /// the pool (CUDA's virtual memory management), which the pool's own counters leave out.
    ConfiguredOverPool {
        /// The caches' configuration.
        config: CacheConfig,
        /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
        threshold: u64,
    },
    /// Straight to the backend: host memory (64-byte aligned) or cudarc's stream-ordered
    /// allocation (`cuMemAllocAsync`) on the device's default stream, uninitialised, no cache.
    Bare,
    /// CUDA only: as `Bare`, with the release threshold of the device's default memory pool set
    /// to `threshold` bytes (cudarc leaves it at 0; `u64::MAX` keeps everything freed), the pool
    /// trimmed first (a cold start) and the peak taken from its reserved high-water mark.
    Pool {
        /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
        threshold: u64,
    },
}

/// A buffer of the bare replay.
enum Bare {
    Host(std::ptr::NonNull<u8>, std::alloc::Layout),
    #[cfg(feature = "cuda")]
    #[allow(dead_code, reason = "held for its drop, which frees it on its stream")]
    Cuda(gpucache::cuda::cudarc::driver::CudaSlice<u8>),
}

impl Drop for Bare {
    #[cfg_attr(not(feature = "cuda"), allow(irrefutable_let_patterns))]
    fn drop(&mut self) {
        if let Bare::Host(ptr, layout) = self {
            // SAFETY: allocated with this layout by `bare_alloc`, freed once, here.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), *layout) };
        }
    }
}

/// A bare buffer of `bytes` bytes (one byte at least: neither backend takes zero).
fn bare_alloc(dev: Device, bytes: usize) -> Result<Bare> {
    match dev {
        Device::Cpu => {
            let layout = std::alloc::Layout::from_size_align(bytes.max(1), 64)?;
            // SAFETY: the layout has a nonzero size.
            let ptr = unsafe { std::alloc::alloc(layout) };
            let ptr = std::ptr::NonNull::new(ptr).ok_or("host allocation failed")?;
            Ok(Bare::Host(ptr, layout))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let stream = gpucache::cuda::default_stream(dev)?;
            // SAFETY: the replay never reads the buffer.
            Ok(Bare::Cuda(unsafe { stream.alloc::<u8>(bytes.max(1)) }?))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err("this build has no CUDA".into()),
    }
}

/// The default memory pool of a CUDA device: its release threshold, trimming, and the reserved
/// high-water mark.
#[cfg(feature = "cuda")]
mod pool {
    use gpucache::Device;
    use gpucache::cuda::cudarc::driver::result;
    use gpucache::cuda::cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool};

    use super::Result;

    fn get(dev: Device) -> Result<CUmemoryPool> {
        let ctx = gpucache::cuda::context(dev)?;
        ctx.bind_to_thread()?;
        // SAFETY: the device comes from a live context, bound to this thread.
        Ok(unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }?)
    }

    /// Sets the release threshold, trims the pool to nothing after a synchronisation (a cold
    /// start) and resets the reserved high-water mark to what stays reserved.
    pub fn reset(dev: Device, threshold: u64) -> Result<()> {
        gpucache::cuda::default_stream(dev)?.synchronize()?;
        let pool = get(dev)?;
        let mut value = threshold;
        let mut zero = 0u64;
        // SAFETY: both attributes take a `u64` (cuuint64_t), alive for the call; the pool is the
        // device's default one.
        unsafe {
            let attr = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            result::mem_pool::set_attribute(pool, attr, (&raw mut value).cast())?;
            result::mem_pool::trim_to(pool, 0)?;
            let attr = CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH;
            result::mem_pool::set_attribute(pool, attr, (&raw mut zero).cast())?;
        }
        Ok(())
    }

    /// The device's memory in use, in bytes (all of it: the pool's reserve and memory mapped
    /// outside the pool).
    pub fn used(dev: Device) -> Result<usize> {
        get(dev)?;
        let (free, total) = result::mem_get_info()?;
        Ok(total - free)
    }

    /// The reserved high-water mark since the last [`reset`].
    pub fn peak(dev: Device) -> Result<u64> {
        read(dev, CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
    }

    fn read(dev: Device, attr: CUmemPool_attribute) -> Result<u64> {
        let pool = get(dev)?;
        let mut value = 0u64;
        // SAFETY: the attribute is a `u64` (cuuint64_t), written into `value`.
        unsafe { result::mem_pool::get_attribute(pool, attr, (&raw mut value).cast()) }?;
        Ok(value)
    }
}

/// What one replay measured.
#[derive(Clone, Debug, Default)]
pub struct Replay {
    /// Wall time of the whole log, seconds.
    pub seconds: f64,
    /// The most bytes allocated from the device at once (gpucache: what its caches and arrays
    /// held, as the backend counts it, above what it held before; bare: the live buffers' bytes;
    /// pool: its reserved high-water mark).
    pub peak_bytes: usize,
    /// Device allocations made (bare and pool: every allocation).
    pub device_allocs: u64,
    /// Per outermost scope (a step), in order: device allocations made inside it.
    pub step_allocs: Vec<u64>,
    /// Per outermost scope: its wall time, from the entry to the synchronisation after its exit.
    pub step_seconds: Vec<f64>,
}

impl Replay {
    /// Device allocations made in the steps after the second (a planned cache's first step
    /// records, its second makes the plan's block).
    pub fn allocs_after_step2(&self) -> u64 {
        self.step_allocs.iter().skip(2).sum()
    }

    /// Device allocations made in the second half of the steps (steps `n / 2..` of `n`): what a
    /// long run's steady state allocates, where every kind of step has come before.
    pub fn allocs_in_second_half(&self) -> u64 {
        let n = self.step_allocs.len();
        self.step_allocs[n / 2..].iter().sum()
    }
}

/// The most bytes of the log's buffers alive at once: the lower bound of any allocator's peak.
pub fn peak_live(ops: &[Op]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    let mut sizes: HashMap<u64, usize> = HashMap::new();
    for op in ops {
        match op {
            Op::Alloc { buffer, bytes, .. } => {
                if let Some(old) = sizes.insert(*buffer, *bytes) {
                    live -= old;
                }
                live += bytes;
                peak = peak.max(live);
            }
            Op::Free { buffer } => live -= sizes.remove(buffer).unwrap_or(0),
            _ => {}
        }
    }
    peak
}

/// The outermost scopes (steps) of the log.
pub fn steps(ops: &[Op]) -> usize {
    let mut depth = 0usize;
    let mut n = 0;
    for op in ops {
        match op {
            Op::Enter(_) => {
                n += usize::from(depth == 0);
                depth += 1;
            }
            Op::Exit(_) => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    n
}

/// A longer run of the steps of `ops` (a log derived from a recording, not one): the log as it
/// is, then `passes` more passes over its steps after the first, each in an order shuffled with
/// `seed` (the first step makes what only a first step makes, and what it keeps lives to the end
/// of the log). The steps of a model whose batch or length varies come in any order in a long
/// run; a short recording shows a few. Buffers are numbered anew. An array a step keeps past its
/// end is freed by the next free, in a later step, of an array of an earlier step, the oldest
/// first (a step frees its predecessor's input); and at the end of a step, the oldest such
/// arrays are freed while more are alive than the recording held after that step (arrays of its
/// steps after the first), so that the run holds as many arrays across steps as
/// the recording, whatever the order. Without that last rule a run drifted: every pass kept as
/// many arrays more as the recording's last step kept more than its first (whose arrays live to
/// the end, and which the recording's second step freed): Keypoint R-CNN, whose recording has at
/// most 15 arrays alive between two steps (its outputs), had up to 80 in a run five passes
/// longer. Operations after the last step are dropped.
pub fn reordered(ops: &[Op], passes: usize, seed: u64) -> Vec<Op> {
    let mut steps: Vec<&[Op]> = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Enter(_) => depth += 1,
            Op::Exit(_) if depth == 1 => {
                depth = 0;
                steps.push(&ops[start..=i]);
                start = i + 1;
            }
            Op::Exit(_) => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    let mut order: Vec<usize> = (0..steps.len()).collect();
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..passes {
        let mut pass: Vec<usize> = (1..steps.len()).collect();
        rng.shuffle(&mut pass);
        order.extend(pass);
    }
    let held = held_across(&steps);
    let mut out = Vec::new();
    let mut next = 0u64;
    // Kept past their step: freed by later steps (oldest first), or at the end.
    let (mut kept, mut to_end) = (std::collections::VecDeque::new(), Vec::new());
    for &s in &order {
        // This step's buffers (recorded number -> new number), in the order they were made.
        let mut own: Vec<(u64, u64)> = Vec::new();
        for op in steps[s] {
            match op {
                Op::Alloc { buffer, .. } => {
                    own.push((*buffer, next));
                    let mut op = op.clone();
                    if let Op::Alloc { buffer, .. } = &mut op {
                        *buffer = next;
                    }
                    out.push(op);
                    next += 1;
                }
                Op::Free { buffer } => {
                    let freed = match own.iter().position(|&(b, _)| b == *buffer) {
                        Some(i) => Some(own.remove(i).1),
                        None => kept.pop_front(),
                    };
                    out.extend(freed.map(|buffer| Op::Free { buffer }));
                }
                op => out.push(op.clone()),
            }
        }
        let left = own.into_iter().map(|(_, b)| b);
        if s == 0 {
            to_end.extend(left);
        } else {
            kept.extend(left);
            // Before the step's exit, its last operation.
            let exit = out.pop();
            while kept.len() > held[s] {
                out.extend(kept.pop_front().map(|buffer| Op::Free { buffer }));
            }
            out.extend(exit);
        }
    }
    out.extend(
        kept.into_iter()
            .chain(to_end)
            .map(|buffer| Op::Free { buffer }),
    );
    out
}

/// For each step of a log (`steps`, as [`reordered`] splits it), how many arrays made by its
/// steps after the first are alive at its end: the arrays the recording holds across steps,
/// besides what its first step keeps.
fn held_across(steps: &[&[Op]]) -> Vec<usize> {
    let mut alive = HashSet::new();
    let mut held = Vec::with_capacity(steps.len());
    for (s, ops) in steps.iter().enumerate() {
        for op in *ops {
            match op {
                Op::Alloc { buffer, .. } if s > 0 => {
                    alive.insert(*buffer);
                }
                Op::Free { buffer } => {
                    alive.remove(buffer);
                }
                _ => {}
            }
        }
        held.push(alive.len());
    }
    held
}

/// The memory figures of one replay of `ops` on `dev` in `mode`, from cold caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memory {
    /// The replay's [`Replay::peak_bytes`].
    pub peak_device: usize,
    /// [`peak_live`]: the lower bound.
    pub peak_live: usize,
    /// Device allocations made in the steps after the second ([`Replay::allocs_after_step2`]).
    pub allocs_after_step2: u64,
    /// Device allocations made in the second half of the steps
    /// ([`Replay::allocs_in_second_half`]).
    pub allocs_in_second_half: u64,
}

/// Whether a replay through gpucache follows its peak (reading the backend's bytes after every
/// allocation, which costs host time the bare and pool replays do not pay; those follow theirs
/// for free), and whether it checks its arrays' memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peak {
    /// [`Replay::peak_bytes`] is the peak.
    Tracked,
    /// As `Tracked`, and every array of a replay through gpucache is written at both ends, its
    /// own tags (8 bytes each, from its number in the replay), through the device's API (a
    /// cudarc view on CUDA), and read back when it drops (or at the end): a replay whose array
    /// was handed bytes another live array holds, or a view that does not reach its array's
    /// end, fails with an error that names the array.
    Checked,
    /// [`Replay::peak_bytes`] is 0 for a replay through gpucache (for timing).
    Untracked,
}

/// The tags of array `n` of a checked replay ([`Peak::Checked`]), for its head and its tail.
fn tags(n: u64) -> [[u8; 8]; 2] {
    [n.to_le_bytes(), (!n).to_le_bytes()]
}

/// Where the tags go in an array of `len` bytes, `(offset, length)`: its first 8 bytes (as many
/// as it has, if fewer) and, for an array of 16 bytes or more, its last 8.
fn tag_spans(len: usize) -> impl Iterator<Item = (usize, usize)> {
    let head = (0, len.min(8));
    let tail = (len.saturating_sub(8), if len >= 16 { 8 } else { 0 });
    [head, tail].into_iter().filter(|&(_, n)| n > 0)
}

/// Writes array `n`'s tags into `a` (see [`Peak::Checked`]).
fn write_tags(a: &mut Array<u8>, n: u64) -> Result<()> {
    let len = a.len();
    if len == 0 {
        return Ok(());
    }
    let tags = tags(n);
    #[cfg(feature = "cuda")]
    if a.device().is_cuda() {
        let stream = gpucache::cuda::current_stream(a.device())?;
        let mut view = a.cuda_view_mut()?;
        for ((at, k), tag) in tag_spans(len).zip(tags) {
            stream.memcpy_htod(&tag[..k], &mut view.slice_mut(at..at + k))?;
        }
        return Ok(());
    }
    let bytes = a.as_mut_slice()?;
    for ((at, k), tag) in tag_spans(len).zip(tags) {
        bytes[at..at + k].copy_from_slice(&tag[..k]);
    }
    Ok(())
}

/// Checks that `a` still holds array `n`'s tags (see [`Peak::Checked`]).
fn check_tags(a: &Array<u8>, n: u64) -> Result<()> {
    let len = a.len();
    for ((at, k), tag) in tag_spans(len).zip(tags(n)) {
        #[cfg(feature = "cuda")]
        let got: Vec<u8> = if a.device().is_cuda() {
            let stream = gpucache::cuda::current_stream(a.device())?;
            let got = stream.clone_dtoh(&a.cuda_view()?.slice(at..at + k))?;
            stream.synchronize()?;
            got
        } else {
            a.as_slice()?[at..at + k].to_vec()
        };
        #[cfg(not(feature = "cuda"))]
        let got: Vec<u8> = a.as_slice()?[at..at + k].to_vec();
        if got[..] != tag[..k] {
            return Err(format!(
                "array {n} of the replay ({len} bytes) was overwritten at byte {at} while alive: \
                 {got:?} where it wrote {:?}",
                &tag[..k]
            )
            .into());
        }
    }
    Ok(())
}

/// [`replay`] on a new thread, so from fresh caches (a cache's state, an arena's block sizes
/// say, outlives `empty_cache`); what they hold goes back to the device when the thread exits,
/// before this returns.
pub fn replay_cold(ops: &[Op], dev: Device, mode: Mode, peak: Peak) -> Result<Replay> {
    std::thread::scope(|s| {
        s.spawn(|| replay_with(ops, dev, mode, peak).map_err(|e| e.to_string()))
            // An explicit join waits for the thread's thread-local destructors too.
            .join()
            .map_err(|_| "the replay panicked".to_owned())?
    })
    .map_err(Into::into)
}

/// Replays `ops` once on `dev` in `mode` from cold ([`replay_cold`], between two
/// `empty_cache`s), its arrays' memory checked ([`Peak::Checked`]), and returns its memory
/// figures (deterministic on the CPU, when nothing else uses gpucache meanwhile).
pub fn memory(ops: &[Op], dev: Device, mode: Mode) -> Result<Memory> {
    gpucache::empty_cache();
    let r = replay_cold(ops, dev, mode, Peak::Checked);
    gpucache::empty_cache();
    let r = r?;
    Ok(Memory {
        peak_device: r.peak_bytes,
        peak_live: peak_live(ops),
        allocs_after_step2: r.allocs_after_step2(),
        allocs_in_second_half: r.allocs_in_second_half(),
    })
}

/// Replays `ops` on `dev` in `mode`. On CUDA the device is synchronised at every outermost
/// scope exit, as a training step ends (in every mode).
pub fn replay(ops: &[Op], dev: Device, mode: Mode) -> Result<Replay> {
    replay_with(ops, dev, mode, Peak::Tracked)
}

/// One operation of a log made ready for the timed replay.
enum Ready<'a> {
    Enter(&'a str),
    Exit,
    Invalidate(&'a str),
    /// The shape: u8 elements, the element size as a last dimension (the same key for the same
    /// element size and shape).
    Alloc {
        slot: usize,
        bytes: usize,
        shape: Shape,
    },
    Free {
        slot: usize,
    },
    /// A `free` of a buffer the log never allocated.
    Skip,
}

/// A log made ready: its operations, and how many slots hold its live buffers at once.
struct Prepared<'a> {
    ops: Vec<Ready<'a>>,
    slots: usize,
}

/// `ops` made ready for [`replay_with`]: each live buffer gets a slot (a freed buffer's slot
/// serves the next one), so that the replay keeps its arrays in a vector rather than a map.
fn prepare(ops: &[Op]) -> Prepared<'_> {
    let mut slot_of: HashMap<u64, usize> = HashMap::new();
    let (mut free, mut slots) = (Vec::new(), 0usize);
    let ops = ops
        .iter()
        .map(|op| match op {
            Op::Enter(cache) => Ready::Enter(cache),
            Op::Exit(_) => Ready::Exit,
            Op::Invalidate(cache) => Ready::Invalidate(cache),
            Op::Alloc {
                buffer,
                bytes,
                elem,
                dims,
                ..
            } => {
                // A buffer number allocated again while live keeps its slot (see the replay).
                let slot = *slot_of.entry(*buffer).or_insert_with(|| {
                    free.pop().unwrap_or_else(|| {
                        slots += 1;
                        slots - 1
                    })
                });
                let mut shape = dims.clone();
                shape.push(*elem);
                Ready::Alloc {
                    slot,
                    bytes: *bytes,
                    shape: shape.into(),
                }
            }
            Op::Free { buffer } => match slot_of.remove(buffer) {
                Some(slot) => {
                    free.push(slot);
                    Ready::Free { slot }
                }
                None => Ready::Skip,
            },
        })
        .collect();
    Prepared { ops, slots }
}

/// [`replay`], following the peak of a replay through gpucache and checking its arrays' memory
/// or not (`track`).
pub fn replay_with(ops: &[Op], dev: Device, mode: Mode, track: Peak) -> Result<Replay> {
    enum Live {
        /// With its number in the replay.
        Cached(Array<u8>, u64),
        Bare(Bare, usize),
    }
    let checked = track == Peak::Checked;
    let mut made = 0u64;
    let cached = matches!(
        mode,
        Mode::Gpucache | Mode::Configured(_) | Mode::ConfiguredOverPool { .. }
    );
    if let Mode::Configured(config) | Mode::ConfiguredOverPool { config, .. } = mode {
        let mut names: Vec<&str> = ops
            .iter()
            .filter_map(|op| match op {
                Op::Enter(c) | Op::Alloc { cache: c, .. } => Some(c.as_str()),
                _ => None,
            })
            .collect();
        names.sort_unstable();
        names.dedup();
        for name in names {
            gpucache::configure(name, config);
        }
    }
    match mode {
        #[cfg(feature = "cuda")]
        Mode::Pool { threshold } | Mode::ConfiguredOverPool { threshold, .. } if dev.is_cuda() => {
            pool::reset(dev, threshold)?;
        }
        Mode::Pool { .. } | Mode::ConfiguredOverPool { .. } => {
            return Err("the pool replay needs a CUDA device".into());
        }
        // gpucache allocates from the same pool: at cudarc's default threshold, from cold.
        #[cfg(feature = "cuda")]
        Mode::Configured(_) | Mode::Bare if dev.is_cuda() => pool::reset(dev, 0)?,
        _ => {}
    }
    // The operations made ready before the clock starts (shapes built, buffer numbers turned
    // into slots of a vector), so that the timed loop costs the allocator, not the harness.
    let prepared = prepare(ops);
    let mut live: Vec<Option<Live>> = Vec::new();
    live.resize_with(prepared.slots, || None);
    let mut scopes: Vec<ScopeGuard> = Vec::new();
    let mut depth = 0usize;
    let before = gpucache::device_stats(dev)?;
    // What gpucache holds above the start: its backend's bytes, or over a pool, the device's
    // memory in use (the pool's reserve and the blocks mapped outside it).
    #[cfg(feature = "cuda")]
    let over_pool = match mode {
        Mode::ConfiguredOverPool { .. } if dev.is_cuda() => Some(pool::used(dev)?),
        _ => None,
    };
    let held_now = || -> Result<usize> {
        #[cfg(feature = "cuda")]
        if let Some(start) = over_pool {
            return Ok(pool::used(dev)?.saturating_sub(start));
        }
        let held = gpucache::device_stats(dev)?.bytes_allocated;
        Ok(held.saturating_sub(before.bytes_allocated))
    };
    let (mut bare_bytes, mut peak, mut bare_allocs) = (0usize, 0usize, 0u64);
    let mut steps = (Vec::new(), Vec::new());
    let (mut step_start, mut step_allocs_before) = (std::time::Instant::now(), 0u64);
    let sync = || -> Result<()> {
        #[cfg(feature = "cuda")]
        if dev.is_cuda() {
            gpucache::cuda::default_stream(dev)?.synchronize()?;
        }
        Ok(())
    };
    let allocs_now = |bare_allocs: u64| -> Result<u64> {
        Ok(if cached {
            gpucache::device_stats(dev)?.allocs - before.allocs
        } else {
            bare_allocs
        })
    };
    let start = std::time::Instant::now();
    for op in &prepared.ops {
        match op {
            Ready::Enter(cache) => {
                if depth == 0 {
                    step_start = std::time::Instant::now();
                    step_allocs_before = allocs_now(bare_allocs)?;
                }
                depth += 1;
                if cached {
                    scopes.push(gpucache::enter(cache));
                }
            }
            Ready::Exit => {
                depth = depth.saturating_sub(1);
                scopes.pop();
                if depth == 0 {
                    sync()?;
                    steps.0.push(allocs_now(bare_allocs)? - step_allocs_before);
                    steps.1.push(step_start.elapsed().as_secs_f64());
                }
            }
            Ready::Invalidate(cache) => {
                if cached {
                    gpucache::invalidate(cache);
                }
            }
            Ready::Alloc { slot, bytes, shape } => {
                let array = if cached {
                    let mut a = Array::<u8>::empty(dev, shape)?;
                    if track != Peak::Untracked {
                        peak = peak.max(held_now()?);
                    }
                    made += 1;
                    if checked {
                        write_tags(&mut a, made)?;
                    }
                    Live::Cached(a, made)
                } else {
                    bare_bytes += bytes;
                    bare_allocs += 1;
                    peak = peak.max(bare_bytes);
                    Live::Bare(bare_alloc(dev, *bytes)?, *bytes)
                };
                // A buffer number allocated again while live (not in a log `read` accepts)
                // ends the earlier buffer.
                if let Some(Live::Bare(_, old)) = live[*slot].replace(array) {
                    bare_bytes -= old;
                }
            }
            Ready::Free { slot } => match live[*slot].take() {
                Some(Live::Bare(b, bytes)) => {
                    bare_bytes -= bytes;
                    drop(b);
                }
                Some(Live::Cached(a, n)) => {
                    if checked {
                        check_tags(&a, n)?;
                    }
                    drop(a);
                }
                None => {}
            },
            Ready::Skip => {}
        }
    }
    if checked {
        for l in live.iter().flatten() {
            if let Live::Cached(a, n) = l {
                check_tags(a, *n)?;
            }
        }
    }
    drop(live);
    while scopes.pop().is_some() {}
    sync()?;
    let seconds = start.elapsed().as_secs_f64();
    #[cfg(feature = "cuda")]
    if let Mode::Pool { .. } = mode {
        peak = usize::try_from(pool::peak(dev)?)?;
    }
    Ok(Replay {
        seconds,
        peak_bytes: peak,
        device_allocs: allocs_now(bare_allocs)?,
        step_allocs: steps.0,
        step_seconds: steps.1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of `kept.len()` steps: step `s` frees what the step before kept (at its start),
    /// makes one temporary, and keeps `kept[s]` arrays past its end.
    fn log_keeping(kept: &[usize]) -> Vec<Op> {
        let mut ops = Vec::new();
        let (mut next, mut before) = (0u64, Vec::new());
        let mut alloc = |ops: &mut Vec<Op>| {
            next += 1;
            ops.push(Op::Alloc {
                cache: "step".into(),
                buffer: next,
                bytes: 256,
                elem: 4,
                dims: vec![64],
            });
            next
        };
        for &k in kept {
            ops.push(Op::Enter("step".into()));
            ops.extend(before.drain(..).map(|buffer| Op::Free { buffer }));
            let temporary = alloc(&mut ops);
            before = (0..k).map(|_| alloc(&mut ops)).collect();
            ops.push(Op::Free { buffer: temporary });
            ops.push(Op::Exit("step".into()));
        }
        ops
    }

    /// The arrays alive at the end of each step of `ops`.
    fn alive_at_step_ends(ops: &[Op]) -> Vec<usize> {
        let (mut alive, mut ends) = (HashSet::new(), Vec::new());
        for op in ops {
            match op {
                Op::Alloc { buffer, .. } => {
                    alive.insert(*buffer);
                }
                Op::Free { buffer } => {
                    alive.remove(buffer);
                }
                Op::Exit(_) => ends.push(alive.len()),
                _ => {}
            }
        }
        ends
    }

    /// A long run holds no more arrays across steps than the recording did, whatever the order:
    /// the recording's last step keeps more arrays than its first, and without the rule that
    /// frees the oldest at a step's end, each pass would keep 5 more (32 alive at the run's end,
    /// seed 1). Its first steps are the recording's (but for what the first step keeps,
    /// alive to the end), and every array is freed once.
    #[test]
    fn a_long_run_holds_as_many_arrays_across_steps_as_the_recording() {
        let kept = [1, 2, 3, 2, 6];
        let ops = log_keeping(&kept);
        // The first step's array lives to the end of the run.
        let recorded: Vec<usize> = (alive_at_step_ends(&ops).into_iter().enumerate())
            .map(|(s, n)| if s == 0 { n } else { n + kept[0] })
            .collect();
        let most = *recorded.iter().max().unwrap();
        for seed in [1, 7, 11] {
            let long = reordered(&ops, 5, seed);
            assert_eq!(steps(&long), 25, "seed {seed}");
            let ends = alive_at_step_ends(&long);
            assert_eq!(ends[..5], recorded[..], "seed {seed}: the recording first");
            assert!(
                ends.iter().all(|&n| n <= most),
                "seed {seed}: {ends:?}, the recording held at most {most}"
            );
            let (allocs, frees) = long.iter().fold((0, 0), |(a, f), op| match op {
                Op::Alloc { .. } => (a + 1, f),
                Op::Free { .. } => (a, f + 1),
                _ => (a, f),
            });
            assert_eq!(allocs, frees, "seed {seed}: every array freed once");
        }
    }

    /// The tags of a checked replay are found as written, at both ends of an array of 16 bytes
    /// or more and once in a smaller one, and a byte of either end overwritten is reported with
    /// the array's number.
    #[test]
    fn checked_tags_find_an_array_overwritten_at_either_end() {
        for len in [1usize, 7, 8, 15, 16, 100] {
            let mut a = Array::<u8>::zeros(Device::Cpu, len).unwrap();
            write_tags(&mut a, 41).unwrap();
            check_tags(&a, 41).unwrap();
            assert!(
                check_tags(&a, 42).is_err(),
                "another array's tags ({len} bytes)"
            );
            for at in [0, len - 1] {
                let mut b = Array::<u8>::zeros(Device::Cpu, len).unwrap();
                write_tags(&mut b, 41).unwrap();
                b.as_mut_slice().unwrap()[at] ^= 0xff;
                // A byte between the tags (of an array of more than 16 bytes) is not looked at.
                let tagged = at < 8 || len >= 16 && at >= len - 8;
                let e = check_tags(&b, 41);
                assert_eq!(e.is_err(), tagged, "byte {at} of {len}");
                if let Err(e) = e {
                    assert!(e.to_string().contains("array 41"), "{e}");
                }
            }
        }
    }
}

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
#![allow(dead_code)] // each example uses a part

use std::collections::HashMap;
use std::error::Error;
use std::fmt::Write as _;
use std::path::Path;

use gpucache::trace::{EventKind, Trace, TraceKey};
use gpucache::{Array, Device, ScopeGuard};

pub type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// One operation of a log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Enter(String),
    Exit(String),
    Alloc {
        cache: String,
        buffer: u64,
        bytes: usize,
        /// The element size and shape (for the cache's key).
        elem: usize,
        dims: Vec<usize>,
    },
    Free {
        buffer: u64,
    },
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

/// Reads a log written by [`to_csv`].
pub fn read(path: &Path) -> Result<Vec<Op>> {
    let text = std::fs::read_to_string(path)?;
    let mut ops = Vec::new();
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
            "free" => Op::Free {
                buffer: num(buffer)?,
            },
            _ => return Err(bad().into()),
        });
    }
    Ok(ops)
}

/// Where the replay's allocations go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Through gpucache, in the recorded scopes.
    Gpucache,
    /// Straight to the backend: host memory (64-byte aligned) or cudarc's stream-ordered
    /// allocation (`cuMemAllocAsync`) on the device's default stream, uninitialised, no cache.
    Bare,
}

/// A buffer of the bare replay.
enum Bare {
    Host(std::ptr::NonNull<u8>, std::alloc::Layout),
    #[cfg(feature = "cuda")]
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

/// What one replay measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct Replay {
    /// Wall time of the whole log, seconds.
    pub seconds: f64,
    /// The most bytes allocated from the device at once (gpucache: what its caches and arrays
    /// held, as the backend counts it; bare: the live buffers).
    pub peak_bytes: usize,
    /// Device allocations made.
    pub device_allocs: u64,
}

/// Replays `ops` on `dev` in `mode`. On CUDA the device is synchronised at every outermost
/// scope exit, as a training step ends (in both modes).
pub fn replay(ops: &[Op], dev: Device, mode: Mode) -> Result<Replay> {
    enum Live {
        Cached(Array<u8>),
        Bare(Bare),
    }
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut scopes: Vec<ScopeGuard> = Vec::new();
    let mut depth = 0usize;
    let before = gpucache::device_stats(dev)?;
    let (mut bare_bytes, mut peak, mut bare_allocs) = (0usize, 0usize, 0u64);
    let sync = || -> Result<()> {
        #[cfg(feature = "cuda")]
        if dev.is_cuda() {
            gpucache::cuda::default_stream(dev)?.synchronize()?;
        }
        Ok(())
    };
    let start = std::time::Instant::now();
    for op in ops {
        match op {
            Op::Enter(cache) => {
                depth += 1;
                if mode == Mode::Gpucache {
                    scopes.push(gpucache::enter(cache));
                }
            }
            Op::Exit(_) => {
                depth = depth.saturating_sub(1);
                scopes.pop();
                if depth == 0 {
                    sync()?;
                }
            }
            Op::Invalidate(cache) => {
                if mode == Mode::Gpucache {
                    gpucache::invalidate(cache);
                }
            }
            Op::Alloc {
                buffer,
                bytes,
                elem,
                dims,
                ..
            } => {
                let array = match mode {
                    Mode::Gpucache => {
                        // u8 elements, the element size as a last dimension: the same key
                        // for the same (element size, shape).
                        let mut shape = dims.clone();
                        shape.push(*elem);
                        let a = Array::<u8>::empty(dev, shape)?;
                        peak = peak.max(gpucache::device_stats(dev)?.bytes_allocated);
                        Live::Cached(a)
                    }
                    Mode::Bare => {
                        bare_bytes += bytes;
                        bare_allocs += 1;
                        peak = peak.max(bare_bytes);
                        Live::Bare(bare_alloc(dev, *bytes)?)
                    }
                };
                live.insert(*buffer, array);
            }
            Op::Free { buffer } => match live.remove(buffer) {
                Some(Live::Bare(b)) => {
                    bare_bytes -= match &b {
                        Bare::Host(_, layout) => layout.size(),
                        #[cfg(feature = "cuda")]
                        Bare::Cuda(s) => s.len(),
                    };
                    drop(b);
                }
                Some(Live::Cached(a)) => drop(a),
                None => {}
            },
        }
    }
    drop(live);
    while scopes.pop().is_some() {}
    sync()?;
    let seconds = start.elapsed().as_secs_f64();
    let after = gpucache::device_stats(dev)?;
    Ok(Replay {
        seconds,
        peak_bytes: peak,
        device_allocs: match mode {
            Mode::Gpucache => after.allocs - before.allocs,
            Mode::Bare => bare_allocs,
        },
    })
}

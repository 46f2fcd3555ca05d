//! Capturing a step as a CUDA graph and replaying it: [`StepGraph`].
//!
//! While a step runs under a [`StepGraph`], the thread is in one of two modes, kept by the
//! backend (`backend::capture`, which the array and backend code read), with the buffers the
//! run holds in `cuda::held`:
//! * *holding* (the eager warm-up runs and the capture): arrays that drop keep their buffers
//!   with the run instead of returning them to their caches, and the run gives them back when
//!   it ends. So a step allocates as many buffers as it would under `Reuse::OnExit`, whatever
//!   the cache's policy, and a warm-up run warms the cache for the capture.
//! * *capturing*: additionally, allocations that are not cache hits fail with
//!   [`Error::CaptureMiss`] instead of reaching the device, arrays pass their raw device
//!   pointers to cudarc and kernels (no cudarc events: a capturing stream may not wait on an
//!   event recorded outside the capture), gpucache's own work on another stream fails with
//!   [`Error::CaptureForeignStream`], host copies fail with [`Error::CaptureUnsupported`], and
//!   every array the step uses that it did not allocate is *pinned*: when such an array drops,
//!   the graph that baked in its address is invalid and is not replayed again.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUresult, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream, DriverError};

use super::held::{self, HeldBuffers};
use crate::backend::capture::{self, Mode};
use crate::backend::cuda as backend;
use crate::cache::CacheCell;
use crate::{CacheConfig, Device, Error, Result};

/// Whether `e` is one of the driver's stream-capture errors.
fn is_capture_error(e: &DriverError) -> bool {
    matches!(
        e.0,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
            | CUresult::CUDA_ERROR_CAPTURED_EVENT
    )
}

/// What a run left: the capture's outcome, the buffers of the arrays that dropped during it.
struct RunEnd {
    failure: Option<Error>,
    alive: Arc<AtomicBool>,
    held: HeldBuffers,
}

/// Puts the thread in `mode` for a run until dropped; then ends a capture still in progress
/// (a step that panicked) and gives the held buffers back.
struct RunGuard {
    stream: Arc<CudaStream>,
    /// Cleared by `finish`; still set when the step panicked.
    armed: bool,
}

impl RunGuard {
    fn start(mode: Mode, device: Device, stream: &Arc<CudaStream>) -> Result<RunGuard> {
        capture::begin(mode, device, stream.cu_stream())?;
        if mode == Mode::Capturing {
            let thread_local = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            if let Err(e) = stream.begin_capture(thread_local) {
                capture::end();
                return Err(Error::CaptureFailed(e));
            }
        }
        held::start();
        Ok(RunGuard {
            stream: Arc::clone(stream),
            armed: true,
        })
    }

    /// Ends the run: the capture's graph (when capturing) and what the run left.
    fn finish(mut self) -> (Result<Option<CudaGraph>, DriverError>, RunEnd) {
        self.armed = false;
        let graph = match capture::mode() {
            Mode::Capturing => self.stream.end_capture(CUgraphInstantiate_flags(0)),
            _ => Ok(None),
        };
        let ended = capture::end().unwrap_or_else(|| unreachable!("a run has state"));
        let end = RunEnd {
            failure: ended.failure,
            alive: ended.alive,
            held: held::finish(),
        };
        (graph, end)
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // The step panicked.
        if capture::capturing() {
            let ctx = self.stream.context();
            ctx.record_err(self.stream.end_capture(CUgraphInstantiate_flags(0)));
        }
        capture::end();
        drop(held::finish());
    }
}

/// What [`StepGraph::run`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ran {
    /// Called the step (a warm-up run, or a run after the graph was invalidated).
    Eagerly,
    /// Called the step under stream capture, then launched the new graph once.
    Captured,
    /// Launched the graph captured earlier; the step was not called.
    Replayed,
}

/// A captured graph and what it depends on.
struct Captured {
    /// `None` for a step that queued no work.
    graph: Option<CudaGraph>,
    stream: Arc<CudaStream>,
    /// Cleared when an array the graph uses (and did not allocate) drops.
    alive: Arc<AtomicBool>,
    /// The cache's configuration and generation at capture (a new generation: the cache was
    /// invalidated, by a call or by a change of key policy).
    config: (CacheConfig, u32),
    /// The buffers of the arrays the step allocated: the graph reads and writes them, so
    /// nothing else may get them while it lives.
    held: HeldBuffers,
}

impl Captured {
    fn is_valid(&self, cell: &CacheCell, stream: &CudaStream) -> bool {
        self.alive.load(Ordering::Acquire)
            && stream.cu_stream() == self.stream.cu_stream()
            && cell.config() == self.config
    }
}

/// A training (or inference) step that runs eagerly until its cache is warm, is then captured
/// once as a CUDA graph on the thread's current stream, and from then on is replayed: one
/// graph launch instead of every kernel, cuBLAS and memset launch of the step.
///
/// See the [module documentation](crate::cuda#cuda-graphs) for the contract.
///
/// ```
/// use gpucache::cuda::{Ran, StepGraph};
/// use gpucache::{Array, Device};
/// let Ok(dev) = Device::cuda(0) else { return Ok(()) };
/// let stream = gpucache::cuda::context(dev)?.new_stream()?; // not the default stream
/// let _on = gpucache::cuda::use_stream(&stream)?;
/// let mut out = Array::<f32>::zeros(dev, 256)?; // outside the step: a fixed address
/// let mut step = StepGraph::new("doc-graph", dev);
/// for i in 0..4 {
///     let ran = step.run(|| -> gpucache::Result<()> {
///         let tmp = Array::<f32>::zeros(dev, 256)?; // a cache hit once warm
///         /* ... kernels reading `tmp` and writing `out` ... */
///         Ok(())
///     })?;
///     let want = [Ran::Eagerly, Ran::Eagerly, Ran::Captured, Ran::Replayed][i];
///     assert_eq!(ran, want);
/// }
/// # let _ = &mut out;
/// # Ok::<(), gpucache::Error>(())
/// ```
pub struct StepGraph {
    cache: Box<str>,
    device: Device,
    warmup: u32,
    /// Eager runs in a row that missed no allocation.
    warm_runs: u32,
    captured: Option<Captured>,
    captures: u64,
    replays: u64,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepGraph")
            .field("cache", &self.cache)
            .field("device", &self.device)
            .field("captured", &self.captured.is_some())
            .field("captures", &self.captures)
            .field("replays", &self.replays)
            .finish_non_exhaustive()
    }
}

impl StepGraph {
    /// A step that runs in the scope `cache` on `device`, captured after one eager run that
    /// missed no allocation (see [`StepGraph::warmup`]).
    pub fn new(cache: &str, device: Device) -> StepGraph {
        StepGraph {
            cache: cache.into(),
            device,
            warmup: 1,
            warm_runs: 0,
            captured: None,
            captures: 0,
            replays: 0,
            _not_send: PhantomData,
        }
    }

    /// How many eager runs in a row must miss no allocation in the cache before the next run
    /// is captured (default and least 1).
    #[must_use]
    pub fn warmup(mut self, runs: u32) -> StepGraph {
        self.warmup = runs;
        self
    }

    /// Runs the step once: calls `step` in the scope of the cache while warming up, captures
    /// it as a graph once warm (and launches the graph), and afterwards launches the graph
    /// without calling `step`. Returns what it did. The work is queued on the thread's current
    /// stream for the device, which must not be the default stream.
    ///
    /// A graph is dropped, and the step runs eagerly again (to be captured again once warm),
    /// when the cache was invalidated or configured differently since the capture, when an
    /// array the graph reads or writes but did not allocate has dropped, or when the current
    /// stream is another one.
    ///
    /// # Errors
    /// [`Error::CaptureDefaultStream`] when the current stream is the default stream; the
    /// step's own errors; during the capture, [`Error::CaptureMiss`],
    /// [`Error::CaptureForeignStream`], [`Error::CaptureUnsupported`] and
    /// [`Error::CaptureFailed`], after which the step has not run on the device and the next
    /// call runs it eagerly; and the driver's errors when launching the graph.
    pub fn run<E: From<Error>>(&mut self, step: impl FnOnce() -> Result<(), E>) -> Result<Ran, E> {
        let n = backend::ordinal(self.device)?;
        let stream = backend::thread_stream(n, backend::device_state(n)?);
        if stream.cu_stream().is_null() {
            return Err(Error::CaptureDefaultStream {
                device: self.device,
            }
            .into());
        }
        let scope = crate::enter(&self.cache);
        let Some(cell) = scope.cell().filter(|_| !crate::config::caching_disabled()) else {
            // No cache to capture from (GPUCACHE_DISABLE=1, or thread teardown).
            step()?;
            return Ok(Ran::Eagerly);
        };
        if let Some(captured) = &self.captured {
            if captured.is_valid(cell, &stream) {
                if let Some(graph) = &captured.graph {
                    graph.launch().map_err(Error::from)?;
                }
                self.replays += 1;
                return Ok(Ran::Replayed);
            }
            self.captured = None;
            self.warm_runs = 0;
        }
        if self.warm_runs >= self.warmup.max(1) {
            self.warm_runs = 0;
            return self.capture(cell, &stream, step).map(|()| Ran::Captured);
        }
        let misses = cell.snapshot().misses;
        let run = RunGuard::start(Mode::Holding, self.device, &stream)?;
        let result = step();
        let (_, state) = run.finish();
        let warm = cell.snapshot().misses == misses;
        drop(state); // gives the buffers back, inside the scope (as its exit would)
        drop(scope);
        result?;
        self.warm_runs = if warm { self.warm_runs + 1 } else { 0 };
        Ok(Ran::Eagerly)
    }

    fn capture<E: From<Error>>(
        &mut self,
        cell: &CacheCell,
        stream: &Arc<CudaStream>,
        step: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let config = cell.config();
        let run = RunGuard::start(Mode::Capturing, self.device, stream)?;
        let result = step();
        let (graph, mut state) = run.finish();
        let failure = state.failure.take();
        if let Some(Error::CaptureForeignStream { .. }) = failure {
            // The step queued work on another stream, which runs eagerly on buffers the run
            // holds: let it finish before they go back to their caches. (Which stream is not
            // known here, so the whole context; another thread's capture in progress fails.)
            let ctx = stream.context();
            ctx.record_err(ctx.synchronize());
        }
        if let Some(failure) = failure {
            return Err(failure.into());
        }
        let graph = match graph {
            // The first failing call returned the cause (which cudarc may have kept in the
            // context's error slot); the end of the capture reports that it was invalidated.
            Err(e) => {
                let ctx = stream.context();
                let cause = ctx.check_err().err();
                let cause = match cause {
                    Some(c) if is_capture_error(&c) => c,
                    other => {
                        ctx.record_err(other.map_or(Ok(()), Err));
                        e
                    }
                };
                return Err(Error::CaptureFailed(cause).into());
            }
            Ok(graph) => graph,
        };
        result?;
        if let Some(graph) = &graph {
            graph.launch().map_err(Error::from)?;
        }
        self.captures += 1;
        self.captured = Some(Captured {
            graph,
            stream: Arc::clone(stream),
            alive: Arc::clone(&state.alive),
            config,
            held: std::mem::take(&mut state.held),
        });
        Ok(())
    }

    /// Whether a graph is captured (and will be replayed by the next [`StepGraph::run`] if
    /// it is still valid then).
    pub fn is_captured(&self) -> bool {
        self.captured.is_some()
    }

    /// Drops the graph (its buffers go back to their caches); the next run is eager.
    pub fn reset(&mut self) {
        self.captured = None;
        self.warm_runs = 0;
    }

    /// How many times a graph was captured.
    pub fn captures(&self) -> u64 {
        self.captures
    }

    /// How many times a graph was replayed (not counting the launch right after a capture).
    pub fn replays(&self) -> u64 {
        self.replays
    }

    /// The bytes of the buffers the graph holds (those its step allocated), 0 without one.
    pub fn held_bytes(&self) -> usize {
        self.captured.as_ref().map_or(0, |c| c.held.bytes())
    }
}

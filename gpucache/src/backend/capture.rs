//! Whether this thread is running a step graph, and what the CUDA backend must do about it.
//!
//! A `StepGraph` run puts its thread in one of two modes for the length of the run:
//! * *holding* (eager warm-up runs and the capture): arrays that drop keep their buffers with the
//!   run instead of going back to their caches (the array layer asks [`holding`]);
//! * *capturing*: additionally, device work is being recorded into a graph, so the backend must
//!   not allocate, copy to or from the host, or touch another stream; each such attempt is
//!   recorded as the run's [`fail`]ure. Every buffer the step uses is *pinned* to the capture
//!   (it watches the run's [`alive_flag`]): when it is freed, the graph that baked in its
//!   address must not be replayed.
//!
//! This is the backend's own state (which stream is capturing is a property of the streams it
//! allocates on); the user-facing `StepGraph` sets it with [`begin`] and [`end`].

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cudarc::driver::sys::CUstream;

use crate::{Device, Error, Result};

/// What the thread is doing for a step graph run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    Off,
    Holding,
    Capturing,
}

/// The state of a run in progress on this thread.
struct Run {
    device: Device,
    /// The capture stream (when capturing).
    stream: CUstream,
    /// Cleared when a buffer the capture baked in is freed.
    alive: Arc<AtomicBool>,
    /// The first thing that made the capture unusable (when capturing).
    failure: Option<Error>,
}

thread_local! {
    /// Read on every array drop and cudarc argument, so a plain `Cell` with a const
    /// initialiser and no destructor.
    static MODE: Cell<Mode> = const { Cell::new(Mode::Off) };
    /// The run in progress, while `MODE` is not `Off`.
    static RUN: RefCell<Option<Run>> = const { RefCell::new(None) };
}

/// What a run left when it ended.
pub(crate) struct Ended {
    /// The first reason the capture cannot be used, if any.
    pub(crate) failure: Option<Error>,
    /// Cleared once a buffer the capture baked in is freed.
    pub(crate) alive: Arc<AtomicBool>,
}

/// The thread's mode.
#[inline]
pub(crate) fn mode() -> Mode {
    MODE.try_with(Cell::get).unwrap_or(Mode::Off)
}

/// Whether this thread is capturing a step graph.
#[inline]
pub(crate) fn capturing() -> bool {
    mode() == Mode::Capturing
}

/// Whether a step graph run on this thread keeps the buffers of arrays that drop.
#[inline]
pub(crate) fn holding() -> bool {
    mode() != Mode::Off
}

/// Starts a run in `mode` (not `Off`) on `device`, capturing on `stream`.
///
/// # Errors
/// [`Error::CaptureUnsupported`] when a run is already in progress on this thread.
pub(crate) fn begin(mode: Mode, device: Device, stream: CUstream) -> Result<()> {
    if self::mode() != Mode::Off {
        return Err(Error::CaptureUnsupported {
            what: "a step graph run inside another step graph run",
        });
    }
    RUN.with(|run| {
        *run.borrow_mut() = Some(Run {
            device,
            stream,
            alive: Arc::new(AtomicBool::new(true)),
            failure: None,
        });
    });
    MODE.with(|m| m.set(mode));
    Ok(())
}

/// Ends the run in progress: the thread's mode is `Off` again.
pub(crate) fn end() -> Option<Ended> {
    MODE.with(|m| m.set(Mode::Off));
    RUN.with(|run| run.borrow_mut().take()).map(|run| Ended {
        failure: run.failure,
        alive: run.alive,
    })
}

/// Records `make()` as the reason the capture in progress cannot be used (the first reason
/// wins) and returns it again for the caller. The capture is dropped when the step returns,
/// even if the step ignores the error.
#[cold]
pub(crate) fn fail(make: impl Fn() -> Error) -> Error {
    let _ = RUN.try_with(|run| {
        if let Some(run) = run.borrow_mut().as_mut()
            && run.failure.is_none()
        {
            run.failure = Some(make());
        }
    });
    make()
}

/// During a capture: records a failure if work is queued on `stream` and it is not the capture
/// stream.
#[inline]
pub(crate) fn require_capture_stream(stream: CUstream) {
    let foreign = RUN
        .try_with(|run| {
            run.borrow()
                .as_ref()
                .map(|run| (run.stream != stream).then_some(run.device))
        })
        .ok()
        .flatten()
        .flatten();
    if let Some(device) = foreign {
        fail(|| Error::CaptureForeignStream { device });
    }
}

/// The flag of the run in progress that a buffer the graph bakes in clears when it is freed
/// (see `CudaBuf::pin`), if there is a run.
pub(crate) fn alive_flag() -> Option<Arc<AtomicBool>> {
    RUN.try_with(|run| run.borrow().as_ref().map(|run| Arc::clone(&run.alive)))
        .ok()
        .flatten()
}

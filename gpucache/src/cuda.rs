//! CUDA interop (feature `cuda`): arrays as cudarc buffers, the thread's current stream, and
//! cross-stream use.
//!
//! An [`Array`] on [`Device::Cuda`] owns a cudarc [`CudaSlice<u8>`](cudarc::driver::CudaSlice)
//! and implements cudarc's [`DevicePtr`] / [`DevicePtrMut`], and `&Array<T>` / `&mut Array<T>`
//! are kernel arguments ([`PushKernelArg`]). So an array goes straight to
//! `stream.launch_builder(&f).arg(&x)`, to cuBLAS (`blas.gemm(cfg, &a, &b, &mut c)`) and to
//! cudarc's copies (`stream.memcpy_htod(&host, &mut x)`), without a copy and with cudarc's own
//! read/write event tracking. [`Array::cuda_view`] / [`Array::cuda_view_mut`] give typed views for
//! sub-slicing. An array served from part of a cached block gets its cudarc slice (and its two
//! events) only when a call needs it: a launch or `DevicePtr` call while the context has a single
//! stream, where cudarc records no event of any slice, takes its device address as it would take
//! the slice's; once the context has a second stream (which cudarc synchronises the context for),
//! the array's first such call makes its slice, with nothing before it to wait for. Allocating and
//! dropping such an array on one stream makes no CUDA call. This crate re-exports the cudarc it was
//! built with as [`gpucache::cuda::cudarc`](cudarc), so the types match.
//!
//! ```
//! use std::sync::Arc;
//! use gpucache::cuda::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
//! use gpucache::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
//! use gpucache::cuda::cudarc::nvrtc::compile_ptx;
//! use gpucache::{Array, Device};
//!
//! let Ok(dev) = Device::cuda(0) else {
//!     return Ok(()); // no GPU (or no driver) on this machine
//! };
//! let stream = gpucache::cuda::current_stream(dev)?; // the context's default stream
//! let ptx = compile_ptx(
//!     r#"extern "C" __global__ void relu(float* y, const float* x, unsigned n) {
//!         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
//!         if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
//!     }"#,
//! )?;
//! let relu = stream.context().load_module(ptx)?.load_function("relu")?;
//! let blas = CudaBlas::new(Arc::clone(&stream))?;
//!
//! for _step in 0..3 {
//!     let _scope = gpucache::enter("doc-step"); // buffers recycled from the second step on
//!     let a = Array::from_slice(dev, &[1.0f32, -2.0, 3.0, -4.0], [2, 2])?;
//!     let b = Array::from_slice(dev, &[1.0f32, 0.0, 0.0, 1.0], [2, 2])?;
//!     let mut c = Array::<f32>::zeros(dev, [2, 2])?;
//!     let cfg = GemmConfig {
//!         transa: cublasOperation_t::CUBLAS_OP_N,
//!         transb: cublasOperation_t::CUBLAS_OP_N,
//!         m: 2, n: 2, k: 2, alpha: 1.0f32, lda: 2, ldb: 2, beta: 0.0f32, ldc: 2,
//!     };
//!     // SAFETY: the three arrays hold 2x2 f32 matrices, as the configuration says.
//!     unsafe { blas.gemm(cfg, &b, &a, &mut c) }?; // c = a * identity
//!     let mut y = Array::<f32>::empty(dev, [2, 2])?;
//!     let n = c.len() as u32;
//!     let mut launch = stream.launch_builder(&relu);
//!     launch.arg(&mut y).arg(&c).arg(&n);
//!     // SAFETY: `relu` takes (float*, const float*, unsigned) and reads/writes n elements.
//!     unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
//!     assert_eq!(y.to_vec()?, [1.0, 0.0, 3.0, 0.0]);
//! }
//! assert_eq!(gpucache::stats("doc-step").hits, 8); // 4 arrays x steps 2 and 3
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Streams
//!
//! Each device has one CUDA context (its primary context), created on first use and kept for
//! the life of the process ([`context`]). Each thread has a *current stream* per device, the
//! context's default stream unless set with [`set_stream`] or [`use_stream`]. Arrays are
//! allocated, zeroed and filled on the current stream, and a recycled buffer is stream-ordered:
//! on the stream it was freed on it is reused at once, and on another stream that stream first
//! waits for an event recorded on the old one. Launch work on cached arrays on the current
//! stream (`gpucache::cuda::current_stream(dev)?`), or declare other streams:
//!
//! * [`Array::record_stream`] marks an array as used on another stream (as PyTorch's
//!   `Tensor.record_stream`). When the array drops, an event is recorded on each marked stream,
//!   and its buffer goes back to a free list only once those events have completed (the cache
//!   polls them when it misses and when a scope exits, as Paddle's StreamSafeCUDAAllocator
//!   does); freeing it outright waits for them on the device. Only marked arrays pay for events.
//! * The event is recorded when the array *drops*, not when it is marked, so work queued on the
//!   marked stream after the call is covered too.
//!
//! cudarc's own tracking stays on: when a context has more than one stream, kernel launches and
//! copies that take an array through cudarc wait for and record the buffer's read/write events,
//! as for any `CudaSlice`.
//!
//! # CUDA graphs
//!
//! A warm scope hands out the same buffers in the same order every step, which is what CUDA
//! graph capture needs. [`StepGraph`] runs a step (a closure) eagerly in a named scope until
//! the scope is warm (a run that missed no allocation), captures the next run once on the
//! thread's current stream, launches the graph, and from then on replays it: one launch per
//! step instead of every kernel, cuBLAS call and memset. See `examples/step_bench.rs` for what
//! it saves.
//!
//! * **Streams.** The legacy default stream cannot be captured: make a stream of the device's
//!   context the thread's current stream ([`use_stream`]) before setting up the step (create
//!   cuBLAS handles on it, launch on it). A run on the default stream is
//!   [`Error::CaptureDefaultStream`]. Work the step puts on another stream is
//!   [`Error::CaptureForeignStream`] when gpucache sees it (an array passed to cuBLAS or a copy
//!   on another stream, [`Array::record_stream`], a recycled buffer last used elsewhere), and
//!   otherwise the driver's error (a stream forked from the capture and not joined back), as
//!   [`Error::CaptureFailed`]. A synchronisation of the whole context on any thread while a
//!   capture is in progress (`CudaContext::synchronize`) makes the driver end that capture
//!   with an error too; the next run warms up and captures again. (gpucache itself does so
//!   only to recover from out of memory, and after a capture that touched another stream.)
//! * **Inputs and outputs** live in arrays allocated outside the step, so their addresses are
//!   fixed: copy the next batch into the input arrays before a run, read the results after.
//!   Once captured, the closure is *not called*: a replay reruns exactly the captured work, on
//!   the captured arrays. Host copies inside the step ([`Array::from_slice`], [`Array::to_vec`])
//!   are [`Error::CaptureUnsupported`].
//! * **Allocations inside the capture must be cache hits.** A miss (a shape that changed since
//!   the warm-up) allocates nothing and returns [`Error::CaptureMiss`]; the capture is dropped,
//!   the step has not run on the device (captured work does not execute), and the next run
//!   warms up eagerly with the new shape and captures again. The failure is recorded even if the
//!   step swallows the error, so a broken capture is never replayed.
//! * **The graph owns its buffers.** The buffers of the arrays the step allocated are baked
//!   into the graph, so it keeps them (busy, counted in `bytes_in_use`) until it is dropped or
//!   invalidated; then they go back to their cache. During every run under a `StepGraph`, the
//!   buffers of arrays that drop are kept until the run ends (as `Reuse::OnExit` does), so the
//!   warm-up runs allocate what the capture needs whatever the cache's policy.
//! * **What invalidates a graph.** [`invalidate`](crate::invalidate) of the scope's cache,
//!   [`configure`](crate::configure) with a different configuration, dropping an array the
//!   graph reads or writes that it did not allocate itself (its address would be stale), or a
//!   different current stream: the next run drops the graph (its buffers are freed or cached as
//!   the cache's generation says) and warms up eagerly again. `empty_cache` leaves graphs alone
//!   (their buffers are in use).
//! * **cudarc's event tracking.** Once a context has a second stream (and a captured step needs
//!   one), cudarc makes every launch that takes a `CudaSlice` wait for the slice's last
//!   read/write events and record new ones. Those events were recorded outside the capture, and
//!   a capturing stream may not wait on them: the driver invalidates the capture
//!   (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`). So while a thread captures, gpucache's arrays give
//!   cudarc and kernels their raw device pointers with no events, and a replay records none:
//!   within the capture stream, stream order is what orders the graph's work, and an array used
//!   on another stream after a replay needs [`Array::record_stream`] or a join, as for any work
//!   gpucache cannot see. A plain cudarc `CudaSlice` passed to a captured step with tracking on
//!   still makes the driver end the capture ([`Error::CaptureFailed`]); use gpucache arrays in
//!   captured steps.
//! * **Other threads.** An array of the capturing thread's caches dropped on another thread
//!   (a result handed to a response thread) makes the array's stream wait for the events of
//!   its uses; while that stream is being captured, the dropping thread waits until the
//!   capture ends, then drops it. (A capturing step that waits for that other thread to drop
//!   such an array would wait forever.)
//! * **Caching off** (`GPUCACHE_DISABLE=1`): nothing is captured; every run is eager.
//!
//! ```
//! use gpucache::cuda::StepGraph;
//! use gpucache::{Array, Device};
//! let Ok(dev) = Device::cuda(0) else { return Ok(()) };
//! let stream = gpucache::cuda::context(dev)?.new_stream()?;
//! let _on = gpucache::cuda::use_stream(&stream)?; // allocate and launch on `stream`
//! let mut y = Array::<f32>::zeros(dev, 1024)?; // an output, outside the step
//! let mut step = StepGraph::new("train_step", dev);
//! for _ in 0..10 {
//!     let ran = step.run(|| -> gpucache::Result<()> {
//!         let h = Array::<f32>::zeros(dev, 1024)?; // a hit once warm; kept by the graph
//!         /* ... kernels on `stream` reading `h`, writing `y` ... */
//!         # let _ = (&h, &mut y);
//!         Ok(())
//!     })?;
//!     # let _ = ran;
//! }
//! assert_eq!((step.captures(), step.replays()), (1, 7));
//! # Ok::<(), gpucache::Error>(())
//! ```
//!
//! # Panics
//!
//! The cudarc trait implementations cannot return errors: passing an array on
//! [`Device::Cpu`] to them panics, as cudarc's own copies panic on a length mismatch. The
//! methods of [`Array`] return [`Error::DeviceMismatch`] instead.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

pub use cudarc;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use crate::backend::Block;
use crate::backend::capture;
use crate::backend::cuda::{self as backend, CudaBuf, DeviceState};
use crate::{Array, Device, Element, Error, Result};

mod graph;
pub(crate) mod held;
pub use graph::{Ran, StepGraph};

/// The state of `device` (a CUDA device), creating its context on first use.
fn state(device: Device) -> Result<&'static DeviceState> {
    backend::device_state(backend::ordinal(device)?)
}

/// The primary context of `device`, which gpucache allocates in. Create streams from it
/// (`context(dev)?.new_stream()?`) so that they can be used with gpucache's arrays.
///
/// # Errors
/// [`Error::DeviceMismatch`] for `Device::Cpu`, and the errors of [`Device::cuda`].
pub fn context(device: Device) -> Result<Arc<CudaContext>> {
    Ok(Arc::clone(&state(device)?.ctx))
}

/// The default (null) stream of `device`'s context.
///
/// # Errors
/// As [`context`].
pub fn default_stream(device: Device) -> Result<Arc<CudaStream>> {
    Ok(Arc::clone(&state(device)?.default_stream))
}

/// The calling thread's current stream for `device`: where its arrays are allocated, zeroed
/// and filled, and where recycled buffers are ordered. The default stream unless set.
///
/// # Errors
/// As [`context`].
pub fn current_stream(device: Device) -> Result<Arc<CudaStream>> {
    let n = backend::ordinal(device)?;
    Ok(backend::thread_stream(n, backend::device_state(n)?))
}

/// Makes `stream` the calling thread's current stream for its device; returns the previous
/// one. See also [`use_stream`], which restores it.
///
/// # Errors
/// [`Error::ForeignStream`] when `stream` is not of the device's primary context ([`context`]).
pub fn set_stream(stream: &Arc<CudaStream>) -> Result<Arc<CudaStream>> {
    let n = backend::context_ordinal(stream)?;
    let previous = backend::replace_current(n, Some(Arc::clone(stream)));
    match previous {
        Some(previous) => Ok(previous),
        None => Ok(Arc::clone(&backend::device_state(n)?.default_stream)),
    }
}

/// Makes `stream` the calling thread's current stream for its device until the guard drops.
///
/// ```
/// use gpucache::{Array, Device};
/// let Ok(dev) = Device::cuda(0) else { return Ok(()) };
/// let side = gpucache::cuda::context(dev)?.new_stream()?;
/// {
///     let _on_side = gpucache::cuda::use_stream(&side)?;
///     assert_eq!(gpucache::cuda::current_stream(dev)?, side);
///     let _x = Array::<f32>::zeros(dev, 1024)?; // allocated and zeroed on `side`
/// }
/// assert_eq!(gpucache::cuda::current_stream(dev)?, gpucache::cuda::default_stream(dev)?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// As [`set_stream`].
pub fn use_stream(stream: &Arc<CudaStream>) -> Result<StreamGuard> {
    let ordinal = backend::context_ordinal(stream)?;
    let previous = backend::replace_current(ordinal, Some(Arc::clone(stream)));
    Ok(StreamGuard {
        ordinal,
        previous,
        _not_send: PhantomData,
    })
}

/// Restores the previous current stream when dropped; made by [`use_stream`].
#[must_use = "the previous stream is restored when the guard drops"]
pub struct StreamGuard {
    ordinal: usize,
    previous: Option<Arc<CudaStream>>,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for StreamGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamGuard")
            .field("device", &Device::Cuda(self.ordinal))
            .finish_non_exhaustive()
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        backend::replace_current(self.ordinal, self.previous.take());
    }
}

/// Free and total memory of `device` in bytes, as `cuMemGetInfo` reports them (the whole
/// device, all processes).
///
/// # Errors
/// As [`context`], and the driver's errors.
pub fn mem_get_info(device: Device) -> Result<(usize, usize)> {
    Ok(state(device)?.ctx.mem_get_info()?)
}

impl<T: Element> Array<T> {
    /// The CUDA buffer of the array (`None` when it has no elements), or an error for an array
    /// that is not on a CUDA device.
    fn cuda_buf(&self) -> Result<Option<&CudaBuf>> {
        let Some(block) = self.block() else {
            backend::ordinal(self.device())?;
            return Ok(None);
        };
        // `ok_or_else`: this is on the path of every kernel argument and cudarc call, where
        // building (and dropping) an unused error costs a call.
        block.cuda().map(Some).ok_or_else(|| Error::DeviceMismatch {
            expected: Device::Cuda(0),
            found: self.device(),
        })
    }

    /// The elements as a cudarc view, for sub-slicing (`view.slice(a..b)`) and for any cudarc
    /// API that takes a `DevicePtr`. A zero-size array gives an empty view.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for an array that is not on a CUDA device.
    pub fn cuda_view(&self) -> Result<CudaView<'_, T>> {
        let slice = match self.cuda_buf()? {
            Some(buf) => {
                if capture::capturing() {
                    buf.pin();
                }
                buf.slice()
            }
            None => &state(self.device())?.sentinel,
        };
        Ok(typed_view(slice, self.len()))
    }

    /// The elements as a mutable cudarc view.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for an array that is not on a CUDA device, and
    /// [`Error::EmptyArray`] for a zero-size array (it owns no memory to point into).
    pub fn cuda_view_mut(&mut self) -> Result<CudaViewMut<'_, T>> {
        let device = self.device();
        let len = self.len();
        let buf = self.cuda_buf()?.ok_or(Error::EmptyArray { device })?;
        if capture::capturing() {
            buf.pin();
        }
        let slice = self
            .block_mut()
            .and_then(Block::cuda_mut)
            .ok_or(Error::EmptyArray { device })?
            .slice_mut();
        // SAFETY: every element type is a plain value type for which cudarc's view is only a
        // typed device pointer; the buffer holds at least `len * size_of::<T>()` bytes and
        // device allocations are aligned to 256 bytes. Bytes that are not a valid `T` (only
        // `bool`) are never read as `T` on the host by gpucache (see `Array::to_vec`).
        let view = unsafe { slice.transmute_mut::<T>(len) };
        view.ok_or(Error::EmptyArray { device })
    }

    /// Marks the array as used on `stream` (another stream than the one it was allocated or
    /// last recycled on): when it drops, an event is recorded on `stream`, and the buffer is
    /// reused or freed only after the work queued there up to that point. Marking the array's
    /// own stream, or the same stream twice, does nothing. A zero-size array owns no memory and
    /// needs no mark.
    ///
    /// ```
    /// use gpucache::{Array, Device};
    /// let Ok(dev) = Device::cuda(0) else { return Ok(()) };
    /// let side = gpucache::cuda::context(dev)?.new_stream()?;
    /// let x = Array::<f32>::zeros(dev, 1 << 20)?; // on the current (default) stream
    /// side.join(&*gpucache::cuda::current_stream(dev)?)?; // `side` sees the zeros
    /// /* ... launch kernels reading `x` on `side` ... */
    /// x.record_stream(&side)?;
    /// drop(x); // its buffer waits for `side`'s work before it is reused
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for an array that is not on `stream`'s device, and
    /// [`Error::ForeignStream`] for a stream of another context than the device's primary one.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let found = Device::Cuda(stream.context().ordinal());
        if self.device() != found {
            return Err(Error::DeviceMismatch {
                expected: self.device(),
                found,
            });
        }
        match self.cuda_buf()? {
            Some(buf) => buf.record_stream(stream),
            None => backend::context_ordinal(stream).map(drop),
        }
    }
}

/// A typed view of the first `len` elements of `slice`.
fn typed_view<T: Element>(slice: &CudaSlice<u8>, len: usize) -> CudaView<'_, T> {
    // SAFETY: as in `Array::cuda_view_mut`; for the sentinel `len` is 0.
    let view = unsafe { slice.transmute::<T>(len) };
    view.unwrap_or_else(|| unreachable!("a buffer holds its array's elements"))
}

#[cold]
#[track_caller]
fn not_on_cuda(device: Device) -> ! {
    panic!(
        "gpucache: an array on {device} was passed to a CUDA API (cudarc); only arrays on \
         Device::Cuda(_) can be"
    )
}

/// The one-byte allocation of `device` that zero-size arrays point at.
#[track_caller]
fn sentinel(device: Device) -> &'static CudaSlice<u8> {
    match state(device) {
        Ok(state) => &state.sentinel,
        Err(_) => not_on_cuda(device),
    }
}

/// The device pointer a kernel or cudarc call gets for `array` while its thread captures a
/// graph: the buffer's (or the sentinel's), without cudarc's events, which a capture may not
/// wait on. Pins the buffer to the capture (see `CudaBuf::pin`).
#[cold]
#[track_caller]
fn captured_ptr<T: Element>(array: &Array<T>) -> &CUdeviceptr {
    match array.cuda_buf() {
        Ok(Some(buf)) => {
            buf.pin();
            buf.ptr()
        }
        Ok(None) => match state(array.device()) {
            Ok(state) => &state.sentinel_ptr,
            Err(_) => not_on_cuda(array.device()),
        },
        Err(_) => not_on_cuda(array.device()),
    }
}

/// What a kernel or cudarc call gets for `array`: its buffer's cudarc slice, with its events, or
/// its buffer's device address where cudarc would use no events of the slice (a view that has
/// no slice yet, while the context manages no synchronisation across streams: see
/// `CudaBuf::tracks`); the device's sentinel for a zero-size array.
#[track_caller]
fn arg_of<T: Element>(array: &Array<T>) -> Arg<'_, &CudaSlice<u8>> {
    match array.cuda_buf() {
        Ok(Some(buf)) if buf.tracks() => Arg::Slice(buf.slice()),
        Ok(Some(buf)) => Arg::Ptr(buf.ptr()),
        Ok(None) => Arg::Sentinel(sentinel(array.device())),
        Err(_) => not_on_cuda(array.device()),
    }
}

/// [`arg_of`] for a call that writes to `array` (nothing is written through the sentinel).
#[track_caller]
fn arg_mut_of<T: Element>(array: &mut Array<T>) -> Arg<'_, &mut CudaSlice<u8>> {
    let device = array.device();
    match array.block_mut() {
        Some(block) => match block.cuda_mut() {
            Some(buf) if buf.tracks() => Arg::Slice(buf.slice_mut()),
            Some(buf) => Arg::Ptr(buf.ptr()),
            None => not_on_cuda(device),
        },
        None => Arg::Sentinel(sentinel(device)),
    }
}

/// What [`arg_of`] and [`arg_mut_of`] found.
enum Arg<'a, S> {
    Slice(S),
    Ptr(&'a CUdeviceptr),
    Sentinel(&'static CudaSlice<u8>),
}

impl<T: Element> DeviceSlice<T> for Array<T> {
    fn len(&self) -> usize {
        Array::len(self)
    }

    /// The stream of the array's buffer (where it was allocated or last recycled); the
    /// device's default stream for a zero-size array.
    ///
    /// # Panics
    /// For an array that is not on a CUDA device.
    fn stream(&self) -> &Arc<CudaStream> {
        match self.cuda_buf() {
            Ok(Some(buf)) => buf.stream(),
            Ok(None) => match state(self.device()) {
                Ok(state) => &state.default_stream,
                Err(_) => not_on_cuda(self.device()),
            },
            Err(_) => not_on_cuda(self.device()),
        }
    }
}

impl<T: Element> DevicePtr<T> for Array<T> {
    /// # Panics
    /// For an array that is not on a CUDA device.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        if capture::capturing() {
            capture::require_capture_stream(stream.cu_stream());
            return (*captured_ptr(self), SyncOnDrop::Record(None));
        }
        match arg_of(self) {
            Arg::Slice(slice) | Arg::Sentinel(slice) => slice.device_ptr(stream),
            Arg::Ptr(&ptr) => (ptr, SyncOnDrop::Record(None)),
        }
    }
}

impl<T: Element> DevicePtrMut<T> for Array<T> {
    /// # Panics
    /// For an array that is not on a CUDA device.
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        if capture::capturing() {
            capture::require_capture_stream(stream.cu_stream());
            return (*captured_ptr(self), SyncOnDrop::Record(None));
        }
        match arg_mut_of(self) {
            Arg::Slice(slice) => slice.device_ptr_mut(stream),
            Arg::Ptr(&ptr) => (ptr, SyncOnDrop::Record(None)),
            Arg::Sentinel(slice) => slice.device_ptr(stream),
        }
    }
}

// SAFETY: pushes exactly what cudarc pushes for the `CudaSlice<u8>` that `arg` owns (or the
// device's sentinel, which lives for the process): a pointer to its `CUdeviceptr`, valid for
// `'b`, and its read/write events. The kernel sees the device pointer of the array's elements.
// For a view with no slice while the context manages no synchronisation across streams (where
// cudarc would push no event of a slice either), and while the thread captures a graph, it
// pushes a pointer to the same `CUdeviceptr` value, kept in the buffer (or the device state)
// for as long, and no events.
unsafe impl<'a, 'b: 'a, T: Element> PushKernelArg<&'b Array<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Array<T>) -> &mut Self {
        if capture::capturing() {
            return self.arg(captured_ptr(arg));
        }
        match arg_of(arg) {
            Arg::Slice(slice) | Arg::Sentinel(slice) => self.arg(slice),
            Arg::Ptr(ptr) => self.arg(ptr),
        }
    }
}

// SAFETY: as for `&Array<T>`, through cudarc's implementation for `&mut CudaSlice<u8>` (which
// also orders the launch after earlier reads and records the write).
unsafe impl<'a, 'b: 'a, T: Element> PushKernelArg<&'b mut Array<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut Array<T>) -> &mut Self {
        if capture::capturing() {
            return self.arg(captured_ptr(arg));
        }
        match arg_mut_of(arg) {
            Arg::Slice(slice) => self.arg(slice),
            Arg::Ptr(ptr) => self.arg(ptr),
            Arg::Sentinel(slice) => self.arg(slice),
        }
    }
}

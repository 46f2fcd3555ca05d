//! The CUDA backend: device memory from cudarc, one primary context per device, allocations on
//! the thread's current stream, and stream-ordered reuse.
//!
//! # Storage
//!
//! A buffer is a [`CudaSlice<u8>`] allocated with cudarc's `CudaStream::alloc` (so
//! `cuMemAllocAsync` on the thread's current stream where the device supports memory pools).
//! Keeping cudarc's own slice keeps its guarantees: kernel launches and copies that take the
//! array through cudarc wait for and record the slice's read/write events (when the context has
//! several streams), and dropping the slice frees it stream-ordered after them. Arrays hand out
//! typed views of it (`transmute`), so nothing is copied to pass an array to a kernel or cuBLAS.
//!
//! # Views
//!
//! An array served from a part of a block (a planned or online range, a room, a slab) has a
//! *view*: a buffer over its bytes that never frees them. cudarc's slice of a view, with its read
//! and write events (two `cuEventCreate`s, and two `cuEventDestroy`s when it goes: about 0.7 µs
//! on an H200's host, more than the rest of an allocation and drop from a block), is made only
//! when something needs it ([`CudaBuf::tracks`]): a cudarc API given the array as a slice
//! (`Array::cuda_view`, a copy), or a kernel launch or `DevicePtr` call while the context
//! manages synchronisation across streams (`CudaContext::is_managing_stream_synchronization`:
//! event tracking on and a second stream made). With one stream, cudarc records and waits for no
//! event of any slice: such calls get the view's device address, as they would get the slice's.
//! A context becomes multi-stream once (`CudaContext::new_stream` synchronises it then, when it
//! tracks events), so a view's slice made at its first use after that starts with no work to
//! wait for, as a slice made with the view would have had none to record before: cudarc's
//! guarantees for the array are the same.
//!
//! # Streams
//!
//! Each buffer remembers the stream it was last handed out on (its *stream*). A buffer recycled
//! on the same stream needs nothing: stream order already puts the new work after the old. On
//! another stream, [`CudaBuf::prepare_reuse`] makes the new stream wait for an event recorded on
//! the old one and adopts the new stream. Work on streams the cache cannot see is declared with
//! `Array::record_stream`: when the array drops, an event is recorded on each marked stream, and
//! the cache keeps the buffer off its free lists until those events complete
//! ([`CudaBuf::is_idle`], polled lazily by the cache, as Paddle's StreamSafeCUDAAllocator does).
//! Unmarked buffers never create an event.
//!
//! # Growable blocks
//!
//! A planned cache's block ([`Backend::alloc_growable`]) of at least [`vmm::GROWABLE_MIN`]
//! bytes is mapped through the driver's virtual memory management instead ([`vmm`]), where the
//! device supports it: when a larger step outgrows the plan, the block grows in place
//! ([`Backend::grow`]), mapping only the new bytes, rather than being freed and allocated again
//! at its new size, also under arrays still alive in it (views of it on any thread: growing takes
//! the mapping's lock and changes neither the address nor the bytes mapped before). Its cudarc
//! slice is made over the range first mapped and never freed by cudarc; views are made from the
//! block's address, so the slice need not cover what was mapped later.
//! Unmapping does not wait for the device, so such a block's free waits for the streams that
//! used it first (a host synchronisation, where other blocks are freed stream-ordered): it
//! happens when a plan's block is released (`invalidate`, `empty_cache`, out-of-memory
//! recovery, a block given up), not in a step that follows its plan.

use std::cell::RefCell;
use std::mem;
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, OnceLock};

use std::sync::atomic::AtomicBool;

use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream, CUstreamCaptureStatus};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};
use parking_lot::Mutex;
use smallvec::SmallVec;

mod vmm;

use super::capture;
use super::{AllocError, Backend, Storage};
use crate::{Device, DeviceStats, Error, Result};

/// What gpucache keeps for one CUDA device, for the life of the process.
pub(crate) struct DeviceState {
    /// The device's primary context.
    pub(crate) ctx: Arc<CudaContext>,
    /// The context's default (null) stream.
    pub(crate) default_stream: Arc<CudaStream>,
    /// A one-byte allocation whose pointer zero-size arrays pass to kernels (they own no memory;
    /// the driver refuses zero-byte allocations). Like the context, it lives for the process and
    /// is never freed: `compute-sanitizer --leak-check full` reports it as 1 byte leaked.
    pub(crate) sentinel: CudaSlice<u8>,
    /// The sentinel's device pointer.
    pub(crate) sentinel_ptr: CUdeviceptr,
    /// How growable blocks are mapped (`None`: the device or driver cannot).
    vmm: Option<vmm::Vmm>,
    /// Buffers allocated and freed through gpucache, and the bytes not yet freed.
    allocs: AtomicU64,
    frees: AtomicU64,
    outstanding: AtomicUsize,
}

/// The driver, once loaded: one slot per device, filled on first use.
struct Driver {
    devices: Box<[OnceLock<DeviceState>]>,
    /// Serialises context creation.
    init: Mutex<()>,
}

/// Why the driver could not be used (kept, so every later call gets the same answer).
#[derive(Clone, Copy)]
enum DriverFailure {
    NotFound,
    NoDevice,
    Call(DriverError),
}

static DRIVER: OnceLock<Result<Driver, DriverFailure>> = OnceLock::new();

fn driver() -> Result<&'static Driver, DriverFailure> {
    DRIVER.get_or_init(load_driver).as_ref().map_err(|&e| e)
}

fn load_driver() -> Result<Driver, DriverFailure> {
    // SAFETY: only tries to open the driver's shared library (no symbol is called).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(DriverFailure::NotFound);
    }
    let count = match CudaContext::device_count() {
        Ok(n) => usize::try_from(n).unwrap_or(0),
        Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => return Err(DriverFailure::NoDevice),
        Err(e) => return Err(DriverFailure::Call(e)),
    };
    Ok(Driver {
        devices: (0..count).map(|_| OnceLock::new()).collect(),
        init: Mutex::new(()),
    })
}

/// The state of CUDA device `ordinal`, creating its context on first use.
pub(crate) fn device_state(ordinal: usize) -> Result<&'static DeviceState> {
    let device = Device::Cuda(ordinal);
    let driver = driver().map_err(|e| match e {
        DriverFailure::NotFound => Error::CudaDriverNotFound { device },
        DriverFailure::NoDevice => Error::CudaDeviceNotFound { device, count: 0 },
        DriverFailure::Call(e) => Error::Driver(e),
    })?;
    let slot = driver
        .devices
        .get(ordinal)
        .ok_or(Error::CudaDeviceNotFound {
            device,
            count: driver.devices.len(),
        })?;
    if let Some(state) = slot.get() {
        return Ok(state);
    }
    let _init = driver.init.lock();
    if let Some(state) = slot.get() {
        return Ok(state);
    }
    let ctx = CudaContext::new(ordinal)?;
    let default_stream = ctx.default_stream();
    // SAFETY: the byte is never read or written: zero-size views point at it.
    let sentinel = unsafe { default_stream.alloc::<u8>(1) }?;
    let sentinel_ptr = raw_ptr(&sentinel);
    default_stream.synchronize()?;
    let vmm = vmm::Vmm::probe(&ctx);
    Ok(slot.get_or_init(|| DeviceState {
        ctx,
        default_stream,
        sentinel,
        sentinel_ptr,
        vmm,
        allocs: AtomicU64::new(0),
        frees: AtomicU64::new(0),
        outstanding: AtomicUsize::new(0),
    }))
}

/// The ordinal of a CUDA device.
pub(crate) fn ordinal(device: Device) -> Result<usize> {
    match device {
        Device::Cuda(n) => Ok(n),
        Device::Cpu => Err(Error::DeviceMismatch {
            expected: Device::Cuda(0),
            found: device,
        }),
    }
}

thread_local! {
    /// This thread's current stream per device ordinal (`None`: the default stream).
    static CURRENT: RefCell<Vec<Option<Arc<CudaStream>>>> = const { RefCell::new(Vec::new()) };
}

/// The handle of this thread's current stream for device `ordinal` (null: the default stream).
/// Cheap: no reference count is touched.
pub(crate) fn current_handle(ordinal: usize) -> CUstream {
    CURRENT
        .try_with(|c| {
            c.borrow()
                .get(ordinal)
                .and_then(Option::as_ref)
                .map_or(ptr::null_mut(), |s| s.cu_stream())
        })
        .unwrap_or(ptr::null_mut())
}

/// This thread's current stream for device `ordinal`.
pub(crate) fn thread_stream(ordinal: usize, state: &'static DeviceState) -> Arc<CudaStream> {
    CURRENT
        .try_with(|c| c.borrow().get(ordinal).cloned().flatten())
        .ok()
        .flatten()
        .unwrap_or_else(|| Arc::clone(&state.default_stream))
}

/// Checks that `stream` belongs to the primary context of its device, which gpucache allocates
/// in; returns the device's ordinal.
pub(crate) fn context_ordinal(stream: &CudaStream) -> Result<usize> {
    let ordinal = stream.context().ordinal();
    let state = device_state(ordinal)?;
    if **stream.context() != *state.ctx {
        return Err(Error::ForeignStream {
            device: Device::Cuda(ordinal),
        });
    }
    Ok(ordinal)
}

/// Replaces this thread's current stream for device `ordinal` (`None`: the default stream);
/// returns the previous setting.
pub(crate) fn replace_current(
    ordinal: usize,
    stream: Option<Arc<CudaStream>>,
) -> Option<Arc<CudaStream>> {
    CURRENT
        .try_with(|c| {
            let mut c = c.borrow_mut();
            if c.len() <= ordinal {
                c.resize(ordinal + 1, None);
            }
            mem::replace(&mut c[ordinal], stream)
        })
        .ok()
        .flatten()
}

/// The device pointer of `slice`.
fn raw_ptr(slice: &CudaSlice<u8>) -> CUdeviceptr {
    // Records a read on the slice's own stream when cudarc tracks events: harmless, and only
    // done once per allocation.
    let (ptr, _record) = slice.device_ptr(slice.stream());
    ptr
}

/// The cudarc slices made for views in the process (see [`CudaBuf::slice`]).
static VIEW_SLICES: AtomicU64 = AtomicU64::new(0);

/// How many cudarc slices were made for views in the process.
pub(crate) fn view_slices_made() -> u64 {
    VIEW_SLICES.load(Relaxed)
}

/// The CUDA backend (one for all devices; per-device state lives in [`DeviceState`]).
#[derive(Debug, Default)]
pub(crate) struct CudaBackend;

/// The process's CUDA backend.
pub(crate) static CUDA: LazyLock<Arc<dyn Backend>> = LazyLock::new(|| Arc::new(CudaBackend));

fn alloc_error(e: DriverError) -> AllocError {
    match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => AllocError::OutOfMemory,
        _ => AllocError::Other(Error::Driver(e)),
    }
}

/// Runs `alloc`; when the device is out of memory, waits for the memory freed stream-ordered
/// (`cuMemFreeAsync`) to return to the device as the device catches up, and tries once more.
fn retry_out_of_memory<T>(
    state: &DeviceState,
    mut alloc: impl FnMut() -> Result<T, DriverError>,
) -> Result<T, AllocError> {
    match alloc() {
        Err(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
            state.ctx.synchronize().map_err(alloc_error)?;
            alloc().map_err(alloc_error)
        }
        got => got.map_err(alloc_error),
    }
}

impl Backend for CudaBackend {
    fn alloc(&self, device: Device, bytes: usize, zeroed: bool) -> Result<Storage, AllocError> {
        let n = ordinal(device).map_err(AllocError::Other)?;
        let state = device_state(n).map_err(AllocError::Other)?;
        let stream = thread_stream(n, state);
        // SAFETY: the memory is left unset here; it is zeroed below when asked, and otherwise
        // only ever copied out as plain bytes (`Array` zeroes or overwrites it before any
        // element type that not every bit pattern is valid for could be read).
        let mut slice = retry_out_of_memory(state, || unsafe { stream.alloc::<u8>(bytes) })?;
        if zeroed {
            stream.memset_zeros(&mut slice).map_err(alloc_error)?;
        }
        state.allocs.fetch_add(1, Relaxed);
        state.outstanding.fetch_add(bytes, Relaxed);
        let base = raw_ptr(&slice);
        Ok(Storage::Cuda(Box::new(CudaBuf::new(
            slice, base, false, stream,
        ))))
    }

    fn alloc_growable(&self, device: Device, bytes: usize) -> Result<Storage, AllocError> {
        let n = ordinal(device).map_err(AllocError::Other)?;
        let state = device_state(n).map_err(AllocError::Other)?;
        let Some(vmm) = state.vmm.filter(|_| bytes >= vmm::GROWABLE_MIN) else {
            return self.alloc(device, bytes, false);
        };
        state.ctx.bind_to_thread().map_err(alloc_error)?;
        let Ok(mapping) = retry_out_of_memory(state, || vmm.map(bytes)) else {
            // Not mapped this way (the device's memory, or the addresses, spent): from the pool,
            // as any other block, which reports what it cannot give.
            return self.alloc(device, bytes, false);
        };
        let (base, mapped) = (mapping.base(), mapping.mapped());
        let stream = thread_stream(n, state);
        // SAFETY: `[base, base + mapped)` is mapped, readable and writable by the device, and
        // stays so until the buffer's drop releases it, after leaking this slice (which cudarc
        // must never free). The memory is left unset, as in `alloc`.
        let slice = unsafe { stream.upgrade_device_ptr::<u8>(base, mapped) };
        state.allocs.fetch_add(1, Relaxed);
        state.outstanding.fetch_add(mapped, Relaxed);
        let mut buf = CudaBuf::new(slice, base, false, stream);
        buf.mapping = Some(Mutex::new(mapping));
        Ok(Storage::Cuda(Box::new(buf)))
    }

    /// Maps more memory after the block's end (its address, its bytes and cudarc's slice of
    /// them stay: views are made from the address, not from the slice, so the slice need not
    /// cover the new bytes), under the mapping's lock: views of the block may be alive on other
    /// threads, which read only the block's stream and its marks.
    fn grow(&self, device: Device, storage: &Storage, bytes: usize) -> Result<bool, AllocError> {
        let Storage::Cuda(buf) = storage else {
            return Ok(false);
        };
        let Some(mapping) = &buf.mapping else {
            return Ok(false);
        };
        let mut mapping = mapping.lock();
        let before = mapping.mapped();
        let state = ordinal(device)
            .and_then(device_state)
            .map_err(AllocError::Other)?;
        state.ctx.bind_to_thread().map_err(alloc_error)?;
        match retry_out_of_memory(state, || mapping.grow(bytes)) {
            Ok(true) => {}
            // No room in the reservation: the caller makes a new block.
            Ok(false) => return Ok(false),
            Err(e @ AllocError::OutOfMemory) => return Err(e),
            // Any other refusal: not grown; a new block reports what the driver says.
            Err(AllocError::Other(_)) => return Ok(false),
        }
        let mapped = mapping.mapped();
        if mapped == before {
            return Ok(true);
        }
        buf.len.store(mapped, Relaxed);
        state.allocs.fetch_add(1, Relaxed);
        state.outstanding.fetch_add(mapped - before, Relaxed);
        Ok(true)
    }

    fn is_growable(&self, storage: &Storage) -> bool {
        matches!(storage, Storage::Cuda(buf) if buf.mapping.is_some())
    }

    fn free(&self, device: Device, storage: Storage) {
        let bytes = storage.bytes();
        drop(storage);
        if let Ok(state) = ordinal(device).and_then(device_state) {
            state.frees.fetch_add(1, Relaxed);
            state.outstanding.fetch_sub(bytes, Relaxed);
        }
    }

    fn stats(&self, device: Device) -> DeviceStats {
        ordinal(device)
            .and_then(device_state)
            .map_or(DeviceStats::default(), |s| DeviceStats {
                allocs: s.allocs.load(Relaxed),
                frees: s.frees.load(Relaxed),
                bytes_allocated: s.outstanding.load(Relaxed),
            })
    }
}

/// An owned CUDA buffer: cudarc's slice, the stream it was last handed out on, and the
/// cross-stream uses declared with `Array::record_stream`.
#[derive(Debug)]
pub(crate) struct CudaBuf {
    /// cudarc's slice: made with the buffer for an allocation; for a view, at the first use
    /// that needs it ([`CudaBuf::slice`]), perhaps never. Taken in `Drop`: freed by cudarc, or
    /// leaked back for a view.
    slice: OnceLock<CudaSlice<u8>>,
    /// The bytes the slice spans (or will span: a view's range, from where it was made to the
    /// end of its block then).
    span: usize,
    /// The device's ordinal.
    ordinal: usize,
    /// The buffer's size: the slice's, or less for a view (see [`CudaBuf::set_view_len`]), or
    /// more for a growable block grown (atomic: it grows through a shared reference; read
    /// relaxed, a plain load).
    len: AtomicUsize,
    /// The device address of the first byte, read without cudarc's event tracking (graph
    /// capture uses it raw).
    base: CUdeviceptr,
    /// Whether this is a view of another buffer's memory (see [`CudaBuf::view`]), which it
    /// must never free.
    view: bool,
    /// The stream of the buffer's current (or last) owner.
    stream: Arc<CudaStream>,
    /// Other streams the current owner was used on (`Array::record_stream`), not yet recorded.
    marked: Mutex<SmallVec<[Arc<CudaStream>; 1]>>,
    /// Events recorded on the marked streams when the owner dropped.
    events: Vec<CudaEvent>,
    /// Flags of captured graphs that bake in this buffer's address for its current owner;
    /// cleared when the owner drops (the graph must not be replayed any more).
    watchers: Mutex<Vec<Arc<AtomicBool>>>,
    /// A growable block's mapping (see [`vmm`]), locked to grow: the slice is then cudarc's view
    /// of its first bytes, never freed by cudarc.
    mapping: Option<Mutex<vmm::Mapping>>,
}

impl CudaBuf {
    /// A buffer over `slice` (starting at device address `base`), owned by `stream`, with no
    /// marks, events or watchers; a `view` never frees its memory.
    fn new(slice: CudaSlice<u8>, base: CUdeviceptr, view: bool, stream: Arc<CudaStream>) -> Self {
        let len = slice.len();
        CudaBuf::with(OnceLock::from(slice), base, len, view, stream)
    }

    /// A buffer of `len` bytes at `base` whose cudarc slice is `slice`'s (or made later, over
    /// those bytes), owned by `stream`, with no marks, events or watchers.
    fn with(
        slice: OnceLock<CudaSlice<u8>>,
        base: CUdeviceptr,
        len: usize,
        view: bool,
        stream: Arc<CudaStream>,
    ) -> Self {
        CudaBuf {
            slice,
            span: len,
            ordinal: stream.context().ordinal(),
            len: AtomicUsize::new(len),
            base,
            view,
            stream,
            marked: Mutex::new(SmallVec::new()),
            events: Vec::new(),
            watchers: Mutex::new(Vec::new()),
            mapping: None,
        }
    }

    /// The size in bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Makes a view `bytes` long: the same view (and its cudarc slice and events, if it has
    /// them), over the range it was made for, serves an array of another size there.
    ///
    /// # Safety
    /// `self` was made by [`CudaBuf::view`] over at least `bytes > 0` bytes ([`CudaBuf::spans`]).
    pub(crate) unsafe fn set_view_len(&mut self, bytes: usize) {
        debug_assert!(self.view && bytes <= self.span);
        *self.len.get_mut() = bytes;
    }

    /// Whether the buffer's cudarc slice holds (or a view's, when made, will hold) `bytes`
    /// bytes (a view's range ends where its block ended when it was made, and the block may have
    /// grown since).
    #[inline]
    pub(crate) fn spans(&self, bytes: usize) -> bool {
        bytes <= self.span
    }

    /// The device the buffer lives on.
    pub(crate) fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The device pointer of the buffer.
    pub(crate) fn ptr(&self) -> &CUdeviceptr {
        &self.base
    }

    /// During a step graph capture: records that the graph bakes in this buffer's address, so
    /// that it is not replayed once the buffer's owner drops.
    pub(crate) fn pin(&self) {
        if let Some(alive) = capture::alive_flag() {
            self.watch(&alive);
        }
    }

    /// Clears `alive` when the current owner drops (see [`CudaBuf::end_use`]). Flags of graphs
    /// that are gone are forgotten here.
    fn watch(&self, alive: &Arc<AtomicBool>) {
        let mut watchers = self.watchers.lock();
        watchers.retain(|w| Arc::strong_count(w) > 1 && !Arc::ptr_eq(w, alive));
        watchers.push(Arc::clone(alive));
    }

    /// A view of the `bytes` bytes at `offset`, on this thread's current stream for the device,
    /// which never frees them: its cudarc slice (with its own read/write events) is made at its
    /// first use that needs one ([`CudaBuf::slice`], [`CudaBuf::tracks`]).
    ///
    /// # Safety
    /// `offset + bytes <= self.bytes()`, `bytes > 0`, and the memory stays allocated for as long
    /// as the view lives.
    pub(crate) unsafe fn view(&self, offset: usize, bytes: usize) -> Result<CudaBuf> {
        let n = self.ordinal;
        let stream = thread_stream(n, device_state(n)?);
        let base = self.base + offset as CUdeviceptr;
        // The range lies inside this buffer's allocation (caller), which outlives the view; the
        // view's slice, if one is made, is leaked back, never freed, when it drops.
        Ok(CudaBuf::with(OnceLock::new(), base, bytes, true, stream))
    }

    /// Whether the current owner was used on `other`'s stream alone: [`CudaBuf::hand_marks_to`]
    /// would hand `other` nothing. (The same `Arc`: a stream wrapped twice is told apart there.)
    #[inline]
    pub(crate) fn used_on_stream_of(&mut self, other: &CudaBuf) -> bool {
        self.marked.get_mut().is_empty() && Arc::ptr_eq(&self.stream, &other.stream)
    }

    /// A view's owner dropped: its marked streams, and its own stream if it is not the
    /// parent's, become marks of `parent`, recorded when the parent's owner ends its use.
    /// Returns whether there were any (the view was used on a stream other than the parent's).
    pub(crate) fn hand_marks_to(&mut self, parent: &CudaBuf) -> bool {
        let own = parent.stream.cu_stream();
        let mut marks = mem::take(self.marked.get_mut());
        if self.stream.cu_stream() != own {
            marks.push(Arc::clone(&self.stream));
        }
        if marks.is_empty() {
            return false;
        }
        let mut marked = parent.marked.lock();
        for stream in marks {
            let s = stream.cu_stream();
            if s != own && !marked.iter().any(|m| m.cu_stream() == s) {
                marked.push(stream);
            }
        }
        true
    }

    /// A view of this buffer used on other streams ([`CudaBuf::hand_marks_to`]) was dropped on
    /// a thread that is not the buffer's owner, which learns only that a view of it is gone
    /// (not which bytes it held) and may hand those bytes out again once it counts no view
    /// alive: the owner's stream waits here, from the dropping thread, for the work queued so
    /// far on every stream the buffer is marked with, so that its next use of any of the bytes
    /// comes after that work. The marks stay, for when the buffer is freed. A failure to order
    /// is recorded in the context and the marked stream waited for on the host instead.
    ///
    /// The caller holds a view of the buffer (its count is not yet released), so the owner is
    /// not changing the buffer's stream meanwhile (it does so only with no view alive).
    pub(crate) fn order_after_marks(&self) {
        let marked = self.marked.lock();
        for stream in marked.iter() {
            if let Err(e) = self.stream.join(stream) {
                let ctx = stream.context();
                ctx.record_err::<()>(Err(e));
                ctx.record_err(stream.synchronize());
            }
        }
    }

    /// Waits on this thread while the stream of this buffer's cudarc slice is being captured
    /// into a graph (by its owner thread, in a [`StepGraph`](crate::cuda::StepGraph)), before
    /// this thread makes that stream wait for anything: dropping the slice makes its stream wait
    /// for the events of the slice's uses, and [`CudaBuf::order_after_marks`] for the marked
    /// streams, work recorded outside the capture, on which a stream being captured may not
    /// wait. Such a wait failed the capture (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`), and every
    /// later test of the process failed with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (a stream
    /// left capturing). A graph is captured once, within one run of its step, so the wait is
    /// short; an owner that waited, during the capture, for this thread to drop the array would
    /// wait forever.
    pub(crate) fn wait_out_capture(&self) {
        // No slice, no events: its drop makes no stream wait.
        let Some(slice) = self.slice.get() else {
            return;
        };
        let stream = slice.stream();
        while matches!(
            stream.capture_status(),
            Ok(s) if s != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        ) {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// cudarc's slice of the whole buffer (a view's made now if it has none: see the module
    /// docs).
    pub(crate) fn slice(&self) -> &CudaSlice<u8> {
        self.slice.get_or_init(|| self.make_slice())
    }

    /// cudarc's slice of the whole buffer, mutable.
    pub(crate) fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        if self.slice.get().is_none() {
            let slice = self.make_slice();
            self.slice = OnceLock::from(slice);
        }
        match self.slice.get_mut() {
            Some(slice) => slice,
            None => unreachable!("the slice was made above"),
        }
    }

    /// A view's cudarc slice, on its owner's stream (an allocation's is made with it).
    #[cold]
    #[inline(never)]
    fn make_slice(&self) -> CudaSlice<u8> {
        debug_assert!(self.view, "an allocation's slice is made with it");
        VIEW_SLICES.fetch_add(1, Relaxed);
        // SAFETY: `[base, base + span)` is the view's range, inside its block's allocation,
        // which outlives the view (`CudaBuf::view`'s contract), so it outlives the slice too: the
        // slice is leaked back, never freed, when the view drops.
        unsafe { self.stream.upgrade_device_ptr::<u8>(self.base, self.span) }
    }

    /// Whether a use of the buffer through cudarc must take its slice, with its events (made
    /// then for a view that has none): the buffer has one already, or the context manages
    /// synchronisation across streams. Otherwise cudarc uses no slice's events, and the use
    /// takes the device address ([`CudaBuf::ptr`]), as cudarc would take the slice's.
    #[inline]
    pub(crate) fn tracks(&self) -> bool {
        self.slice.get().is_some() || self.stream.context().is_managing_stream_synchronization()
    }

    /// The stream of the buffer's current owner.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Declares that the current owner is used on `stream` too.
    pub(crate) fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if capture::capturing() && stream.cu_stream() != self.stream.cu_stream() {
            let device = self.device();
            return Err(capture::fail(|| Error::CaptureForeignStream { device }));
        }
        if **stream.context() != **self.stream.context() {
            let found = Device::Cuda(stream.context().ordinal());
            let expected = Device::Cuda(self.stream.context().ordinal());
            return Err(if found == expected {
                Error::ForeignStream { device: found }
            } else {
                Error::DeviceMismatch { expected, found }
            });
        }
        if stream.cu_stream() == self.stream.cu_stream() {
            return Ok(());
        }
        let mut marked = self.marked.lock();
        if !marked.iter().any(|s| s.cu_stream() == stream.cu_stream()) {
            marked.push(Arc::clone(stream));
        }
        Ok(())
    }

    /// The owner dropped: record an event on each marked stream, so the buffer is reused (or
    /// freed) only after the work queued there so far. Inlined: it runs on every array drop,
    /// and there is usually nothing to do.
    #[inline]
    pub(crate) fn end_use(&mut self) {
        if !self.watchers.get_mut().is_empty() || !self.marked.get_mut().is_empty() {
            self.end_use_slow();
        }
    }

    #[cold]
    #[inline(never)]
    fn end_use_slow(&mut self) {
        for w in self.watchers.get_mut().drain(..) {
            w.store(false, std::sync::atomic::Ordering::Release);
        }
        if self.view {
            // A view's marks go to the buffer it is a view of (`hand_marks_to`).
            return;
        }
        for stream in self.marked.get_mut().drain(..) {
            match stream.record_event(None) {
                Ok(event) => self.events.push(event),
                // No event: wait for the stream here instead (a failing driver has bigger
                // problems, but the buffer must not be reused under running work).
                Err(e) => {
                    let ctx = stream.context();
                    ctx.record_err::<()>(Err(e));
                    ctx.record_err(stream.synchronize());
                }
            }
        }
    }

    /// Whether the work recorded on other streams has completed (no events: at once).
    ///
    /// A failed query counts as not complete: a driver error must not let the buffer be handed
    /// out while the device may still use it. Such a buffer stays on its cache's deferred list
    /// (polled again at misses and scope exits, counted as waiting) until it is freed, which
    /// (`cuMemFreeAsync`, ordered after its events) is safe whatever the events' state.
    pub(crate) fn is_idle(&self) -> bool {
        self.events
            .iter()
            .all(|e| e.try_is_complete().unwrap_or(false))
    }

    /// Whether the thread's current stream for the device is the buffer's: then
    /// [`CudaBuf::prepare_reuse`] has nothing to order.
    #[inline]
    pub(crate) fn on_current_stream(&self) -> bool {
        current_handle(self.ordinal) == self.stream.cu_stream()
    }

    /// Hands the buffer to a new owner on this thread's current stream for its device.
    #[inline]
    pub(crate) fn prepare_reuse(&mut self) -> Result<()> {
        // The cache hands out only idle buffers: their events have completed.
        self.events.clear();
        let n = self.ordinal;
        if current_handle(n) != self.stream.cu_stream() {
            if capture::capturing() {
                // Ordering after another stream would wait on work outside the capture.
                let device = self.device();
                return Err(capture::fail(|| Error::CaptureForeignStream { device }));
            }
            let current = thread_stream(n, device_state(n)?);
            current.join(&self.stream)?;
            self.stream = current;
        }
        Ok(())
    }

    /// Zeroes the first `bytes` bytes, on the owner's stream.
    pub(crate) fn zero(&mut self, bytes: usize) -> Result<()> {
        if capture::capturing() {
            capture::require_capture_stream(self.stream.cu_stream());
            self.pin();
            // Without cudarc's events, which a capture may not wait on.
            return self.zero_raw(bytes);
        }
        if !self.tracks() {
            return self.zero_raw(bytes);
        }
        let stream = Arc::clone(&self.stream);
        stream.memset_zeros(&mut self.slice_mut().slice_mut(..bytes))?;
        Ok(())
    }

    /// Zeroes the first `bytes` bytes on the owner's stream through the driver, without cudarc's
    /// events (while capturing, or while the context uses none).
    fn zero_raw(&self, bytes: usize) -> Result<()> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: `base` is the start of this buffer's `bytes() >= bytes` bytes (callers), which
        // the caller's exclusive borrow keeps alive and unaliased until the memset is queued; the
        // memset is ordered on the owner's stream like any use of the buffer.
        unsafe {
            cudarc::driver::result::memset_d8_async(self.base, 0, bytes, self.stream.cu_stream())
        }?;
        Ok(())
    }

    /// Copies `src` to the start of the buffer, on the owner's stream.
    pub(crate) fn write(&mut self, src: &[u8]) -> Result<()> {
        if capture::capturing() {
            let what = "a copy from host memory (Array::from_slice)";
            return Err(capture::fail(|| Error::CaptureUnsupported { what }));
        }
        if !self.tracks() {
            let stream = &self.stream;
            stream.context().bind_to_thread()?;
            // SAFETY: `base` is the start of this buffer's `bytes() >= src.len()` bytes (the
            // caller's array), which the exclusive borrow keeps alive and unaliased until the copy
            // is queued; from pageable memory the copy has read `src` when it returns, as in
            // cudarc's own `memcpy_htod` of a host slice, which makes this same call.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(self.base, src, stream.cu_stream())
            }?;
            return Ok(());
        }
        let stream = Arc::clone(&self.stream);
        let mut view = self.slice_mut().slice_mut(..src.len());
        stream.memcpy_htod(src, &mut view)?;
        Ok(())
    }

    /// Copies the start of the buffer to `dst`, on this thread's current stream for its device
    /// (ordered after the owner's stream), and waits for the copy.
    pub(crate) fn read(&self, dst: &mut [u8]) -> Result<()> {
        if capture::capturing() {
            let what = "a copy to host memory (Array::to_vec)";
            return Err(capture::fail(|| Error::CaptureUnsupported { what }));
        }
        let n = self.ordinal;
        let state = device_state(n)?;
        let stream = thread_stream(n, state);
        if stream.cu_stream() != self.stream.cu_stream() {
            stream.join(&self.stream)?;
        }
        if self.tracks() {
            let view = self.slice().slice(..dst.len());
            stream.memcpy_dtoh(&view, dst)?;
        } else {
            stream.context().bind_to_thread()?;
            // SAFETY: `base` starts this buffer's `bytes() >= dst.len()` bytes (the caller's
            // array, borrowed until the copy is done); `dst` is written only by the copy, which
            // the synchronisation below waits for before `dst`'s borrow ends.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(dst, self.base, stream.cu_stream())
            }?;
        }
        stream.synchronize()?;
        Ok(())
    }
}

impl Drop for CudaBuf {
    /// cudarc frees the slice on the stream it was allocated on, after its tracked reads and
    /// writes. Order that free after the owner's stream and the marked streams too.
    fn drop(&mut self) {
        if self.view {
            // Not ours to free: cudarc waits for the view's events and forgets the pointer.
            if let Some(slice) = self.slice.take() {
                slice.leak();
            }
            return;
        }
        self.end_use();
        if let Some(mapping) = self.mapping.take() {
            return self.release(mapping.into_inner());
        }
        // An allocation's slice is made with it (so it is always there to free).
        let Some(slice) = self.slice.take() else {
            return;
        };
        let free_stream = Arc::clone(slice.stream());
        let ctx = free_stream.context();
        // An error recorded earlier in the context is set aside while the buffer is freed, and
        // recorded again after: cudarc's calls return it in place of their work (its
        // `bind_to_thread` checks it first), so the waits below and the slice's own would be
        // skipped, and the free no longer ordered after them.
        let pending = ctx.check_err();
        // A buffer may be freed on any thread (an array dropped on another one, whose cache
        // cannot take it back, or that has none): cudarc frees in the thread's current context,
        // and makes it current only to wait for the slice's own events.
        ctx.record_err(ctx.bind_to_thread());
        for event in &self.events {
            ctx.record_err(free_stream.wait(event));
        }
        if self.stream.cu_stream() != free_stream.cu_stream()
            && let Err(e) = free_stream.join(&self.stream)
        {
            ctx.record_err::<()>(Err(e));
            ctx.record_err(self.stream.synchronize());
        }
        drop(slice);
        ctx.record_err(pending);
    }
}

impl CudaBuf {
    /// Drops a growable block: waits for every stream that used it (unmapping does not wait
    /// for the device), then unmaps it. A block whose streams cannot be waited for is leaked
    /// rather than unmapped under running work (a failing driver has bigger problems).
    #[cold]
    fn release(&mut self, mapping: vmm::Mapping) {
        // cudarc's view of the mapping (made with it): its stream waits for its events, and it is
        // forgotten.
        let slice_stream = self.slice.take().map(|slice| {
            let stream = Arc::clone(slice.stream());
            slice.leak();
            stream
        });
        let ctx = Arc::clone(self.stream.context());
        // An error recorded earlier, set aside (see `drop`): returned by the calls below in
        // place of their work, it had the block leaked.
        let pending = ctx.check_err();
        let idle = self
            .events
            .iter()
            .try_for_each(CudaEvent::synchronize)
            .and_then(|()| self.stream.synchronize())
            .and_then(|()| slice_stream.as_ref().map_or(Ok(()), |s| s.synchronize()))
            .and_then(|()| ctx.bind_to_thread());
        ctx.record_err(pending);
        match idle {
            // SAFETY: the block's own stream, the slice's and the streams its owners were
            // marked as used on (their events, recorded by `end_use`; views hand their streams
            // to their block) have finished their work; no view of the block is alive (a block
            // is freed only once its views are gone), and the buffer is dropping, so nothing
            // uses the addresses again. The context is current.
            Ok(()) => unsafe { mapping.release() },
            Err(e) => {
                ctx.record_err::<()>(Err(e));
                mem::forget(mapping);
            }
        }
    }
}

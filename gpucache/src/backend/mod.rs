//! The backend boundary: where bytes come from and go back to.
//!
//! A backend allocates and frees device memory and knows nothing of caches or scopes. The cache
//! moves [`Block`]s around; a `Block` owns its memory and the backend that made it, so it goes
//! back to the right place from whichever thread drops it (RAII: dropping a `Block` frees it).
//!
//! Backends: [`cpu`] (64-byte aligned host memory, always built), `cuda` (feature `cuda`: device
//! memory through cudarc, stream-ordered; a planned cache's large blocks through CUDA's virtual
//! memory management, growable in place) and the counting, fault-injecting backend of
//! [`crate::testing`] (which can grow blocks in place too, for tests). Each device resolves to
//! one backend per thread: for `Device::Cpu` the CPU backend unless a test installed another on
//! this thread, for `Device::Cuda(n)` the CUDA backend.

pub(crate) mod cpu;

pub(crate) use cpu::HostBuf;
#[cfg(feature = "cuda")]
pub(crate) mod capture;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use std::cell::RefCell;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, LazyLock};

use crate::{Device, DeviceStats, Error, Result};

/// Alignment of every host allocation, in bytes (a cache line, and enough for AVX-512 loads).
pub(crate) const HOST_ALIGN: usize = 64;
// The largest array must stay describable at this alignment.
const _: () = assert!(crate::shape::MAX_BYTES.is_multiple_of(HOST_ALIGN));

/// Blocks smaller than this come from the stream-ordered pool even when asked to be growable
/// (CUDA's virtual memory management maps the larger ones): below it a fresh pool allocation
/// costs no more than a mapping (about 50-100 µs either way). The testing backend, told a
/// granularity, does the same.
pub(crate) const GROWABLE_MIN: usize = 32 << 20;

/// A source of device memory.
pub(crate) trait Backend: Send + Sync + fmt::Debug {
    /// Allocates `bytes > 0` bytes on `device`. Host memory is always returned zeroed (it must be
    /// initialised to be read); `zeroed` asks a device backend to zero it too.
    fn alloc(&self, device: Device, bytes: usize, zeroed: bool) -> Result<Storage, AllocError>;
    /// Allocates `bytes > 0` bytes on `device` that [`Backend::grow`] may later grow in place
    /// (a planned cache's block, which a larger step makes larger). Never zeroed: the arrays
    /// in such a block zero their own bytes. A backend that cannot grow memory allocates as
    /// [`Backend::alloc`] does.
    fn alloc_growable(&self, device: Device, bytes: usize) -> Result<Storage, AllocError> {
        self.alloc(device, bytes, false)
    }
    /// Grows `storage`, made by this backend on `device`, in place to at least `bytes`: its
    /// address and contents stay, and only the new bytes are allocated (counted as one
    /// allocation). `Ok(false)` when it cannot (memory not made growable, or no room to grow).
    /// Through a shared reference: views of the storage may be alive, on any thread, and
    /// stay valid (a plan's block grows under the arrays a step keeps alive in it); the
    /// storage's growable state is behind its own lock or atomics.
    fn grow(&self, device: Device, storage: &Storage, bytes: usize) -> Result<bool, AllocError> {
        let _ = (device, storage, bytes);
        Ok(false)
    }
    /// Whether [`Backend::grow`] may grow `storage`.
    fn is_growable(&self, storage: &Storage) -> bool {
        let _ = storage;
        false
    }
    /// Gives memory made by [`Backend::alloc`] on `device` back.
    fn free(&self, device: Device, storage: Storage);
    /// What this backend has done on `device`.
    fn stats(&self, device: Device) -> DeviceStats;
}

/// Why an allocation failed.
#[derive(Debug)]
pub(crate) enum AllocError {
    /// The device has no room: the caller may release cached memory and retry.
    OutOfMemory,
    /// Anything else; retrying will not help.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // produced by device backends
    Other(Error),
}

/// Memory owned by a backend allocation.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Host memory.
    Host(HostBuf),
    /// CUDA device memory (boxed: arrays stay small, and the box is made once per device
    /// allocation, not per hit).
    #[cfg(feature = "cuda")]
    Cuda(Box<cuda::CudaBuf>),
}

impl Storage {
    /// The size in bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Storage::Host(h) => h.bytes(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.bytes(),
        }
    }

    /// The host memory, when that is what it is.
    pub(crate) fn host(&self) -> Option<&HostBuf> {
        match self {
            Storage::Host(h) => Some(h),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    /// The host memory, when that is what it is; else the storage back.
    pub(crate) fn into_host(self) -> Result<HostBuf, Storage> {
        match self {
            Storage::Host(h) => Ok(h),
            #[cfg(feature = "cuda")]
            other => Err(other),
        }
    }

    /// The device the memory lives on.
    pub(crate) fn device(&self) -> Device {
        match self {
            Storage::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.device(),
        }
    }
}

/// A block of device memory: a [`Storage`] and the backend that owns it. Dropping a block gives
/// its memory back to that backend.
///
/// A block may also be a *view*: a sub-range of another block, made by [`Block::view`] for an
/// arena cache. A view's backend is the arena block it was cut from, which counts its views
/// itself (without atomics): a view holds no count of that `Arc`, and is given back with
/// [`Block::drop_view`], not dropped. Nothing else tells views apart, so the paths that move
/// blocks of free lists around never test for them.
pub(crate) struct Block {
    storage: ManuallyDrop<Storage>,
    backend: Arc<dyn Backend>,
}

// Blocks are moved on every hit and release, and arrays and homes with them: their sizes are
// part of the hit path's cost, so a change that grows them must show up here.
const _: () = assert!(std::mem::size_of::<Block>() == 32);
const _: () = assert!(std::mem::size_of::<Option<Block>>() == 32);

impl Block {
    /// Allocates a block of `bytes` on `device` from `backend`.
    pub(crate) fn alloc(
        backend: &Arc<dyn Backend>,
        device: Device,
        bytes: usize,
        zeroed: bool,
    ) -> Result<Block, AllocError> {
        let storage = backend.alloc(device, bytes, zeroed)?;
        Ok(Block {
            storage: ManuallyDrop::new(storage),
            backend: Arc::clone(backend),
        })
    }

    /// Allocates a block of `bytes` on `device` from `backend` that [`Block::grow`] may grow
    /// (see [`Backend::alloc_growable`]).
    pub(crate) fn alloc_growable(
        backend: &Arc<dyn Backend>,
        device: Device,
        bytes: usize,
    ) -> Result<Block, AllocError> {
        let storage = backend.alloc_growable(device, bytes)?;
        Ok(Block {
            storage: ManuallyDrop::new(storage),
            backend: Arc::clone(backend),
        })
    }

    /// Grows the block in place to at least `bytes` (see [`Backend::grow`]: views of it stay
    /// valid); `Ok(false)` when its backend cannot.
    pub(crate) fn grow(&self, bytes: usize) -> Result<bool, AllocError> {
        self.backend.grow(self.device(), &self.storage, bytes)
    }

    /// Whether [`Block::grow`] may grow the block.
    pub(crate) fn is_growable(&self) -> bool {
        self.backend.is_growable(&self.storage)
    }

    /// A view of the `bytes` bytes of this block that start at `offset`, whose backend is
    /// `owner` (device memory: made on this thread's current stream for the device, with cudarc
    /// events of its own, and never freed by cudarc).
    ///
    /// # Safety
    /// `offset + bytes <= self.bytes()` and `bytes > 0`; `owner` is the pointer
    /// [`Arc::into_raw`] gave for an `Arc` that stays alive, as do this block and its memory,
    /// unmoved and unwritten through `self`, for as long as the view lives; the view is given
    /// back with [`Block::drop_view`] (if it is dropped instead, `owner`'s `free` must add the
    /// count that the drop takes off).
    #[inline]
    pub(crate) unsafe fn view(
        &self,
        owner: *const dyn Backend,
        offset: usize,
        bytes: usize,
    ) -> Result<Block> {
        debug_assert!(offset + bytes <= self.bytes() && bytes > 0);
        #[cfg(test)]
        VIEWS_MADE.with(|n| n.set(n.get() + 1));
        let storage = match &*self.storage {
            // SAFETY: the range is inside this block's allocation (caller), so the pointer stays
            // in bounds and non-null; the view's backend never frees it.
            Storage::Host(h) => Storage::Host(unsafe { h.view(offset, bytes) }),
            // SAFETY: as above; a CUDA view leaks its slice back when it drops.
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Storage::Cuda(Box::new(unsafe { c.view(offset, bytes) }?)),
        };
        // SAFETY: `owner` came from `Arc::into_raw` of an `Arc` that outlives the view (caller).
        // The new `Arc` holds no count: `drop_view` forgets it, and a drop balances it (caller).
        let backend = unsafe { Arc::from_raw(owner) };
        Ok(Block {
            storage: ManuallyDrop::new(storage),
            backend,
        })
    }

    /// Makes a view `bytes` long, to serve another array where it was made.
    ///
    /// # Safety
    /// `self` was made by [`Block::view`], its block holds `bytes > 0` bytes from the view's
    /// start, and the view reaches them ([`Block::spans`]).
    #[inline]
    pub(crate) unsafe fn set_view_len(&mut self, bytes: usize) {
        match &mut *self.storage {
            // SAFETY: a view whose buffer holds `bytes` bytes from its start (caller).
            Storage::Host(h) => unsafe { h.set_view_len(bytes) },
            // SAFETY: as above, and its slice reaches them (caller).
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => unsafe { c.set_view_len(bytes) },
        }
    }

    /// Whether a view made by [`Block::view`] reaches `bytes` bytes from its start: a device
    /// view's cudarc slice ends where its block ended when it was made, and the block may have
    /// grown since (host memory: a pointer, no end of its own).
    #[inline(always)]
    pub(crate) fn spans(&self, bytes: usize) -> bool {
        match &*self.storage {
            Storage::Host(_) => {
                let _ = bytes;
                true
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.spans(bytes),
        }
    }

    /// Drops a view without a call to its backend.
    ///
    /// # Safety
    /// `self` was made by [`Block::view`].
    #[inline]
    pub(crate) unsafe fn drop_view(self) {
        let mut view = ManuallyDrop::new(self);
        // SAFETY: the storage is dropped once, and `view` never is: its backend, which holds no
        // count (caller), is forgotten.
        unsafe { ManuallyDrop::drop(&mut view.storage) };
    }

    /// The backend, as the pointer [`Arc::as_ptr`] gives: for a view, its owner as passed to
    /// [`Block::view`].
    #[inline]
    pub(crate) fn backend_ptr(&self) -> *const dyn Backend {
        Arc::as_ptr(&self.backend)
    }

    /// The capacity in bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        self.storage.bytes()
    }

    /// The device the block lives on.
    #[inline]
    pub(crate) fn device(&self) -> Device {
        self.storage.device()
    }

    /// The address of the memory's first byte (host or device), for debug checks.
    pub(crate) fn address(&self) -> usize {
        match &*self.storage {
            Storage::Host(h) => h.ptr().as_ptr().addr(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => *c.ptr() as usize,
        }
    }

    /// The host allocation, when the memory is host memory.
    #[inline]
    pub(crate) fn host(&self) -> Option<&HostBuf> {
        match &*self.storage {
            Storage::Host(h) => Some(h),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    /// The CUDA allocation, when the memory is CUDA device memory.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> Option<&cuda::CudaBuf> {
        match &*self.storage {
            Storage::Cuda(c) => Some(c),
            Storage::Host(_) => None,
        }
    }

    /// The CUDA allocation, mutable, when the memory is CUDA device memory.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_mut(&mut self) -> Option<&mut cuda::CudaBuf> {
        match &mut *self.storage {
            Storage::Cuda(c) => Some(c),
            Storage::Host(_) => None,
        }
    }

    /// A number naming the block while it lives (the address of its host memory, or of its
    /// CUDA buffer's bookkeeping), for recorded events.
    pub(crate) fn id(&self) -> u64 {
        match &*self.storage {
            Storage::Host(h) => h.ptr().as_ptr() as u64,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => &raw const **c as u64,
        }
    }

    /// The CUDA stream the block was last handed out on, as a number (its `CUstream` handle; 0
    /// for the default stream), for recorded events. `None` for host memory.
    pub(crate) fn stream_id(&self) -> Option<u64> {
        match &*self.storage {
            Storage::Host(_) => None,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Some(c.stream().cu_stream() as u64),
        }
    }

    /// Whether no device work that was recorded against this block on another stream is still
    /// running, so that it may be handed out again. Host memory is always idle.
    #[inline]
    pub(crate) fn is_idle(&self) -> bool {
        match &*self.storage {
            Storage::Host(_) => true,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.is_idle(),
        }
    }

    /// The block's array dropped: device backends record events for the work queued so far
    /// on the streams the array was marked as used on (so [`Block::is_idle`] can tell when it
    /// is done). Nothing to do for host memory.
    #[inline]
    pub(crate) fn end_use(&mut self) {
        match &mut *self.storage {
            Storage::Host(_) => {}
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.end_use(),
        }
    }

    /// Whether [`Block::prepare_reuse`] has nothing to order: host memory, or device memory
    /// last used on the thread's current stream.
    #[inline]
    pub(crate) fn on_current_stream(&self) -> bool {
        match &*self.storage {
            Storage::Host(_) => true,
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.on_current_stream(),
        }
    }

    /// Prepares a recycled block for its new array: device backends order the thread's
    /// current stream after the block's earlier work. Nothing to do for host memory.
    #[inline]
    pub(crate) fn prepare_reuse(&mut self) -> Result<()> {
        match &mut *self.storage {
            Storage::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.prepare_reuse(),
        }
    }

    /// Sets the first `bytes` bytes to zero.
    pub(crate) fn zero(&mut self, bytes: usize) -> Result<()> {
        debug_assert!(bytes <= self.bytes());
        match &mut *self.storage {
            Storage::Host(h) => h.zero(bytes),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.zero(bytes),
        }
    }

    /// Copies `src` to the start of the block.
    pub(crate) fn write(&mut self, src: &[u8]) -> Result<()> {
        debug_assert!(src.len() <= self.bytes());
        match &mut *self.storage {
            Storage::Host(h) => h.write(src),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.write(src),
        }
    }

    /// Copies the start of the block to `dst`.
    pub(crate) fn read(&self, dst: &mut [u8]) -> Result<()> {
        debug_assert!(dst.len() <= self.bytes());
        match &*self.storage {
            Storage::Host(h) => h.read(dst),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.read(dst),
        }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: `storage` is taken exactly once, here, and `self` is never used again.
        let storage = unsafe { ManuallyDrop::take(&mut self.storage) };
        self.backend.free(storage.device(), storage);
    }
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("bytes", &self.bytes())
            .field("device", &self.storage.device())
            .finish_non_exhaustive()
    }
}

static CPU: LazyLock<Arc<dyn Backend>> = LazyLock::new(|| Arc::new(cpu::CpuBackend::default()));

thread_local! {
    /// Backends installed for `Device::Cpu` on this thread by `testing::use_backend`, with their
    /// guards' numbers; the last one serves.
    static CPU_OVERRIDES: RefCell<Vec<(u64, Arc<dyn Backend>)>> = const { RefCell::new(Vec::new()) };
}

/// The backend that serves `device` on this thread.
pub(crate) fn resolve(device: Device) -> Result<Arc<dyn Backend>> {
    match device {
        Device::Cpu => Ok(CPU_OVERRIDES
            .try_with(|o| o.borrow().last().map(|(_, b)| Arc::clone(b)))
            .ok()
            .flatten()
            .unwrap_or_else(|| Arc::clone(&CPU))),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            cuda::device_state(n)?;
            Ok(Arc::clone(&cuda::CUDA))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(Error::CudaNotEnabled { device }),
    }
}

/// The calling thread's current stream for `device`, as a number (see [`Block::stream_id`]);
/// `None` for host memory.
pub(crate) fn current_stream_id(device: Device) -> Option<u64> {
    match device {
        Device::Cpu => None,
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => Some(cuda::current_handle(n) as u64),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => None,
    }
}

/// Checks that `device` can be used in this build and on this machine.
pub(crate) fn check_device(device: Device) -> Result<()> {
    resolve(device).map(drop)
}

// `Device` is a plain value type that knows no backend; its one constructor that asks the
// machine lives here, with the backends it asks.
impl Device {
    /// The CUDA GPU `ordinal`, after checking that it exists.
    ///
    /// With the `cuda` feature this loads the CUDA driver and creates the device's context on
    /// first use (gpucache keeps one context per device for the life of the process).
    ///
    /// # Errors
    /// [`Error::CudaNotEnabled`] when gpucache was built without
    /// its `cuda` feature; with it, [`Error::CudaDriverNotFound`]
    /// when no CUDA driver can be loaded, [`Error::CudaDeviceNotFound`]
    /// when the driver has no GPU with this ordinal, and `Error::Driver` when creating the
    /// context fails.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        check_device(Device::Cuda(ordinal))?;
        Ok(Device::Cuda(ordinal))
    }
}

/// Installs `backend` for `Device::Cpu` on this thread, over any installed before; returns the
/// number that [`remove_cpu_override`] takes.
pub(crate) fn push_cpu_override(backend: Arc<dyn Backend>) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Relaxed);
    let _ = CPU_OVERRIDES.try_with(|o| o.borrow_mut().push((id, backend)));
    id
}

/// Removes the backend installed as `id` (wherever it is in the stack: guards dropped out of
/// order remove their own entry, and the last installed one that remains serves).
pub(crate) fn remove_cpu_override(id: u64) {
    let _ = CPU_OVERRIDES.try_with(|o| o.borrow_mut().retain(|(i, _)| *i != id));
}

#[cfg(test)]
thread_local! {
    /// The views [`Block::view`] made on this thread (unit tests count them: a view costs a
    /// buffer, and on CUDA a cudarc slice with two events once it is used with several streams).
    pub(crate) static VIEWS_MADE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

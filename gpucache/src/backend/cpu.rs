//! The CPU backend: zeroed, 64-byte aligned host allocations from the global allocator.
//!
//! Large buffers come from `mmap` in the system allocator and are paid for again in page faults
//! on first touch; recycling them through a cache skips both.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{AllocError, Backend, HOST_ALIGN, HostBuf, Storage};
use crate::Device;

/// Host memory from the global allocator, with a count of the bytes outstanding.
#[derive(Debug, Default)]
pub(crate) struct CpuBackend {
    outstanding: AtomicUsize,
}

impl CpuBackend {
    fn layout(bytes: usize) -> Option<Layout> {
        Layout::from_size_align(bytes, HOST_ALIGN).ok()
    }
}

impl Backend for CpuBackend {
    fn alloc(&self, device: Device, bytes: usize, _zeroed: bool) -> Result<Storage, AllocError> {
        debug_assert_eq!(device, Device::Cpu);
        debug_assert!(bytes > 0);
        // A size the allocator cannot describe is memory no machine has.
        let layout = Self::layout(bytes).ok_or(AllocError::OutOfMemory)?;
        // SAFETY: `layout` has a non-zero size (the cache never asks for zero bytes).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(AllocError::OutOfMemory)?;
        self.outstanding.fetch_add(bytes, Ordering::Relaxed);
        Ok(Storage::Host(HostBuf { ptr, bytes }))
    }

    fn free(&self, _device: Device, storage: Storage) {
        #[cfg_attr(not(feature = "cuda"), expect(clippy::infallible_destructuring_match))]
        let buf = match storage {
            Storage::Host(buf) => buf,
            // Not host memory (never made here): its own drop gives it back.
            #[cfg(feature = "cuda")]
            other => return drop(other),
        };
        // SAFETY: `Layout::from_size_align` accepted this size and alignment when `buf` was
        // allocated, so they satisfy its conditions.
        let layout = unsafe { Layout::from_size_align_unchecked(buf.bytes, HOST_ALIGN) };
        // SAFETY: `buf` was allocated by `alloc` above with this same layout and is owned, so it
        // is freed exactly once.
        unsafe { alloc::dealloc(buf.ptr.as_ptr(), layout) };
        self.outstanding.fetch_sub(buf.bytes, Ordering::Relaxed);
    }

    fn allocated_bytes(&self, _device: Device) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }
}

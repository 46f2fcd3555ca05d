//! The CPU backend: zeroed, 64-byte aligned host allocations.
//!
//! Small buffers come from the global allocator. Buffers of [`MAP_THRESHOLD`] bytes and more are
//! anonymous `mmap` mappings, whose pages the kernel zeroes lazily on first touch (the global
//! allocator cannot hand out lazily zeroed memory at 64-byte alignment: it zeroes every byte
//! itself). Either way a new buffer costs system calls, page faults or a memset; recycling it
//! through a cache skips all three.

use std::alloc::{self, Layout};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{AllocError, Backend, HOST_ALIGN, HostBuf, Storage};
use crate::{Device, DeviceStats};

/// Buffers of at least this many bytes are mapped from the kernel directly.
pub(crate) const MAP_THRESHOLD: usize = 1 << 20;

/// Host memory, with counts of what was allocated and freed.
#[derive(Debug, Default)]
pub(crate) struct CpuBackend {
    allocs: AtomicU64,
    frees: AtomicU64,
    outstanding: AtomicUsize,
}

impl CpuBackend {
    fn layout(bytes: usize) -> Option<Layout> {
        Layout::from_size_align(bytes, HOST_ALIGN).ok()
    }
}

/// Maps `bytes` of zeroed, page-aligned memory.
fn map(bytes: usize) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping with no address hint touches no existing memory; the
    // arguments are valid for any length (the kernel refuses lengths it cannot map).
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        None
    } else {
        NonNull::new(p.cast::<u8>())
    }
}

impl Backend for CpuBackend {
    fn alloc(&self, device: Device, bytes: usize, _zeroed: bool) -> Result<Storage, AllocError> {
        debug_assert_eq!(device, Device::Cpu);
        debug_assert!(bytes > 0);
        let ptr = if bytes >= MAP_THRESHOLD {
            map(bytes)
        } else {
            // A size the allocator cannot describe is memory no machine has.
            let layout = Self::layout(bytes).ok_or(AllocError::OutOfMemory)?;
            // SAFETY: `layout` has a non-zero size (the cache never asks for zero bytes).
            NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
        };
        let ptr = ptr.ok_or(AllocError::OutOfMemory)?;
        self.allocs.fetch_add(1, Ordering::Relaxed);
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
        if buf.bytes >= MAP_THRESHOLD {
            // SAFETY: buffers of this size were mapped by `map` with exactly this length, are
            // owned by `buf` and are unmapped once, here.
            let r = unsafe { libc::munmap(buf.ptr.as_ptr().cast(), buf.bytes) };
            debug_assert_eq!(r, 0, "munmap of a mapping we own cannot fail");
        } else {
            // SAFETY: `Layout::from_size_align` accepted this size and alignment when `buf` was
            // allocated, so they satisfy its conditions.
            let layout = unsafe { Layout::from_size_align_unchecked(buf.bytes, HOST_ALIGN) };
            // SAFETY: `buf` was allocated by `alloc` above with this same layout and is owned,
            // so it is freed exactly once.
            unsafe { alloc::dealloc(buf.ptr.as_ptr(), layout) };
        }
        self.frees.fetch_add(1, Ordering::Relaxed);
        self.outstanding.fetch_sub(buf.bytes, Ordering::Relaxed);
    }

    fn stats(&self, _device: Device) -> DeviceStats {
        DeviceStats {
            allocs: self.allocs.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            bytes_allocated: self.outstanding.load(Ordering::Relaxed),
        }
    }
}

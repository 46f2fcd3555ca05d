//! The CPU backend: zeroed, 64-byte aligned host allocations.
//!
//! Small buffers come from the global allocator. On Unix, buffers of [`MAP_THRESHOLD`] bytes and
//! more are anonymous `mmap` mappings, whose pages the kernel zeroes lazily on first touch (the
//! global allocator cannot hand out lazily zeroed memory at 64-byte alignment: it zeroes every
//! byte itself); elsewhere they come from the global allocator too. Either way a new buffer
//! costs system calls, page faults or a memset; recycling it through a cache skips all three.

use std::alloc::{self, Layout};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{AllocError, Backend, HOST_ALIGN, Storage};
use crate::{Device, DeviceStats, Result};

/// An owned, [`HOST_ALIGN`]-aligned, initialised host allocation of `bytes > 0` bytes.
#[derive(Debug)]
pub(crate) struct HostBuf {
    ptr: NonNull<u8>,
    /// Atomic so that a growable buffer grows through a shared reference (see
    /// [`HostBuf::grow_to`]); read relaxed, a plain load.
    bytes: AtomicUsize,
}

// SAFETY: a HostBuf uniquely owns its allocation, like a Box<[u8]>; it has no thread affinity and
// shared references only hand out reads through `&self` methods.
unsafe impl Send for HostBuf {}
// SAFETY: as above; `&HostBuf` gives only the pointer and reads, and writes need `&mut`.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// The start of the allocation.
    #[inline]
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The size in bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// A buffer of `bytes` bytes at `ptr`.
    fn new(ptr: NonNull<u8>, bytes: usize) -> HostBuf {
        HostBuf {
            ptr,
            bytes: AtomicUsize::new(bytes),
        }
    }

    /// A `HostBuf` for the `bytes` bytes at `offset`, which does not own them.
    ///
    /// # Safety
    /// `offset + bytes <= self.bytes()` and `bytes > 0`; the result is never given to
    /// [`CpuBackend`]'s free, and is used only while `self`'s allocation is alive.
    #[inline]
    pub(crate) unsafe fn view(&self, offset: usize, bytes: usize) -> HostBuf {
        // SAFETY: `offset <= self.bytes`, so the pointer stays inside the allocation (caller).
        let ptr = unsafe { self.ptr.add(offset) };
        HostBuf::new(ptr, bytes)
    }

    /// Makes a view (see [`HostBuf::view`]) `bytes` long.
    ///
    /// # Safety
    /// `self` was made by [`HostBuf::view`], and the buffer it views holds `bytes > 0` bytes
    /// from its start (a growable buffer may have grown since).
    pub(crate) unsafe fn set_view_len(&mut self, bytes: usize) {
        *self.bytes.get_mut() = bytes;
    }

    /// Grows a buffer made by [`map_growable`] to `bytes`, through a shared reference: views of
    /// it may be alive on other threads, and its address and first bytes stay.
    ///
    /// # Safety
    /// `self` was made by [`map_growable`] with a reserve of at least `bytes >= self.bytes()`.
    pub(crate) unsafe fn grow_to(&self, bytes: usize) {
        self.bytes.store(bytes, Ordering::Relaxed);
    }

    /// Sets the first `bytes <= self.bytes()` bytes to zero. Never fails (the `Result` matches
    /// the device backends').
    pub(crate) fn zero(&mut self, bytes: usize) -> Result<()> {
        assert!(bytes <= self.bytes());
        // SAFETY: the buffer owns `self.bytes >= bytes` writable bytes, and `&mut self` keeps
        // anything else from reading or writing them meanwhile.
        unsafe { self.ptr.as_ptr().write_bytes(0, bytes) };
        Ok(())
    }

    /// Copies `src` (at most `self.bytes()` long) to the start of the buffer. Never fails.
    pub(crate) fn write(&mut self, src: &[u8]) -> Result<()> {
        assert!(src.len() <= self.bytes());
        // SAFETY: the destination owns `self.bytes >= src.len()` bytes, is exclusively borrowed
        // through `&mut self`, and cannot overlap `src`, a shared borrow of other memory.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr(), src.len()) };
        Ok(())
    }

    /// Copies the start of the buffer to `dst` (at most `self.bytes()` long). Never fails.
    pub(crate) fn read(&self, dst: &mut [u8]) -> Result<()> {
        assert!(dst.len() <= self.bytes());
        // SAFETY: the source holds `self.bytes >= dst.len()` initialised bytes (host buffers are
        // zeroed when allocated, then written only with whole bytes) and cannot overlap `dst`, an
        // exclusive borrow of other memory.
        unsafe { ptr::copy_nonoverlapping(self.ptr.as_ptr(), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

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
#[cfg(unix)]
fn map(bytes: usize) -> Option<NonNull<u8>> {
    map_with(bytes, 0)
}

/// [`map`] with more `flags` for `mmap`.
#[cfg(unix)]
fn map_with(bytes: usize, flags: libc::c_int) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping with no address hint touches no existing memory; the
    // arguments are valid for any length (the kernel refuses lengths it cannot map).
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
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

/// Unmaps a mapping made by [`map`].
///
/// # Safety
/// `ptr` and `bytes` are those of one live mapping made by [`map`], which is not used again.
#[cfg(unix)]
unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: the caller gives a mapping of exactly this length that nothing uses any more.
    let r = unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
    debug_assert_eq!(r, 0, "munmap of a mapping we own cannot fail");
}

/// Without `mmap`, large buffers come from the global allocator like small ones.
#[cfg(not(unix))]
fn map(_bytes: usize) -> Option<NonNull<u8>> {
    None
}

/// A buffer of `bytes` in a mapping of `reserve >= bytes > 0` bytes, which it may grow into in
/// place ([`HostBuf::set_view_len`] is how: the kernel backs only the pages touched, and the
/// mapping reserves no swap, so a reserve as large as a GPU's memory costs addresses only). For
/// the testing backend's growable blocks; `None` when the mapping fails, or without `mmap`.
#[cfg(unix)]
pub(crate) fn map_growable(reserve: usize, bytes: usize) -> Option<HostBuf> {
    debug_assert!(0 < bytes && bytes <= reserve);
    map_with(reserve, libc::MAP_NORESERVE).map(|ptr| HostBuf::new(ptr, bytes))
}

/// Without `mmap`, no buffer is growable.
#[cfg(not(unix))]
pub(crate) fn map_growable(_reserve: usize, _bytes: usize) -> Option<HostBuf> {
    None
}

/// Unmaps a buffer made by [`map_growable`] with this `reserve`.
///
/// # Safety
/// `buf` was made by [`map_growable`] with `reserve`, and nothing uses its memory any more.
#[cfg(unix)]
pub(crate) unsafe fn unmap_growable(buf: HostBuf, reserve: usize) {
    // SAFETY: the whole mapping `map_growable` made, unused (caller).
    unsafe { unmap(buf.ptr, reserve) };
}

/// Whether buffers of `bytes` are mapped (see [`MAP_THRESHOLD`]).
fn mapped(bytes: usize) -> bool {
    cfg!(unix) && bytes >= MAP_THRESHOLD
}

impl Backend for CpuBackend {
    fn alloc(&self, device: Device, bytes: usize, _zeroed: bool) -> Result<Storage, AllocError> {
        debug_assert_eq!(device, Device::Cpu);
        debug_assert!(bytes > 0);
        let ptr = if mapped(bytes) {
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
        Ok(Storage::Host(HostBuf::new(ptr, bytes)))
    }

    fn free(&self, _device: Device, storage: Storage) {
        #[cfg_attr(not(feature = "cuda"), expect(clippy::infallible_destructuring_match))]
        let buf = match storage {
            Storage::Host(buf) => buf,
            // Not host memory (never made here): its own drop gives it back.
            #[cfg(feature = "cuda")]
            other => return drop(other),
        };
        if mapped(buf.bytes()) {
            // SAFETY: buffers of this size were mapped by `map` with exactly this length, are
            // owned by `buf` and are unmapped once, here.
            #[cfg(unix)]
            unsafe {
                unmap(buf.ptr, buf.bytes())
            };
        } else {
            // SAFETY: `Layout::from_size_align` accepted this size and alignment when `buf` was
            // allocated, so they satisfy its conditions.
            let layout = unsafe { Layout::from_size_align_unchecked(buf.bytes(), HOST_ALIGN) };
            // SAFETY: `buf` was allocated by `alloc` above with this same layout and is owned,
            // so it is freed exactly once.
            unsafe { alloc::dealloc(buf.ptr.as_ptr(), layout) };
        }
        self.frees.fetch_add(1, Ordering::Relaxed);
        self.outstanding.fetch_sub(buf.bytes(), Ordering::Relaxed);
    }

    fn stats(&self, _device: Device) -> DeviceStats {
        DeviceStats {
            allocs: self.allocs.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            bytes_allocated: self.outstanding.load(Ordering::Relaxed),
        }
    }
}

//! The CPU backend: zeroed, 64-byte aligned host allocations.
//!
//! Small buffers come from the global allocator. On Unix, buffers of [`MAP_THRESHOLD`] bytes and
//! more are anonymous `mmap` mappings, whose pages the kernel zeroes lazily on first touch (the
//! global allocator cannot hand out lazily zeroed memory at 64-byte alignment: it zeroes every
//! byte itself); elsewhere they come from the global allocator too. Either way a new buffer
//! costs system calls, page faults or a memset; recycling it through a cache skips all three.
//!
//! A planned cache's block (asked for with [`Backend::alloc_growable`]) of at least
//! [`GROWABLE_MIN`] bytes is growable in place, as the CUDA backend's are: a mapping that
//! reserves [`GROWABLE_RESERVE`] bytes of addresses and reserves no memory for them (the kernel
//! backs the pages touched), of which the block holds the first bytes, in multiples of
//! [`HOST_GRANULE`]. A step larger than its plan grows the block under the arrays it keeps
//! alive, where a block that cannot grow is replaced by a larger one while the old one is still
//! held (Keypoint R-CNN's varying inference replayed held 2.05x its peak live bytes so, 1.27x
//! grown, as on an H100). Where the kernel refuses that many addresses (valgrind does, and so
//! does a kernel that accounts every mapping, `vm.overcommit_memory = 2`), the block is
//! allocated as any other, not growable; so it is in a process whose addresses are limited
//! (`RLIMIT_AS`, `ulimit -v`), which a reserve would count against.

use std::alloc::{self, Layout};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::{AllocError, Backend, GROWABLE_MIN, HOST_ALIGN, Storage};
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

/// The bytes a growable host buffer may grow to: as much as a GPU's memory, as the CUDA backend
/// reserves (addresses only: the kernel backs the pages touched). With 1 GiB, a plan's block of
/// EfficientNet-B0 trained on a batch of up to 64 could not grow, and the replay held 1.187x of
/// peak live where an H200 held 1.035x.
pub(crate) const GROWABLE_RESERVE: usize = if usize::BITS >= 64 { 1 << 37 } else { 1 << 30 };

/// The CPU backend's growable blocks are mapped in multiples of this: the granule of the CUDA
/// backend's mappings on an H100 and an H200 (and x86-64's huge page), so that a planned cache
/// holds on the CPU what it holds on such a GPU (the rounding is room a later plan may fit in).
pub(crate) const HOST_GRANULE: usize = 2 << 20;

/// The bytes a growable block asked for `bytes` maps, in multiples of `granularity` (0: as
/// asked); `None` when it is not made growable: past [`GROWABLE_RESERVE`], or, at a
/// granularity, smaller than [`GROWABLE_MIN`] (as the CUDA backend takes those from its pool).
pub(crate) fn growable_size(bytes: usize, granularity: usize) -> Option<usize> {
    match granularity {
        0 => Some(bytes),
        _ if bytes < GROWABLE_MIN => None,
        g => bytes.checked_next_multiple_of(g),
    }
    .filter(|&b| b <= GROWABLE_RESERVE)
}

/// The growable host buffers a backend made, each with the bytes it may grow to: the backend
/// grows them and unmaps them whole through this list (a buffer's own size says nothing of its
/// reserve).
#[derive(Debug, Default)]
pub(crate) struct GrowableBufs(Mutex<Vec<(usize, usize)>>);

impl GrowableBufs {
    /// A buffer of `bytes > 0` in a mapping of the first of `reserves` (each at least `bytes`)
    /// the host grants, listed; `None` when it grants none (and always without `mmap`).
    pub(crate) fn map(&self, bytes: usize, reserves: &[usize]) -> Option<HostBuf> {
        let (buf, reserve) = reserves
            .iter()
            .filter(|&&reserve| bytes <= reserve)
            .find_map(|&reserve| Some((map_growable(reserve, bytes)?, reserve)))?;
        self.0.lock().push((buf.ptr.as_ptr().addr(), reserve));
        Some(buf)
    }

    /// The bytes `buf` may grow to, if it is a listed buffer.
    pub(crate) fn reserve_of(&self, buf: &HostBuf) -> Option<usize> {
        let addr = buf.ptr.as_ptr().addr();
        let bufs = self.0.lock();
        bufs.iter().find(|&&(p, _)| p == addr).map(|&(_, r)| r)
    }

    /// Grows `buf` to `bytes` when it is a listed buffer whose reserve holds that many (true
    /// then, also when it holds them already).
    pub(crate) fn grow(&self, buf: &HostBuf, bytes: usize) -> bool {
        if self.reserve_of(buf).is_none_or(|reserve| bytes > reserve) {
            return false;
        }
        if bytes > buf.bytes() {
            // SAFETY: listed, so made by `map` (`map_growable`) with a reserve of at least
            // `bytes`, more than it holds.
            unsafe { buf.grow_to(bytes) };
        }
        true
    }

    /// Unmaps `buf` whole, and unlists it, if it is a listed buffer; gives it back otherwise.
    ///
    /// # Safety
    /// `buf` owns its memory (it is not a [`HostBuf::view`]), and nothing uses that memory any
    /// more.
    pub(crate) unsafe fn unmap(&self, buf: HostBuf) -> Result<(), HostBuf> {
        let addr = buf.ptr.as_ptr().addr();
        let listed = {
            let mut bufs = self.0.lock();
            let at = bufs.iter().position(|&(p, _)| p == addr);
            at.map(|i| bufs.swap_remove(i).1)
        };
        let Some(reserve) = listed else {
            return Err(buf);
        };
        // SAFETY: listed, so made by `map_growable` with this reserve; it owns the mapping,
        // unused (caller), and was unlisted above, so it is unmapped once.
        #[cfg(unix)]
        unsafe {
            unmap(buf.ptr, reserve)
        };
        #[cfg(not(unix))]
        let _ = reserve;
        Ok(())
    }
}

/// Whether the host grants a growable buffer its [`GROWABLE_RESERVE`] of addresses (valgrind
/// does not, nor does a kernel that accounts every mapping, `vm.overcommit_memory = 2`).
pub(crate) fn host_grants_reserve() -> bool {
    let probe = GrowableBufs::default();
    probe.map(4096, &[GROWABLE_RESERVE]).is_some_and(|buf| {
        // SAFETY: just made, owned, unused.
        unsafe { probe.unmap(buf) }.is_ok()
    })
}

/// Whether the process's addresses are limited (`RLIMIT_AS`, `ulimit -v`): a reserve counts
/// against that limit though no memory backs it, so under one the CPU backend makes no block
/// growable (128 GiB of addresses per block would be taken from what the process's other
/// allocations may use).
#[cfg(unix)]
fn addresses_limited() -> bool {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid `rlimit` for the call to write.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_AS, &raw mut limit) };
    r != 0 || limit.rlim_cur != libc::RLIM_INFINITY
}

/// Without `mmap`, no block is growable anyway.
#[cfg(not(unix))]
fn addresses_limited() -> bool {
    true
}

/// Whether the CPU backend makes planned caches' blocks growable in this process: the host
/// grants the reserve, and the process's addresses are not limited.
pub(crate) fn grows_blocks() -> bool {
    !addresses_limited() && host_grants_reserve()
}

/// Host memory, with counts of what was allocated and freed.
#[derive(Debug, Default)]
pub(crate) struct CpuBackend {
    allocs: AtomicU64,
    frees: AtomicU64,
    outstanding: AtomicUsize,
    /// The planned caches' growable blocks.
    growable: GrowableBufs,
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
/// place ([`HostBuf::grow_to`] is how: the kernel backs only the pages touched, and the mapping
/// reserves no swap, so a reserve as large as a GPU's memory costs addresses only); `None` when
/// the mapping fails, or without `mmap`. Listed by [`GrowableBufs::map`].
#[cfg(unix)]
fn map_growable(reserve: usize, bytes: usize) -> Option<HostBuf> {
    debug_assert!(0 < bytes && bytes <= reserve);
    map_with(reserve, libc::MAP_NORESERVE).map(|ptr| HostBuf::new(ptr, bytes))
}

/// Without `mmap`, no buffer is growable.
#[cfg(not(unix))]
fn map_growable(_reserve: usize, _bytes: usize) -> Option<HostBuf> {
    None
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

    fn alloc_growable(&self, device: Device, bytes: usize) -> Result<Storage, AllocError> {
        let buf = growable_size(bytes, HOST_GRANULE)
            .filter(|_| !addresses_limited())
            .and_then(|mapped| self.growable.map(mapped, &[GROWABLE_RESERVE]));
        let Some(buf) = buf else {
            return self.alloc(device, bytes, false);
        };
        self.allocs.fetch_add(1, Ordering::Relaxed);
        self.outstanding.fetch_add(buf.bytes(), Ordering::Relaxed);
        Ok(Storage::Host(buf))
    }

    fn grow(&self, _device: Device, storage: &Storage, bytes: usize) -> Result<bool, AllocError> {
        let (Some(buf), Some(bytes)) = (storage.host(), growable_size(bytes, HOST_GRANULE)) else {
            return Ok(false);
        };
        let before = buf.bytes();
        if !self.growable.grow(buf, bytes) {
            return Ok(false);
        }
        if bytes > before {
            // Counted as an allocation of the new bytes, as the CUDA backend's growth is.
            self.allocs.fetch_add(1, Ordering::Relaxed);
            self.outstanding
                .fetch_add(bytes - before, Ordering::Relaxed);
        }
        Ok(true)
    }

    fn is_growable(&self, storage: &Storage) -> bool {
        storage
            .host()
            .is_some_and(|buf| self.growable.reserve_of(buf).is_some())
    }

    fn free(&self, _device: Device, storage: Storage) {
        #[cfg_attr(not(feature = "cuda"), expect(clippy::infallible_destructuring_match))]
        let buf = match storage {
            Storage::Host(buf) => buf,
            // Not host memory (never made here): its own drop gives it back.
            #[cfg(feature = "cuda")]
            other => return drop(other),
        };
        let bytes = buf.bytes();
        if mapped(bytes) {
            // SAFETY: given to `free`, so an owned buffer (views never are), which nothing
            // uses any more.
            if let Err(buf) = unsafe { self.growable.unmap(buf) } {
                // SAFETY: not growable, so a buffer of this size mapped by `map` with exactly
                // this length; owned by `buf` and unmapped once, here.
                #[cfg(unix)]
                unsafe {
                    unmap(buf.ptr, bytes)
                };
                #[cfg(not(unix))]
                let _ = buf;
            }
        } else {
            // SAFETY: `Layout::from_size_align` accepted this size and alignment when `buf` was
            // allocated, so they satisfy its conditions.
            let layout = unsafe { Layout::from_size_align_unchecked(buf.bytes(), HOST_ALIGN) };
            // SAFETY: `buf` was allocated by `alloc` above with this same layout and is owned,
            // so it is freed exactly once.
            unsafe { alloc::dealloc(buf.ptr.as_ptr(), layout) };
        }
        self.frees.fetch_add(1, Ordering::Relaxed);
        self.outstanding.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn stats(&self, _device: Device) -> DeviceStats {
        DeviceStats {
            allocs: self.allocs.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            bytes_allocated: self.outstanding.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host buffer of storage the CPU backend made.
    fn host_mut(storage: &mut Storage) -> &mut HostBuf {
        match storage {
            Storage::Host(buf) => buf,
            #[cfg(feature = "cuda")]
            _ => unreachable!("made by the CPU backend"),
        }
    }

    /// Where the host grants the reserve, a planned cache's block of the CPU backend is mapped
    /// in granules and grows in place, keeping its address and its bytes, each growth counted
    /// as an allocation of the new bytes; below `GROWABLE_MIN` (and where the host refuses the
    /// reserve, as valgrind does) a block is allocated as any other and never grows.
    #[test]
    fn growable_blocks_grow_in_place_in_granules() {
        let backend = CpuBackend::default();
        let small = backend.alloc_growable(Device::Cpu, 1 << 20).unwrap();
        assert!(!backend.is_growable(&small));
        assert!(matches!(
            backend.grow(Device::Cpu, &small, 2 << 20),
            Ok(false)
        ));
        backend.free(Device::Cpu, small);
        let mut storage = backend.alloc_growable(Device::Cpu, (40 << 20) + 1).unwrap();
        let stats = || backend.stats(Device::Cpu);
        if !grows_blocks() {
            assert!(!backend.is_growable(&storage));
            assert_eq!(storage.bytes(), (40 << 20) + 1);
            backend.free(Device::Cpu, storage);
            return;
        }
        assert!(backend.is_growable(&storage));
        assert_eq!(storage.bytes(), 42 << 20, "rounded up to the granule");
        assert_eq!((stats().allocs, stats().bytes_allocated), (2, 42 << 20));
        let start = storage.host().unwrap().ptr();
        host_mut(&mut storage).write(&[7; 4096]).unwrap();
        assert!(matches!(
            backend.grow(Device::Cpu, &storage, (100 << 20) - 1),
            Ok(true)
        ));
        assert_eq!(storage.host().unwrap().ptr(), start, "grown in place");
        assert_eq!(storage.bytes(), 100 << 20);
        assert_eq!((stats().allocs, stats().bytes_allocated), (3, 100 << 20));
        let mut read = vec![0; 4096];
        storage.host().unwrap().read(&mut read).unwrap();
        assert!(read.iter().all(|&b| b == 7), "the bytes before stay");
        // The last byte grown is memory of the buffer's own.
        host_mut(&mut storage).zero(100 << 20).unwrap();
        // Growing to less than it holds, or past the reserve, changes nothing.
        assert!(matches!(
            backend.grow(Device::Cpu, &storage, 50 << 20),
            Ok(true)
        ));
        assert!(matches!(
            backend.grow(Device::Cpu, &storage, GROWABLE_RESERVE + 1),
            Ok(false)
        ));
        assert_eq!((stats().allocs, stats().bytes_allocated), (3, 100 << 20));
        backend.free(Device::Cpu, storage);
        assert_eq!((stats().frees, stats().bytes_allocated), (2, 0));
    }

    /// Under a limit on the process's addresses (`ulimit -v`, which a reserve counts against),
    /// no block is made growable: checked in a child process of this test binary run under
    /// such a limit (the limit is the whole process's, so not set in this one).
    #[cfg(unix)]
    #[test]
    fn no_block_is_growable_under_a_limit_on_addresses() {
        const CHILD: &str = "GPUCACHE_TEST_ADDRESSES_LIMITED";
        const NAME: &str = "backend::cpu::tests::no_block_is_growable_under_a_limit_on_addresses";
        if std::env::var_os(CHILD).is_some() {
            assert!(addresses_limited());
            let backend = CpuBackend::default();
            let storage = backend.alloc_growable(Device::Cpu, 40 << 20).unwrap();
            assert!(!backend.is_growable(&storage));
            assert_eq!(storage.bytes(), 40 << 20, "as asked, not in granules");
            backend.free(Device::Cpu, storage);
            return;
        }
        let exe = std::env::current_exe().unwrap();
        // 192 GiB of addresses: room for a reserve of 128 GiB, which would take two thirds of
        // them (a lower limit already set stays; a reserve fails under it anyway).
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg("ulimit -v 201326592 2>/dev/null; exec \"$0\" --exact \"$1\" --test-threads=1")
            .arg(&exe)
            .arg(NAME)
            .env(CHILD, "1")
            .output()
            .unwrap();
        assert!(
            child.status.success(),
            "the child under `ulimit -v`: {}\n{}{}",
            child.status,
            String::from_utf8_lossy(&child.stdout),
            String::from_utf8_lossy(&child.stderr)
        );
        let out = String::from_utf8_lossy(&child.stdout);
        assert!(out.contains("1 passed"), "the child ran the test: {out}");
    }
}

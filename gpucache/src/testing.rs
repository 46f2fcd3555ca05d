//! Tools for testing code that uses gpucache: a counting CPU backend that can be told to fail.
//!
//! [`CountingBackend`] serves `Device::Cpu` allocations on the threads where it is installed with
//! [`use_backend`]. It counts allocations, frees and the bytes outstanding, so a test can check
//! that nothing leaks, and it fails allocations on demand (the Nth, every Nth, or any that would
//! exceed a byte limit) with an out-of-memory error, so out-of-memory recovery can be tested on
//! any machine. Made growable ([`CountingBackend::set_growable`]), it grows a planned cache's
//! blocks in place as the CUDA backend does, so that path can be tested on any machine too; told
//! the device's granularity as well ([`CountingBackend::set_granularity`]), it holds what the
//! CUDA backend holds, to the byte, so a replay on the CPU reports the GPU's memory figures.
//! The CPU backend itself maps planned caches' blocks that way wherever the host grants the
//! addresses ([`host_grows_blocks`]).
//!
//! ```
//! use gpucache::testing::{CountingBackend, use_backend};
//! use gpucache::{Array, Device, Error};
//!
//! let backend = CountingBackend::new();
//! let _installed = use_backend(&backend);
//! for _ in 0..2 {
//!     let _scope = gpucache::enter("doc-oom");
//!     let _a = Array::<u8>::zeros(Device::Cpu, 1000)?;
//! }
//! assert_eq!(backend.outstanding_bytes(), 1024); // the plan's block, cached
//!
//! // Fail the next allocation and the retry after it: the cache is released, then an error.
//! backend.fail_nth(1);
//! backend.fail_nth(2);
//! let err = Array::<u8>::zeros(Device::Cpu, 10).unwrap_err();
//! assert!(matches!(err, Error::OutOfMemory { requested: 10, .. }));
//! assert_eq!(backend.outstanding_bytes(), 0); // the cached block was released
//! # Ok::<(), gpucache::Error>(())
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};

use parking_lot::Mutex;

use crate::backend::cpu::{self, CpuBackend, GROWABLE_RESERVE};
use crate::backend::{self, AllocError, Backend, Storage};
use crate::{Device, DeviceStats};

/// A CPU backend that counts what it does and fails allocations on demand. See the
/// [module docs](self).
#[derive(Default)]
pub struct CountingBackend {
    host: CpuBackend,
    attempts: AtomicU64,
    allocs: AtomicU64,
    zeroed: AtomicU64,
    frees: AtomicU64,
    failures: AtomicU64,
    outstanding_bytes: AtomicUsize,
    peak_bytes: AtomicUsize,
    plan: Mutex<FailPlan>,
    growable: AtomicBool,
    grows: AtomicU64,
    /// The growable buffers alive.
    growable_bufs: cpu::GrowableBufs,
    /// Growable blocks are rounded up to a multiple of this, and smaller ones than
    /// `GROWABLE_MIN` are not growable (0: every size as asked, see `set_granularity`).
    granularity: AtomicUsize,
}

/// The reserve of a growable buffer when the host refuses [`GROWABLE_RESERVE`] of addresses
/// (valgrind does, and a kernel that accounts every mapping, `vm.overcommit_memory = 2`).
const FALLBACK_RESERVE: usize = 1 << 30;

#[derive(Default)]
struct FailPlan {
    /// Attempt numbers (1-based, counted from the backend's creation) that fail.
    at: Vec<u64>,
    /// Fail every attempt whose number is a multiple of this (0: off).
    every: u64,
    /// Fail attempts that would take the outstanding bytes over this.
    limit: Option<usize>,
}

impl CountingBackend {
    /// A new backend that fails nothing.
    pub fn new() -> Arc<CountingBackend> {
        Arc::new(CountingBackend::default())
    }

    /// Makes the `n`th allocation attempt from now fail (`n >= 1`; 1 is the next one). Calls
    /// add up: `fail_nth(1); fail_nth(2)` fails the next two.
    pub fn fail_nth(&self, n: u64) {
        let at = self.attempts.load(SeqCst) + n.max(1);
        self.plan.lock().at.push(at);
    }

    /// Makes every `n`th allocation attempt fail, counting from the backend's creation
    /// (`0` turns it off).
    pub fn fail_every(&self, n: u64) {
        self.plan.lock().every = n;
    }

    /// Makes the backend behave as a device of `bytes` bytes: an allocation that would take the
    /// outstanding bytes over it fails (`None`: no limit).
    pub fn set_limit(&self, bytes: Option<usize>) {
        self.plan.lock().limit = bytes;
    }

    /// Allocation attempts so far, failed ones included.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(SeqCst)
    }

    /// Successful allocations so far (growths in place included, see
    /// [`grows`](Self::grows)).
    pub fn allocs(&self) -> u64 {
        self.allocs.load(SeqCst)
    }

    /// Successful allocations that asked for zeroed memory: those a device backend would
    /// memset (host memory is zeroed whatever is asked). A new buffer is zeroed only for an
    /// array that must be (`zeros`, or `bool` elements), and an arena block, whose arrays get
    /// views, never as a whole: each array that must be zeroes its own bytes.
    pub fn zeroed_allocs(&self) -> u64 {
        self.zeroed.load(SeqCst)
    }

    /// Frees so far.
    pub fn frees(&self) -> u64 {
        self.frees.load(SeqCst)
    }

    /// Makes the blocks of planned caches growable in place, as the CUDA backend makes them
    /// (on Unix; elsewhere this does nothing): a block that a larger step outgrows then grows
    /// rather than being replaced. Growing counts as an allocation of the new bytes, and can be
    /// made to fail like one.
    pub fn set_growable(&self, growable: bool) {
        self.growable.store(growable, SeqCst);
    }

    /// Maps growable blocks as CUDA's virtual memory management does, in multiples of
    /// `granularity` bytes (a power of two; the H100's is 2 MiB; 0 turns it off): a block made or
    /// grown is rounded up to it, and a block of less than 32 MiB is not made growable (the CUDA
    /// backend takes those from the stream-ordered pool, as asked). The rounding is memory held,
    /// and slack a plan may fit in: with it, replays on the CPU hold what the GPU holds
    /// (BERT inference: 1.013x of peak live without, 1.022x with it, as on an H100 and an H200).
    /// A growable block may grow to 128 GiB, as the CUDA backend reserves a GPU's memory (1 GiB
    /// where the host refuses that many addresses, as valgrind does). Takes effect with
    /// [`set_growable`](Self::set_growable).
    pub fn set_granularity(&self, granularity: usize) {
        debug_assert!(granularity == 0 || granularity.is_power_of_two());
        self.granularity.store(granularity, SeqCst);
    }

    /// `bytes` as a growable block maps them (see [`set_granularity`](Self::set_granularity)),
    /// `None` when such a block is not growable.
    fn mapped(&self, bytes: usize) -> Option<usize> {
        cpu::growable_size(bytes, self.granularity.load(SeqCst))
    }

    /// Attempts that were made to fail.
    pub fn failures(&self) -> u64 {
        self.failures.load(SeqCst)
    }

    /// Bytes allocated and not yet freed.
    pub fn outstanding_bytes(&self) -> usize {
        self.outstanding_bytes.load(SeqCst)
    }

    /// The most bytes outstanding at once, since the backend was made or since
    /// [`reset_peak`](Self::reset_peak).
    pub fn peak_bytes(&self) -> usize {
        self.peak_bytes.load(SeqCst)
    }

    /// Starts [`peak_bytes`](Self::peak_bytes) again from the bytes outstanding now.
    pub fn reset_peak(&self) {
        self.peak_bytes.store(self.outstanding_bytes(), SeqCst);
    }

    /// Successful allocations that grew a block in place (see
    /// [`set_growable`](Self::set_growable)); counted in [`allocs`](Self::allocs) too.
    pub fn grows(&self) -> u64 {
        self.grows.load(SeqCst)
    }

    /// Blocks allocated and not yet freed (allocations that grew a block are not blocks).
    pub fn outstanding_allocs(&self) -> u64 {
        self.allocs() - self.grows() - self.frees()
    }

    /// `None` if attempt `attempt` fails by the plan; else reserves `bytes` in
    /// `outstanding_bytes`, checked against the limit and added in one atomic step, so that
    /// threads allocating at once cannot pass the limit together, and returns the bytes
    /// outstanding just after (a candidate for the peak, which a later read could miss: other
    /// threads may free meanwhile).
    fn reserve(&self, attempt: u64, bytes: usize) -> Option<usize> {
        let limit = {
            let mut plan = self.plan.lock();
            let before = plan.at.len();
            plan.at.retain(|&a| a != attempt);
            if plan.at.len() != before || (plan.every != 0 && attempt.is_multiple_of(plan.every)) {
                return None;
            }
            plan.limit
        };
        let before = self
            .outstanding_bytes
            .fetch_update(SeqCst, SeqCst, |out| {
                let after = out.checked_add(bytes)?;
                limit.is_none_or(|l| after <= l).then_some(after)
            })
            .ok()?;
        Some(before + bytes)
    }
}

impl CountingBackend {
    /// An allocation attempt of `bytes`, counted: [`CountingBackend::reserve`], or a counted
    /// failure.
    fn attempt(&self, bytes: usize) -> Result<usize, AllocError> {
        let attempt = self.attempts.fetch_add(1, SeqCst) + 1;
        self.reserve(attempt, bytes).ok_or_else(|| {
            self.failures.fetch_add(1, SeqCst);
            AllocError::OutOfMemory
        })
    }

    /// Counts a successful allocation, with the bytes outstanding just after it.
    fn counted(&self, outstanding: usize, zeroed: bool) {
        self.allocs.fetch_add(1, SeqCst);
        self.zeroed.fetch_add(u64::from(zeroed), SeqCst);
        self.peak_bytes.fetch_max(outstanding, SeqCst);
    }
}

impl fmt::Debug for CountingBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingBackend")
            .field("attempts", &self.attempts())
            .field("allocs", &self.allocs())
            .field("zeroed_allocs", &self.zeroed_allocs())
            .field("frees", &self.frees())
            .field("grows", &self.grows())
            .field("failures", &self.failures())
            .field("outstanding_bytes", &self.outstanding_bytes())
            .field("peak_bytes", &self.peak_bytes())
            .finish()
    }
}

impl Backend for CountingBackend {
    fn alloc(&self, device: Device, bytes: usize, zeroed: bool) -> Result<Storage, AllocError> {
        let outstanding = self.attempt(bytes)?;
        // The bytes are reserved (see `reserve`): given back if the host fails.
        let storage = self.host.alloc(device, bytes, zeroed).inspect_err(|_| {
            self.outstanding_bytes.fetch_sub(bytes, SeqCst);
        })?;
        self.counted(outstanding, zeroed);
        Ok(storage)
    }

    fn alloc_growable(&self, device: Device, bytes: usize) -> Result<Storage, AllocError> {
        let mapped = self.mapped(bytes);
        let Some(bytes) = mapped.filter(|_| self.growable.load(SeqCst) && cfg!(unix)) else {
            return self.alloc(device, bytes, false);
        };
        let outstanding = self.attempt(bytes)?;
        let reserves = [GROWABLE_RESERVE, FALLBACK_RESERVE];
        let Some(buf) = self.growable_bufs.map(bytes, &reserves) else {
            self.outstanding_bytes.fetch_sub(bytes, SeqCst);
            return Err(AllocError::OutOfMemory);
        };
        self.counted(outstanding, false);
        Ok(Storage::Host(buf))
    }

    fn grow(&self, _device: Device, storage: &Storage, bytes: usize) -> Result<bool, AllocError> {
        let (Some(bytes), Some(buf)) = (self.mapped(bytes), storage.host()) else {
            return Ok(false);
        };
        let reserve = self.growable_bufs.reserve_of(buf);
        if reserve.is_none_or(|reserve| bytes > reserve) {
            return Ok(false);
        }
        let Some(more) = bytes.checked_sub(buf.bytes()).filter(|&m| m > 0) else {
            return Ok(true);
        };
        let outstanding = self.attempt(more)?;
        let grown = self.growable_bufs.grow(buf, bytes);
        debug_assert!(grown, "a listed buffer within its reserve");
        self.counted(outstanding, false);
        self.grows.fetch_add(1, SeqCst);
        Ok(true)
    }

    fn is_growable(&self, storage: &Storage) -> bool {
        storage
            .host()
            .is_some_and(|buf| self.growable_bufs.reserve_of(buf).is_some())
    }

    fn free(&self, device: Device, storage: Storage) {
        let bytes = storage.bytes();
        match storage.into_host() {
            // SAFETY: given to `free`, so an owned buffer (views never are), which nothing uses
            // any more.
            Ok(buf) => match unsafe { self.growable_bufs.unmap(buf) } {
                Ok(()) => {}
                Err(buf) => self.host.free(device, Storage::Host(buf)),
            },
            Err(storage) => self.host.free(device, storage),
        }
        self.frees.fetch_add(1, SeqCst);
        self.outstanding_bytes.fetch_sub(bytes, SeqCst);
    }

    fn stats(&self, _device: Device) -> DeviceStats {
        DeviceStats {
            allocs: self.allocs(),
            frees: self.frees(),
            bytes_allocated: self.outstanding_bytes(),
        }
    }
}

/// Whether the CPU backend makes planned caches' blocks growable in place on this host: it
/// maps a block of 32 MiB or more in 2 MiB granules within a reserve of addresses as large as
/// a GPU's memory, as the CUDA backend does (so a replay through it holds what an H100 holds),
/// where the host grants that reserve without accounting it and the process's addresses are not
/// limited (`ulimit -v`, which a reserve counts against); valgrind does not grant it, nor does a
/// kernel with `vm.overcommit_memory = 2`, and there blocks are allocated as any other (and
/// without `mmap`, off Unix, too).
pub fn host_grows_blocks() -> bool {
    cpu::grows_blocks()
}

/// How many cudarc slices the CUDA backend has made for views in this process: an array
/// served from part of a block gets its slice (with cudarc's read and write events) only at its
/// first use that needs one, and none while its context has a single stream (see
/// [`cuda`](crate::cuda)). A test on a GPU counts them to check that.
#[cfg(feature = "cuda")]
pub fn cuda_view_slices_made() -> u64 {
    backend::cuda::view_slices_made()
}

/// Routes this thread's `Device::Cpu` allocations to `backend` until the guard drops.
///
/// Guards nest like scopes: the backend installed last serves, and dropping a guard removes its
/// own backend, even when guards drop out of order. Installing and removing a backend releases
/// the free buffers of this thread's caches on `Device::Cpu`, so a free list never mixes buffers
/// of two backends. Buffers always go back to the backend that allocated them, whichever thread
/// drops them.
pub fn use_backend(backend: &Arc<CountingBackend>) -> BackendGuard {
    crate::registry::give_back_own(Some(Device::Cpu));
    let backend: Arc<dyn Backend> = Arc::clone(backend) as Arc<dyn Backend>;
    BackendGuard {
        id: backend::push_cpu_override(backend),
        _not_send: PhantomData,
    }
}

/// Keeps a [`CountingBackend`] installed on this thread; made by [`use_backend`].
#[must_use = "the backend is removed when the guard drops"]
pub struct BackendGuard {
    id: u64,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for BackendGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendGuard").finish_non_exhaustive()
    }
}

impl Drop for BackendGuard {
    fn drop(&mut self) {
        crate::registry::give_back_own(Some(Device::Cpu));
        backend::remove_cpu_override(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_limit_holds_under_threads() {
        let backend = CountingBackend::new();
        backend.set_limit(Some(1000));
        let over = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20_000 {
                        if let Ok(storage) = backend.alloc(Device::Cpu, 1000, false) {
                            if backend.outstanding_bytes() > 1000 {
                                over.fetch_add(1, SeqCst);
                            }
                            backend.free(Device::Cpu, storage);
                        }
                    }
                });
            }
        });
        assert_eq!(over.load(SeqCst), 0, "allocations past the limit");
        assert_eq!(backend.outstanding_bytes(), 0);
    }

    /// A plan's block grows in place as far as a GPU's memory, as on CUDA (the pages untouched
    /// cost nothing): a 1 GiB reserve refused EfficientNet's 1.4 GiB plan, which grows on the GPU.
    /// Where the host refuses that many addresses (valgrind does), the buffer has 1 GiB and grows
    /// within it.
    #[cfg(all(unix, target_pointer_width = "64"))]
    #[test]
    fn growable_blocks_grow_as_far_as_their_reserve() {
        // As large as an H100's memory at least.
        const { assert!(GROWABLE_RESERVE >= 80 << 30) };
        let granted = cpu::host_grants_reserve();
        let backend = CountingBackend::new();
        backend.set_growable(true);
        backend.set_granularity(2 << 20);
        let storage = backend.alloc_growable(Device::Cpu, 40 << 20).unwrap();
        let reserve = storage
            .host()
            .and_then(|buf| backend.growable_bufs.reserve_of(buf));
        let expected = if granted {
            GROWABLE_RESERVE
        } else {
            FALLBACK_RESERVE
        };
        assert_eq!(reserve, Some(expected));
        // Past 1 GiB where the reserve allows it, rounded up to the granule as the GPU maps it.
        let far = if expected > 1 << 30 { 3 << 30 } else { 1 << 29 };
        assert!(matches!(
            backend.grow(Device::Cpu, &storage, far + 1),
            Ok(true)
        ));
        assert_eq!(backend.outstanding_bytes(), far + (2 << 20));
        assert_eq!(backend.grows(), 1);
        // Not past it.
        assert!(matches!(
            backend.grow(Device::Cpu, &storage, expected + 1),
            Ok(false)
        ));
        backend.free(Device::Cpu, storage);
        assert_eq!(backend.outstanding_bytes(), 0);
    }
}

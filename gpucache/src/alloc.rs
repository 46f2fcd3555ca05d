//! The allocation pipeline: how an array gets its buffer, and where the buffer goes when the
//! array drops.
//!
//! An allocation inside a scope first tries the hit path, inlined into the array constructors
//! ([`hit`]: the newest free buffer of its key in the thread's current cache). Everything else
//! comes here, to [`alloc_slow`], and goes down these steps in order, each one handing over to
//! the next only when it cannot serve the request:
//!
//! 1. a zero-size array owns no memory and touches no cache;
//! 2. the cache serves it ([`CacheCell::take`]): a planned cache from its plan or a spare; a
//!    cache of free lists takes in what other threads returned and what other streams finished
//!    with, and looks again;
//! 3. a device allocation is refused while the thread captures a step graph (it would be
//!    captured, not made);
//! 4. the backend allocates (a planned cache's plan block growable in place where it can, or
//!    grown in place from the block the plan gave up, see [`Make`]); when the device is out of
//!    memory, the caches give back what no array owns (this thread's for that device, then
//!    every thread's) and it retries once; a planned cache's block larger than the array (a
//!    plan's whole block, room to grow) that still does not fit is asked again at the array's
//!    own size;
//! 5. the cache accounts the new buffer ([`CacheCell::adopt`]).
//!
//! Zeroing is decided once per allocation, from its [`Init`] and element type
//! ([`Init::must_zero`]).
//! A drop goes the other way ([`release_from`]): the common drops on the owner thread served
//! while the buffer is still in the array; any other ([`release`]) to a step graph run that
//! holds its buffers, else back to the buffer's cache, or to the device.

use crate::backend::{self, AllocError, Backend, Block};
use crate::cache::{self, CacheCell, Got, HitPath, Home, Make, Request, Take};
use crate::trace::record::{self, EventKind, Note};
use crate::{Error, Result, registry, scope};
#[cfg(feature = "cuda")]
use crate::{backend::capture, cuda::held};

/// How a new array's contents must start.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Init {
    /// All zero.
    Zeroed,
    /// Anything valid for the element type.
    Any,
    /// About to be overwritten entirely.
    Overwritten,
}

impl Init {
    /// Whether the array's buffer must be zeroed, new or recycled: when asked, or when not
    /// every bit pattern is valid for its element type (`any_bit_pattern` false: `bool`) and it
    /// is not about to be overwritten. Any other buffer is handed out as it is: a recycled one
    /// with what its last array left in it, a new device buffer with what the device gives
    /// (memory the process may have used before, as a recycled buffer). Host memory is always
    /// zeroed by its backend, so that reading it is never undefined behaviour.
    #[inline(always)]
    pub(crate) const fn must_zero(self, any_bit_pattern: bool) -> bool {
        matches!(self, Init::Zeroed) || (matches!(self, Init::Any) && !any_bit_pattern)
    }
}

/// The hit path, from one look at the thread's current cache: a free buffer of `req`'s key if
/// it is a plain cache, the next position of its plan if it is a planned one and the position
/// can be served at once ([`CacheCell::plan_hit`]); nothing if it is recorded or closed. What
/// it cannot serve goes to [`alloc_slow`].
#[inline(always)]
pub(crate) fn hit(req: &Request<'_>) -> Option<(Block, Home)> {
    scope::with_current_for_hit(|c| {
        let c = c?;
        match c.hit_path() {
            HitPath::FreeList => c.hit(req),
            HitPath::Plan => c.plan_hit(req),
            HitPath::None => None,
        }
    })
}

/// The allocation when [`hit`] found nothing (see the module docs for the steps). `None` for
/// a zero-size array.
pub(crate) fn alloc_slow(req: &Request<'_>, zero: bool) -> Result<Option<Got>> {
    if req.bytes == 0 {
        backend::check_device(req.device)?;
        return Ok(None);
    }
    scope::with_current(|cache| {
        let Some(cache) = cache else {
            let block = device_alloc(req, None, req.bytes, zero, false)?;
            return Ok(Some(Got::Fresh(block, None)));
        };
        let (capacity, view, make) = match cache.take(req) {
            Take::Hit(block, home) => return Ok(Some(Got::Recycled(block, home))),
            Take::Failed(e) => return Err(e),
            Take::Bypass => {
                let block = device_alloc(req, Some(cache), req.bytes, zero, false)?;
                return Ok(Some(Got::Fresh(block, None)));
            }
            Take::Miss {
                capacity,
                view,
                make,
            } => (capacity, view, make),
        };
        // A block that reaches the array as a view is zeroed as a recycled buffer is (by the
        // array, when asked), not as a whole.
        let made = match make {
            Make::Grow(old) => grow(req, cache, old, capacity),
            make => {
                let growable = matches!(make, Make::Growable);
                device_alloc(req, Some(cache), capacity, zero && !view, growable)
            }
        };
        let block = match made {
            // A planned cache's block larger than the array (a plan's block, room to grow) that
            // the device cannot give even after recovery: the array alone may still fit, and
            // the cache makes whatever block it gets a block of its own.
            Err(Error::OutOfMemory { .. }) if view && capacity > req.bytes => {
                device_alloc(req, Some(cache), req.bytes, false, false)?
            }
            got => got?,
        };
        match cache.adopt(req, block)? {
            Got::Fresh(mut block, home) if view && zero => {
                block.zero(req.bytes)?;
                Ok(Some(Got::Fresh(block, home)))
            }
            got => Ok(Some(got)),
        }
    })
}

/// The plan's block `old` (handed over by the cache) grown in place to `capacity` bytes for
/// `req`, and ordered after its earlier work as a recycled block is; when its backend cannot
/// grow it, or the device has no room for the growth, it is freed and a new growable block is
/// made ([`device_alloc`], which recovers from out of memory).
fn grow(req: &Request<'_>, cache: &CacheCell, mut old: Block, capacity: usize) -> Result<Block> {
    match old.grow(capacity) {
        Ok(true) => {
            old.prepare_reuse()?;
            Ok(old)
        }
        Ok(false) | Err(AllocError::OutOfMemory) => {
            drop(old);
            device_alloc(req, Some(cache), capacity, false, true)
        }
        Err(AllocError::Other(e)) => Err(e),
    }
}

/// A new block of `capacity` bytes for `req` (zeroed if `zeroed`; growable in place if
/// `growable`, see [`Block::alloc_growable`]), for the thread's current cache `cache` (if any):
/// refused while the thread captures a step graph; on out of memory, the caches give back what
/// they hold for the device and it retries once.
fn device_alloc(
    req: &Request<'_>,
    cache: Option<&CacheCell>,
    capacity: usize,
    zeroed: bool,
    growable: bool,
) -> Result<Block> {
    #[cfg(feature = "cuda")]
    if req.device.is_cuda() && capture::capturing() {
        return Err(capture::fail(|| Error::CaptureMiss {
            cache: cache.map_or_else(String::new, |c| c.name().to_owned()),
            dtype: req.dtype,
            dims: req.dims().to_vec(),
            device: req.device,
        }));
    }
    let backend = backend::resolve(req.device)?;
    let new = New {
        capacity,
        zeroed,
        growable,
    };
    match new.alloc(&backend, req.device) {
        Ok(block) => Ok(block),
        Err(AllocError::Other(e)) => Err(e),
        Err(AllocError::OutOfMemory) => recover(&backend, req, cache, new),
    }
}

/// A device allocation to make: its bytes, and whether zeroed or growable.
#[derive(Clone, Copy)]
struct New {
    capacity: usize,
    zeroed: bool,
    growable: bool,
}

impl New {
    /// Makes it on `device`, from `backend`.
    fn alloc(
        self,
        backend: &std::sync::Arc<dyn Backend>,
        device: crate::Device,
    ) -> Result<Block, AllocError> {
        if self.growable {
            Block::alloc_growable(backend, device, self.capacity)
        } else {
            Block::alloc(backend, device, self.capacity, self.zeroed)
        }
    }
}

/// The device is out of memory: gives back what every cache holds on it that no array owns
/// (this thread's caches first, then every thread's) and retries once.
#[cold]
#[inline(never)]
fn recover(
    backend: &std::sync::Arc<dyn Backend>,
    req: &Request<'_>,
    cache: Option<&CacheCell>,
    new: New,
) -> Result<Block> {
    let device = req.device;
    let before = backend.stats(device).bytes_allocated;
    registry::give_back_unowned(Some(device), true);
    let released = before.saturating_sub(backend.stats(device).bytes_allocated);
    let retry = new.alloc(backend, device);
    note_out_of_memory(req, cache, released, retry.is_ok());
    match retry {
        Ok(block) => Ok(block),
        Err(AllocError::Other(e)) => Err(e),
        Err(AllocError::OutOfMemory) => {
            // What caches still hold on the device that no array owns: free lists and dropped
            // buffers of scopes active on other threads.
            let cached = registry::unowned_bytes(device);
            let allocated = backend.stats(device).bytes_allocated;
            Err(Error::OutOfMemory {
                device,
                requested: req.bytes,
                cached,
                in_use: allocated.saturating_sub(cached),
            })
        }
    }
}

/// Reports an allocation that ran out of memory, the bytes released and the retry's outcome:
/// as a `tracing` warning (feature `tracing`) and a recorded event.
fn note_out_of_memory(
    req: &Request<'_>,
    cache: Option<&CacheCell>,
    released: usize,
    recovered: bool,
) {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        device = %req.device,
        requested = req.bytes,
        released,
        recovered,
        "out of memory: gave back cached buffers and retried"
    );
    if record::on() {
        record::push(Note {
            bytes: req.bytes,
            device: Some(req.device),
            stream: backend::current_stream_id(req.device),
            ..Note::about(
                EventKind::OutOfMemory {
                    released,
                    recovered,
                },
                cache.map(CacheCell::trace_id),
            )
        });
    }
}

/// A dropped array's buffer and home, taken from the array: the common drops on the owner
/// thread are served before the buffer leaves the array ([`cache::drop_here`]); any other goes
/// to [`release`]. (Moved through the calls of [`release`] first, the buffer was copied
/// through the stack on the way.)
#[inline(always)]
pub(crate) fn release_from(block: &mut Option<Block>, home: &mut Option<Home>) {
    #[cfg(feature = "cuda")]
    let holding = capture::holding();
    #[cfg(not(feature = "cuda"))]
    let holding = false;
    if let Some(h) = home
        && !holding
        && cache::drop_here(block, h, scope::current_ptr())
    {
        return;
    }
    if let Some(block) = block.take() {
        release(block, home.take());
    }
}

/// Where a dropped array's buffer goes: to the step graph run in progress on this thread, if
/// it holds buffers; else back to the buffer's cache, or to the device when it has none.
#[inline(always)]
pub(crate) fn release(block: Block, home: Option<Home>) {
    #[cfg(feature = "cuda")]
    if capture::holding() && block.cuda().is_some() {
        return held::hold(block, home);
    }
    cache::return_block(block, home, scope::current_ptr());
}

//! NCCL collectives on gpucache arrays (feature `nccl`): data-parallel training over several
//! GPUs, in one process or many, on one host or several.
//!
//! A [`Comm`] is one rank of an NCCL communicator, on one CUDA device. Its operations take
//! [`Array`]s of that device directly (no copy, no staging buffer) and are enqueued on the
//! calling thread's *current stream* for the device ([`crate::cuda::current_stream`]), the
//! stream gpucache allocates and recycles the arrays on. So a cached array can be all-reduced
//! inside a `#[cache_scope]` and recycled by the next step with no synchronisation: the next
//! step's work on that stream is ordered after the collective. An array whose buffer belongs to
//! another stream (it was allocated while another stream was current) is handled as a kernel on
//! a second stream should be: the collective waits for the array's stream, and the array is
//! marked as used on the current one ([`Array::record_stream`]), so its buffer is not reused
//! before the collective completes. Work queued afterwards on the array's own stream must wait
//! for the current one (`own.join(&current)`), as after any cross-stream launch.
//!
//! NCCL is loaded at run time, as the rest of CUDA, so the crate builds without it. cudarc looks
//! for `libnccl.so` on the library search path; a system that has only `libnccl.so.2` needs a
//! `libnccl.so` link to it (NCCL's development package installs one).
//!
//! # Set-ups
//!
//! * **One thread per GPU** (one process): make a [`UniqueId`], give it to every thread, and let
//!   thread `r` call [`Comm::new`]`(Device::cuda(r)?, r, world_size, &id)`; the calls return when
//!   every rank has joined.
//! * **One process per GPU** (as `torchrun` starts them; the set-up that spans hosts): rank 0
//!   makes the [`UniqueId`] and hands it to the other processes at start-up, as text
//!   (`id.to_string()`, parsed back with `str::parse`); each process calls [`Comm::new`] with its
//!   rank. Across hosts NCCL talks over the network (InfiniBand or TCP sockets); nothing in the
//!   code changes: start the ranks of each host with a launcher there (or `mpirun`, Slurm) and
//!   hand every rank the same id (rank 0's id names the address the others connect to). Keep
//!   NCCL's environment (`NCCL_NVLS_ENABLE` and the like) in the environment the ranks get.
//!
//! ```no_run
//! use gpucache::nccl::{Comm, ReduceOp, UniqueId};
//! use gpucache::{Array, Device};
//!
//! let world_size = 2;
//! let id = UniqueId::new()?;
//! std::thread::scope(|s| {
//!     for rank in 0..world_size {
//!         s.spawn(move || -> gpucache::Result<()> {
//!             let dev = Device::cuda(rank)?;
//!             let comm = Comm::new(dev, rank, world_size, &id)?;
//!             for _step in 0..3 {
//!                 let _scope = gpucache::enter("step"); // the gradient is recycled every step
//!                 let mut grad = Array::from_slice(dev, &[rank as f32 + 1.0; 4], 4)?;
//!                 comm.all_reduce(&mut grad, ReduceOp::Sum)?;
//!                 assert_eq!(grad.to_vec()?, [3.0; 4]); // 1 + 2 on both ranks
//!             }
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok::<(), gpucache::Error>(())
//! ```
//!
//! gpucache is not a communication library: it keeps per-device caches and lets NCCL work on
//! their arrays. Choosing ranks, starting processes, handing the id over, bucketing gradients
//! and overlapping communication with computation are the program's (or a framework's).

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys::{self, ncclComm_t, ncclDataType_t, ncclRedOp_t};

pub use cudarc::nccl::result::NcclError;

use crate::backend::cuda::{device_state, ordinal, thread_stream};
use crate::{Array, Device, Element, Error, Result, bf16, f16};

/// Whether the NCCL library can be loaded (checked once).
fn ensure_library() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the shared library; no symbol is called.
    let present = *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(Error::NcclNotFound)
    }
}

/// The version of the loaded NCCL library as `(major, minor, patch)`.
///
/// # Errors
/// [`Error::NcclNotFound`] when NCCL cannot be loaded.
pub fn version() -> Result<(u32, u32, u32)> {
    ensure_library()?;
    let v = u32::try_from(nccl::get_nccl_version()?).unwrap_or(0);
    // NCCL encodes 2.27.3 as 22703 (and versions before 2.9 as 2703).
    let (major, rest) = if v >= 10_000 {
        (v / 10_000, v % 10_000)
    } else {
        (v / 1_000, v % 1_000)
    };
    Ok((major, rest / 100, rest % 100))
}

/// The unique id that names one NCCL communicator: rank 0 makes it and every rank passes it to
/// [`Comm::new`]. It is plain data: send it to other threads by copy, and to other processes or
/// hosts as text (`Display` writes 256 hexadecimal digits, `FromStr` reads them back).
#[derive(Clone, Copy)]
pub struct UniqueId(sys::ncclUniqueId);

impl UniqueId {
    /// A new id (`ncclGetUniqueId`; it holds the address rank 0 listens on for the others).
    ///
    /// # Errors
    /// [`Error::NcclNotFound`] when NCCL cannot be loaded, and NCCL's errors.
    pub fn new() -> Result<UniqueId> {
        ensure_library()?;
        Ok(UniqueId(nccl::get_uniqueid()?))
    }

    /// The id's 128 bytes.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id with these 128 bytes (made by [`UniqueId::to_bytes`] on another rank).
    pub fn from_bytes(bytes: [u8; 128]) -> UniqueId {
        UniqueId(sys::ncclUniqueId {
            internal: bytes.map(|b| b as c_char),
        })
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.to_bytes()
            .iter()
            .try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({self})")
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    /// Reads the 256 lowercase hexadecimal digits that `Display` writes, and nothing else (no
    /// sign, no uppercase digit).
    fn from_str(s: &str) -> Result<UniqueId> {
        let invalid = || Error::InvalidUniqueId { len: s.len() };
        let digits = s.as_bytes();
        if digits.len() != 256 {
            return Err(invalid());
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut bytes = [0u8; 128];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            let (Some(hi), Some(lo)) = (digit(pair[0]), digit(pair[1])) else {
                return Err(invalid());
            };
            *byte = hi << 4 | lo;
        }
        Ok(UniqueId::from_bytes(bytes))
    }
}

/// How [`Comm::all_reduce`] combines the ranks' values.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Prod,
    /// The maximum.
    Max,
    /// The minimum.
    Min,
    /// The mean (the sum divided by the number of ranks).
    Avg,
}

impl ReduceOp {
    fn raw(self) -> ncclRedOp_t {
        match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Element types NCCL can reduce: `i8`, `u8`, `i32`, `u32`, `i64`, `u64`, `f16`, `bf16`,
/// `f32`, `f64`. (Broadcast and send/receive take any [`Element`]: they move bytes.)
pub trait Reduce: Element + sealed::Sealed {
    /// NCCL's name for the type.
    #[doc(hidden)]
    const NCCL: ncclDataType_t;
}

macro_rules! reduce {
    ($($t:ty => $nccl:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Reduce for $t {
            const NCCL: ncclDataType_t = ncclDataType_t::$nccl;
        }
    )*};
}

reduce! {
    i8 => ncclInt8, u8 => ncclUint8, i32 => ncclInt32, u32 => ncclUint32, i64 => ncclInt64,
    u64 => ncclUint64, f16 => ncclFloat16, bf16 => ncclBfloat16, f32 => ncclFloat32,
    f64 => ncclFloat64,
}

/// One rank of an NCCL communicator, on one CUDA device.
///
/// `Send` (it may be made on one thread and used on another) but not `Sync`: NCCL does not
/// allow one communicator to be used by two threads at once. Dropping it aborts the
/// communicator (`ncclCommAbort`), which stops NCCL work still queued on it: synchronise the
/// stream before dropping it when the results are still to be read.
pub struct Comm {
    raw: ncclComm_t,
    device: Device,
    rank: usize,
    world_size: usize,
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: an NCCL communicator may be used from any thread, one thread at a time; `Comm` is not
// `Sync`, so `&Comm` never reaches two threads, and moving it moves the only handle.
unsafe impl Send for Comm {}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm")
            .field("device", &self.device)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

/// `value` as a C int, or the rank error.
fn c_int_of(value: usize, world_size: usize) -> Result<c_int> {
    c_int::try_from(value).map_err(|_| Error::RankOutOfRange {
        rank: value,
        world_size,
    })
}

impl Comm {
    /// Joins the communicator `id` as rank `rank` of `world_size`, on `device`. Every rank must
    /// call this (on its own thread or process) with the same id and world size; it returns once
    /// all have joined.
    ///
    /// # Errors
    /// [`Error::RankOutOfRange`] when `rank >= world_size`; [`Error::NcclNotFound`] when NCCL
    /// cannot be loaded; the errors of [`Device::cuda`] for `device`; NCCL's errors.
    pub fn new(device: Device, rank: usize, world_size: usize, id: &UniqueId) -> Result<Comm> {
        if rank >= world_size {
            return Err(Error::RankOutOfRange { rank, world_size });
        }
        let (nranks, r) = (
            c_int_of(world_size, world_size)?,
            c_int_of(rank, world_size)?,
        );
        ensure_library()?;
        // NCCL creates the communicator on the calling thread's current device.
        device_state(ordinal(device)?)?.ctx.bind_to_thread()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid place for the new communicator's handle; the id is 128
        // plain bytes, copied.
        unsafe { nccl::comm_init_rank(&mut raw, nranks, id.0, r) }?;
        Ok(Comm {
            raw,
            device,
            rank,
            world_size,
            _not_sync: PhantomData,
        })
    }

    /// The device of this rank.
    pub fn device(&self) -> Device {
        self.device
    }

    /// This rank's number, from 0.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Checks that `array` is on this rank's device.
    fn check<T: Element>(&self, array: &Array<T>) -> Result<()> {
        if array.device() == self.device {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                expected: self.device,
                found: array.device(),
            })
        }
    }

    /// Checks that `peer` is a rank of the communicator.
    fn peer(&self, peer: usize) -> Result<c_int> {
        if peer >= self.world_size {
            return Err(Error::RankOutOfRange {
                rank: peer,
                world_size: self.world_size,
            });
        }
        c_int_of(peer, self.world_size)
    }

    /// The stream the calling thread enqueues this rank's work on, with the device's context
    /// bound to the thread.
    fn stream(&self) -> Result<Arc<CudaStream>> {
        let n = ordinal(self.device)?;
        let state = device_state(n)?;
        state.ctx.bind_to_thread()?;
        Ok(thread_stream(n, state))
    }

    /// Enqueues `op` on the current stream with the device pointers of `src` (read) and `dst`
    /// (written), then orders the reuse of their buffers after it.
    fn enqueue<S: Element, D: Element>(
        &self,
        src: Option<&Array<S>>,
        mut dst: Option<&mut Array<D>>,
        op: impl FnOnce(*const c_void, *mut c_void, sys::cudaStream_t) -> Result<(), NcclError>,
    ) -> Result<()> {
        let stream = self.stream()?;
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        // The collective comes after the work queued on the arrays' own streams.
        let own_streams = [
            src.map(|a| DeviceSlice::stream(a)),
            dst.as_deref().map(|a| DeviceSlice::stream(a)),
        ];
        for own in own_streams.into_iter().flatten() {
            if own.cu_stream() != stream.cu_stream() {
                stream.join(own)?;
            }
        }
        {
            // cudarc's event tracking: wait for earlier writes, record this read/write.
            let (src_ptr, _read) = src.map(|a| a.device_ptr(&stream)).unzip();
            let (dst_ptr, _write) = match dst {
                Some(ref mut a) => Some(a.device_ptr_mut(&stream)).unzip(),
                None => (None, None),
            };
            let src_ptr = src_ptr.or(dst_ptr).unwrap_or(0) as *const c_void;
            let dst_ptr = dst_ptr.unwrap_or(0) as *mut c_void;
            op(src_ptr, dst_ptr, cu_stream)?;
        }
        if let Some(a) = src {
            a.record_stream(&stream)?;
        }
        if let Some(a) = dst {
            a.record_stream(&stream)?;
        }
        Ok(())
    }

    /// Sums (or otherwise reduces, see [`ReduceOp`]) `buf` over all ranks, in place: every
    /// rank's `buf` ends up holding the result. Every rank must call it with the same length.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for an array that is not on this rank's device; NCCL's errors.
    pub fn all_reduce<T: Reduce>(&self, buf: &mut Array<T>, op: ReduceOp) -> Result<()> {
        self.check(buf)?;
        let count = buf.len();
        self.enqueue(None::<&Array<T>>, Some(buf), |src, dst, stream| {
            // SAFETY: `src` and `dst` both point at `buf`'s `count` elements of type `T`
            // (in place); `stream` is a stream of this rank's device.
            unsafe { nccl::all_reduce(src, dst, count, T::NCCL, op.raw(), self.raw, stream) }
                .map(drop)
        })
    }

    /// Reduces `send` over all ranks into `recv` (same length), leaving `send` as it was.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for an array that is not on this rank's device;
    /// [`Error::ArrayLengthMismatch`] when the lengths differ; NCCL's errors.
    pub fn all_reduce_into<T: Reduce>(
        &self,
        send: &Array<T>,
        recv: &mut Array<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check(send)?;
        self.check(recv)?;
        if send.len() != recv.len() {
            return Err(Error::ArrayLengthMismatch {
                expected: send.len(),
                found: recv.len(),
            });
        }
        let count = send.len();
        self.enqueue(Some(send), Some(recv), |src, dst, stream| {
            // SAFETY: `src` points at `count` elements of `send`, `dst` at `count` of `recv`,
            // both of type `T`, distinct arrays (one is borrowed mutably); `stream` is a stream
            // of this rank's device.
            unsafe { nccl::all_reduce(src, dst, count, T::NCCL, op.raw(), self.raw, stream) }
                .map(drop)
        })
    }

    /// Copies rank `root`'s `buf` into every other rank's `buf`, in place. Every rank must call
    /// it with the same root and the same number of bytes.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for an array that is not on this rank's device;
    /// [`Error::RankOutOfRange`] for a root that is not a rank; NCCL's errors.
    pub fn broadcast<T: Element>(&self, buf: &mut Array<T>, root: usize) -> Result<()> {
        self.check(buf)?;
        let root = self.peer(root)?;
        let bytes = buf.num_bytes();
        self.enqueue(None::<&Array<T>>, Some(buf), |src, dst, stream| {
            let uint8 = ncclDataType_t::ncclUint8;
            // SAFETY: `src` and `dst` both point at `buf`'s `bytes` bytes (in place); `stream`
            // is a stream of this rank's device.
            unsafe { nccl::broadcast(src, dst, bytes, uint8, root, self.raw, stream) }.map(drop)
        })
    }

    /// Sends `buf` to rank `peer`, which must [`Comm::recv`] an array of the same number of
    /// bytes. Two ranks that send to each other must do it inside [`group`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for an array that is not on this rank's device;
    /// [`Error::RankOutOfRange`] for a peer that is not a rank; NCCL's errors.
    pub fn send<T: Element>(&self, buf: &Array<T>, peer: usize) -> Result<()> {
        self.check(buf)?;
        let peer = self.peer(peer)?;
        let bytes = buf.num_bytes();
        self.enqueue(Some(buf), None::<&mut Array<T>>, |src, _, stream| {
            let uint8 = ncclDataType_t::ncclUint8;
            // SAFETY: `src` points at `buf`'s `bytes` bytes; `stream` is a stream of this
            // rank's device.
            unsafe { nccl::send(src, bytes, uint8, peer, self.raw, stream) }.map(drop)
        })
    }

    /// Receives into `buf` what rank `peer` [sends](Comm::send).
    ///
    /// # Errors
    /// As [`Comm::send`].
    pub fn recv<T: Element>(&self, buf: &mut Array<T>, peer: usize) -> Result<()> {
        self.check(buf)?;
        let peer = self.peer(peer)?;
        let bytes = buf.num_bytes();
        self.enqueue(None::<&Array<T>>, Some(buf), |_, dst, stream| {
            let uint8 = ncclDataType_t::ncclUint8;
            // SAFETY: `dst` points at `buf`'s `bytes` writable bytes; `stream` is a stream of
            // this rank's device.
            unsafe { nccl::recv(dst, bytes, uint8, peer, self.raw, stream) }.map(drop)
        })
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `raw` is a communicator made by `comm_init_rank`, dropped once, here.
        // A failure leaves nothing to clean up.
        let _ = unsafe { nccl::comm_abort(self.raw) };
    }
}

/// Runs `f` inside an NCCL group (`ncclGroupStart` / `ncclGroupEnd`): the operations it
/// enqueues start together, as a unit. Needed when one thread drives several ranks, and for
/// send/receive pairs that would otherwise wait on each other (two ranks exchanging arrays).
/// The group ends even when `f` fails or panics.
///
/// NCCL enqueues a group's work when the group ends, after the calls inside it have returned:
/// cudarc's read/write events of the arrays (which order work on *other* streams) are recorded
/// before that work. Work on the current stream is ordered as usual, and buffer reuse is ordered
/// by gpucache; order other streams after a group explicitly (`other.join(&current)`).
///
/// # Errors
/// [`Error::NcclNotFound`] when NCCL cannot be loaded; `f`'s error; NCCL's errors.
pub fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    struct End(bool);
    impl Drop for End {
        fn drop(&mut self) {
            if !self.0 {
                let _ = nccl::group_end();
            }
        }
    }
    ensure_library()?;
    nccl::group_start()?;
    let mut end = End(false);
    let out = f();
    end.0 = true;
    let ended = nccl::group_end();
    let out = out?;
    ended?;
    Ok(out)
}

impl From<NcclError> for Error {
    fn from(e: NcclError) -> Error {
        Error::Nccl(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_text_is_exactly_what_display_writes() {
        let id = UniqueId::from_bytes(std::array::from_fn(|i| (i * 37) as u8));
        let text = id.to_string();
        assert_eq!(text.parse::<UniqueId>().unwrap().to_bytes(), id.to_bytes());
        // What `Display` never writes: uppercase digits, a sign.
        let upper = text.to_uppercase();
        assert_ne!(upper, text);
        assert!(upper.parse::<UniqueId>().is_err());
        let signed = format!("+{}", &text[1..]);
        assert!(signed.parse::<UniqueId>().is_err());
        let signed = format!("{}+{}", &text[..10], &text[11..]);
        assert!(signed.parse::<UniqueId>().is_err());
    }
}

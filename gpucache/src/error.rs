//! [`Error`] and [`Result`]: everything that can go wrong, typed, with messages a person can act on.

use crate::{DType, Device};

/// The result type of every fallible gpucache operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong.
///
/// Bad input (a shape whose size overflows, data of the wrong length), a device that is not there
/// and a device that is out of memory are all reported through this type; gpucache never panics or
/// aborts on them and never loses memory when it returns one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The number of elements or bytes of a shape does not fit in `usize` (or exceeds
    /// `isize::MAX` bytes, the most any Rust allocation or slice can hold).
    #[error(
        "shape {dims:?} of {dtype} is too large: its size in bytes overflows the address space \
         (at most isize::MAX bytes); check the dimensions"
    )]
    ShapeOverflow {
        /// The dimensions that were asked for.
        dims: Vec<usize>,
        /// The element type.
        dtype: DType,
    },

    /// `Array::from_slice` got a slice whose length is not the shape's number of elements.
    #[error(
        "data has {got} elements but shape {dims:?} holds {expected}; pass a slice of exactly \
         {expected} elements or change the shape"
    )]
    LengthMismatch {
        /// The dimensions that were asked for.
        dims: Vec<usize>,
        /// The number of elements the shape holds.
        expected: usize,
        /// The number of elements that were given.
        got: usize,
    },

    /// The device could not provide the memory, even after gpucache released every cached
    /// buffer it could (this thread's caches for the device, then every other thread's) and
    /// retried once.
    #[error(
        "out of memory on {device}: could not allocate {requested} bytes after releasing cached \
         buffers and retrying; gpucache still holds {in_use} bytes in use by live arrays and \
         {cached} bytes cached in scopes active on other threads. Drop arrays you no longer need, \
         call gpucache::invalidate for caches you are done with, or use smaller batches"
    )]
    OutOfMemory {
        /// The device that ran out.
        device: Device,
        /// The number of bytes that were asked for.
        requested: usize,
        /// Bytes still sitting in free lists that could not be released (caches held active by
        /// a scope on another thread).
        cached: usize,
        /// Bytes gpucache has allocated on the device that are not in any free list: owned by
        /// live arrays, or dropped inside a scope that has not exited yet.
        in_use: usize,
    },

    /// A CUDA device was asked for but this build of gpucache has no CUDA backend.
    #[error(
        "{device} is not available: gpucache was built without its `cuda` feature; enable it \
         (gpucache = {{ features = [\"cuda\"] }}) or use Device::Cpu"
    )]
    CudaNotEnabled {
        /// The device that was asked for.
        device: Device,
    },

    /// No CUDA driver could be loaded (`libcuda.so` is not on the library search path), so no
    /// CUDA device can be used.
    #[error(
        "{device} is not available: no CUDA driver was found (libcuda.so could not be loaded); \
         install the NVIDIA driver, check LD_LIBRARY_PATH, or use Device::Cpu"
    )]
    CudaDriverNotFound {
        /// The device that was asked for.
        device: Device,
    },

    /// The CUDA driver is there but has no device with this ordinal.
    #[error(
        "{device} does not exist: the CUDA driver reports {count} device(s); use an ordinal below \
         {count} (check CUDA_VISIBLE_DEVICES)"
    )]
    CudaDeviceNotFound {
        /// The device that was asked for.
        device: Device,
        /// The number of CUDA devices the driver reports.
        count: usize,
    },

    /// A call of the CUDA driver failed. The driver's own error is the [source](std::error::Error::source).
    #[cfg(feature = "cuda")]
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),

    /// An operation got an array or stream of one device where another was needed (a CPU array
    /// passed to a CUDA API, a stream of another GPU).
    #[error("expected an array or stream on {expected}, got one on {found}")]
    DeviceMismatch {
        /// The device the operation needs.
        expected: Device,
        /// The device it got.
        found: Device,
    },

    /// A CUDA stream that does not belong to the context gpucache allocates in (the device's
    /// primary context) was given where gpucache records or orders work.
    #[error(
        "the stream belongs to a CUDA context other than the primary context of {device}, which \
         gpucache allocates in; create streams from gpucache::cuda::context({device:?})"
    )]
    ForeignStream {
        /// The device of the stream.
        device: Device,
    },

    /// NCCL (feature `nccl`) could not be loaded: cudarc looks for `libnccl.so` on the library
    /// search path. Install NCCL; where only `libnccl.so.2` is installed (the runtime package, or
    /// the `nvidia-nccl` Python wheel), put a `libnccl.so` link to it in a directory on
    /// `LD_LIBRARY_PATH`.
    #[cfg(feature = "nccl")]
    #[error("NCCL is not available: libnccl.so could not be loaded")]
    NcclNotFound,

    /// A call of NCCL failed. NCCL's own error code is kept in the variant.
    #[cfg(feature = "nccl")]
    #[error("NCCL call failed: {:?}", .0.0)]
    Nccl(crate::nccl::NcclError),

    /// A rank (own, root or peer) that is not below the communicator's number of ranks.
    #[cfg(feature = "nccl")]
    #[error("rank {rank} is out of range for a communicator of {world_size} ranks")]
    RankOutOfRange {
        /// The rank that was given.
        rank: usize,
        /// The number of ranks.
        world_size: usize,
    },

    /// Text that is not an NCCL unique id: those are 256 hexadecimal digits, as the id's
    /// `Display` writes them. Pass the id on unchanged.
    #[cfg(feature = "nccl")]
    #[error("an NCCL unique id is 256 hexadecimal digits, got {len} bytes that are not one")]
    InvalidUniqueId {
        /// The length of the text, in bytes.
        len: usize,
    },

    /// Two arrays that must have the same number of elements (a collective's input and output)
    /// do not.
    #[cfg(feature = "nccl")]
    #[error("expected an array of {expected} elements, got one of {found}")]
    ArrayLengthMismatch {
        /// The number of elements needed.
        expected: usize,
        /// The number of elements of the array given.
        found: usize,
    },

    /// A zero-size array owns no device memory, so it has no mutable device view.
    #[error(
        "the array on {device} has no elements and owns no device memory, so it has no mutable \
         view; check is_empty() first"
    )]
    EmptyArray {
        /// The array's device.
        device: Device,
    },

    /// The array lives in device memory that the host cannot address.
    #[error(
        "the array lives on {device}, whose memory the host cannot read or write directly; copy \
         it with to_vec() or use the device's own API"
    )]
    NotHostAccessible {
        /// The array's device.
        device: Device,
    },
}

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
    /// The number of elements or bytes of a shape does not fit in `usize`, or its bytes exceed
    /// the largest allocation (`isize::MAX` rounded down to 64 bytes). Check the dimensions.
    #[error(
        "shape {dims:?}{} is too large: its size overflows the largest allocation",
        of_type(*.dtype)
    )]
    ShapeOverflow {
        /// The dimensions that were asked for.
        dims: Vec<usize>,
        /// The element type (`None` when the number of elements itself overflows, as reported
        /// by [`Shape::numel`](crate::Shape::numel)).
        dtype: Option<DType>,
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

    /// The device could not provide the memory, even after gpucache gave back everything its
    /// caches held for the device that no array owns (this thread's caches, then every other
    /// thread's, buffers returned from other threads included) and retried once.
    ///
    /// What to do: drop arrays you no longer need, [`invalidate`](crate::invalidate) caches you
    /// are done with, or use smaller batches. `cached` bytes are held by scopes active on other
    /// threads: they are released when those scopes exit.
    #[error(
        "out of memory on {device}: could not allocate {requested} bytes after releasing cached \
         buffers and retrying ({in_use} bytes in use by live arrays, {cached} bytes held by \
         scopes active on other threads)"
    )]
    OutOfMemory {
        /// The device that ran out.
        device: Device,
        /// The number of bytes the caller asked for (not rounded up to a size class).
        requested: usize,
        /// Bytes gpucache holds on the device that no array owns and that could not be released:
        /// free lists of caches inside a scope on another thread, and buffers dropped inside such
        /// a scope (free when it exits).
        cached: usize,
        /// Bytes gpucache has allocated on the device for arrays that are alive.
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

/// ` of {dtype}`, or nothing.
fn of_type(dtype: Option<DType>) -> String {
    dtype.map(|t| format!(" of {t}")).unwrap_or_default()
}

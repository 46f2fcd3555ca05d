//! [`Error`] and [`Result`]: everything that can go wrong, typed, with messages a person can act on.

use crate::metrics::Bytes;
use crate::{DType, Device};

/// The result type of every fallible gpucache operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong.
///
/// Messages follow the usual Rust convention: one lowercase clause without a trailing period,
/// never repeating the [source](std::error::Error::source) (a CUDA driver error is the source
/// of `Error::Driver`). What to do about an error is in its variant's documentation.
///
/// Bad input (a shape whose size overflows, data of the wrong length), a device that is not there
/// and a device that is out of memory are all reported through this type; gpucache never panics or
/// aborts on them and never loses memory when it returns one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The number of elements or bytes of a shape does not fit in `usize`, or its bytes exceed
    /// the largest allocation (`isize::MAX` rounded down to 64 bytes). Check the dimensions.
    #[error("shape {dims:?}{} is too large for one allocation", of_type(*.dtype))]
    ShapeOverflow {
        /// The dimensions that were asked for.
        dims: Vec<usize>,
        /// The element type (`None` when the number of elements itself overflows, as reported
        /// by [`Shape::numel`](crate::Shape::numel)).
        dtype: Option<DType>,
    },

    /// `Array::from_slice` got a slice whose length is not the shape's number of elements.
    /// Pass a slice of exactly `expected` elements, or change the shape.
    #[error("data has {got} elements but shape {dims:?} holds {expected}")]
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
    /// thread's, buffers returned from other threads included) and retried once (a planned
    /// cache that asked for a block larger than the array, once more for the array alone).
    ///
    /// What to do: drop arrays you no longer need, [`invalidate`](crate::invalidate) caches you
    /// are done with, or use smaller batches. `cached` bytes are held by scopes active on other
    /// threads: they are released when those scopes exit.
    #[error(
        "out of memory on {device}: {} requested, {} in use by live arrays, {} held by scopes \
         active on other threads",
        Amount(*.requested), Amount(*.in_use), Amount(*.cached)
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

    /// A CUDA device was asked for but this build of gpucache has no CUDA backend. Enable the
    /// `cuda` feature (`features = ["cuda"]` on the gpucache dependency) or use `Device::Cpu`.
    #[error("{device} needs the `cuda` feature, which this build of gpucache lacks")]
    CudaNotEnabled {
        /// The device that was asked for.
        device: Device,
    },

    /// No CUDA driver could be loaded (`libcuda.so` is not on the library search path), so no
    /// CUDA device can be used. Install the NVIDIA driver, check `LD_LIBRARY_PATH`, or use
    /// `Device::Cpu`.
    #[error("no CUDA driver was found for {device} (libcuda.so could not be loaded)")]
    CudaDriverNotFound {
        /// The device that was asked for.
        device: Device,
    },

    /// The CUDA driver is there but has no device with this ordinal. Use an ordinal below
    /// `count`, and check `CUDA_VISIBLE_DEVICES`.
    #[error("{device} does not exist: the CUDA driver reports {count} device(s)")]
    CudaDeviceNotFound {
        /// The device that was asked for.
        device: Device,
        /// The number of CUDA devices the driver reports.
        count: usize,
    },

    /// A call of the CUDA driver failed. The driver's own error is the
    /// [source](std::error::Error::source) (not repeated in this error's message).
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    #[error("CUDA driver call failed")]
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
    /// primary context) was given where gpucache records or orders work. Create streams from
    /// `gpucache::cuda::context(device)`.
    #[error("the stream belongs to a CUDA context other than the primary context of {device}")]
    ForeignStream {
        /// The device of the stream.
        device: Device,
    },

    /// NCCL (feature `nccl`) could not be loaded: cudarc looks for `libnccl.so` on the library
    /// search path. Install NCCL; where only `libnccl.so.2` is installed (the runtime package, or
    /// the `nvidia-nccl` Python wheel), put a `libnccl.so` link to it in a directory on
    /// `LD_LIBRARY_PATH`.
    #[cfg(feature = "nccl")]
    #[error("no NCCL library was found (libnccl.so could not be loaded)")]
    NcclNotFound,

    /// A call of NCCL failed. NCCL's own error code is kept in the variant (cudarc's
    /// `NcclError` does not implement `std::error::Error`, so it is not a source).
    #[cfg(feature = "nccl")]
    #[error("NCCL call failed with {:?}", .0.0)]
    Nccl(cudarc::nccl::result::NcclError),

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
    #[error("text of {len} bytes is not an NCCL unique id (256 hexadecimal digits)")]
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

    /// A zero-size array owns no device memory, so it has no mutable device view. Check
    /// `is_empty()` first.
    #[error("the array on {device} has no elements, so it has no mutable device view")]
    EmptyArray {
        /// The array's device.
        device: Device,
    },

    /// An array allocation inside a step being captured as a CUDA graph (`cuda::StepGraph`,
    /// feature `cuda`) was not a hit in the step's caches: a shape changed since the warm-up
    /// runs, or the step allocates outside any scope. Nothing was allocated, the capture was
    /// dropped, and the step did not run on the device; the next `StepGraph::run` runs it
    /// eagerly again (warming the cache for the new shape) and captures it once it is warm.
    #[error(
        "{dtype} array of shape {dims:?} on {device} missed cache {cache:?} during graph capture"
    )]
    CaptureMiss {
        /// The cache the allocation went through (empty when no scope was entered).
        cache: String,
        /// The element type asked for.
        dtype: DType,
        /// The dimensions asked for.
        dims: Vec<usize>,
        /// The device.
        device: Device,
    },

    /// A graph capture was asked for on the legacy default stream, which CUDA cannot capture.
    /// Create a stream (`gpucache::cuda::context(dev)?.new_stream()?`) and make it the thread's
    /// current stream (`gpucache::cuda::use_stream`) before the step's arrays, cuBLAS handles
    /// and launches are set up.
    #[error("the default stream of {device} cannot be captured as a graph")]
    CaptureDefaultStream {
        /// The device whose current stream is its default stream.
        device: Device,
    },

    /// A step being captured as a CUDA graph used a gpucache array on a stream other than the
    /// capture stream (a cuBLAS handle or copy on another stream, `record_stream`, a recycled
    /// buffer last used on another stream). Such work would run eagerly, outside the graph. The
    /// capture was dropped and the step did not run on the device: run all of the step's work on
    /// the thread's current stream.
    #[error(
        "a step captured as a graph used an array on a stream other than the capture stream of {device}"
    )]
    CaptureForeignStream {
        /// The device of the capture stream.
        device: Device,
    },

    /// A step being captured as a CUDA graph did something a graph cannot replay: a copy from or
    /// to host memory (`Array::from_slice`, `Array::to_vec`), whose host buffer would be gone at
    /// replay. The capture was dropped and the step did not run on the device: copy inputs into
    /// arrays allocated outside the step before running it, and read results after.
    #[error("{what} cannot be captured in a graph")]
    CaptureUnsupported {
        /// What the step did.
        what: &'static str,
    },

    /// The CUDA driver ended a graph capture with an error: the step waited on work recorded
    /// outside the capture (a cudarc `CudaSlice` with event tracking on, or a stream joined
    /// before the capture), forked work to another stream without joining it back, or made a
    /// call that is not allowed while capturing (a synchronisation). The capture was dropped
    /// and the step did not run on the device. The driver's error is the
    /// [source](std::error::Error::source).
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    #[error("the CUDA driver ended the graph capture with an error")]
    CaptureFailed(#[source] cudarc::driver::DriverError),

    /// A trace file could not be created or written (see [`trace::start_to`](crate::trace::start_to)
    /// and `GPUCACHE_TRACE`). The I/O error is the [source](std::error::Error::source). Check
    /// that the directory exists and is writable.
    #[error("cannot write the trace file {}", path.display())]
    TraceFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why it could not be written.
        #[source]
        source: std::io::Error,
    },

    /// A trace is already being recorded (started by `GPUCACHE_TRACE` or by an earlier
    /// [`trace::start`](crate::trace::start)). Call [`trace::stop`](crate::trace::stop) first.
    #[error("a trace is already being recorded")]
    TraceActive,

    /// The array lives in device memory that the host cannot address. Copy it with
    /// `to_vec()`, or use the device's own API.
    #[error("the array lives on {device}, whose memory the host cannot address")]
    NotHostAccessible {
        /// The array's device.
        device: Device,
    },
}

/// ` of {dtype}`, or nothing.
fn of_type(dtype: Option<DType>) -> String {
    dtype.map(|t| format!(" of {t}")).unwrap_or_default()
}

/// A byte count in a message: binary units as the stats print them, and the exact count beside
/// them (`1.5 MiB (1572864 bytes)`; under 1 KiB, `100 B`).
struct Amount(usize);

impl std::fmt::Display for Amount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 < 1024 {
            write!(f, "{}", Bytes(self.0))
        } else {
            write!(f, "{} ({} bytes)", Bytes(self.0), self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One of each variant that can be made without a GPU.
    fn samples() -> Vec<Error> {
        let device = Device::Cuda(3);
        vec![
            Error::ShapeOverflow {
                dims: vec![usize::MAX, 2],
                dtype: Some(DType::F32),
            },
            Error::LengthMismatch {
                dims: vec![2, 3],
                expected: 6,
                got: 5,
            },
            Error::OutOfMemory {
                device,
                requested: 10,
                cached: 1,
                in_use: 2,
            },
            Error::CudaNotEnabled { device },
            Error::CudaDriverNotFound { device },
            Error::CudaDeviceNotFound { device, count: 1 },
            Error::DeviceMismatch {
                expected: device,
                found: Device::Cpu,
            },
            Error::ForeignStream { device },
            Error::EmptyArray { device },
            Error::NotHostAccessible { device },
            Error::TraceFile {
                path: "/no/such/dir/trace.json".into(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            },
            Error::TraceActive,
        ]
    }

    #[test]
    fn messages_are_one_lowercase_clause() {
        for err in samples() {
            let msg = err.to_string();
            let first = msg.chars().next().unwrap();
            assert!(!first.is_uppercase(), "{msg}");
            assert!(
                !msg.ends_with('.') && !msg.contains(". ") && !msg.contains("; "),
                "{msg}"
            );
        }
    }

    #[test]
    fn out_of_memory_prints_binary_units_and_bytes() {
        let err = Error::OutOfMemory {
            device: Device::Cpu,
            requested: 3 << 19,
            in_use: 2048,
            cached: 100,
        };
        assert_eq!(
            err.to_string(),
            "out of memory on cpu: 1.5 MiB (1572864 bytes) requested, 2.0 KiB (2048 bytes) in \
             use by live arrays, 100 B held by scopes active on other threads"
        );
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_driver_error_is_the_source_and_not_repeated() {
        use std::error::Error as _;
        let driver =
            cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let err = Error::from(driver);
        assert!(err.source().is_some(), "the driver error is the source");
        // (Formatting the driver error itself asks the driver for its text, so compare whole.)
        assert_eq!(err.to_string(), "CUDA driver call failed");
    }
}

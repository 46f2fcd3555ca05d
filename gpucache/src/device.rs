//! [`Device`]: where an array's memory lives.

use std::fmt;

use crate::Result;

/// A device that arrays can be allocated on.
///
/// `Device::Cpu` (the default) is host memory and works in every build. `Device::Cuda(ordinal)`
/// is a CUDA GPU and needs the `cuda` feature; prefer [`Device::cuda`], which checks that the GPU
/// is there, to naming the variant directly.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory, 64-byte aligned.
    #[default]
    Cpu,
    /// The CUDA GPU with this ordinal (as `cuDeviceGet` numbers them).
    Cuda(usize),
}

impl Device {
    /// The CUDA GPU `ordinal`, after checking that it exists.
    ///
    /// With the `cuda` feature this loads the CUDA driver and creates the device's context on
    /// first use (gpucache keeps one context per device for the life of the process).
    ///
    /// # Errors
    /// [`Error::CudaNotEnabled`](crate::Error::CudaNotEnabled) when gpucache was built without
    /// its `cuda` feature; with it, [`Error::CudaDriverNotFound`](crate::Error::CudaDriverNotFound)
    /// when no CUDA driver can be loaded, [`Error::CudaDeviceNotFound`](crate::Error::CudaDeviceNotFound)
    /// when the driver has no GPU with this ordinal, and `Error::Driver` when creating the
    /// context fails.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        crate::backend::check_device(Device::Cuda(ordinal))?;
        Ok(Device::Cuda(ordinal))
    }

    /// Whether this is host memory.
    pub const fn is_cpu(self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Whether this is a CUDA GPU.
    pub const fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

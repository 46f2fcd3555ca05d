//! [`Device`]: where an array's memory lives.

use std::fmt;

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

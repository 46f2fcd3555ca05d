//! Free-list keys: what an allocation is looked up by, and the hash of it.

use crate::{DType, Device, Shape};

/// The key of a free list.
#[derive(Clone, Debug)]
pub(super) enum Key {
    Exact {
        dtype: DType,
        device: Device,
        shape: Shape,
    },
    Class {
        bytes: usize,
        device: Device,
    },
}

/// A borrowed [`Key`], to look a request up without building a `Shape`.
#[derive(Clone, Copy)]
pub(super) enum KeyRef<'a> {
    Exact {
        dtype: DType,
        device: Device,
        dims: &'a [usize],
    },
    Class {
        bytes: usize,
        device: Device,
    },
}

/// An entry of the key table: a key, its hash (kept for rehashing) and its free list.
pub(super) struct Entry {
    pub(super) hash: u64,
    pub(super) key: Key,
    pub(super) slot: u32,
}

/// Mixes `x` into the running hash `h` (a multiply-fold step, as in foldhash and wyhash).
#[inline]
fn mix(h: u64, x: u64) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let m = u128::from(h ^ x) * u128::from(K);
    (m as u64) ^ ((m >> 64) as u64)
}

impl Key {
    /// The key as recorded events report it.
    pub(super) fn traced(&self) -> crate::trace::record::TraceKey {
        match self {
            Key::Exact { dtype, shape, .. } => crate::trace::record::TraceKey::Exact {
                dtype: *dtype,
                shape: shape.clone(),
            },
            Key::Class { bytes, .. } => crate::trace::record::TraceKey::SizeClass { bytes: *bytes },
        }
    }

    #[inline]
    fn as_ref(&self) -> KeyRef<'_> {
        match self {
            Key::Exact {
                dtype,
                device,
                shape,
            } => KeyRef::Exact {
                dtype: *dtype,
                device: *device,
                dims: shape.dims(),
            },
            Key::Class { bytes, device } => KeyRef::Class {
                bytes: *bytes,
                device: *device,
            },
        }
    }
}

impl KeyRef<'_> {
    /// The key's hash. Written out rather than derived (this is on every allocation): one
    /// multiply-fold per word, the device, element type, rank and kind packed in the first.
    #[inline]
    pub(super) fn hash(self) -> u64 {
        let (device, first, rest): (Device, u64, &[usize]) = match self {
            KeyRef::Exact {
                dtype,
                device,
                dims,
            } => (device, (dtype as u64) << 32 | dims.len() as u64, dims),
            KeyRef::Class { bytes, device } => (device, 1 << 40 | bytes as u64, &[]),
        };
        let device = match device {
            Device::Cpu => 0,
            Device::Cuda(n) => n as u64 + 1,
        };
        let mut h = mix(device, first);
        for &d in rest {
            h = mix(h, d as u64);
        }
        h
    }

    /// Whether `key` is this key.
    #[inline]
    pub(super) fn matches(self, key: &Key) -> bool {
        match (self, key.as_ref()) {
            (
                KeyRef::Exact {
                    dtype: t1,
                    device: d1,
                    dims: s1,
                },
                KeyRef::Exact {
                    dtype: t2,
                    device: d2,
                    dims: s2,
                },
            ) => {
                t1 == t2
                    && d1 == d2
                    && s1.len() == s2.len()
                    && s1.iter().zip(s2).all(|(a, b)| a == b)
            }
            (
                KeyRef::Class {
                    bytes: b1,
                    device: d1,
                },
                KeyRef::Class {
                    bytes: b2,
                    device: d2,
                },
            ) => b1 == b2 && d1 == d2,
            _ => false,
        }
    }

    pub(super) fn to_owned(self) -> Key {
        match self {
            KeyRef::Exact {
                dtype,
                device,
                dims,
            } => Key::Exact {
                dtype,
                device,
                shape: Shape::from(dims),
            },
            KeyRef::Class { bytes, device } => Key::Class { bytes, device },
        }
    }
}

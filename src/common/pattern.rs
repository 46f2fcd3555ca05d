//! Arrays of several element types filled with a pattern unique to each array, so that a buffer
//! handed to two live arrays at once shows up as a broken pattern.

use std::fmt::Debug;

use gpucache::{Array, DType, Device, Element, Shape, f16};

/// An element type with a zero and a pattern value for every (array id, index).
pub trait Pattern: Element + PartialEq + Debug {
    /// The all-zero-bytes value.
    const ZERO: Self;
    /// Element `i` of the pattern of array `id`.
    fn at(id: u64, i: usize) -> Self;
}

/// A well-mixed 64-bit value of (id, i): patterns of two ids differ in most elements.
fn mix(id: u64, i: usize) -> u64 {
    let mut z = id
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    z = (z ^ (z >> 30)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Pattern for f32 {
    const ZERO: f32 = 0.0;
    fn at(id: u64, i: usize) -> f32 {
        // Integers below 2^24 are exact in f32; never zero, so a zeroed buffer is no pattern.
        ((mix(id, i) >> 41) | 1) as f32
    }
}

impl Pattern for u8 {
    const ZERO: u8 = 0;
    fn at(id: u64, i: usize) -> u8 {
        (mix(id, i) >> 56) as u8 | 1
    }
}

impl Pattern for i64 {
    const ZERO: i64 = 0;
    fn at(id: u64, i: usize) -> i64 {
        // Unique per (id, i) for the ids and lengths of the tests.
        ((id << 32) | (i as u64 & 0xffff_ffff)) as i64 | 1 << 62
    }
}

impl Pattern for bool {
    const ZERO: bool = false;
    fn at(id: u64, i: usize) -> bool {
        mix(id, i) & 1 == 1
    }
}

impl Pattern for f16 {
    const ZERO: f16 = f16::ZERO;
    fn at(id: u64, i: usize) -> f16 {
        // Integers up to 2048 are exact in f16.
        f16::from_f32(((mix(id, i) >> 53) | 1) as f32)
    }
}

/// The element types the tests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dt {
    /// `f32`.
    F32,
    /// `u8`.
    U8,
    /// `i64`.
    I64,
    /// `bool`.
    Bool,
    /// `f16`.
    F16,
}

impl Dt {
    /// Every type, for strategies.
    pub const ALL: [Dt; 5] = [Dt::F32, Dt::U8, Dt::I64, Dt::Bool, Dt::F16];

    /// The size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::U8 | Dt::Bool => 1,
            Dt::I64 => 8,
            Dt::F16 => 2,
        }
    }
}

/// Which constructor makes an array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// `Array::zeros`, checked to be zero.
    Zeros,
    /// `Array::empty` (bool arrays checked to be `false`).
    Empty,
    /// `Array::from_slice` with the pattern.
    FromSlice,
}

impl Init {
    /// Every constructor, for strategies.
    pub const ALL: [Init; 3] = [Init::Zeros, Init::Empty, Init::FromSlice];
}

/// An array of one of the [`Dt`] types.
#[derive(Debug)]
pub enum AnyArray {
    /// [`Dt::F32`].
    F32(Array<f32>),
    /// [`Dt::U8`].
    U8(Array<u8>),
    /// [`Dt::I64`].
    I64(Array<i64>),
    /// [`Dt::Bool`].
    Bool(Array<bool>),
    /// [`Dt::F16`].
    F16(Array<f16>),
}

/// Applies `$body` to the array inside an [`AnyArray`], whatever its type.
macro_rules! each {
    ($any:expr, $a:ident => $body:expr) => {
        match $any {
            AnyArray::F32($a) => $body,
            AnyArray::U8($a) => $body,
            AnyArray::I64($a) => $body,
            AnyArray::Bool($a) => $body,
            AnyArray::F16($a) => $body,
        }
    };
}

impl AnyArray {
    /// Allocates an array of `dt` and `shape` on `dev` with `init` and fills it with the pattern
    /// of `id`. Panics if a fresh array's contents break the constructor's contract.
    pub fn new(
        dev: Device,
        dt: Dt,
        shape: impl Into<Shape>,
        init: Init,
        id: u64,
    ) -> gpucache::Result<AnyArray> {
        let shape = shape.into();
        Ok(match dt {
            Dt::F32 => AnyArray::F32(filled_with_pattern(dev, shape, init, id)?),
            Dt::U8 => AnyArray::U8(filled_with_pattern(dev, shape, init, id)?),
            Dt::I64 => AnyArray::I64(filled_with_pattern(dev, shape, init, id)?),
            Dt::Bool => AnyArray::Bool(filled_with_pattern(dev, shape, init, id)?),
            Dt::F16 => AnyArray::F16(filled_with_pattern(dev, shape, init, id)?),
        })
    }

    /// Whether the array still holds the pattern of `id`.
    pub fn holds(&self, id: u64) -> bool {
        each!(self, a => holds_pattern(a, id))
    }

    /// The start address of a host array's elements (`None` when it is empty).
    pub fn addr(&self) -> Option<usize> {
        each!(self, a => {
            let s = a.as_slice().expect("host array");
            (!s.is_empty()).then_some(s.as_ptr() as usize)
        })
    }

    /// The size of the elements in bytes.
    pub fn num_bytes(&self) -> usize {
        each!(self, a => a.num_bytes())
    }
}

/// An array made with `init` and then filled with the pattern of `id`.
pub fn filled_with_pattern<T: Pattern>(
    dev: Device,
    shape: Shape,
    init: Init,
    id: u64,
) -> gpucache::Result<Array<T>> {
    if init == Init::FromSlice {
        let data: Vec<T> = (0..shape.numel()?).map(|i| T::at(id, i)).collect();
        return Array::from_slice(dev, &data, shape);
    }
    let mut a = match init {
        Init::Zeros => Array::<T>::zeros(dev, shape)?,
        _ => Array::<T>::empty(dev, shape)?,
    };
    let s = a.as_mut_slice()?;
    if init == Init::Zeros || T::DTYPE == DType::Bool {
        assert!(
            s.iter().all(|&x| x == T::ZERO),
            "a new {:?} array from {init:?} is not all zero",
            T::DTYPE
        );
    }
    for (i, x) in s.iter_mut().enumerate() {
        *x = T::at(id, i);
    }
    Ok(a)
}

/// Whether `a` holds the pattern of `id`.
pub fn holds_pattern<T: Pattern>(a: &Array<T>, id: u64) -> bool {
    let s = a.as_slice().expect("host array");
    s.iter().enumerate().all(|(i, &x)| x == T::at(id, i))
}

/// Checks that the byte ranges `[start, start + len)` of live buffers are pairwise disjoint;
/// returns the first overlapping pair.
pub fn first_overlap<K: Copy>(ranges: &mut [(usize, usize, K)]) -> Option<(K, K)> {
    ranges.sort_unstable_by_key(|r| r.0);
    ranges
        .windows(2)
        .find(|w| w[0].0 + w[0].1 > w[1].0)
        .map(|w| (w[0].2, w[1].2))
}

//! [`DType`] and [`Element`]: the element types an [`Array`](crate::Array) can hold.

use std::fmt;

use half::{bf16, f16};

/// The element type of an array, as a value.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// `bool`, one byte, 0 or 1.
    Bool,
    /// `u8`.
    U8,
    /// `i8`.
    I8,
    /// `u16`.
    U16,
    /// `i16`.
    I16,
    /// IEEE half precision, [`half::f16`].
    F16,
    /// bfloat16, [`half::bf16`].
    BF16,
    /// `u32`.
    U32,
    /// `i32`.
    I32,
    /// `f32`.
    F32,
    /// `u64`.
    U64,
    /// `i64`.
    I64,
    /// `f64`.
    F64,
}

impl DType {
    /// The size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// The short lowercase name (`"f32"`, `"bf16"`, `"bool"`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::F32 => "f32",
            DType::U64 => "u64",
            DType::I64 => "i64",
            DType::F64 => "f64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can be the element of an [`Array`](crate::Array).
///
/// Implemented for `bool`, the integer types of 8 to 64 bits, `f32`, `f64`, [`half::f16`] and
/// [`half::bf16`]. The trait is sealed: the cache hands the same bytes to arrays of different
/// types (see [`KeyPolicy::SizeClass`](crate::KeyPolicy::SizeClass)), which is only sound for
/// plain types without padding.
pub trait Element: sealed::Sealed + Copy + Send + Sync + fmt::Debug + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Whether every bit pattern of `size_of::<Self>()` bytes is a valid value. Arrays of types
    /// for which it is false (`bool`) are always zeroed, never handed out with recycled bytes.
    #[doc(hidden)]
    const ANY_BIT_PATTERN: bool = true;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, f16 => F16, bf16 => BF16,
    u32 => U32, i32 => I32, f32 => F32, u64 => U64, i64 => I64, f64 => F64,
);

impl sealed::Sealed for bool {}
impl Element for bool {
    const DTYPE: DType = DType::Bool;
    const ANY_BIT_PATTERN: bool = false;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size_matches<T: Element>() {
        assert_eq!(
            T::DTYPE.size_in_bytes(),
            std::mem::size_of::<T>(),
            "{}",
            T::DTYPE
        );
    }

    #[test]
    fn sizes_match_rust_types() {
        size_matches::<bool>();
        size_matches::<u8>();
        size_matches::<i8>();
        size_matches::<u16>();
        size_matches::<i16>();
        size_matches::<f16>();
        size_matches::<bf16>();
        size_matches::<u32>();
        size_matches::<i32>();
        size_matches::<f32>();
        size_matches::<u64>();
        size_matches::<i64>();
        size_matches::<f64>();
    }
}

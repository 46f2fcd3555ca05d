//! [`Shape`]: the dimensions of an array, stored inline up to rank 4, with checked products.

use std::fmt;

use smallvec::SmallVec;

use crate::{DType, Error, Result};

/// The dimensions of an n-d array.
///
/// Up to four dimensions are stored inline (no heap allocation). A shape of rank 0 is a scalar
/// holding one element; a shape with a zero dimension holds none, whatever its other dimensions
/// (`[usize::MAX, 2, 0]` is empty, as `[0, usize::MAX, 2]` is). Products are checked: a shape
/// whose size overflows (with no zero dimension) is reported as [`Error::ShapeOverflow`] when an
/// array is made from it, never a panic.
///
/// ```
/// use gpucache::Shape;
/// let s = Shape::from([2, 3, 4]);
/// assert_eq!(s.dims(), &[2, 3, 4]);
/// assert_eq!(s.numel().unwrap(), 24);
/// assert_eq!(Shape::from(7).dims(), &[7]);
/// assert!(Shape::from([usize::MAX, 2]).numel().is_err());
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    dims: SmallVec<[usize; INLINE]>,
}

/// The largest array in bytes: `isize::MAX` (the most one Rust allocation may hold) rounded down
/// to 64 bytes, so that an allocation of it can be described at the host backend's alignment
/// (which checks, at compile time, that it divides 64).
pub(crate) const MAX_BYTES: usize = (isize::MAX as usize) & !63;

/// Dimensions stored without a heap allocation.
const INLINE: usize = 4;

impl Shape {
    /// The shape of a scalar: rank 0, one element.
    pub fn scalar() -> Shape {
        Shape::default()
    }

    /// The dimensions, outermost first.
    #[inline]
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The number of elements: the product of the dimensions (1 for a scalar).
    ///
    /// # Errors
    /// [`Error::ShapeOverflow`] (with no element type) when the product does not fit in
    /// `usize` (never for a shape with a zero dimension: it has no elements).
    pub fn numel(&self) -> Result<usize> {
        self.checked_numel().ok_or_else(|| self.overflow(None))
    }

    /// The size in bytes of an array of this shape and `dtype`, checked against [`MAX_BYTES`].
    #[inline]
    pub(crate) fn byte_len(&self, dtype: DType) -> Result<usize> {
        // `n * size <= MAX_BYTES` exactly when `n <= MAX_BYTES / size`: with the element type
        // known where this is inlined, one comparison with a constant, and the product cannot
        // overflow.
        let size = dtype.size_in_bytes();
        match self.product() {
            Some(n) if n <= MAX_BYTES / size => Ok(n * size),
            // Out of line: the product overflowed or is too large (or a zero dimension came
            // after the overflow), so the allocation path above stays as short as it can be.
            _ => self.byte_len_slow(dtype),
        }
    }

    #[cold]
    #[inline(never)]
    fn byte_len_slow(&self, dtype: DType) -> Result<usize> {
        let size = dtype.size_in_bytes();
        self.checked_numel()
            .filter(|&n| n <= MAX_BYTES / size)
            .map(|n| n * size)
            .ok_or_else(|| self.overflow(Some(dtype)))
    }

    /// The product of the dimensions in order, or `None` when it overflows on the way.
    #[inline(always)]
    fn product(&self) -> Option<usize> {
        self.dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// The product of the dimensions, or `None` when it overflows; 0 whenever a dimension is,
    /// whatever the order (the zero is looked for only after an overflow).
    fn checked_numel(&self) -> Option<usize> {
        self.product()
            .or_else(|| self.dims.contains(&0).then_some(0))
    }

    fn overflow(&self, dtype: Option<DType>) -> Error {
        Error::ShapeOverflow {
            dims: self.dims.to_vec(),
            dtype,
        }
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    #[inline]
    fn from(dims: [usize; N]) -> Shape {
        if N <= INLINE {
            // Fill the inline buffer directly: no length checks, no copy loop.
            let mut buf = [0; INLINE];
            buf[..N].copy_from_slice(&dims);
            Shape {
                dims: SmallVec::from_buf_and_len(buf, N),
            }
        } else {
            Shape {
                dims: SmallVec::from_slice(&dims),
            }
        }
    }
}

impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(dims: &[usize; N]) -> Shape {
        Shape::from(&dims[..])
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Shape {
        Shape {
            dims: SmallVec::from_slice(dims),
        }
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Shape {
        Shape {
            dims: SmallVec::from_vec(dims),
        }
    }
}

impl From<usize> for Shape {
    #[inline]
    fn from(len: usize) -> Shape {
        Shape::from([len])
    }
}

impl From<&Shape> for Shape {
    fn from(shape: &Shape) -> Shape {
        shape.clone()
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.dims.iter()).finish()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_has_one_element_and_zero_dims_none() {
        assert_eq!(Shape::scalar().numel().unwrap(), 1);
        assert_eq!(Shape::from([3, 0, 5]).numel().unwrap(), 0);
    }

    #[test]
    fn byte_len_is_checked_against_the_largest_allocation() {
        let half = (isize::MAX as usize) / 2 + 1;
        assert!(Shape::from(half).byte_len(DType::U8).is_ok());
        assert!(matches!(
            Shape::from(half).byte_len(DType::U16),
            Err(Error::ShapeOverflow {
                dtype: Some(DType::U16),
                ..
            })
        ));
        assert_eq!(
            Shape::from(MAX_BYTES).byte_len(DType::U8).unwrap(),
            MAX_BYTES
        );
        for bytes in [MAX_BYTES + 1, isize::MAX as usize] {
            assert!(matches!(
                Shape::from(bytes).byte_len(DType::U8),
                Err(Error::ShapeOverflow {
                    dtype: Some(DType::U8),
                    ..
                })
            ));
        }
        assert!(matches!(
            Shape::from([usize::MAX, 2]).numel(),
            Err(Error::ShapeOverflow { dtype: None, .. })
        ));
    }

    #[test]
    fn a_zero_dimension_makes_a_shape_empty_whatever_the_order() {
        for dims in [[usize::MAX, 2, 0], [0, usize::MAX, 2], [usize::MAX, 0, 2]] {
            let s = Shape::from(dims);
            assert_eq!(s.numel().unwrap(), 0, "{s}");
            assert_eq!(s.byte_len(DType::F64).unwrap(), 0, "{s}");
        }
        assert!(Shape::from([usize::MAX, 2, 1]).numel().is_err());
    }

    #[test]
    fn conversions_agree() {
        let a = Shape::from([2usize, 3]);
        assert_eq!(a, Shape::from(&[2usize, 3][..]));
        assert_eq!(a, Shape::from(vec![2, 3]));
        assert_eq!(a, Shape::from(&[2usize, 3]));
        assert_eq!(format!("{a}"), "[2, 3]");
        let big = Shape::from([1usize, 2, 3, 4, 5, 6]);
        assert_eq!(big.rank(), 6);
        assert_eq!(big.numel().unwrap(), 720);
    }
}

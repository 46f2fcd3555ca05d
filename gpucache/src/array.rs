//! [`Array`]: an owned n-d buffer on a device, allocated through the current scope's cache.

use std::fmt;
use std::marker::PhantomData;
use std::mem;
use std::slice;

use crate::alloc::{self, Init};
use crate::backend::Block;
use crate::cache::{Got, Home, Request};
use crate::{DType, Device, Element, Error, Result, Shape};

/// An owned n-d array of `T` on a [`Device`].
///
/// Inside a scope (see [`enter`](crate::enter)) its buffer comes from, and goes back to, the
/// scope's cache; outside any scope it is allocated from the device and freed when it drops.
/// Dropping an array returns its buffer to the cache it came from, from whichever thread drops
/// it, and a buffer is never handed to a second array while the first is alive.
///
/// Zero-size arrays own no memory and never touch a cache.
///
/// ```
/// use gpucache::{Array, Device};
/// let mut a = Array::<f32>::zeros(Device::Cpu, [2, 3])?;
/// a.as_mut_slice()?[4] = 7.0;
/// assert_eq!(a.to_vec()?, [0.0, 0.0, 0.0, 0.0, 7.0, 0.0]);
/// let b = Array::from_slice(Device::Cpu, &[1u8, 2, 3], 3)?;
/// assert_eq!((b.len(), b.num_bytes(), b.shape().dims()), (3, 3, &[3][..]));
/// # Ok::<(), gpucache::Error>(())
/// ```
pub struct Array<T: Element> {
    /// `None` for zero-size arrays.
    block: Option<Block>,
    /// `None` when not allocated through a cache.
    home: Option<Home>,
    shape: Shape,
    device: Device,
    _elem: PhantomData<T>,
}

impl<T: Element> Array<T> {
    /// An array of `shape` on `device`, every element zero.
    ///
    /// # Errors
    /// [`Error::ShapeOverflow`] when the shape's size overflows, [`Error::OutOfMemory`] when the
    /// device has no room even after releasing cached buffers, and the device's own errors.
    pub fn zeros(device: Device, shape: impl Into<Shape>) -> Result<Self> {
        Self::alloc(device, shape.into(), Init::Zeroed)
    }

    /// An array of `shape` on `device` whose contents are unspecified but initialised: a
    /// recycled buffer keeps what its last array left in it; a new host buffer is zeroed, a new
    /// device buffer holds what the device gives (as `torch.empty`: memory the process may have
    /// used before, never memset). Never undefined behaviour to read: host memory is always
    /// initialised, device memory is read only by copies, and `bool` arrays, for which not
    /// every byte is valid, are always zeroed.
    ///
    /// # Errors
    /// As [`Array::zeros`].
    pub fn empty(device: Device, shape: impl Into<Shape>) -> Result<Self> {
        Self::alloc(device, shape.into(), Init::Any)
    }

    /// An array of `shape` on `device` holding a copy of `data` (in row-major order).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `data.len()` is not the shape's number of elements, and
    /// the errors of [`Array::zeros`].
    pub fn from_slice(device: Device, data: &[T], shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        // The byte size first, so that an overflow names the element type.
        let expected = shape.byte_len(T::DTYPE)? / mem::size_of::<T>();
        if expected != data.len() {
            return Err(Error::LengthMismatch {
                dims: shape.dims().to_vec(),
                expected,
                got: data.len(),
            });
        }
        let mut array = Self::alloc(device, shape, Init::Overwritten)?;
        if let Some(block) = &mut array.block {
            block.write(as_bytes(data))?;
        }
        Ok(array)
    }

    /// Allocates through the current scope's cache, or the device outside any scope (see the
    /// `alloc` module). The hit is the inlined fast path; everything else is out of line.
    #[inline]
    fn alloc(device: Device, shape: Shape, init: Init) -> Result<Self> {
        let bytes = shape.byte_len(T::DTYPE)?;
        let zero = init.must_zero(T::ANY_BIT_PATTERN);
        if bytes != 0
            && let Some((block, home)) = alloc::hit(&Self::request(&shape, device, bytes))
        {
            return Self::recycled(block, home, shape, device, bytes, zero);
        }
        Self::alloc_slow(device, shape, bytes, zero)
    }

    /// What an allocation of `bytes` bytes of `shape` on `device` asks a cache for.
    #[inline(always)]
    fn request(shape: &Shape, device: Device, bytes: usize) -> Request<'_> {
        Request {
            dtype: T::DTYPE,
            shape,
            device,
            bytes,
        }
    }

    /// The allocation when the hit path found nothing.
    #[inline(never)]
    fn alloc_slow(device: Device, shape: Shape, bytes: usize, zero: bool) -> Result<Self> {
        let req = Self::request(&shape, device, bytes);
        match alloc::alloc_slow(&req, zero)? {
            Some(Got::Recycled(block, home)) => {
                Self::recycled(block, home, shape, device, bytes, zero)
            }
            Some(Got::Fresh(block, home)) => Ok(Self::assemble(Some(block), home, shape, device)),
            None => Ok(Self::assemble(None, None, shape, device)),
        }
    }

    /// An array around a recycled buffer, made ready for it (zeroed if asked).
    #[inline]
    fn recycled(
        block: Block,
        home: Home,
        shape: Shape,
        device: Device,
        bytes: usize,
        zero: bool,
    ) -> Result<Self> {
        let mut array = Self::assemble(Some(block), Some(home), shape, device);
        if let Some(block) = &mut array.block {
            // On failure `array` drops and the buffer goes home.
            block.prepare_reuse()?;
            if zero {
                block.zero(bytes)?;
            }
        }
        Ok(array)
    }

    #[inline]
    fn assemble(block: Option<Block>, home: Option<Home>, shape: Shape, device: Device) -> Self {
        Array {
            block,
            home,
            shape,
            device,
            _elem: PhantomData,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        // The product was checked when the array was made.
        self.shape.dims().iter().product()
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }

    /// The device the array lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The size of the elements in bytes (`len() * size_of::<T>()`; the buffer may be larger
    /// under [`KeyPolicy::SizeClass`](crate::KeyPolicy::SizeClass)).
    pub fn num_bytes(&self) -> usize {
        self.len() * mem::size_of::<T>()
    }

    /// The elements, for an array in host memory.
    ///
    /// # Errors
    /// [`Error::NotHostAccessible`] for an array in device memory.
    pub fn as_slice(&self) -> Result<&[T]> {
        let Some(block) = &self.block else {
            return Ok(&[]);
        };
        let host = block.host().ok_or(self.not_host())?;
        // SAFETY: the buffer is host memory aligned to 64 bytes (>= align_of::<T>()), holds at
        // least `len * size_of::<T>()` bytes, is initialised (zeroed when allocated, then only
        // written with whole `Element` values; types that not every bit pattern is valid for
        // are zeroed or overwritten on every hand-out) and is owned by this array, so the
        // borrow of `self` keeps it alive and unaliased by writers.
        Ok(unsafe { slice::from_raw_parts(host.ptr().as_ptr().cast::<T>(), self.len()) })
    }

    /// The elements, mutable, for an array in host memory.
    ///
    /// # Errors
    /// [`Error::NotHostAccessible`] for an array in device memory.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        let not_host = self.not_host();
        let len = self.len();
        let Some(block) = &mut self.block else {
            return Ok(&mut []);
        };
        let host = block.host().ok_or(not_host)?;
        // SAFETY: as in `as_slice`; the exclusive borrow of `self` makes this the only access.
        Ok(unsafe { slice::from_raw_parts_mut(host.ptr().as_ptr().cast::<T>(), len) })
    }

    /// A copy of the elements in a `Vec`.
    ///
    /// For an array in device memory this copies the bytes to the host (on CUDA: on the
    /// thread's current stream, ordered after the array's stream, and waits for the copy).
    /// `bool` elements are read as bytes, and any nonzero byte is `true` (a kernel may have
    /// written any value).
    ///
    /// # Errors
    /// The device's errors while copying.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let Some(block) = &self.block else {
            return Ok(Vec::new());
        };
        if block.host().is_some() {
            return Ok(self.as_slice()?.to_vec());
        }
        let mut bytes = vec![0u8; self.num_bytes()];
        block.read(&mut bytes)?;
        Ok(from_bytes(bytes))
    }

    /// The array's block (`None` for zero-size arrays).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn block(&self) -> Option<&Block> {
        self.block.as_ref()
    }

    /// The array's block, mutable (`None` for zero-size arrays).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn block_mut(&mut self) -> Option<&mut Block> {
        self.block.as_mut()
    }

    fn not_host(&self) -> Error {
        Error::NotHostAccessible {
            device: self.device,
        }
    }
}

impl<T: Element> Drop for Array<T> {
    fn drop(&mut self) {
        alloc::release_from(&mut self.block, &mut self.home);
    }
}

// Unwind safety. The compiler does not derive `UnwindSafe` / `RefUnwindSafe` for `Array`: its
// `Block` holds an `Arc<dyn Backend>` and its `Home` a pointer to its cache (a `CacheCell`, with
// interior mutability). What a panic caught by `catch_unwind` could leave behind:
// * the array's own fields (block, home, shape, device) are set when it is made and only taken
//   by `drop`; no method leaves them half-changed, and `&Array` changes nothing;
// * its elements may be partly written by the caller's code, which is the caller's data, as
//   with a `Vec<T>` (which is `UnwindSafe`); every bit pattern of an `Element` is valid, and
//   `bool` arrays are written only through `&mut [bool]`;
// * the cache and the backend are shared with other arrays and threads, and already kept
//   consistent across panics: library code returns errors instead of panicking, their state
//   sits behind locks and atomics that are never left half-updated, and scopes are exited by
//   their guards' `Drop` during unwinding.
// So an `Array`, or a reference to one, observed after a caught panic is in a valid state.
impl<T: Element> std::panic::UnwindSafe for Array<T> {}
impl<T: Element> std::panic::RefUnwindSafe for Array<T> {}

impl<T: Element> fmt::Debug for Array<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Array")
            .field("dtype", &T::DTYPE)
            .field("shape", &self.shape)
            .field("device", &self.device)
            .field("cached", &self.home.is_some())
            .finish()
    }
}

/// The bytes of a slice of elements.
fn as_bytes<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: `Element` types are plain values without padding, so every byte of an initialised
    // `[T]` is an initialised `u8`; the length is the slice's size in bytes and the lifetime is
    // the input's.
    unsafe { slice::from_raw_parts(data.as_ptr().cast::<u8>(), mem::size_of_val(data)) }
}

/// Elements from their bytes, as a device copied them out. Bytes of `bool` elements are read as
/// `byte != 0`.
fn from_bytes<T: Element>(mut bytes: Vec<u8>) -> Vec<T> {
    // Every `Element` is valid for any bit pattern except `bool`, a one-byte type.
    const { assert!(T::ANY_BIT_PATTERN || mem::size_of::<T>() == 1) };
    if !T::ANY_BIT_PATTERN {
        for b in &mut bytes {
            *b = u8::from(*b != 0);
        }
    }
    let len = bytes.len() / mem::size_of::<T>();
    let mut out = Vec::<T>::with_capacity(len);
    // SAFETY: `out` has room for `len` elements, that is `bytes.len()` bytes (a whole number of
    // elements: the caller copied `len * size_of::<T>()` bytes), which cannot overlap `bytes`.
    // Every byte pattern is a valid `T` for `ANY_BIT_PATTERN` types, and the only other type
    // (`bool`, one byte, asserted above) got 0 or 1 in each byte. So all `len` elements are
    // initialised and valid before `set_len`.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), bytes.len());
        out.set_len(len);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arrays are moved on every allocation (`Result<Array<T>>`): keep them within two cache
    /// lines so the moves stay a few vector stores.
    #[test]
    fn arrays_stay_small() {
        assert!(
            mem::size_of::<Array<f32>>() <= 128,
            "{}",
            mem::size_of::<Array<f32>>()
        );
        assert_eq!(mem::size_of::<Option<Home>>(), 16);
    }
}

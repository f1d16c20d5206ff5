//! Element types, borrowed tensor views and owned tensors.
//!
//! A [`TensorRef`] borrows a caller's buffer with a shape and element strides; the last dimension must
//! be contiguous (stride 1), the others may be anything, so views into larger buffers work without a
//! copy. Nothing here validates: `crate::params` checks every view once, at the boundary, and the
//! kernels trust what it accepted. Owned [`Tensor`]s (what the library returns) are always contiguous,
//! row-major.

use half::{bf16, f16};
use std::fmt;

pub use crate::dtype::DType;

/// Evaluates `$body` with the type alias `$T` bound to the element type of `$dtype` (a [`DType`]):
/// the one place that turns a run-time dtype into a generic instantiation.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::tensor::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::tensor::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::tensor::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type: f32, f16 or bf16.
pub trait Element:
    Copy + Send + Sync + Default + PartialEq + fmt::Debug + sealed::Sealed + 'static
{
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    /// Round to nearest even.
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
    /// Round to nearest even, directly from f64 (no double rounding through f32).
    fn from_f64(x: f64) -> Self;
    fn wrap(data: &[Self]) -> Slice<'_>;
    fn unwrap(data: Slice<'_>) -> Option<&[Self]>;
    fn wrap_vec(data: Vec<Self>) -> Buffer;
    /// The mutable twin of [`Element::wrap`].
    fn wrap_mut(data: &mut [Self]) -> SliceMut<'_>;
    /// Widens `src` into `dst` (same length): F16C/NEON for f16 where `half` has it, a
    /// vectorised loop for bf16.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` into `dst` (same length).
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn wrap(data: &[Self]) -> Slice<'_> {
        Slice::F32(data)
    }
    fn unwrap(data: Slice<'_>) -> Option<&[Self]> {
        match data {
            Slice::F32(d) => Some(d),
            _ => None,
        }
    }
    fn wrap_vec(data: Vec<Self>) -> Buffer {
        Buffer::F32(data)
    }
    fn wrap_mut(data: &mut [Self]) -> SliceMut<'_> {
        SliceMut::F32(data)
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
}

macro_rules! half_element {
    ($t:ty, $variant:ident, $widen:path, $narrow:path) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            #[inline(always)]
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }
            fn wrap(data: &[Self]) -> Slice<'_> {
                Slice::$variant(data)
            }
            fn unwrap(data: Slice<'_>) -> Option<&[Self]> {
                match data {
                    Slice::$variant(d) => Some(d),
                    _ => None,
                }
            }
            fn wrap_vec(data: Vec<Self>) -> Buffer {
                Buffer::$variant(data)
            }
            fn wrap_mut(data: &mut [Self]) -> SliceMut<'_> {
                SliceMut::$variant(data)
            }
            #[inline]
            fn widen(src: &[Self], dst: &mut [f32]) {
                $widen(src, dst)
            }
            #[inline]
            fn narrow(src: &[f32], dst: &mut [Self]) {
                $narrow(src, dst)
            }
        }
    };
}
half_element!(
    f16,
    F16,
    crate::convert::widen_f16,
    crate::convert::narrow_f16
);
half_element!(
    bf16,
    BF16,
    crate::convert::widen_bf16,
    crate::convert::narrow_bf16
);

/// A borrowed buffer of one of the element types.
#[derive(Clone, Copy, Debug)]
pub enum Slice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Slice<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            Slice::F32(_) => DType::F32,
            Slice::F16(_) => DType::F16,
            Slice::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Slice::F32(d) => d.len(),
            Slice::F16(d) => d.len(),
            Slice::BF16(d) => d.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What validation needs to know about a view, wherever its buffer lives (host memory, or a CUDA
/// device for [`crate::cuda`]): [`crate::params`] checks any implementor the same way.
pub(crate) trait ViewDesc {
    fn dtype(&self) -> DType;
    fn shape(&self) -> &[usize];
    fn strides(&self) -> &[usize];
    /// Elements in the underlying buffer.
    fn buffer_len(&self) -> usize;
}

/// A view's description alone, with the dtype validation is to see: how one validation covers a
/// call whose tensors are of different kinds (FP8 caches beside a bf16 q).
#[derive(Clone, Debug)]
pub(crate) struct ViewInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub len: usize,
}

impl ViewInfo {
    /// `v` as it is.
    pub fn of<V: ViewDesc + ?Sized>(v: &V) -> Self {
        Self::with_dtype(v, v.dtype())
    }
    /// `v`, seen as holding `dtype`.
    pub fn with_dtype<V: ViewDesc + ?Sized>(v: &V, dtype: DType) -> Self {
        ViewInfo {
            dtype,
            shape: v.shape().to_vec(),
            strides: v.strides().to_vec(),
            len: v.buffer_len(),
        }
    }
}

impl ViewDesc for ViewInfo {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn strides(&self) -> &[usize] {
        &self.strides
    }
    fn buffer_len(&self) -> usize {
        self.len
    }
}

impl ViewDesc for TensorRef<'_> {
    fn dtype(&self) -> DType {
        TensorRef::dtype(self)
    }
    fn shape(&self) -> &[usize] {
        TensorRef::shape(self)
    }
    fn strides(&self) -> &[usize] {
        TensorRef::strides(self)
    }
    fn buffer_len(&self) -> usize {
        self.data.len()
    }
}

/// A strided view of a caller's buffer. Strides are in elements.
#[derive(Clone, Debug)]
pub struct TensorRef<'a> {
    data: Slice<'a>,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<'a> TensorRef<'a> {
    /// A view with explicit strides (in elements). Checked when passed to an attention call.
    pub fn new<T: Element>(data: &'a [T], shape: &[usize], strides: &[usize]) -> Self {
        Self::from_slice(T::wrap(data), shape, strides)
    }

    /// A contiguous row-major view.
    pub fn contiguous<T: Element>(data: &'a [T], shape: &[usize]) -> Self {
        Self::new(data, shape, &contiguous_strides(shape))
    }

    pub fn from_slice(data: Slice<'a>, shape: &[usize], strides: &[usize]) -> Self {
        TensorRef {
            data,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn data(&self) -> Slice<'a> {
        self.data
    }
    /// The buffer as `&[T]`, if `T` is its element type.
    pub fn typed<T: Element>(&self) -> Option<&'a [T]> {
        T::unwrap(self.data)
    }

    /// The view with dimension `dim` fixed at `index`, one dimension fewer (PyTorch's
    /// `x.select(dim, index)`); it borrows the same buffer from element `index · strides[dim]` on.
    /// This is how flash-attn's packed layouts are passed: q, k and v of `qkv` `[batch, seqlen, 3,
    /// heads, head_dim]` (`flash_attn_qkvpacked_func`) are `qkv.select(2, 0)`, `select(2, 1)` and
    /// `select(2, 2)`; k and v of `kv` `[batch, seqlen_k, 2, heads_kv, head_dim]`
    /// (`flash_attn_kvpacked_func`) `kv.select(2, 0)` and `select(2, 1)`; with packed sequences
    /// (`[total, 3, heads, head_dim]`) the dimension is 1.
    ///
    /// ```
    /// use flashattn::{flash_attn, AttnOptions, TensorRef};
    /// let (b, s, h, d) = (1, 16, 2, 8);
    /// let qkv: Vec<f32> = (0..b * s * 3 * h * d).map(|i| (i as f32 * 0.1).sin()).collect();
    /// let qkv = TensorRef::contiguous(&qkv, &[b, s, 3, h, d]);
    /// let (q, k, v) = (qkv.select(2, 0)?, qkv.select(2, 1)?, qkv.select(2, 2)?);
    /// assert_eq!(q.shape(), &[b, s, h, d]);
    /// let out = flash_attn(&q, &k, &v, &AttnOptions::default().causal(true))?.out;
    /// assert_eq!(out.shape(), &[b, s, h, d]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn select(&self, dim: usize, index: usize) -> crate::Result<TensorRef<'a>> {
        let offset = (dim < self.shape.len().min(self.strides.len()) && index < self.shape[dim])
            .then(|| index.checked_mul(self.strides[dim]))
            .flatten()
            .filter(|&o| o <= self.data.len());
        let Some(offset) = offset else {
            return Err(crate::ErrorKind::Select {
                dim,
                index,
                shape: self.shape.clone(),
                strides: self.strides.clone(),
                len: self.data.len(),
            }
            .into());
        };
        let data = match self.data {
            Slice::F32(d) => Slice::F32(&d[offset..]),
            Slice::F16(d) => Slice::F16(&d[offset..]),
            Slice::BF16(d) => Slice::BF16(&d[offset..]),
        };
        let drop_dim = |v: &[usize]| -> Vec<usize> {
            v.iter()
                .enumerate()
                .filter(|&(i, _)| i != dim)
                .map(|(_, &x)| x)
                .collect()
        };
        Ok(TensorRef {
            data,
            shape: drop_dim(&self.shape),
            strides: drop_dim(&self.strides),
        })
    }
}

/// Row-major strides for `shape`. Saturating: a shape too large to address gets strides that the
/// bounds check then rejects, instead of wrapping around.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// An owned buffer of one of the element types.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Buffer {
    pub fn dtype(&self) -> DType {
        self.as_slice().dtype()
    }
    pub fn as_slice(&self) -> Slice<'_> {
        match self {
            Buffer::F32(d) => Slice::F32(d),
            Buffer::F16(d) => Slice::F16(d),
            Buffer::BF16(d) => Slice::BF16(d),
        }
    }
}

/// An owned, contiguous, row-major tensor (what flashattn returns).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    data: Buffer,
    shape: Vec<usize>,
}

impl Tensor {
    /// Wraps `data`; `None` if its length is not the product of `shape`.
    pub fn from_buffer(data: Buffer, shape: &[usize]) -> Option<Self> {
        let n: usize = shape.iter().product();
        (data.as_slice().len() == n).then(|| Tensor {
            data,
            shape: shape.to_vec(),
        })
    }
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Option<Self> {
        Self::from_buffer(T::wrap_vec(data), shape)
    }
    pub(crate) fn new_unchecked(data: Buffer, shape: Vec<usize>) -> Self {
        debug_assert_eq!(data.as_slice().len(), shape.iter().product::<usize>());
        Tensor { data, shape }
    }
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn buffer(&self) -> &Buffer {
        &self.data
    }
    pub fn into_buffer(self) -> Buffer {
        self.data
    }
    /// The elements as `&[T]`, if `T` is the element type.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::unwrap(self.data.as_slice())
    }
    /// A view of the whole tensor.
    pub fn view(&self) -> TensorRef<'_> {
        TensorRef::from_slice(
            self.data.as_slice(),
            &self.shape,
            &contiguous_strides(&self.shape),
        )
    }
    /// The elements widened to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            Buffer::F32(d) => d.clone(),
            Buffer::F16(d) => d.iter().map(|x| x.to_f32()).collect(),
            Buffer::BF16(d) => d.iter().map(|x| x.to_f32()).collect(),
        }
    }
    /// The elements widened to f64.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Buffer::F32(d) => d.iter().map(|&x| x as f64).collect(),
            Buffer::F16(d) => d.iter().map(|x| x.to_f64()).collect(),
            Buffer::BF16(d) => d.iter().map(|x| x.to_f64()).collect(),
        }
    }
}

/// A mutable borrowed buffer of one of the element types (the caches that a call appends to).
#[derive(Debug)]
pub enum SliceMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
}

impl<'a> From<&'a mut [f32]> for SliceMut<'a> {
    fn from(d: &'a mut [f32]) -> Self {
        SliceMut::F32(d)
    }
}
impl<'a> From<&'a mut [f16]> for SliceMut<'a> {
    fn from(d: &'a mut [f16]) -> Self {
        SliceMut::F16(d)
    }
}
impl<'a> From<&'a mut [bf16]> for SliceMut<'a> {
    fn from(d: &'a mut [bf16]) -> Self {
        SliceMut::BF16(d)
    }
}

impl SliceMut<'_> {
    /// A shared view of the same elements.
    pub fn as_slice(&self) -> Slice<'_> {
        match self {
            SliceMut::F32(d) => Slice::F32(d),
            SliceMut::F16(d) => Slice::F16(d),
            SliceMut::BF16(d) => Slice::BF16(d),
        }
    }
    pub fn dtype(&self) -> DType {
        self.as_slice().dtype()
    }
}

/// A strided, mutable view of a caller's buffer (strides in elements, last dimension contiguous):
/// how `k_cache` and `v_cache` are passed, since a call with new keys writes them in place.
#[derive(Debug)]
pub struct TensorMut<'a> {
    pub(crate) data: SliceMut<'a>,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<'a> TensorMut<'a> {
    /// A view with explicit strides (checked when passed to a call).
    pub fn new(data: impl Into<SliceMut<'a>>, shape: &[usize], strides: &[usize]) -> Self {
        TensorMut {
            data: data.into(),
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }
    /// A contiguous row-major view.
    pub fn contiguous(data: impl Into<SliceMut<'a>>, shape: &[usize]) -> Self {
        Self::new(data, shape, &contiguous_strides(shape))
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    /// A read-only view of the same tensor.
    pub fn view(&self) -> TensorRef<'_> {
        TensorRef::from_slice(self.data.as_slice(), &self.shape, &self.strides)
    }
}

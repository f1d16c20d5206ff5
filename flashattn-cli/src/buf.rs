//! Owned host buffers: allocations that fail with a message naming the tensor instead of
//! aborting, KV-cache buffers on a 2 MiB boundary, FP8 buffers, and contiguous views.

use crate::error::{fail, Result};
use flashattn::decode::SliceMut;
use flashattn::fp8::{self, Fp8Format, Fp8TensorRef, F8E4M3, F8E5M2};
use flashattn::memory::CacheBuf;
use flashattn::tensor::Slice;
use flashattn::{Buffer, TensorRef};
use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// The elements of `shape`, or an error where they pass `usize`.
pub fn numel(shape: &[usize]) -> Result<usize> {
    match shape.iter().try_fold(1usize, |n, &x| n.checked_mul(x)) {
        Some(n) => Ok(n),
        None => fail(format!(
            "shape {shape:?} has more elements than fit in memory"
        )),
    }
}

/// The values of `x` in a `Vec`, or an error naming `what` where the allocator refuses them: a
/// benchmark asked for a shape larger than the machine fails with a message, not an abort.
pub fn try_vec<T>(what: &str, x: impl ExactSizeIterator<Item = T>) -> Result<Vec<T>> {
    let mut v = Vec::new();
    let n = x.len();
    if v.try_reserve_exact(n).is_err() {
        let bytes = n.saturating_mul(std::mem::size_of::<T>());
        return fail(format!(
            "out of memory: {bytes} bytes for {what} could not be allocated (choose a smaller shape)"
        ));
    }
    v.extend(x);
    Ok(v)
}

/// The values of `x` in a buffer for a KV cache ([`flashattn::memory::CacheBuf`]: on a 2 MiB
/// boundary), advised for transparent huge pages before its first write when `huge`; an error
/// naming `what` where the machine cannot hold them.
pub fn cache_vec<T: Copy>(
    what: &'static str,
    huge: bool,
    x: impl ExactSizeIterator<Item = T>,
) -> Result<CacheBuf<T>> {
    Ok(CacheBuf::try_from_iter_advised(what, x, huge)?)
}

/// A KV cache of the benchmarks in its dtype (see [`cache_vec`]).
pub enum CacheBuffer {
    F32(CacheBuf<f32>),
    F16(CacheBuf<f16>),
    BF16(CacheBuf<bf16>),
}

impl CacheBuffer {
    /// An empty buffer (a placeholder where the caches are FP8).
    pub fn empty() -> Self {
        CacheBuffer::BF16(CacheBuf::default())
    }
    pub fn as_slice(&self) -> Slice<'_> {
        match self {
            CacheBuffer::F32(d) => Slice::F32(d),
            CacheBuffer::F16(d) => Slice::F16(d),
            CacheBuffer::BF16(d) => Slice::BF16(d),
        }
    }
    pub fn slice_mut(&mut self) -> SliceMut<'_> {
        match self {
            CacheBuffer::F32(d) => SliceMut::F32(d),
            CacheBuffer::F16(d) => SliceMut::F16(d),
            CacheBuffer::BF16(d) => SliceMut::BF16(d),
        }
    }
    /// The address range of the buffer's bytes (see [`flashattn::memory::huge_page_bytes_in`]).
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        match self {
            CacheBuffer::F32(d) => flashattn::memory::byte_range(d),
            CacheBuffer::F16(d) => flashattn::memory::byte_range(d),
            CacheBuffer::BF16(d) => flashattn::memory::byte_range(d),
        }
    }
}

pub fn view<'a>(buf: &'a Buffer, shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_slice(
        buf.as_slice(),
        shape,
        &flashattn::tensor::contiguous_strides(shape),
    )
}

/// An owned FP8 buffer (a file's tensor, or the bench's random inputs), aligned as a KV cache
/// ([`cache_vec`]).
pub enum Fp8Buf {
    E4M3(CacheBuf<F8E4M3>),
    E5M2(CacheBuf<F8E5M2>),
}

impl Fp8Buf {
    /// `x` rounded to `format` (nearest even, saturating at its max).
    pub fn quantize(
        what: &'static str,
        format: Fp8Format,
        x: impl ExactSizeIterator<Item = f32>,
    ) -> Result<Self> {
        Self::quantize_cache(what, format, x, false)
    }
    /// [`Fp8Buf::quantize`] into a KV cache buffer, in huge pages when `huge` (see
    /// [`cache_vec`]); an error naming `what` where the machine cannot hold it.
    pub fn quantize_cache(
        what: &'static str,
        format: Fp8Format,
        x: impl ExactSizeIterator<Item = f32>,
        huge: bool,
    ) -> Result<Self> {
        Ok(match format {
            Fp8Format::E4M3 => Fp8Buf::E4M3(cache_vec(what, huge, x.map(F8E4M3::from_f32))?),
            Fp8Format::E5M2 => Fp8Buf::E5M2(cache_vec(what, huge, x.map(F8E5M2::from_f32))?),
        })
    }
    /// The address range of the buffer's bytes (see [`flashattn::memory::huge_page_bytes_in`]).
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        match self {
            Fp8Buf::E4M3(d) => flashattn::memory::byte_range(d),
            Fp8Buf::E5M2(d) => flashattn::memory::byte_range(d),
        }
    }
    pub fn format(&self) -> Fp8Format {
        match self {
            Fp8Buf::E4M3(_) => Fp8Format::E4M3,
            Fp8Buf::E5M2(_) => Fp8Format::E5M2,
        }
    }
    /// A mutable view of `shape` with element `strides` (a KV cache).
    pub fn view_mut(&mut self, shape: &[usize], strides: &[usize]) -> fp8::Fp8TensorMut<'_> {
        match self {
            Fp8Buf::E4M3(d) => fp8::Fp8TensorMut::new(&mut d[..], shape, strides),
            Fp8Buf::E5M2(d) => fp8::Fp8TensorMut::new(&mut d[..], shape, strides),
        }
    }
    /// A contiguous view of `shape`.
    pub fn view(&self, shape: &[usize]) -> Fp8TensorRef<'_> {
        match self {
            Fp8Buf::E4M3(d) => Fp8TensorRef::contiguous(&d[..], shape),
            Fp8Buf::E5M2(d) => Fp8TensorRef::contiguous(&d[..], shape),
        }
    }
}

impl Fp8Buf {
    /// A file's FP8 tensor (`F8_E4M3` or `F8_E5M2`); `why` ends the message for other dtypes.
    pub fn load(name: &str, t: &TensorView, why: &str) -> Result<Self> {
        let bytes = t.data();
        Ok(match t.dtype() {
            Dtype::F8_E4M3 => Fp8Buf::from_bits(Fp8Format::E4M3, bytes),
            Dtype::F8_E5M2 => Fp8Buf::from_bits(Fp8Format::E5M2, bytes),
            other => return fail(format!("tensor `{name}` has dtype {other:?}, {why}")),
        })
    }
    /// Values of `format` from their bytes (no larger than the bytes the caller holds).
    pub fn from_bits(format: Fp8Format, bytes: &[u8]) -> Self {
        match format {
            Fp8Format::E4M3 => Fp8Buf::E4M3(CacheBuf::from_iter_advised(
                bytes.iter().map(|&b| F8E4M3::from_bits(b)),
                false,
            )),
            Fp8Format::E5M2 => Fp8Buf::E5M2(CacheBuf::from_iter_advised(
                bytes.iter().map(|&b| F8E5M2::from_bits(b)),
                false,
            )),
        }
    }
    /// The safetensors dtype and bytes.
    pub fn encoded(&self) -> (Dtype, Vec<u8>) {
        match self {
            Fp8Buf::E4M3(d) => (Dtype::F8_E4M3, d.iter().map(|x| x.to_bits()).collect()),
            Fp8Buf::E5M2(d) => (Dtype::F8_E5M2, d.iter().map(|x| x.to_bits()).collect()),
        }
    }
}

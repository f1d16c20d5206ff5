//! Between candle and flashattn: CPU storages as flashattn views, flashattn buffers as candle
//! storages and tensors, flashattn errors as candle errors.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Device, Error, Layout, Result, Storage, Tensor};
use flashattn::{Buffer, TensorRef};

/// A flashattn error as a candle error; its message (which names the tensor and the problem) is
/// kept as it is.
pub(crate) fn wrap(e: flashattn::Error) -> Error {
    Error::wrap(e)
}

/// The storage a tensor argument lives in, if it is a CPU one.
pub(crate) fn cpu<'a>(s: &'a Storage, name: &str) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(c) => Ok(c),
        other => Err(Error::Msg(format!(
            "flashattn-candle: {name} is on {:?}; {}",
            other.device().location(),
            crate::UNSUPPORTED_DEVICE
        ))),
    }
}

/// `s` seen through `layout`: the buffer from the layout's start offset on, with its dims and
/// strides (flashattn checks them: rank, a contiguous last dimension, bounds).
pub(crate) fn view<'a>(s: &'a CpuStorage, layout: &Layout, name: &str) -> Result<TensorRef<'a>> {
    let start = layout.start_offset();
    let (dims, strides) = (layout.dims(), layout.stride());
    fn tail<'a, T>(d: &'a [T], start: usize, name: &str) -> Result<&'a [T]> {
        d.get(start..).ok_or_else(|| {
            Error::Msg(format!(
                "flashattn-candle: {name} starts at element {start} of a buffer of {}",
                d.len()
            ))
        })
    }
    match s {
        CpuStorage::F32(d) => Ok(TensorRef::new(tail(d, start, name)?, dims, strides)),
        CpuStorage::F16(d) => Ok(TensorRef::new(tail(d, start, name)?, dims, strides)),
        CpuStorage::BF16(d) => Ok(TensorRef::new(tail(d, start, name)?, dims, strides)),
        other => Err(Error::Msg(format!(
            "flashattn-candle: {name} has dtype {:?}; flashattn takes f32, f16 or bf16",
            other.dtype()
        ))),
    }
}

/// A flashattn result buffer as a candle CPU storage (moved, not copied).
pub(crate) fn storage(b: Buffer) -> CpuStorage {
    match b {
        Buffer::F32(v) => CpuStorage::F32(v),
        Buffer::F16(v) => CpuStorage::F16(v),
        Buffer::BF16(v) => CpuStorage::BF16(v),
    }
}

/// A flashattn result tensor as a candle tensor on `device` (moved, not copied).
pub(crate) fn tensor(t: flashattn::Tensor, device: &Device) -> Result<Tensor> {
    let shape = t.shape().to_vec();
    match t.into_buffer() {
        Buffer::F32(v) => Tensor::from_vec(v, shape, device),
        Buffer::F16(v) => Tensor::from_vec(v, shape, device),
        Buffer::BF16(v) => Tensor::from_vec(v, shape, device),
    }
}

/// `t`, copied to a contiguous tensor if its last dimension is strided (flashattn reads rows of
/// `head_dim` elements as slices); other strides are passed through as they are.
pub(crate) fn last_dim_contiguous(t: &Tensor) -> Result<Tensor> {
    let layout = t.layout();
    match (layout.dims().last(), layout.stride().last()) {
        (Some(&n), Some(&s)) if n > 1 && s != 1 => t.contiguous(),
        _ => Ok(t.clone()),
    }
}

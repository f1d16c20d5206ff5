//! Device memory as the calls see it: [`DeviceBuffer`] (a GPU buffer of one element type),
//! [`CudaTensor`] (a view of one), uploads and downloads, and [`CudaAttnOutput`], what the
//! forward and decode calls return.

use super::device::CudaDevice;
use super::error::driver_err;
use crate::error::Result;
use crate::params;
use crate::tensor::{Buffer, DType, Slice, Tensor, TensorRef, ViewDesc};
use cudarc::driver::{CudaContext, CudaSlice};
use half::{bf16, f16};
use std::sync::Arc;

/// A GPU buffer of one element type.
#[derive(Clone, Debug)]
pub enum DeviceBuffer {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
}

impl DeviceBuffer {
    pub fn dtype(&self) -> DType {
        match self {
            DeviceBuffer::F32(_) => DType::F32,
            DeviceBuffer::F16(_) => DType::F16,
            DeviceBuffer::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            DeviceBuffer::F32(s) => s.len(),
            DeviceBuffer::F16(s) => s.len(),
            DeviceBuffer::BF16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub(super) fn context(&self) -> &Arc<CudaContext> {
        match self {
            DeviceBuffer::F32(s) => s.context(),
            DeviceBuffer::F16(s) => s.context(),
            DeviceBuffer::BF16(s) => s.context(),
        }
    }
}

/// A tensor in GPU memory: a buffer, a shape and element strides (last dimension contiguous), as
/// [`TensorRef`] on the host. Shapes and strides are checked when a call uses the tensor.
#[derive(Clone, Debug)]
pub struct CudaTensor {
    pub(super) buf: DeviceBuffer,
    pub(super) shape: Vec<usize>,
    pub(super) strides: Vec<usize>,
}

impl CudaTensor {
    /// A view of `buf` with explicit strides (validated by the call that uses it).
    pub fn from_buffer(buf: DeviceBuffer, shape: &[usize], strides: &[usize]) -> CudaTensor {
        CudaTensor {
            buf,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }
    /// A row-major contiguous view of `buf`.
    pub fn contiguous(buf: DeviceBuffer, shape: &[usize]) -> CudaTensor {
        CudaTensor::from_buffer(buf, shape, &crate::tensor::contiguous_strides(shape))
    }
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buf
    }
    pub fn into_buffer(self) -> DeviceBuffer {
        self.buf
    }

    /// Copies the tensor to the host (waits for the stream), as a contiguous [`Tensor`].
    pub fn to_host(&self, dev: &CudaDevice) -> Result<Tensor> {
        params::check_view("tensor", self, self.shape.len(), "any")?;
        let dtoh = driver_err("cuMemcpyDtoH");
        let (shape, strides) = (&self.shape[..], &self.strides[..]);
        let buf = match &self.buf {
            DeviceBuffer::F32(s) => Buffer::F32(gather(
                &dev.stream.clone_dtoh(s).map_err(dtoh)?,
                shape,
                strides,
            )),
            DeviceBuffer::F16(s) => Buffer::F16(gather(
                &dev.stream.clone_dtoh(s).map_err(dtoh)?,
                shape,
                strides,
            )),
            DeviceBuffer::BF16(s) => Buffer::BF16(gather(
                &dev.stream.clone_dtoh(s).map_err(dtoh)?,
                shape,
                strides,
            )),
        };
        dev.synchronize()?;
        Ok(Tensor::from_buffer(buf, shape).expect("gather yields the product of the shape"))
    }
}

/// The elements of a validated view, row-major (a plain copy when the view is contiguous).
pub(super) fn gather<T: Copy>(data: &[T], shape: &[usize], strides: &[usize]) -> Vec<T> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Vec::new();
    }
    if strides == crate::tensor::contiguous_strides(shape) {
        return data[..n].to_vec();
    }
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    loop {
        let offset: usize = idx.iter().zip(strides).map(|(i, s)| i * s).sum();
        out.push(data[offset]);
        let mut d = shape.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

impl ViewDesc for CudaTensor {
    fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn strides(&self) -> &[usize] {
        &self.strides
    }
    fn buffer_len(&self) -> usize {
        self.buf.len()
    }
}

impl CudaDevice {
    /// Copies a host view to the GPU as a contiguous tensor of the same shape and dtype.
    pub fn upload(&self, t: &TensorRef) -> Result<CudaTensor> {
        params::check_view("tensor", t, t.shape().len(), "any")?;
        let (shape, strides) = (t.shape(), t.strides());
        let buf = match t.data() {
            Slice::F32(d) => DeviceBuffer::F32(self.htod(&gather(d, shape, strides))?),
            Slice::F16(d) => DeviceBuffer::F16(self.htod(&gather(d, shape, strides))?),
            Slice::BF16(d) => DeviceBuffer::BF16(self.htod(&gather(d, shape, strides))?),
        };
        Ok(CudaTensor::contiguous(buf, shape))
    }
}

/// What a CUDA forward call returns, on the device: `out` (q's dtype, contiguous) and `lse` (f32),
/// shaped as the CPU path's [`crate::AttnOutput`].
#[derive(Clone, Debug)]
pub struct CudaAttnOutput {
    pub out: CudaTensor,
    pub lse: CudaTensor,
}

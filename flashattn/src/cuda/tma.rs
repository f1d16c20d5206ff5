//! The TMA tensor maps of the warp-specialised sm_90a forward (kernels/fwd_sm90_ws.cu): what each
//! map describes ([`TmaSpec`], computed on the host from a launch, also what the host emulation
//! reads) and its encoding by the driver (`cuTensorMapEncodeTiled`) for a GPU launch.
//!
//! Each of q, k and v is seen as a 4-D tensor of 16-bit elements (FP8 mode: bytes) {head_dim,
//! rows, heads, batches} (innermost first) with its own byte strides: a batched call's rows are one
//! sequence's, a packed call's the whole tensor's (one batch). A box is 128 bytes (the swizzle's
//! span: 64 columns, or 128 of bytes) by `box_rows` rows of one head and batch; the kernel loads
//! one box per 128-byte slab of a tile.
//! Elements outside the tensor arrive as zeros.

use super::error::driver_err;
use crate::error::{ErrorKind, Result};
use crate::tensor::DType;
use cudarc::driver::{sys, DeviceRepr};

/// What one tensor map describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaSpec {
    /// Elements per dimension, innermost first: head_dim, rows, heads, batches.
    pub dims: [u64; 4],
    /// Byte strides of dimensions 1, 2 and 3 (the innermost is contiguous).
    pub strides: [u64; 3],
    /// Rows per box (the tile's rows); the box is 128 bytes of one head and batch.
    pub box_rows: u32,
    /// Bytes per element: 2 (f16, bf16) or 1 (FP8 bytes).
    pub elem_bytes: u32,
}

/// An encoded map, passed to the kernel by value (its `TmaDesc` parameter, 128 bytes).
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct TmaDesc(sys::CUtensorMap);

// SAFETY: CUtensorMap is 128 plain bytes (16 u64) that the kernel receives by value as a
// `__grid_constant__ TmaDesc` of the same size; cuLaunchKernel copies the bytes at the kernel's
// declared alignment.
unsafe impl DeviceRepr for TmaDesc {}

impl TmaSpec {
    /// The driver's encoding of this map over the elements at device address `base`: of `dtype`,
    /// or FP8 bytes when the spec's elements are one byte.
    pub(crate) fn encode(&self, base: sys::CUdeviceptr, dtype: DType) -> Result<TmaDesc> {
        let data_type = match dtype {
            _ if self.elem_bytes == 1 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            DType::F32 => {
                return Err(ErrorKind::CudaUnsupported {
                    feature: "TMA loads of f32",
                    detail: " (the sm_90a forward takes f16 and bf16)".into(),
                }
                .into())
            }
        };
        let boxes: [u32; 4] = [128 / self.elem_bytes, self.box_rows, 1, 1];
        let element_strides: [u32; 4] = [1; 4];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: `map` is writable storage for one CUtensorMap; the dims, strides, boxes and
        // element strides arrays hold rank (4), rank - 1 and rank entries as the call reads them;
        // `base` is the device address of the tensor the launch reads, alive until the kernel
        // has run (the caller holds its buffer). The driver validates the values (alignment of
        // base and strides to 16 bytes, sizes) and returns an error code for bad ones.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                data_type,
                4,
                base as *mut std::ffi::c_void,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        r.result().map_err(driver_err("cuTensorMapEncodeTiled"))?;
        // SAFETY: the call succeeded, so it wrote the whole map.
        Ok(TmaDesc(unsafe { map.assume_init() }))
    }
}

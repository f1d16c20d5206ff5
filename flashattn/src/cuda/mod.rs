//! The NVIDIA CUDA backend: the same attention calls as the CPU path, on tensors in GPU memory.
//!
//! Nothing CUDA is needed to build or test the crate: cudarc loads libcuda and libnvrtc at run
//! time (`probe` checks that they exist before cudarc is called, since cudarc panics otherwise),
//! and the kernels are CUDA C++ sources embedded in the library (`kernels/*.cu`), compiled by
//! NVRTC for the device's architecture at first use. Each variant is named by a typed
//! [`KernelKey`]; compiled cubins are cached in memory (per device) and on disk (keyed by a hash of
//! the sources, the key, the architecture and NVRTC's version).
//!
//! Semantics are the CPU path's: same validation (`crate::params`), same masks, scores, LSE,
//! fully-masked-row rule. Decoding with a KV cache ([`flash_attn_with_kvcache`]: appends,
//! rotary, paged caches, split-KV with an LSE merge) runs CUDA-core kernels of its own. The
//! backward pass ([`flash_attn_backward`]) runs tensor-core kernels for f16/bf16 up to head_dim
//! 128 and CUDA-core kernels otherwise. Dropout regenerates the CPU path's Philox mask bit for bit
//! in the forward and backward kernels, so a mask drawn on one backend is the mask of the other.
//!
//! This file only declares the backend's files and re-exports their public items; the files are
//! layered, each importing only those below it (docs/CUDA.md, "Host code").
//!
//! ```no_run
//! use flashattn::{cuda, AttnOptions, TensorRef};
//! let dev = cuda::CudaDevice::new(0)?; // a typed error (no panic) when there is no GPU
//! let host = vec![half::bf16::from_f32(0.5); 1 * 128 * 8 * 64];
//! let shape = [1, 128, 8, 64];
//! let q = dev.upload(&TensorRef::contiguous(&host, &shape))?;
//! let res = cuda::flash_attn(&dev, &q, &q, &q, &AttnOptions::default().causal(true))?;
//! let out = res.out.to_host(&dev)?; // a flashattn::Tensor
//! # Ok::<(), flashattn::Error>(())
//! ```

mod arch;
mod backward;
mod buffer;
mod cache;
mod decode;
mod decode_plan;
mod device;
mod error;
mod forward;
mod fp8;
mod key;
mod launch;
mod loader;
mod nvrtc;
mod params;
mod probe;
mod schedule;
mod tma;

pub use arch::{Arch, GpuShape};
pub use backward::{
    backward_kernel_key, flash_attn_backward, flash_attn_backward_into, CudaAttnGrads,
    CudaGradBuffers, BWD_FIELDS,
};
#[cfg(feature = "test-hooks")]
pub use backward::{backward_launch_description, BackwardLaunch};
pub use buffer::{CudaAttnOutput, CudaTensor, DeviceBuffer};
/// The cudarc this backend is built on (0.19, CUDA 13.0 API), for streams, events and slices of
/// matching types.
pub use cudarc;
pub use decode::{flash_attn_with_kvcache, flash_attn_with_kvcache_into};
#[cfg(feature = "test-hooks")]
pub use decode_plan::decode_launch_description;
pub use decode_plan::{
    choose_splits, choose_splits_for, decode_launch_description_fp8,
    decode_launch_description_with, DecodeKernel, DecodeLaunch, DECODE_FIELDS,
};
pub use device::CudaDevice;
#[cfg(feature = "test-hooks")]
pub use forward::launch_description;
pub use forward::{
    flash_attn, flash_attn_into, kernel_key, CudaOutBuffers, ForwardKernel, LaunchDescription,
    SEQ_FIELDS,
};
pub use fp8::{
    flash_attn_fp8, flash_attn_fp8_into, flash_attn_with_kvcache_fp8,
    flash_attn_with_kvcache_fp8_into, fp8_kernel_key, launch_description_fp8, CudaFp8Tensor,
};
pub use key::{KernelKey, KernelKind, Tiles, HEAD_DIM_STEP};
pub use launch::MAX_SEQLEN;
pub use loader::{precompile, KernelOrigin, Precompile, Precompiled, Prepared};
pub use nvrtc::{compile, version as nvrtc_version, CompiledKernel};
/// The contract structs' C names, sizes and fields (name, offset, size), for the tests that
/// compare them with params.cuh.
#[cfg(feature = "test-hooks")]
pub use params::{layouts as params_layouts, FieldLayout, StructLayout};
pub use params::{BwdParams, DecodeParams, DropoutParams, FwdParams};
pub use tma::TmaSpec;

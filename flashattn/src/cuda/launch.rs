//! What every launch shares: the limits of the kernels' grids and index arithmetic and the check
//! of a call against them and the device ([`check_launchable`]), the sinks table, and the
//! allocation of kernel outputs and workspaces ([`alloc_output`]).

use super::device::CudaDevice;
use super::error::driver_err;
use super::key::KernelKey;
use crate::error::{ErrorKind, Result};
use crate::params::Params;
use crate::tensor::DType;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use std::sync::Arc;

/// Longest sequence the kernels accept: their in-sequence index arithmetic is 32-bit, and with
/// sides clamped to seqlen_q + seqlen_k no intermediate exceeds 2^31.
pub const MAX_SEQLEN: usize = 1 << 29;

/// grid.y (heads) and grid.z (batch) are limited to 65535 by CUDA.
pub(super) const MAX_GRID_YZ: usize = 65_535;

/// Checks what the kernels cannot do or address, before anything is allocated or queued.
pub(crate) fn check_launchable(
    dev: &CudaDevice,
    p: &Params,
    key: &KernelKey,
    contexts: &[&Arc<CudaContext>],
) -> Result<()> {
    for c in contexts {
        if !Arc::ptr_eq(c, &dev.ctx) {
            return Err(ErrorKind::CudaUnsupported {
                feature: "a tensor from another CUDA context",
                detail: format!(" (the call runs on {})", dev.name),
            }
            .into());
        }
    }
    if p.dtype != DType::F32 && dev.arch.major < 8 {
        return Err(ErrorKind::CudaUnsupported {
            feature: "f16/bf16",
            detail: format!(
                " on {} (compute capability {}.{}; the tensor-core kernels need 8.0 or newer)",
                dev.name, dev.arch.major, dev.arch.minor
            ),
        }
        .into());
    }
    let limit = |what, value: usize, limit: usize| {
        if value > limit {
            Err(crate::Error::from(ErrorKind::CudaLimit {
                what,
                value: value as u64,
                limit: limit as u64,
            }))
        } else {
            Ok(())
        }
    };
    limit("batch", p.seqs.len() + p.packed as usize, MAX_GRID_YZ)?;
    limit("heads", p.heads, MAX_GRID_YZ)?;
    for s in &p.seqs {
        limit("seqlen_q", s.seqlen_q, MAX_SEQLEN)?;
        limit("seqlen_k", s.seqlen_k, MAX_SEQLEN)?;
    }
    limit(
        "shared memory per block (bytes)",
        key.smem_bytes(),
        dev.smem_optin,
    )
}

/// The learnable sinks of `p` for the kernels: `heads` logits per launched sequence (`launched`,
/// the tail of packed rows included, which gets -inf: no sink), or `None`.
pub(crate) fn sink_table(p: &Params, launched: usize) -> Option<Vec<f32>> {
    p.sink.as_ref().map(|s| {
        (0..launched)
            .flat_map(|b| {
                s.iter().map(move |&x| {
                    if b < p.seqs.len() {
                        x
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect()
    })
}

/// Whether [`alloc_output`] poisons: by default in debug builds (the tests) and not in release
/// builds; `FLASHATTN_POISON=1` or `0` says so for either (read once per process). A poisoned
/// buffer costs one memset on the stream per output and workspace: nothing at the forward's scale,
/// but ~2-3 us of GPU time each in a decode step that reads its cache in tens of microseconds.
fn poison_device_outputs() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| match std::env::var("FLASHATTN_POISON").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => cfg!(debug_assertions),
    })
}

/// A new buffer for a kernel's output or workspace. Where [`poison_device_outputs`] says so it is
/// filled with all-ones bytes (NaN in f32, f16 and bf16), as the CPU path poisons its outputs: the
/// kernels write every element, and one they missed would read as NaN, not as a plausible stale
/// value; the tests run that way.
pub(super) fn alloc_output<T: cudarc::driver::DeviceRepr>(
    s: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    // SAFETY: T is a plain float type for which every bit pattern is a valid value; the kernels
    // that take the buffer write every element before anything reads it (the debug-build tests
    // check this with the memset below), and where the memset runs it is queued first.
    let mut buf = unsafe { s.alloc::<T>(len.max(1)) }.map_err(driver_err("cuMemAllocAsync"))?;
    if !poison_device_outputs() {
        return Ok(buf);
    }
    let bytes = len.max(1) * std::mem::size_of::<T>();
    let (ptr, record) = buf.device_ptr_mut(s);
    // SAFETY: `ptr` addresses `bytes` bytes owned by `buf`, alive for the call; the memset is
    // queued on the same stream as every later use of `buf`.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, s.cu_stream()) }
        .map_err(driver_err("cuMemsetD8Async"))?;
    drop(record);
    Ok(buf)
}

//! FP8 on the GPU: [`CudaFp8Tensor`] (FP8 bytes in GPU memory, with their format);
//! [`flash_attn_fp8`] (batched or packed), the CPU's [`crate::fp8::flash_attn_fp8`]
//! with the same validation (`crate::fp8::validate_forward`) on the bf16 forward kernel of
//! `kernels/fwd.cu` compiled with `FA_FP8_INPUT`; and [`flash_attn_with_kvcache_fp8`], the CPU's
//! [`crate::fp8::flash_attn_with_kvcache_fp8`] with the same validation
//! (`crate::fp8::validate_kvcache`) and the decode kernels of `kernels/decode.cu` compiled with
//! `FA_FP8_CACHE`. Each has an `_into` form writing `out` and `lse` into caller-provided buffers.

use super::buffer::{gather, CudaAttnOutput, CudaTensor, DeviceBuffer};
use super::decode::{alloc_outputs, prepare, queue, refuse_host_new_kv};
use super::device::CudaDevice;
use super::error::driver_err;
use super::forward::{
    check_destination, launch_forward, run_forward, CudaOutBuffers, LaunchDescription,
};
use crate::decode::KvCacheOptions;
use crate::error::Result;
use crate::fp8::{validate_forward, Fp8Format, Fp8TensorRef, Fp8View};
use crate::params::{self, AttnOptions, DecodeParams, Params};
use crate::tensor::{DType, ViewDesc, ViewInfo};
use cudarc::driver::CudaSlice;
use half::bf16;

/// FP8 values in GPU memory (one byte each, e4m3 or e5m2), a shape and element strides (last
/// dimension contiguous): q, k or v of [`flash_attn_fp8`], or an FP8 KV cache for
/// [`flash_attn_with_kvcache_fp8`].
#[derive(Clone, Debug)]
pub struct CudaFp8Tensor {
    buf: CudaSlice<u8>,
    format: Fp8Format,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl CudaFp8Tensor {
    /// A view of `buf` holding values of `format`, with explicit strides (validated by the call
    /// that uses it).
    pub fn from_buffer(
        buf: CudaSlice<u8>,
        format: Fp8Format,
        shape: &[usize],
        strides: &[usize],
    ) -> CudaFp8Tensor {
        CudaFp8Tensor {
            buf,
            format,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }
    pub fn format(&self) -> Fp8Format {
        self.format
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.buf
    }
    /// The bytes, giving up the view (an embedding that borrowed the memory leaks the slice
    /// rather than freeing it).
    pub fn into_buffer(self) -> CudaSlice<u8> {
        self.buf
    }

    /// The tensor's bytes on the host, row-major (waits for the stream).
    pub fn to_host_bytes(&self, dev: &CudaDevice) -> Result<Vec<u8>> {
        params::check_view("tensor", self, self.shape.len(), "any")?;
        let all = dev
            .stream
            .clone_dtoh(&self.buf)
            .map_err(driver_err("cuMemcpyDtoH"))?;
        dev.synchronize()?;
        Ok(gather(&all, &self.shape, &self.strides))
    }
}

/// Validation sees an FP8 cache as bf16, its bounds in elements (one byte each).
impl ViewDesc for CudaFp8Tensor {
    fn dtype(&self) -> DType {
        DType::BF16
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

impl Fp8View for CudaFp8Tensor {
    fn fp8_format(&self) -> Fp8Format {
        self.format
    }
}

impl CudaDevice {
    /// Copies a host FP8 view to the GPU as a contiguous tensor of the same shape and format.
    pub fn upload_fp8(&self, t: &Fp8TensorRef) -> Result<CudaFp8Tensor> {
        params::check_view("tensor", t, t.shape().len(), "any")?;
        let bytes = gather(t.data().bytes(), t.shape(), t.strides());
        Ok(CudaFp8Tensor::from_buffer(
            self.htod(&bytes)?,
            t.format(),
            t.shape(),
            &crate::tensor::contiguous_strides(t.shape()),
        ))
    }
}

/// [`crate::fp8::flash_attn_with_kvcache_fp8`] on the GPU, queued on `dev`'s stream (returns
/// without waiting): q (f32, f16 or bf16) and the new keys and values (`new_kv`, in q's dtype) as
/// [`CudaTensor`]s, the caches as [`CudaFp8Tensor`]s of one format, with the dequantisation
/// factors `opts.attn.descale` (`k` and `v`: one value, or one per (batch row, kv head); `q`
/// must be `None`). Everything else as [`super::flash_attn_with_kvcache`]: host index arrays,
/// `opts.new_kv` `None`, every input validated before anything is queued (on error the caches are
/// untouched).
///
/// The kernels widen the cache bytes exactly to f32 as they read them; appended keys (rotated
/// first) and values are divided by their factor in f64 and rounded once to FP8, saturating, as
/// on the CPU.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache_fp8(
    dev: &CudaDevice,
    q: &CudaTensor,
    k_cache: &mut CudaFp8Tensor,
    v_cache: &mut CudaFp8Tensor,
    cache_seqlens: &[i32],
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    opts: &KvCacheOptions,
) -> Result<CudaAttnOutput> {
    let (dp, dk) = validate_kvcache_fp8(q, (k_cache, v_cache), new_kv, cache_seqlens, opts)?;
    let mut res = alloc_outputs(dev, &dp)?;
    let dst = CudaOutBuffers {
        out: &mut res.out,
        lse: &mut res.lse,
    };
    kvcache_fp8_into(dev, &dp, &dk, q, (k_cache, v_cache), new_kv, dst)?;
    Ok(res)
}

/// [`flash_attn_with_kvcache_fp8`] writing `out` (q's dtype) and `lse` into caller-provided
/// buffers, as [`super::flash_attn_with_kvcache_into`]: everything validated first (on error
/// nothing is written, the caches untouched), queued without waiting.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache_fp8_into(
    dev: &CudaDevice,
    q: &CudaTensor,
    k_cache: &mut CudaFp8Tensor,
    v_cache: &mut CudaFp8Tensor,
    cache_seqlens: &[i32],
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    opts: &KvCacheOptions,
    dst: CudaOutBuffers,
) -> Result<()> {
    let (dp, dk) = validate_kvcache_fp8(q, (k_cache, v_cache), new_kv, cache_seqlens, opts)?;
    kvcache_fp8_into(dev, &dp, &dk, q, (k_cache, v_cache), new_kv, dst)
}

/// The FP8 decode's validation (host `new_kv` refused): its parameters and the k factors.
fn validate_kvcache_fp8(
    q: &CudaTensor,
    (k_cache, v_cache): (&CudaFp8Tensor, &CudaFp8Tensor),
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<(DecodeParams, Vec<f32>)> {
    refuse_host_new_kv(opts)?;
    crate::fp8::validate_kvcache(
        &ViewInfo::of(q),
        (k_cache, v_cache),
        new_kv.map(|(k, v)| (ViewInfo::of(k), ViewInfo::of(v))),
        cache_seqlens,
        opts,
    )
}

/// The decode of validated `dp` (k factors `dk`) on FP8 caches, into `dst`.
fn kvcache_fp8_into(
    dev: &CudaDevice,
    dp: &DecodeParams,
    dk: &[f32],
    q: &CudaTensor,
    (k_cache, v_cache): (&mut CudaFp8Tensor, &mut CudaFp8Tensor),
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    dst: CudaOutBuffers,
) -> Result<()> {
    let d = prepare(
        dev,
        dp,
        [
            q.buf.context(),
            k_cache.buf.context(),
            v_cache.buf.context(),
        ],
        new_kv,
        Some((k_cache.format, dk)),
        &dst,
    )?;
    queue(
        dev,
        &d,
        q,
        (&mut k_cache.buf, &mut v_cache.buf),
        new_kv,
        dst,
    )
}

/// [`crate::fp8::flash_attn_fp8`] on the GPU, queued on `dev`'s stream (returns without waiting):
/// q `[batch, seqlen_q, heads, head_dim]`, k and v `[batch, seqlen_k, heads_kv, head_dim]` (or
/// packed with [`AttnOptions::varlen`], `cu_seqlens_*` on the host), all three
/// [`CudaFp8Tensor`]s of one format, with their dequantisation factors in `opts.descale` (one
/// value, one per (sequence, kv head), or per block of 128 rows: [`crate::fp8::Descale`]).
/// Returns `out` in bf16 and `lse` in f32. Every option of [`super::flash_attn`] applies; every
/// input is validated before anything is queued.
///
/// The kernel is the bf16 forward fed from FP8 bytes: each key block's bytes are staged in shared
/// memory and widened exactly to bf16 tiles (every FP8 value is a bf16 value), the folded
/// `softmax_scale · q_descale · k_descale` of each (sequence, kv head) scales the scores and
/// `v_descale` the finished rows, as on the CPU. The products run on the bf16 tensor cores, not
/// FlashAttention-3's FP8 ones (those are fwd_sm90_fp8.cu's, with `FLASHATTN_CUDA_FWD=sm90fp8`).
/// Per-block factors: a CTA's query rows lie in one 128-row block, so its q factor is fixed, and
/// the score scale `softmax_scale · q_descale · k_descale` is set per key block; the v factors
/// (relative to the largest of the (sequence, kv head), which scales the finished rows) multiply
/// P after row_sum took it in fwd.cu, while fwd_sm90_fp8.cu keeps acc_o in units of the current
/// key block's v factor (a ratio folded into the online-softmax rescale), as P rounded to e4m3
/// would otherwise lose the exactness of a dominant probability. Compiled and emulated, not yet
/// run on a GPU.
pub fn flash_attn_fp8(
    dev: &CudaDevice,
    q: &CudaFp8Tensor,
    k: &CudaFp8Tensor,
    v: &CudaFp8Tensor,
    opts: &AttnOptions,
) -> Result<CudaAttnOutput> {
    let p = validate_forward([q, k, v], opts)?;
    forward_fp8(dev, &p, [q, k, v])
}

/// The kernel variant a [`flash_attn_fp8`] call with these arguments runs on `dev` (validated as the call would be): fwd.cu, or
/// fwd_sm90_fp8.cu where the launch picks it (`FLASHATTN_CUDA_FWD=sm90fp8` on compute
/// capability 9.0 with e4m3 inputs).
pub fn fp8_kernel_key(
    dev: &CudaDevice,
    [q, k, v]: [&CudaFp8Tensor; 3],
    opts: &AttnOptions,
) -> Result<super::KernelKey> {
    let p = validate_forward([q, k, v], opts)?;
    Ok(LaunchDescription::new(&p, Some(q.format))
        .for_arch(dev.arch, super::forward::ForwardKernel::from_env())
        .key)
}

/// [`flash_attn_fp8`] writing into caller-provided buffers ([`CudaOutBuffers`]: `out` bf16 with
/// q's shape, `lse` f32, both contiguous), as [`super::flash_attn_into`]: everything validated
/// first (on error nothing is written), queued without waiting.
pub fn flash_attn_fp8_into(
    dev: &CudaDevice,
    q: &CudaFp8Tensor,
    k: &CudaFp8Tensor,
    v: &CudaFp8Tensor,
    opts: &AttnOptions,
    dst: CudaOutBuffers,
) -> Result<()> {
    let p = validate_forward([q, k, v], opts)?;
    forward_fp8_into(dev, &p, [q, k, v], dst)
}

/// The launch an FP8 forward with these host views would make (validated as the call would be):
/// for the host emulation test of the kernel.
pub fn launch_description_fp8(
    q: &Fp8TensorRef,
    k: &Fp8TensorRef,
    v: &Fp8TensorRef,
    opts: &AttnOptions,
) -> Result<LaunchDescription> {
    let p = validate_forward([q, k, v], opts)?;
    Ok(LaunchDescription::new(&p, Some(q.format())))
}

fn forward_fp8(
    dev: &CudaDevice,
    p: &Params,
    [q, k, v]: [&CudaFp8Tensor; 3],
) -> Result<CudaAttnOutput> {
    let contexts = [q.buf.context(), k.buf.context(), v.buf.context()];
    let qkv = (&q.buf, &k.buf, &v.buf);
    run_forward::<u8, bf16>(dev, p, Some(q.format), contexts, qkv, DeviceBuffer::BF16)
}

fn forward_fp8_into(
    dev: &CudaDevice,
    p: &Params,
    [q, k, v]: [&CudaFp8Tensor; 3],
    dst: CudaOutBuffers,
) -> Result<()> {
    check_destination("out", dst.out, DType::BF16, &p.out_shape)?;
    check_destination("lse", dst.lse, DType::F32, &p.lse_shape)?;
    let (out_ctx, lse_ctx) = (dst.out.buf.context().clone(), dst.lse.buf.context().clone());
    let contexts = [
        q.buf.context(),
        k.buf.context(),
        v.buf.context(),
        &out_ctx,
        &lse_ctx,
    ];
    let (DeviceBuffer::BF16(out), DeviceBuffer::F32(lse)) = (&mut dst.out.buf, &mut dst.lse.buf)
    else {
        unreachable!("checked: out is bf16, lse f32")
    };
    let qkv = (&q.buf, &k.buf, &v.buf);
    launch_forward::<u8, bf16>(dev, p, Some(q.format), &contexts, qkv, out, lse)
}

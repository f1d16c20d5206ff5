//! `run --device cuda`: the same work on the GPU through `flashattn::cuda` (device 0). Without a
//! GPU these return the library's typed error (no driver, no device, no NVRTC), and `run` exits
//! non-zero.

use crate::buf::Fp8Buf;
use crate::error::Result;
use crate::st_io::Loaded;
use flashattn::cuda::{self, CudaDevice};
use flashattn::{AttnGrads, AttnOptions, AttnOutput, TensorRef};

/// Attention on GPU 0 of host views: upload, forward (and backward when `dout` is given),
/// download. `opts.cu_seqlens` selects the packed layout.
pub fn compute(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: Option<&TensorRef>,
    opts: &AttnOptions,
) -> Result<(AttnOutput, Option<AttnGrads>)> {
    let dev = CudaDevice::new(0)?;
    let (dq, dk, dv) = (dev.upload(q)?, dev.upload(k)?, dev.upload(v)?);
    let res = cuda::flash_attn(&dev, &dq, &dk, &dv, opts)?;
    let grads = match dout {
        Some(dout) => {
            let dd = dev.upload(dout)?;
            let (o, l) = (&res.out, &res.lse);
            let g = cuda::flash_attn_backward(&dev, &dq, &dk, &dv, o, l, &dd, opts)?;
            Some(AttnGrads {
                dq: g.dq.to_host(&dev)?,
                dk: g.dk.to_host(&dev)?,
                dv: g.dv.to_host(&dev)?,
                dsink: g.dsink.map(|t| t.to_host(&dev)).transpose()?,
            })
        }
        None => None,
    };
    let out = AttnOutput {
        out: res.out.to_host(&dev)?,
        lse: res.lse.to_host(&dev)?,
    };
    Ok((out, grads))
}

/// The FP8 forward on GPU 0 of host FP8 views: upload, forward, download (out bf16, lse f32).
/// The layout and the factors are in `opts` (`cu_seqlens`, `descale`).
pub fn compute_fp8(
    q: &flashattn::fp8::Fp8TensorRef,
    k: &flashattn::fp8::Fp8TensorRef,
    v: &flashattn::fp8::Fp8TensorRef,
    opts: &AttnOptions,
) -> Result<AttnOutput> {
    let dev = CudaDevice::new(0)?;
    let (dq, dk, dv) = (dev.upload_fp8(q)?, dev.upload_fp8(k)?, dev.upload_fp8(v)?);
    let res = cuda::flash_attn_fp8(&dev, &dq, &dk, &dv, opts)?;
    Ok(AttnOutput {
        out: res.out.to_host(&dev)?,
        lse: res.lse.to_host(&dev)?,
    })
}

/// q and the new keys and values of a decode step on the device, and the options with the host
/// views of the new keys taken out (the GPU calls take them as device tensors).
struct Step<'a> {
    q: cuda::CudaTensor,
    new: Option<(cuda::CudaTensor, cuda::CudaTensor)>,
    opts: flashattn::KvCacheOptions<'a>,
}

impl<'a> Step<'a> {
    fn upload(dev: &CudaDevice, q: &Loaded, opts: &flashattn::KvCacheOptions<'a>) -> Result<Self> {
        let new = match &opts.new_kv {
            Some((k, v)) => Some((dev.upload(k)?, dev.upload(v)?)),
            None => None,
        };
        let mut opts = opts.clone();
        opts.new_kv = None;
        Ok(Step {
            q: dev.upload(&q.view())?,
            new,
            opts,
        })
    }
    fn new_kv(&self) -> Option<(&cuda::CudaTensor, &cuda::CudaTensor)> {
        self.new.as_ref().map(|(k, v)| (k, v))
    }
}

/// An FP8 cache on the host: its values and shape.
type HostFp8Cache<'a> = (&'a mut Fp8Buf, &'a [usize]);

/// `run --device cuda` on a KV-cache file with FP8 caches: q, the caches and the new keys/values
/// uploaded to GPU 0, one `cuda::flash_attn_with_kvcache_fp8` call, the result downloaded and the
/// caches' bytes as appended written back into `k` / `v`.
pub fn decode_run_fp8(
    q: &Loaded,
    ((k, k_shape), (v, v_shape)): (HostFp8Cache<'_>, HostFp8Cache<'_>),
    cache_seqlens: &[i32],
    descale: &flashattn::fp8::Descale,
    opts: &flashattn::KvCacheOptions,
) -> Result<AttnOutput> {
    let dev = CudaDevice::new(0)?;
    let mut dk = dev.upload_fp8(&k.view(k_shape))?;
    let mut dv = dev.upload_fp8(&v.view(v_shape))?;
    let step = Step::upload(&dev, q, opts)?;
    let res = cuda::flash_attn_with_kvcache_fp8(
        &dev,
        &step.q,
        &mut dk,
        &mut dv,
        cache_seqlens,
        step.new_kv(),
        &step.opts.clone().descale(*descale),
    )?;
    let out = AttnOutput {
        out: res.out.to_host(&dev)?,
        lse: res.lse.to_host(&dev)?,
    };
    *k = Fp8Buf::from_bits(k.format(), &dk.to_host_bytes(&dev)?);
    *v = Fp8Buf::from_bits(v.format(), &dv.to_host_bytes(&dev)?);
    Ok(out)
}

/// `run --device cuda` on a KV-cache file: q, the caches and the new keys/values (from `opts`'s
/// host views) uploaded to GPU 0, one `cuda::flash_attn_with_kvcache` call, and the result and
/// the caches as appended downloaded into `k_cache` / `v_cache`.
pub fn decode_run(
    q: &Loaded,
    k_cache: &mut Loaded,
    v_cache: &mut Loaded,
    cache_seqlens: &[i32],
    opts: &flashattn::KvCacheOptions,
) -> Result<AttnOutput> {
    let dev = CudaDevice::new(0)?;
    let mut dk = dev.upload(&k_cache.view())?;
    let mut dv = dev.upload(&v_cache.view())?;
    let step = Step::upload(&dev, q, opts)?;
    let res = cuda::flash_attn_with_kvcache(
        &dev,
        &step.q,
        &mut dk,
        &mut dv,
        cache_seqlens,
        step.new_kv(),
        &step.opts,
    )?;
    let out = AttnOutput {
        out: res.out.to_host(&dev)?,
        lse: res.lse.to_host(&dev)?,
    };
    k_cache.buf = dk.to_host(&dev)?.into_buffer();
    v_cache.buf = dv.to_host(&dev)?.into_buffer();
    Ok(out)
}

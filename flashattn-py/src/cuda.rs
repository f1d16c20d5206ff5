//! torch CUDA tensors through flashattn's CUDA backend (its tests, tests/test_cuda.py, passed on
//! an H200 for f32/f16/bf16 forward, backward, varlen and KV caches; ALiBi, sinks, rotary and FP8
//! are wired the same way, compiled, not yet run on a GPU; `FLASHATTN_PY_CUDA=0` turns the path
//! off in the Python layer).
//!
//! Work is queued on the stream torch is using (`torch.cuda.current_stream().cuda_stream`), in
//! the device's primary context (the one torch's runtime uses), with no synchronisation inside a
//! call (except the backward with learnable sinks, whose `dsink` is summed on the host). Inputs,
//! in-place caches and every output (the forwards' and the decode's `out` and `lse`, the
//! backward's dq, dk, dv and dsink) are torch's memory, borrowed as cudarc slices that are leaked,
//! never freed, when the call ends ([`Borrowed`]): the kernels write into them directly through
//! the library's `_into` calls, no copy (the library's `_into` forms for the backward, the FP8
//! forward and the decode are compiled, not yet run on a GPU). The small option tables (ALiBi
//! slopes, sinks, rotary cos/sin) arrive as host copies: the library uploads them per call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use flashattn::cuda::cudarc::driver::{sys, CudaStream};
use flashattn::cuda::{self, CudaDevice, CudaFp8Tensor, CudaTensor, DeviceBuffer};
use flashattn::fp8::{Descale, Fp8Format};
use flashattn::KvCacheOptions;
use pyo3::prelude::*;

use crate::errors::BindError;
use crate::view::{Dt, RawView, View};
use crate::{views, KvOpts, Opts};

/// A borrowed tensor: f32/f16/bf16 values, or FP8 bytes.
enum Held {
    Float(CudaTensor),
    Fp8(CudaFp8Tensor),
}

/// One [`CudaDevice`] per ordinal for the process (its compiled kernels shared by all streams).
fn device(ordinal: usize, stream: usize) -> Result<CudaDevice, BindError> {
    static DEVICES: Mutex<Option<HashMap<usize, CudaDevice>>> = Mutex::new(None);
    let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let map = devices.get_or_insert_with(HashMap::new);
    let dev = match map.get(&ordinal) {
        Some(d) => d.clone(),
        None => {
            let d = CudaDevice::new(ordinal)?;
            map.insert(ordinal, d.clone());
            d
        }
    };
    // SAFETY: `stream` is the CUstream torch returned for this device
    // (`torch.cuda.current_stream(device).cuda_stream`), which belongs to the device's primary
    // context (the context `CudaDevice::new` retains) and which torch keeps alive while the call
    // runs; the wrapper does not destroy it. Work goes on that one stream only, so its order is
    // the order of every use.
    let s: Arc<CudaStream> = unsafe { dev.context().wrap_borrowed_stream(stream as sys::CUstream) };
    Ok(dev.on_stream(s))
}

/// torch's memory as a [`CudaTensor`] (or a [`CudaFp8Tensor`]) for the length of one call:
/// leaked (not freed) on drop.
struct Borrowed(Option<Held>);

impl Borrowed {
    /// # Safety
    /// `v` describes a live CUDA tensor of `dev`'s device that torch keeps alive for the call.
    unsafe fn new(dev: &CudaDevice, v: &View) -> Result<Self, BindError> {
        let (ptr, len) = (v.addr() as sys::CUdeviceptr, v.extent());
        let s = dev.stream();
        let fp8 = |format| {
            // SAFETY: as below, one byte per element.
            let buf = s.upgrade_device_ptr::<u8>(ptr, len);
            Held::Fp8(CudaFp8Tensor::from_buffer(
                buf, format, &v.shape, &v.strides,
            ))
        };
        // SAFETY: `ptr` is the device address of `len` elements of this dtype (torch's tensor,
        // alive for the call); the slice never frees it (`Drop` leaks it).
        let held = match v.dt {
            Dt::F32 => Held::Float(CudaTensor::from_buffer(
                DeviceBuffer::F32(s.upgrade_device_ptr(ptr, len)),
                &v.shape,
                &v.strides,
            )),
            Dt::F16 => Held::Float(CudaTensor::from_buffer(
                DeviceBuffer::F16(s.upgrade_device_ptr(ptr, len)),
                &v.shape,
                &v.strides,
            )),
            Dt::BF16 => Held::Float(CudaTensor::from_buffer(
                DeviceBuffer::BF16(s.upgrade_device_ptr(ptr, len)),
                &v.shape,
                &v.strides,
            )),
            Dt::F8E4M3 => fp8(Fp8Format::E4M3),
            Dt::F8E5M2 => fp8(Fp8Format::E5M2),
            Dt::U8 => {
                return Err(BindError::Type(format!(
                    "{}: CUDA tensors take float32, float16, bfloat16 or FP8",
                    v.name
                )))
            }
        };
        Ok(Borrowed(Some(held)))
    }

    /// Every view of `views`, in order (see [`Borrowed::new`]).
    ///
    /// # Safety
    /// As [`Borrowed::new`], for each view.
    unsafe fn all(dev: &CudaDevice, views: &[&View]) -> Result<Vec<Self>, BindError> {
        views.iter().map(|v| Self::new(dev, v)).collect()
    }

    fn held(&self) -> &Held {
        self.0.as_ref().expect("borrowed until drop")
    }

    fn get(&self) -> Result<&CudaTensor, BindError> {
        match self.held() {
            Held::Float(t) => Ok(t),
            Held::Fp8(_) => Err(not_fp8_here()),
        }
    }

    fn get_mut(&mut self) -> Result<&mut CudaTensor, BindError> {
        match self.0.as_mut().expect("borrowed until drop") {
            Held::Float(t) => Ok(t),
            Held::Fp8(_) => Err(not_fp8_here()),
        }
    }

    fn fp8(&self) -> Result<&CudaFp8Tensor, BindError> {
        match self.held() {
            Held::Fp8(t) => Ok(t),
            Held::Float(_) => Err(BindError::Type(
                "an FP8 call takes float8_e4m3fn or float8_e5m2 tensors".into(),
            )),
        }
    }

    fn fp8_mut(&mut self) -> Result<&mut CudaFp8Tensor, BindError> {
        match self.0.as_mut().expect("borrowed until drop") {
            Held::Fp8(t) => Ok(t),
            Held::Float(_) => Err(BindError::Type(
                "FP8 caches must both be float8_e4m3fn or float8_e5m2".into(),
            )),
        }
    }
}

fn not_fp8_here() -> BindError {
    BindError::Type("this argument takes float32, float16 or bfloat16, not FP8".into())
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        // torch owns the memory: give each pointer back without freeing it.
        match self.0.take() {
            Some(Held::Float(t)) => match t.into_buffer() {
                DeviceBuffer::F32(s) => {
                    s.leak();
                }
                DeviceBuffer::F16(s) => {
                    s.leak();
                }
                DeviceBuffer::BF16(s) => {
                    s.leak();
                }
            },
            Some(Held::Fp8(t)) => {
                t.into_buffer().leak();
            }
            None => {}
        }
    }
}

/// Forward on CUDA tensors (see the module documentation).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_fwd(
    py: Python<'_>,
    ordinal: usize,
    stream: usize,
    q: RawView,
    k: RawView,
    v: RawView,
    out: RawView,
    lse: RawView,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, k, v, out, lse] = views([q, k, v, out, lse])?;
        let ov = opts.views()?;
        let dev = device(ordinal, stream)?;
        // SAFETY: the option tables are host tensors the Python layer keeps alive for the call.
        let ao = unsafe { opts.attn_packed(&ov)? };
        // SAFETY: torch holds every tensor of the call alive; inputs are only read, out and lse
        // are fresh tensors of the call, written only by the kernel.
        let [qb, kb, vb, mut ob, mut lb]: [Borrowed; 5] =
            unsafe { Borrowed::all(&dev, &[&q, &k, &v, &out, &lse])? }
                .try_into()
                .unwrap_or_else(|_| unreachable!("five views, five borrows"));
        let (qt, kt, vt) = (qb.get()?, kb.get()?, vb.get()?);
        let dst = cuda::CudaOutBuffers {
            out: ob.get_mut()?,
            lse: lb.get_mut()?,
        };
        cuda::flash_attn_into(&dev, qt, kt, vt, &ao, dst)?;
        Ok(())
    })?;
    Ok(())
}

/// FP8 forward on CUDA tensors (e4m3fn or e5m2 q, k, v; out bf16, written into torch's `out`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_fwd_fp8(
    py: Python<'_>,
    ordinal: usize,
    stream: usize,
    q: RawView,
    k: RawView,
    v: RawView,
    out: RawView,
    lse: RawView,
    q_descale: Option<Vec<f32>>,
    k_descale: Option<Vec<f32>>,
    v_descale: Option<Vec<f32>>,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, k, v, out, lse] = views([q, k, v, out, lse])?;
        let ov = opts.views()?;
        let dev = device(ordinal, stream)?;
        let descale = Descale {
            q: q_descale.as_deref(),
            k: k_descale.as_deref(),
            v: v_descale.as_deref(),
            per_block: opts.descale_per_block,
        };
        // SAFETY: as in `cuda_fwd`.
        let ao = unsafe { opts.attn_packed(&ov)? }.descale(descale);
        // SAFETY: torch holds every tensor of the call alive; q, k and v are only read, out and
        // lse are fresh tensors of the call, written only by the kernel.
        let [qb, kb, vb, mut ob, mut lb]: [Borrowed; 5] =
            unsafe { Borrowed::all(&dev, &[&q, &k, &v, &out, &lse])? }
                .try_into()
                .unwrap_or_else(|_| unreachable!("five views, five borrows"));
        let (qt, kt, vt) = (qb.fp8()?, kb.fp8()?, vb.fp8()?);
        let dst = cuda::CudaOutBuffers {
            out: ob.get_mut()?,
            lse: lb.get_mut()?,
        };
        cuda::flash_attn_fp8_into(&dev, qt, kt, vt, &ao, dst)?;
        Ok(())
    })?;
    Ok(())
}

/// Backward on CUDA tensors.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_bwd(
    py: Python<'_>,
    ordinal: usize,
    stream: usize,
    q: RawView,
    k: RawView,
    v: RawView,
    out: RawView,
    lse: RawView,
    dout: RawView,
    dq: RawView,
    dk: RawView,
    dv: RawView,
    dsink: Option<RawView>,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, k, v, out, lse, dout, dq, dk, dv] = views([q, k, v, out, lse, dout, dq, dk, dv])?;
        let dsink = dsink.map(View::try_from).transpose()?;
        let ov = opts.views()?;
        let dev = device(ordinal, stream)?;
        // SAFETY: as in `cuda_fwd`.
        let ao = unsafe { opts.attn_packed(&ov)? };
        // SAFETY: as in `cuda_fwd`: the inputs are only read; dq, dk, dv (and dsink) are fresh
        // tensors of the call, written only by the kernels.
        let b = unsafe { Borrowed::all(&dev, &[&q, &k, &v, &out, &lse, &dout])? };
        let t = b.iter().map(Borrowed::get).collect::<Result<Vec<_>, _>>()?;
        // SAFETY: as above.
        let [mut dqb, mut dkb, mut dvb]: [Borrowed; 3] =
            unsafe { Borrowed::all(&dev, &[&dq, &dk, &dv])? }
                .try_into()
                .unwrap_or_else(|_| unreachable!("three views, three borrows"));
        // SAFETY: as above.
        let mut dsb = match &dsink {
            Some(w) => Some(unsafe { Borrowed::new(&dev, w)? }),
            None => None,
        };
        let dst = cuda::CudaGradBuffers {
            dq: dqb.get_mut()?,
            dk: dkb.get_mut()?,
            dv: dvb.get_mut()?,
            dsink: dsb.as_mut().map(Borrowed::get_mut).transpose()?,
        };
        cuda::flash_attn_backward_into(&dev, t[0], t[1], t[2], t[3], t[4], t[5], &ao, dst)?;
        Ok(())
    })?;
    Ok(())
}

/// Decoding over CUDA KV caches (f32/f16/bf16, or FP8 with `k_descale`/`v_descale`), appending
/// in place.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_kvcache(
    py: Python<'_>,
    ordinal: usize,
    stream: usize,
    q: RawView,
    k_cache: RawView,
    v_cache: RawView,
    cache_seqlens: Vec<i32>,
    out: RawView,
    lse: RawView,
    opts: Opts,
    kv: KvOpts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, kc, vc, out, lse] = views([q, k_cache, v_cache, out, lse])?;
        kc.check_disjoint([&vc, &q])?;
        let ov = opts.views()?;
        let dev = device(ordinal, stream)?;
        let opt = |r: &Option<RawView>| r.clone().map(View::try_from).transpose();
        let (kn, vn, cos, sin) = (
            opt(&kv.k)?,
            opt(&kv.v)?,
            opt(&kv.rotary_cos)?,
            opt(&kv.rotary_sin)?,
        );
        // SAFETY: torch holds every tensor alive; the caches are written in place and checked
        // disjoint from q and from each other; out and lse are fresh tensors of the call, written
        // only by the kernels.
        let (qb, mut kcb, mut vcb, mut ob, mut lb) = unsafe {
            (
                Borrowed::new(&dev, &q)?,
                Borrowed::new(&dev, &kc)?,
                Borrowed::new(&dev, &vc)?,
                Borrowed::new(&dev, &out)?,
                Borrowed::new(&dev, &lse)?,
            )
        };
        let new_kv = match (&kn, &vn) {
            // SAFETY: as above; read only.
            (Some(k), Some(v)) => {
                Some(unsafe { (Borrowed::new(&dev, k)?, Borrowed::new(&dev, v)?) })
            }
            (None, None) => None,
            _ => return Err(BindError::Value("k and v must be given together".into())),
        };
        // SAFETY: the option tables and the rotary cos/sin are host tensors the Python layer keeps
        // alive for the call.
        let mut ko = KvCacheOptions::default().attn(unsafe { opts.attn(&ov)? });
        match (&cos, &sin) {
            // SAFETY: as above.
            (Some(c), Some(s)) => unsafe {
                ko = ko.rotary(c.tensor()?, s.tensor()?, kv.rotary_interleaved);
            },
            (None, None) => {}
            _ => {
                return Err(BindError::Value(
                    "rotary_cos and rotary_sin must be given together".into(),
                ))
            }
        }
        let ko = kv.index_options(ko);
        let nk = match &new_kv {
            Some((k, v)) => Some((k.get()?, v.get()?)),
            None => None,
        };
        let dst = cuda::CudaOutBuffers {
            out: ob.get_mut()?,
            lse: lb.get_mut()?,
        };
        if matches!(kc.dt, Dt::F8E4M3 | Dt::F8E5M2) {
            let descale = Descale {
                q: None,
                k: kv.k_descale.as_deref(),
                v: kv.v_descale.as_deref(),
                per_block: false,
            };
            cuda::flash_attn_with_kvcache_fp8_into(
                &dev,
                qb.get()?,
                kcb.fp8_mut()?,
                vcb.fp8_mut()?,
                &cache_seqlens,
                nk,
                &ko.descale(descale),
                dst,
            )?
        } else {
            cuda::flash_attn_with_kvcache_into(
                &dev,
                qb.get()?,
                kcb.get_mut()?,
                vcb.get_mut()?,
                &cache_seqlens,
                nk,
                &ko,
                dst,
            )?
        };
        Ok(())
    })?;
    Ok(())
}

//! torch CUDA tensors through flashattn's CUDA backend (its tests, tests/test_cuda.py, passed on
//! an H200; `FLASHATTN_PY_CUDA=0` turns the path off in the Python layer).
//!
//! Work is queued on the stream torch is using (`torch.cuda.current_stream().cuda_stream`), in
//! the device's primary context (the one torch's runtime uses), with no synchronisation inside a
//! call. Inputs, in-place caches and the forward's `out` and `lse` are torch's memory, borrowed as
//! cudarc slices that are leaked, never freed, when the call ends ([`Borrowed`]): the forward
//! writes into them directly. The backward's gradients and the decode output are still allocated
//! by the library on that stream and copied into torch's tensors on the same stream (an O(N·d)
//! device copy beside the attention's work).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use flashattn::cuda::cudarc::driver::{sys, CudaStream};
use flashattn::cuda::{self, CudaDevice, CudaTensor, DeviceBuffer};
use flashattn::AttnOptions;
use pyo3::prelude::*;

use crate::errors::BindError;
use crate::view::{Dt, RawView, View};
use crate::{views, KvOpts, Opts};

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

/// torch's memory as a [`CudaTensor`] for the length of one call: leaked (not freed) on drop.
struct Borrowed(Option<CudaTensor>);

impl Borrowed {
    /// # Safety
    /// `v` describes a live CUDA tensor of `dev`'s device that torch keeps alive for the call.
    unsafe fn new(dev: &CudaDevice, v: &View) -> Result<Self, BindError> {
        let (ptr, len) = (v.addr() as sys::CUdeviceptr, v.extent());
        let s = dev.stream();
        // SAFETY: `ptr` is the device address of `len` elements of this dtype (torch's tensor,
        // alive for the call); the slice never frees it (`Drop` leaks it).
        let buf = match v.dt {
            Dt::F32 => DeviceBuffer::F32(s.upgrade_device_ptr(ptr, len)),
            Dt::F16 => DeviceBuffer::F16(s.upgrade_device_ptr(ptr, len)),
            Dt::BF16 => DeviceBuffer::BF16(s.upgrade_device_ptr(ptr, len)),
            _ => {
                return Err(BindError::Type(format!(
                    "{}: CUDA tensors take float32, float16 or bfloat16",
                    v.name
                )))
            }
        };
        Ok(Borrowed(Some(CudaTensor::from_buffer(
            buf, &v.shape, &v.strides,
        ))))
    }

    /// Every view of `views`, in order (see [`Borrowed::new`]).
    ///
    /// # Safety
    /// As [`Borrowed::new`], for each view.
    unsafe fn all(dev: &CudaDevice, views: &[&View]) -> Result<Vec<Self>, BindError> {
        views.iter().map(|v| Self::new(dev, v)).collect()
    }

    fn get(&self) -> &CudaTensor {
        self.0.as_ref().expect("borrowed until drop")
    }

    fn get_mut(&mut self) -> &mut CudaTensor {
        self.0.as_mut().expect("borrowed until drop")
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            // torch owns the memory: give the pointer back without freeing it.
            match t.into_buffer() {
                DeviceBuffer::F32(s) => {
                    s.leak();
                }
                DeviceBuffer::F16(s) => {
                    s.leak();
                }
                DeviceBuffer::BF16(s) => {
                    s.leak();
                }
            }
        }
    }
}

/// Copies a contiguous library result into torch's contiguous tensor `dst`, on the stream.
fn copy_into(dev: &CudaDevice, src: &CudaTensor, dst: &View) -> Result<(), BindError> {
    dst.require_contiguous()?;
    let (ptr, len) = (dst.addr() as sys::CUdeviceptr, dst.extent());
    if src.buffer().len() != len {
        return Err(BindError::Value(format!(
            "{}: {} elements, but the result has {}",
            dst.name,
            len,
            src.buffer().len()
        )));
    }
    let s = dev.stream();
    let err = |e: cuda::cudarc::driver::DriverError| {
        BindError::Value(format!("cuMemcpyDtoDAsync into {} failed: {e}", dst.name))
    };
    // SAFETY: `ptr` is the device address of `len` contiguous elements of `dst`'s dtype (a fresh
    // torch tensor, alive for the call, written by nothing else); the slice is leaked, not freed.
    unsafe {
        match (src.buffer(), dst.dt) {
            (DeviceBuffer::F32(a), Dt::F32) => {
                let mut b = s.upgrade_device_ptr::<f32>(ptr, len);
                let r = s.memcpy_dtod(a, &mut b);
                b.leak();
                r.map_err(err)
            }
            (DeviceBuffer::F16(a), Dt::F16) => {
                let mut b = s.upgrade_device_ptr::<half::f16>(ptr, len);
                let r = s.memcpy_dtod(a, &mut b);
                b.leak();
                r.map_err(err)
            }
            (DeviceBuffer::BF16(a), Dt::BF16) => {
                let mut b = s.upgrade_device_ptr::<half::bf16>(ptr, len);
                let r = s.memcpy_dtod(a, &mut b);
                b.leak();
                r.map_err(err)
            }
            _ => Err(BindError::Type(format!(
                "{}: dtype differs from the result's",
                dst.name
            ))),
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
        let dev = device(ordinal, stream)?;
        let ao = cuda_opts(&opts)?;
        // SAFETY: torch holds every tensor of the call alive; inputs are only read, out and lse
        // are fresh tensors of the call, written only by the kernel.
        let [qb, kb, vb, mut ob, mut lb]: [Borrowed; 5] =
            unsafe { Borrowed::all(&dev, &[&q, &k, &v, &out, &lse])? }
                .try_into()
                .unwrap_or_else(|_| unreachable!("five views, five borrows"));
        let dst = cuda::CudaOutBuffers {
            out: ob.get_mut(),
            lse: lb.get_mut(),
        };
        match &opts.cu_seqlens {
            Some((cq, ck)) => {
                cuda::flash_attn_varlen_into(&dev, qb.get(), kb.get(), vb.get(), cq, ck, &ao, dst)
            }
            None => cuda::flash_attn_into(&dev, qb.get(), kb.get(), vb.get(), &ao, dst),
        }?;
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
        let dev = device(ordinal, stream)?;
        let ao = cuda_opts(&opts)?;
        // SAFETY: as in `cuda_fwd`.
        let b = unsafe { Borrowed::all(&dev, &[&q, &k, &v, &out, &lse, &dout])? };
        let t = |i: usize| b[i].get();
        let g = match &opts.cu_seqlens {
            Some((cq, ck)) => cuda::flash_attn_varlen_backward(
                &dev,
                t(0),
                t(1),
                t(2),
                t(3),
                t(4),
                t(5),
                cq,
                ck,
                &ao,
            ),
            None => cuda::flash_attn_backward(&dev, t(0), t(1), t(2), t(3), t(4), t(5), &ao),
        }?;
        copy_into(&dev, &g.dq, &dq)?;
        copy_into(&dev, &g.dk, &dk)?;
        copy_into(&dev, &g.dv, &dv)?;
        match (&dsink, &g.dsink) {
            (Some(w), Some(s)) => copy_into(&dev, s, w),
            (None, None) => Ok(()),
            _ => Err(BindError::Value(
                "dsink must be given exactly when the call has a learnable_sink".into(),
            )),
        }
    })?;
    Ok(())
}

/// Decoding over CUDA KV caches, appending in place.
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
        let dev = device(ordinal, stream)?;
        let opt = |r: &Option<RawView>| r.clone().map(View::try_from).transpose();
        let (kn, vn, cos, sin) = (
            opt(&kv.k)?,
            opt(&kv.v)?,
            opt(&kv.rotary_cos)?,
            opt(&kv.rotary_sin)?,
        );
        if kv.k_descale.is_some() || kv.v_descale.is_some() {
            return Err(BindError::Value(
                "FP8 KV caches are not wired for CUDA tensors from Python yet".into(),
            ));
        }
        // SAFETY: torch holds every tensor alive; the caches are written in place and checked
        // disjoint from q and from each other.
        let (qb, mut kcb, mut vcb) = unsafe {
            (
                Borrowed::new(&dev, &q)?,
                Borrowed::new(&dev, &kc)?,
                Borrowed::new(&dev, &vc)?,
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
        if cos.is_some() || sin.is_some() {
            return Err(BindError::Value(
                "rotary with CUDA tensors is not wired from Python yet".into(),
            ));
        }
        let ko = kv.index_options(flashattn::KvCacheOptions::default().attn(cuda_opts(&opts)?));
        let nk = new_kv.as_ref().map(|(k, v)| (k.get(), v.get()));
        let res = cuda::flash_attn_with_kvcache(
            &dev,
            qb.get(),
            kcb.get_mut(),
            vcb.get_mut(),
            &cache_seqlens,
            nk,
            &ko,
        )?;
        copy_into(&dev, &res.out, &out)?;
        copy_into(&dev, &res.lse, &lse)
    })?;
    Ok(())
}

/// The attention options for a CUDA call (the option tensors are small host copies).
fn cuda_opts(opts: &Opts) -> Result<AttnOptions<'static>, BindError> {
    if opts.alibi_slopes.is_some() || opts.learnable_sink.is_some() {
        return Err(BindError::Value(
            "alibi_slopes and learnable_sink with CUDA tensors are not wired from Python yet"
                .into(),
        ));
    }
    let mut o = AttnOptions::default()
        .softmax_scale(opts.softmax_scale)
        .causal(opts.causal)
        .window(opts.window_left, opts.window_right);
    if opts.softcap != 0.0 {
        o = o.softcap(opts.softcap);
    }
    if opts.dropout_p != 0.0 {
        o = o.dropout(opts.dropout_p, opts.seed);
    }
    Ok(o)
}

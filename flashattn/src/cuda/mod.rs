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

mod backward;
mod cache;
mod decode;
mod fp8;
mod key;
mod nvrtc;
mod probe;
mod tma;

pub use backward::{
    backward_kernel_key, backward_launch_description, flash_attn_backward,
    flash_attn_varlen_backward, BackwardLaunch, CudaAttnGrads, BWD_FIELDS,
};
/// The cudarc this backend is built on (0.19, CUDA 13.0 API), for streams, events and slices of
/// matching types.
pub use cudarc;
pub use decode::{
    choose_splits, choose_splits_for, decode_launch_description, decode_launch_description_fp8,
    decode_launch_description_with, flash_attn_with_kvcache, DecodeKernel, DecodeLaunch, GpuShape,
    DECODE_FIELDS,
};
pub use fp8::{
    flash_attn_fp8, flash_attn_varlen_fp8, flash_attn_with_kvcache_fp8, launch_description_fp8,
    CudaFp8Tensor,
};
pub use key::{Arch, KernelKey, KernelKind, Tiles, HEAD_DIM_STEP};
pub use nvrtc::{compile, version as nvrtc_version, CompiledKernel};
pub use tma::TmaSpec;

use crate::error::{ErrorKind, Result};
use crate::params::{self, AttnOptions, Params};
use crate::tensor::{Buffer, DType, Slice, Tensor, TensorRef, ViewDesc};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DriverError, LaunchConfig,
    PushKernelArg,
};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest sequence the kernels accept: their in-sequence index arithmetic is 32-bit, and with
/// sides clamped to seqlen_q + seqlen_k no intermediate exceeds 2^31.
pub const MAX_SEQLEN: usize = 1 << 29;
/// grid.y (heads) and grid.z (batch) are limited to 65535 by CUDA.
const MAX_GRID_YZ: usize = 65_535;
/// Entries per sequence of the table the kernels read (common.cuh: SEQ_FIELDS).
pub const SEQ_FIELDS: usize = 7;

fn driver_err(call: &'static str) -> impl Fn(DriverError) -> crate::Error {
    move |e| {
        ErrorKind::CudaDriver {
            call,
            message: e.to_string(),
        }
        .into()
    }
}

/// Where a kernel came from when it was first needed on this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelOrigin {
    /// Already loaded on this device.
    Memory,
    /// A cubin from the disk cache.
    Disk,
    /// Compiled by NVRTC now (and written to the disk cache when one is available).
    Compiled,
}

/// How [`CudaDevice::prepare`] got a kernel, and how long it took.
#[derive(Clone, Copy, Debug)]
pub struct Prepared {
    pub origin: KernelOrigin,
    pub time: Duration,
}

/// What [`precompile`] did for one kernel variant.
#[derive(Clone, Debug)]
pub struct Precompiled {
    pub key: KernelKey,
    /// The compile time, `Ok(None)` for a variant already in the cache, or the compile error.
    pub compiled: std::result::Result<Option<Duration>, crate::Error>,
}

/// What [`precompile`] did: the NVRTC version it compiled with (part of every cache file's key)
/// and the outcome per variant.
#[derive(Clone, Debug)]
pub struct Precompile {
    pub nvrtc: (i32, i32),
    pub variants: Vec<Precompiled>,
}

/// Compiles `keys` for `arch` into the disk cache (see [`KernelOrigin::Disk`]) on all cores,
/// skipping variants whose cubin is already there, so that later processes on a GPU of that
/// architecture load kernels instead of compiling them. Needs NVRTC only, no GPU: a cache filled on
/// one machine serves another with the same NVRTC major.minor. Errors only when NVRTC is missing
/// or no cache directory is configured; per-variant compile errors are in the returned list.
pub fn precompile(keys: &[KernelKey], arch: Arch) -> Result<Precompile> {
    use rayon::prelude::*;
    let version = nvrtc::version()?;
    if cache::dir().is_none() {
        return Err(ErrorKind::CudaUnavailable {
            reason: "no kernel cache directory (FLASHATTN_CACHE_DIR is empty and HOME is unset)"
                .into(),
        }
        .into());
    }
    let variants = keys
        .par_iter()
        .map(|key| {
            let path = cache::path(key, arch, version).expect("checked above");
            if cache::exists(&path) {
                return Precompiled {
                    key: *key,
                    compiled: Ok(None),
                };
            }
            let compiled = nvrtc::compile(key, arch).map(|c| {
                cache::store(&path, &c.cubin);
                Some(c.compile_time)
            });
            Precompiled {
                key: *key,
                compiled,
            }
        })
        .collect();
    Ok(Precompile {
        nvrtc: version,
        variants,
    })
}

/// One GPU (a CUDA context) and the stream flashattn launches on.
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    name: String,
    sm_count: usize,
    smem_optin: usize,
    kernels: Arc<Mutex<HashMap<KernelKey, CudaFunction>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` with a new stream. Without a driver, without a device, or with a bad
    /// ordinal this returns [`ErrorKind::CudaUnavailable`] / [`ErrorKind::CudaDriver`]; it never
    /// panics and prints nothing.
    ///
    /// The context is opened without cudarc's per-buffer event tracking
    /// (`CudaContext::disable_event_tracking`): flashattn queues everything on this device's one
    /// stream, which orders every use already. Buffers made through this device and then used on
    /// another stream are the caller's to synchronize; [`CudaDevice::with_stream`] keeps the
    /// tracking settings of the caller's context.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        probe::driver()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            let message = e.to_string();
            if message.contains("NO_DEVICE") || message.contains("INVALID_DEVICE") {
                crate::Error::from(ErrorKind::CudaUnavailable {
                    reason: format!("device {ordinal}: {message}"),
                })
            } else {
                ErrorKind::CudaDriver {
                    call: "cuInit / cuDevicePrimaryCtxRetain",
                    message,
                }
                .into()
            }
        })?;
        // SAFETY: called on the context this function just made, before any buffer exists in
        // it (the flag covers buffers made afterwards). Every allocation, copy and launch of
        // flashattn through this device goes on its one stream, so the stream's order already
        // orders every use of every buffer; cudarc's per-buffer events would only add two
        // driver calls per buffer per launch (a decode launch passes ~10 buffers; with the
        // release-build memsets and the separate uploads this took ~20-25 us off a decode
        // step on an H100, docs/GPU.md run 5). A caller who uses these buffers on streams of their own
        // synchronizes them (documented on `CudaDevice::new`); `with_stream` leaves the
        // caller's context as it is.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        Self::from_parts(ctx, stream)
    }

    /// flashattn on a stream the caller owns (e.g. another library's), in that stream's context.
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<CudaDevice> {
        Self::from_parts(stream.context().clone(), stream)
    }

    /// This device on another stream of its context (e.g. the stream a framework runs on now):
    /// the kernels compiled and loaded so far are shared by every such copy, so a process
    /// compiles each variant once whatever the streams. The caller orders the new stream's work
    /// with the old one's.
    pub fn on_stream(&self, stream: Arc<CudaStream>) -> CudaDevice {
        CudaDevice {
            stream,
            ..self.clone()
        }
    }

    fn from_parts(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<CudaDevice> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        let attr = |a| {
            ctx.attribute(a)
                .map(|v| v.max(0) as usize)
                .map_err(driver_err("cuDeviceGetAttribute"))
        };
        Ok(CudaDevice {
            arch: Arch {
                major: major as u32,
                minor: minor as u32,
            },
            name: ctx.name().map_err(driver_err("cuDeviceGetName"))?,
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            smem_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?,
            ctx,
            stream,
            kernels: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn arch(&self) -> Arch {
        self.arch
    }
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }
    /// The SM count and shared memory per block that launch choices depend on.
    pub fn shape(&self) -> GpuShape {
        GpuShape {
            sm_count: self.sm_count,
            smem_optin: self.smem_optin,
        }
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }

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

    fn htod<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        v: &[T],
    ) -> Result<CudaSlice<T>> {
        if v.is_empty() {
            // The driver rejects zero-byte allocations; an empty tensor gets one unread element.
            return self
                .stream
                .alloc_zeros(1)
                .map_err(driver_err("cuMemAllocAsync"));
        }
        self.stream
            .clone_htod(v)
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    }

    /// Makes the kernel of `key` ready on this device: from memory, the disk cache, or NVRTC.
    pub fn prepare(&self, key: &KernelKey) -> Result<Prepared> {
        self.function(key).map(|(_, p)| p)
    }

    fn function(&self, key: &KernelKey) -> Result<(CudaFunction, Prepared)> {
        let start = Instant::now();
        let mut kernels = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = kernels.get(key) {
            let p = Prepared {
                origin: KernelOrigin::Memory,
                time: start.elapsed(),
            };
            return Ok((f.clone(), p));
        }
        let nvrtc_version = nvrtc::version()?;
        let path = cache::path(key, self.arch, nvrtc_version);
        let cached = path.as_deref().and_then(cache::load);
        let (function, origin) = match cached.and_then(|c| self.load(key, c).ok()) {
            Some(f) => (f, KernelOrigin::Disk),
            None => {
                let compiled = nvrtc::compile(key, self.arch)?;
                if let Some(p) = &path {
                    cache::store(p, &compiled.cubin);
                }
                (self.load(key, compiled.cubin)?, KernelOrigin::Compiled)
            }
        };
        kernels.insert(*key, function.clone());
        let p = Prepared {
            origin,
            time: start.elapsed(),
        };
        Ok((function, p))
    }

    fn load(&self, key: &KernelKey, cubin: Vec<u8>) -> Result<CudaFunction> {
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(driver_err("cuModuleLoadData"))?;
        let f = module
            .load_function(key.entry())
            .map_err(driver_err("cuModuleGetFunction"))?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            key.smem_bytes() as i32,
        )
        .map_err(driver_err("cuFuncSetAttribute"))?;
        if key.min_blocks() > 1 {
            // Several CTAs of tens of KiB per SM (the tensor-core decode kernel): ask for the
            // largest shared-memory carve-out of the SM's L1 (a hint, in percent).
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .map_err(driver_err("cuFuncSetAttribute"))?;
        }
        Ok(f)
    }
}

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
    fn context(&self) -> &Arc<CudaContext> {
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
    buf: DeviceBuffer,
    shape: Vec<usize>,
    strides: Vec<usize>,
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
fn gather<T: Copy>(data: &[T], shape: &[usize], strides: &[usize]) -> Vec<T> {
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

/// What a CUDA forward call returns, on the device: `out` (q's dtype, contiguous) and `lse` (f32),
/// shaped as the CPU path's [`crate::AttnOutput`].
#[derive(Clone, Debug)]
pub struct CudaAttnOutput {
    pub out: CudaTensor,
    pub lse: CudaTensor,
}

/// [`crate::flash_attn`] on the GPU: q `[batch, seqlen_q, heads, head_dim]`, k and v
/// `[batch, seqlen_k, heads_kv, head_dim]`, queued on `dev`'s stream (returns without waiting).
pub fn flash_attn(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    opts: &AttnOptions,
) -> Result<CudaAttnOutput> {
    let p = params::batched(q, k, v, opts)?;
    forward(dev, &p, q, k, v)
}

/// [`crate::flash_attn_varlen`] on the GPU (packed layout; `cu_seqlens_*` on the host).
pub fn flash_attn_varlen(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<CudaAttnOutput> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    forward(dev, &p, q, k, v)
}

/// Caller-provided destinations of a CUDA forward ([`flash_attn_into`]): `out` with q's shape
/// and dtype and `lse` in f32 with the call's lse shape (`[batch, heads, seqlen_q]`, packed:
/// `[heads, total_q]`), both contiguous and in `dev`'s context (e.g. a framework's tensors viewed
/// as [`CudaTensor`]s). Every element is written.
#[derive(Debug)]
pub struct CudaOutBuffers<'a> {
    pub out: &'a mut CudaTensor,
    pub lse: &'a mut CudaTensor,
}

/// [`flash_attn`] writing into caller-provided buffers: no allocation, no copy.
pub fn flash_attn_into(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    opts: &AttnOptions,
    dst: CudaOutBuffers,
) -> Result<()> {
    let p = params::batched(q, k, v, opts)?;
    forward_into(dev, &p, q, k, v, dst)
}

/// [`flash_attn_varlen`] writing into caller-provided buffers (see [`flash_attn_into`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_into(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
    dst: CudaOutBuffers,
) -> Result<()> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    forward_into(dev, &p, q, k, v, dst)
}

/// Checks a caller's destination: `dtype`, `shape`'s element count, and a contiguous view of
/// exactly its buffer.
fn check_destination(
    tensor: &'static str,
    t: &CudaTensor,
    dtype: DType,
    shape: &[usize],
) -> Result<()> {
    params::destination(tensor, (t.dtype(), t.buffer().len()), dtype, shape)?;
    let numel: usize = t.shape().iter().product();
    let contiguous = crate::tensor::contiguous_strides(t.shape());
    if numel != t.buffer().len() || (numel > 1 && t.strides() != contiguous.as_slice()) {
        return Err(ErrorKind::Shape {
            tensor,
            expected: shape.to_vec(),
            got: t.shape().to_vec(),
        }
        .into());
    }
    Ok(())
}

fn forward_into(
    dev: &CudaDevice,
    p: &Params,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    dst: CudaOutBuffers,
) -> Result<()> {
    check_destination("out", dst.out, p.dtype, &p.out_shape)?;
    check_destination("lse", dst.lse, DType::F32, &p.lse_shape)?;
    let (out_ctx, lse_ctx) = (dst.out.buf.context().clone(), dst.lse.buf.context().clone());
    let contexts = [
        q.buf.context(),
        k.buf.context(),
        v.buf.context(),
        &out_ctx,
        &lse_ctx,
    ];
    let lse = match &mut dst.lse.buf {
        DeviceBuffer::F32(l) => l,
        _ => unreachable!("checked: lse is f32"),
    };
    match (&q.buf, &k.buf, &v.buf, &mut dst.out.buf) {
        (
            DeviceBuffer::F32(qb),
            DeviceBuffer::F32(kb),
            DeviceBuffer::F32(vb),
            DeviceBuffer::F32(o),
        ) => launch_forward(dev, p, None, &contexts, (qb, kb, vb), o, lse),
        (
            DeviceBuffer::F16(qb),
            DeviceBuffer::F16(kb),
            DeviceBuffer::F16(vb),
            DeviceBuffer::F16(o),
        ) => launch_forward(dev, p, None, &contexts, (qb, kb, vb), o, lse),
        (
            DeviceBuffer::BF16(qb),
            DeviceBuffer::BF16(kb),
            DeviceBuffer::BF16(vb),
            DeviceBuffer::BF16(o),
        ) => launch_forward(dev, p, None, &contexts, (qb, kb, vb), o, lse),
        _ => unreachable!("params checked q, k and v share one dtype; out was checked against it"),
    }
}

/// The kernel variant a batched [`flash_attn`] call with these arguments runs on `dev`
/// (validated as the call would be); with [`CudaDevice::prepare`], lets a caller compile it ahead
/// of time.
pub fn kernel_key(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    opts: &AttnOptions,
) -> Result<KernelKey> {
    let p = params::batched(q, k, v, opts)?;
    Ok(LaunchDescription::new(&p, None)
        .for_arch(dev.arch, ForwardKernel::from_env())
        .key)
}

/// The kernel variant that serves validated `p` (strides decide the vector-load path), on FP8
/// inputs when `fp8` (`p` then describes them as bf16, one byte per element).
fn key_for(p: &Params, fp8: bool) -> KernelKey {
    // The vector path moves 16 bytes at a time: 8 elements of 16 bits, 16 FP8 bytes.
    let unit = if fp8 { 16 } else { 8 };
    let aligned = |x: usize| x.is_multiple_of(unit);
    let layouts_aligned = [p.q, p.k, p.v]
        .iter()
        .all(|l| aligned(l.row_stride) && aligned(l.head_stride));
    let bases_aligned = p
        .seqs
        .iter()
        .all(|s| aligned(s.q_base) && aligned(s.k_base) && aligned(s.v_base));
    KernelKey {
        kind: KernelKind::Forward,
        dtype: p.dtype,
        head_dim: KernelKey::padded_head_dim(p.head_dim),
        masked: p.window_left.is_some() || p.window_right.is_some(),
        softcap: p.softcap.is_some(),
        alibi: p.alibi.is_some(),
        dropout: p.dropout.is_some(),
        vec_load: p.dtype != DType::F32 && aligned(p.head_dim) && layouts_aligned && bases_aligned,
        fp8,
    }
}

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

fn forward(
    dev: &CudaDevice,
    p: &Params,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
) -> Result<CudaAttnOutput> {
    let contexts = [q.buf.context(), k.buf.context(), v.buf.context()];
    match (&q.buf, &k.buf, &v.buf) {
        (DeviceBuffer::F32(qb), DeviceBuffer::F32(kb), DeviceBuffer::F32(vb)) => {
            run_forward(dev, p, None, contexts, (qb, kb, vb), DeviceBuffer::F32)
        }
        (DeviceBuffer::F16(qb), DeviceBuffer::F16(kb), DeviceBuffer::F16(vb)) => {
            run_forward(dev, p, None, contexts, (qb, kb, vb), DeviceBuffer::F16)
        }
        (DeviceBuffer::BF16(qb), DeviceBuffer::BF16(kb), DeviceBuffer::BF16(vb)) => {
            run_forward(dev, p, None, contexts, (qb, kb, vb), DeviceBuffer::BF16)
        }
        _ => unreachable!("params checked that q, k and v share one dtype"),
    }
}

/// Checks, compiles (or fetches) and queues the forward of validated `p` on q, k and v of element
/// type `TI` (FP8 bytes when `fp8` names their format), into a new poisoned `out` of type `TO`
/// (`wrap` names its dtype) and `lse`.
pub(crate) fn run_forward<TI, TO: cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    p: &Params,
    fp8: Option<crate::fp8::Fp8Format>,
    contexts: [&Arc<CudaContext>; 3],
    qkv: (&CudaSlice<TI>, &CudaSlice<TI>, &CudaSlice<TI>),
    wrap: fn(CudaSlice<TO>) -> DeviceBuffer,
) -> Result<CudaAttnOutput> {
    let s = &dev.stream;
    let mut lse = alloc_output::<f32>(s, p.lse_len())?;
    let mut out = alloc_output::<TO>(s, p.out_len())?;
    launch_forward(dev, p, fp8, &contexts, qkv, &mut out, &mut lse)?;
    Ok(CudaAttnOutput {
        out: CudaTensor::contiguous(wrap(out), &p.out_shape),
        lse: CudaTensor::contiguous(DeviceBuffer::F32(lse), &p.lse_shape),
    })
}

/// Checks, compiles (or fetches) and queues the forward of validated `p` into `out` (p.out_len()
/// elements of type `TO`) and `lse` (p.lse_len()).
fn launch_forward<TI, TO: cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    p: &Params,
    fp8: Option<crate::fp8::Fp8Format>,
    contexts: &[&Arc<CudaContext>],
    qkv: (&CudaSlice<TI>, &CudaSlice<TI>, &CudaSlice<TI>),
    out: &mut CudaSlice<TO>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    let desc = LaunchDescription::new(p, fp8).for_arch(dev.arch, ForwardKernel::from_env());
    check_launchable(dev, p, &desc.key, contexts)?;
    let (function, _) = dev.function(&desc.key)?;
    let plan = Plan::new(dev, desc)?;
    plan.launch(dev, &function, qkv, out, lse)
}

/// Everything a forward launch passes besides the tensors, computed on the host from validated
/// parameters: what the GPU path uploads and launches, and what the host emulation of the kernels
/// (tests/cuda_emulated.rs) runs, so both exercise the same argument logic.
#[derive(Clone, Debug)]
#[doc(hidden)]
pub struct LaunchDescription {
    pub key: KernelKey,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub smem_bytes: u32,
    /// The per-sequence table (packed calls only; batched calls pass null and batch strides):
    /// SEQ_FIELDS i64 per launched sequence, the last one possibly the tail of packed rows.
    pub table: Option<Vec<i64>>,
    /// ALiBi slopes, one row of `heads` per launched sequence, when ALiBi is on.
    pub slopes: Option<Vec<f32>>,
    pub heads: i32,
    pub heads_kv: i32,
    pub head_dim: i32,
    /// q row, q head, k row, k head, v row, v head strides, lse head stride.
    pub strides: [i64; 7],
    pub softmax_scale: f32,
    pub softcap: f32,
    /// Window sides, -1 unbounded, clamped to seqlen_q + seqlen_k.
    pub window: (i32, i32),
    /// Batched calls: seqlen_q, seqlen_k and the batch strides of q, k, v.
    pub batch_seqlens: (i32, i32),
    pub batch_strides: [i64; 3],
    /// FP8 inputs: the score scale and the v factor per (launched sequence, kv head), 2 each
    /// (common.cuh: FLASH_FWD_PARAMS); `None` (a null pointer) otherwise.
    pub descale: Option<Vec<f32>>,
    /// FP8 inputs: 1 for e5m2, 0 for e4m3 (and for 16-bit and f32 inputs).
    pub fp8_e5m2: i32,
    /// Learnable sinks: the logit of (launched sequence, head), `heads` per launched sequence,
    /// -inf for the tail of packed rows after the last sequence (no sink: out 0, lse -inf, as on
    /// the CPU); `None` (a null pointer) without sinks.
    pub sink: Option<Vec<f32>>,
    pub dropout: DropoutArgs,
    pub out_len: usize,
    pub lse_len: usize,
    pub out_shape: Vec<usize>,
    pub lse_shape: Vec<usize>,
    /// The tensor maps of q, k and v, for the warp-specialised sm_90a forward only.
    pub tma: Option<[TmaSpec; 3]>,
}

/// The dropout arguments every attention kernel takes last (common.cuh: FA_DROPOUT_PARAMS): the
/// seed's halves, the keep threshold and 1 / (1 - p); threshold 2^32 and scale 1 without dropout.
#[derive(Clone, Copy, Debug, PartialEq)]
#[doc(hidden)]
pub struct DropoutArgs {
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub threshold: i64,
    pub scale: f32,
}

impl DropoutArgs {
    pub(crate) fn new(d: Option<crate::dropout::Dropout>) -> DropoutArgs {
        d.map_or(
            DropoutArgs {
                seed_lo: 0,
                seed_hi: 0,
                threshold: 1 << 32,
                scale: 1.0,
            },
            |d| DropoutArgs {
                seed_lo: d.seed() as u32,
                seed_hi: (d.seed() >> 32) as u32,
                threshold: d.threshold() as i64,
                scale: d.scale(),
            },
        )
    }

    /// Pushes the four arguments (u32, u32, i64, f32).
    pub(crate) fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.seed_lo)
            .arg(&self.seed_hi)
            .arg(&self.threshold)
            .arg(&self.scale);
    }
}

impl LaunchDescription {
    /// The launch of validated `p`; `fp8` names the format of FP8 inputs (their factors are
    /// `p.descale`).
    pub(crate) fn new(p: &Params, fp8: Option<crate::fp8::Fp8Format>) -> LaunchDescription {
        let key = key_for(p, fp8.is_some());
        // Packed rows after the last sequence get out = 0 and lse = -inf, as on the CPU: they are
        // launched as one more sequence that sees no key (the kernels' fully-masked-row rule).
        let used = p.seqs.last().map_or(0, |s| s.out_row0 + s.seqlen_q);
        let tail = (p.packed && used < p.total_q).then(|| crate::params::Seq {
            seqlen_q: p.total_q - used,
            seqlen_k: 0,
            q_base: used * p.q.row_stride,
            k_base: 0,
            v_base: 0,
            out_row0: used,
            lse_base: used,
            k_row0: 0,
        });
        let seqs: Vec<_> = p.seqs.iter().copied().chain(tail).collect();
        let max_q = seqs.iter().map(|s| s.seqlen_q).max().unwrap_or(0);
        let max_k = seqs.iter().map(|s| s.seqlen_k).max().unwrap_or(0);
        let table = p.packed.then(|| {
            seqs.iter()
                .flat_map(|s| {
                    [
                        s.seqlen_q, s.seqlen_k, s.q_base, s.k_base, s.v_base, s.out_row0,
                        s.lse_base,
                    ]
                })
                .map(|x| x as i64)
                .collect::<Vec<i64>>()
        });
        let slopes = p.alibi.as_ref().map(|a| {
            let mut a = a.clone();
            a.resize(seqs.len() * p.heads, 0.0); // the tail sequence's row, never used
            a
        });
        // A window side wider than any distance in the batch sees the same keys as an unbounded
        // one; clamping keeps the kernels' 32-bit arithmetic exact (MAX_SEQLEN).
        let side = |w: Option<usize>| w.map_or(-1, |w| w.min(max_q + max_k) as i32);
        let stride = |f: fn(&crate::params::Seq) -> usize| p.seqs.get(1).map_or(0, f) as i64;
        let descale = fp8.map(|_| {
            let d = p.descale.as_ref().expect("FP8 params carry their factors");
            let mut t: Vec<f32> = d
                .score_scale
                .iter()
                .zip(&d.out_scale)
                .flat_map(|(&s, &o)| [s, o])
                .collect();
            t.resize(2 * seqs.len() * p.heads_kv, 1.0); // the tail sequence's, never used
            t
        });
        LaunchDescription {
            grid: (
                max_q.div_ceil(key.tiles().block_m) as u32,
                p.heads as u32,
                seqs.len() as u32,
            ),
            threads: key.threads() as u32,
            smem_bytes: key.smem_bytes() as u32,
            table,
            slopes,
            heads: p.heads as i32,
            heads_kv: p.heads_kv as i32,
            head_dim: p.head_dim as i32,
            strides: [
                p.q.row_stride as i64,
                p.q.head_stride as i64,
                p.k.row_stride as i64,
                p.k.head_stride as i64,
                p.v.row_stride as i64,
                p.v.head_stride as i64,
                p.lse_head_stride as i64,
            ],
            softmax_scale: p.softmax_scale,
            softcap: p.softcap.unwrap_or(1.0),
            window: (side(p.window_left), side(p.window_right)),
            batch_seqlens: (max_q as i32, max_k as i32),
            batch_strides: [
                stride(|s| s.q_base),
                stride(|s| s.k_base),
                stride(|s| s.v_base),
            ],
            descale,
            fp8_e5m2: (fp8 == Some(crate::fp8::Fp8Format::E5M2)) as i32,
            sink: sink_table(p, seqs.len()),
            dropout: DropoutArgs::new(p.dropout),
            out_len: p.out_len(),
            lse_len: p.lse_len(),
            out_shape: p.out_shape.clone(),
            lse_shape: p.lse_shape.clone(),
            tma: None,
            key,
        }
    }

    /// The same launch on the kernel `choice` names for a GPU of `arch`: the sm_90a forward
    /// (fwd_sm90.cu: its key, its tiles, grid and shared memory) on compute capability 9.0 where
    /// it serves the call ([`KernelKey::sm90_forward`]) and `choice` asks for it; else unchanged.
    pub fn for_arch(mut self, arch: Arch, choice: ForwardKernel) -> LaunchDescription {
        if choice == ForwardKernel::Fa2 || arch != Arch::SM90 {
            return self;
        }
        let Some(mut key) = self.key.sm90_forward() else {
            return self;
        };
        if choice == ForwardKernel::Sm90Ws {
            key.kind = KernelKind::ForwardSm90Ws;
        }
        self.grid.0 = (self.batch_seqlens.0 as usize).div_ceil(key.tiles().block_m) as u32;
        self.threads = key.threads() as u32;
        self.smem_bytes = key.smem_bytes() as u32;
        self.key = key;
        if key.kind == KernelKind::ForwardSm90Ws {
            self.tma = Some(self.tensor_maps());
        }
        self
    }

    /// The tensor maps of q, k and v (cuda/tma.rs): a batched call's rows are one sequence's
    /// (batch_seqlens), a packed call's reach the last row any sequence uses.
    fn tensor_maps(&self) -> [TmaSpec; 3] {
        let t = self.key.tiles();
        let [q_row, q_head, k_row, k_head, v_row, v_head, _] = self.strides.map(|x| x as u64);
        let (batches, q_rows, k_rows, v_rows, batch_strides) = match &self.table {
            Some(table) => {
                // Table fields per sequence: seqlen_q, seqlen_k, q_base, k_base, v_base,
                // out_row0, lse_base (element offsets).
                let end = |f: &dyn Fn(&[i64]) -> i64| {
                    table.chunks(7).map(f).max().unwrap_or(0).max(1) as u64
                };
                let q_rows = end(&|s| s[5] + s[0]);
                let k_rows = end(&|s| s[3] / k_row as i64 + s[1]);
                let v_rows = end(&|s| s[4] / v_row as i64 + s[1]);
                // One batch: its stride is never stepped over, but must be a valid one.
                (
                    1,
                    q_rows,
                    k_rows,
                    v_rows,
                    [q_rows * q_row, k_rows * k_row, v_rows * v_row],
                )
            }
            None => {
                let (sq, sk) = (
                    self.batch_seqlens.0.max(1) as u64,
                    self.batch_seqlens.1.max(1) as u64,
                );
                (
                    self.grid.2.max(1) as u64,
                    sq,
                    sk,
                    sk,
                    self.batch_strides.map(|x| x as u64),
                )
            }
        };
        let spec =
            |rows: u64, heads: i32, row: u64, head: u64, batch: u64, box_rows: usize| TmaSpec {
                dims: [self.head_dim as u64, rows, heads as u64, batches],
                strides: [2 * row, 2 * head, 2 * batch],
                box_rows: box_rows as u32,
            };
        [
            spec(
                q_rows,
                self.heads,
                q_row,
                q_head,
                batch_strides[0],
                t.block_m,
            ),
            spec(
                k_rows,
                self.heads_kv,
                k_row,
                k_head,
                batch_strides[1],
                t.block_n,
            ),
            spec(
                v_rows,
                self.heads_kv,
                v_row,
                v_head,
                batch_strides[2],
                t.block_n,
            ),
        ]
    }

    /// Nothing to launch: no query row, or no sequence.
    pub fn is_empty(&self) -> bool {
        self.out_len == 0 || self.grid.0 == 0 || self.grid.2 == 0
    }
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

/// The launch a batched forward with these host views and options would make (validated as the
/// call would be). For the host emulation test of the kernels.
#[doc(hidden)]
pub fn launch_description(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cu_seqlens: Option<(&[i32], &[i32])>,
    opts: &AttnOptions,
) -> Result<LaunchDescription> {
    let p = match cu_seqlens {
        Some((cq, ck)) => params::varlen(q, k, v, cq, ck, opts)?,
        None => params::batched(q, k, v, opts)?,
    };
    Ok(LaunchDescription::new(&p, None))
}

/// Which forward kernel serves f16/bf16 calls on a Hopper GPU (compute capability 9.0) where both
/// could: the warpgroup kernel (fwd_sm90.cu; the default: 1.0-1.6x fwd.cu on an H200, docs/CUDA.md)
/// or, with `FLASHATTN_CUDA_FWD=fa2`, the FlashAttention-2-class one (fwd.cu). Read once per
/// process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ForwardKernel {
    Fa2,
    #[default]
    Sm90,
    /// fwd_sm90_ws.cu (`FLASHATTN_CUDA_FWD=sm90ws`): warp-specialised, TMA loads.
    Sm90Ws,
}

impl ForwardKernel {
    pub fn from_env() -> ForwardKernel {
        static KERNEL: std::sync::OnceLock<ForwardKernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| match std::env::var("FLASHATTN_CUDA_FWD").as_deref() {
            Ok("fa2") => ForwardKernel::Fa2,
            Ok("sm90ws") => ForwardKernel::Sm90Ws,
            _ => ForwardKernel::Sm90,
        })
    }
}

/// A [`LaunchDescription`] with its table and slopes on the device.
struct Plan {
    d: LaunchDescription,
    table: Option<CudaSlice<i64>>,
    slopes: Option<CudaSlice<f32>>,
    descale: Option<CudaSlice<f32>>,
    sink: Option<CudaSlice<f32>>,
}

impl Plan {
    fn new(dev: &CudaDevice, d: LaunchDescription) -> Result<Plan> {
        let table = d.table.as_deref().map(|t| dev.htod(t)).transpose()?;
        let slopes = d.slopes.as_deref().map(|t| dev.htod(t)).transpose()?;
        let descale = d.descale.as_deref().map(|t| dev.htod(t)).transpose()?;
        let sink = d.sink.as_deref().map(|t| dev.htod(t)).transpose()?;
        Ok(Plan {
            d,
            table,
            slopes,
            descale,
            sink,
        })
    }

    /// Queues the kernel: q, k and v of element type `TI` (the key's: f32, f16, bf16, or FP8
    /// bytes), out of type `TO` (bf16 for FP8 inputs, else `TI`).
    fn launch<TI, TO>(
        &self,
        dev: &CudaDevice,
        function: &CudaFunction,
        (q, k, v): (&CudaSlice<TI>, &CudaSlice<TI>, &CudaSlice<TI>),
        out: &mut CudaSlice<TO>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let d = &self.d;
        let out_size = if d.key.dtype == DType::F32 { 4 } else { 2 };
        let in_size = if d.key.fp8 { 1 } else { out_size };
        assert!(
            std::mem::size_of::<TI>() == in_size
                && std::mem::size_of::<TO>() == out_size
                && d.descale.is_some() == d.key.fp8,
            "the forward's element types and factors match its variant"
        );
        if d.is_empty() {
            return Ok(());
        }
        let null: u64 = 0;
        // The warp-specialised kernel's tensor maps, encoded over q, k and v's device memory.
        let maps = match &d.tma {
            Some(specs) => {
                use cudarc::driver::DevicePtr;
                let s = &dev.stream;
                let (qp, _qr) = q.device_ptr(s);
                let (kp, _kr) = k.device_ptr(s);
                let (vp, _vr) = v.device_ptr(s);
                Some([
                    specs[0].encode(qp, d.key.dtype)?,
                    specs[1].encode(kp, d.key.dtype)?,
                    specs[2].encode(vp, d.key.dtype)?,
                ])
            }
            None => None,
        };
        let mut b = dev.stream.launch_builder(function);
        b.arg(q).arg(k).arg(v).arg(out).arg(lse);
        match &self.table {
            Some(t) => b.arg(t),
            None => b.arg(&null),
        };
        match &self.slopes {
            Some(t) => b.arg(t),
            None => b.arg(&null),
        };
        b.arg(&d.heads).arg(&d.heads_kv).arg(&d.head_dim);
        for s in &d.strides {
            b.arg(s);
        }
        b.arg(&d.softmax_scale).arg(&d.softcap);
        b.arg(&d.window.0).arg(&d.window.1);
        b.arg(&d.batch_seqlens.0).arg(&d.batch_seqlens.1);
        for s in &d.batch_strides {
            b.arg(s);
        }
        match &self.descale {
            Some(t) => b.arg(t),
            None => b.arg(&null),
        };
        b.arg(&d.fp8_e5m2);
        match &self.sink {
            Some(t) => b.arg(t),
            None => b.arg(&null),
        };
        d.dropout.push(&mut b);
        if let Some(m) = &maps {
            b.arg(&m[0]).arg(&m[1]).arg(&m[2]);
        }
        let cfg = LaunchConfig {
            grid_dim: d.grid,
            block_dim: (d.threads, 1, 1),
            shared_mem_bytes: d.smem_bytes,
        };
        // SAFETY: the argument list matches `flash_fwd` in fwd.cu / fwd_f32.cu: pointers to TI,
        // TI, TI, TO, f32, i64 (or null: batched), f32 (or null: no ALiBi, then never read);
        // i32 x3; i64 x7; f32 x2; i32 x4; i64 x3; f32 pointer (or null), i32; f32 pointer (or
        // null); u32 x2, i64, f32
        // (a null pointer is pushed as a 64-bit zero); for fwd_sm90_ws.cu then three TmaDesc
        // maps encoded over q, k and v themselves. TI and TO are the element types the
        // variant was compiled for: the callers pick the key from the same buffers (forward:
        // one dtype, FA_FP8_INPUT off; forward_fp8: bytes in, bf16 out, FA_FP8_INPUT on), and a
        // descale table is pushed exactly for FP8 keys. Params validated every view, so each
        // element the kernels address (bases and row/head strides over the sequence table or the
        // batch strides) lies inside q, k and v; out and lse hold out_len / lse_len elements, the
        // table 7 per launched sequence, the slopes one row and the descale table 2 · heads_kv
        // factors per launched sequence, the sinks `heads` logits per launched sequence.
        unsafe { b.launch(cfg) }.map_err(driver_err("cuLaunchKernel"))?;
        Ok(())
    }
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
fn alloc_output<T: cudarc::driver::DeviceRepr>(
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

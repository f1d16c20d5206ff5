//! The forward pass on the GPU: [`flash_attn`] and [`flash_attn_into`] (batched or packed, as
//! `opts.cu_seqlens` says), the CPU calls' semantics (same validation, `crate::params`) with q, k and v in GPU memory; the
//! launch they make ([`LaunchDescription`], computed on the host and shared with the host
//! emulation of the kernels) and its upload and launch. The FP8 forward (`fp8.rs`) runs through
//! [`run_forward`].

use super::arch::Arch;
use super::buffer::{CudaAttnOutput, CudaTensor, DeviceBuffer};
use super::device::CudaDevice;
use super::error::driver_err;
use super::key::{KernelKey, KernelKind};
use super::launch::{alloc_output, check_launchable, sink_table};
use super::params::{DropoutParams, FwdParams};
use super::schedule;
use super::tma::TmaSpec;
use crate::error::{ErrorKind, Result};
use crate::params::{self, AttnOptions, Params};
use crate::tensor::DType;
#[cfg(feature = "test-hooks")]
use crate::tensor::TensorRef;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Entries per sequence of the table the kernels read (common.cuh: SEQ_FIELDS).
pub const SEQ_FIELDS: usize = 7;

/// [`crate::flash_attn`] on the GPU: q `[batch, seqlen_q, heads, head_dim]`, k and v
/// `[batch, seqlen_k, heads_kv, head_dim]`, or packed with [`AttnOptions::varlen`]
/// (`cu_seqlens_*` on the host), queued on `dev`'s stream (returns without waiting).
pub fn flash_attn(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    opts: &AttnOptions,
) -> Result<CudaAttnOutput> {
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
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
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
    forward_into(dev, &p, q, k, v, dst)
}

/// Checks a caller's destination: `dtype`, `shape`'s element count, and a contiguous view of
/// exactly its buffer (shared by every CUDA `_into` call).
pub(super) fn check_destination(
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

/// The kernel variant a [`flash_attn`] call with these arguments runs on `dev`
/// (validated as the call would be); with [`CudaDevice::prepare`], lets a caller compile it ahead
/// of time.
pub fn kernel_key(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    opts: &AttnOptions,
) -> Result<KernelKey> {
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
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
pub(super) fn launch_forward<TI, TO: cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    p: &Params,
    fp8: Option<crate::fp8::Fp8Format>,
    contexts: &[&Arc<CudaContext>],
    qkv: (&CudaSlice<TI>, &CudaSlice<TI>, &CudaSlice<TI>),
    out: &mut CudaSlice<TO>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    let mut desc = LaunchDescription::new(p, fp8).for_arch(dev.arch, ForwardKernel::from_env());
    if let Some(ctas) = schedule::persistent_ctas(dev.sm_count()) {
        desc = desc.persistent(ctas);
    }
    desc = desc.dynamic_tiles(schedule::dynamic_tiles());
    check_launchable(dev, p, &desc.key, contexts)?;
    let (function, _) = dev.function(&desc.key)?;
    let plan = Plan::new(dev, desc)?;
    plan.launch(dev, &function, qkv, out, lse)
}

/// Everything a forward launch passes besides the tensors, computed on the host from validated
/// parameters: what the GPU path uploads and launches, and what the host emulation of the kernels
/// (tests/integration/cuda/emulated.rs) runs, so both exercise the same argument logic. Returned
/// by [`super::launch_description_fp8`] (the CLI's benchmark reads the kernel key from it).
#[derive(Clone, Debug)]
pub struct LaunchDescription {
    /// The kernel variant.
    pub key: KernelKey,
    /// Grid (query blocks, heads, launched sequences; fwd_sm90_ws.cu: (CTAs, 1, 1) over its work
    /// tiles, cuda/schedule.rs), threads per CTA and dynamic shared memory.
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub smem_bytes: u32,
    /// The per-sequence table (packed calls only; batched calls pass null and batch strides):
    /// SEQ_FIELDS i64 per launched sequence, the last one possibly the tail of packed rows.
    pub table: Option<Vec<i64>>,
    /// ALiBi slopes, one row of `heads` per launched sequence, when ALiBi is on.
    pub slopes: Option<Vec<f32>>,
    /// FP8 inputs: the score scale and the v factor per (launched sequence, kv head), 2 each
    /// (params.cuh: FwdParams); `None` (a null pointer) otherwise.
    pub descale: Option<Vec<f32>>,
    /// Learnable sinks: the logit of (launched sequence, head), `heads` per launched sequence,
    /// -inf for the tail of packed rows after the last sequence (no sink: out 0, lse -inf, as on
    /// the CPU); `None` (a null pointer) without sinks.
    pub sink: Option<Vec<f32>>,
    /// The kernel's parameter, its device addresses 0: the launch fills them in.
    pub params: FwdParams,
    /// Elements and shapes of out and lse.
    pub out_len: usize,
    pub lse_len: usize,
    pub out_shape: Vec<usize>,
    pub lse_shape: Vec<usize>,
    /// The tensor maps of q, k and v, for the warp-specialised sm_90a forward only.
    pub tma: Option<[TmaSpec; 3]>,
    /// The warp-specialised sm_90a forward takes its tiles from a counter (its dynamic scheduler,
    /// cuda/schedule.rs): the launch passes one int zeroed on its stream before it; else null
    /// (static rounds).
    pub tile_counter: bool,
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
        // Per-block FP8 factors: their tables after the pairs (crate::fp8::BlockDescales).
        let mut descale = descale;
        let blocks = match (&mut descale, crate::fp8::blocks(p)) {
            (Some(t), Some(bd)) => bd.append_kernel_tables(p, seqs.len(), max_q, t),
            _ => [0; 5],
        };
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
            descale,
            sink: sink_table(p, seqs.len()),
            params: FwdParams {
                q_row_stride: p.q.row_stride as i64,
                q_head_stride: p.q.head_stride as i64,
                k_row_stride: p.k.row_stride as i64,
                k_head_stride: p.k.head_stride as i64,
                v_row_stride: p.v.row_stride as i64,
                v_head_stride: p.v.head_stride as i64,
                lse_head_stride: p.lse_head_stride as i64,
                q_batch_stride: stride(|s| s.q_base),
                k_batch_stride: stride(|s| s.k_base),
                v_batch_stride: stride(|s| s.v_base),
                drop: DropoutParams::new(p.dropout),
                heads: p.heads as i32,
                heads_kv: p.heads_kv as i32,
                head_dim: p.head_dim as i32,
                softmax_scale: p.softmax_scale,
                softcap: p.softcap.unwrap_or(1.0),
                window_left: side(p.window_left),
                window_right: side(p.window_right),
                batch_seqlen_q: max_q as i32,
                batch_seqlen_k: max_k as i32,
                fp8_e5m2: (fp8 == Some(crate::fp8::Fp8Format::E5M2)) as i32,
                num_seqs: seqs.len() as i32,
                block_q: blocks[0],
                block_k: blocks[1],
                block_v: blocks[2],
                q_blocks: blocks[3],
                k_blocks: blocks[4],
                ..FwdParams::default()
            },
            out_len: p.out_len(),
            lse_len: p.lse_len(),
            out_shape: p.out_shape.clone(),
            lse_shape: p.lse_shape.clone(),
            tma: None,
            tile_counter: false,
            key,
        }
    }

    /// The same launch on the kernel `choice` names for a GPU of `arch`: the sm_90a forward
    /// (fwd_sm90.cu: its key, its tiles, grid and shared memory) on compute capability 9.0 where
    /// it serves the call ([`KernelKey::sm90_forward`]) and `choice` asks for it; for e4m3 inputs
    /// with [`ForwardKernel::Sm90Fp8`], fwd_sm90_fp8.cu, with [`ForwardKernel::Sm90Fp8Ws`],
    /// fwd_sm90_ws.cu's FP8 mode; else unchanged.
    pub fn for_arch(mut self, arch: Arch, choice: ForwardKernel) -> LaunchDescription {
        if choice == ForwardKernel::Fa2 || arch != Arch::SM90 {
            return self;
        }
        let Some(mut key) = self.key.sm90_forward() else {
            return self;
        };
        // FP8: asked for (fwd_sm90_fp8.cu, or fwd_sm90_ws.cu's FP8 mode), e4m3 only.
        let fp8_choice = matches!(choice, ForwardKernel::Sm90Fp8 | ForwardKernel::Sm90Fp8Ws);
        if key.fp8 && (!fp8_choice || self.params.fp8_e5m2 != 0) {
            return self;
        }
        // fwd_sm90_ws.cu's FP8 mode takes per-(sequence, kv head) and per-block factors alike.
        if (choice == ForwardKernel::Sm90Ws && !key.fp8)
            || (choice == ForwardKernel::Sm90Fp8Ws && key.fp8)
        {
            key.kind = KernelKind::ForwardSm90Ws;
        }
        self.grid.0 = (self.params.batch_seqlen_q as usize).div_ceil(key.tiles().block_m) as u32;
        self.threads = key.threads() as u32;
        self.smem_bytes = key.smem_bytes() as u32;
        self.key = key;
        if key.kind == KernelKind::ForwardSm90Ws {
            self.tma = Some(self.tensor_maps());
            // One CTA per work tile (cuda/schedule.rs); `persistent` makes them loop.
            self.grid = schedule::tile_grid(self.grid);
        }
        self
    }

    /// The same launch with at most `ctas` CTAs, each looping over the work tiles
    /// (cuda/schedule.rs), for the warp-specialised sm_90a forward; other kernels unchanged.
    pub fn persistent(mut self, ctas: usize) -> LaunchDescription {
        if self.key.kind == KernelKind::ForwardSm90Ws {
            self.grid = schedule::persistent_grid(self.grid, ctas);
        }
        self
    }

    /// The same launch with the dynamic tile scheduler (`on`) or the static rounds, for the
    /// warp-specialised sm_90a forward (cuda/schedule.rs); other kernels unchanged.
    pub fn dynamic_tiles(mut self, on: bool) -> LaunchDescription {
        self.tile_counter = on && self.key.kind == KernelKind::ForwardSm90Ws;
        self
    }

    /// The tensor maps of q, k and v (cuda/tma.rs): a batched call's rows are one sequence's
    /// (batch_seqlens), a packed call's reach the last row any sequence uses.
    fn tensor_maps(&self) -> [TmaSpec; 3] {
        let t = self.key.tiles();
        let p = &self.params;
        let [q_row, q_head, k_row, k_head, v_row, v_head] = [
            p.q_row_stride,
            p.q_head_stride,
            p.k_row_stride,
            p.k_head_stride,
            p.v_row_stride,
            p.v_head_stride,
        ]
        .map(|x| x as u64);
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
                    p.batch_seqlen_q.max(1) as u64,
                    p.batch_seqlen_k.max(1) as u64,
                );
                (
                    p.num_seqs.max(1) as u64,
                    sq,
                    sk,
                    sk,
                    [p.q_batch_stride, p.k_batch_stride, p.v_batch_stride].map(|x| x as u64),
                )
            }
        };
        // FP8 inputs are bytes, the others 16-bit elements.
        let e: u64 = if self.key.fp8 { 1 } else { 2 };
        let spec =
            |rows: u64, heads: i32, row: u64, head: u64, batch: u64, box_rows: usize| TmaSpec {
                dims: [p.head_dim as u64, rows, heads as u64, batches],
                strides: [e * row, e * head, e * batch],
                box_rows: box_rows as u32,
                elem_bytes: e as u32,
            };
        [
            spec(q_rows, p.heads, q_row, q_head, batch_strides[0], t.block_m),
            spec(
                k_rows,
                p.heads_kv,
                k_row,
                k_head,
                batch_strides[1],
                t.block_n,
            ),
            spec(
                v_rows,
                p.heads_kv,
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

/// The launch a forward with these host views and options would make (validated as the call
/// would be). For the host emulation test of the kernels.
#[cfg(feature = "test-hooks")]
pub fn launch_description(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
) -> Result<LaunchDescription> {
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
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
    /// `FLASHATTN_CUDA_FWD=sm90fp8`: [`ForwardKernel::Sm90`], and e4m3 inputs on the FP8 tensor
    /// cores (fwd_sm90_fp8.cu) instead of widened to bf16 on fwd.cu. Opt-in until it has run on
    /// a GPU: it rounds P to e4m3 (as FlashAttention-3), where the default FP8 path keeps bf16.
    Sm90Fp8,
    /// `FLASHATTN_CUDA_FWD=sm90fp8ws`: [`ForwardKernel::Sm90`] for 16-bit inputs, and e4m3
    /// inputs on fwd_sm90_ws.cu's FP8 mode (TMA, a producer warpgroup that also transposes V,
    /// wgmma with e4m3 operands; P rounded to e4m3 as [`ForwardKernel::Sm90Fp8`]). Opt-in: it has
    /// not run on a GPU.
    Sm90Fp8Ws,
}

impl ForwardKernel {
    pub fn from_env() -> ForwardKernel {
        static KERNEL: std::sync::OnceLock<ForwardKernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| match std::env::var("FLASHATTN_CUDA_FWD").as_deref() {
            Ok("fa2") => ForwardKernel::Fa2,
            Ok("sm90ws") => ForwardKernel::Sm90Ws,
            Ok("sm90fp8") => ForwardKernel::Sm90Fp8,
            Ok("sm90fp8ws") => ForwardKernel::Sm90Fp8Ws,
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
        let s = &dev.stream;
        // The buffers' device addresses; each guard records this launch's use of its buffer when
        // dropped, after the launch is queued (what `arg` does for a buffer pushed directly).
        let (q_ptr, _q) = q.device_ptr(s);
        let (k_ptr, _k) = k.device_ptr(s);
        let (v_ptr, _v) = v.device_ptr(s);
        let (out_ptr, _out) = out.device_ptr_mut(s);
        let (lse_ptr, _lse) = lse.device_ptr_mut(s);
        let table = self.table.as_ref().map(|t| t.device_ptr(s));
        let slopes = self.slopes.as_ref().map(|t| t.device_ptr(s));
        let descale = self.descale.as_ref().map(|t| t.device_ptr(s));
        let sink = self.sink.as_ref().map(|t| t.device_ptr(s));
        let addr = |t: &Option<(u64, _)>| t.as_ref().map_or(0, |t| t.0);
        let params = FwdParams {
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            out: out_ptr,
            lse: lse_ptr,
            seqs: addr(&table),
            alibi_slopes: addr(&slopes),
            descale: addr(&descale),
            sink: addr(&sink),
            ..d.params
        };
        // The warp-specialised kernel's tensor maps, encoded over q, k and v's device memory.
        let maps = match &d.tma {
            Some(specs) => Some([
                specs[0].encode(q_ptr, d.key.dtype)?,
                specs[1].encode(k_ptr, d.key.dtype)?,
                specs[2].encode(v_ptr, d.key.dtype)?,
            ]),
            None => None,
        };
        // The dynamic scheduler's tile counter: one int of this launch's own, zeroed on its
        // stream before it (so concurrent launches never share one and a failed launch leaves
        // nothing behind); freed on the stream after the kernel.
        let counter = if d.tile_counter {
            Some(
                s.alloc_zeros::<i32>(1)
                    .map_err(driver_err("cuMemAllocAsync"))?,
            )
        } else {
            None
        };
        let counter = counter.as_ref().map(|c| c.device_ptr(s));
        let counter_ptr: u64 = addr(&counter);
        let mut b = dev.stream.launch_builder(function);
        b.arg(&params);
        if let Some(m) = &maps {
            b.arg(&m[0]).arg(&m[1]).arg(&m[2]).arg(&counter_ptr);
        }
        let cfg = LaunchConfig {
            grid_dim: d.grid,
            block_dim: (d.threads, 1, 1),
            shared_mem_bytes: d.smem_bytes,
        };
        // SAFETY: the arguments match `flash_fwd` in every forward kernel: one FwdParams, laid out
        // as params.cuh's (the size and offset checks on both sides), whose addresses are those
        // of q, k, v (elements of TI), out (TO), lse (f32) and the uploaded tables (i64, f32) or
        // null for a table the call does not use (then never read), all alive past the launch
        // (borrowed here; their guards record the launch when dropped below); for
        // fwd_sm90_ws.cu then three TmaDesc maps encoded over q, k and v themselves and the
        // address of its tile counter (one zeroed int alive past the launch) or null. TI and TO
        // are the element types the variant was compiled for: the callers pick the key from the same buffers (forward:
        // one dtype, FA_FP8_INPUT off; forward_fp8: bytes in, bf16 out, FA_FP8_INPUT on), and a
        // descale table is pushed exactly for FP8 keys. Params validated every view, so each
        // element the kernels address (bases and row/head strides over the sequence table or the
        // batch strides) lies inside q, k and v; out and lse hold out_len / lse_len elements, the
        // table 7 per launched sequence, the slopes one row and the descale table 2 · heads_kv
        // factors per launched sequence (then, with per-block FP8 factors, the three tables
        // whose offsets and row lengths the params carry, rows for every launched sequence), the
        // sinks `heads` logits per launched sequence.
        unsafe { b.launch(cfg) }.map_err(driver_err("cuLaunchKernel"))?;
        Ok(())
    }
}

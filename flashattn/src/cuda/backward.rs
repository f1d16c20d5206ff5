//! The backward pass on the GPU: [`flash_attn_backward`] (batched or packed, as `opts.cu_seqlens`
//! says), the CPU call's semantics (same validation) with every tensor in GPU memory. Three kernels of
//! `kernels/bwd.cu` run on the device's stream (on tensor cores for f16/bf16 up to head_dim 128,
//! on CUDA cores otherwise): `bwd_prep` (dO·O per row and the LSE
//! in the log2 domain), `bwd_dq` (one CTA per query block) and `bwd_dkdv` (one CTA per key block
//! and kv head, summing the heads of its group). No atomics: the gradients are bit-identical from
//! run to run. On compute capability 9.0 with `FLASHATTN_SM90_BWD=1`, dQ and dK/dV run on
//! `kernels/bwd_sm90.cu` (the same two kernels on wgmma) where it serves the call: opt-in until it
//! has run on a GPU. The `_into` forms write the gradients into caller-provided buffers
//! ([`CudaGradBuffers`]); the allocating forms allocate them and call the same code.

use super::arch::Arch;
use super::buffer::{CudaAttnOutput, CudaTensor, DeviceBuffer};
use super::device::CudaDevice;
use super::error::driver_err;
use super::forward::check_destination;
use super::key::{KernelKey, KernelKind};
use super::launch::{alloc_output, check_launchable};
use super::params::{BwdParams, DropoutParams};
use crate::error::{ErrorKind, Result};
use crate::params::{self, AttnOptions, Params, QLike};
#[cfg(feature = "test-hooks")]
use crate::tensor::TensorRef;
use crate::tensor::{DType, ViewDesc};
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

/// Entries per launched sequence of the backward kernels' table (bwd.cu: BWD_FIELDS).
pub const BWD_FIELDS: usize = 11;
/// Query rows per CTA of `bwd_prep` (bwd.cu: BLOCK_Q).
const PREP_ROWS: usize = 16;

/// Everything the backward launches pass besides the tensors, computed on the host from a
/// validated call: what the GPU path uploads and launches, and what the host emulation of bwd.cu
/// (tests/integration/cuda/emulated.rs) runs.
#[derive(Clone, Debug)]
pub struct BackwardLaunch {
    pub prep: KernelKey,
    pub dq: KernelKey,
    pub dkdv: KernelKey,
    /// Launched sequences: the batch, plus packed query rows after the last sequence and packed
    /// keys after the last sequence, each launched as a sequence of its own that sees nothing.
    pub seqs: usize,
    pub max_q: usize,
    pub max_k: usize,
    /// BWD_FIELDS i64 per launched sequence.
    pub table: Vec<i64>,
    /// ALiBi slopes, one row of `heads` per launched sequence.
    pub slopes: Option<Vec<f32>>,
    /// The three kernels' parameter, its device addresses 0: the launch fills them in.
    pub params: BwdParams,
    /// Elements of dq (and of out), of dk and dv, and of the workspaces (and of lse).
    pub dq_len: usize,
    pub dk_len: usize,
    pub lse_len: usize,
    pub q_shape: Vec<usize>,
    pub k_shape: Vec<usize>,
    /// Learnable sinks (`heads` logits), for [`BackwardLaunch::dsink`]; `None` without.
    pub sink: Option<Vec<f32>>,
    /// Per sequence (the batch, not the launched tails): the workspace index of head 0, query 0
    /// and its query rows.
    pub sink_rows: Vec<(usize, usize)>,
}

impl BackwardLaunch {
    /// The sinks' gradient `dsink_h = -Σ_rows e^{sink_h - lse} · D` (the CPU path's formula,
    /// `cpu::backward::sink_grad`, and its order: head, sequence, row; in f64) from the prep
    /// kernel's workspaces `lse2` (lse · log2 e) and `dsum` (D = rowsum(dO ∘ O)), both laid out
    /// as the forward's contiguous lse; `None` without sinks.
    pub fn dsink(&self, lse2: &[f32], dsum: &[f32]) -> Option<Vec<f32>> {
        let sinks = self.sink.as_ref()?;
        let head_stride = self.params.lse_head_stride as usize;
        let dsink = sinks.iter().enumerate().map(|(h, &sink)| {
            let s2 = sink as f64 * std::f64::consts::LOG2_E;
            let mut acc = 0f64;
            for &(base, rows) in &self.sink_rows {
                for i in 0..rows {
                    let at = base + h * head_stride + i;
                    acc -= (s2 - lse2[at] as f64).exp2() * dsum[at] as f64;
                }
            }
            acc as f32
        });
        Some(dsink.collect())
    }

    fn new(p: &Params, out: &QLike, dout: &QLike, lse_strides: &[usize]) -> BackwardLaunch {
        // The tensor-core kernels move tiles of q, k, v and dout 16 bytes at a time when
        // head_dim and every stride and base are multiples of 8 elements.
        let aligned = |x: usize| x.is_multiple_of(8);
        let vec_load = aligned(p.head_dim)
            && [p.q, p.k, p.v, dout.layout]
                .iter()
                .all(|l| aligned(l.row_stride) && aligned(l.head_stride))
            && p.seqs
                .iter()
                .all(|s| aligned(s.q_base) && aligned(s.k_base) && aligned(s.v_base))
            && dout.bases.iter().all(|&b| aligned(b));
        let dkey = |kind| {
            let key = KernelKey {
                kind,
                dtype: p.dtype,
                head_dim: KernelKey::padded_head_dim(p.head_dim),
                masked: p.window_left.is_some() || p.window_right.is_some(),
                softcap: p.softcap.is_some(),
                alibi: p.alibi.is_some(),
                dropout: p.dropout.is_some(),
                vec_load: false,
                fp8: false,
            };
            KernelKey {
                vec_load: vec_load && key.bwd_tensor_cores(),
                ..key
            }
        };
        // The caller's lse: [batch, heads, seqlen_q] or [heads, total_q].
        let (lse_bs, lse_hs, lse_rs) = if p.packed {
            (0, lse_strides[0], lse_strides[1])
        } else {
            (lse_strides[0], lse_strides[1], lse_strides[2])
        };
        let mut table = Vec::with_capacity((p.seqs.len() + 2) * BWD_FIELDS);
        for (b, s) in p.seqs.iter().enumerate() {
            let lse_view = if p.packed {
                s.out_row0 * lse_rs
            } else {
                b * lse_bs
            };
            table.extend([
                s.seqlen_q,
                s.seqlen_k,
                s.q_base,
                s.k_base,
                s.v_base,
                out.bases[b],
                dout.bases[b],
                s.out_row0,
                s.lse_base,
                lse_view,
                s.k_row0,
            ]);
        }
        if p.packed {
            // dq rows and dk/dv rows outside every sequence are 0, as on the CPU.
            let used_q = p.seqs.last().map_or(0, |s| s.out_row0 + s.seqlen_q);
            if used_q < p.total_q {
                let r = used_q;
                let (o, g) = (out.layout.row_stride, dout.layout.row_stride);
                let q_base = r * p.q.row_stride;
                table.extend([
                    p.total_q - r,
                    0,
                    q_base,
                    0,
                    0,
                    r * o,
                    r * g,
                    r,
                    r,
                    r * lse_rs,
                    0,
                ]);
            }
            let used_k = p.seqs.last().map_or(0, |s| s.k_row0 + s.seqlen_k);
            if used_k < p.total_k {
                let r = used_k;
                let (kb, vb) = (r * p.k.row_stride, r * p.v.row_stride);
                table.extend([0, p.total_k - r, 0, kb, vb, 0, 0, 0, 0, 0, r]);
            }
        }
        let seqs = table.len() / BWD_FIELDS;
        let seq_max = |f: usize| table.iter().skip(f).step_by(BWD_FIELDS).max().copied();
        let (max_q, max_k) = (seq_max(0).unwrap_or(0), seq_max(1).unwrap_or(0));
        let slopes = p.alibi.as_ref().map(|a| {
            let mut a = a.clone();
            a.resize(seqs * p.heads, 0.0); // the tail sequences' rows, never used
            a
        });
        let side = |w: Option<usize>| w.map_or(-1, |w| w.min(max_q + max_k) as i32);
        let table: Vec<i64> = table.iter().map(|&x| x as i64).collect();
        BackwardLaunch {
            prep: KernelKey::backward_prep(p.dtype),
            dq: dkey(KernelKind::BackwardDq),
            dkdv: dkey(KernelKind::BackwardDkDv),
            seqs,
            max_q,
            max_k,
            table,
            slopes,
            params: BwdParams {
                q_row_stride: p.q.row_stride as i64,
                q_head_stride: p.q.head_stride as i64,
                k_row_stride: p.k.row_stride as i64,
                k_head_stride: p.k.head_stride as i64,
                v_row_stride: p.v.row_stride as i64,
                v_head_stride: p.v.head_stride as i64,
                out_row_stride: out.layout.row_stride as i64,
                out_head_stride: out.layout.head_stride as i64,
                dout_row_stride: dout.layout.row_stride as i64,
                dout_head_stride: dout.layout.head_stride as i64,
                lse_view_head_stride: lse_hs as i64,
                lse_view_row_stride: lse_rs as i64,
                lse_head_stride: p.lse_head_stride as i64,
                drop: DropoutParams::new(p.dropout),
                heads: p.heads as i32,
                heads_kv: p.heads_kv as i32,
                head_dim: p.head_dim as i32,
                softmax_scale: p.softmax_scale,
                softcap: p.softcap.unwrap_or(1.0),
                window_left: side(p.window_left),
                window_right: side(p.window_right),
                ..BwdParams::default()
            },
            dq_len: p.out_len(),
            dk_len: p.dk_len(),
            lse_len: p.lse_len(),
            q_shape: p.out_shape.clone(),
            k_shape: p.k_shape.clone(),
            sink: p.sink.clone(),
            sink_rows: p.seqs.iter().map(|s| (s.lse_base, s.seqlen_q)).collect(),
        }
    }

    /// The same launches for a GPU of `arch`: with `sm90` on compute capability 9.0, `bwd_dq` and
    /// `bwd_dkdv` on bwd_sm90.cu ([`BackwardLaunch::on_sm90`]); else unchanged.
    pub fn for_arch(self, arch: Arch, sm90: bool) -> BackwardLaunch {
        if sm90 && arch == Arch::SM90 {
            self.on_sm90()
        } else {
            self
        }
    }

    /// The same launches with `bwd_dq` and `bwd_dkdv` on the sm_90a kernels of bwd_sm90.cu
    /// (their keys, tiles, grids and shared memory) where they serve the call
    /// ([`KernelKey::sm90_backward`]: f16/bf16, 16-byte loads, head_dim up to 128); else
    /// unchanged. `bwd_prep` stays bwd.cu's.
    pub fn on_sm90(mut self) -> BackwardLaunch {
        if let (Some(dq), Some(dkdv)) = (self.dq.sm90_backward(), self.dkdv.sm90_backward()) {
            self.dq = dq;
            self.dkdv = dkdv;
        }
        self
    }

    /// Grid of `bwd_prep` (None: no query row).
    pub fn prep_grid(&self) -> Option<(u32, u32, u32)> {
        self.grid(self.max_q, PREP_ROWS, self.params.heads)
    }

    /// Grid of `bwd_dq` (None: no query row).
    pub fn dq_grid(&self) -> Option<(u32, u32, u32)> {
        self.grid(self.max_q, self.dq.tiles().block_m, self.params.heads)
    }

    /// Grid of `bwd_dkdv` (None: no key).
    pub fn dkdv_grid(&self) -> Option<(u32, u32, u32)> {
        self.grid(self.max_k, self.dkdv.tiles().block_n, self.params.heads_kv)
    }

    fn grid(&self, len: usize, block: usize, heads: i32) -> Option<(u32, u32, u32)> {
        (len > 0 && self.seqs > 0)
            .then(|| (len.div_ceil(block) as u32, heads as u32, self.seqs as u32))
    }
}

/// Whether the backward runs on bwd_sm90.cu where it can (compute capability 9.0, see
/// [`BackwardLaunch::for_arch`]): only with `FLASHATTN_SM90_BWD=1` until the kernel has run on a
/// GPU (read once per process).
fn sm90_from_env() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FLASHATTN_SM90_BWD").as_deref() == Ok("1"))
}

/// Validates a backward call: q, k, v and the options as the forward, then out, dout (q's shape
/// and dtype, any strides) and lse (f32, the forward's shape, any strides).
fn validate<V: ViewDesc + ?Sized>(
    p: &Params,
    out: &V,
    lse: &V,
    dout: &V,
) -> Result<(QLike, QLike, Vec<usize>)> {
    let out = params::q_like("out", out, p)?;
    let dout = params::q_like("dout", dout, p)?;
    params::check_lse(p, lse)?;
    Ok((out, dout, lse.strides().to_vec()))
}

/// The launches a backward call with these host views would make (validated as the call would
/// be). For the host emulation test of the kernels.
#[cfg(feature = "test-hooks")]
#[allow(clippy::too_many_arguments)]
pub fn backward_launch_description(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    out: &TensorRef,
    lse: &TensorRef,
    dout: &TensorRef,
    opts: &AttnOptions,
) -> Result<BackwardLaunch> {
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
    let (o, g, ls) = validate(&p, out, lse, dout)?;
    Ok(BackwardLaunch::new(&p, &o, &g, &ls))
}

/// The `bwd_dq` variant a backward with these arguments runs (its `bwd_dkdv` differs only
/// in kind); validated as the call would be, with `dout` standing in for `out` (same shape).
pub fn backward_kernel_key(
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    dout: &CudaTensor,
    opts: &AttnOptions,
) -> Result<KernelKey> {
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
    let out = params::q_like("out", dout, &p)?;
    let dout = params::q_like("dout", dout, &p)?;
    let lse_strides = crate::tensor::contiguous_strides(&p.lse_shape);
    let d = BackwardLaunch::new(&p, &out, &dout, &lse_strides);
    // The GPU the tensors live on, for the choice of bwd_sm90.cu (as `plan` makes it).
    let d = match q.buf.context().compute_capability() {
        Ok((major, minor)) => d.for_arch(
            Arch {
                major: major as u32,
                minor: minor as u32,
            },
            sm90_from_env(),
        ),
        Err(_) => d,
    };
    Ok(d.dq)
}

/// Gradients on the device: dq, dk, dv with the shapes and dtypes of q, k, v (contiguous), and
/// with learnable sinks their gradient `dsink` (f32 `[heads]`).
#[derive(Clone, Debug)]
pub struct CudaAttnGrads {
    pub dq: CudaTensor,
    pub dk: CudaTensor,
    pub dv: CudaTensor,
    pub dsink: Option<CudaTensor>,
}

/// Caller-provided destinations of a CUDA backward ([`flash_attn_backward_into`]): dq with q's
/// shape, dk and dv with k's, in q's dtype, and `dsink` (f32 `[heads]`) exactly when the call has
/// a learnable sink; each contiguous and in `dev`'s context (e.g. a framework's tensors viewed as
/// [`CudaTensor`]s). Every element is written.
#[derive(Debug)]
pub struct CudaGradBuffers<'a> {
    pub dq: &'a mut CudaTensor,
    pub dk: &'a mut CudaTensor,
    pub dv: &'a mut CudaTensor,
    pub dsink: Option<&'a mut CudaTensor>,
}

impl CudaAttnOutput {
    /// The backward pass of the [`super::flash_attn`] call that produced `self` (same q, k, v and
    /// options, so the same layout). See [`flash_attn_backward`].
    pub fn backward(
        &self,
        dev: &CudaDevice,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        dout: &CudaTensor,
        opts: &AttnOptions,
    ) -> Result<CudaAttnGrads> {
        flash_attn_backward(dev, q, k, v, &self.out, &self.lse, dout, opts)
    }
}

/// [`crate::flash_attn_backward`] on the GPU, queued on `dev`'s stream (returns without waiting):
/// gradients of `Σ out ∘ dout` with respect to q, k and v, for the forward's `out` and `lse`
/// (batched, or packed with [`AttnOptions::varlen`], `cu_seqlens_*` on the host).
/// dQ, dK and dV are each summed by one thread in a fixed order, so results are bit-identical
/// from run to run. f16/bf16 up to head_dim 128 run on tensor cores (P and dS rounded to the input
/// type for their products, as FlashAttention-2), f32 and larger head dims on CUDA cores. With
/// dropout the kernels regenerate the forward's mask from `opts`' seed (pass the forward's options).
/// With learnable sinks, `dsink` is summed on the host from the prep kernel's workspaces: that
/// call waits for the stream.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_backward(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    out: &CudaTensor,
    lse: &CudaTensor,
    dout: &CudaTensor,
    opts: &AttnOptions,
) -> Result<CudaAttnGrads> {
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
    backward(dev, &p, [q, k, v, out, lse, dout])
}

/// [`flash_attn_backward`] writing into caller-provided buffers ([`CudaGradBuffers`]): no
/// allocation of the gradients, no copy. Everything (inputs and destinations: dtype, length,
/// contiguity, context) is validated before anything is queued: on error nothing is written.
/// Queued on `dev`'s stream without waiting (except with sinks, as [`flash_attn_backward`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_backward_into(
    dev: &CudaDevice,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    out: &CudaTensor,
    lse: &CudaTensor,
    dout: &CudaTensor,
    opts: &AttnOptions,
    dst: CudaGradBuffers,
) -> Result<()> {
    params::check_no_mask_mod(opts, "the CUDA backend")?;
    let p = params::attn(q, k, v, opts)?;
    let t = [q, k, v, out, lse, dout];
    let d = plan(dev, &p, t)?;
    backward_into(dev, &p, &d, t, dst)
}

/// Validates the call's inputs (q, k, v and the options in `p`; out, lse and dout here) and
/// checks its launches against `dev`.
fn plan(dev: &CudaDevice, p: &Params, t: [&CudaTensor; 6]) -> Result<BackwardLaunch> {
    let [_, _, _, out, lse, dout] = t;
    let (o, g, ls) = validate(p, out, lse, dout)?;
    let d = BackwardLaunch::new(p, &o, &g, &ls).for_arch(dev.arch(), sm90_from_env());
    let contexts = t.map(|x| x.buf.context());
    check_launchable(dev, p, &d.dkdv, &contexts)?;
    check_launchable(dev, p, &d.dq, &contexts)?;
    Ok(d)
}

/// The allocating backward: new (poisoned, see `alloc_output`) gradients, written by
/// [`backward_into`].
fn backward(dev: &CudaDevice, p: &Params, t: [&CudaTensor; 6]) -> Result<CudaAttnGrads> {
    let d = plan(dev, p, t)?;
    let s = &dev.stream;
    let alloc = |len: usize, shape: &[usize]| -> Result<CudaTensor> {
        let buf = match p.dtype {
            DType::F32 => DeviceBuffer::F32(alloc_output(s, len)?),
            DType::F16 => DeviceBuffer::F16(alloc_output(s, len)?),
            DType::BF16 => DeviceBuffer::BF16(alloc_output(s, len)?),
        };
        Ok(CudaTensor::contiguous(buf, shape))
    };
    let mut dq = alloc(d.dq_len, &d.q_shape)?;
    let mut dk = alloc(d.dk_len, &d.k_shape)?;
    let mut dv = alloc(d.dk_len, &d.k_shape)?;
    let mut dsink = match &d.sink {
        Some(x) => Some(CudaTensor::contiguous(
            DeviceBuffer::F32(alloc_output(s, x.len())?),
            &[x.len()],
        )),
        None => None,
    };
    let dst = CudaGradBuffers {
        dq: &mut dq,
        dk: &mut dk,
        dv: &mut dv,
        dsink: dsink.as_mut(),
    };
    backward_into(dev, p, &d, t, dst)?;
    Ok(CudaAttnGrads { dq, dk, dv, dsink })
}

/// Checks the destinations against the planned launches `d`, then queues them writing into `dst`.
fn backward_into(
    dev: &CudaDevice,
    p: &Params,
    d: &BackwardLaunch,
    t: [&CudaTensor; 6],
    dst: CudaGradBuffers,
) -> Result<()> {
    let [q, k, v, out, lse, dout] = t;
    check_destination("dq", dst.dq, p.dtype, &d.q_shape)?;
    check_destination("dk", dst.dk, p.dtype, &d.k_shape)?;
    check_destination("dv", dst.dv, p.dtype, &d.k_shape)?;
    let sink_shape = [d.sink.as_ref().map_or(0, Vec::len)];
    match (&d.sink, &dst.dsink) {
        (Some(_), Some(ds)) => check_destination("dsink", ds, DType::F32, &sink_shape)?,
        (None, None) => {}
        _ => {
            return Err(ErrorKind::DestinationLength {
                tensor: "dsink",
                expected: sink_shape[0],
                got: dst.dsink.as_ref().map_or(0, |x| x.buf.len()),
                shape: sink_shape.to_vec(),
            }
            .into())
        }
    }
    let mut dst_contexts = vec![
        dst.dq.buf.context(),
        dst.dk.buf.context(),
        dst.dv.buf.context(),
    ];
    dst_contexts.extend(dst.dsink.as_ref().map(|x| x.buf.context()));
    check_launchable(dev, p, &d.dq, &dst_contexts)?;
    let f = [
        dev.function(&d.prep)?.0,
        dev.function(&d.dq)?.0,
        dev.function(&d.dkdv)?.0,
    ];
    let s = &dev.stream;
    let table = dev.htod(&d.table)?;
    let slopes = d.slopes.as_deref().map(|x| dev.htod(x)).transpose()?;
    let mut ws = [
        alloc_output::<f32>(s, d.lse_len)?,
        alloc_output::<f32>(s, d.lse_len)?,
    ];
    let DeviceBuffer::F32(lse_b) = &lse.buf else {
        unreachable!("lse was validated as f32")
    };
    macro_rules! typed {
        ($variant:ident) => {{
            let bufs = (&q.buf, &k.buf, &v.buf, &out.buf, &dout.buf);
            let (
                DeviceBuffer::$variant(qb),
                DeviceBuffer::$variant(kb),
                DeviceBuffer::$variant(vb),
                DeviceBuffer::$variant(ob),
                DeviceBuffer::$variant(gb),
            ) = bufs
            else {
                unreachable!("q, k, v, out and dout were validated to share one dtype")
            };
            let grads = (&mut dst.dq.buf, &mut dst.dk.buf, &mut dst.dv.buf);
            let (
                DeviceBuffer::$variant(dq),
                DeviceBuffer::$variant(dk),
                DeviceBuffer::$variant(dv),
            ) = grads
            else {
                unreachable!("dq, dk and dv were checked against q's dtype")
            };
            let ins = [qb, kb, vb, ob, gb];
            launch(
                dev,
                d,
                &f,
                ins,
                lse_b,
                &mut ws,
                &mut [dq, dk, dv],
                &table,
                &slopes,
            )?;
        }};
    }
    match p.dtype {
        DType::F32 => typed!(F32),
        DType::F16 => typed!(F16),
        DType::BF16 => typed!(BF16),
    }
    // The sinks' gradient: a sum over every row per head, from the prep kernel's workspaces
    // (rows × heads f32 each, a head_dim-th of dq's size), on the host in f64 as the CPU path.
    if let Some(ds_dst) = dst.dsink {
        let dtoh = driver_err("cuMemcpyDtoH");
        let lse2 = s.clone_dtoh(&ws[0]).map_err(dtoh)?;
        let dsum = s.clone_dtoh(&ws[1]).map_err(driver_err("cuMemcpyDtoH"))?;
        dev.synchronize()?;
        let ds = d.dsink(&lse2, &dsum).expect("the launch has sinks");
        let DeviceBuffer::F32(slice) = &mut ds_dst.buf else {
            unreachable!("dsink was checked as f32")
        };
        if !ds.is_empty() {
            s.memcpy_htod(&ds, slice)
                .map_err(driver_err("cuMemcpyHtoDAsync"))?;
        }
    }
    Ok(())
}

/// Queues `bwd_prep`, `bwd_dq` and `bwd_dkdv`.
#[allow(clippy::too_many_arguments)]
fn launch<T>(
    dev: &CudaDevice,
    d: &BackwardLaunch,
    f: &[CudaFunction; 3],
    ins: [&CudaSlice<T>; 5],
    lse: &CudaSlice<f32>,
    ws: &mut [CudaSlice<f32>; 2],
    grads: &mut [&mut CudaSlice<T>; 3],
    table: &CudaSlice<i64>,
    slopes: &Option<CudaSlice<f32>>,
) -> Result<()> {
    let s = &dev.stream;
    // The buffers' device addresses; each guard records the launches' use of its buffer when
    // dropped, after they are queued (what `arg` does for a buffer pushed directly).
    let [q, k, v, out, dout] = ins.map(|x| x.device_ptr(s));
    let (lse_ptr, _lse) = lse.device_ptr(s);
    let [lse2, dsum] = ws;
    let (lse2_ptr, _lse2) = lse2.device_ptr_mut(s);
    let (dsum_ptr, _dsum) = dsum.device_ptr_mut(s);
    let [dq, dk, dv] = grads;
    let (dq_ptr, _dq) = dq.device_ptr_mut(s);
    let (dk_ptr, _dk) = dk.device_ptr_mut(s);
    let (dv_ptr, _dv) = dv.device_ptr_mut(s);
    let (table_ptr, _table) = table.device_ptr(s);
    let slopes = slopes.as_ref().map(|t| t.device_ptr(s));
    let params = BwdParams {
        q: q.0,
        k: k.0,
        v: v.0,
        out: out.0,
        dout: dout.0,
        lse: lse_ptr,
        lse2: lse2_ptr,
        dsum: dsum_ptr,
        dq: dq_ptr,
        dk: dk_ptr,
        dv: dv_ptr,
        seqs: table_ptr,
        alibi_slopes: slopes.as_ref().map_or(0, |t| t.0),
        ..d.params
    };
    let launches = [
        (&f[0], &d.prep, d.prep_grid()),
        (&f[1], &d.dq, d.dq_grid()),
        (&f[2], &d.dkdv, d.dkdv_grid()),
    ];
    for (function, key, grid) in launches {
        let Some(grid) = grid else { continue };
        let mut b = s.launch_builder(function);
        b.arg(&params);
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (key.threads() as u32, 1, 1),
            shared_mem_bytes: key.smem_bytes() as u32,
        };
        // SAFETY: the argument matches the BwdParams every bwd.cu kernel takes, laid out as
        // params.cuh's (the size and offset checks on both sides); its addresses are those of q,
        // k, v, out, dout (T), lse (f32), the workspaces (f32), dq, dk, dv (T), the table (i64) and
        // the slopes (f32; null without ALiBi, then never read), all borrowed here and alive past
        // the launches (their guards record the launches when dropped at the end).
        // Validation checked that every row each table entry names (bases, strides and lengths
        // of q, k, v, out, dout and the caller's lse) lies inside its buffer; the workspaces hold
        // lse_len elements indexed as the forward's contiguous lse, dq dq_len and dk/dv dk_len
        // elements indexed by token, head and column, each written by the one CTA that owns it.
        unsafe { b.launch(cfg) }.map_err(driver_err("cuLaunchKernel"))?;
    }
    Ok(())
}

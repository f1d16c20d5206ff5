//! # flashattn
//!
//! Exact attention `O = softmax(Q·Kᵀ·scale)·V`, computed the FlashAttention way:
//!
//! 1. q, k and v are cut into tiles (`block_m` query rows, `block_n` key rows) that fit the caches;
//! 2. for each query tile, the key tiles it can see are streamed through once: `S = Q·Kᵀ`, scale,
//!    softcap, ALiBi and masks, then an **online softmax** (running `row_max`, `row_sum`) and
//!    `acc_o += P·V`, all fused, so the N×N score matrix never exists;
//! 3. each row is divided by its `row_sum` once at the end, and its log-sum-exp `lse` is stored.
//!
//! Memory is O(N) instead of O(N²), and the result is exact (up to floating-point rounding).
//!
//! ```
//! use flashattn::{flash_attn, AttnOptions, TensorRef};
//! let (b, n, h, d) = (1, 3, 2, 4);
//! let q: Vec<f32> = (0..b * n * h * d).map(|i| (i as f32 * 0.37).sin()).collect();
//! let shape = [b, n, h, d];
//! let t = TensorRef::contiguous(&q, &shape);
//! let res = flash_attn(&t, &t, &t, &AttnOptions::default().causal(true)).unwrap();
//! assert_eq!(res.out.shape(), &shape);
//! assert_eq!(res.lse.shape(), &[b, h, n]);
//! ```
//!
//! ## Glossary
//! - `block_m` / `block_n`: rows of a query / key tile; `m_block` / `n_block`: a tile's index.
//! - `row_max`, `row_sum`: the online softmax's running statistics (log2 domain inside kernels).
//! - `acc_o`: the unnormalised output accumulator of a query tile.
//! - `lse`: log-sum-exp of a row's scaled scores, natural log; -inf for a fully masked row.
//! - `scale_log2`: `softmax_scale · log2(e)`, so exponentials are `exp2`.
//! - `delta`: `rowsum(dO ∘ O)`, the backward pass's softmax correction.

pub mod block_mask;
pub mod blocks;
pub(crate) mod convert;
pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode;
pub mod dropout;
pub mod dtype;
pub mod error;
pub mod flops;
pub mod fp8;
pub mod isa;
pub mod limits;
pub mod memory;
pub mod naive;
pub mod output;
pub(crate) mod params;
pub mod reference;
pub mod score_expr;
pub mod score_fn;
/// The CPU microkernels: which instruction set runs, and the kernels themselves (public for the
/// benches and tests; the attention calls are the supported interface).
pub mod simd {
    pub use crate::cpu::simd::*;
}
pub mod tensor;

/// Helpers for the unit tests.
#[cfg(test)]
pub(crate) mod test_util;

pub use block_mask::{BlockMask, BlockMaskBuilder, MaskIndex, MaskShape};
pub use blocks::MaskMod;
pub use decode::{
    flash_attn_with_kvcache, flash_attn_with_kvcache_into, merge_attn_partials, BlockTable,
    KvCacheOptions, Rotary,
};
pub use error::{CuSeqlensProblem, Error, ErrorKind, Result};

pub use output::{AttnGrads, AttnOutput, GradBuffers, OutBuffers};
pub use params::{AttnOptions, Descale, MAX_HEAD_DIM};
pub use score_fn::{ScoreFn, ScoreFunction, ScoreStrip, ScoreValue};
pub use tensor::{Buffer, DType, Element, Slice, SliceMut, Tensor, TensorMut, TensorRef};

use output::data;
use params::Params;
use tensor::with_dtype;

/// Frees the scratch buffers the CPU calls keep from one call to the next, and returns how many
/// bytes they held.
///
/// The largest working buffers of a call (the forward's packed k/v tiles; the backward's query
/// tiles and dQ copies) are kept when it returns, so that the next call of a similar shape does
/// not page-fault tens of MiB in again: at f32, N = 2048, 16 heads, d = 128, forward+backward took
/// ~9% less time (2 threads, docs/PERFORMANCE.md). At most 256 MiB are kept over all buffers; a
/// buffer that would exceed that is freed as usual. Concurrent calls each use their own buffers
/// (only one of them is kept per site).
pub fn release_scratch() -> usize {
    let kept = cpu::reuse::kept_bytes();
    cpu::reuse::release_all();
    kept
}

/// Fills the kept scratch buffers with NaN (tests: a call must never read what an earlier call
/// left in them).
#[cfg(feature = "test-hooks")]
pub fn poison_scratch() {
    cpu::reuse::poison_all();
}

impl AttnOutput {
    /// The backward pass of the forward that produced `self`: gradients of `Σ out ∘ dout` with
    /// respect to q, k and v. Pass the same q, k, v and options as the forward (the same layout,
    /// and the same `seed` regenerates the same dropout mask). See [`flash_attn_backward`].
    pub fn backward(
        &self,
        q: &TensorRef,
        k: &TensorRef,
        v: &TensorRef,
        dout: &TensorRef,
        opts: &AttnOptions,
    ) -> Result<AttnGrads> {
        flash_attn_backward(q, k, v, &self.out.view(), &self.lse.view(), dout, opts)
    }
}

/// Attention over a batch of equal-length sequences, or over packed sequences of different
/// lengths ([`AttnOptions::varlen`]).
///
/// Batched: q `[batch, seqlen_q, heads, head_dim]`, k and v `[batch, seqlen_k, heads_kv, head_dim]`;
/// `lse` is `[batch, heads, seqlen_q]`. Packed (`opts.varlen(cu_seqlens_q, cu_seqlens_k)`): q
/// `[total_q, heads, head_dim]`, k and v `[total_k, heads_kv, head_dim]`; sequence b holds q
/// tokens `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` and k/v tokens `cu_seqlens_k[b]..cu_seqlens_k[b + 1]`
/// and attends only within itself; masks apply per sequence; `lse` is `[heads, total_q]`.
/// All three of one dtype (f32, f16 or bf16); `heads` a multiple of `heads_kv` (MQA/GQA: query
/// head h reads kv head `h / (heads / heads_kv)`). Runs on the current rayon pool. FP8 inputs
/// take [`fp8::flash_attn_fp8`]; descale factors here are [`ErrorKind::DescaleNotFp8`].
///
/// Working memory besides `out` and `lse`: a few tiles per thread, and where key blocks are visited
/// 16 times or more on average (long query sequences, GQA groups), k and v packed once per call
/// into contiguous tiles (f32, so up to twice k and v in f32; bf16 pairs on the bf16 path). Those
/// tiles are kept for the next call (see [`release_scratch`]).
pub fn flash_attn(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
) -> Result<AttnOutput> {
    let p = params::attn(q, k, v, opts)?;
    forward(&p, q, k, v)
}

/// [`flash_attn`] writing into caller-provided buffers (validated first: on error nothing is
/// written). Every element of `out` and `lse` is written.
pub fn flash_attn_into(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
    dst: OutBuffers,
) -> Result<()> {
    let p = params::attn(q, k, v, opts)?;
    forward_into(&p, q, k, v, dst)
}

/// [`flash_attn_backward`] writing into caller-provided buffers (validated first: on error
/// nothing is written).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_backward_into(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    out: &TensorRef,
    lse: &TensorRef,
    dout: &TensorRef,
    opts: &AttnOptions,
    dst: GradBuffers,
) -> Result<()> {
    let p = params::attn(q, k, v, opts)?;
    let g = params::grad_inputs(&p, out, lse, dout)?;
    backward_into(&p, &g, [q, k, v, out, dout], dst)
}

fn slice_mut_len(s: &SliceMut) -> (DType, usize) {
    (s.dtype(), s.as_slice().len())
}

/// The forward of validated `p` into `dst` (checked here).
pub(crate) fn forward_into(
    p: &Params,
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dst: OutBuffers,
) -> Result<()> {
    params::out_buffers(p, p.dtype, &dst)?;
    let lse = dst.lse;
    match dst.out {
        SliceMut::F32(o) => cpu::forward::forward_into(p, data(q), data(k), data(v), o, lse),
        SliceMut::F16(o) => cpu::forward::forward_into(p, data(q), data(k), data(v), o, lse),
        SliceMut::BF16(o) => cpu::forward::forward_into(p, data(q), data(k), data(v), o, lse),
    }
}

fn backward_into(
    p: &Params,
    g: &params::GradInputs,
    [q, k, v, out, dout]: [&TensorRef; 5],
    dst: GradBuffers,
) -> Result<()> {
    params::destination("dq", slice_mut_len(&dst.dq), p.dtype, &p.out_shape)?;
    params::destination("dk", slice_mut_len(&dst.dk), p.dtype, &p.k_shape)?;
    params::destination("dv", slice_mut_len(&dst.dv), p.dtype, &p.k_shape)?;
    let sink_shape = [if p.sink.is_some() { p.heads } else { 0 }];
    let dsink_len = dst.dsink.as_ref().map_or(0, |d| d.len());
    params::destination("dsink", (DType::F32, dsink_len), DType::F32, &sink_shape)?;
    if p.sink.is_some() != dst.dsink.is_some() {
        return Err(ErrorKind::DestinationLength {
            tensor: "dsink",
            expected: sink_shape[0],
            got: dsink_len,
            shape: sink_shape.to_vec(),
        }
        .into());
    }
    fn run<T: Element>(
        p: &Params,
        g: &params::GradInputs,
        [q, k, v, out, dout]: [&TensorRef; 5],
        grads: (&mut [T], &mut [T], &mut [T]),
    ) -> Result<Option<Vec<f32>>> {
        let inputs = cpu::backward::BackwardInputs {
            q: data(q),
            k: data(k),
            v: data(v),
            out: data(out),
            dout: data(dout),
        };
        cpu::backward::backward_into(p, g, inputs, grads)
    }
    let inputs = [q, k, v, out, dout];
    let dsink = match (dst.dq, dst.dk, dst.dv) {
        (SliceMut::F32(a), SliceMut::F32(b), SliceMut::F32(c)) => run(p, g, inputs, (a, b, c)),
        (SliceMut::F16(a), SliceMut::F16(b), SliceMut::F16(c)) => run(p, g, inputs, (a, b, c)),
        (SliceMut::BF16(a), SliceMut::BF16(b), SliceMut::BF16(c)) => run(p, g, inputs, (a, b, c)),
        // Unreachable: the three dtypes were checked equal to p.dtype above.
        (dq, _, _) => Err(ErrorKind::DType {
            tensor: "dq",
            expected: p.dtype,
            got: dq.dtype(),
        }
        .into()),
    }?;
    if let (Some(w), Some(s)) = (dst.dsink, dsink) {
        w.copy_from_slice(&s);
    }
    Ok(())
}

/// Backward pass of [`flash_attn`]: gradients of `Σ out ∘ dout` with respect to q, k and v
/// (accumulated in f32, returned in q's dtype, contiguous, shapes of q, k, v; for GQA/MQA, dk and dv
/// sum over the query heads of each group).
///
/// `out` and `lse` are the forward's results for the same inputs and options (batched, or packed
/// with [`AttnOptions::varlen`]: `lse` `[heads, total_q]`); `dout` has q's shape and dtype (any
/// strides, last dimension contiguous). Attention probabilities are recomputed
/// tile by tile from q, k and `lse`; no buffer grows with seqlen_q · seqlen_k. Results are
/// bit-identical for any thread count.
///
/// dQ is accumulated in the same pass as dK and dV, in up to four f32 copies of dQ (one per chunk
/// of key blocks, summed in order at the end; five block products per tile); with too few
/// (sequence, kv head) pairs for the machine's cores, in a second pass that recomputes the
/// scores instead (seven products, no copies). Besides the copies, q and dO are kept in tiles built
/// once per call: four times q's size in f32 (in bf16 on the bf16 dot-product path). The choice
/// depends on the shape and the machine's core count, not on the thread pool; the environment
/// variable `FLASHATTN_DQ_CHUNKS` forces it (`0`: two passes, `1`-`4`: that many copies; anything
/// else is [`ErrorKind::DqChunksUnknown`]). The copies and the tiles are kept for the next call
/// (see [`release_scratch`]).
pub fn flash_attn_backward(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    out: &TensorRef,
    lse: &TensorRef,
    dout: &TensorRef,
    opts: &AttnOptions,
) -> Result<AttnGrads> {
    let p = params::attn(q, k, v, opts)?;
    let g = params::grad_inputs(&p, out, lse, dout)?;
    backward(&p, &g, q, k, v, out, dout)
}

fn backward(
    p: &Params,
    g: &params::GradInputs,
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    out: &TensorRef,
    dout: &TensorRef,
) -> Result<AttnGrads> {
    fn typed<T: Element>(
        p: &Params,
        g: &params::GradInputs,
        q: &TensorRef,
        k: &TensorRef,
        v: &TensorRef,
        out: &TensorRef,
        dout: &TensorRef,
    ) -> Result<AttnGrads> {
        let (dq, dk, dv, dsink) =
            cpu::backward::backward(p, g, data(q), data(k), data(v), data(out), data(dout))?;
        Ok(AttnGrads {
            dq: Tensor::new_unchecked(T::wrap_vec(dq), p.out_shape.clone()),
            dk: Tensor::new_unchecked(T::wrap_vec(dk), p.k_shape.clone()),
            dv: Tensor::new_unchecked(T::wrap_vec(dv), p.k_shape.clone()),
            dsink: dsink.map(|s| Tensor::new_unchecked(Buffer::F32(s), vec![p.heads])),
        })
    }
    with_dtype!(p.dtype, T => typed::<T>(p, g, q, k, v, out, dout))
}

fn forward(p: &Params, q: &TensorRef, k: &TensorRef, v: &TensorRef) -> Result<AttnOutput> {
    fn typed<T: Element>(
        p: &Params,
        q: &TensorRef,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<AttnOutput> {
        let (out, lse) = cpu::forward::forward(p, data(q), data(k), data(v))?;
        Ok(AttnOutput {
            out: Tensor::new_unchecked(T::wrap_vec(out), p.out_shape.clone()),
            lse: Tensor::new_unchecked(Buffer::F32(lse), p.lse_shape.clone()),
        })
    }
    with_dtype!(p.dtype, T => typed::<T>(p, q, k, v))
}

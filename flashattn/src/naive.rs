//! Standard, unfused attention in the inputs' precision: `S = Q·Kᵀ`, softmax, `O = P·V`, with the
//! whole `S` and `P` of every (sequence, head) materialised at once, as `softmax(q @ k.T) @ v` does
//! in a framework. Two roles: the baseline of `flashattn bench`, and the yardstick of the tests'
//! error bounds (flashattn's error must stay within a small multiple of this one's).
//!
//! Every intermediate a framework would store in the input dtype is rounded to it: the scores,
//! the scaled/capped/biased scores and the probabilities; products accumulate in f32 (as tensor
//! cores and BLAS do). Memory: `2 · Σ_b heads · seqlen_q · seqlen_k` f32 values ([`memory_bytes`]).

use crate::cpu::kernels::dot;
use crate::error::Result;
use crate::memory::try_filled;
use crate::params::{self, AttnOptions, Params};
use crate::tensor::{with_dtype, Buffer, Element, Tensor, TensorRef};
use crate::{data, AttnOutput};
use rayon::prelude::*;

/// Bytes of S and P that [`attention`] allocates for a batched shape.
pub fn memory_bytes(batch: usize, heads: usize, seqlen_q: usize, seqlen_k: usize) -> u128 {
    2 * 4 * batch as u128 * heads as u128 * seqlen_q as u128 * seqlen_k as u128
}

/// Naive attention, batched layout; same arguments, validation and result layout as
/// [`crate::flash_attn`].
pub fn attention(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
) -> Result<AttnOutput> {
    let p = params::batched(q, k, v, opts)?;
    dispatch(&p, q, k, v, DotOrder::Lanes8)
}

/// How the naive implementation sums each `q · k` dot product. Both are ordinary f32 summations;
/// they round differently, and with huge logits under softcap (raw dot products that cancel to
/// near 0, where tanh's slope is 1) that rounding is the output's main error. The tests bound
/// flashattn's error by the larger of the two, so the yardstick does not hinge on one arbitrary
/// order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DotOrder {
    /// 8 interleaved partial sums combined pairwise (what [`attention`] does).
    Lanes8,
    /// One running sum from the first element to the last, as a BLAS matrix-product kernel
    /// accumulates along k (what `softmax(q @ k.T) @ v` in a framework does).
    Sequential,
}

/// [`attention`] with a chosen [`DotOrder`] for the scores.
pub fn attention_with_order(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
    order: DotOrder,
) -> Result<AttnOutput> {
    let p = params::batched(q, k, v, opts)?;
    dispatch(&p, q, k, v, order)
}

/// Naive attention, packed layout; as [`crate::flash_attn`] with [`crate::AttnOptions::varlen`].
pub fn attention_varlen(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<AttnOutput> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    dispatch(&p, q, k, v, DotOrder::Lanes8)
}

fn dispatch(
    p: &Params,
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    order: DotOrder,
) -> Result<AttnOutput> {
    fn typed<T: Element>(
        p: &Params,
        q: &TensorRef,
        k: &TensorRef,
        v: &TensorRef,
        order: DotOrder,
    ) -> Result<AttnOutput> {
        let (out, lse) = run::<T>(p, data(q), data(k), data(v), order)?;
        Ok(AttnOutput {
            out: Tensor::new_unchecked(T::wrap_vec(out), p.out_shape.clone()),
            lse: Tensor::new_unchecked(Buffer::F32(lse), p.lse_shape.clone()),
        })
    }
    with_dtype!(p.dtype, T => typed::<T>(p, q, k, v, order))
}

/// The one-score strip of query `i`, key `j` of (sequence b, head h).
fn strip(b: usize, h: usize, i: usize, j: usize) -> crate::ScoreStrip {
    crate::ScoreStrip {
        batch: b,
        head: h,
        q0: i,
        k: j,
    }
}

/// Rounds an f32 to the precision of `T`.
#[inline(always)]
fn round<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

fn run<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
    order: DotOrder,
) -> Result<(Vec<T>, Vec<f32>)> {
    let d = p.head_dim;
    let mut out = try_filled("`out`", T::default(), p.out_len())?;
    let mut lse = try_filled("`lse`", f32::NEG_INFINITY, p.lse_len())?;
    let sizes: Vec<usize> = p.seqs.iter().map(|s| s.seqlen_q * s.seqlen_k).collect();
    // Sums of products of validated lengths can still overflow (many long sequences).
    let total = sizes
        .iter()
        .try_fold(0usize, |acc, &n| acc.checked_add(n))
        .and_then(|n| n.checked_mul(p.heads))
        .unwrap_or(usize::MAX);
    let mut scores = try_filled("the naive score matrix S", 0f32, total)?;
    let mut probs = try_filled("the naive probability matrix P", 0f32, total)?;
    // (sequence, head) jobs, each with its own S and P.
    let mut jobs = Vec::new();
    let (mut s_rest, mut p_rest) = (scores.as_mut_slice(), probs.as_mut_slice());
    for (b, &n) in sizes.iter().enumerate() {
        for h in 0..p.heads {
            let (s_head, s_tail) = std::mem::take(&mut s_rest).split_at_mut(n);
            let (p_head, p_tail) = std::mem::take(&mut p_rest).split_at_mut(n);
            (s_rest, p_rest) = (s_tail, p_tail);
            jobs.push((b, h, s_head, p_head));
        }
    }
    let results: Vec<(usize, usize, Vec<f32>, Vec<f32>)> = jobs
        .into_par_iter()
        .map(|(b, h, s_mat, p_mat)| {
            let (o, l) = head::<T>(p, (q, k, v), b, h, s_mat, p_mat, order);
            (b, h, o, l)
        })
        .collect();
    for (b, h, o, l) in results {
        for (i, row) in o.chunks_exact(d).enumerate() {
            let at = p.out_offset(b, i, h);
            T::narrow(row, &mut out[at..at + d]);
            lse[p.lse_offset(b, h, i)] = l[i];
        }
    }
    Ok((out, lse))
}

/// One (sequence, head): returns its output rows (f32 values already rounded to T) and LSEs.
#[allow(clippy::too_many_arguments)]
/// `a · b` summed in `order`.
fn dot_in(order: DotOrder, a: &[f32], b: &[f32]) -> f32 {
    match order {
        DotOrder::Lanes8 => dot(a, b),
        DotOrder::Sequential => a.iter().zip(b).fold(0.0, |acc, (x, y)| acc + x * y),
    }
}

#[allow(clippy::too_many_arguments)]
fn head<T: Element>(
    p: &Params,
    (q, k, v): (&[T], &[T], &[T]),
    b: usize,
    h: usize,
    s_mat: &mut [f32],
    p_mat: &mut [f32],
    order: DotOrder,
) -> (Vec<f32>, Vec<f32>) {
    let (s, d, hk) = (p.seqs[b], p.head_dim, p.kv_head(h));
    let (sq, sk) = (s.seqlen_q, s.seqlen_k);
    let rows = |src: &[T], base: usize, stride: usize, n: usize| -> Vec<f32> {
        let mut m = vec![0f32; n * d];
        for r in 0..n {
            T::widen(
                &src[base + r * stride..base + r * stride + d],
                &mut m[r * d..(r + 1) * d],
            );
        }
        m
    };
    let qm = rows(q, s.q_base + h * p.q.head_stride, p.q.row_stride, sq);
    let km = rows(k, s.k_base + hk * p.k.head_stride, p.k.row_stride, sk);
    let vm = rows(v, s.v_base + hk * p.v.head_stride, p.v.row_stride, sk);
    let slope = p.alibi_slope(b, h);
    let diag_offset = sk as i64 - sq as i64;
    let mut lse = vec![f32::NEG_INFINITY; sq];
    for i in 0..sq {
        let srow = &mut s_mat[i * sk..(i + 1) * sk];
        let diag = i as i64 + diag_offset;
        for (j, x) in srow.iter_mut().enumerate() {
            let mut val = round::<T>(
                round::<T>(dot_in(
                    order,
                    &qm[i * d..(i + 1) * d],
                    &km[j * d..(j + 1) * d],
                )) * p.softmax_scale,
            );
            if let Some(cap) = p.softcap {
                val = round::<T>(cap * (val / cap).tanh());
            }
            if let Some(slope) = slope {
                val = round::<T>(val - slope * (diag - j as i64).unsigned_abs() as f32);
            }
            if let Some(f) = &p.score_fn {
                let mut x = [val];
                f.apply(strip(b, h, i, j), &mut x, None);
                val = round::<T>(x[0]);
            }
            let hidden_by_fn = p.mask_mod.as_ref().is_some_and(|f| !f.allows(b, h, i, j));
            // i128: window sides up to i64::MAX cannot overflow.
            let (j, diag) = (j as i128, diag as i128);
            let hidden = p.window_left.is_some_and(|l| j < diag - l as i128)
                || p.window_right.is_some_and(|r| j > diag + r as i128)
                || hidden_by_fn;
            *x = if hidden { f32::NEG_INFINITY } else { val };
        }
        // A learnable sink is one more logit of the row, with no value.
        let sink = p.sink.as_ref().map(|s| s[h]);
        let max = srow
            .iter()
            .chain(&sink)
            .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let prow = &mut p_mat[i * sk..(i + 1) * sk];
        if max == f32::NEG_INFINITY {
            prow.fill(0.0);
            continue;
        }
        let sum: f32 = srow.iter().chain(&sink).map(|&x| (x - max).exp()).sum();
        for (pj, &x) in prow.iter_mut().zip(srow.iter()) {
            *pj = round::<T>((x - max).exp() / sum);
        }
        lse[i] = max + sum.ln();
    }
    let mut out = vec![0f32; sq * d];
    let mut keep = vec![true; sk];
    let drop_scale = p.dropout.map_or(1.0, |dr| dr.scale());
    for i in 0..sq {
        if let Some(drop) = p.dropout {
            drop.keep_row(b, h, i, 0, &mut keep);
        }
        let orow = &mut out[i * d..(i + 1) * d];
        for (j, &pj) in p_mat[i * sk..(i + 1) * sk].iter().enumerate() {
            let pj = if keep[j] {
                round::<T>(pj * drop_scale)
            } else {
                0.0
            };
            crate::cpu::kernels::axpy(pj, &vm[j * d..(j + 1) * d], orow);
        }
        orow.iter_mut().for_each(|x| *x = round::<T>(*x));
    }
    (out, lse)
}

/// Naive backward in the inputs' precision (what autograd through `softmax(q @ k.T) @ v` computes):
/// recomputes the naive forward, then `dV = P̃ᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP - rowsum(P ∘ dP))`,
/// `dQ = dS·K·scale`, `dK = dSᵀ·Q·scale`, each product accumulated in f32 and rounded to the dtype.
/// The yardstick of the gradient tests' error bounds.
pub fn attention_backward(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
    opts: &AttnOptions,
) -> Result<crate::AttnGrads> {
    let p = params::batched(q, k, v, opts)?;
    backward_dispatch(&p, q, k, v, dout, RowTerm::FromProbs)
}

/// [`attention_backward`] with FlashAttention's row term: `dS = P ∘ (dP - D)` with
/// `D = rowsum(dO ∘ O)` from the naive forward's output as stored (rounded to the dtype), the
/// identity the fused backward uses so that it needs only O, not a pass over P. Equal to
/// `rowsum(P ∘ dP)` in exact arithmetic, but its rounding does not cancel against dP's where a
/// row's probability sits on one key (seqlen_k 1, or one key dominating under dropout's
/// `1/(1-p)`): the yardstick for that term, beside [`attention_backward`]'s.
pub fn attention_backward_from_output(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
    opts: &AttnOptions,
) -> Result<crate::AttnGrads> {
    let p = params::batched(q, k, v, opts)?;
    backward_dispatch(&p, q, k, v, dout, RowTerm::FromOutput)
}

/// Naive backward, packed layout.
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen_backward(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<crate::AttnGrads> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    backward_dispatch(&p, q, k, v, dout, RowTerm::FromProbs)
}

/// [`attention_backward_from_output`], packed layout.
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen_backward_from_output(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<crate::AttnGrads> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    backward_dispatch(&p, q, k, v, dout, RowTerm::FromOutput)
}

/// How the naive backward computes each row's term `D` of `dS = P ∘ (dP - D)`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowTerm {
    /// `rowsum(P ∘ dP)` (autograd's softmax backward).
    FromProbs,
    /// `rowsum(dO ∘ O)`, O the stored output (FlashAttention's).
    FromOutput,
}

fn backward_dispatch(
    p: &Params,
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
    term: RowTerm,
) -> Result<crate::AttnGrads> {
    let layout = params::q_like("dout", dout, p)?;
    fn typed<T: Element>(
        p: &Params,
        q: &TensorRef,
        k: &TensorRef,
        v: &TensorRef,
        dout: &TensorRef,
        (layout, term): (&params::QLike, RowTerm),
    ) -> Result<crate::AttnGrads> {
        let (dq, dk, dv, dsink) =
            backward_run::<T>(p, data(q), data(k), data(v), data(dout), (layout, term))?;
        let wrap = |x: Vec<f32>, shape: &[usize]| {
            let mut t = vec![T::default(); x.len()];
            T::narrow(&x, &mut t);
            Tensor::new_unchecked(T::wrap_vec(t), shape.to_vec())
        };
        Ok(crate::AttnGrads {
            dq: wrap(dq, &p.out_shape),
            dk: wrap(dk, &p.k_shape),
            dv: wrap(dv, &p.k_shape),
            dsink: p
                .sink
                .as_ref()
                .map(|_| Tensor::new_unchecked(crate::Buffer::F32(dsink), vec![p.heads])),
        })
    }
    with_dtype!(p.dtype, T => typed::<T>(p, q, k, v, dout, (&layout, term)))
}

/// dq, dk, dv (f32, rounded to the dtype) and dsink.
type Grads32 = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn backward_run<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
    (layout, term): (&params::QLike, RowTerm),
) -> Result<Grads32> {
    let d = p.head_dim;
    let scale = p.softmax_scale;
    let mut dq = try_filled("`dq`", 0f32, p.out_len())?;
    let mut dk = try_filled("`dk`", 0f32, p.dk_len())?;
    let mut dv = try_filled("`dv`", 0f32, p.dk_len())?;
    let jobs: Vec<(usize, usize)> = (0..p.seqs.len())
        .flat_map(|b| (0..p.heads).map(move |h| (b, h)))
        .collect();
    let per_head: Vec<HeadGrads> = jobs
        .par_iter()
        .map(|&(b, h)| head_backward::<T>(p, q, k, v, dout, (layout, term), b, h))
        .collect::<Result<_>>()?;
    let mut dsink = vec![0f32; p.heads];
    // Per-head gradients (already rounded to T) summed over the GQA group in a fixed order.
    for (&(b, h), (hdq, hdk, hdv, hds)) in jobs.iter().zip(per_head) {
        dsink[h] += hds;
        let (s, hk) = (p.seqs[b], p.kv_head(h));
        for i in 0..s.seqlen_q {
            let at = p.out_offset(b, i, h);
            for c in 0..d {
                dq[at + c] = round::<T>(hdq[i * d + c] * scale);
            }
        }
        for j in 0..s.seqlen_k {
            let at = p.dk_offset(b, j, hk);
            for c in 0..d {
                dk[at + c] += round::<T>(hdk[j * d + c] * scale);
                dv[at + c] += round::<T>(hdv[j * d + c]);
            }
        }
    }
    Ok((dq, dk, dv, dsink))
}

/// One (sequence, head)'s unscaled dQ/scale, dK/scale, dV and part of the sink gradient.
type HeadGrads = (Vec<f32>, Vec<f32>, Vec<f32>, f32);

/// Unscaled dQ/scale, dK/scale and dV of one (sequence, head), and its rows' part of the sink
/// gradient, `-Σ_i P_sink,i · rowsum(P ∘ dP)_i` (0 without sinks); `OutOfMemory` where its
/// seqlen_q × seqlen_k matrices cannot be allocated.
#[allow(clippy::too_many_arguments)]
fn head_backward<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
    (layout, term): (&params::QLike, RowTerm),
    b: usize,
    h: usize,
) -> Result<HeadGrads> {
    let (d, scale) = (p.head_dim, p.softmax_scale);
    let s = p.seqs[b];
    let (sq, sk) = (s.seqlen_q, s.seqlen_k);
    let hk = p.kv_head(h);
    let mut s_mat = try_filled("the naive score matrix S", 0f32, sq * sk)?;
    let mut p_mat = try_filled("the naive probability matrix P", 0f32, sq * sk)?;
    let (out, lse) = head::<T>(p, (q, k, v), b, h, &mut s_mat, &mut p_mat, DotOrder::Lanes8);
    let sink = p.sink.as_ref().map(|s| s[h]);
    let mut dsink = 0f32;
    let row = |src: &[T], at: usize| -> Vec<f32> {
        let mut r = vec![0f32; d];
        T::widen(&src[at..at + d], &mut r);
        r
    };
    let qr: Vec<Vec<f32>> = (0..sq)
        .map(|i| row(q, s.q_base + i * p.q.row_stride + h * p.q.head_stride))
        .collect();
    let kr: Vec<Vec<f32>> = (0..sk)
        .map(|j| row(k, s.k_base + j * p.k.row_stride + hk * p.k.head_stride))
        .collect();
    let vr: Vec<Vec<f32>> = (0..sk)
        .map(|j| row(v, s.v_base + j * p.v.row_stride + hk * p.v.head_stride))
        .collect();
    let dor: Vec<Vec<f32>> = (0..sq).map(|i| row(dout, layout.offset(b, i, h))).collect();
    let drop_scale = p.dropout.map_or(1.0, |dr| dr.scale());
    let mut keep = vec![true; sk];
    let (mut hdq, mut hdk, mut hdv) = (vec![0f32; sq * d], vec![0f32; sk * d], vec![0f32; sk * d]);
    for i in 0..sq {
        if let Some(drop) = p.dropout {
            drop.keep_row(b, h, i, 0, &mut keep);
        }
        let prow = &p_mat[i * sk..(i + 1) * sk];
        let pdrop: Vec<f32> = prow
            .iter()
            .zip(&keep)
            .map(|(&x, &kp)| if kp { round::<T>(x * drop_scale) } else { 0.0 })
            .collect();
        let dp: Vec<f32> = (0..sk)
            .map(|j| {
                if keep[j] {
                    round::<T>(round::<T>(dot(&dor[i], &vr[j])) * drop_scale)
                } else {
                    0.0
                }
            })
            .collect();
        let pdp = match term {
            RowTerm::FromProbs => round::<T>(prow.iter().zip(&dp).map(|(a, b)| a * b).sum()),
            RowTerm::FromOutput => round::<T>(dot(&dor[i], &out[i * d..(i + 1) * d])),
        };
        if let Some(s) = sink {
            dsink -= (s - lse[i]).exp() * pdp;
        }
        for j in 0..sk {
            let mut ds = round::<T>(prow[j] * (dp[j] - pdp));
            if let Some(cap) = p.softcap {
                if s_mat[i * sk + j] != f32::NEG_INFINITY {
                    let raw = round::<T>(round::<T>(dot(&qr[i], &kr[j])) * scale);
                    let th = (raw / cap).tanh();
                    ds = round::<T>(ds * (1.0 - th * th));
                }
            }
            if let (Some(f), true) = (&p.score_fn, prow[j] != 0.0) {
                // The score the function was given, as the forward computed it.
                let mut val = round::<T>(round::<T>(dot(&qr[i], &kr[j])) * scale);
                if let Some(cap) = p.softcap {
                    val = round::<T>(cap * (val / cap).tanh());
                }
                if let Some(slope) = p.alibi_slope(b, h) {
                    let dist = (i as i64 + sk as i64 - sq as i64 - j as i64).unsigned_abs();
                    val = round::<T>(val - slope * dist as f32);
                }
                let mut g = [0f32];
                f.apply(strip(b, h, i, j), &mut [val], Some(&mut g));
                ds = round::<T>(ds * g[0]);
            }
            crate::cpu::kernels::axpy(ds, &kr[j], &mut hdq[i * d..(i + 1) * d]);
            crate::cpu::kernels::axpy(ds, &qr[i], &mut hdk[j * d..(j + 1) * d]);
            crate::cpu::kernels::axpy(pdrop[j], &dor[i], &mut hdv[j * d..(j + 1) * d]);
        }
    }
    Ok((hdq, hdk, hdv, dsink))
}

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
use crate::params::{self, AttnOptions, Params};
use crate::tensor::{Buffer, DType, Element, Tensor, TensorRef};
use crate::{data, AttnOutput};
use half::{bf16, f16};
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
    Ok(dispatch(&p, q, k, v))
}

/// Naive attention, packed layout; as [`crate::flash_attn_varlen`].
pub fn attention_varlen(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<AttnOutput> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    Ok(dispatch(&p, q, k, v))
}

fn dispatch(p: &Params, q: &TensorRef, k: &TensorRef, v: &TensorRef) -> AttnOutput {
    fn typed<T: Element>(p: &Params, q: &TensorRef, k: &TensorRef, v: &TensorRef) -> AttnOutput {
        let (out, lse) = run::<T>(p, data(q), data(k), data(v));
        AttnOutput {
            out: Tensor::new_unchecked(T::wrap_vec(out), p.out_shape.clone()),
            lse: Tensor::new_unchecked(Buffer::F32(lse), p.lse_shape.clone()),
        }
    }
    match p.dtype {
        DType::F32 => typed::<f32>(p, q, k, v),
        DType::F16 => typed::<f16>(p, q, k, v),
        DType::BF16 => typed::<bf16>(p, q, k, v),
    }
}

/// Rounds an f32 to the precision of `T`.
#[inline(always)]
fn round<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

fn run<T: Element>(p: &Params, q: &[T], k: &[T], v: &[T]) -> (Vec<T>, Vec<f32>) {
    let d = p.head_dim;
    let sizes: Vec<usize> = p.seqs.iter().map(|s| s.seqlen_q * s.seqlen_k).collect();
    let total: usize = sizes.iter().sum::<usize>() * p.heads;
    let mut scores = vec![0f32; total];
    let mut probs = vec![0f32; total];
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
            let (o, l) = head::<T>(p, q, k, v, b, h, s_mat, p_mat);
            (b, h, o, l)
        })
        .collect();
    let mut out = vec![T::default(); p.out_len()];
    let mut lse = vec![f32::NEG_INFINITY; p.lse_len()];
    for (b, h, o, l) in results {
        for (i, row) in o.chunks_exact(d).enumerate() {
            let at = p.out_offset(b, i, h);
            T::narrow(row, &mut out[at..at + d]);
            lse[p.lse_offset(b, h, i)] = l[i];
        }
    }
    (out, lse)
}

/// One (sequence, head): returns its output rows (f32 values already rounded to T) and LSEs.
#[allow(clippy::too_many_arguments)]
fn head<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
    b: usize,
    h: usize,
    s_mat: &mut [f32],
    p_mat: &mut [f32],
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
                round::<T>(dot(&qm[i * d..(i + 1) * d], &km[j * d..(j + 1) * d])) * p.softmax_scale,
            );
            if let Some(cap) = p.softcap {
                val = round::<T>(cap * (val / cap).tanh());
            }
            if let Some(slope) = slope {
                val = round::<T>(val - slope * (diag - j as i64).unsigned_abs() as f32);
            }
            let j = j as i64;
            let hidden = p.window_left.is_some_and(|l| j < diag - l as i64)
                || p.window_right.is_some_and(|r| j > diag + r as i64);
            *x = if hidden { f32::NEG_INFINITY } else { val };
        }
        let max = srow.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let prow = &mut p_mat[i * sk..(i + 1) * sk];
        if max == f32::NEG_INFINITY {
            prow.fill(0.0);
            continue;
        }
        let sum: f32 = srow.iter().map(|&x| (x - max).exp()).sum();
        for (pj, &x) in prow.iter_mut().zip(srow.iter()) {
            *pj = round::<T>((x - max).exp() / sum);
        }
        lse[i] = max + sum.ln();
    }
    let mut out = vec![0f32; sq * d];
    for i in 0..sq {
        let orow = &mut out[i * d..(i + 1) * d];
        for (j, &pj) in p_mat[i * sk..(i + 1) * sk].iter().enumerate() {
            crate::cpu::kernels::axpy(pj, &vm[j * d..(j + 1) * d], orow);
        }
        orow.iter_mut().for_each(|x| *x = round::<T>(*x));
    }
    (out, lse)
}

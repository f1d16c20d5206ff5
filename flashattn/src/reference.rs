//! Naive attention in f64: the oracle the tests compare against.
//!
//! It builds each head's full `seqlen_q x seqlen_k` score matrix, applies the options straight from
//! their written definitions (it does not use [`crate::blocks`], so a bounds bug there cannot hide in
//! both), and normalises with an exact softmax. Slow and O(N²) in memory by design.

use crate::error::Result;
use crate::params::{self, AttnOptions, Params};
use crate::tensor::{Slice, TensorRef};

/// f64 results in the layouts of the fast path: `out` like q, `lse` `[batch, heads, seqlen_q]`
/// (batched) or `[heads, total_q]` (packed).
#[derive(Clone, Debug)]
pub struct Reference {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub out_shape: Vec<usize>,
    pub lse_shape: Vec<usize>,
}

/// Reads element `idx` of a validated buffer as f64.
pub(crate) fn read(data: Slice, idx: usize) -> f64 {
    match data {
        Slice::F32(d) => d[idx] as f64,
        Slice::F16(d) => d[idx].to_f64(),
        Slice::BF16(d) => d[idx].to_f64(),
    }
}

/// Gathers one head row (head_dim values) of q/k/v as f64.
pub(crate) fn head_row(data: Slice, base: usize, d: usize) -> Vec<f64> {
    (0..d).map(|x| read(data, base + x)).collect()
}

/// Whether query `i` sees key `j`, written from the definition in the README.
pub(crate) fn visible(p: &Params, sq: usize, sk: usize, i: usize, j: usize) -> bool {
    let diag = i as i64 + sk as i64 - sq as i64; // the key on query i's diagonal
    let j = j as i64;
    let left_ok = p.window_left.is_none_or(|l| j >= diag - l as i64);
    let right_ok = p.window_right.is_none_or(|r| j <= diag + r as i64);
    left_ok && right_ok
}

/// The score of (query row, key row) after scale, softcap and ALiBi, or `None` when masked.
pub(crate) fn score(p: &Params, b: usize, h: usize, i: usize, j: usize, qrow: &[f64], krow: &[f64]) -> Option<f64> {
    let s = &p.seqs[b];
    if !visible(p, s.seqlen_q, s.seqlen_k, i, j) {
        return None;
    }
    let dot: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum();
    let mut x = dot * p.softmax_scale as f64;
    if let Some(cap) = p.softcap {
        let cap = cap as f64;
        x = cap * (x / cap).tanh();
    }
    if let Some(slope) = p.alibi_slope(b, h) {
        let dist = (i as i64 + s.seqlen_k as i64 - s.seqlen_q as i64 - j as i64).abs();
        x -= slope as f64 * dist as f64;
    }
    Some(x)
}

/// Rows of q, k or v of one head as f64, `[rows][head_dim]`.
pub(crate) fn head_rows(data: Slice, base: usize, row_stride: usize, head_offset: usize, rows: usize, d: usize) -> Vec<Vec<f64>> {
    (0..rows).map(|r| head_row(data, base + r * row_stride + head_offset, d)).collect()
}

/// The full score matrix of (sequence b, head h), `None` where masked.
pub(crate) fn score_matrix(p: &Params, b: usize, h: usize, q: &[Vec<f64>], k: &[Vec<f64>]) -> Vec<Vec<Option<f64>>> {
    (0..q.len()).map(|i| (0..k.len()).map(|j| score(p, b, h, i, j, &q[i], &k[j])).collect()).collect()
}

/// Softmax of one row of scores: (probabilities, lse). A fully masked row gives zeros and -inf.
pub(crate) fn softmax_row(row: &[Option<f64>]) -> (Vec<f64>, f64) {
    let max = row.iter().flatten().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    if max == f64::NEG_INFINITY {
        return (vec![0.0; row.len()], f64::NEG_INFINITY);
    }
    let e: Vec<f64> = row.iter().map(|x| x.map_or(0.0, |x| (x - max).exp())).collect();
    let sum: f64 = e.iter().sum();
    (e.iter().map(|x| x / sum).collect(), max + sum.ln())
}

fn run(p: &Params, q: &TensorRef, k: &TensorRef, v: &TensorRef) -> Reference {
    let d = p.head_dim;
    let mut out = vec![0.0; p.out_len()];
    let mut lse = vec![0.0; p.lse_len()];
    for (b, s) in p.seqs.iter().enumerate() {
        for h in 0..p.heads {
            let hk = p.kv_head(h);
            let qr = head_rows(q.data(), s.q_base, p.q.row_stride, h * p.q.head_stride, s.seqlen_q, d);
            let kr = head_rows(k.data(), s.k_base, p.k.row_stride, hk * p.k.head_stride, s.seqlen_k, d);
            let vr = head_rows(v.data(), s.v_base, p.v.row_stride, hk * p.v.head_stride, s.seqlen_k, d);
            let scores = score_matrix(p, b, h, &qr, &kr);
            for (i, row) in scores.iter().enumerate() {
                let (probs, row_lse) = softmax_row(row);
                let o = p.out_offset(b, i, h);
                for (j, pj) in probs.iter().enumerate() {
                    for x in 0..d {
                        out[o + x] += pj * vr[j][x];
                    }
                }
                lse[p.lse_offset(b, h, i)] = row_lse;
            }
        }
    }
    Reference { out, lse, out_shape: p.out_shape.clone(), lse_shape: p.lse_shape.clone() }
}

/// Naive f64 attention, batched layout (same validation and errors as [`crate::flash_attn`]).
pub fn attention(q: &TensorRef, k: &TensorRef, v: &TensorRef, opts: &AttnOptions) -> Result<Reference> {
    let p = params::batched(q, k, v, opts)?;
    Ok(run(&p, q, k, v))
}

/// Naive f64 attention, packed layout (same validation and errors as [`crate::flash_attn_varlen`]).
pub fn attention_varlen(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<Reference> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    Ok(run(&p, q, k, v))
}

/// One output row of the batched layout, for spot checks on shapes too large for [`attention`]:
/// `(out row of head_dim values, lse)` of (batch `b`, head `h`, query row `i`).
pub fn attention_row(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
    b: usize,
    h: usize,
    i: usize,
) -> Result<(Vec<f64>, f64)> {
    let p = params::batched(q, k, v, opts)?;
    let (d, s, hk) = (p.head_dim, p.seqs[b], p.kv_head(h));
    let qrow = head_row(q.data(), s.q_base + i * p.q.row_stride + h * p.q.head_stride, d);
    let kr = head_rows(k.data(), s.k_base, p.k.row_stride, hk * p.k.head_stride, s.seqlen_k, d);
    let scores: Vec<Option<f64>> = (0..s.seqlen_k).map(|j| score(&p, b, h, i, j, &qrow, &kr[j])).collect();
    let (probs, lse) = softmax_row(&scores);
    let mut out = vec![0.0; d];
    for (j, pj) in probs.iter().enumerate().filter(|(_, &pj)| pj != 0.0) {
        let vrow = head_row(v.data(), s.v_base + j * p.v.row_stride + hk * p.v.head_stride, d);
        for x in 0..d {
            out[x] += pj * vrow[x];
        }
    }
    Ok((out, lse))
}

//! Naive attention in f64: the oracle the tests compare against, forward and backward.
//!
//! It builds each head's full `seqlen_q x seqlen_k` score and probability matrices, applies the
//! options straight from their written definitions (it does not use [`crate::blocks`], so a bounds
//! bug there cannot hide in both), normalises with an exact softmax, and differentiates with the
//! textbook formulas (no `delta` shortcut). Slow and O(N²) in memory by design. Its own gradients
//! are checked against finite differences in this module's tests.

use crate::dropout::Dropout;
use crate::error::Result;
use crate::memory::{try_collect, try_filled};
use crate::params::{self, AttnOptions, Params, QLike};
use crate::tensor::{Slice, TensorRef};

/// f64 forward results in the layouts of the fast path: `out` like q, `lse` `[batch, heads,
/// seqlen_q]` (batched) or `[heads, total_q]` (packed).
#[derive(Clone, Debug)]
pub struct Reference {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub out_shape: Vec<usize>,
    pub lse_shape: Vec<usize>,
}

/// f64 gradients, contiguous, with the shapes of q (`dq`) and k/v (`dk`, `dv`).
#[derive(Clone, Debug)]
pub struct ReferenceGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    /// Gradient of the learnable sinks (`[heads]`), when the call has them.
    pub dsink: Option<Vec<f64>>,
}

/// A whole buffer widened to f64, indexed as the original.
pub(crate) fn widen_all(data: Slice) -> Vec<f64> {
    match data {
        Slice::F32(d) => d.iter().map(|&x| x as f64).collect(),
        Slice::F16(d) => d.iter().map(|x| x.to_f64()).collect(),
        Slice::BF16(d) => d.iter().map(|x| x.to_f64()).collect(),
    }
}

/// q, k and v as f64 buffers, indexed with the validated layouts of `p`.
pub(crate) struct Inputs<'a> {
    pub q: &'a [f64],
    pub k: &'a [f64],
    pub v: &'a [f64],
}

/// What the reference's per-head allocations are named in `OutOfMemory`: their sizes follow the
/// shapes (seqlen_q × seqlen_k per head), however small the results are.
const HEAD_BUFFERS: &str = "the reference's per-head matrices";

fn rows(buf: &[f64], base: usize, row_stride: usize, n: usize, d: usize) -> Result<Vec<Vec<f64>>> {
    let mut m = empty_rows(n)?;
    for (r, row) in m.iter_mut().enumerate() {
        let at = base + r * row_stride;
        *row = try_collect(HEAD_BUFFERS, buf[at..at + d].iter().copied())?;
    }
    Ok(m)
}

/// `n` empty rows, or `OutOfMemory`.
fn empty_rows<X>(n: usize) -> Result<Vec<Vec<X>>> {
    try_collect(HEAD_BUFFERS, (0..n).map(|_| Vec::new()))
}

/// `n` rows of `len` copies of `x`, or `OutOfMemory`.
fn matrix<X: Clone>(n: usize, len: usize, x: X) -> Result<Vec<Vec<X>>> {
    let mut m = empty_rows(n)?;
    for row in &mut m {
        *row = try_filled(HEAD_BUFFERS, x.clone(), len)?;
    }
    Ok(m)
}

/// Whether query `i` of (sequence b, head h) sees key `j`, written from the definition in
/// docs/SEMANTICS.md.
fn visible(
    p: &Params,
    (b, h): (usize, usize),
    (sq, sk): (usize, usize),
    i: usize,
    j: usize,
) -> bool {
    // In i128, so that any window side (up to i64::MAX) is exact.
    let diag = i as i128 + sk as i128 - sq as i128; // the key on query i's diagonal
    let j = j as i128;
    let left_ok = p.window_left.is_none_or(|l| j >= diag - l as i128);
    let right_ok = p.window_right.is_none_or(|r| j <= diag + r as i128);
    left_ok
        && right_ok
        && p.mask_mod
            .as_ref()
            .is_none_or(|f| f.allows(b, h, i, j as usize))
}

/// One (sequence, head): everything forward and backward need, as full matrices.
struct Head {
    q: Vec<Vec<f64>>,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    /// Probabilities before dropout (0 where masked).
    p: Vec<Vec<f64>>,
    /// Probabilities after dropout and its 1/(1-p) scaling: what multiplies V.
    p_drop: Vec<Vec<f64>>,
    /// Dropout's keep-mask (all true without dropout).
    keep: Vec<Vec<bool>>,
    /// d(score)/d(scaled dot product): 1, or 1 - tanh² with softcap, times a score function's
    /// derivative.
    dscore: Vec<Vec<f64>>,
    lse: Vec<f64>,
}

/// Query rows `row_range` of (sequence b, head h); row `r` of the result is query `row_range.start + r`.
fn head(
    p: &Params,
    x: &Inputs,
    b: usize,
    h: usize,
    row_range: std::ops::Range<usize>,
) -> Result<Head> {
    let (s, d, hk) = (p.seqs[b], p.head_dim, p.kv_head(h));
    let (sq, sk) = (s.seqlen_q, s.seqlen_k);
    let i0 = row_range.start;
    let q = rows(
        x.q,
        s.q_base + i0 * p.q.row_stride + h * p.q.head_stride,
        p.q.row_stride,
        row_range.len(),
        d,
    )?;
    let k = rows(x.k, s.k_base + hk * p.k.head_stride, p.k.row_stride, sk, d)?;
    let v = rows(x.v, s.v_base + hk * p.v.head_stride, p.v.row_stride, sk, d)?;
    let mut scores = matrix(q.len(), sk, None)?;
    let mut dscore = matrix(q.len(), sk, 1.0)?;
    for r in 0..q.len() {
        let i = i0 + r;
        for j in (0..sk).filter(|&j| visible(p, (b, h), (sq, sk), i, j)) {
            let dot: f64 = q[r].iter().zip(&k[j]).map(|(a, b)| a * b).sum();
            let mut val = dot * p.softmax_scale as f64;
            if let Some(cap) = p.softcap {
                let t = (val / cap as f64).tanh();
                val = cap as f64 * t;
                dscore[r][j] = 1.0 - t * t;
            }
            if let Some(slope) = p.alibi_slope(b, h) {
                val -= slope as f64 * (i as i64 + sk as i64 - sq as i64 - j as i64).abs() as f64;
            }
            if let Some(f) = &p.score_fn {
                let at = crate::MaskIndex {
                    batch: b,
                    head: h,
                    q: i,
                    k: j,
                };
                let y = f.eval_f64(at, val);
                val = y.value;
                dscore[r][j] *= y.grad;
            }
            // -inf from a score function hides the pair, as a mask does.
            scores[r][j] = (val != f64::NEG_INFINITY).then_some(val);
        }
    }
    let mut probs = empty_rows(q.len())?;
    let mut lse = try_filled(HEAD_BUFFERS, f64::NEG_INFINITY, q.len())?;
    // A learnable sink: one more logit of every row, with no value.
    let sink = p.sink.as_ref().map(|s| s[h] as f64);
    for (r, row) in scores.iter().enumerate() {
        let max = row
            .iter()
            .flatten()
            .chain(&sink)
            .fold(f64::NEG_INFINITY, |m, &x| m.max(x));
        if max == f64::NEG_INFINITY {
            probs[r] = try_filled(HEAD_BUFFERS, 0.0, sk)?;
            continue;
        }
        let sum: f64 = row
            .iter()
            .flatten()
            .chain(&sink)
            .map(|x| (x - max).exp())
            .sum();
        let p_row = row.iter().map(|x| x.map_or(0.0, |x| (x - max).exp() / sum));
        probs[r] = try_collect(HEAD_BUFFERS, p_row)?;
        lse[r] = max + sum.ln();
    }
    let keep = keep_rows(p.dropout, b, h, row_range, sk)?;
    let drop_scale = p.dropout.map_or(1.0, |dr| 1.0 / (1.0 - dr.p() as f64));
    let mut p_drop = empty_rows(q.len())?;
    for ((pd, row), kr) in p_drop.iter_mut().zip(&probs).zip(&keep) {
        let kept = row.iter().zip(kr);
        *pd = try_collect(
            HEAD_BUFFERS,
            kept.map(|(&x, &kept)| if kept { x * drop_scale } else { 0.0 }),
        )?;
    }
    Ok(Head {
        q,
        k,
        v,
        p: probs,
        p_drop,
        keep,
        dscore,
        lse,
    })
}

fn keep_rows(
    drop: Option<Dropout>,
    b: usize,
    h: usize,
    rows: std::ops::Range<usize>,
    sk: usize,
) -> Result<Vec<Vec<bool>>> {
    let mut keep = matrix(rows.len(), sk, true)?;
    if let Some(drop) = drop {
        for (i, row) in rows.zip(&mut keep) {
            drop.keep_row(b, h, i, 0, row);
        }
    }
    Ok(keep)
}

pub(crate) fn forward_core(p: &Params, x: &Inputs) -> Result<Reference> {
    let d = p.head_dim;
    let mut out = try_filled("`out`", 0.0, p.out_len())?;
    let mut lse = try_filled("`lse`", f64::NEG_INFINITY, p.lse_len())?;
    for b in 0..p.seqs.len() {
        for h in 0..p.heads {
            let hd = head(p, x, b, h, 0..p.seqs[b].seqlen_q)?;
            for (i, prow) in hd.p_drop.iter().enumerate() {
                let o = p.out_offset(b, i, h);
                for (pj, vj) in prow.iter().zip(&hd.v) {
                    for c in 0..d {
                        out[o + c] += pj * vj[c];
                    }
                }
                lse[p.lse_offset(b, h, i)] = hd.lse[i];
            }
        }
    }
    Ok(Reference {
        out,
        lse,
        out_shape: p.out_shape.clone(),
        lse_shape: p.lse_shape.clone(),
    })
}

pub(crate) fn backward_core(
    p: &Params,
    x: &Inputs,
    dout: &[f64],
    dout_layout: &QLike,
) -> Result<ReferenceGrads> {
    let d = p.head_dim;
    let scale = p.softmax_scale as f64;
    let mut dq = try_filled("`dq`", 0.0, p.out_len())?;
    let mut dk = try_filled("`dk`", 0.0, p.dk_len())?;
    let mut dv = try_filled("`dv`", 0.0, p.dk_len())?;
    let mut dsink = p.sink.as_ref().map(|_| vec![0.0; p.heads]);
    for b in 0..p.seqs.len() {
        for h in 0..p.heads {
            let hd = head(p, x, b, h, 0..p.seqs[b].seqlen_q)?;
            let hk = p.kv_head(h);
            let (sq, sk) = (hd.q.len(), hd.k.len());
            let drop_scale = p.dropout.map_or(1.0, |dr| 1.0 / (1.0 - dr.p() as f64));
            for i in 0..sq {
                let at = dout_layout.offset(b, i, h);
                let d_o = &dout[at..at + d];
                // dP[j] = d(out_i)/d(P_ij): through dropout, dO_i · V_j · keep / (1 - p).
                let dp = (0..sk).map(|j| {
                    let factor = if hd.keep[i][j] { drop_scale } else { 0.0 };
                    factor * d_o.iter().zip(&hd.v[j]).map(|(a, b)| a * b).sum::<f64>()
                });
                let dp = try_collect(HEAD_BUFFERS, dp)?;
                let pdp: f64 = (0..sk).map(|j| hd.p[i][j] * dp[j]).sum();
                // The sink's probability exp(sink - lse) times d(out)/d(its logit) = -pdp.
                if let (Some(ds), Some(s)) = (dsink.as_mut(), &p.sink) {
                    ds[h] -= (s[h] as f64 - hd.lse[i]).exp() * pdp;
                }
                for j in 0..sk {
                    // A hidden pair: no gradient, whatever a score function's derivative.
                    let pij = hd.p[i][j];
                    let dsc = if pij == 0.0 {
                        0.0
                    } else {
                        pij * (dp[j] - pdp) * hd.dscore[i][j] * scale
                    };
                    for c in 0..d {
                        dq[p.out_offset(b, i, h) + c] += dsc * hd.k[j][c];
                        dk[p.dk_offset(b, j, hk) + c] += dsc * hd.q[i][c];
                        dv[p.dk_offset(b, j, hk) + c] += hd.p_drop[i][j] * d_o[c];
                    }
                }
            }
        }
    }
    Ok(ReferenceGrads { dq, dk, dv, dsink })
}

fn run(p: &Params, q: &TensorRef, k: &TensorRef, v: &TensorRef) -> Result<Reference> {
    let (q, k, v) = (
        widen_all(q.data()),
        widen_all(k.data()),
        widen_all(v.data()),
    );
    forward_core(
        p,
        &Inputs {
            q: &q,
            k: &k,
            v: &v,
        },
    )
}

/// Naive f64 attention, batched layout (same validation and errors as [`crate::flash_attn`]).
pub fn attention(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
) -> Result<Reference> {
    let p = params::batched(q, k, v, opts)?;
    run(&p, q, k, v)
}

/// [`attention`] on f64 values: q `[batch, seqlen_q, heads, head_dim]`, k and v `[batch, seqlen_k,
/// heads_kv, head_dim]`, contiguous. For inputs that are not exact in f32, such as FP8 values
/// times a descale factor, or a rotated q: an oracle fed those rounded to f32 would carry an
/// error of the size of f32 attention's own.
pub fn attention_f64(
    (q, q_shape): (&[f64], &[usize]),
    (k, k_shape): (&[f64], &[usize]),
    (v, v_shape): (&[f64], &[usize]),
    opts: &AttnOptions,
) -> Result<Reference> {
    // The shapes are validated on f32 stand-ins of the same lengths (the values are unused).
    let (qs, ks, vs) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; v.len()],
    );
    let p = params::batched(
        &TensorRef::contiguous(&qs, q_shape),
        &TensorRef::contiguous(&ks, k_shape),
        &TensorRef::contiguous(&vs, v_shape),
        opts,
    )?;
    forward_core(&p, &Inputs { q, k, v })
}

/// Naive f64 attention, packed layout (same validation and errors as [`crate::flash_attn`] with [`crate::AttnOptions::varlen`]).
pub fn attention_varlen(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<Reference> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    run(&p, q, k, v)
}

fn run_backward(
    p: &Params,
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
) -> Result<ReferenceGrads> {
    let layout = params::q_like("dout", dout, p)?;
    let (q, k, v, dout) = (
        widen_all(q.data()),
        widen_all(k.data()),
        widen_all(v.data()),
        widen_all(dout.data()),
    );
    backward_core(
        p,
        &Inputs {
            q: &q,
            k: &k,
            v: &v,
        },
        &dout,
        &layout,
    )
}

/// Gradients of `Σ out ∘ dout` in f64, batched layout; recomputes the forward itself.
pub fn attention_backward(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
    opts: &AttnOptions,
) -> Result<ReferenceGrads> {
    let p = params::batched(q, k, v, opts)?;
    run_backward(&p, q, k, v, dout)
}

/// Gradients in f64, packed layout.
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen_backward(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    dout: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<ReferenceGrads> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)?;
    run_backward(&p, q, k, v, dout)
}

/// One output row of the batched layout, for spot checks on shapes too large for [`attention`]:
/// `(out row of head_dim values, lse)` of (batch `b`, head `h`, query row `i`).
#[allow(clippy::too_many_arguments)]
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
    let (q, k, v) = (
        widen_all(q.data()),
        widen_all(k.data()),
        widen_all(v.data()),
    );
    let hd = head(
        &p,
        &Inputs {
            q: &q,
            k: &k,
            v: &v,
        },
        b,
        h,
        i..i + 1,
    )?;
    let mut out = vec![0.0; p.head_dim];
    for (pj, vj) in hd.p_drop[0].iter().zip(&hd.v) {
        for (o, x) in out.iter_mut().zip(vj) {
            *o += pj * x;
        }
    }
    Ok((out, hd.lse[0]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::TensorRef;
    use crate::test_util::lcg;

    /// q, k, v and dout of shape (b, sq, sk, h, hk, d) from the LCG seeded with `seed`.
    fn lcg_inputs(
        (b, sq, sk, h, hk, d): (usize, usize, usize, usize, usize, usize),
        mut seed: u64,
    ) -> [Vec<f32>; 4] {
        [
            b * sq * h * d,
            b * sk * hk * d,
            b * sk * hk * d,
            b * sq * h * d,
        ]
        .map(|n| (0..n).map(|_| lcg(&mut seed)).collect())
    }

    /// The largest |central finite difference - gradient| over every element of q, k and v, for
    /// `loss(q, k, v)` and its gradients `grads`.
    fn worst_fd_error(
        [q, k, v]: [&[f64]; 3],
        grads: &ReferenceGrads,
        loss: impl Fn(&[f64], &[f64], &[f64]) -> f64,
    ) -> f64 {
        let eps = 1e-6;
        let mut worst = 0f64;
        for (which, (base, grad)) in [(q, &grads.dq), (k, &grads.dk), (v, &grads.dv)]
            .into_iter()
            .enumerate()
        {
            for idx in 0..base.len() {
                let (mut plus, mut minus) = (base.to_vec(), base.to_vec());
                plus[idx] += eps;
                minus[idx] -= eps;
                let (lp, lm) = match which {
                    0 => (loss(&plus, k, v), loss(&minus, k, v)),
                    1 => (loss(q, &plus, v), loss(q, &minus, v)),
                    _ => (loss(q, k, &plus), loss(q, k, &minus)),
                };
                worst = worst.max(((lp - lm) / (2.0 * eps) - grad[idx]).abs());
            }
        }
        worst
    }

    /// The reference backward agrees with central finite differences of the reference forward,
    /// with every option on (GQA, window, softcap, ALiBi, dropout, seqlen_q != seqlen_k).
    #[test]
    fn backward_matches_finite_differences() {
        let (b, sq, sk, h, hk, d) = (2usize, 5usize, 7usize, 4usize, 2usize, 3usize);
        let [q, k, v, dout] = lcg_inputs((b, sq, sk, h, hk, d), 7);
        let slopes = [0.3f32, 0.1, 0.7, 0.2];
        for (causal, window, softcap, alibi, dropout) in [
            (false, (-1, -1), None, false, 0.0),
            (true, (-1, -1), Some(1.5f32), true, 0.0),
            (false, (3, 1), Some(2.0), false, 0.3),
            (true, (2, -1), None, true, 0.5),
        ] {
            let mut opts = AttnOptions::default()
                .causal(causal)
                .window(window.0, window.1)
                .dropout(dropout, 11);
            opts.softcap = softcap;
            if alibi {
                opts.alibi_slopes = Some(TensorRef::contiguous(&slopes, &[h]));
            }
            let qt = TensorRef::contiguous(&q, &[b, sq, h, d]);
            let kt = TensorRef::contiguous(&k, &[b, sk, hk, d]);
            let vt = TensorRef::contiguous(&v, &[b, sk, hk, d]);
            let p = params::batched(&qt, &kt, &vt, &opts).unwrap();
            let dt = TensorRef::contiguous(&dout, &[b, sq, h, d]);
            let layout = params::q_like("dout", &dt, &p).unwrap();
            let [q64, k64, v64, do64] = [&qt, &kt, &vt, &dt].map(|t| widen_all(t.data()));
            let grads = backward_core(
                &p,
                &Inputs {
                    q: &q64,
                    k: &k64,
                    v: &v64,
                },
                &do64,
                &layout,
            )
            .unwrap();
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                let r = forward_core(&p, &Inputs { q, k, v }).unwrap();
                r.out.iter().zip(&do64).map(|(a, b)| a * b).sum()
            };
            let worst = worst_fd_error([&q64, &k64, &v64], &grads, loss);
            assert!(worst < 1e-7, "causal={causal} window={window:?} softcap={softcap:?} alibi={alibi} dropout={dropout}: worst |fd - grad| = {worst:e}");
        }
    }

    /// With learnable sinks: the forward against a direct softmax over the keys and the sink,
    /// and the gradients of q, k, v and the sinks against central finite differences (with GQA, a
    /// causal mask that leaves rows with no key, softcap, ALiBi and dropout).
    #[test]
    fn sink_forward_and_backward_match_finite_differences() {
        let (b, sq, sk, h, hk, d) = (2usize, 6usize, 4usize, 4usize, 2usize, 3usize);
        let [q, k, v, dout] = lcg_inputs((b, sq, sk, h, hk, d), 19);
        let sinks = [0.4f32, -1.3, 2.5, 0.0];
        let slopes = [0.3f32, 0.1, 0.7, 0.2];
        let qt = TensorRef::contiguous(&q, &[b, sq, h, d]);
        let kt = TensorRef::contiguous(&k, &[b, sk, hk, d]);
        let vt = TensorRef::contiguous(&v, &[b, sk, hk, d]);
        let dt = TensorRef::contiguous(&dout, &[b, sq, h, d]);
        for (window, softcap, alibi, dropout) in [
            ((-1, -1), None, false, 0.0),
            ((1, 0), Some(1.5f32), true, 0.0),
            ((-1, 0), None, false, 0.3),
        ] {
            let mut opts = AttnOptions::default()
                .window(window.0, window.1)
                .dropout(dropout, 5)
                .learnable_sink(TensorRef::contiguous(&sinks, &[h]));
            opts.softcap = softcap;
            if alibi {
                opts.alibi_slopes = Some(TensorRef::contiguous(&slopes, &[h]));
            }
            let p = params::batched(&qt, &kt, &vt, &opts).unwrap();
            let layout = params::q_like("dout", &dt, &p).unwrap();
            let [q64, k64, v64, do64] = [&qt, &kt, &vt, &dt].map(|t| widen_all(t.data()));
            let inputs = Inputs {
                q: &q64,
                k: &k64,
                v: &v64,
            };
            // Forward, no dropout: out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink}) over the
            // visible keys; lse = log of that denominator (the sink alone for a row with none).
            if dropout == 0.0 {
                let r = forward_core(&p, &inputs).unwrap();
                let plain = params::batched(
                    &qt,
                    &kt,
                    &vt,
                    &AttnOptions {
                        learnable_sink: None,
                        ..opts.clone()
                    },
                )
                .unwrap();
                let r0 = forward_core(&plain, &inputs).unwrap();
                for bb in 0..b {
                    for (hh, &sink) in sinks.iter().enumerate() {
                        for i in 0..sq {
                            let l0 = r0.lse[p.lse_offset(bb, hh, i)];
                            let l = r.lse[p.lse_offset(bb, hh, i)];
                            let s = sink as f64;
                            let want = if l0 == f64::NEG_INFINITY {
                                s
                            } else {
                                (l0.exp() + s.exp()).ln()
                            };
                            assert!((l - want).abs() < 1e-12, "lse {l} vs {want}");
                            let o = p.out_offset(bb, i, hh);
                            for c in 0..d {
                                let w0 = r0.out[o + c] * (l0 - want).exp();
                                assert!((r.out[o + c] - w0).abs() < 1e-12);
                            }
                        }
                    }
                }
            }
            let grads = backward_core(&p, &inputs, &do64, &layout).unwrap();
            let loss = |q: &[f64], k: &[f64], v: &[f64], sinks: &[f32]| -> f64 {
                let mut p = p.clone();
                p.sink = Some(sinks.to_vec());
                let r = forward_core(&p, &Inputs { q, k, v }).unwrap();
                r.out.iter().zip(&do64).map(|(a, b)| a * b).sum()
            };
            let worst = worst_fd_error([&q64, &k64, &v64], &grads, |q, k, v| loss(q, k, v, &sinks));
            // The sinks are f32 in the options: step them by a power of two, exact in f32.
            let dsink = grads.dsink.as_ref().expect("sinks give a sink gradient");
            let step = 1.0 / 1024.0;
            for hh in 0..h {
                let (mut plus, mut minus) = (sinks, sinks);
                plus[hh] += step;
                minus[hh] -= step;
                let fd = (loss(&q64, &k64, &v64, &plus) - loss(&q64, &k64, &v64, &minus))
                    / (2.0 * step as f64);
                // Central differences err by ~step² · (third derivative).
                assert!(
                    (fd - dsink[hh]).abs() < 1e-6,
                    "dsink[{hh}]: fd {fd} vs {}, window {window:?}",
                    dsink[hh]
                );
                assert!(dsink[hh] != 0.0, "a sink gradient of 0 tests nothing");
            }
            assert!(
                worst < 1e-7,
                "window={window:?}: worst |fd - grad| = {worst:e}"
            );
        }
    }
}

//! The FlashAttention backward on the CPU, with recomputation: only q, k, v, out, dout and the
//! forward's LSE are read; each tile of P = exp(S·scale - lse) is recomputed from Q and K.
//!
//! Two passes, no atomics, bit-for-bit deterministic for any thread count:
//! 1. dK/dV pass, one work item per (sequence, kv head, key block): for every query head of the
//!    kv head's group and every query block that sees the key block (in a fixed order), recompute
//!    P and dS and accumulate `dV += P̃ᵀ·dO`, `dK += dSᵀ·Q·scale` in the item's own tile.
//! 2. dQ pass, one work item per (sequence, head, query block): recompute dS over its key blocks
//!    and accumulate `dQ += dS·K·scale`.
//!
//! Pass 1 and 2 each recompute S and dP (7 block products instead of 5); the alternative, one pass
//! that scatters dQ, needs atomics or a buffer per key block that grows with seqlen_q·seqlen_k.
//! With `delta = rowsum(dO ∘ O)`: `dS = P ∘ (dP - delta)`, dropout folded into dP and P̃, softcap's
//! derivative `1 - tanh²` applied to dS.

use super::forward::{load_tile, ScoreMod, WorkItem};
use super::kernels::{ptx, pv, qk};
use super::softmax::exp2;
use super::{block_sizes, BlockSizes, Disjoint};
use crate::blocks::Mask;
use crate::params::{GradInputs, Params, LOG2_E};
use crate::tensor::Element;
use rayon::prelude::*;

/// Per-thread tiles of the backward pass.
struct Scratch {
    q: Vec<f32>,
    d_o: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Scores, then probabilities P̃ (after dropout).
    p: Vec<f32>,
    /// dP, then dS.
    ds: Vec<f32>,
    /// Softcap's derivative `1 - tanh²` per element.
    dtanh: Vec<f32>,
    lse_log2: Vec<f32>,
    delta: Vec<f32>,
    keep: Vec<bool>,
    /// dK and dV (pass 1) or dQ (pass 2) accumulators.
    acc_a: Vec<f32>,
    acc_b: Vec<f32>,
}

impl Scratch {
    fn new(bs: BlockSizes, d: usize) -> Self {
        let (bm, bn) = (bs.block_m, bs.block_n);
        let big = bm.max(bn) * d;
        Scratch {
            q: vec![0.0; bm * d],
            d_o: vec![0.0; bm * d],
            k: vec![0.0; bn * d],
            v: vec![0.0; bn * d],
            p: vec![0.0; bm * bn],
            ds: vec![0.0; bm * bn],
            dtanh: vec![0.0; bm * bn],
            lse_log2: vec![0.0; bm],
            delta: vec![0.0; bm],
            keep: vec![true; bn],
            acc_a: vec![0.0; big],
            acc_b: vec![0.0; big],
        }
    }
}

/// Everything both passes read.
struct Ctx<'a, T> {
    p: &'a Params,
    g: &'a GradInputs,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    dout: &'a [T],
    /// rowsum(dO ∘ O) per row, in `lse` layout.
    delta: &'a [f32],
    bs: BlockSizes,
}

/// Gradients `(dq, dk, dv)`: dq in q's contiguous layout, dk/dv in k's.
pub(crate) fn backward<T: Element>(
    p: &Params,
    g: &GradInputs,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    dout: &[T],
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let bs = block_sizes(p.head_dim);
    let delta = compute_delta(p, g, out, dout);
    let cx = Ctx {
        p,
        g,
        q,
        k,
        v,
        dout,
        delta: &delta,
        bs,
    };
    let d = p.head_dim;
    let poison = T::from_f32(f32::NAN);
    let (mut dq, mut dk, mut dv) = (
        vec![poison; p.out_len()],
        vec![poison; p.dk_len()],
        vec![poison; p.dk_len()],
    );
    // Rows of no sequence (packed inputs with spare tokens) get zero gradients.
    let q_used = p.seqs.last().map_or(0, |s| s.out_row0 + s.seqlen_q);
    let k_used = p.seqs.last().map_or(0, |s| s.k_row0 + s.seqlen_k);
    dq[q_used * p.heads * d..].fill(T::default());
    dk[k_used * p.heads_kv * d..].fill(T::default());
    dv[k_used * p.heads_kv * d..].fill(T::default());

    let (dk_w, dv_w) = (Disjoint::new(&mut dk), Disjoint::new(&mut dv));
    let kv_items: Vec<WorkItem> = p
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(b, s)| {
            (0..p.heads_kv).flat_map(move |h| {
                (0..s.seqlen_k.div_ceil(bs.block_n)).map(move |m_block| WorkItem { b, h, m_block })
            })
        })
        .collect();
    kv_items.par_iter().for_each_init(
        || (Scratch::new(bs, d), vec![T::default(); d]),
        |(scr, row_buf), item| dkdv_block(&cx, *item, scr, row_buf, &dk_w, &dv_w),
    );

    let dq_w = Disjoint::new(&mut dq);
    super::forward::work_items(p, bs.block_m)
        .par_iter()
        .for_each_init(
            || (Scratch::new(bs, d), vec![T::default(); d]),
            |(scr, row_buf), item| dq_block(&cx, *item, scr, row_buf, &dq_w),
        );
    (dq, dk, dv)
}

/// `delta[b, h, i] = dO_i · O_i`, in `lse` layout.
fn compute_delta<T: Element>(p: &Params, g: &GradInputs, out: &[T], dout: &[T]) -> Vec<f32> {
    let d = p.head_dim;
    let jobs: Vec<(usize, usize)> = (0..p.seqs.len())
        .flat_map(|b| (0..p.heads).map(move |h| (b, h)))
        .collect();
    let rows: Vec<Vec<f32>> = jobs
        .par_iter()
        .map(|&(b, h)| {
            let (mut o, mut d_o) = (vec![0f32; d], vec![0f32; d]);
            (0..p.seqs[b].seqlen_q)
                .map(|i| {
                    let (oa, da) = (g.out.offset(b, i, h), g.dout.offset(b, i, h));
                    T::widen(&out[oa..oa + d], &mut o);
                    T::widen(&dout[da..da + d], &mut d_o);
                    super::kernels::dot(&o, &d_o)
                })
                .collect()
        })
        .collect();
    let mut delta = vec![0f32; p.lse_len()];
    for (&(b, h), r) in jobs.iter().zip(rows) {
        let at = p.lse_offset(b, h, 0);
        delta[at..at + r.len()].copy_from_slice(&r);
    }
    delta
}

impl<T: Element> Ctx<'_, T> {
    /// Loads q, dO, lse and delta of rows `m0..m0 + rows` of (sequence b, head h).
    fn load_query_side(&self, b: usize, h: usize, m0: usize, rows: usize, scr: &mut Scratch) {
        let (p, s, d) = (self.p, self.p.seqs[b], self.p.head_dim);
        load_tile(
            self.q,
            s.q_base + m0 * p.q.row_stride + h * p.q.head_stride,
            p.q.row_stride,
            rows,
            d,
            &mut scr.q,
        );
        let dl = self.g.dout.layout;
        load_tile(
            self.dout,
            self.g.dout.offset(b, m0, h),
            dl.row_stride,
            rows,
            d,
            &mut scr.d_o,
        );
        for r in 0..rows {
            let at = p.lse_offset(b, h, m0 + r);
            let lse = self.g.lse[at];
            // A fully masked row (lse = -inf) has P = 0: +inf makes every exp2 below 0.
            scr.lse_log2[r] = if lse == f32::NEG_INFINITY {
                f32::INFINITY
            } else {
                lse * LOG2_E
            };
            scr.delta[r] = self.delta[at];
        }
    }

    /// Loads k and v of keys `n0..n0 + cols` of (sequence b, kv head hk).
    fn load_key_side(&self, b: usize, hk: usize, n0: usize, cols: usize, scr: &mut Scratch) {
        let (p, s, d) = (self.p, self.p.seqs[b], self.p.head_dim);
        load_tile(
            self.k,
            s.k_base + n0 * p.k.row_stride + hk * p.k.head_stride,
            p.k.row_stride,
            cols,
            d,
            &mut scr.k,
        );
        load_tile(
            self.v,
            s.v_base + n0 * p.v.row_stride + hk * p.v.head_stride,
            p.v.row_stride,
            cols,
            d,
            &mut scr.v,
        );
    }

    /// With q-side rows `m0..m1` and key-side `n0..n1` loaded: P̃ into `scr.p` and
    /// dS·softmax_scale into `scr.ds` (both `rows x cols`).
    #[allow(clippy::too_many_arguments)]
    fn recompute(
        &self,
        b: usize,
        h: usize,
        m0: usize,
        m1: usize,
        n0: usize,
        n1: usize,
        scr: &mut Scratch,
    ) {
        let (p, d) = (self.p, self.p.head_dim);
        let s = p.seqs[b];
        let (rows, cols) = (m1 - m0, n1 - n0);
        let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
        let sp = &mut scr.p[..rows * cols];
        qk(&scr.q, &scr.k, sp, rows, cols, d);
        let dtanh = p.softcap.map(|_| &mut scr.dtanh[..rows * cols]);
        let masked = mask.needs_mask(m0, m1, n0, n1);
        ScoreMod::new(p, b, h).apply(sp, cols, m0, n0, &mask, masked, dtanh);
        for (row, &l) in sp.chunks_exact_mut(cols).zip(&scr.lse_log2[..rows]) {
            row.iter_mut().for_each(|x| *x = exp2(*x - l));
        }
        // dP̃ = dO·Vᵀ.
        let ds = &mut scr.ds[..rows * cols];
        qk(&scr.d_o, &scr.v, ds, rows, cols, d);
        // One pass per row, with the dropout mask generated once: dropped entries get P̃ = 0 and
        // dP = 0, kept ones are scaled by 1/(1-p); then dS = P ∘ (dP - delta) · scale (· 1 - tanh²).
        let drop_scale = p.dropout.map_or(1.0, |dr| dr.scale());
        let scale = p.softmax_scale;
        for r in 0..rows {
            if let Some(drop) = p.dropout {
                drop.keep_row(b, h, m0 + r, n0, &mut scr.keep[..cols]);
            }
            let delta = scr.delta[r];
            for c in 0..cols {
                let at = r * cols + c;
                let kept = p.dropout.is_none() || scr.keep[c];
                let prob = sp[at];
                let dp = if kept { ds[at] } else { 0.0 };
                let mut g = prob * (dp * drop_scale - delta) * scale;
                if p.softcap.is_some() {
                    g *= scr.dtanh[at];
                }
                ds[at] = g;
                sp[at] = if kept { prob * drop_scale } else { 0.0 };
            }
        }
    }
}

/// Pass 1 item: dK and dV of keys `n_block` (stored in `item.m_block`) of kv head `item.h`.
fn dkdv_block<T: Element>(
    cx: &Ctx<T>,
    item: WorkItem,
    scr: &mut Scratch,
    row_buf: &mut [T],
    dk: &Disjoint<T>,
    dv: &Disjoint<T>,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    let (b, hk, n_block) = (item.b, item.h, item.m_block);
    let s = p.seqs[b];
    let n0 = n_block * bs.block_n;
    let n1 = (n0 + bs.block_n).min(s.seqlen_k);
    let cols = n1 - n0;
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    cx.load_key_side(b, hk, n0, cols, scr);
    scr.acc_a[..cols * d].fill(0.0);
    scr.acc_b[..cols * d].fill(0.0);
    let group = p.heads / p.heads_kv;
    for h in hk * group..(hk + 1) * group {
        for m_block in 0..s.seqlen_q.div_ceil(bs.block_m) {
            let m0 = m_block * bs.block_m;
            let m1 = (m0 + bs.block_m).min(s.seqlen_q);
            let (nb0, nb1) = mask.n_block_range(m0, m1, bs.block_n);
            if !(nb0..nb1).contains(&n_block) {
                continue;
            }
            let rows = m1 - m0;
            cx.load_query_side(b, h, m0, rows, scr);
            cx.recompute(b, h, m0, m1, n0, n1, scr);
            ptx(
                &scr.p[..rows * cols],
                &scr.d_o,
                &mut scr.acc_b[..cols * d],
                rows,
                cols,
                d,
            );
            ptx(
                &scr.ds[..rows * cols],
                &scr.q,
                &mut scr.acc_a[..cols * d],
                rows,
                cols,
                d,
            );
        }
    }
    for c in 0..cols {
        let at = p.dk_offset(b, n0 + c, hk);
        // SAFETY: keys n0..n1 of kv head hk of sequence b belong to this work item alone.
        unsafe {
            T::narrow(&scr.acc_a[c * d..(c + 1) * d], row_buf);
            dk.range(at, d).copy_from_slice(row_buf);
            T::narrow(&scr.acc_b[c * d..(c + 1) * d], row_buf);
            dv.range(at, d).copy_from_slice(row_buf);
        }
    }
}

/// Pass 2 item: dQ of rows `m_block` of head `h`.
fn dq_block<T: Element>(
    cx: &Ctx<T>,
    item: WorkItem,
    scr: &mut Scratch,
    row_buf: &mut [T],
    dq: &Disjoint<T>,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    let WorkItem { b, h, m_block } = item;
    let s = p.seqs[b];
    let m0 = m_block * bs.block_m;
    let m1 = (m0 + bs.block_m).min(s.seqlen_q);
    let rows = m1 - m0;
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    cx.load_query_side(b, h, m0, rows, scr);
    scr.acc_a[..rows * d].fill(0.0);
    let (nb0, nb1) = mask.n_block_range(m0, m1, bs.block_n);
    for n_block in nb0..nb1 {
        let n0 = n_block * bs.block_n;
        let n1 = (n0 + bs.block_n).min(s.seqlen_k);
        cx.load_key_side(b, p.kv_head(h), n0, n1 - n0, scr);
        cx.recompute(b, h, m0, m1, n0, n1, scr);
        pv(
            &scr.ds[..rows * (n1 - n0)],
            &scr.k,
            &mut scr.acc_a[..rows * d],
            rows,
            n1 - n0,
            d,
        );
    }
    for r in 0..rows {
        T::narrow(&scr.acc_a[r * d..(r + 1) * d], row_buf);
        // SAFETY: rows m0..m1 of head h of sequence b belong to this work item alone.
        unsafe {
            dq.range(p.out_offset(b, m0 + r, h), d)
                .copy_from_slice(row_buf)
        };
    }
}

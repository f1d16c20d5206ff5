//! The FlashAttention forward on the CPU.
//!
//! For each work item (sequence b, head h, query block m_block): load the q tile once, then stream
//! the key blocks that [`Mask::n_block_range`] says it sees: S = Q·Kᵀ, score modifiers (scale,
//! softcap, ALiBi) and the mask (only on blocks the mask cuts), online softmax, acc_o += P·V. Divide
//! by row_sum once at the end and store the LSE. Scratch is O(block · head_dim) per thread; nothing
//! grows with seqlen_q · seqlen_k.

use super::kernels::{pv, qk};
use super::softmax::{finalize, max_get_scale, online_softmax, rescale_o, RowStats};
use super::{block_sizes, BlockSizes, Disjoint};
use crate::blocks::Mask;
use crate::dropout::Dropout;
use crate::params::{Params, LOG2_E};
use crate::tensor::Element;
use rayon::prelude::*;

/// Per-thread tiles, allocated once per worker, never inside the block loops.
pub(crate) struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    acc_o: Vec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    alpha: Vec<f32>,
    keep: Vec<bool>,
}

impl Scratch {
    pub fn new(bs: BlockSizes, d: usize) -> Self {
        let (bm, bn) = (bs.block_m, bs.block_n);
        Scratch {
            q: vec![0.0; bm * d],
            k: vec![0.0; bn * d],
            v: vec![0.0; bn * d],
            s: vec![0.0; bm * bn],
            acc_o: vec![0.0; bm * d],
            row_max: vec![0.0; bm],
            row_sum: vec![0.0; bm],
            alpha: vec![0.0; bm],
            keep: vec![true; bn],
        }
    }
}

/// Scale, softcap and ALiBi, folded for the log2 domain.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScoreMod {
    /// softmax_scale · log2(e): without softcap, one multiply takes a raw dot product to the log2 domain.
    scale_log2: f32,
    /// (softmax_scale / softcap, softcap · log2(e)).
    softcap: Option<(f32, f32)>,
    /// slope · log2(e).
    alibi_log2: Option<f32>,
}

impl ScoreMod {
    pub fn new(p: &Params, b: usize, h: usize) -> Self {
        ScoreMod {
            scale_log2: p.softmax_scale * LOG2_E,
            softcap: p.softcap.map(|c| (p.softmax_scale / c, c * LOG2_E)),
            alibi_log2: p.alibi_slope(b, h).map(|s| s * LOG2_E),
        }
    }

    /// Raw dot products of rows `m0..` x keys `n0..n0 + cols` -> log2-domain scores, masked to
    /// -inf where `masked` says the mask cuts this block. With softcap, `dtanh` (if given, same
    /// length as `s`) receives the derivative `1 - tanh²` that the backward pass needs, from the
    /// same `tanh` (computed once per element).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        s: &mut [f32],
        cols: usize,
        m0: usize,
        n0: usize,
        mask: &Mask,
        masked: bool,
        mut dtanh: Option<&mut [f32]>,
    ) {
        for (r, row) in s.chunks_exact_mut(cols).enumerate() {
            let i = m0 + r;
            match (self.softcap, dtanh.as_deref_mut()) {
                (None, _) => row.iter_mut().for_each(|x| *x *= self.scale_log2),
                (Some((pre, post)), None) => {
                    row.iter_mut().for_each(|x| *x = post * (*x * pre).tanh())
                }
                (Some((pre, post)), Some(dt)) => {
                    for (x, t) in row.iter_mut().zip(&mut dt[r * cols..(r + 1) * cols]) {
                        let th = (*x * pre).tanh();
                        *t = 1.0 - th * th;
                        *x = post * th;
                    }
                }
            }
            if let Some(slope) = self.alibi_log2 {
                for (c, x) in row.iter_mut().enumerate() {
                    *x -= slope * mask.diagonal_distance(i, n0 + c).unsigned_abs() as f32;
                }
            }
            if masked {
                let (lo, hi) = mask.key_range(i);
                for (c, x) in row.iter_mut().enumerate() {
                    if !(lo..hi).contains(&(n0 + c)) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Copies `rows` head rows starting at element `base` (stride `row_stride`) into a packed f32 tile.
#[inline]
pub(crate) fn load_tile<T: Element>(
    src: &[T],
    base: usize,
    row_stride: usize,
    rows: usize,
    d: usize,
    dst: &mut [f32],
) {
    for r in 0..rows {
        let at = base + r * row_stride;
        T::widen(&src[at..at + d], &mut dst[r * d..(r + 1) * d]);
    }
}

/// Zeroes the dropped probabilities of the tile of rows `m0..`, keys `n0..n0 + cols` (the 1/(1-p)
/// factor is applied once, at the end).
#[allow(clippy::too_many_arguments)]
fn apply_dropout(
    drop: Dropout,
    b: usize,
    h: usize,
    m0: usize,
    n0: usize,
    s: &mut [f32],
    cols: usize,
    keep: &mut [bool],
) {
    for (r, row) in s.chunks_exact_mut(cols).enumerate() {
        drop.keep_row(b, h, m0 + r, n0, &mut keep[..cols]);
        for (x, &kept) in row.iter_mut().zip(keep.iter()) {
            if !kept {
                *x = 0.0;
            }
        }
    }
}

/// One (sequence, head, query block) work item.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkItem {
    pub b: usize,
    pub h: usize,
    pub m_block: usize,
}

/// All work items, in (sequence, head, query block) order.
pub(crate) fn work_items(p: &Params, block_m: usize) -> Vec<WorkItem> {
    let mut items = Vec::new();
    for (b, s) in p.seqs.iter().enumerate() {
        for h in 0..p.heads {
            items.extend((0..s.seqlen_q.div_ceil(block_m)).map(|m_block| WorkItem {
                b,
                h,
                m_block,
            }));
        }
    }
    items
}

/// Forward attention. Returns `out` (q's dtype, `p.out_shape`) and `lse` (`p.lse_shape`).
pub(crate) fn forward<T: Element>(p: &Params, q: &[T], k: &[T], v: &[T]) -> (Vec<T>, Vec<f32>) {
    let bs = block_sizes(p.head_dim);
    // Poisoned: every element is written below (rows of no sequence explicitly), and tests check.
    let mut out = vec![T::from_f32(f32::NAN); p.out_len()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    clear_unused_rows(p, &mut out, &mut lse);
    let (out_w, lse_w) = (Disjoint::new(&mut out), Disjoint::new(&mut lse));
    work_items(p, bs.block_m).par_iter().for_each_init(
        || (Scratch::new(bs, p.head_dim), vec![T::default(); p.head_dim]),
        |(scratch, row_buf), item| {
            forward_block(p, q, k, v, *item, bs, scratch, row_buf, &out_w, &lse_w)
        },
    );
    (out, lse)
}

/// Packed inputs may have tokens after the last sequence; their rows are 0 with LSE -inf.
fn clear_unused_rows<T: Element>(p: &Params, out: &mut [T], lse: &mut [f32]) {
    let used = p.seqs.last().map_or(0, |s| s.out_row0 + s.seqlen_q);
    if !p.packed || used == p.total_q {
        return; // batched layout: every row belongs to a sequence
    }
    out[used * p.heads * p.head_dim..].fill(T::default());
    for h in 0..p.heads {
        lse[h * p.total_q + used..(h + 1) * p.total_q].fill(f32::NEG_INFINITY);
    }
}

#[allow(clippy::too_many_arguments)]
fn forward_block<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
    item: WorkItem,
    bs: BlockSizes,
    scr: &mut Scratch,
    row_buf: &mut [T],
    out: &Disjoint<T>,
    lse: &Disjoint<f32>,
) {
    let WorkItem { b, h, m_block } = item;
    let seq = p.seqs[b];
    let d = p.head_dim;
    let hk = p.kv_head(h);
    let m0 = m_block * bs.block_m;
    let m1 = (m0 + bs.block_m).min(seq.seqlen_q);
    let rows = m1 - m0;
    let mask = Mask::new(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    let score_mod = ScoreMod::new(p, b, h);

    let q_base = seq.q_base + m0 * p.q.row_stride + h * p.q.head_stride;
    load_tile(q, q_base, p.q.row_stride, rows, d, &mut scr.q);
    scr.acc_o[..rows * d].fill(0.0);
    scr.row_max[..rows].fill(f32::NEG_INFINITY);
    scr.row_sum[..rows].fill(0.0);

    let (n_min, n_max) = mask.n_block_range(m0, m1, bs.block_n);
    for n_block in n_min..n_max {
        let n0 = n_block * bs.block_n;
        let n1 = (n0 + bs.block_n).min(seq.seqlen_k);
        let cols = n1 - n0;
        load_tile(
            k,
            seq.k_base + n0 * p.k.row_stride + hk * p.k.head_stride,
            p.k.row_stride,
            cols,
            d,
            &mut scr.k,
        );
        load_tile(
            v,
            seq.v_base + n0 * p.v.row_stride + hk * p.v.head_stride,
            p.v.row_stride,
            cols,
            d,
            &mut scr.v,
        );
        let s = &mut scr.s[..rows * cols];
        qk(&scr.q, &scr.k, s, rows, cols, d);
        score_mod.apply(
            s,
            cols,
            m0,
            n0,
            &mask,
            mask.needs_mask(m0, m1, n0, n1),
            None,
        );
        max_get_scale(s, cols, &mut scr.row_max[..rows], &mut scr.alpha[..rows]);
        let mut stats = RowStats {
            row_max: &mut scr.row_max[..rows],
            row_sum: &mut scr.row_sum[..rows],
        };
        online_softmax(s, cols, &mut stats, &scr.alpha[..rows]);
        rescale_o(&mut scr.acc_o[..rows * d], d, &scr.alpha[..rows]);
        if let Some(drop) = p.dropout {
            // row_sum keeps the undropped probabilities (the softmax normaliser); only P·V sees the mask.
            apply_dropout(drop, b, h, m0, n0, s, cols, &mut scr.keep);
        }
        pv(s, &scr.v, &mut scr.acc_o[..rows * d], rows, cols, d);
    }

    let out_scale = p.dropout.map_or(1.0, |drop| drop.scale());
    for r in 0..rows {
        let acc = &mut scr.acc_o[r * d..(r + 1) * d];
        let row_lse = finalize(acc, scr.row_max[r], scr.row_sum[r], out_scale);
        T::narrow(acc, row_buf);
        // SAFETY: rows m0..m1 of head h of sequence b belong to this work item alone.
        unsafe {
            out.range(p.out_offset(b, m0 + r, h), d)
                .copy_from_slice(row_buf);
            *lse.range(p.lse_offset(b, h, m0 + r), 1)
                .first_mut()
                .expect("len 1") = row_lse;
        }
    }
}

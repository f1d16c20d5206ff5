//! The q and dO tiles of every query block, built once per call.

use crate::cpu::forward::{load_tile, WorkItem};
use crate::cpu::simd::{pad_lanes, Kernels};
use crate::cpu::{reuse, BlockSizes, Buf};
use crate::error::Result;
use crate::params::{GradInputs, Params};
use crate::tensor::Element;
use half::bf16;
use rayon::prelude::*;

/// A query block's q and dO: f32 transposed (`[d][np]`, for S and dP) then row-major (`[rows][dp]`,
/// for dK and dV), or bf16 pairs `[d2][np]` followed by q and dO as pairs of rows (`[rows / 2][dp]`).
#[derive(Clone, Copy)]
pub(super) enum QTiles<'a> {
    F32([&'a [f32]; 4]),
    Bf16([&'a [u32]; 4]),
}

/// q and dO of every (sequence, head, query block) transposed to `[d][np]` (query rows in lanes,
/// padded lanes 0) and row-major `[rows][dp]`, built once per call: the dK/dV pass reads each
/// tile once per key block that sees it; transposing there (scalar strided stores) cost ~25% of
/// it, and copying the row-major tiles from q's strided rows ~9% (f32, d = 128, N = 2048, 16
/// heads, 2026-11-24). Memory: four times q in f32. On the bf16 path, as bf16 pairs `[d2][np]`
/// instead (the B operands of S and dP), and q and dO as pairs of rows `[rows / 2][dp]` (the B
/// operands of dK and dV; loading and packing them per key block took ~10% of the bf16 backward).
pub(super) struct QueryTiles {
    data: Buf<f32>,
    pairs: Buf<u32>,
    /// Start of each tile pair (qt, then dot) in `data` or `pairs`, in `work_items` order.
    offsets: Vec<usize>,
    /// Index of the first work item of each sequence.
    seq_item0: Vec<usize>,
}

// Their buffers are kept for the next call (see `cpu::reuse`).
impl Drop for QueryTiles {
    fn drop(&mut self) {
        reuse::QUERY_TILES.put(std::mem::take(&mut self.data));
        reuse::QUERY_PAIRS.put(std::mem::take(&mut self.pairs));
    }
}

impl QueryTiles {
    pub(super) fn new<T: Element>(
        p: &Params,
        g: &GradInputs,
        (q, dout): (&[T], &[T]),
        bf16_qdo: Option<(&[bf16], &[bf16])>,
        bs: BlockSizes,
    ) -> Result<Self> {
        let bf16_pairs = bf16_qdo.is_some();
        let d = p.head_dim;
        let items = crate::cpu::forward::work_items(p, bs.block_m);
        let rows =
            |it: &WorkItem| (p.seqs[it.b].seqlen_q - it.m_block * bs.block_m).min(bs.block_m);
        let (d2, dp) = (d.div_ceil(2), pad_lanes(d));
        // Elements of one item's tiles.
        let size = |r: usize| {
            let np = pad_lanes(r);
            if bf16_pairs {
                2 * d2 * np + 2 * r.div_ceil(2) * dp
            } else {
                2 * d * np + 2 * r * dp
            }
        };
        let mut offsets = Vec::with_capacity(items.len() + 1);
        offsets.push(0);
        for it in &items {
            offsets.push(offsets.last().expect("non-empty") + size(rows(it)));
        }
        let mut seq_item0 = Vec::with_capacity(p.seqs.len());
        let mut n = 0;
        for s in &p.seqs {
            seq_item0.push(n);
            n += p.heads * s.seqlen_q.div_ceil(bs.block_m);
        }
        let total = *offsets.last().expect("non-empty");
        // Each item's tile pair: qᵀ then dOᵀ.
        let bases = |it: &WorkItem| {
            let (s, m0) = (p.seqs[it.b], it.m_block * bs.block_m);
            let q_base = s.q_base + m0 * p.q.row_stride + it.h * p.q.head_stride;
            let do_base = g.dout.offset(it.b, m0, it.h);
            (q_base, do_base, rows(it))
        };
        let (mut data, mut pairs) = (Buf::empty(), Buf::empty());
        if let Some((qb, dob)) = bf16_qdo {
            // Every element is written below (transpose_pairs and load_row_pairs fill the padding).
            pairs =
                reuse::QUERY_PAIRS.take_for_overwrite("the backward's query tiles", total, 0)?;
            in_token_order(split_at_offsets(&mut pairs, &offsets), &items)
                .into_par_iter()
                .for_each(|(chunk, it)| {
                    let (q_base, do_base, r) = bases(it);
                    let np = pad_lanes(r);
                    let (qt, rest) = chunk.split_at_mut(d2 * np);
                    let (dot, rest) = rest.split_at_mut(d2 * np);
                    let (q_rm, do_rm) = rest.split_at_mut(r.div_ceil(2) * dp);
                    let do_stride = g.dout.layout.row_stride;
                    transpose_pairs(qb, q_base, p.q.row_stride, (r, d, np), qt);
                    transpose_pairs(dob, do_base, do_stride, (r, d, np), dot);
                    load_row_pairs(qb, q_base, p.q.row_stride, (r, d, dp), q_rm);
                    load_row_pairs(dob, do_base, do_stride, (r, d, dp), do_rm);
                });
        } else {
            // Every element is written below (padded lanes and head-dim columns too).
            data =
                reuse::QUERY_TILES.take_for_overwrite("the backward's query tiles", total, 0.0)?;
            // q and dO are read once: into the row-major tile, which is then transposed while
            // it is in L1 (reading them again for the transposed tile, strided rows from memory,
            // took ~3% of the f32 backward's samples at N = 1024, d = 128).
            in_token_order(split_at_offsets(&mut data, &offsets), &items)
                .into_par_iter()
                .for_each(|(chunk, it)| {
                    let (q_base, do_base, r) = bases(it);
                    let np = pad_lanes(r);
                    let (qt, rest) = chunk.split_at_mut(d * np);
                    let (dot, rest) = rest.split_at_mut(d * np);
                    let (q_rm, do_rm) = rest.split_at_mut(r * dp);
                    let do_stride = g.dout.layout.row_stride;
                    load_tile(q, q_base, p.q.row_stride, (r, d, dp), q_rm);
                    load_tile(dout, do_base, do_stride, (r, d, dp), do_rm);
                    for (rm, t) in [(&mut *q_rm, &mut *qt), (&mut *do_rm, &mut *dot)] {
                        if dp > d {
                            rm.chunks_exact_mut(dp).for_each(|row| row[d..].fill(0.0));
                        }
                        transpose_rows(p.kernels, rm, (r, d, dp, np), t);
                    }
                });
        }
        Ok(QueryTiles {
            data,
            pairs,
            offsets,
            seq_item0,
        })
    }

    /// (qᵀ, dOᵀ) of (sequence b, head h, query block m_block).
    pub(super) fn get(
        &self,
        p: &Params,
        b: usize,
        h: usize,
        m_block: usize,
        block_m: usize,
    ) -> QTiles<'_> {
        let i = self.seq_item0[b] + h * p.seqs[b].seqlen_q.div_ceil(block_m) + m_block;
        let (lo, hi) = (self.offsets[i], self.offsets[i + 1]);
        let (d, d2, dp) = (p.head_dim, p.head_dim.div_ceil(2), pad_lanes(p.head_dim));
        let r = (p.seqs[b].seqlen_q - m_block * block_m).min(block_m);
        let np = pad_lanes(r);
        if self.pairs.is_empty() {
            let (qt, rest) = self.data[lo..hi].split_at(d * np);
            let (dot, rest) = rest.split_at(d * np);
            let (q_rm, do_rm) = rest.split_at(r * dp);
            QTiles::F32([qt, dot, q_rm, do_rm])
        } else {
            let (qt, rest) = self.pairs[lo..hi].split_at(d2 * np);
            let (dot, rest) = rest.split_at(d2 * np);
            let (q_rm, do_rm) = rest.split_at(r.div_ceil(2) * dp);
            QTiles::Bf16([qt, dot, q_rm, do_rm])
        }
    }
}

/// The transposed tile `t[x * np + r]` = `rm[r * dp + x]` of a row-major tile `rm` (`rows` rows
/// of `dp` lanes, the first `d` used); lanes `rows..np` are 0. In 8×8 blocks
/// ([`Kernels::transpose`]): element by element it took ~1.3% of the f32 backward's samples
/// (AVX2, d = 64, N = 1024).
fn transpose_rows(
    kern: &Kernels,
    rm: &[f32],
    (rows, d, dp, np): (usize, usize, usize, usize),
    t: &mut [f32],
) {
    kern.transpose(rm, dp, (rows, d), t, np);
    for x in 0..d {
        t[x * np + rows..(x + 1) * np].fill(0.0);
    }
}

/// `rows` bf16 head rows as transposed pairs along the head dimension: `t[xp * np + r]` =
/// `(row r [2xp], row r [2xp + 1])`, the high half 0 past `d`, lanes `rows..np` 0 (what the
/// forward's `load_pairs_t` writes). Eight rows are first packed as pairs (contiguous, a loop
/// LLVM vectorises), then stored in runs of eight lanes: element by element with a store per
/// row and pair, the q and dO tiles took ~6% of the bf16 backward's samples (d = 64, causal).
fn transpose_pairs(
    src: &[bf16],
    base: usize,
    row_stride: usize,
    (rows, d, np): (usize, usize, usize),
    t: &mut [u32],
) {
    const R: usize = 8;
    let d2 = d.div_ceil(2);
    let mut block = vec![0u32; R * d2];
    for r0 in (0..rows).step_by(R) {
        let n = R.min(rows - r0);
        for (i, out) in block.chunks_exact_mut(d2).take(n).enumerate() {
            let row = &src[base + (r0 + i) * row_stride..][..d];
            for (o, pair) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = pair[0].to_bits() as u32 | (pair[1].to_bits() as u32) << 16;
            }
            if d % 2 == 1 {
                out[d2 - 1] = row[d - 1].to_bits() as u32;
            }
        }
        for xp in 0..d2 {
            let lanes = &mut t[xp * np + r0..][..n];
            for (i, lane) in lanes.iter_mut().enumerate() {
                *lane = block[i * d2 + xp];
            }
        }
    }
    for xp in 0..d2 {
        t[xp * np + rows..(xp + 1) * np].fill(0);
    }
}

/// `rows` bf16 head rows as pairs of rows: `dst[rp * dp + x]` = `(row 2rp [x], row 2rp + 1 [x])`,
/// the high half 0 past the last row, `x` in `d..dp` 0.
fn load_row_pairs(
    src: &[bf16],
    base: usize,
    row_stride: usize,
    (rows, d, dp): (usize, usize, usize),
    dst: &mut [u32],
) {
    let row = |r: usize| &src[base + r * row_stride..][..d];
    for (rp, out) in dst.chunks_exact_mut(dp).take(rows.div_ceil(2)).enumerate() {
        let lo = row(2 * rp);
        if 2 * rp + 1 < rows {
            let hi = row(2 * rp + 1);
            for ((o, l), h) in out.iter_mut().zip(lo).zip(hi) {
                *o = l.to_bits() as u32 | (h.to_bits() as u32) << 16;
            }
        } else {
            for (o, l) in out.iter_mut().zip(lo) {
                *o = l.to_bits() as u32;
            }
        }
        out[d..].fill(0);
    }
}

/// Each item's chunk beside it, in the order (sequence, query block, head): the heads of a token
/// are contiguous and its rows heads·d apart, so a worker that goes through one query block's
/// heads in turn finds the lines of the next head's rows in the cache (head by head, each tile
/// read a row or two per page; with `transpose_pairs`, the bf16 tiles went from ~10% to ~5% of
/// the backward's samples at d = 64, causal).
fn in_token_order<'a, X>(
    chunks: Vec<&'a mut [X]>,
    items: &'a [WorkItem],
) -> Vec<(&'a mut [X], &'a WorkItem)> {
    let mut pairs: Vec<_> = chunks.into_iter().zip(items).collect();
    pairs.sort_by_key(|(_, it)| (it.b, it.m_block, it.h));
    pairs
}

/// `buf` cut at `offsets` (ascending, from 0 to `buf.len()`), one chunk per window.
pub(super) fn split_at_offsets<'a, X>(buf: &'a mut [X], offsets: &[usize]) -> Vec<&'a mut [X]> {
    let mut chunks = Vec::with_capacity(offsets.len().saturating_sub(1));
    let mut rest = buf;
    for w in offsets.windows(2) {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(w[1] - w[0]);
        chunks.push(head);
        rest = tail;
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::forward::load_pairs_t;

    /// The transposed pairs are the forward's `load_pairs_t` tile, lanes and padding included
    /// (row counts around the 8-row groups, odd and even head dims, rows wider than d).
    #[test]
    fn transpose_pairs_matches_load_pairs_t() {
        let mut x = 99u32;
        let src: Vec<bf16> = (0..64 * 300)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                bf16::from_bits((x >> 16) as u16)
            })
            .collect();
        for rows in [1, 7, 8, 9, 13, 64] {
            for d in [1usize, 2, 7, 40, 59, 64, 111, 128] {
                let (np, stride, base) = (pad_lanes(rows), d + 171, 5);
                let len = d.div_ceil(2) * np;
                let (mut want, mut got) = (vec![7u32; len], vec![9u32; len]);
                load_pairs_t(&src[..], base, stride, (rows, d, np), &mut want);
                transpose_pairs(&src, base, stride, (rows, d, np), &mut got);
                assert_eq!(want, got, "rows {rows} d {d}");
            }
        }
    }
}

//! The one-pass backward's f32 copies of dQ, one per chunk of key blocks, and their sum into dq.

use super::query_tiles::split_at_offsets;
use super::recompute::Scratch;
use crate::blocks::Mask;
use crate::cpu::forward::WorkItem;
use crate::cpu::simd::pad_lanes;
use crate::cpu::{reuse, BlockSizes, Buf, Disjoint};
use crate::error::Result;
use crate::params::Params;
use crate::tensor::Element;

/// The one-pass backward's f32 copies of dQᵀ: per chunk of key blocks `c`, sequence `b` and kv
/// head `hk`, a region of `group · query blocks` tiles `[d][npb]` (head of the group, then query
/// block; `npb` = block_m padded, padded lanes unused). Regions of chunks a sequence does not have
/// (fewer key blocks than chunks) are empty.
pub(super) struct DqPartials {
    /// Per sequence, the first key block of each chunk and the end (`chunks + 1` bounds; empty
    /// chunks where a sequence has fewer key blocks).
    bounds: Vec<Vec<usize>>,
    chunks: usize,
    /// Region `(c · seqs + b) · heads_kv + hk` is `data[offsets[i]..offsets[i + 1]]`.
    offsets: Vec<usize>,
    data: Buf<f32>,
    npb: usize,
}

/// What one work item of the one-pass backward gets: sequence, kv head, its key blocks and its
/// region of [`DqPartials`].
type FusedItem<'a> = (usize, usize, std::ops::Range<usize>, &'a mut [f32]);

impl Drop for DqPartials {
    fn drop(&mut self) {
        reuse::DQ_COPIES.put(std::mem::take(&mut self.data));
    }
}

impl DqPartials {
    pub(super) fn new(p: &Params, bs: BlockSizes, chunks: usize) -> Result<Self> {
        let (d, npb) = (p.head_dim, pad_lanes(bs.block_m));
        let group = p.heads / p.heads_kv;
        let bounds: Vec<Vec<usize>> = p
            .seqs
            .iter()
            .map(|s| {
                let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
                // Weighed with 64-row query blocks whatever block_m is: the bounds decide how
                // dQ's copies are summed, and so must not follow the host's caches.
                let weights = BlockSizes {
                    block_m: 64,
                    block_n: bs.block_n,
                };
                chunk_bounds(s.seqlen_q, s.seqlen_k, &mask, weights, chunks)
            })
            .collect();
        let mut offsets = vec![0];
        for c in 0..chunks {
            for (s, bd) in p.seqs.iter().zip(&bounds) {
                let used = bd[c] < bd[c + 1];
                let tiles = if used {
                    group * s.seqlen_q.div_ceil(bs.block_m)
                } else {
                    0
                };
                for _ in 0..p.heads_kv {
                    offsets.push(offsets.last().expect("non-empty") + tiles * d * npb);
                }
            }
        }
        let total = *offsets.last().expect("non-empty");
        Ok(DqPartials {
            bounds,
            chunks,
            offsets,
            // Every work item zeroes its own region before using it.
            data: reuse::DQ_COPIES.take_for_overwrite("the backward's copies of dQ", total, 0.0)?,
            npb,
        })
    }

    /// The work items, each with its own region.
    pub(super) fn items(&mut self, p: &Params) -> Vec<FusedItem<'_>> {
        let regions = split_at_offsets(&mut self.data, &self.offsets);
        let (seqs, hkv) = (p.seqs.len(), p.heads_kv);
        let mut items = Vec::new();
        for (i, region) in regions.into_iter().enumerate() {
            let (c, b, hk) = (i / (seqs * hkv), i / hkv % seqs, i % hkv);
            let blocks = self.bounds[b][c]..self.bounds[b][c + 1];
            if !blocks.is_empty() {
                items.push((b, hk, blocks, region));
            }
        }
        items
    }

    /// Sums the chunks' dQᵀ tiles of (sequence, head, query block) `item` in chunk order and writes
    /// them as rows of dq.
    pub(super) fn sum_into<T: Element>(
        &self,
        p: &Params,
        bs: BlockSizes,
        item: WorkItem,
        scr: &mut Scratch,
        dq: &Disjoint<T>,
    ) {
        let WorkItem { b, h, m_block } = item;
        let d = p.head_dim;
        let (npb, tile) = (self.npb, d * self.npb);
        let group = p.heads / p.heads_kv;
        let (hk, hg) = (h / group, h % group);
        let nmb = p.seqs[b].seqlen_q.div_ceil(bs.block_m);
        let at = (hg * nmb + m_block) * tile;
        let region = |c: usize| {
            let i = (c * p.seqs.len() + b) * p.heads_kv + hk;
            &self.data[self.offsets[i] + at..][..tile]
        };
        let mut used = (0..self.chunks)
            .filter(|&c| self.bounds[b][c] < self.bounds[b][c + 1])
            .map(region);
        // One copy (the usual case) is written as it is; several are summed in chunk order.
        let acc: &[f32] = match (used.next(), used.next()) {
            (Some(only), None) => only,
            (first, second) => {
                let acc = &mut scr.acc_a[..tile];
                acc.fill(0.0);
                for part in first.into_iter().chain(second).chain(used) {
                    acc.iter_mut().zip(part).for_each(|(a, x)| *a += x);
                }
                acc
            }
        };
        let m0 = m_block * bs.block_m;
        let rows = (m0 + bs.block_m).min(p.seqs[b].seqlen_q) - m0;
        write_dq_rows(p, (b, h, m0, rows), acc, npb, &mut scr.row, dq);
    }
}

/// Splits the key blocks of a sequence into `chunks` runs of about equal work (the query blocks
/// that see each key block): `chunks + 1` ascending bounds from 0 to the key block count, empty runs
/// where there are fewer key blocks than chunks.
fn chunk_bounds(
    seqlen_q: usize,
    seqlen_k: usize,
    mask: &Mask,
    bs: BlockSizes,
    chunks: usize,
) -> Vec<usize> {
    let nb = seqlen_k.div_ceil(bs.block_n);
    // work[n]: query blocks visiting key block n, by a difference array over each block's range.
    let mut diff = vec![0i64; nb + 1];
    for m_block in 0..seqlen_q.div_ceil(bs.block_m) {
        let m0 = m_block * bs.block_m;
        let (n0, n1) = mask.n_block_range(m0, (m0 + bs.block_m).min(seqlen_q), bs.block_n);
        if n0 < n1 {
            diff[n0] += 1;
            diff[n1] -= 1;
        }
    }
    // A block nobody visits still costs its (empty) dK/dV tile: weight at least 1.
    let mut run = 0i64;
    let mut cum = Vec::with_capacity(nb + 1);
    cum.push(0i64);
    for dn in &diff[..nb] {
        run += dn;
        cum.push(cum.last().expect("non-empty") + run.max(1));
    }
    let total = *cum.last().expect("non-empty");
    let mut bounds = vec![0; chunks + 1];
    for (c, bd) in bounds.iter_mut().enumerate().skip(1) {
        // The first block end whose cumulative work reaches c/chunks of the total.
        let goal = (total * c as i64 + chunks as i64 - 1) / chunks as i64;
        *bd = cum.partition_point(|&w| w < goal).min(nb);
    }
    bounds
}

/// Writes dQᵀ tile `acc` (`[d][ld]`) as rows `m0..m0 + rows` of head `h` of sequence `b` of dq;
/// `row` is scratch of at least `8 · d` elements.
pub(super) fn write_dq_rows<T: Element>(
    p: &Params,
    (b, h, m0, rows): (usize, usize, usize, usize),
    acc: &[f32],
    ld: usize,
    row: &mut [f32],
    dq: &Disjoint<T>,
) {
    let d = p.head_dim;
    // Rows in groups of GATHER: the group's lanes of every head-dim column transposed into its
    // rows (`Kernels::transpose`; a strided element per row and column took ~1% of the f32
    // backward's samples, AVX2, d = 64).
    const GATHER: usize = 8;
    debug_assert!(row.len() >= GATHER * d);
    for g0 in (0..rows).step_by(GATHER) {
        let n = GATHER.min(rows - g0);
        p.kernels.transpose(&acc[g0..], ld, (d, n), row, d);
        for (i, r) in (g0..g0 + n).enumerate() {
            // SAFETY: rows m0..m0 + rows of head h of sequence b belong to this work item alone.
            let out = unsafe { dq.range(p.out_offset(b, m0 + r, h), d) };
            T::narrow(&row[i * d..(i + 1) * d], out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_bounds_split_the_work_evenly() {
        let bs = BlockSizes {
            block_m: 64,
            block_n: 64,
        };
        let bounds = |sq: usize, sk: usize, right: Option<usize>, chunks: usize| {
            chunk_bounds(sq, sk, &Mask::new(sq, sk, None, right), bs, chunks)
        };
        // Causal, square: key block n is seen by 16 - n query blocks; halves of the work.
        assert_eq!(bounds(1024, 1024, Some(0), 2), [0, 5, 16]);
        // No mask: equal block counts; more chunks than blocks leaves empty runs.
        assert_eq!(bounds(100, 200, None, 2), [0, 2, 4]);
        assert_eq!(bounds(100, 200, None, 4), [0, 1, 2, 3, 4]);
        assert_eq!(bounds(10, 70, None, 4), [0, 1, 1, 2, 2]);
        // No queries: every block weighs 1.
        assert_eq!(bounds(0, 300, None, 2), [0, 3, 5]);
    }
}

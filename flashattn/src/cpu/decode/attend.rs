//! Running a call's work items in parallel, and merging each query row's split partials through
//! their LSEs into `out` and `lse`.

use super::plan::Plan;
use super::tile_loop::{run_item, ItemOut, Kv};
use crate::cpu::softmax::fold_sink;
use crate::params::DecodeParams;
use crate::tensor::Element;
use rayon::prelude::*;

/// Attention of every sequence's queries over its first `seqlen_k` cache keys, into `out` (q's
/// dtype, `[batch, seqlen_q, heads, d]`) and `lse` (`[batch, heads, seqlen_q]`), every element of
/// which it writes, with the buffers of `plan`.
pub(super) fn attend<T: Element>(
    dp: &DecodeParams,
    q: &[T],
    kv: Kv<T>,
    (out, lse): (&mut [T], &mut [f32]),
    plan: Plan,
) {
    let p = &dp.p;
    let d = p.head_dim;
    let Plan {
        blocks,
        splits,
        items,
        rows,
        covered,
        direct,
        part_lse: mut part_lse_all,
        mut part_out,
    } = plan;
    let work = |x: usize, dst: ItemOut<T>, lse: &mut [f32]| {
        run_item(dp, q, kv, (items[x], items.get(x + 1).copied()), (dst, lse))
    };
    // Packed queries (cu_seqlens_q, lse `[heads, total_q]`) may leave rows after the last
    // sequence: 0, lse -inf. Batched queries cover every row.
    for r in covered..p.total_q {
        out[r * p.heads * d..(r + 1) * p.heads * d].fill(T::from_f32(0.0));
        for h in 0..p.heads {
            lse[h * p.lse_head_stride + r] = f32::NEG_INFINITY;
        }
    }
    if direct {
        let mut rest = &mut out[..covered * p.heads * d];
        let chunks: Vec<&mut [T]> = blocks
            .iter()
            .map(|&(_, i0, i1, _, _)| {
                let (c, r) = std::mem::take(&mut rest).split_at_mut((i1 - i0) * p.heads * d);
                rest = r;
                c
            })
            .collect();
        chunks
            .into_par_iter()
            .zip(part_lse_all.par_chunks_mut(rows.max(1)))
            .enumerate()
            .with_max_len(1)
            .for_each(|(x, (out, lse))| work(x, ItemOut::Rows(out), lse));
        for (x, &(b, i0, i1, _, _)) in blocks.iter().enumerate() {
            let m = i1 - i0;
            for h in 0..p.heads {
                for il in 0..m {
                    lse[p.lse_offset(b, h, i0 + il)] = part_lse_all[x * rows + h * m + il];
                }
            }
        }
        return;
    }
    part_out
        .par_chunks_mut((rows * d).max(1))
        .zip(part_lse_all.par_chunks_mut(rows.max(1)))
        .enumerate()
        .with_max_len(1)
        .for_each(|(x, (out, lse))| work(x, ItemOut::Parts(out), lse));

    let mut parts = vec![0f32; splits * d];
    let mut part_lse = vec![0f32; splits];
    let mut row = vec![0f32; d];
    for (x, &(b, i0, i1, _, _)) in blocks.iter().enumerate() {
        let m = i1 - i0;
        for h in 0..p.heads {
            for il in 0..m {
                let r = h * m + il;
                for s in 0..splits {
                    let item = x * splits + s;
                    let src = &part_out[(item * rows + r) * d..][..d];
                    parts[s * d..(s + 1) * d].copy_from_slice(src);
                    part_lse[s] = part_lse_all[item * rows + r];
                }
                let mut row_lse = merge_row(&part_lse, &parts, d, &mut row);
                if let Some(s) = &p.sink {
                    row_lse = fold_sink(&mut row, row_lse, s[h]);
                }
                let o = p.out_offset(b, i0 + il, h);
                T::narrow(&row, &mut out[o..o + d]);
                lse[p.lse_offset(b, h, i0 + il)] = row_lse;
            }
        }
    }
}

/// Merges one row's partials: `lse[s]` and `parts[s · d..(s + 1) · d]` -> `dst` (d values), and
/// returns the merged LSE. Splits with lse -inf (no visible key) are skipped, so whatever their
/// out holds cannot leak in; all -inf gives 0 and -inf. One finite split is copied exactly.
pub(crate) fn merge_row(lse: &[f32], parts: &[f32], d: usize, dst: &mut [f32]) -> f32 {
    let max = lse.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    dst[..d].fill(0.0);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let sum: f32 = lse.iter().map(|&x| (x - max).exp()).sum();
    let inv = 1.0 / sum;
    for (s, &l) in lse.iter().enumerate() {
        if l == f32::NEG_INFINITY {
            continue;
        }
        let w = (l - max).exp() * inv;
        for (o, &x) in dst[..d].iter_mut().zip(&parts[s * d..(s + 1) * d]) {
            *o += w * x;
        }
    }
    max + sum.ln()
}

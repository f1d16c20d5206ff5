//! The row terms computed before the tile loops: delta = rowsum(dO ∘ O), and the sinks' gradient.

use crate::cpu::Disjoint;
use crate::error::Result;
use crate::memory::try_filled;
use crate::params::{GradInputs, Params};
use crate::tensor::Element;
use rayon::prelude::*;

/// The gradient of the learnable sinks, when the call has them: for head h, `-Σ_rows
/// exp(sink_h - lse) · D` over every sequence's rows, where `exp(sink - lse)` is the row's sink
/// probability and `D = rowsum(dO ∘ O)` (the same D as the kernels'), summed in f64 in row order
/// (so the same for any thread count). An O(rows) sum over the backward's own D (`delta`).
pub(super) fn sink_grad(p: &Params, g: &GradInputs, delta: &[f32]) -> Option<Vec<f32>> {
    let sinks = p.sink.as_ref()?;
    let mut dsink = vec![0f64; p.heads];
    for (h, (ds, &sink)) in dsink.iter_mut().zip(sinks).enumerate() {
        for b in 0..p.seqs.len() {
            for i in 0..p.seqs[b].seqlen_q {
                let at = p.lse_offset(b, h, i);
                *ds -= (sink as f64 - g.lse[at] as f64).exp() * delta[at] as f64;
            }
        }
    }
    Some(dsink.into_iter().map(|x| x as f32).collect())
}

/// `delta[b, h, i] = dO_i · O_i`, in `lse` layout (`OutOfMemory` where it cannot be allocated).
pub(super) fn compute_delta<T: Element>(
    p: &Params,
    g: &GradInputs,
    out: &[T],
    dout: &[T],
) -> Result<Vec<f32>> {
    let d = p.head_dim;
    let mut delta = try_filled("the backward's row terms D", 0f32, p.lse_len())?;
    let delta_w = Disjoint::new(&mut delta);
    // Row by row, every head of a row in turn: the rows of one head are heads·d elements apart
    // (a row or two per page), and walking them head by head waited on memory (the loads took
    // ~6% of the bf16 backward's samples at d = 64, causal); a token's heads are contiguous.
    const ROWS: usize = 64;
    let jobs: Vec<(usize, usize)> = (0..p.seqs.len())
        .flat_map(|b| (0..p.seqs[b].seqlen_q.div_ceil(ROWS)).map(move |blk| (b, blk * ROWS)))
        .collect();
    jobs.par_iter().for_each_init(
        || (vec![0f32; d], vec![0f32; d]),
        |(o, d_o), &(b, i0)| {
            for i in i0..(i0 + ROWS).min(p.seqs[b].seqlen_q) {
                for h in 0..p.heads {
                    let (oa, da) = (g.out.offset(b, i, h), g.dout.offset(b, i, h));
                    let (out_row, dout_row) = (&out[oa..oa + d], &dout[da..da + d]);
                    // f32 rows are read in place (widening them was a copy: ~2% of the f32
                    // backward's samples); other types are widened into the scratch rows.
                    let x = match (
                        f32::unwrap(T::wrap(out_row)),
                        f32::unwrap(T::wrap(dout_row)),
                    ) {
                        (Some(o32), Some(do32)) => crate::cpu::kernels::dot(o32, do32),
                        _ => {
                            T::widen(out_row, o);
                            T::widen(dout_row, d_o);
                            crate::cpu::kernels::dot(o, d_o)
                        }
                    };
                    // SAFETY: lse's layout gives every (sequence, head, row) its own element,
                    // and each row of each sequence belongs to one job.
                    unsafe { delta_w.range(p.lse_offset(b, h, i), 1)[0] = x };
                }
            }
        },
    );
    Ok(delta)
}

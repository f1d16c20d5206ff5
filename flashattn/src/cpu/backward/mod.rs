//! The FlashAttention backward on the CPU, with recomputation: only q, k, v, out, dout and the
//! forward's LSE are read; each tile of P = exp(S·scale - lse) is recomputed from Q and K.
//!
//! No atomics, bit-for-bit deterministic for any thread count. One work item per (sequence, kv
//! head, chunk of key blocks): for every key block of the chunk, every query head of the kv head's
//! group and every query block that sees the key block (in a fixed order), recompute P and dS and
//! accumulate `dV += P̃ᵀ·dO`, `dK += dSᵀ·Q·scale` in the item's own tile, and `dQ += dS·K·scale`
//! in the item's own f32 copy of dQ for its group ([`DqPartials`]); a last pass sums the chunks'
//! copies in chunk order. Five block products per tile, as the FLOP model counts. The number of
//! chunks depends on the shape and the machine's core count, never on the thread pool's size.
//!
//! When there are too few (sequence, kv head) pairs to keep the cores busy with at most
//! [`MAX_DQ_CHUNKS`] copies of dQ (batch 1 with MQA on many cores, say; see [`dq_strategy`]),
//! the backward runs two passes instead:
//! the one above without dQ, then one work item per (sequence, head, query block) that recomputes
//! dS over its key blocks and accumulates `dQ += dS·K·scale` (7 block products).
//!
//! bf16 inputs on a CPU with a bf16 dot product (`vdpbf16ps`) take it in every product: q, k, v
//! and dO as they are, P̃ and dS rounded to bf16 where they are operands (as flash-attn rounds
//! them for its tensor-core products), f32 accumulation. Measured in docs/PERFORMANCE.md
//! ("The one-pass backward").
//! With `delta = rowsum(dO ∘ O)`: `dS = P ∘ (dP - delta)`, dropout folded into dP and P̃, softcap's
//! derivative `1 - tanh²` applied to dS.

mod block;
mod dq_partials;
mod prep;
mod query_tiles;
mod recompute;

use super::forward::{as_bf16, bf16_inputs, packed_v_keys, WorkItem};
use super::{block_sizes, Disjoint, Pass};
use crate::error::{ErrorKind, Result};
use crate::memory::{par_fill, try_poisoned_huge};
use crate::params::{GradInputs, Params};
use crate::tensor::Element;
use block::{dkdv_block, dq_block};
use dq_partials::DqPartials;
use prep::{compute_delta, sink_grad};
use query_tiles::QueryTiles;
use rayon::prelude::*;
use recompute::{Bf, Ctx, Scratch};
use std::sync::OnceLock;

/// Gradients `(dq, dk, dv, dsink)`: dq in q's contiguous layout, dk/dv in k's, and the sinks'
/// gradient ([`sink_grad`]) when the call has sinks.
pub(crate) fn backward<T: Element>(
    p: &Params,
    g: &GradInputs,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    dout: &[T],
) -> Result<Grads<T>> {
    // Poisoned: every element is written, and tests check.
    let poison = T::from_f32(f32::NAN);
    let (mut dq, mut dk, mut dv) = (
        try_poisoned_huge("`dq`", poison, p.out_len())?,
        try_poisoned_huge("`dk`", poison, p.dk_len())?,
        try_poisoned_huge("`dv`", poison, p.dk_len())?,
    );
    let inputs = BackwardInputs { q, k, v, out, dout };
    let dsink = backward_poisoned(p, g, inputs, (&mut dq, &mut dk, &mut dv))?;
    Ok((dq, dk, dv, dsink))
}

/// The tensors a backward call reads, in their validated layouts.
#[derive(Clone, Copy)]
pub(crate) struct BackwardInputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub out: &'a [T],
    pub dout: &'a [T],
}

/// [`backward`] into the caller's contiguous `dq` (`p.out_len()` elements), `dk` and `dv`
/// (`p.dk_len()` each), whose lengths the caller checked; returns dsink when the call has sinks.
pub(crate) fn backward_into<T: Element>(
    p: &Params,
    g: &GradInputs,
    inputs: BackwardInputs<T>,
    (dq, dk, dv): (&mut [T], &mut [T], &mut [T]),
) -> Result<Option<Vec<f32>>> {
    // Poisoned by the pool's threads: every element is written, and tests check.
    for d in [&mut *dq, &mut *dk, &mut *dv] {
        par_fill(d, T::from_f32(f32::NAN));
    }
    backward_poisoned(p, g, inputs, (dq, dk, dv))
}

/// The backward into gradients whose every element it writes (poisoned with NaN first, so that
/// the tests see any it misses).
fn backward_poisoned<T: Element>(
    p: &Params,
    g: &GradInputs,
    BackwardInputs { q, k, v, out, dout }: BackwardInputs<T>,
    (dq, dk, dv): (&mut [T], &mut [T], &mut [T]),
) -> Result<Option<Vec<f32>>> {
    // FP8 inputs have a forward only (as FlashAttention-3): no entry point builds these params.
    debug_assert!(
        p.descale.is_none(),
        "the backward has no FP8 descale factors"
    );
    debug_assert_eq!(
        (dq.len(), dk.len(), dv.len()),
        (p.out_len(), p.dk_len(), p.dk_len())
    );
    #[cfg_attr(not(test), allow(unused_mut))]
    let mut bs = block_sizes(Pass::Backward, p.kernels.isa, p.head_dim);
    #[cfg(test)]
    if let Some(m) = tests::BLOCK_M.get() {
        bs.block_m = m;
    }
    let delta = compute_delta(p, g, out, dout)?;
    let dsink = sink_grad(p, g, &delta);
    let bf_in = bf16_inputs(p, q, k, v).filter(|_| p.kernels.backward_bf16_dot());
    let bf = match bf_in {
        Some((_, kb, vb)) => Some(Bf {
            k: kb,
            v: vb,
            packed_k: packed_v_keys(p, kb, bs)?,
        }),
        None => None,
    };
    let bf_qdo = bf_in.map(|(qb, _, _)| (qb, as_bf16(dout)));
    let tiles = QueryTiles::new(p, g, (q, dout), bf_qdo, bs)?;
    let cx = Ctx {
        p,
        g,
        k,
        v,
        delta: &delta,
        tiles: &tiles,
        bs,
        bf,
        #[cfg(not(test))]
        fused_masked: true,
        #[cfg(test)]
        fused_masked: !tests::UNFUSED_MASKED.get(),
    };
    let d = p.head_dim;
    // The dQ strategy, a choice of this backend (before anything is written: a bad
    // FLASHATTN_DQ_CHUNKS is an error that touches no output).
    let dq_chunks = dq_strategy(p)?;
    // Rows of no sequence (packed inputs with spare tokens) get zero gradients.
    let q_used = p.seqs.last().map_or(0, |s| s.out_row0 + s.seqlen_q);
    let k_used = p.seqs.last().map_or(0, |s| s.k_row0 + s.seqlen_k);
    dq[q_used * p.heads * d..].fill(T::default());
    dk[k_used * p.heads_kv * d..].fill(T::default());
    dv[k_used * p.heads_kv * d..].fill(T::default());

    let (dk_w, dv_w) = (Disjoint::new(dk), Disjoint::new(dv));
    let new_scratch = || Scratch::new(bs, d);
    if let Some(chunks) = dq_chunks {
        let mut parts = DqPartials::new(p, bs, chunks)?;
        // One pass: dK, dV and each chunk's copy of dQ, then the copies summed into dq.
        let items = parts.items(p);
        items
            .into_par_iter()
            .for_each_init(new_scratch, |scr, item| {
                let (b, hk, n_blocks, dq_part) = item;
                // Zeroed here, in this worker (a kept buffer holds the last call's values; fresh
                // pages would otherwise be first touched by a read, the products' accumulate,
                // which maps the shared zero page and then faults again on the write).
                dq_part.fill(0.0);
                let last = n_blocks.end - 1;
                for n_block in n_blocks {
                    let item = WorkItem {
                        b,
                        h: hk,
                        m_block: n_block,
                    };
                    let next = n_block < last;
                    dkdv_block(&cx, item, scr, &dk_w, &dv_w, Some(&mut *dq_part), next);
                }
            });
        let dq_w = Disjoint::new(dq);
        in_token_order(super::forward::work_items(p, bs.block_m))
            .par_iter()
            .for_each_init(new_scratch, |scr, item| {
                parts.sum_into(p, bs, *item, scr, &dq_w)
            });
        return Ok(dsink);
    }
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
    kv_items.par_iter().for_each_init(new_scratch, |scr, item| {
        dkdv_block(&cx, *item, scr, &dk_w, &dv_w, None, false)
    });

    let dq_w = Disjoint::new(dq);
    in_token_order(super::forward::work_items(p, bs.block_m))
        .par_iter()
        .for_each_init(new_scratch, |scr, item| dq_block(&cx, *item, scr, &dq_w));
    Ok(dsink)
}

/// Query work items in the order (sequence, query block, head): a token's heads are contiguous
/// and its rows heads·d apart, so a worker that writes one query block's heads in turn writes
/// into lines and pages that the previous head's rows opened.
fn in_token_order(mut items: Vec<WorkItem>) -> Vec<WorkItem> {
    items.sort_by_key(|it| (it.b, it.m_block, it.h));
    items
}

/// What [`backward`] returns: dq, dk, dv and, with sinks, dsink.
pub(crate) type Grads<T> = (Vec<T>, Vec<T>, Vec<T>, Option<Vec<f32>>);

/// At most this many f32 copies of dQ (one per chunk of key blocks) for the one-pass backward.
pub(crate) const MAX_DQ_CHUNKS: usize = 4;

/// Chunks of key blocks per (sequence, kv head) for the one-pass backward: the fewest (up to
/// [`MAX_DQ_CHUNKS`]) whose work items fill whole rounds of `cores` workers at least 90%, or
/// `None` (two passes).
fn dq_chunks(pairs: usize, cores: usize) -> Option<usize> {
    (1..=MAX_DQ_CHUNKS).find(|c| {
        let items = pairs * c;
        10 * items >= 9 * items.div_ceil(cores) * cores
    })
}

/// The backward's dQ strategy for `p`: `Some(c)`, dQ in the dK/dV pass with `c` f32 copies of
/// it; `None`, in a second pass. The
/// `FLASHATTN_DQ_CHUNKS` environment variable when set (`0`: two passes; `1`-`4`: that many
/// copies; read on every call), else [`dq_chunks`] for the machine's core count. The core count
/// is the machine's, not the thread pool's, so the gradients are the same for any pool size.
pub(crate) fn dq_strategy(p: &Params) -> Result<Option<usize>> {
    static CORES: OnceLock<usize> = OnceLock::new();
    if let Ok(value) = std::env::var("FLASHATTN_DQ_CHUNKS") {
        return match value.trim().parse::<usize>() {
            Ok(0) => Ok(None),
            Ok(c) if c <= MAX_DQ_CHUNKS => Ok(Some(c)),
            _ => Err(ErrorKind::DqChunksUnknown { value }.into()),
        };
    }
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    Ok(dq_chunks(p.seqs.len() * p.heads_kv, cores))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{flash_attn, AttnOptions, TensorRef};
    use half::bf16;
    use std::cell::Cell;

    thread_local! {
        /// The backward's block_m on this thread instead of [`block_sizes`]'s.
        pub(super) static BLOCK_M: Cell<Option<usize>> = const { Cell::new(None) };
        /// Masked tiles through the three passes (scale and mask, softmax, dS) on this thread.
        pub(super) static UNFUSED_MASKED: Cell<bool> = const { Cell::new(false) };
    }

    /// Gradients as f32 bits (+0 for either zero), for the given block_m.
    fn grad_bits<T: crate::Element>(
        conv: fn(f32) -> T,
        opts: &AttnOptions,
        block_m: usize,
    ) -> Vec<Vec<u32>> {
        let (b, sq, sk, h, hk, d) = (2usize, 200usize, 170usize, 4usize, 2usize, 40usize);
        let vals = |len: usize, seed: u32| -> Vec<T> {
            let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
            (0..len)
                .map(|_| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    conv((x >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
                })
                .collect()
        };
        let (q, k, v, dout) = (
            vals(b * sq * h * d, 1),
            vals(b * sk * hk * d, 2),
            vals(b * sk * hk * d, 3),
            vals(b * sq * h * d, 4),
        );
        let (qt, kt, vt, dt) = (
            TensorRef::contiguous(&q, &[b, sq, h, d]),
            TensorRef::contiguous(&k, &[b, sk, hk, d]),
            TensorRef::contiguous(&v, &[b, sk, hk, d]),
            TensorRef::contiguous(&dout, &[b, sq, h, d]),
        );
        let fwd = flash_attn(&qt, &kt, &vt, opts).unwrap();
        BLOCK_M.set(Some(block_m));
        let g = fwd.backward(&qt, &kt, &vt, &dt, opts).unwrap();
        BLOCK_M.set(None);
        [g.dq, g.dk, g.dv]
            .iter()
            .map(|t| {
                let mut x = vec![0f32; t.as_slice::<T>().unwrap().len()];
                T::widen(t.as_slice::<T>().unwrap(), &mut x);
                x.iter()
                    .map(|v| if *v == 0.0 { 0 } else { v.to_bits() })
                    .collect()
            })
            .collect()
    }

    /// block_m is chosen from the caches in multiples of KC rows, which the products sum in
    /// chunks of KC anyway: the gradients are the same bits for any such block_m (so the same on
    /// every host), on every SIMD instruction set, masked or not, with dropout and softcap. (The
    /// scalar kernels sum each call in f64 and round once: there block_m stays 64.)
    #[test]
    fn gradients_do_not_depend_on_block_m() {
        for isa in crate::simd::available() {
            if isa == crate::simd::Isa::Scalar {
                continue;
            }
            for opts in [
                AttnOptions::default(),
                AttnOptions::default().causal(true).dropout(0.1, 7),
                AttnOptions::default().window(20, 5).softcap(20.0),
            ] {
                let opts = opts.isa(isa);
                let f = grad_bits::<f32>(|x| x, &opts, 64);
                let h = grad_bits::<bf16>(bf16::from_f32, &opts, 64);
                for block_m in [32, 96, 128] {
                    let ctx = format!("{isa} {opts:?} block_m {block_m}");
                    assert!(grad_bits::<f32>(|x| x, &opts, block_m) == f, "f32 {ctx}");
                    assert!(
                        grad_bits::<bf16>(bf16::from_f32, &opts, block_m) == h,
                        "bf16 {ctx}"
                    );
                }
            }
        }
    }

    /// Tiles cut by a causal or window mask take the fused P and dS pass with the mask set on
    /// the raw scores, their products by strips of lanes over the keys each strip sees (dQ's
    /// too): the same gradient bits as the three passes over whole tiles, on every SIMD instruction set,
    /// f32 and bf16, 200 queries over 170 keys (a bottom-right aligned diagonal), GQA.
    #[test]
    fn fused_masked_tiles_give_the_same_bits() {
        let unfused = |f: &dyn Fn() -> Vec<Vec<u32>>| {
            UNFUSED_MASKED.set(true);
            let g = f();
            UNFUSED_MASKED.set(false);
            g
        };
        for isa in crate::simd::available() {
            if isa == crate::simd::Isa::Scalar {
                continue;
            }
            for opts in [
                AttnOptions::default().causal(true),
                AttnOptions::default().window(20, 5),
                AttnOptions::default().window(70, 0).softmax_scale(0.3),
            ] {
                let opts = opts.isa(isa);
                let f = || grad_bits::<f32>(|x| x, &opts, 64);
                let h = || grad_bits::<bf16>(bf16::from_f32, &opts, 64);
                assert!(f() == unfused(&f), "f32 {isa} {opts:?}");
                assert!(h() == unfused(&h), "bf16 {isa} {opts:?}");
            }
        }
    }

    #[test]
    fn dq_chunks_fill_the_cores() {
        // (pairs, cores) -> chunks: the fewest copies whose items fill rounds of cores ≥ 90%.
        for (pairs, cores, want) in [
            (16, 2, Some(1)),
            (1, 2, Some(2)),
            (3, 2, Some(2)),
            (1, 1, Some(1)),
            (5, 16, Some(3)),
            (8, 16, Some(2)),
            (1, 16, None),
            (3, 64, None),
        ] {
            assert_eq!(
                dq_chunks(pairs, cores),
                want,
                "{pairs} pairs, {cores} cores"
            );
        }
    }
}

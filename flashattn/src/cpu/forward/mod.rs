//! The FlashAttention forward on the CPU.
//!
//! For each work item (sequence b, head h, query block m_block): load the q tile once, then stream
//! the key blocks that [`Mask::n_block_range`] says it sees: S = Q·Kᵀ, score modifiers (scale,
//! softcap, ALiBi) and the mask (only on blocks the mask cuts, and there only over the lanes and
//! keys that some row sees, `parts`), online softmax, acc_o += P·V. Divide by row_sum once at the
//! end and store the LSE.
//!
//! Query rows sit in SIMD lanes: the item's q is held transposed (`qt[x][r]`), scores as `st[c][r]`
//! and the accumulator as `ot[x][r]`, so both products are [`Kernels::gemm`] calls and the row
//! statistics are vertical vector operations (see [`super::simd`]). Memory: per-thread tiles of
//! O(block · head_dim), plus, on the bf16 dot-product path, v packed in key pairs once per call
//! (the size of v); nothing grows with seqlen_q · seqlen_k.
//!
//! [`Mask::n_block_range`]: crate::blocks::Mask::n_block_range
//! [`Kernels::gemm`]: super::simd::Kernels::gemm

mod block;
mod items;
mod parts;
mod score_mod;
mod tiles;

use super::reuse::{self, Slot};
use super::{block_sizes, Disjoint, Pass};
use crate::error::Result;
use crate::memory::{par_fill, try_poisoned};
use crate::params::{Params, RowLayout};
use crate::tensor::{DType, Element};
use block::{forward_block, Inputs, Scratch};
use half::bf16;
use items::{key_block_visits, key_blocks, pack_visits_f32, PACK_VISITS_WIDENED};
pub(crate) use items::{work_items, WorkItem};
use rayon::prelude::*;
pub(crate) use score_mod::ScoreMod;
use std::sync::Mutex;
#[cfg(test)]
pub(crate) use tiles::load_pairs_t;
pub(crate) use tiles::{load_pairs, load_tile, packed_v_keys, Fp8Source, PackedV};
use tiles::{packed_v, Bf16Source, KeyTiles};
pub(crate) use tiles::{prefetch_rows, prefetch_span};

/// Forward attention. Returns `out` (q's dtype, `p.out_shape`) and `lse` (`p.lse_shape`), or
/// `OutOfMemory` where they cannot be allocated.
pub(crate) fn forward<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
) -> Result<(Vec<T>, Vec<f32>)> {
    // Poisoned: every element is written (rows of no sequence explicitly), and tests check.
    let mut out = try_poisoned("`out`", T::from_f32(f32::NAN), p.out_len())?;
    let mut lse = try_poisoned("`lse`", f32::NAN, p.lse_len())?;
    forward_with(p, (q, k, v), bf16_inputs(p, q, k, v), &mut out, &mut lse)?;
    Ok((out, lse))
}

/// [`forward`] into the caller's contiguous `out` (`p.out_len()` elements) and `lse`
/// (`p.lse_len()`), whose lengths the caller checked.
pub(crate) fn forward_into<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: &mut [f32],
) -> Result<()> {
    par_fill(out, T::from_f32(f32::NAN));
    par_fill(lse, f32::NAN);
    forward_with(p, (q, k, v), bf16_inputs(p, q, k, v), out, lse)
}

/// Forward attention of FP8 inputs on the bf16 dot-product path (the caller checked that the
/// kernels have one): q, k and v are widened to bf16 as their tiles are built. Returns `out` in
/// bf16 and `lse`.
pub(crate) fn forward_fp8(
    p: &Params,
    q: Fp8Source,
    k: Fp8Source,
    v: Fp8Source,
) -> Result<(Vec<bf16>, Vec<f32>)> {
    debug_assert!(p.kernels.has_bf16_dot());
    // The typed slices feed only the f32 products, which do not run when `bf` is given.
    let mut out = try_poisoned("`out`", bf16::NAN, p.out_len())?;
    let mut lse = try_poisoned("`lse`", f32::NAN, p.lse_len())?;
    forward_with::<bf16, _>(p, (&[], &[], &[]), Some((q, k, v)), &mut out, &mut lse)?;
    Ok((out, lse))
}

/// [`forward_fp8`] into the caller's contiguous `out` (`p.out_len()` elements) and `lse`
/// (`p.lse_len()`), whose lengths the caller checked.
pub(crate) fn forward_fp8_into(
    p: &Params,
    (q, k, v): (Fp8Source, Fp8Source, Fp8Source),
    out: &mut [bf16],
    lse: &mut [f32],
) -> Result<()> {
    debug_assert!(p.kernels.has_bf16_dot());
    par_fill(out, bf16::NAN);
    par_fill(lse, f32::NAN);
    forward_with::<bf16, _>(p, (&[], &[], &[]), Some((q, k, v)), out, lse)
}

/// The forward over typed inputs `qkv` (read by the f32 products), or, when `bf` is given, over
/// its bf16 sources (the bf16 dot-product path).
fn forward_with<T: Element, S: Bf16Source>(
    p: &Params,
    (q, k, v): (&[T], &[T], &[T]),
    bf: Option<(S, S, S)>,
    out: &mut [T],
    lse: &mut [f32],
) -> Result<()> {
    debug_assert_eq!((out.len(), lse.len()), (p.out_len(), p.lse_len()));
    let pass = if bf.is_some() {
        Pass::ForwardBf16Dot
    } else {
        Pass::ForwardF32
    };
    let bs = block_sizes(pass, p.kernels.isa, p.head_dim);
    // `out` and `lse` arrive poisoned (NaN): every element is written below.
    clear_unused_rows(p, out, lse);
    let mut items = work_items(p, bs.block_m);
    let visits = key_block_visits(p, &items, bs);
    let revisited = visits >= pack_visits_f32(p.kernels.isa);
    // The f32 products widen bf16 and f16 tiles as they copy them: packed, each element is
    // widened once per call instead of at every visit.
    let pack_f32 = bf.is_none()
        && match T::DTYPE {
            DType::F32 => revisited,
            _ => visits >= PACK_VISITS_WIDENED,
        };
    let d = p.head_dim;
    let tiles_of =
        |src: &[T],
         base_of: fn(&crate::params::Seq) -> usize,
         (layout, slot, what): (RowLayout, &'static Slot<f32>, &'static str)| {
            KeyTiles::build(
                p,
                bs,
                (bs.block_n * d, slot, what),
                |out, (b, hk, n0, cols)| {
                    let base =
                        base_of(&p.seqs[b]) + n0 * layout.row_stride + hk * layout.head_stride;
                    load_tile(src, base, layout.row_stride, (cols, d, d), out);
                },
            )
        };
    let packed_k = |kb: S| {
        let what = "the packed bf16 pairs of k";
        let block = (bs.block_n * d.div_ceil(2), &reuse::K_PAIRS, what);
        KeyTiles::build(p, bs, block, |out, (b, hk, n0, cols)| {
            let base = p.seqs[b].k_base + n0 * p.k.row_stride + hk * p.k.head_stride;
            load_pairs(kb, base, p.k.row_stride, cols, d, out);
        })
    };
    let inputs = Inputs {
        q,
        k,
        v,
        packed_v: bf.map(|(_, _, vb)| packed_v(p, vb, bs)).transpose()?,
        packed_k: bf
            .filter(|_| revisited || !S::COPY_IS_CHEAP)
            .map(|(_, kb, _)| packed_k(kb))
            .transpose()?,
        tiles_f32: match pack_f32 {
            true => Some((
                tiles_of(
                    k,
                    |s| s.k_base,
                    (p.k, &reuse::K_TILES, "the packed tiles of k"),
                )?,
                tiles_of(
                    v,
                    |s| s.v_base,
                    (p.v, &reuse::V_TILES, "the packed tiles of v"),
                )?,
            )),
            false => None,
        },
        bf,
    };
    let (out_w, lse_w) = (Disjoint::new(out), Disjoint::new(lse));
    // Longest first (causal and windowed items see different numbers of key blocks), so the last
    // items to run are short ones and the threads finish together.
    items.sort_by_key(|it| std::cmp::Reverse(key_blocks(p, it, bs)));
    // One item per steal keeps that order; each worker thread reuses its own scratch (rayon's
    // `for_each_init` would build and zero a new one per item at this granularity).
    let pool: Vec<Mutex<Option<ThreadScratch<T>>>> = (0..rayon::current_num_threads())
        .map(|_| Mutex::new(None))
        .collect();
    // The largest tile any item uses: full blocks, or a short call's rows and keys.
    let longest = |f: fn(&crate::params::Seq) -> usize| p.seqs.iter().map(f).max().unwrap_or(0);
    let tile = (
        bs.block_m.min(longest(|s| s.seqlen_q)).max(1),
        bs.block_n.min(longest(|s| s.seqlen_k)).max(1),
    );
    // A worker runs a contiguous run of the list: the item after its own is usually its next.
    items
        .par_iter()
        .enumerate()
        .with_max_len(1)
        .for_each(|(at, item)| {
            let slot = rayon::current_thread_index().and_then(|i| pool.get(i));
            let mut guard = slot.map(|m| m.lock().unwrap_or_else(|e| e.into_inner()));
            let mut local = None;
            let (scratch, row_buf) = match guard.as_deref_mut() {
                Some(own) => own,
                None => &mut local,
            }
            .get_or_insert_with(|| {
                (
                    Scratch::new(bs, p.head_dim, tile),
                    vec![T::default(); p.head_dim],
                )
            });
            let next = items.get(at + 1).copied();
            forward_block(
                p,
                &inputs,
                (*item, next),
                bs,
                scratch,
                row_buf,
                &out_w,
                &lse_w,
            )
        });
    Ok(())
}

/// A worker's tiles and its output row buffer.
type ThreadScratch<T> = (Scratch, Vec<T>);

/// q, k, v as bf16 when they are bf16 and the kernels have a bf16 dot product.
pub(crate) fn bf16_inputs<'a, T: Element>(
    p: &Params,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
) -> Option<(&'a [bf16], &'a [bf16], &'a [bf16])> {
    if T::DTYPE != DType::BF16 || !p.kernels.has_bf16_dot() {
        return None;
    }
    Some((as_bf16(q), as_bf16(k), as_bf16(v)))
}

/// `x` as bf16; the caller knows `T` is bf16.
pub(crate) fn as_bf16<T: Element>(x: &[T]) -> &[bf16] {
    bf16::unwrap(T::wrap(x)).expect("T is bf16")
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

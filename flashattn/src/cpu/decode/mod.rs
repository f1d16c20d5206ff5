//! Decoding on the CPU: append to the KV cache, split-KV attention, and the merge of partials.
//!
//! Work items are (sequence b, query block, key split). A query block holds `m_rows` query
//! positions of *every* head, so each item streams its keys once for all heads, reading the
//! cache in place, tile by tile ([`TILE_KEYS`] keys of all kv heads; [`TILE_KEYS_MANY_ROWS`]
//! when a kv head has more than 4 query rows). In a contiguous cache a
//! tile's rows are adjacent (`heads_kv · d` elements per key), so the item reads one dense span
//! per tile and asks for the next tile's span ahead of use ([`Ahead`]); reading one kv head at a
//! time over the whole range would instead touch one `d`-row per 4 KiB page (f32, 8 kv heads,
//! d = 128). A tile of a paged cache spans as many pages as its keys lie on: the products
//! follow each key's row offset ([`KeyRows`]), and the prefetch asks for one span per page. (Tiles
//! cut at page boundaries ran 1-key tiles at page size 1, 2.5-3.5× slower; see
//! docs/PERFORMANCE.md.)
//!
//! Every query row of the item (all heads) is a lane of one score tile `st[c][r]`, rows of kv
//! head `hk` at lanes `hk · rows..`, so one online-softmax step (the forward's kernels,
//! [`Kernels::max_get_scale`], [`Kernels::online_softmax`]) covers all heads: 32 heads of one
//! token fill two 16-lane vectors, where a step per kv head would use 4 of 16 lanes. The two
//! products run per kv head and are shaped for a few rows against many keys:
//! - scores `S = Q·Kᵀ`: [`scores`], dot products along `d` (4 query rows × 4 keys in registers),
//!   then one transposing reduction per 16 scores;
//!   with many query rows per kv head on AVX-512, outer products against q transposed instead
//!   ([`scores_bcast_avx512`]), and in bf16 with 4-31 rows q in blocks of 4 rows
//!   ([`scores_quad_avx512_bf16`]);
//! - `acc_o += P·V`: [`pv_acc`], rows × `d` accumulators in registers over the tile's keys, so
//!   each v element is loaded once per 4 rows (up to 6 with more than 4 rows per kv head).
//!
//! bf16 on a CPU with AVX512_BF16 multiplies bf16 pairs with `vdpbf16ps` in both products (q·k
//! exact; P rounded to bf16 for P·V, as the forward and flash-attn do). Without AVX-512 the
//! products are those of `decode/avx2.rs` (bf16 widened in even/odd pairs, f16 by F16C).
//!
//! Each split ends with a normalised partial `(out, lse)` per row; [`merge_row`] combines a row's
//! splits (`lse = log Σ exp(lse_s)`, `out = Σ exp(lse_s - lse) · out_s`). With one split the merge
//! is the identity, bit for bit, so then each item writes its rows of the output itself.
//!
//! The files, one concern each: [`plan`] (how a call is cut into work items, tile sizes, split
//! count), [`append`] (writing the new keys and values), [`attend`] (running the items and
//! merging their partials), [`tile_loop`] (one item's loop over its tiles), [`rows`] and
//! [`prefetch`] (where a tile's rows lie, and asking for the next tile ahead of use),
//! [`scores`](mod@scores) and [`pv`] (the two products, dispatching to the kernels that the
//! call's kernel table names, [`DecodeKernels`], beside the forward's), and the x86-64 kernels:
//! `x86_blocks` (shared pieces), `x86_scores`, `x86_scores_qt` and `x86_pv` (AVX-512) and `avx2`.
//!
//! [`append`]: mod@append
//! [`attend`]: mod@attend
//! [`Ahead`]: prefetch::Ahead
//! [`Kernels::max_get_scale`]: crate::cpu::simd::Kernels::max_get_scale
//! [`Kernels::online_softmax`]: crate::cpu::simd::Kernels::online_softmax
//! [`DecodeKernels`]: crate::cpu::simd::DecodeKernels
//! [`KeyRows`]: rows::KeyRows
//! [`TILE_KEYS`]: plan::TILE_KEYS
//! [`TILE_KEYS_MANY_ROWS`]: plan::TILE_KEYS_MANY_ROWS
//! [`pv_acc`]: pv::pv_acc
//! [`scores`]: scores::scores
//! [`scores_bcast_avx512`]: x86_scores_qt::scores_bcast_avx512
//! [`scores_quad_avx512_bf16`]: x86_scores_qt::scores_quad_avx512_bf16

mod append;
mod attend;
mod plan;
mod prefetch;
mod pv;
mod rows;
mod scores;
mod tile_loop;
#[cfg(target_arch = "x86_64")]
#[macro_use]
mod x86_blocks;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86_pv;
#[cfg(target_arch = "x86_64")]
mod x86_scores;
#[cfg(target_arch = "x86_64")]
mod x86_scores_qt;

use append::{append, append_fp8};
use attend::attend;
use plan::Plan;
use tile_loop::Kv;

pub(crate) use attend::merge_row;

use crate::dtype::Fp8Format;
use crate::error::Result;
use crate::output::data;
use crate::params::DecodeParams;
use crate::tensor::{Element, SliceMut, TensorRef};
use half::bf16;

/// Appends (rotates), then attends, into `out` (q's dtype, `dp.p.out_len()` elements) and `lse`
/// (`dp.p.lse_len()`), which arrive poisoned (NaN) and are written whole. The dtypes of the
/// caches and of `out` were validated to be q's. The plan's buffers are allocated before an
/// append writes the caches, so a call that gets `OutOfMemory` has written nothing.
pub(crate) fn run(
    dp: &DecodeParams,
    q: &TensorRef,
    new_kv: Option<&(TensorRef, TensorRef)>,
    k_cache: &mut SliceMut,
    v_cache: &mut SliceMut,
    (out, lse): (SliceMut, &mut [f32]),
) -> Result<()> {
    fn typed<T: Element>(
        dp: &DecodeParams,
        q: &TensorRef,
        new_kv: Option<&(TensorRef, TensorRef)>,
        (k, v): (&mut [T], &mut [T]),
        dst: (&mut [T], &mut [f32]),
    ) -> Result<()> {
        let plan = Plan::new(dp)?;
        if let Some((kn, vn)) = new_kv {
            append(dp, data::<T>(kn), data::<T>(vn), k, v);
        }
        attend(dp, data::<T>(q), Kv::Plain(k, v), dst, plan);
        Ok(())
    }
    match (k_cache, v_cache, out) {
        (SliceMut::F32(k), SliceMut::F32(v), SliceMut::F32(o)) => {
            typed::<f32>(dp, q, new_kv, (k, v), (o, lse))
        }
        (SliceMut::F16(k), SliceMut::F16(v), SliceMut::F16(o)) => {
            typed(dp, q, new_kv, (k, v), (o, lse))
        }
        (SliceMut::BF16(k), SliceMut::BF16(v), SliceMut::BF16(o)) => {
            typed(dp, q, new_kv, (k, v), (o, lse))
        }
        _ => unreachable!("cache and out dtypes validated against q"),
    }
}

/// Appends (rotates, quantises), then attends, over FP8 caches (bytes of `format`); q, the new
/// keys and values and `out` are in q's dtype (`out` and `lse` as in [`run`]). `quant` holds the
/// k and v descale factors per (sequence, kv head), by which the appended rows are divided before
/// rounding to FP8. `dp.p` carries the descale factors folded into the score scale and the output
/// rows.
pub(crate) fn run_fp8(
    dp: &DecodeParams,
    q: &TensorRef,
    new_kv: Option<&(TensorRef, TensorRef)>,
    (k, v): (&mut [u8], &mut [u8]),
    format: Fp8Format,
    quant: (&[f32], &[f32]),
    (out, lse): (SliceMut, &mut [f32]),
) -> Result<()> {
    fn typed<T: Element>(
        dp: &DecodeParams,
        q: &TensorRef,
        new_kv: Option<&(TensorRef, TensorRef)>,
        (k, v): (&mut [u8], &mut [u8]),
        (format, quant): (Fp8Format, (&[f32], &[f32])),
        dst: (&mut [T], &mut [f32]),
    ) -> Result<()> {
        let plan = Plan::new(dp)?;
        if let Some((kn, vn)) = new_kv {
            append_fp8(dp, (data::<T>(kn), data::<T>(vn)), (k, v), format, quant);
        }
        attend(dp, data::<T>(q), Kv::Fp8(k, v, format), dst, plan);
        Ok(())
    }
    let fq = (format, quant);
    match out {
        SliceMut::F32(o) => typed::<f32>(dp, q, new_kv, (k, v), fq, (o, lse)),
        SliceMut::F16(o) => typed::<half::f16>(dp, q, new_kv, (k, v), fq, (o, lse)),
        SliceMut::BF16(o) => typed::<bf16>(dp, q, new_kv, (k, v), fq, (o, lse)),
    }
}

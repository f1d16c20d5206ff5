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

use super::forward::ScoreMod;
use super::fp8::widen;
use super::simd::{pad_lanes, Isa, Kernels, LANES};
use super::softmax::{finalize, fold_sink};
use super::{buf, buf_from, Buf};
use crate::blocks::Mask;
use crate::decode::{DecodeParams, SliceMut};
use crate::dtype::Fp8Format;
use crate::error::Result;
use crate::memory::{try_collect, try_filled};
use crate::output::{data, AttnOutput};
use crate::tensor::{Buffer, DType, Element, Slice, Tensor, TensorRef};
use half::bf16;
use rayon::prelude::*;

/// Most query rows (positions × heads) one item holds: 256, and fewer where its f32 q and acc_o
/// (`2 · rows · d · 4` bytes) would pass [`ROWS_BYTES`] (d > 128), so they stay in L2 beside the
/// k/v tiles. 32 heads × 8 positions fit, so speculative decoding of a few tokens still reads the
/// cache once; a long query chunk (chunked prefill) reads it once per 8 positions. 256 against
/// 128 rows (32/8 heads, d = 128, causal, 2 threads, four alternations of `flashattn bench
/// --decode --seqlen N`, medians, 2026-11-24): 512 queries over 8192 keys bf16 0.95, f32 0.93
/// (then level with the forward kernel on the same attention: bf16 223, f32 431 ms); 64 queries
/// over 4096 keys 0.94 / 0.83; 8 queries 0.80 / 1.03. 512 rows: no better, often worse.
const ROWS_MAX: usize = 256;
/// Bytes of an item's f32 q and acc_o at most (see [`ROWS_MAX`]).
const ROWS_BYTES: usize = 256 << 10;

/// Query rows per item at head dim `d` (see [`ROWS_MAX`]): 256 up to d = 128, 128 at d = 256.
fn rows_cap(d: usize) -> usize {
    ROWS_MAX.min(ROWS_BYTES / (8 * pad_lanes(d)))
}
/// Keys per tile: the online softmax's step. 16 keys of 8 kv heads at d = 128 are 64 KiB of
/// bf16 k and v (128 KiB f32), fetched one tile ahead into L2 (1 MiB on Zen 4). 16 measured
/// best of 8-128 keys and 1-4 tiles ahead (2 threads, 32k keys, three interleaved rounds: 16
/// keys one tile ahead 10.1-13.1 ms f32 and 5.6-6.3 ms bf16, 32 keys 12.0-12.8 and 6.5-6.9, 64
/// keys 13.1-20.7 and 6.2-10.3; a busy machine, so relative figures).
const TILE_KEYS: usize = 16;
/// Keys per tile for more than 4 query rows per kv head (MQA, several tokens per step), where
/// the step is bound by arithmetic: longer runs of each register tile over keys (P·V's
/// accumulators put back, the score kernel's per-call work, the softmax calls once per tile).
/// Measured (A/B in one process, 2 threads, 32k keys, 2026-11-23), 32 against 16 keys: MQA f32
/// 0.95, bf16 0.86; 4 tokens f32 0.99, bf16 0.93; 64 keys no better (0.97 / 0.84 / 1.01 / 0.95).
const TILE_KEYS_MANY_ROWS: usize = 32;
/// The longest tile of either kind (buffer sizes).
const TILE_KEYS_MAX: usize = TILE_KEYS_MANY_ROWS;
/// The products take a tile in sub-blocks of keys whose rows of all kv heads span at most this
/// many bytes, each sub-block head by head: 8 keys (32 KiB of k, then of v) for f32 at 8 kv
/// heads and d = 128, where walking one kv head over all 16 keys of the tile touches 16 pages
/// at once. Measured (A/B, 2 threads, 32k keys, f32, paired ratios over 60 alternating calls,
/// 2026-11-23): sub-blocks of 8 keys 0.89-0.92 of the whole-tile time, 4 keys 0.90-0.93, 2
/// keys 1.03-1.04 (the 4-key register blocks shrink); one thread 0.88. bf16 at 8 kv heads (2
/// KiB a key) keeps the whole tile: 8-key sub-blocks took 1.10 of its time. What counts is
/// P·V's order (whole-tile P·V with 8-key score sub-blocks: 1.065; the reverse: 1.015). With 32
/// kv heads (16 KiB a key in f32: 4-key sub-blocks) the whole tile took 1.09, 8 keys 1.01; bf16
/// at 16 kv heads (4 KiB a key: 8-key sub-blocks) the whole tile 1.01-1.05.
/// With 4 query tokens per step (16 rows per kv head, bound by arithmetic) 8-key sub-blocks
/// took 1.07 of the whole-tile time, so [`run_item`] keeps whole tiles for more than 4 rows per
/// kv head.
const SUB_BLOCK_BYTES: usize = 32 << 10;
/// Keys per sub-block of the products (see [`SUB_BLOCK_BYTES`]) when a key's rows of all kv
/// heads take `key_bytes`: 4, 8 or 16 ([`TILE_KEYS`]), so that a sub-block holds whole 4-key
/// register blocks and whole bf16 key pairs, and the sub-blocks tile a tile.
fn sub_block_keys(key_bytes: usize) -> usize {
    let keys = (SUB_BLOCK_BYTES / key_bytes.max(1)).clamp(4, TILE_KEYS);
    1 << keys.ilog2()
}
/// The largest padded head dimension (stack rows of the portable kernels).
const MAX_D: usize = 256;
/// Splits beyond one per thread should hold at least this many keys: an item costs a q load, a
/// merge and its partial buffers; 512 keys of 8 kv heads at d = 128 are 2-4 MiB of k/v, 70-150
/// µs at 27 GB/s.
pub(crate) const MIN_SPLIT_KEYS: usize = 512;
/// Shortest split worth taking so that every thread has an item (see [`choose_splits`]).
/// Measured, B = 1, 2 threads, 32/8 heads, d = 128, `flashattn bench --decode --num-splits`
/// (2026-11-24): 2 splits against 1 at 128, 192, 256, 512 keys take 0.82, 0.71, 0.66, 0.64 of
/// the time in bf16 and 0.68, 0.61, 0.61, 0.54 in f32; 4 splits at 512 keys 0.74 (bf16).
const EVEN_SPLIT_KEYS: usize = 64;
/// Items per thread the automatic split count aims for: more than one, so that dynamic scheduling
/// evens out sequences of different lengths.
const ITEMS_PER_THREAD: usize = 4;
/// Upper bound on the automatic split count.
const MAX_SPLITS: usize = 128;

/// The number of key splits when the caller names none: enough items (`items` = sequences ×
/// query blocks, times the splits) to give each of `threads` threads [`ITEMS_PER_THREAD`], but no
/// split shorter than [`MIN_SPLIT_KEYS`] of the longest sequence's `max_keys`; and in any case
/// enough for one item per thread while splits keep [`EVEN_SPLIT_KEYS`]. One thread: 1.
/// E.g. B = 1, 2 threads: 32k keys 8 splits of 4096; 1024 keys 2; 128 keys 2; B = 64: 1 split.
pub(crate) fn choose_splits(items: usize, max_keys: usize, threads: usize) -> usize {
    if threads <= 1 || items == 0 {
        return 1;
    }
    let want = (ITEMS_PER_THREAD * threads).div_ceil(items);
    let by_len = (max_keys / MIN_SPLIT_KEYS).max(1);
    let even = threads.div_ceil(items).min(max_keys / EVEN_SPLIT_KEYS);
    want.min(by_len).max(even).clamp(1, MAX_SPLITS)
}

/// Appends (rotates), then attends. The dtypes of the caches were validated to be q's.
pub(crate) fn run(
    dp: &DecodeParams,
    q: &TensorRef,
    new_kv: Option<&(TensorRef, TensorRef)>,
    k_cache: &mut SliceMut,
    v_cache: &mut SliceMut,
) -> Result<AttnOutput> {
    fn typed<T: Element>(
        dp: &DecodeParams,
        q: &TensorRef,
        new_kv: Option<&(TensorRef, TensorRef)>,
        k: &mut [T],
        v: &mut [T],
    ) -> Result<AttnOutput> {
        let results = results(dp)?;
        if let Some((kn, vn)) = new_kv {
            append(dp, data::<T>(kn), data::<T>(vn), k, v);
        }
        Ok(output(
            dp,
            attend(dp, data::<T>(q), Kv::Plain(k, v), results),
        ))
    }
    match (k_cache, v_cache) {
        (SliceMut::F32(k), SliceMut::F32(v)) => typed::<f32>(dp, q, new_kv, k, v),
        (SliceMut::F16(k), SliceMut::F16(v)) => typed(dp, q, new_kv, k, v),
        (SliceMut::BF16(k), SliceMut::BF16(v)) => typed(dp, q, new_kv, k, v),
        _ => unreachable!("cache dtypes validated against q"),
    }
}

/// Appends (rotates, quantises), then attends, over FP8 caches (bytes of `format`); q, the new
/// keys and values and `out` are in q's dtype. `quant` holds the k and v descale factors per
/// (sequence, kv head), by which the appended rows are divided before rounding to FP8. `dp.p`
/// carries the descale factors folded into the score scale and the output rows.
pub(crate) fn run_fp8(
    dp: &DecodeParams,
    q: &TensorRef,
    new_kv: Option<&(TensorRef, TensorRef)>,
    (k, v): (&mut [u8], &mut [u8]),
    format: Fp8Format,
    quant: (&[f32], &[f32]),
) -> Result<AttnOutput> {
    fn typed<T: Element>(
        dp: &DecodeParams,
        q: &TensorRef,
        new_kv: Option<&(TensorRef, TensorRef)>,
        (k, v): (&mut [u8], &mut [u8]),
        format: Fp8Format,
        quant: (&[f32], &[f32]),
    ) -> Result<AttnOutput> {
        let results = results(dp)?;
        if let Some((kn, vn)) = new_kv {
            append_fp8(dp, (data::<T>(kn), data::<T>(vn)), (k, v), format, quant);
        }
        Ok(output(
            dp,
            attend(dp, data::<T>(q), Kv::Fp8(k, v, format), results),
        ))
    }
    match q.dtype() {
        DType::F32 => typed::<f32>(dp, q, new_kv, (k, v), format, quant),
        DType::F16 => typed::<half::f16>(dp, q, new_kv, (k, v), format, quant),
        DType::BF16 => typed::<bf16>(dp, q, new_kv, (k, v), format, quant),
    }
}

/// What [`attend`] fills: `out` and `lse`, poisoned (every element is written by its items or
/// its merge; tests check for NaN), and its [`Plan`] with the partial results' buffers.
/// Allocated before an append writes the caches, so a call that gets `OutOfMemory` has written
/// nothing.
fn results<T: Element>(dp: &DecodeParams) -> Result<(Vec<T>, Vec<f32>, Plan)> {
    Ok((
        try_filled("`out`", T::from_f32(f32::NAN), dp.p.out_len())?,
        try_filled("`lse`", f32::NAN, dp.p.lse_len())?,
        Plan::new(dp)?,
    ))
}

/// Query block: sequence, its query rows `i0..i1`, and the keys `lo..hi` they see.
type QueryBlock = (usize, usize, usize, usize, usize);

/// How [`attend`] cuts the call into work items, fixed by the shapes before the append, with the
/// buffers of their partial results.
struct Plan {
    blocks: Vec<QueryBlock>,
    splits: usize,
    /// Split `s` of block `x` is item `x · splits + s`.
    items: Vec<Item>,
    /// Rows per item's partials: heads × the most query rows of a block.
    rows: usize,
    /// Query rows the sequences cover (packed rows after them belong to none).
    covered: usize,
    /// Whether each item writes its final rows of `out` itself (see [`attend`]).
    direct: bool,
    /// The items' LSEs, `rows` each.
    part_lse: Vec<f32>,
    /// The items' partial rows (see [`ItemOut::Parts`]), `rows · d` each; empty where `direct`.
    part_out: Vec<f32>,
}

impl Plan {
    fn new(dp: &DecodeParams) -> Result<Plan> {
        let p = &dp.p;
        let d = p.head_dim;
        let m_rows = (rows_cap(d) / p.heads).max(1);
        // Query blocks: (b, i0, i1) and the keys their rows see (the union: both ends of a row's
        // window grow with i, see `crate::blocks`).
        let mut blocks = Vec::new();
        for (b, s) in p.seqs.iter().enumerate() {
            let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
            for i0 in (0..s.seqlen_q).step_by(m_rows) {
                let i1 = (i0 + m_rows).min(s.seqlen_q);
                // Keys before `cache_leftpad[b]` are hidden: the masks count from there, which
                // only removes keys (their bounds are relative to the last key), so the range
                // starts later.
                let (lo, hi) = (
                    mask.key_range(i0).0.max(dp.leftpad[b]),
                    mask.key_range(i1 - 1).1,
                );
                blocks.push((b, i0, i1, lo, hi.max(lo)));
            }
        }
        let max_keys = blocks.iter().map(|x| x.4 - x.3).max().unwrap_or(0);
        let splits = dp
            .num_splits
            .unwrap_or_else(|| choose_splits(blocks.len(), max_keys, rayon::current_num_threads()));
        let items = try_collect(
            "the work items",
            (0..blocks.len() * splits).map(|x| {
                let ((b, i0, i1, lo, hi), s) = (blocks[x / splits], x % splits);
                let chunk = (hi - lo).div_ceil(splits);
                Item {
                    b,
                    i0,
                    i1,
                    n_lo: (lo + s * chunk).min(hi),
                    n_hi: (lo + (s + 1) * chunk).min(hi),
                }
            }),
        )?;
        let rows = p.heads * blocks.iter().map(|x| x.2 - x.1).max().unwrap_or(0);
        // One split (batches of sequences): item x is query block x, whose rows of `out`
        // follow those of block x - 1, so each item writes its final rows itself and nothing
        // is merged (the merge of one split copies it exactly, so the result is the same). The
        // serial merge and the f32 partials' round trip took 8-15% of a 64 × 128-key step (A/B
        // in one process, alternating, both orders, 2026-11-23: bf16 0.92 on one thread and
        // 0.83-0.87 on two, f32 0.84-0.85 on two; 64 × 512 keys 0.96-0.975; 16 × 512 keys with
        // 4 tokens 0.90-0.91).
        let covered: usize = p.seqs.iter().map(|s| s.seqlen_q).sum();
        let direct = splits == 1 && {
            let mut at = 0;
            blocks.iter().all(|&(b, i0, i1, _, _)| {
                let ok = p.out_offset(b, i0, 0) == at;
                at += (i1 - i0) * p.heads * d;
                ok
            }) && at == covered * p.heads * d
        };
        // Each item's rows (see `ItemOut`) and LSEs go to buffers shared by all items, not one
        // per item: results allocated by the workers and held until the merge grew their heaps
        // by ~16 KiB an item, the allocator gave that memory back after each call, and the next
        // call page-faulted it in again (68 faults a call at 64 sequences × 512 keys, none now).
        // Two binaries alternated, bf16, 2026-11-23: 64 sequences × 128 keys 3.39-3.66 ->
        // 2.68-2.94 ms on one thread, 1.49-1.73 -> 1.39-1.45 on two; × 512 keys ~4.96 -> ~4.73
        // (medians of six runs, two threads); one sequence of 32k keys unchanged.
        let part_lse = try_filled(
            "the split partials' LSEs",
            0f32,
            items.len().saturating_mul(rows),
        )?;
        let part_out = match direct {
            true => Vec::new(),
            false => try_filled(
                "the split partials",
                0f32,
                items.len().saturating_mul(rows).saturating_mul(d),
            )?,
        };
        Ok(Plan {
            blocks,
            splits,
            items,
            rows,
            covered,
            direct,
            part_lse,
            part_out,
        })
    }
}

/// `out` and `lse` of [`attend`] as the call's result tensors.
fn output<T: Element>(dp: &DecodeParams, (out, lse): (Vec<T>, Vec<f32>)) -> AttnOutput {
    AttnOutput {
        out: Tensor::new_unchecked(T::wrap_vec(out), dp.p.out_shape.clone()),
        lse: Tensor::new_unchecked(Buffer::F32(lse), dp.p.lse_shape.clone()),
    }
}

/// [`append`] into FP8 caches: each new row (the keys rotated in f32 first) is divided by its
/// (sequence, kv head) descale factor in f64 and rounded once to the format, saturating at its
/// largest finite value (CUDA's `__NV_SATFINITE`; NaN stays NaN).
fn append_fp8<T: Element>(
    dp: &DecodeParams,
    (kn, vn): (&[T], &[T]),
    (k, v): (&mut [u8], &mut [u8]),
    format: Fp8Format,
    (k_descale, v_descale): (&[f32], &[f32]),
) {
    let Some(nk) = &dp.new_kv else { return };
    let (p, cache) = (&dp.p, &dp.cache);
    let d = p.head_dim;
    let mut row = vec![0f32; d];
    let quantise = |row: &[f32], factor: f32, dst: &mut [u8]| {
        for (o, &x) in dst.iter_mut().zip(row) {
            *o = format.quantise(x as f64 / factor as f64);
        }
    };
    for (b, &len) in dp.cache_seqlens.iter().enumerate() {
        for t in 0..nk.lens[b] {
            let (k0, v0) = cache.key_offsets(b, len + t);
            for hk in 0..p.heads_kv {
                let factor = b * p.heads_kv + hk;
                let src = nk.k_base[b] + t * nk.k.row_stride + hk * nk.k.head_stride;
                T::widen(&kn[src..src + d], &mut row);
                if let Some(rot) = &dp.rotary {
                    rot.rotate(&mut row, b, t);
                }
                let dst = k0 + hk * cache.k.head_stride;
                quantise(&row, k_descale[factor], &mut k[dst..dst + d]);
                let src = nk.v_base[b] + t * nk.v.row_stride + hk * nk.v.head_stride;
                T::widen(&vn[src..src + d], &mut row);
                let dst = v0 + hk * cache.v.head_stride;
                quantise(&row, v_descale[factor], &mut v[dst..dst + d]);
            }
        }
    }
}

/// The caches an attention reads: in q's dtype, read in place; or FP8 bytes, widened (exactly)
/// to q's dtype a sub-block of keys at a time into a scratch tile that the same products read.
#[derive(Clone, Copy)]
enum Kv<'a, T> {
    Plain(&'a [T], &'a [T]),
    Fp8(&'a [u8], &'a [u8], Fp8Format),
}

/// Writes the new keys (rotated when the call has a rotary embedding, in f64, rounded once to the
/// cache's dtype) and values at positions `cache_seqlens[b]..` of each sequence. Sequential: it
/// moves `Σ seqlen_new · heads_kv · d` elements, a few KiB per decode step, and two batch
/// rows sharing a cache row or page then overwrite each other in batch order, never concurrently.
fn append<T: Element>(dp: &DecodeParams, kn: &[T], vn: &[T], k: &mut [T], v: &mut [T]) {
    let Some(nk) = &dp.new_kv else { return };
    let (p, cache) = (&dp.p, &dp.cache);
    let d = p.head_dim;
    let mut row = vec![0f32; d];
    for (b, &len) in dp.cache_seqlens.iter().enumerate() {
        for t in 0..nk.lens[b] {
            let (k0, v0) = cache.key_offsets(b, len + t);
            for hk in 0..p.heads_kv {
                let src = nk.k_base[b] + t * nk.k.row_stride + hk * nk.k.head_stride;
                let dst = k0 + hk * cache.k.head_stride;
                match &dp.rotary {
                    Some(rot) => {
                        T::widen(&kn[src..src + d], &mut row);
                        rot.rotate_to::<T>(&mut row, b, t);
                        T::narrow(&row, &mut k[dst..dst + d]);
                    }
                    None => k[dst..dst + d].copy_from_slice(&kn[src..src + d]),
                }
                let src = nk.v_base[b] + t * nk.v.row_stride + hk * nk.v.head_stride;
                let dst = v0 + hk * cache.v.head_stride;
                v[dst..dst + d].copy_from_slice(&vn[src..src + d]);
            }
        }
    }
}

/// One work item: sequence `b`, query positions `i0..i1` (all heads), keys `n_lo..n_hi`.
#[derive(Clone, Copy, Debug)]
struct Item {
    b: usize,
    i0: usize,
    i1: usize,
    n_lo: usize,
    n_hi: usize,
}

/// Attention of every sequence's queries over its first `seqlen_k` cache keys, into `out` (q's
/// dtype, `[batch, seqlen_q, heads, d]`) and `lse` (`[batch, heads, seqlen_q]`) from
/// [`results`], which it returns.
fn attend<T: Element>(
    dp: &DecodeParams,
    q: &[T],
    kv: Kv<T>,
    (mut out, mut lse, plan): (Vec<T>, Vec<f32>, Plan),
) -> (Vec<T>, Vec<f32>) {
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
        return (out, lse);
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
    (out, lse)
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

/// Where an item puts its rows: row `h · m + il` of query block `i0..i0 + m` (`m` positions of
/// every head) is query position `i0 + il` of head `h` (its LSE goes to `lse[h · m + il]` either
/// way).
enum ItemOut<'a, T> {
    /// A split's partial result: the row, normalised, in f32 at `[(h · m + il) · d..]`, to be
    /// merged through the LSEs.
    Parts(&'a mut [f32]),
    /// The final result (the only split): the row rounded to `T` at `[(il · heads + h) · d..]`,
    /// the block's rows of the call's output.
    Rows(&'a mut [T]),
}

/// The split-KV loop of one item over its keys, for all heads, writing the item's normalised
/// rows into `dst` (see [`ItemOut`]) and their LSEs into `lse`; `next`, the item after it, has its first
/// tile prefetched during this item's last. See the module docs.
fn run_item<T: Element>(
    dp: &DecodeParams,
    q: &[T],
    kv: Kv<T>,
    (it, next): (Item, Option<Item>),
    (mut dst, lse): (ItemOut<T>, &mut [f32]),
) {
    let (p, cache) = (&dp.p, &dp.cache);
    let kern: &Kernels = p.kernels;
    let Item {
        b,
        i0,
        i1,
        n_lo,
        n_hi,
    } = it;
    let seq = p.seqs[b];
    let (d, dpad) = (p.head_dim, pad_lanes(p.head_dim));
    let (heads_kv, group) = (p.heads_kv, p.heads / p.heads_kv);
    let m_rows = i1 - i0;
    // Row (h, i) of the item is h · m_rows + (i - i0): the rows of kv head hk are
    // hk · rows..(hk + 1) · rows. Every row of the item is a lane of the score tile (np lanes
    // per key), so one softmax step covers all heads.
    let rows = group * m_rows;
    let all_rows = heads_kv * rows;
    let np = pad_lanes(all_rows);
    let mask = Mask::new(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);

    // q in f32, rotated, rows of `dpad` (padding 0).
    let mut qf = buf(0f32, all_rows * dpad);
    let masked = p.window_left.is_some() || p.window_right.is_some();
    for h in 0..p.heads {
        for i in i0..i1 {
            let src = seq.q_base + i * p.q.row_stride + h * p.q.head_stride;
            let dst = &mut qf[(h * m_rows + i - i0) * dpad..][..d];
            T::widen(&q[src..src + d], dst);
            if let Some(rot) = &dp.rotary {
                // flash-attn's rule: with a causal or windowed mask query i sits at position
                // cache_seqlens[b] + i; without one, every query sits at cache_seqlens[b]. The
                // rotated q is rounded to q's dtype, as flash-attn hands it over.
                rot.rotate_to::<T>(dst, b, if masked { i } else { 0 });
            }
        }
    }
    // bf16 with `vdpbf16ps`: q also as bf16 pairs (exact: q is bf16, rotated or not), rows of
    // dpad / 2 pairs.
    let qb: Option<Buf<u32>> = (T::DTYPE == DType::BF16 && kern.has_bf16_dot()).then(|| {
        let pair = |a: bf16, b: bf16| a.to_bits() as u32 | (b.to_bits() as u32) << 16;
        match T::wrap(q) {
            // Unrotated bf16 q: its own bits, as rounding its f32 widening would give back
            // (~7% of a 64 × 128-key bf16 step when rounded element by element).
            Slice::BF16(qs) if dp.rotary.is_none() => {
                let mut qb = buf(0u32, all_rows * dpad / 2);
                for h in 0..p.heads {
                    for i in i0..i1 {
                        let src = &qs[seq.q_base + i * p.q.row_stride + h * p.q.head_stride..][..d];
                        let dst = &mut qb[(h * m_rows + i - i0) * dpad / 2..][..d.div_ceil(2)];
                        let pairs = src.chunks_exact(2);
                        if let [last] = pairs.remainder() {
                            dst[d / 2] = pair(*last, bf16::ZERO);
                        }
                        for (o, x) in dst.iter_mut().zip(pairs) {
                            *o = pair(x[0], x[1]);
                        }
                    }
                }
                qb
            }
            _ => buf_from(
                qf.chunks_exact(2)
                    .map(|x| pair(bf16::from_f32(x[0]), bf16::from_f32(x[1]))),
            ),
        }
    });
    // Many rows per kv head (MQA, several tokens per step) on AVX-512: q also transposed, for
    // the outer-product score kernel; bf16 keys on AVX2: q in even-odd order.
    let bf16_keys = T::DTYPE == DType::BF16;
    let qt = QTrans::for_item(
        kern.isa,
        &qf,
        (qb.as_deref(), bf16_keys),
        (heads_kv, rows, d, dpad),
    );
    let mut acc = buf(0f32, all_rows * dpad);
    let mut row_max = vec![f32::NEG_INFINITY; np];
    let mut row_sum = vec![0f32; np];
    let (mut alpha, mut m_sub) = (vec![0f32; np], vec![0f32; np]);
    // Lanes all_rows..np are never written by the products; zero here, they stay finite through
    // the softmax and are never read back.
    let mut st = buf(0f32, TILE_KEYS_MAX * np);
    // bf16 with `vdpbf16ps`: P as bf16 pairs of keys for the P·V product.
    let mut pp: Option<Buf<u32>> = qb
        .is_some()
        .then(|| buf(0u32, TILE_KEYS_MAX.div_ceil(2) * np));
    let mods: Vec<ScoreMod> = (0..p.heads).map(|h| ScoreMod::new(p, b, h)).collect();
    // One score scale for all heads, unless FP8 k descale factors differ between kv heads: then
    // each head's rows are scaled by `ScoreMod::apply`.
    let one_scale = mods.iter().all(|m| m.scale_log2 == mods[0].scale_log2);
    // The tile after n0: keys n0..n1, cut at the split's end; the rows' offsets (kv head 0) in
    // k and v, which may lie on several pages.
    // Sub-blocks only where one register block holds a kv head's query rows (one token per
    // step): with more rows the products do several times the arithmetic per byte read, and the
    // sub-blocks' extra passes over the accumulators cost more than the reads gain (see
    // SUB_BLOCK_BYTES); those shapes take longer tiles whole instead.
    let (tile_keys, sub) = if rows <= 4 {
        (
            TILE_KEYS,
            sub_block_keys(heads_kv * d * std::mem::size_of::<T>()),
        )
    } else {
        (TILE_KEYS_MANY_ROWS, TILE_KEYS_MANY_ROWS)
    };
    let tile = |n0: usize, kt: &mut [usize; TILE_KEYS_MAX], vt: &mut [usize; TILE_KEYS_MAX]| {
        let n1 = n_hi.min(n0 + tile_keys);
        cache.key_offsets_run(b, n0, &mut kt[..n1 - n0], &mut vt[..n1 - n0]);
        n1
    };
    let (mut kt, mut vt) = ([0usize; TILE_KEYS_MAX], [0usize; TILE_KEYS_MAX]);
    let (mut kt_next, mut vt_next) = ([0usize; TILE_KEYS_MAX], [0usize; TILE_KEYS_MAX]);
    // Refilled in place per tile (its run buffers are a few KiB).
    let mut ahead = Ahead::none();
    // FP8 caches: the sub-block being multiplied, widened to q's dtype (see `Kv`), as rows
    // [key][kv head][d]; `scratch_rows` names them (kv head 0) for the products.
    let span = heads_kv * d;
    let mut scratch: Vec<T> = match kv {
        Kv::Fp8(..) => vec![T::default(); TILE_KEYS_MAX * span],
        Kv::Plain(..) => Vec::new(),
    };
    let scratch_keys: [usize; TILE_KEYS_MAX] = std::array::from_fn(|c| c * span);
    let scratch_rows = KeyRows::new(&scratch_keys, 0, d);

    // The query rows of kv head hk (the same for every tile).
    let q_rows = |hk: usize| QRows {
        f32: &qf[hk * rows * dpad..(hk + 1) * rows * dpad],
        bf16_pairs: qb
            .as_ref()
            .map(|qb| &qb[hk * rows * dpad / 2..(hk + 1) * rows * dpad / 2]),
        rows,
        dpad,
        t: qt.as_ref().map(|t| t.group(hk)),
    };

    let mut n0 = n_lo;
    let mut n1 = tile(n0, &mut kt, &mut vt);
    while n0 < n_hi {
        let cols = n1 - n0;
        // The rows of kv head hk for the tile's keys c0..c1.
        let (kt_rows, vt_rows) = (
            KeyRows::new(&kt[..cols], 0, d),
            KeyRows::new(&vt[..cols], 0, d),
        );
        let k_rows =
            |hk: usize, c0: usize, c1: usize| kt_rows.sub(c0, c1, hk * cache.k.head_stride);
        let v_rows =
            |hk: usize, c0: usize, c1: usize| vt_rows.sub(c0, c1, hk * cache.v.head_stride);
        // The next tile is fetched while this one computes: a few cache lines per key of both
        // products (see `Ahead`).
        // After the last tile: the first tile of the next item, which this thread most often
        // takes next (rayon hands out consecutive items); 64 sequences × 128 keys bf16 0.92-0.93
        // on one thread, 0.93-0.94 on two, × 512 keys 0.96-0.98, f32 0.94; one 32k-key
        // sequence unchanged (A/B in one process, alternating, both orders, 2026-11-23).
        let (n2, pf) = if n1 < n_hi {
            let n2 = tile(n1, &mut kt_next, &mut vt_next);
            (n2, n2 - n1)
        } else if let Some(nx) = next {
            let m = (nx.n_hi - nx.n_lo).min(TILE_KEYS);
            cache.key_offsets_run(nx.b, nx.n_lo, &mut kt_next[..m], &mut vt_next[..m]);
            (n1, m)
        } else {
            (n1, 0)
        };
        let steps = 2 * heads_kv * cols;
        match kv {
            Kv::Plain(k, v) => ahead.set(
                (k, &kt_next[..pf], cache.k),
                (v, &vt_next[..pf], cache.v),
                (heads_kv, d),
                steps,
            ),
            Kv::Fp8(k, v, _) => ahead.set(
                (k, &kt_next[..pf], cache.k),
                (v, &vt_next[..pf], cache.v),
                (heads_kv, d),
                steps,
            ),
        }
        let masked = mask.needs_mask(i0, i1, n0, n1);
        let apply = !one_scale || mods[0].needs_apply(masked);
        let st = &mut st[..cols * np];
        for c0 in (0..cols).step_by(sub) {
            let c1 = cols.min(c0 + sub);
            if let Kv::Fp8(k, _, format) = kv {
                let src = (k, &kt[c0..c1], cache.k);
                widen_keys(kern.isa, format, src, (heads_kv, d), &mut scratch);
            }
            for hk in 0..heads_kv {
                let st = &mut st[c0 * np + hk * rows..];
                let (src, kr) = match kv {
                    Kv::Plain(k, _) => (k, k_rows(hk, c0, c1)),
                    Kv::Fp8(..) => (&scratch[..], scratch_rows.sub(0, c1 - c0, hk * d)),
                };
                scores(kern.isa, q_rows(hk), src, kr, st, np, &mut ahead);
            }
        }
        if apply {
            for hk in 0..heads_kv {
                for hl in 0..group {
                    mods[hk * group + hl].apply(
                        &mut st[hk * rows + hl * m_rows..],
                        np,
                        (i0, m_rows),
                        (n0, cols),
                        &mask,
                        masked,
                        None,
                    );
                }
            }
        }
        let scale = if apply { 1.0 } else { mods[0].scale_log2 };
        kern.max_get_scale(st, cols, np, scale, &mut row_max, &mut alpha, &mut m_sub);
        kern.online_softmax(st, cols, np, &m_sub, &mut row_sum, &alpha);
        // alpha is exactly 1 where a row's maximum did not move (as in the forward).
        for (acc_row, &a) in acc.chunks_exact_mut(dpad).zip(&alpha) {
            if a != 1.0 {
                acc_row.iter_mut().for_each(|x| *x *= a);
            }
        }
        if let Some(pp) = pp.as_mut() {
            kern.pack_pairs_bf16(st, cols, np, pp);
        }
        for c0 in (0..cols).step_by(sub) {
            let c1 = cols.min(c0 + sub);
            if let Kv::Fp8(_, v, format) = kv {
                let src = (v, &vt[c0..c1], cache.v);
                widen_keys(kern.isa, format, src, (heads_kv, d), &mut scratch);
            }
            for hk in 0..heads_kv {
                let acc_hk = &mut acc[hk * rows * dpad..(hk + 1) * rows * dpad];
                // c0 is even: a whole number of bf16 key pairs precedes it.
                let pr = PRows {
                    f32: &st[c0 * np + hk * rows..],
                    bf16_pairs: pp.as_ref().map(|pp| &pp[c0 / 2 * np + hk * rows..]),
                    rows,
                    np,
                };
                let (src, vr) = match kv {
                    Kv::Plain(_, v) => (v, v_rows(hk, c0, c1)),
                    Kv::Fp8(..) => (&scratch[..], scratch_rows.sub(0, c1 - c0, hk * d)),
                };
                pv_acc(kern.isa, pr, src, vr, acc_hk, dpad, &mut ahead);
            }
        }
        (n0, n1) = (n1, n2);
        (kt, vt) = (kt_next, vt_next);
    }

    for row in 0..all_rows {
        let acc_row = &mut acc[row * dpad..row * dpad + d];
        // FP8 caches: v's descale factor (1 otherwise).
        let out_scale = p.out_descale(b, row / m_rows);
        lse[row] = finalize(acc_row, row_max[row], row_sum[row], out_scale);
        match &mut dst {
            // A split's partial: the sink joins after the merge (see `attend`).
            ItemOut::Parts(out) => out[row * d..(row + 1) * d].copy_from_slice(acc_row),
            // The item covers all of its rows' keys: the sink joins here.
            ItemOut::Rows(out) => {
                let (h, il) = (row / m_rows, row % m_rows);
                if let Some(s) = &p.sink {
                    lse[row] = fold_sink(acc_row, lse[row], s[h]);
                }
                T::narrow(acc_row, &mut out[(il * p.heads + h) * d..][..d]);
            }
        }
    }
}

/// Widens the rows of all `heads_kv` kv heads of the keys at row offsets `keys` (kv head 0) in
/// the FP8 cache `src` (layout `l`) into `dst` as rows `[key][kv head][d]` from its start. Where a
/// key's heads lie together (flash-attn's `[.., seqlen, heads_kv, d]`), each run of consecutive
/// keys is one call: one per sub-block of a contiguous cache, one per page of a paged one.
fn widen_keys<T: Element>(
    isa: Isa,
    format: Fp8Format,
    (src, keys, l): (&[u8], &[usize], crate::params::RowLayout),
    (heads_kv, d): (usize, usize),
    dst: &mut [T],
) {
    let span = heads_kv * d;
    if heads_kv == 1 || l.head_stride == d {
        let mut c = 0;
        while c < keys.len() {
            let mut e = c + 1;
            while e < keys.len() && keys[e] == keys[e - 1] + span {
                e += 1;
            }
            let n = (e - c) * span;
            widen(
                isa,
                format,
                &src[keys[c]..keys[c] + n],
                &mut dst[c * span..c * span + n],
            );
            c = e;
        }
    } else {
        for (c, &k) in keys.iter().enumerate() {
            for hk in 0..heads_kv {
                let at = k + hk * l.head_stride;
                let o = c * span + hk * d;
                widen(isa, format, &src[at..at + d], &mut dst[o..o + d]);
            }
        }
    }
}

/// Where the rows of one kv head lie in a cache: key c's `d` values start at element
/// `keys[c] + head`, for `c < cols()`. `keys` holds the tile's row offsets (kv head 0), so a
/// tile may span pages of a paged cache. `last` is the largest offset of the tile the keys were
/// cut from (at least every offset in `keys`), found once per tile by [`KeyRows::new`] and kept
/// by [`KeyRows::sub`], so the products' bound check is O(1) per call. The maximum taken per
/// call instead (16 offsets, compiled to emulated 64-bit SSE2 compares in baseline x86-64 code)
/// cost 2.5-6% of the bf16 step (A/B in one process, 2026-11-23: 32k keys 0.94-0.98 on two
/// threads, 0.97 on one; 512 keys 0.96; f32 0.995).
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyRows<'a> {
    keys: &'a [usize],
    last: usize,
    head: usize,
    d: usize,
}

impl<'a> KeyRows<'a> {
    /// The rows of `d` values at `keys[c] + head`.
    pub fn new(keys: &'a [usize], head: usize, d: usize) -> Self {
        let last = keys.iter().copied().max().unwrap_or(0);
        KeyRows {
            keys,
            last,
            head,
            d,
        }
    }

    /// Keys `c0..c1` of the same rows, of kv head offset `head`.
    pub fn sub(&self, c0: usize, c1: usize, head: usize) -> Self {
        KeyRows {
            keys: &self.keys[c0..c1],
            head,
            ..*self
        }
    }

    /// The number of keys.
    #[inline(always)]
    pub fn cols(&self) -> usize {
        self.keys.len()
    }

    /// The element offset of key `c`'s row.
    #[inline(always)]
    pub fn at(&self, c: usize) -> usize {
        self.keys[c] + self.head
    }

    /// Panics unless every row lies inside `len` elements (once per call, so the kernels can
    /// read without checks).
    fn check(&self, len: usize) {
        // The row furthest in ends furthest in: one bound for all keys.
        let inside = self
            .last
            .checked_add(self.head)
            .and_then(|x| x.checked_add(self.d))
            .is_some_and(|e| e <= len);
        assert!(inside, "decode: key rows out of bounds");
    }
}

/// Most prefetch runs of one tile: one per key and kv head of 8 kv heads, enough for every
/// head-major page of a tile with up to 8 kv heads (the runs past it are not prefetched).
const RUNS_CAP: usize = 8 * TILE_KEYS_MAX;

/// Up to [`RUNS_CAP`] element ranges `[start, end)` of a cache, in order. Not `Copy`: 4 KiB,
/// refilled in place.
#[derive(Debug)]
pub(crate) struct Runs {
    r: [(usize, usize); RUNS_CAP],
    n: usize,
}

impl Default for Runs {
    fn default() -> Self {
        Runs {
            r: [(0, 0); RUNS_CAP],
            n: 0,
        }
    }
}

impl Runs {
    /// Adds `[start, end)`, merged into the last range when it starts inside or right after it;
    /// dropped when [`RUNS_CAP`] ranges are taken (a prefetch is only a hint).
    fn push(&mut self, start: usize, end: usize) {
        match self.r[..self.n].last_mut() {
            Some(r) if start >= r.0 && start <= r.1 => r.1 = r.1.max(end),
            _ if self.n < RUNS_CAP => {
                self.r[self.n] = (start, end);
                self.n += 1;
            }
            _ => {}
        }
    }

    /// Sets the ranges to those holding the rows of all kv heads of the keys with row offsets
    /// `keys` (kv head 0; at most [`TILE_KEYS_MAX`]), adjacent ranges merged. Where a key's rows of
    /// all heads lie together (at most twice their data apart, as in flash-attn's
    /// `[.., seqlen, heads_kv, d]`), one range per key: one run for a tile of a contiguous cache,
    /// one per page of a paged one. Otherwise (e.g. head-major `[.., heads_kv, seqlen, d]`) one
    /// range per head and key, head by head: one run per kv head for a contiguous cache.
    fn fill(&mut self, keys: &[usize], l: crate::params::RowLayout, heads_kv: usize, d: usize) {
        self.n = 0;
        let span = (heads_kv - 1) * l.head_stride + d;
        if span <= 2 * heads_kv * d {
            keys.iter().for_each(|&k| self.push(k, k + span));
        } else {
            for h in 0..heads_kv {
                let at = h * l.head_stride;
                keys.iter().for_each(|&k| self.push(k + at, k + at + d));
            }
        }
    }
}

/// Software prefetch of the next tile, spread evenly over the current one.
///
/// Hardware prefetchers follow demand reads, so without this a tile's keys are fetched only when
/// the products reach them and the core waits for memory between bursts of arithmetic: the
/// single-thread f32 step at 32k keys took 46 ms without, 37 ms with the next tile's lines asked
/// for in bursts of ~500 per kv head (the extra requests block loads once the miss buffers fill),
/// and 25 ms with a few lines asked for per key, so that memory and arithmetic overlap (a busy
/// machine; relative figures). Both products step it, so requests keep going out during P·V.
/// Two tiles ahead measured no better (see [`TILE_KEYS`]). Every line is asked for: every
/// second (leaving the other to the adjacent-line prefetcher) measured 12.8-16.1 ms against
/// 11.4-12.9 ms (f32, 2 threads). `prefetcht1` (into L2): a tile is 64-128 KiB, more than the
/// 32 KiB L1. k and v are asked for in turns of [`TURN_BYTES`].
pub(crate) struct Ahead {
    /// Byte addresses still to ask for in k and in v: runs `[i..n)`, the first from `next`;
    /// never dereferenced.
    k: Stream,
    v: Stream,
    lines_per_step: usize,
    /// Whose turn it is (v's when true), and the bytes left of it.
    on_v: bool,
    turn_left: usize,
}

/// Bytes of k's lines asked for before v's, and the other way round. Each step used to ask for
/// `lines_per_step` lines of each (turns of 256 bytes of f32 at the decode benchmark shape, 128 of bf16);
/// turns of 512 bytes took 0.91-0.97 of that time in f32 and 0.94-0.99 in bf16 (two threads, 32k
/// keys, six runs of `examples/decode_step` alternating the two, 2026-11-27, AVX-512 host);
/// turns of 1 KiB 0.95-0.99 / 0.94-1.00, 2 KiB 1.02-1.06 / 1.06-1.12, 4-64 KiB (64 KiB: k's whole
/// tile, then v's) 1.03-1.09. One thread: 0.94-1.02 / 0.92-0.96. With the cache in L3 (2048 f32
/// or 4096 bf16 keys, two threads) 512-byte turns took 1.02-1.06 of the time.
const TURN_BYTES: usize = 512;

#[derive(Default)]
struct Stream {
    runs: Runs,
    i: usize,
    next: usize,
}

impl Stream {
    /// Restarts on the byte addresses of the element runs of `keys` (see [`Runs::fill`]) in
    /// `buf`; returns their bytes.
    fn set<T>(
        &mut self,
        buf: &[T],
        keys: &[usize],
        l: crate::params::RowLayout,
        (heads_kv, d): (usize, usize),
    ) -> usize {
        let (base, size) = (buf.as_ptr() as usize, std::mem::size_of::<T>());
        self.runs.fill(keys, l, heads_kv, d);
        let mut bytes = 0;
        for r in &mut self.runs.r[..self.runs.n] {
            *r = (base + r.0 * size, base + r.1 * size);
            bytes += r.1 - r.0;
        }
        (self.i, self.next) = (0, self.runs.r[0].0);
        bytes
    }

    /// Whether every run has been asked for.
    #[inline(always)]
    fn done(&self) -> bool {
        self.i >= self.runs.n
    }

    /// Asks for up to `bytes` more bytes.
    #[inline(always)]
    fn step(&mut self, mut bytes: usize) {
        // Locals, written back once: the loop must not go through `self` per line (the first
        // version did, and took a fifth of the score product's time).
        let (mut i, mut next) = (self.i, self.next);
        while bytes > 0 && i < self.runs.n {
            let end = self.runs.r[i].1;
            let stop = end.min(next + bytes);
            bytes -= stop - next;
            // Four lines an iteration: the loop's own instructions were three of every four
            // (~6% of a bf16 step's instructions on AVX2).
            while next + 4 * CACHE_LINE <= stop {
                for l in 0..4 {
                    prefetch_line(next + l * CACHE_LINE);
                }
                next += 4 * CACHE_LINE;
            }
            while next < stop {
                prefetch_line(next);
                next += CACHE_LINE;
            }
            if next >= end {
                i += 1;
                if i < self.runs.n {
                    next = self.runs.r[i].0;
                }
            }
        }
        (self.i, self.next) = (i, next);
    }
}

impl Ahead {
    /// Nothing to ask for (until [`Ahead::set`]).
    pub fn none() -> Self {
        Ahead {
            k: Stream::default(),
            v: Stream::default(),
            lines_per_step: 0,
            on_v: true,
            turn_left: 0,
        }
    }

    /// Restarts on the rows of all `heads_kv` kv heads of the keys at row offsets `kk` in `k`
    /// and `vk` in `v`, asked for over `steps` calls of [`Ahead::step`].
    #[allow(clippy::type_complexity)]
    fn set<T>(
        &mut self,
        (k, kk, kl): (&[T], &[usize], crate::params::RowLayout),
        (v, vk, vl): (&[T], &[usize], crate::params::RowLayout),
        shape: (usize, usize),
        steps: usize,
    ) {
        let kb = self.k.set(k, kk, kl, shape);
        let vb = self.v.set(v, vk, vl, shape);
        self.lines_per_step = kb.max(vb).div_ceil(CACHE_LINE).div_ceil(steps.max(1));
        // k's turn first.
        (self.on_v, self.turn_left) = (true, 0);
    }

    /// Asks for the lines of k and of v that `steps` steps are due: as many bytes as
    /// `lines_per_step` lines of each, from k and v in turns of [`TURN_BYTES`] (all of them from
    /// one stream once the other has none left).
    #[inline(always)]
    pub fn step(&mut self, steps: usize) {
        let mut bytes = 2 * steps * self.lines_per_step * CACHE_LINE;
        while bytes > 0 {
            if self.turn_left == 0 {
                (self.on_v, self.turn_left) = (!self.on_v, TURN_BYTES);
            }
            let (this, other) = match self.on_v {
                true => (&mut self.v, &mut self.k),
                false => (&mut self.k, &mut self.v),
            };
            if this.done() {
                other.step(bytes);
                return;
            }
            let x = bytes.min(self.turn_left);
            this.step(x);
            bytes -= x;
            self.turn_left -= x;
        }
    }
}

/// Asks for the cache line at byte address `addr` (x86-64; a no-op elsewhere). A prefetch
/// cannot fault and reads nothing the program observes.
#[inline(always)]
fn prefetch_line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; the address is never dereferenced.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(addr as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

const CACHE_LINE: usize = 64;

/// The query rows of one kv group: `rows` rows of `dpad` f32 ([`LANES`]-padded with zeros), and
/// the same as bf16 pairs (`dpad / 2` u32 per row) when the bf16 dot product is to be used;
/// `t`, when given, the same rows transposed for [`scores_bcast_avx512`] or in blocks of 4
/// rows for [`scores_quad_avx512_bf16`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct QRows<'a> {
    pub f32: &'a [f32],
    pub bf16_pairs: Option<&'a [u32]>,
    pub rows: usize,
    pub dpad: usize,
    pub t: Option<QTrans<'a>>,
}

/// Query rows in the layout of an AVX-512 score kernel other than plain rows. `F32` and
/// `Pairs` are transposed, rows along the lanes: element `x · ld + r` is dim `x` of row `r`
/// (`F32`, `x < d`) or the bf16 pair of dims `2x, 2x + 1` (`Pairs`, `x < d / 2`, d even); `ld`
/// is `rows` rounded up to [`LANES`], the lanes past `rows` zero.
///
/// `Quads`: bf16 pairs in blocks of 4 rows for [`scores_quad_avx512_bf16`] (d a multiple of
/// 16): element `((b · d / 16 + s) · 2 + h) · 16 + 8u + t` is the pair of dims `16s + 2t,
/// 16s + 2t + 1` of row `4b + 2h + u`, so one vector holds 8 pairs of each of 2 rows (one per
/// 256-bit half); rows past `rows` zero.
///
/// `EvenOdd` (AVX2, bf16 keys): rows of `dpad` f32 with each whole 16-dim chunk stored even
/// dims first ([`avx2::even_odd`]), the order in which the AVX2 kernel widens bf16 pairs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum QTrans<'a> {
    F32 { qt: &'a [f32], ld: usize },
    Pairs { qt: &'a [u32], ld: usize },
    Quads { qt: &'a [u32] },
    EvenOdd { qt: &'a [f32] },
}

/// Fewest query rows per kv head for which bf16 scores take q in the `Quads` form
/// ([`scores_quad_avx512_bf16`]): with fewer, most of each vector's 4 rows would be empty (one
/// row per kv head keeps the dot-product kernel's 4-key reduction).
const QUAD_MIN_ROWS: usize = 4;

/// Fewest query rows per kv head for which the score product takes q transposed
/// ([`scores_bcast_avx512`]): one 16-lane vector of rows (f32, f16, bf16 widened), two for bf16
/// pairs. Fewer would leave lanes empty. Measured (A/B in one process, one thread, cache in
/// L2/L3, 2026-11-23): 16 rows (4 tokens, GQA 4) f32 0.945 of the dot-product kernel's time,
/// bf16 pairs 1.04; 32 rows (MQA) f32 0.90, bf16 0.94. Tiles of 8 or 16 keys for one or two
/// vectors of rows (more independent accumulators) were slower: 1.2-1.4.
fn bcast_min_rows(bf16_pairs: bool) -> usize {
    if bf16_pairs {
        2 * LANES
    } else {
        LANES
    }
}

impl QTrans<'_> {
    /// q in the form `isa`'s score kernel takes for this many rows per kv group, for all of an
    /// item's groups: transposed for the outer-product kernel from [`bcast_min_rows`] on (as
    /// bf16 pairs where [`QTrans::build`] makes them), in 4-row blocks of bf16 pairs for
    /// [`scores_quad_avx512_bf16`] from [`QUAD_MIN_ROWS`] on; on AVX2 with bf16 keys
    /// (`bf16_keys`), in even-odd order for any number of rows; `None` for plain rows.
    pub fn for_item(
        isa: Isa,
        q: &[f32],
        (qb, bf16_keys): (Option<&[u32]>, bool),
        shape @ (heads_kv, rows, d, dpad): (usize, usize, usize, usize),
    ) -> Option<QTransBuf> {
        let pairs = qb.is_some() && d.is_multiple_of(2);
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 && bf16_keys {
            return Some(QTransBuf::EvenOdd {
                t: avx2::even_odd(q, heads_kv * rows, d, dpad),
                stride: rows * dpad,
            });
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (bf16_keys, heads_kv, dpad);
        if isa != Isa::Avx512 {
            return None;
        }
        if rows >= bcast_min_rows(pairs) {
            return Some(Self::build(q, qb, shape));
        }
        qb.filter(|_| rows >= QUAD_MIN_ROWS && d.is_multiple_of(16))
            .map(|qb| Self::quads(qb, shape))
    }

    /// The `Quads` form of `rows` rows of bf16 pairs `qb` (`dpad / 2` each, kv head by kv head:
    /// `heads_kv` groups); d a multiple of 16.
    pub fn quads(qb: &[u32], (heads_kv, rows, d, dpad): (usize, usize, usize, usize)) -> QTransBuf {
        debug_assert!(d.is_multiple_of(16));
        let (blocks, steps) = (rows.div_ceil(4), d / 16);
        let stride = blocks * steps * 32;
        let mut t = buf(0u32, heads_kv * stride);
        for g in 0..heads_kv {
            for r in 0..rows {
                let row = &qb[(g * rows + r) * dpad / 2..][..d / 2];
                let (b, h, u) = (r / 4, r % 4 / 2, r % 2);
                for (s, eight) in row.chunks_exact(8).enumerate() {
                    let at = g * stride + ((b * steps + s) * 2 + h) * 16 + 8 * u;
                    t[at..at + 8].copy_from_slice(eight);
                }
            }
        }
        QTransBuf::Quads { t, stride }
    }

    /// Builds the transposed form of `rows` rows of `q` (`dpad` f32 each, kv head by kv head:
    /// `heads_kv` groups) or of their bf16 pairs `qb` (`dpad / 2` each) when given and `d` is
    /// even. Returns the buffer of all groups and a group's stride in it.
    pub fn build(
        q: &[f32],
        qb: Option<&[u32]>,
        (heads_kv, rows, d, dpad): (usize, usize, usize, usize),
    ) -> QTransBuf {
        let ld = rows.next_multiple_of(LANES);
        // Group g's row r, elements 0..n of its `w`-element row in `src`, to column r of the
        // group's n × ld block.
        fn transpose<E: Copy + Default>(
            src: &[E],
            (groups, rows, n, w, ld): (usize, usize, usize, usize, usize),
        ) -> Buf<E> {
            let mut t = buf(E::default(), groups * n * ld);
            for g in 0..groups {
                for r in 0..rows {
                    let row = &src[(g * rows + r) * w..][..n];
                    for (x, &v) in row.iter().enumerate() {
                        t[g * n * ld + x * ld + r] = v;
                    }
                }
            }
            t
        }
        match qb.filter(|_| d.is_multiple_of(2)) {
            Some(qb) => QTransBuf::Pairs {
                t: transpose(qb, (heads_kv, rows, d / 2, dpad / 2, ld)),
                ld,
                stride: d / 2 * ld,
            },
            None => QTransBuf::F32 {
                t: transpose(q, (heads_kv, rows, d, dpad, ld)),
                ld,
                stride: d * ld,
            },
        }
    }
}

/// The buffer behind [`QTrans`] for all kv groups of an item (`stride` elements a group).
pub(crate) enum QTransBuf {
    F32 {
        t: Buf<f32>,
        ld: usize,
        stride: usize,
    },
    Pairs {
        t: Buf<u32>,
        ld: usize,
        stride: usize,
    },
    Quads {
        t: Buf<u32>,
        stride: usize,
    },
    /// AVX2 only (x86-64).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    EvenOdd {
        t: Buf<f32>,
        stride: usize,
    },
}

impl QTransBuf {
    /// Group `g`'s rows in the buffer's form.
    pub fn group(&self, g: usize) -> QTrans<'_> {
        match self {
            QTransBuf::F32 { t, ld, stride } => QTrans::F32 {
                qt: &t[g * stride..(g + 1) * stride],
                ld: *ld,
            },
            QTransBuf::Pairs { t, ld, stride } => QTrans::Pairs {
                qt: &t[g * stride..(g + 1) * stride],
                ld: *ld,
            },
            QTransBuf::Quads { t, stride } => QTrans::Quads {
                qt: &t[g * stride..(g + 1) * stride],
            },
            QTransBuf::EvenOdd { t, stride } => QTrans::EvenOdd {
                qt: &t[g * stride..(g + 1) * stride],
            },
        }
    }
}

/// Scores of a few query rows against keys read in place from the cache, transposed:
/// `st[c · np + r] = Σ_x q[r][x] · k[c][x]` for `r < rows`, `c < kr.cols()`, with `k[c]` the row
/// of `src` that `kr` names, widened to f32 as it is loaded (or, for bf16 with `q.bf16_pairs` on
/// a CPU with AVX512_BF16, multiplied as bf16 pairs by `vdpbf16ps`). Lanes `rows..np` are not
/// written: `st` may be a window into a wider tile whose other lanes belong to other kv heads.
pub(crate) fn scores<T: Element>(
    isa: Isa,
    q: QRows,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    let QRows { rows, dpad, .. } = q;
    kr.check(src.len());
    assert!(
        dpad.is_multiple_of(LANES)
            && kr.d <= dpad
            && rows <= np
            && q.f32.len() >= rows * dpad
            && q.bf16_pairs.is_none_or(|b| b.len() >= rows * dpad / 2)
            && (kr.cols() == 0 || st.len() >= (kr.cols() - 1) * np + rows),
        "decode scores: operands too short"
    );
    if let Some(t) = q.t {
        let lanes = rows.next_multiple_of(LANES);
        let fits = match t {
            QTrans::F32 { qt, ld } => ld >= lanes && qt.len() >= kr.d * ld,
            QTrans::Pairs { qt, ld } => ld >= lanes && qt.len() >= kr.d / 2 * ld,
            QTrans::Quads { qt } => qt.len() >= rows.div_ceil(4) * (kr.d / 16) * 32,
            QTrans::EvenOdd { qt } => qt.len() >= rows * dpad,
        };
        assert!(fits, "decode scores: transposed q too short");
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        match q.t {
            Some(QTrans::F32 { qt, ld }) => {
                // SAFETY: AVX-512F present (the kernel table's ISA); bounds checked above.
                return unsafe { scores_bcast_avx512(qt, ld, rows, src, kr, st, np, ahead) };
            }
            Some(QTrans::Pairs { qt, ld }) if kr.d.is_multiple_of(2) => {
                if let (Some(k), true) = (bf16::unwrap(T::wrap(src)), isa.has_bf16_dot()) {
                    // SAFETY: AVX-512F and AVX512_BF16 present (checked); bounds checked above.
                    return unsafe { scores_bcast_avx512_bf16(qt, ld, rows, k, kr, st, np, ahead) };
                }
            }
            Some(QTrans::Quads { qt }) if kr.d.is_multiple_of(16) => {
                if let (Some(k), true) = (bf16::unwrap(T::wrap(src)), isa.has_bf16_dot()) {
                    // SAFETY: AVX-512F and AVX512_BF16 present (checked); bounds checked above.
                    return unsafe { scores_quad_avx512_bf16(qt, rows, k, kr, st, np, ahead) };
                }
            }
            _ => {}
        }
        if let (Some(pairs), Some(k)) = (q.bf16_pairs, bf16::unwrap(T::wrap(src))) {
            if isa.has_bf16_dot() {
                // SAFETY: AVX-512F and AVX512_BF16 present (checked); bounds checked above.
                return unsafe {
                    scores_avx512_bf16(q.f32, pairs, rows, dpad, k, kr, st, np, ahead)
                };
            }
        }
        // SAFETY: a kernel table of Isa::Avx512 exists only on a CPU with AVX-512F
        // (`Kernels::for_isa`); bounds checked above.
        return unsafe { scores_avx512(q.f32, rows, dpad, src, kr, st, np, ahead) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2::has_f16c() {
        // bf16 keys take q in even-odd order (`avx2::even_odd`), other dtypes as rows.
        let qf = match (q.t, T::DTYPE) {
            (Some(QTrans::EvenOdd { qt }), DType::BF16) => qt,
            (_, DType::BF16) => {
                return scores_portable(q.f32, rows, dpad, src, kr, st, np, ahead);
            }
            _ => q.f32,
        };
        // SAFETY: a kernel table of Isa::Avx2 exists only on a CPU with AVX2 and FMA, F16C
        // checked; bounds checked above.
        return unsafe { avx2::scores(qf, rows, dpad, src, kr, st, np, ahead) };
    }
    let _ = isa;
    scores_portable(q.f32, rows, dpad, src, kr, st, np, ahead);
}

/// Calls `$body` with `A`, `B` bound as constants to `$a`, `$b` (each 1-4; 4 for anything
/// larger, 1 for anything smaller): the dispatch from a runtime block shape to a kernel
/// instantiated for it. Callers whose blocks stay smaller (AVX2: 2 keys, 3 vectors; bf16 P·V: 2
/// chunks) also instantiate shapes they never run.
#[cfg(target_arch = "x86_64")]
macro_rules! by_tile {
    ($a:expr, $b:expr, |$A:ident, $B:ident| $body:expr) => {{
        macro_rules! with_b {
            ($av:literal) => {{
                const $A: usize = $av;
                match $b {
                    4.. => {
                        const $B: usize = 4;
                        $body
                    }
                    3 => {
                        const $B: usize = 3;
                        $body
                    }
                    2 => {
                        const $B: usize = 2;
                        $body
                    }
                    _ => {
                        const $B: usize = 1;
                        $body
                    }
                }
            }};
        }
        match $a {
            4.. => with_b!(4),
            3 => with_b!(3),
            2 => with_b!(2),
            _ => with_b!(1),
        }
    }};
}

/// The block walk of the score kernels: keys in blocks of up to `$keys` (stepping `ahead` once
/// per block), and within each, `$units` (query rows, or vectors of rows) in blocks of up to 4;
/// `$body` runs per block with its first key, first unit and the two sizes.
#[cfg(target_arch = "x86_64")]
macro_rules! score_blocks {
    (
        ($kr:expr, $keys:expr), $units:expr, $ahead:expr,
        |$c0:ident, $u0:ident, $kb:ident, $ub:ident| $body:block
    ) => {{
        let units = $units;
        let mut $c0 = 0;
        while $c0 < $kr.cols() {
            let $kb = ($kr.cols() - $c0).min($keys);
            $ahead.step($kb);
            let mut $u0 = 0;
            while $u0 < units {
                let $ub = (units - $u0).min(4);
                $body
                $u0 += $ub;
            }
            $c0 += $kb;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx2;

/// [`scores`] without intrinsics: one key row widened to f32, then 16 lane sums per query row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scores_portable<T: Element>(
    q: &[f32],
    rows: usize,
    dpad: usize,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    let mut krow = [0f32; MAX_D];
    let krow = &mut krow[..dpad];
    for c in 0..kr.cols() {
        ahead.step(1);
        let at = kr.at(c);
        widen_row(&src[at..at + kr.d], &mut krow[..kr.d]);
        for r in 0..rows {
            let qr = &q[r * dpad..(r + 1) * dpad];
            // 16 lane sums added pairwise: the AVX-512 kernel's order, roughly.
            let mut lanes = [0f32; LANES];
            for (qc, kc) in qr.chunks_exact(LANES).zip(krow.chunks_exact(LANES)) {
                for l in 0..LANES {
                    lanes[l] += qc[l] * kc[l];
                }
            }
            let mut n = LANES;
            while n > 1 {
                n /= 2;
                for l in 0..n {
                    lanes[l] += lanes[l + n];
                }
            }
            st[c * np + r] = lanes[0];
        }
    }
}

/// Probabilities of a few query rows for [`pv_acc`]: `f32[c · np + r]` for row `r < rows` and key
/// `c` (a window into a wider tile), and, when the bf16 dot product is to be used, the same as
/// bf16 pairs of keys: `bf16_pairs[cp · np + r]` = (key 2cp, key 2cp + 1) of row r, as
/// [`Kernels::pack_pairs_bf16`] writes them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PRows<'a> {
    pub f32: &'a [f32],
    pub bf16_pairs: Option<&'a [u32]>,
    pub rows: usize,
    pub np: usize,
}

/// `acc[r · dpad + x] += Σ_c p[c][r] · v[c][x]` for `r < rows`, `x < vr.d`, with `v[c]` the row
/// of `src` that `vr` names, widened to f32 as it is loaded (or, for bf16 with `p.bf16_pairs` on
/// a CPU with AVX512_BF16, two keys at a time by `vdpbf16ps` against p rounded to bf16, as the
/// forward does). Steps `ahead` once per key.
pub(crate) fn pv_acc<T: Element>(
    isa: Isa,
    p: PRows,
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    ahead: &mut Ahead,
) {
    let PRows { rows, np, .. } = p;
    vr.check(src.len());
    let cols = vr.cols();
    assert!(
        vr.d <= dpad
            && rows <= np
            && (cols == 0 || p.f32.len() >= (cols - 1) * np + rows)
            && p.bf16_pairs
                .is_none_or(|b| cols < 2 || b.len() >= (cols / 2 - 1) * np + rows)
            && acc.len() >= rows * dpad,
        "decode P·V: operands too short"
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        if let (Some(pairs), Some(v)) = (p.bf16_pairs, bf16::unwrap(T::wrap(src))) {
            if isa.has_bf16_dot() {
                // SAFETY: AVX-512F and AVX512_BF16 present (checked); bounds checked above.
                return unsafe { pv_avx512_bf16(p, pairs, v, vr, acc, dpad, ahead) };
            }
        }
        // SAFETY: as in `scores`.
        return unsafe { pv_avx512(p.f32, np, rows, src, vr, acc, dpad, 0, Some(ahead)) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2::has_f16c() {
        // SAFETY: a kernel table of Isa::Avx2 exists only on a CPU with AVX2 and FMA, F16C
        // checked; bounds checked above.
        return unsafe { avx2::pv(p.f32, np, rows, src, vr, acc, dpad, ahead) };
    }
    let _ = isa;
    pv_portable(p.f32, np, rows, src, vr, acc, dpad, ahead);
}

/// The tail of a P·V row block, element by element: `acc[r][x] += p[c][r] · v[c][x]` for rows
/// `r0..r0 + rb`, dims `from..d`, every key; `ahead` (if given: no vector tile stepped it) is
/// stepped once per key. Shared by the AVX2 and AVX-512 products, whose vector widths leave
/// `d % 8` and `d % 16` dims.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pv_tail<T: Element>(
    st: &[f32],
    np: usize,
    (r0, rb): (usize, usize),
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    from: usize,
    mut ahead: Option<&mut Ahead>,
) {
    if from >= vr.d && ahead.is_none() {
        return; // d a multiple of the vector width: nothing to add (the usual case)
    }
    for c in 0..vr.cols() {
        if let Some(a) = ahead.as_deref_mut() {
            a.step(1);
        }
        let row = &src[vr.at(c)..vr.at(c) + vr.d];
        for r in r0..r0 + rb {
            let p = st[c * np + r];
            let acc_r = &mut acc[r * dpad..r * dpad + vr.d];
            for (a, v) in acc_r[from..].iter_mut().zip(&row[from..]) {
                *a += p * v.to_f32();
            }
        }
    }
}

/// [`pv_acc`] without intrinsics: one v row widened to f32, then an axpy per query row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_portable<T: Element>(
    st: &[f32],
    np: usize,
    rows: usize,
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    ahead: &mut Ahead,
) {
    let mut vrow = [0f32; MAX_D];
    let vrow = &mut vrow[..vr.d];
    for c in 0..vr.cols() {
        ahead.step(1);
        let at = vr.at(c);
        widen_row(&src[at..at + vr.d], vrow);
        for r in 0..rows {
            let p = st[c * np + r];
            for (a, &x) in acc[r * dpad..r * dpad + vr.d].iter_mut().zip(vrow.iter()) {
                *a += p * x;
            }
        }
    }
}

/// One row to f32, portable: bf16 by a shift (exact; `half`'s slice conversion also quietens
/// NaNs and measured ~4× slower than the whole decode step's budget), f16 and f32 as `half`
/// and `copy_from_slice` do it.
#[inline]
fn widen_row<T: Element>(src: &[T], dst: &mut [f32]) {
    match bf16::unwrap(T::wrap(src)) {
        Some(b) => {
            for (o, x) in dst.iter_mut().zip(b) {
                *o = f32::from_bits((x.to_bits() as u32) << 16);
            }
        }
        None => T::widen(src, dst),
    }
}

/// 16 elements at `p` as f32: a load (f32), `vcvtph2ps` (f16), or zero-extension and a shift
/// into the high half (bf16, exact).
///
/// # Safety
/// AVX-512F present; 16 elements readable at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load16<T: Element>(p: *const T) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm512_loadu_ps(p.cast::<f32>()),
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
        }
    }
}

/// Writes a `K` keys × `R` rows block of scores: `out[j · np + i]` = the lane sum of `acc[j][i]`
/// plus `q[i][x] · k[j][x]` over the tail dims `from..d`, element by element (q row i at
/// `qp + i · dpad`, k row j at `kp[j]`). A full 4 × 4 block is reduced by [`reduce16`], 4 keys of
/// one row by [`reduce4`]. A macro, not a function: the accumulators must stay in registers, and
/// a `#[target_feature]` function cannot be forced inline (the first version, a function, was
/// not inlined and took 12% of the decode step, the accumulators passed through memory).
/// Expands inside an `unsafe` block of an AVX-512F function with `K`, `R` in scope.
#[cfg(target_arch = "x86_64")]
macro_rules! store_scores {
    ($acc:expr, ($qp:expr, $dpad:expr), $kp:expr, ($from:expr, $d:expr), ($out:expr, $np:expr)) => {{
        use std::arch::x86_64::*;
        let (acc, qp, dpad, kp, from, d, out, np) = (&$acc, $qp, $dpad, &$kp, $from, $d, $out, $np);
        let flat = acc.as_flattened();
        // sums[j][i]: key j, row i (row-major, so lane 4j + i of reduce16's result).
        let mut sums = [[0f32; 4]; 4];
        if K == 4 && R == 4 {
            _mm512_storeu_ps(sums.as_mut_ptr().cast(), reduce16(flat));
        } else if K == 4 && R == 1 {
            let mut s = [0f32; 4];
            _mm_storeu_ps(
                s.as_mut_ptr(),
                reduce4([flat[0], flat[1], flat[2], flat[3]]),
            );
            (0..4).for_each(|j| sums[j][0] = s[j]);
        } else if R == 4 {
            for (j, aj) in flat.chunks_exact(4).enumerate() {
                _mm_storeu_ps(sums[j].as_mut_ptr(), reduce4([aj[0], aj[1], aj[2], aj[3]]));
            }
        } else {
            for (j, aj) in acc.iter().enumerate() {
                for (s, a) in sums[j].iter_mut().zip(aj) {
                    *s = _mm512_reduce_add_ps(*a);
                }
            }
        }
        for (j, (sj, kj)) in sums.iter().zip(kp.iter()).enumerate() {
            for (i, &s) in sj.iter().take(R).enumerate() {
                let mut s = s;
                for x in from..d {
                    s += *qp.add(i * dpad + x) * (*kj.add(x)).to_f32();
                }
                *out.add(j * np + i) = s;
            }
        }
    }};
}

/// [`scores`] in AVX-512, register-blocked: 4 keys × 4 query rows = 16 zmm accumulators, + 4
/// zmm of q and 1 of k per 16 dims (21 of 32 registers). Per 16 dims: 8 loads for 16 FMAs, so
/// the loop is bound by the FMA unit (one 512-bit FMA per cycle on Zen 4), not by loads; the
/// first version (one key × 4 rows, q re-read per key) issued 5 loads per 4 FMAs and took twice
/// as long as the P·V product of the same size. Then one horizontal sum per score ([`reduce4`]
/// for 4 rows at once); the `d % 16` tail of a row element by element.
///
/// # Safety
/// AVX-512F present; operands as checked by [`scores`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_avx512<T: Element>(
    q: &[f32],
    rows: usize,
    dpad: usize,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every block stays inside rows × cols.
    score_blocks!((kr, 4), rows, ahead, |c0, r0, kb, rb| {
        let at = (q, r0, dpad, src, kr, c0, &mut *st, np);
        by_tile!(kb, rb, |A, B| unsafe { scores_tile::<A, B, T>(at) });
    });
}

/// Operands of one [`scores_tile`]: q, its first row, dpad, the cache, its rows, the first key,
/// st, np.
#[cfg(target_arch = "x86_64")]
type ScoresAt<'a, T> = (
    &'a [f32],
    usize,
    usize,
    &'a [T],
    KeyRows<'a>,
    usize,
    &'a mut [f32],
    usize,
);

/// Keys `c0..c0 + K` × rows `r0..r0 + R` of [`scores_avx512`].
///
/// # Safety
/// As [`scores_avx512`]; `c0 + K <= cols`, `r0 + R <= rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_tile<const K: usize, const R: usize, T: Element>(at: ScoresAt<T>) {
    use std::arch::x86_64::*;
    let (q, r0, dpad, src, kr, c0, st, np) = at;
    let full = kr.d / LANES * LANES;
    // SAFETY: the caller's contract.
    unsafe {
        let qp = q.as_ptr().add(r0 * dpad);
        let kp: [*const T; K] = std::array::from_fn(|j| src.as_ptr().add(kr.at(c0 + j)));
        let mut acc = [[_mm512_setzero_ps(); R]; K];
        for x in (0..full).step_by(LANES) {
            let qv: [__m512; R] = std::array::from_fn(|i| _mm512_loadu_ps(qp.add(i * dpad + x)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let kv = load16(kp[j].add(x));
                for (a, qi) in aj.iter_mut().zip(&qv) {
                    *a = _mm512_fmadd_ps(*qi, kv, *a);
                }
            }
        }
        let out = st.as_mut_ptr().add(c0 * np + r0);
        store_scores!(acc, (qp, dpad), kp, (full, kr.d), (out, np));
    }
}

/// [`scores_avx512`] for bf16 with `vdpbf16ps`: each k row is read as it lies, 32 bf16 (16 pairs)
/// per load, against q as bf16 pairs; one instruction does 32 multiply-adds where the widening
/// path needs a load, two conversion instructions and two FMAs. Same 4 keys × 4 rows blocking;
/// a remaining 16 dims (d % 32 >= 16) go through the f32 path, the last d % 16 element by element.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`scores`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_avx512_bf16(
    q: &[f32],
    qb: &[u32],
    rows: usize,
    dpad: usize,
    src: &[bf16],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every block stays inside rows × cols.
    score_blocks!((kr, 4), rows, ahead, |c0, r0, kb, rb| {
        let at = (q, r0, dpad, src, kr, c0, &mut *st, np);
        by_tile!(kb, rb, |A, B| unsafe { scores_tile_bf16::<A, B>(at, qb) });
    });
}

/// Keys `c0..c0 + K` × rows `r0..r0 + R` of [`scores_avx512_bf16`].
///
/// # Safety
/// As [`scores_avx512_bf16`]; `c0 + K <= cols`, `r0 + R <= rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn scores_tile_bf16<const K: usize, const R: usize>(at: ScoresAt<bf16>, qb: &[u32]) {
    use std::arch::x86_64::{
        __m512, __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
        _mm512_loadu_si512, _mm512_setzero_ps,
    };
    let (q, r0, dpad, src, kr, c0, st, np) = at;
    let (full32, full16) = (kr.d / 32 * 32, kr.d / LANES * LANES);
    // SAFETY: the caller's contract; q pairs of row r cover dims 0..dpad, k rows 0..d.
    unsafe {
        let qp = q.as_ptr().add(r0 * dpad);
        let qbp = qb.as_ptr().add(r0 * dpad / 2);
        let kp: [*const bf16; K] = std::array::from_fn(|j| src.as_ptr().add(kr.at(c0 + j)));
        let mut acc = [[_mm512_setzero_ps(); R]; K];
        for x in (0..full32).step_by(32) {
            let qv: [__m512bh; R] = std::array::from_fn(|i| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    qbp.add(i * dpad / 2 + x / 2).cast(),
                ))
            });
            for (j, aj) in acc.iter_mut().enumerate() {
                let kv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    kp[j].add(x).cast(),
                ));
                for (a, qi) in aj.iter_mut().zip(&qv) {
                    *a = _mm512_dpbf16_ps(*a, *qi, kv);
                }
            }
        }
        if full16 > full32 {
            let x = full32;
            let qv: [__m512; R] = std::array::from_fn(|i| _mm512_loadu_ps(qp.add(i * dpad + x)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let kv = load16(kp[j].add(x));
                for (a, qi) in aj.iter_mut().zip(&qv) {
                    *a = _mm512_fmadd_ps(*qi, kv, *a);
                }
            }
        }
        let out = st.as_mut_ptr().add(c0 * np + r0);
        store_scores!(acc, (qp, dpad), kp, (full16, kr.d), (out, np));
    }
}

/// [`scores`] in AVX-512 for a kv head with many query rows ([`bcast_min_rows`] or more: MQA,
/// several tokens per step): outer products, no horizontal sums. Each k element is broadcast
/// against a vector of 16 rows of q transposed (`qt[x · ld + r]`), in register tiles of 4 keys ×
/// 4 vectors (64 rows): 16 zmm accumulators, 4 of q, one broadcast; per dim 4 loads, 4
/// broadcasts and 16 FMAs. The dot-product blocks of [`scores_avx512`] spend a 45-instruction
/// reduction per 16 scores and reload q per 4 keys. Lanes past `rows` are not stored.
///
/// # Safety
/// AVX-512F present; operands as checked by [`scores`] (`qt` holds `kr.d` rows of `ld >=
/// rows` rounded up to 16 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_bcast_avx512<T: Element>(
    qt: &[f32],
    ld: usize,
    rows: usize,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every tile stays inside keys × rows.
    score_blocks!((kr, 4), rows.div_ceil(LANES), ahead, |c0, v0, kb, vb| {
        let at = (qt, ld, rows, src, kr, (c0, v0), &mut *st, np);
        by_tile!(kb, vb, |A, B| unsafe { scores_bcast_tile::<A, B, T>(at) });
    });
}

/// Stores a tile's accumulators (key `c0 + i`, rows of vector `v0 + j`) into `st` through
/// [`store_rows`].
///
/// # Safety
/// AVX-512F present; every stored key and vector inside `st` as [`store_rows`] requires.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile<const K: usize, const V: usize>(
    acc: &[[std::arch::x86_64::__m512; V]; K],
    st: &mut [f32],
    np: usize,
    (c0, v0): (usize, usize),
    rows: usize,
) {
    for (i, ai) in acc.iter().enumerate() {
        for (j, a) in ai.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { store_rows(*a, st, np, c0 + i, v0 + j, rows) };
        }
    }
}

/// Operands of one [`scores_bcast_tile`] (`P = f32`) or [`scores_bcast_tile_bf16`] (`P = u32`):
/// q transposed, its `ld`, rows, the cache, its rows, (first key, first vector of rows), st, np.
#[cfg(target_arch = "x86_64")]
type BcastAt<'a, P, T> = (
    &'a [P],
    usize,
    usize,
    &'a [T],
    KeyRows<'a>,
    (usize, usize),
    &'a mut [f32],
    usize,
);

/// Stores accumulator `a` (rows `16 · v..16 · v + 16` of key `c`) into `st`, lanes past `rows`
/// masked off.
///
/// # Safety
/// AVX-512F present; `c · np + min(rows, 16 · v + 16) <= st.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_rows(
    a: std::arch::x86_64::__m512,
    st: &mut [f32],
    np: usize,
    c: usize,
    v: usize,
    rows: usize,
) {
    use std::arch::x86_64::_mm512_mask_storeu_ps;
    let r = v * LANES;
    let n = (rows - r).min(LANES);
    let m = if n == LANES {
        u16::MAX
    } else {
        (1u16 << n) - 1
    };
    // SAFETY: the caller's contract; masked-off lanes are not written.
    unsafe { _mm512_mask_storeu_ps(st.as_mut_ptr().add(c * np + r), m, a) };
}

/// Keys `c0..c0 + K` × row vectors `v0..v0 + V` of [`scores_bcast_avx512`].
///
/// # Safety
/// As [`scores_bcast_avx512`]; `c0 + K <= cols`, `v0 + V <= rows.div_ceil(16)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_bcast_tile<const K: usize, const V: usize, T: Element>(at: BcastAt<f32, T>) {
    use std::arch::x86_64::*;
    let (qt, ld, rows, src, kr, (c0, v0), st, np) = at;
    // SAFETY: the caller's contract.
    unsafe {
        let kp: [*const T; K] = std::array::from_fn(|i| src.as_ptr().add(kr.at(c0 + i)));
        let qp = qt.as_ptr().add(v0 * LANES);
        let mut acc = [[_mm512_setzero_ps(); V]; K];
        for x in 0..kr.d {
            let qv: [__m512; V] =
                std::array::from_fn(|j| _mm512_loadu_ps(qp.add(x * ld + j * LANES)));
            for (ai, kpi) in acc.iter_mut().zip(&kp) {
                let kx = _mm512_set1_ps((*kpi.add(x)).to_f32());
                for (a, qj) in ai.iter_mut().zip(&qv) {
                    *a = _mm512_fmadd_ps(kx, *qj, *a);
                }
            }
        }
        store_tile(&acc, st, np, (c0, v0), rows);
    }
}

/// [`scores_bcast_avx512`] for bf16 with `vdpbf16ps`: the pair of k dims `2x, 2x + 1`
/// broadcast as one u32 against the rows' pairs (`qt[x · ld + r]`); d even.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`scores`] (`qt` holds `kr.d / 2`
/// rows of `ld`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_bcast_avx512_bf16(
    qt: &[u32],
    ld: usize,
    rows: usize,
    src: &[bf16],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every tile stays inside keys × rows.
    score_blocks!((kr, 4), rows.div_ceil(LANES), ahead, |c0, v0, kb, vb| {
        let at = (qt, ld, rows, src, kr, (c0, v0), &mut *st, np);
        by_tile!(kb, vb, |A, B| unsafe { scores_bcast_tile_bf16::<A, B>(at) });
    });
}

/// Keys `c0..c0 + K` × row vectors `v0..v0 + V` of [`scores_bcast_avx512_bf16`].
///
/// # Safety
/// As [`scores_bcast_avx512_bf16`]; `c0 + K <= cols`, `v0 + V <= rows.div_ceil(16)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn scores_bcast_tile_bf16<const K: usize, const V: usize>(at: BcastAt<u32, bf16>) {
    use std::arch::x86_64::*;
    let (qt, ld, rows, src, kr, (c0, v0), st, np) = at;
    let bh = |x: __m512i| std::mem::transmute::<__m512i, __m512bh>(x);
    // SAFETY: the caller's contract; a k pair is read unaligned (a row may start at an odd
    // element).
    unsafe {
        let kp: [*const half::bf16; K] = std::array::from_fn(|i| src.as_ptr().add(kr.at(c0 + i)));
        let qp = qt.as_ptr().add(v0 * LANES);
        let mut acc = [[_mm512_setzero_ps(); V]; K];
        for x in 0..kr.d / 2 {
            let qv: [__m512i; V] =
                std::array::from_fn(|j| _mm512_loadu_si512(qp.add(x * ld + j * LANES).cast()));
            for (ai, kpi) in acc.iter_mut().zip(&kp) {
                let pair = kpi.add(2 * x).cast::<i32>().read_unaligned();
                let kx = bh(_mm512_set1_epi32(pair));
                for (a, qj) in ai.iter_mut().zip(&qv) {
                    *a = _mm512_dpbf16_ps(*a, kx, bh(*qj));
                }
            }
        }
        store_tile(&acc, st, np, (c0, v0), rows);
    }
}

/// Keys per register block of [`scores_quad_avx512_bf16`]: 16 accumulators, two vectors of q
/// and the broadcasts of k.
#[cfg(target_arch = "x86_64")]
const QUAD_KEYS: usize = 8;

/// [`scores`] for bf16 with `vdpbf16ps` and a few query rows per kv head (GQA with
/// [`QUAD_MIN_ROWS`] rows or more, fewer than [`bcast_min_rows`]): q in the `Quads` form
/// ([`QTrans::quads`]), a vector holding 8 pairs of each of two rows; 16 dims of a k row (32
/// bytes) are broadcast to both 256-bit halves and multiply two such vectors (4 rows), so a
/// key's two accumulators hold its 4 scores as 8 partial sums each. 4 keys' accumulators then
/// reduce to their 16 scores with 21 instructions and one permute, where the dot-product blocks
/// of [`scores_avx512_bf16`] need 45 per 16 (scratch timing of the inner loops alone, data in
/// L1, 2026-11-23: both at ~1.05 cycles per `vdpbf16ps`; a 128-bit broadcast per
/// `vdpbf16ps` instead takes 1.4-1.65). d a multiple of 16. Against the dot-product kernel (A/B
/// in one process, the variants alternating call by call, both orders, bf16, 2026-11-23): the
/// decode benchmark shape (GQA 4, 32k keys, two threads) 0.96-0.99 in six runs; 4 tokens a step
/// (16 rows) and GQA 8 (8 rows) 0.94-0.96 when it runs second in each pair, 0.99 when first;
/// with the cache in L2/L3 (one thread) 0.98-1.02.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`scores`] (`qt` holds
/// `rows.div_ceil(4) · d / 16 · 32` pairs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn scores_quad_avx512_bf16(
    qt: &[u32],
    rows: usize,
    src: &[bf16],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    let blocks = rows.div_ceil(4);
    let mut c0 = 0;
    while c0 < kr.cols() {
        let kb = (kr.cols() - c0).min(QUAD_KEYS);
        ahead.step(kb);
        let mut b = 0;
        while b < blocks {
            // SAFETY: the caller's contract; keys c0..c0 + kb and rows 4b..min(4b + 8, rows)
            // lie inside kr and st.
            unsafe {
                // Two row blocks share each broadcast of k (4 keys at a time, 16 accumulators
                // still): 8-16 rows per kv head, one thread, 1024-2048 keys, 0.973-0.979 of the
                // time of one block per pass (A/B in one process, both orders, 2026-11-24).
                if b + 1 < blocks {
                    for h in (0..kb).step_by(QUAD_KEYS / 2) {
                        let kh = (kb - h).min(QUAD_KEYS / 2);
                        scores_quad_tile::<2, { QUAD_KEYS / 2 }>(
                            qt,
                            (rows, b),
                            src,
                            kr,
                            (c0 + h, kh),
                            st,
                            np,
                        );
                    }
                    b += 2;
                } else {
                    scores_quad_tile::<1, QUAD_KEYS>(qt, (rows, b), src, kr, (c0, kb), st, np);
                    b += 1;
                }
            }
        }
        c0 += kb;
    }
}

/// Keys `c0..c0 + kb` (`kb <= KEYS`) × the `NB` row blocks from `b` (rows `4b..4b + 4·NB`) of
/// [`scores_quad_avx512_bf16`]: `2·NB·KEYS` accumulators (16 for 1 × 8 and 2 × 4). Keys past
/// `kb` repeat the last one and are not stored; rows past `rows` are not stored.
///
/// # Safety
/// As [`scores_quad_avx512_bf16`]; `c0 + kb <= cols`, `4(b + NB - 1) < rows`, `KEYS` a multiple
/// of 4.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn scores_quad_tile<const NB: usize, const KEYS: usize>(
    qt: &[u32],
    (rows, b): (usize, usize),
    src: &[bf16],
    kr: KeyRows,
    (c0, kb): (usize, usize),
    st: &mut [f32],
    np: usize,
) {
    use std::arch::x86_64::*;
    let steps = kr.d / 16;
    let bh = |x: __m512i| std::mem::transmute::<__m512i, __m512bh>(x);
    // SAFETY: the caller's contract; each k read is 16 dims inside a row of d.
    unsafe {
        let kp: [*const half::bf16; KEYS] =
            std::array::from_fn(|j| src.as_ptr().add(kr.at(c0 + j.min(kb - 1))));
        let qp: [*const u32; NB] = std::array::from_fn(|n| qt.as_ptr().add((b + n) * steps * 32));
        let mut acc = [[[_mm512_setzero_ps(); 2]; NB]; KEYS];
        for s in 0..steps {
            let qv: [[__m512bh; 2]; NB] = std::array::from_fn(|n| {
                [
                    bh(_mm512_loadu_si512(qp[n].add(s * 32).cast())),
                    bh(_mm512_loadu_si512(qp[n].add(s * 32 + 16).cast())),
                ]
            });
            for (a, kpj) in acc.iter_mut().zip(&kp) {
                let kv = bh(_mm512_broadcast_i64x4(_mm256_loadu_si256(
                    kpj.add(16 * s).cast(),
                )));
                for (an, qn) in a.iter_mut().zip(&qv) {
                    an[0] = _mm512_dpbf16_ps(an[0], qn[0], kv);
                    an[1] = _mm512_dpbf16_ps(an[1], qn[1], kv);
                }
            }
        }
        // Per key: 128-bit lane i = 4 partial sums of row 4b + i.
        let by_row = |a: &[__m512; 2]| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a[0], a[1]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a[0], a[1]),
            )
        };
        for n in 0..NB {
            let bn = b + n;
            let nr = (rows - 4 * bn).min(4);
            for (g, a) in acc.chunks_exact(4).enumerate() {
                let s = quad_scores([
                    by_row(&a[0][n]),
                    by_row(&a[1][n]),
                    by_row(&a[2][n]),
                    by_row(&a[3][n]),
                ]);
                let at = st.as_mut_ptr().add((c0 + 4 * g) * np + 4 * bn);
                let mut x = [[0f32; 4]; 4];
                _mm512_storeu_ps(x.as_mut_ptr().cast(), s);
                for (j, xj) in x.iter().enumerate().take(kb.saturating_sub(4 * g)) {
                    if nr == 4 {
                        _mm_storeu_ps(at.add(j * np), _mm_loadu_ps(xj.as_ptr()));
                    } else {
                        (0..nr).for_each(|i| *at.add(j * np + i) = xj[i]);
                    }
                }
            }
        }
    }
}

/// The scores of 4 keys' quad accumulators (lane `i` of `a[j]`: 4 partial sums of row `i`,
/// key `j`), as lane `j`, element `i` of one vector: two in-lane transposing rounds (6
/// shuffles, 3 adds), then one permute from rows × keys to keys × rows.
///
/// # Safety
/// AVX-512F present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn quad_scores(a: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Per lane: [x0 + x2, y0 + y2, x1 + x3, y1 + y3].
    let mix =
        |x: __m512, y: __m512| _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    let (s01, s23) = (mix(a[0], a[1]), mix(a[2], a[3]));
    let pd = _mm512_castps_pd;
    // Per lane: [Σ a0, Σ a1, Σ a2, Σ a3] (row i's score of keys 0..4 in lane i).
    let s = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(pd(s01), pd(s23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(pd(s01), pd(s23))),
    );
    let keys_by_rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(keys_by_rows, s)
}

/// The lane sums of 16 vectors `a[4j + i]`, as lane `4j + i` of one vector: 256-bit halves
/// added pairwise (two keys at a time), then 128-bit quarters, then two in-lane rounds, 45
/// instructions where 16 separate reductions take ~140.
///
/// # Safety
/// AVX-512F present; `a.len() == 16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce16(a: &[std::arch::x86_64::__m512]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    debug_assert_eq!(a.len(), 16);
    // [x.q0 + x.q2, x.q1 + x.q3, y.q0 + y.q2, y.q1 + y.q3] (q: 128-bit quarters).
    let halves = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    };
    // t = [A0, A1, B0, B1], u = [C0, C1, D0, D1] -> [A0 + A1, B0 + B1, C0 + C1, D0 + D1].
    let quarters = |t: __m512, u: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(t, u),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(t, u),
        )
    };
    // Per 128-bit lane: [x0 + x1, x2 + x3, y0 + y1, y2 + y3].
    let pairs = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(x, y),
            _mm512_shuffle_ps::<0b11_01_11_01>(x, y),
        )
    };
    // w[i]: quarter j holds 4 partial sums of a[4j + i].
    let w: [__m512; 4] =
        std::array::from_fn(|i| quarters(halves(a[i], a[4 + i]), halves(a[8 + i], a[12 + i])));
    // Quarter j, lane i: Σ a[4j + i].
    pairs(pairs(w[0], w[1]), pairs(w[2], w[3]))
}

/// The horizontal sums of 4 vectors, `[Σ a[0], Σ a[1], Σ a[2], Σ a[3]]`: halves added, then
/// three `hadd`s and a final fold, ~19 instructions where four separate reductions take ~36.
///
/// # Safety
/// AVX-512F present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce4(a: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let half = |x: __m512| {
        _mm256_add_ps(
            _mm512_castps512_ps256(x),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))),
        )
    };
    let (b0, b1, b2, b3) = (half(a[0]), half(a[1]), half(a[2]), half(a[3]));
    // [b0 01, b0 23, b1 01, b1 23 | b0 45, b0 67, b1 45, b1 67], likewise for b2, b3, then
    // [Σ b0 0..4, Σ b1 0..4, Σ b2 0..4, Σ b3 0..4 | the same of lanes 4..8].
    let h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

/// [`pv_acc`] in AVX-512 from the 16-dim vector `x_start` on: tiles of up to 4 rows × 4 vectors
/// (64 dims) held in 16 zmm accumulators over all keys, + 4 zmm of v per key and a broadcast of
/// p: 21 of 32 registers (the budget of `simd::x86_avx512::gemm`). Per key: 4 loads (widened),
/// 4 broadcasts, 16 FMAs. The `d % 16` tail element by element. `ahead` (if given) is stepped
/// once per key, in the first tile.
///
/// # Safety
/// AVX-512F present; operands as checked by [`pv_acc`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_avx512<T: Element>(
    st: &[f32],
    np: usize,
    rows: usize,
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    x_start: usize,
    mut ahead: Option<&mut Ahead>,
) {
    let nv = vr.d / LANES;
    let mut r0 = 0;
    // SAFETY: the caller's contract; every tile below stays inside rows × d.
    unsafe {
        // Row blocks of up to 6 (`pv_row_block`; 6 × 4 vectors: 24 accumulators, each key's 4
        // loads of v feeding 24 FMAs). 4 tokens a step at GQA 4 (16 rows), f32, one thread,
        // 1024 keys: 0.955-0.964 of the time with blocks of 4; 2 tokens at GQA 8: 0.97; MQA
        // 0.98-0.99 (A/B in one process, both orders, 2026-11-24).
        let mut blk = 0;
        while r0 < rows {
            let rb = pv_row_block(rows, blk);
            blk += 1;
            let mut x0 = x_start;
            while x0 < nv {
                let xv = (nv - x0).min(4);
                match (rb, xv) {
                    (6, 4) => {
                        pv_tile::<6, 4, T>((st, np, r0, src, vr, x0, &mut *acc, dpad, ahead.take()))
                    }
                    (5, 4) => {
                        pv_tile::<5, 4, T>((st, np, r0, src, vr, x0, &mut *acc, dpad, ahead.take()))
                    }
                    _ => {
                        let mut r = r0;
                        while r < r0 + rb {
                            let h = (r0 + rb - r).min(4);
                            let at = (st, np, r, src, vr, x0, &mut *acc, dpad, ahead.take());
                            by_tile!(h, xv, |A, B| pv_tile::<A, B, T>(at));
                            r += h;
                        }
                    }
                }
                x0 += xv;
            }
            // The tail dims d - d % 16..d (and every key's step when there was no tile: d < 16).
            pv_tail(
                st,
                np,
                (r0, rb),
                src,
                vr,
                acc,
                dpad,
                nv * LANES,
                ahead.take(),
            );
            r0 += rb;
        }
    }
}

/// Rows of the `blk`-th register block of the P·V products over `rows` rows: all of them up to
/// 4, else balanced blocks of up to 6 (16 rows as 6, 5, 5; 32 as 6, 6, 5, 5, 5, 5), which the
/// callers run as 5- and 6-row tiles where the dims allow.
#[cfg(target_arch = "x86_64")]
fn pv_row_block(rows: usize, blk: usize) -> usize {
    if rows <= 4 {
        return rows;
    }
    let nb = rows.div_ceil(6);
    rows / nb + usize::from(blk < rows % nb)
}

/// Operands of one [`pv_tile`] (`P = f32`) or [`pv_tile_bf16`] (`P = u32`, p as bf16 pairs,
/// `T = bf16`): p, np, the first row, the cache, its rows, the first vector or chunk, acc,
/// dpad, and the prefetcher to step (first tile only).
#[cfg(target_arch = "x86_64")]
type PvAt<'a, P, T> = (
    &'a [P],
    usize,
    usize,
    &'a [T],
    KeyRows<'a>,
    usize,
    &'a mut [f32],
    usize,
    Option<&'a mut Ahead>,
);

/// Rows `r0..r0 + R`, vectors `x0..x0 + V` (dims `16·x0..16·(x0 + V)`) of [`pv_avx512`].
///
/// # Safety
/// As [`pv_avx512`]; `r0 + R <= rows`, `16 · (x0 + V) <= d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pv_tile<const R: usize, const V: usize, T: Element>(at: PvAt<f32, T>) {
    use std::arch::x86_64::*;
    let (st, np, r0, src, vr, x0, acc, dpad, mut ahead) = at;
    // SAFETY: the caller's contract.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); V]; R];
        let sp = st.as_ptr().add(r0);
        for c in 0..vr.cols() {
            if let Some(ah) = ahead.as_deref_mut() {
                ah.step(1);
            }
            let row = src.as_ptr().add(vr.at(c) + x0 * LANES);
            let mut vv = [_mm512_setzero_ps(); V];
            for (j, x) in vv.iter_mut().enumerate() {
                *x = load16(row.add(j * LANES));
            }
            let pc = sp.add(c * np);
            for (i, ai) in a.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*pc.add(i));
                for (x, vx) in ai.iter_mut().zip(&vv) {
                    *x = _mm512_fmadd_ps(p, *vx, *x);
                }
            }
        }
        let ap = acc.as_mut_ptr();
        for (i, ai) in a.iter().enumerate() {
            for (j, x) in ai.iter().enumerate() {
                let at = ap.add((r0 + i) * dpad + (x0 + j) * LANES);
                _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), *x));
            }
        }
    }
}

/// [`pv_acc`] for bf16 with `vdpbf16ps`: the dims in whole 32-dim chunks take keys two at a
/// time, their v rows interleaved in registers (`vpunpck{l,h}wd`: lane t of 128-bit lane L pairs
/// dim 8L + t of both keys, the high unpack dim 8L + 4 + t) against p as bf16 pairs, so one
/// instruction does 32 multiply-adds where the widening path needs two conversions and two FMAs
/// per 16; the accumulators stay in that permuted order over all keys and are put back in dim
/// order once per tile. An odd last key and the dims after the last whole chunk go through the
/// f32 path.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`pv_acc`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pv_avx512_bf16(
    p: PRows,
    pairs: &[u32],
    src: &[bf16],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    ahead: &mut Ahead,
) {
    let PRows { rows, np, .. } = p;
    let chunks = vr.d / 32;
    if chunks == 0 {
        // SAFETY: the caller's contract.
        return unsafe { pv_avx512(p.f32, np, rows, src, vr, acc, dpad, 0, Some(ahead)) };
    }
    let mut first = Some(ahead);
    // SAFETY: the caller's contract; every tile below stays inside rows × d.
    unsafe {
        // Row blocks of up to 6 (`pv_row_block`): each key pair's loads and unpacks of v feed
        // up to 24 `vdpbf16ps` instead of 16. 4 tokens a step at GQA 4 (16 rows), bf16, one
        // thread, 1024 keys: 0.95 of the time with blocks of 4 (A/B in one process, both
        // orders, 2026-11-24); MQA (32 rows) unchanged.
        let mut r0 = 0;
        let mut blk = 0;
        while r0 < rows {
            let rb = pv_row_block(rows, blk);
            let mut x0 = 0;
            while x0 < chunks {
                let xv = (chunks - x0).min(2);
                let at = (pairs, np, r0, src, vr, x0, &mut *acc, dpad, first.take());
                match (rb, xv) {
                    (6, 2) => pv_tile_bf16::<6, 2>(at),
                    (5, 2) => pv_tile_bf16::<5, 2>(at),
                    (6, _) => pv_tile_bf16::<6, 1>(at),
                    (5, _) => pv_tile_bf16::<5, 1>(at),
                    _ => by_tile!(rb, xv, |A, B| pv_tile_bf16::<A, B>(at)),
                }
                x0 += xv;
            }
            r0 += rb;
            blk += 1;
        }
        // An odd last key, dims 0..32 · chunks, in f32.
        if vr.cols() % 2 == 1 {
            use std::arch::x86_64::*;
            let c = vr.cols() - 1;
            let row = src.as_ptr().add(vr.at(c));
            for r in 0..rows {
                let pv = _mm512_set1_ps(*p.f32.as_ptr().add(c * np + r));
                let ar = acc.as_mut_ptr().add(r * dpad);
                for x in (0..32 * chunks).step_by(LANES) {
                    let y = _mm512_fmadd_ps(pv, load16(row.add(x)), _mm512_loadu_ps(ar.add(x)));
                    _mm512_storeu_ps(ar.add(x), y);
                }
            }
        }
        // Dims 32 · chunks..d.
        if 32 * chunks < vr.d {
            pv_avx512(p.f32, np, rows, src, vr, acc, dpad, 2 * chunks, None);
        }
    }
}

/// Rows `r0..r0 + R`, chunks `x0..x0 + V` (dims `32·x0..32·(x0 + V)`) of [`pv_avx512_bf16`],
/// keys `0..cols - cols % 2`: up to 6 × 2 × 2 = 24 zmm accumulators, 4 of interleaved v, a
/// broadcast p pair. Per key pair: 4 loads, 4 unpacks, R broadcasts, 4R `vdpbf16ps`.
///
/// # Safety
/// As [`pv_avx512_bf16`]; `r0 + R <= rows`, `32 · (x0 + V) <= d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn pv_tile_bf16<const R: usize, const V: usize>(at: PvAt<u32, bf16>) {
    use std::arch::x86_64::*;
    let (pairs, np, r0, src, vr, x0, acc, dpad, mut ahead) = at;
    let bh = |x: __m512i| std::mem::transmute::<__m512i, __m512bh>(x);
    // SAFETY: the caller's contract.
    unsafe {
        let mut lo = [[_mm512_setzero_ps(); V]; R];
        let mut hi = [[_mm512_setzero_ps(); V]; R];
        let pp = pairs.as_ptr().add(r0);
        for cp in 0..vr.cols() / 2 {
            if let Some(ah) = ahead.as_deref_mut() {
                ah.step(2);
            }
            let row0 = src.as_ptr().add(vr.at(2 * cp) + x0 * 32);
            let row1 = src.as_ptr().add(vr.at(2 * cp + 1) + x0 * 32);
            let mut vl = [_mm512_setzero_si512(); V];
            let mut vh = [_mm512_setzero_si512(); V];
            for j in 0..V {
                let a = _mm512_loadu_si512(row0.add(j * 32).cast());
                let b = _mm512_loadu_si512(row1.add(j * 32).cast());
                vl[j] = _mm512_unpacklo_epi16(a, b);
                vh[j] = _mm512_unpackhi_epi16(a, b);
            }
            let pc = pp.add(cp * np);
            for i in 0..R {
                let p = bh(_mm512_set1_epi32(*pc.add(i) as i32));
                for j in 0..V {
                    lo[i][j] = _mm512_dpbf16_ps(lo[i][j], p, bh(vl[j]));
                    hi[i][j] = _mm512_dpbf16_ps(hi[i][j], p, bh(vh[j]));
                }
            }
        }
        // Lane 4L + t of lo is dim 8L + t, of hi dim 8L + 4 + t: back to dim order.
        let first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        let second =
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        let ap = acc.as_mut_ptr();
        for i in 0..R {
            for j in 0..V {
                let at = ap.add((r0 + i) * dpad + (x0 + j) * 32);
                let d0 = _mm512_permutex2var_ps(lo[i][j], first, hi[i][j]);
                let d1 = _mm512_permutex2var_ps(lo[i][j], second, hi[i][j]);
                _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), d0));
                _mm512_storeu_ps(at.add(16), _mm512_add_ps(_mm512_loadu_ps(at.add(16)), d1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::lcg;

    /// Every ISA's scores and P·V kernels agree with f64 sums over edge sizes, in every dtype,
    /// reading rows in place at a stride (with NaN between rows, which must not be read).
    #[test]
    fn kernels_match_f64_on_every_isa() {
        use half::f16;
        let mut seed = 1u64;
        for isa in crate::cpu::simd::available() {
            for &(rows, cols, d) in &[
                (1, 1, 1),
                (4, 3, 16),
                (5, 17, 40),
                (13, 32, 128),
                (32, 2, 256),
                (7, 5, 59),
                (1, 9, 64),
                (4, 33, 128),
                (3, 11, 8),
                (12, 19, 256),
                (6, 21, 48),
                (3, 9, 32),
                (8, 6, 96),
                (16, 7, 128),
                (17, 5, 40),
                (64, 9, 64),
                (70, 6, 59),
            ] {
                let (dpad, np) = (pad_lanes(d), pad_lanes(rows));
                let stride = d + 3;
                let mut q = vec![0f32; rows * dpad];
                for r in 0..rows {
                    (0..d).for_each(|x| q[r * dpad + x] = lcg(&mut seed));
                }
                let mut kv = vec![f32::NAN; 2 + cols * stride];
                for c in 0..cols {
                    (0..d).for_each(|x| kv[2 + c * stride + x] = lcg(&mut seed));
                }
                let p: Vec<f32> = (0..cols * np).map(|_| lcg(&mut seed).abs()).collect();
                // Rows in reverse order, as pages of one key would lie in a shuffled paged
                // cache: the kernels must follow each key's own offset.
                let keys: Vec<usize> = (0..cols).map(|c| 2 + (cols - 1 - c) * stride).collect();
                let kr = KeyRows::new(&keys, 0, d);
                fn check<T: Element>(
                    isa: Isa,
                    (q, rows, dpad, np): (&[f32], usize, usize, usize),
                    kv: &[f32],
                    kr: KeyRows,
                    p: &[f32],
                ) {
                    let src: Vec<T> = kv.iter().map(|&x| T::from_f32(x)).collect();
                    let val = |c: usize, x: usize| src[kr.at(c) + x].to_f64();
                    let pairs: Vec<u32> = q
                        .chunks_exact(2)
                        .map(|x| {
                            bf16::from_f32(x[0]).to_bits() as u32
                                | (bf16::from_f32(x[1]).to_bits() as u32) << 16
                        })
                        .collect();
                    // bf16: q rounded to bf16 for the dot-product path; the tolerance covers it.
                    let bf = T::DTYPE == DType::BF16;
                    // Scores with q as rows, and transposed (f32, and bf16 pairs where the dtype
                    // has them): the outer-product kernels on AVX-512; other ISAs ignore it.
                    let qt = QTrans::build(q, None, (1, rows, kr.d, dpad));
                    let qtp = QTrans::build(q, bf.then_some(&pairs[..]), (1, rows, kr.d, dpad));
                    // and in 4-row blocks of bf16 pairs (d a multiple of 16).
                    let qtq = (bf && kr.d.is_multiple_of(16))
                        .then(|| QTrans::quads(&pairs, (1, rows, kr.d, dpad)));
                    let quads = qtq.as_ref().map(|b| b.group(0));
                    // and, for AVX2 with bf16 keys, in even-odd order (other ISAs ignore it;
                    // AVX2 takes the portable kernel for bf16 keys without it).
                    let qeo = QTrans::for_item(Isa::Avx2, q, (None, bf), (1, rows, kr.d, dpad));
                    let eo = qeo.as_ref().map(|b| b.group(0));
                    for t in [None, Some(qt.group(0)), Some(qtp.group(0)), quads, eo] {
                        let qr = QRows {
                            f32: q,
                            bf16_pairs: bf.then_some(&pairs[..]),
                            rows,
                            dpad,
                            t,
                        };
                        let mut st = vec![f32::NAN; kr.cols() * np];
                        scores(isa, qr, &src, kr, &mut st, np, &mut Ahead::none());
                        let what = format!(
                            "{isa:?} {} rows {rows} cols {} d {} q {}",
                            T::DTYPE,
                            kr.cols(),
                            kr.d,
                            match t {
                                None => "as rows",
                                Some(QTrans::F32 { .. }) => "transposed, f32",
                                Some(QTrans::Pairs { .. }) => "transposed, bf16 pairs",
                                Some(QTrans::Quads { .. }) => "bf16 pairs in blocks of 4 rows",
                                Some(QTrans::EvenOdd { .. }) => "even-odd order",
                            }
                        );
                        for c in 0..kr.cols() {
                            for r in 0..np {
                                let got = st[c * np + r] as f64;
                                if r >= rows {
                                    // Lanes past `rows` belong to other kv heads: untouched.
                                    assert!(got.is_nan(), "{what}: st[{c}][{r}] written");
                                    continue;
                                }
                                let want: f64 =
                                    (0..kr.d).map(|x| q[r * dpad + x] as f64 * val(c, x)).sum();
                                let tol = if bf {
                                    1e-2 * (kr.d as f64).sqrt()
                                } else {
                                    1e-5
                                };
                                assert!(
                                    (got - want).abs() <= tol * (1.0 + want.abs()),
                                    "{what}: st[{c}][{r}] = {got}, want {want}"
                                );
                            }
                        }
                    }
                    // bf16 on a CPU with the bf16 dot product: p as bf16 pairs, as the decode
                    // loop passes them; the f64 sums below round p the same way.
                    let dot = bf && isa.has_bf16_dot();
                    let mut pairs = vec![0u32; kr.cols().div_ceil(2) * np];
                    crate::cpu::simd::Kernels::for_isa(isa)
                        .unwrap()
                        .pack_pairs_bf16(p, kr.cols(), np, &mut pairs);
                    let pr = PRows {
                        f32: p,
                        bf16_pairs: dot.then_some(&pairs[..]),
                        rows,
                        np,
                    };
                    let mut acc = vec![0.5f32; rows * dpad];
                    pv_acc(isa, pr, &src, kr, &mut acc, dpad, &mut Ahead::none());
                    // p as the kernel multiplies it: rounded to bf16 on the pair path, except
                    // an odd last key, which takes the f32 path.
                    let p_used = |c: usize, r: usize| {
                        let x = p[c * np + r];
                        if dot && kr.d >= 32 && (c + 1 < kr.cols() || kr.cols().is_multiple_of(2)) {
                            bf16::from_f32(x).to_f64()
                        } else {
                            x as f64
                        }
                    };
                    let what = format!(
                        "{isa:?} {} rows {rows} cols {} d {}",
                        T::DTYPE,
                        kr.cols(),
                        kr.d
                    );
                    for r in 0..rows {
                        for x in 0..kr.d {
                            let want: f64 = 0.5
                                + (0..kr.cols())
                                    .map(|c| {
                                        // dims past the last whole 32 take the f32 path
                                        let pc = if x < kr.d / 32 * 32 {
                                            p_used(c, r)
                                        } else {
                                            p[c * np + r] as f64
                                        };
                                        pc * val(c, x)
                                    })
                                    .sum::<f64>();
                            let got = acc[r * dpad + x] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "{what}: acc[{r}][{x}] = {got}, want {want}"
                            );
                        }
                    }
                }
                let ops = (&q[..], rows, dpad, np);
                check::<f32>(isa, ops, &kv, kr, &p);
                check::<f16>(isa, ops, &kv, kr, &p);
                check::<bf16>(isa, ops, &kv, kr, &p);
            }
        }
    }

    #[test]
    fn merge_row_rules() {
        let d = 2;
        let mut dst = vec![f32::NAN; d];
        // All -inf: 0 and -inf, NaN in a skipped partial does not leak.
        let l = merge_row(&[f32::NEG_INFINITY; 2], &[f32::NAN; 4], d, &mut dst);
        assert_eq!((l, dst.clone()), (f32::NEG_INFINITY, vec![0.0, 0.0]));
        // One finite split is copied exactly.
        let l = merge_row(
            &[f32::NEG_INFINITY, 0.3],
            &[f32::NAN, f32::NAN, 0.7, -1.1],
            d,
            &mut dst,
        );
        assert_eq!((l, dst.clone()), (0.3, vec![0.7, -1.1]));
        // Two equal halves: lse + ln 2, the mean of the outs.
        let l = merge_row(&[1.0, 1.0], &[1.0, 2.0, 3.0, 4.0], d, &mut dst);
        assert!((l - (1.0 + 2f32.ln())).abs() < 1e-6);
        assert!((dst[0] - 2.0).abs() < 1e-6 && (dst[1] - 3.0).abs() < 1e-6);
    }

    /// The decode benchmark shape's kv heads and head dim, and flash-attn's cache layout for them.
    fn issue_layout() -> ((usize, usize), crate::params::RowLayout) {
        let (heads_kv, d) = (8, 128);
        let dense = crate::params::RowLayout {
            row_stride: heads_kv * d,
            head_stride: d,
        };
        ((heads_kv, d), dense)
    }

    /// The prefetch runs of a tile: one for consecutive keys of a contiguous cache, one per page
    /// of a paged cache (keys on one page merged, pages in any order), one per kv head (and page)
    /// for a head-major layout, capped at RUNS_CAP.
    #[test]
    fn prefetch_runs_follow_pages() {
        use crate::params::RowLayout;
        let ((heads_kv, d), dense) = issue_layout();
        let runs = |keys: &[usize], l| {
            let mut r = Runs::default();
            r.fill(keys, l, heads_kv, d);
            r.r[..r.n].to_vec()
        };
        let contiguous: Vec<usize> = (5..21).map(|j| j * 1024).collect();
        assert_eq!(runs(&contiguous, dense), vec![(5 * 1024, 21 * 1024)]);
        // Page size 2 (2048 elements per page): pages 7 and 3 whole, the first key of 3's
        // neighbour 4 (merged with 3), then the first key of page 0.
        let paged = [
            7 * 2048,
            7 * 2048 + 1024,
            3 * 2048,
            3 * 2048 + 1024,
            4 * 2048,
            0,
        ];
        assert_eq!(
            runs(&paged, dense),
            vec![(7 * 2048, 8 * 2048), (3 * 2048, 4 * 2048 + 1024), (0, 1024)]
        );
        // Head-major [heads_kv, seqlen, d]: one key's heads span 7 × 4096 + 128 elements, so
        // one run per head of the 16 adjacent rows.
        let head_major = RowLayout {
            row_stride: d,
            head_stride: 4096 * d,
        };
        let keys: Vec<usize> = (5..21).map(|j| j * d).collect();
        let want: Vec<_> = (0..heads_kv)
            .map(|h| (h * 4096 * d + 5 * d, h * 4096 * d + 21 * d))
            .collect();
        assert_eq!(runs(&keys, head_major), want);
        // Head-major pages of 1 key: one run per key and head, up to RUNS_CAP, then dropped
        // (40 keys × 8 heads ask for more than the cap).
        let pages: Vec<usize> = (0..40).rev().map(|j| j * 2 * d).collect();
        let got = runs(&pages, head_major);
        assert!(40 * heads_kv > RUNS_CAP);
        assert_eq!(got.len(), RUNS_CAP);
        assert_eq!(got[0], (39 * 2 * d, 39 * 2 * d + d));
        assert_eq!(got[40], (4096 * d + 39 * 2 * d, 4096 * d + 39 * 2 * d + d));
    }

    /// The prefetcher asks for k and v in turns of TURN_BYTES, and for every line of both by the
    /// last step, also when v's tile is shorter than k's.
    #[test]
    fn prefetch_takes_turns_and_asks_for_every_line() {
        let ((heads_kv, d), dense) = issue_layout();
        let buf = vec![0f32; 64 * heads_kv * d];
        let (k, v) = buf.split_at(32 * heads_kv * d);
        let keys: Vec<usize> = (0..16).map(|j| j * heads_kv * d).collect();
        // Bytes asked for so far.
        let asked = |s: &Stream| {
            let done: usize = s.runs.r[..s.i].iter().map(|r| r.1 - r.0).sum();
            done + if s.done() {
                0
            } else {
                s.next - s.runs.r[s.i].0
            }
        };
        let steps = 2 * heads_kv * keys.len();
        let mut ah = Ahead::none();
        ah.set((k, &keys, dense), (v, &keys, dense), (heads_kv, d), steps);
        // 16 keys × 4 KiB of each over 256 steps: 4 lines of each a step, 512 bytes in all.
        assert_eq!(ah.lines_per_step, 4);
        ah.step(1);
        assert_eq!((asked(&ah.k), asked(&ah.v)), (TURN_BYTES, 0));
        ah.step(1);
        assert_eq!((asked(&ah.k), asked(&ah.v)), (TURN_BYTES, TURN_BYTES));
        for _ in 2..steps {
            ah.step(1);
        }
        assert!(ah.k.done() && ah.v.done());
        // v's run a quarter of k's: both get 512 bytes in turns until v's 16 KiB are asked for
        // (step 64), then k takes every step's 512 bytes: its other 48 KiB by step 160.
        let mut ah = Ahead::none();
        ah.set(
            (k, &keys, dense),
            (v, &keys[..4], dense),
            (heads_kv, d),
            steps,
        );
        for _ in 0..64 {
            ah.step(1);
        }
        assert!(ah.v.done() && asked(&ah.k) == 16 << 10);
        for _ in 64..159 {
            ah.step(1);
        }
        assert!(!ah.k.done());
        ah.step(1);
        assert!(ah.k.done());
    }

    /// The kernels' bound check covers every key's row, not only the first or last one.
    #[test]
    fn key_rows_check_every_row() {
        let rows = |keys: &'static [usize]| KeyRows::new(keys, 8, 16);
        rows(&[40, 0, 16]).check(64);
        let caught =
            |keys: &'static [usize]| std::panic::catch_unwind(|| rows(keys).check(64)).is_err();
        assert!(caught(&[0, 41, 16]));
        assert!(caught(&[41, 0, 16]));
        assert!(caught(&[0, 16, usize::MAX - 4]));
        // A sub-range is checked against its tile's bound (conservative, never laxer).
        let sub = |keys: &'static [usize]| rows(keys).sub(0, 1, 8);
        assert!(std::panic::catch_unwind(|| sub(&[0, 41]).check(64)).is_err());
        sub(&[0, 40]).check(64);
    }

    #[test]
    fn sub_block_rule() {
        // f32, 8 kv heads: d = 128 -> 8 keys, d = 256 -> 4; bf16 at d = 128 -> the whole tile.
        assert_eq!(sub_block_keys(8 * 128 * 4), 8);
        assert_eq!(sub_block_keys(8 * 256 * 4), 4);
        assert_eq!(sub_block_keys(8 * 128 * 2), TILE_KEYS);
        assert_eq!(sub_block_keys(3 * 256 * 4), 8);
        assert_eq!(sub_block_keys(1), TILE_KEYS);
        assert_eq!(sub_block_keys(1 << 20), 4);
        for b in 1..20_000 {
            let s = sub_block_keys(b);
            assert!(
                s.is_power_of_two() && (4..=TILE_KEYS).contains(&s) && TILE_KEYS.is_multiple_of(s)
            );
        }
    }

    #[test]
    fn split_count_rule() {
        assert_eq!(choose_splits(1, 32768, 2), 8);
        assert_eq!(choose_splits(64, 32768, 2), 1);
        assert_eq!(choose_splits(1, 100, 2), 1);
        assert_eq!(choose_splits(1, 128, 2), 2);
        assert_eq!(choose_splits(1, 511, 2), 2);
        assert_eq!(choose_splits(1, 1024, 2), 2);
        assert_eq!(choose_splits(1, 512, 8), 8);
        assert_eq!(choose_splits(3, 512, 8), 3);
        assert_eq!(choose_splits(2, 4096, 2), 4);
        assert_eq!(choose_splits(1, 32768, 1), 1);
        assert_eq!(choose_splits(1, 1 << 20, 64), 128);
    }
}

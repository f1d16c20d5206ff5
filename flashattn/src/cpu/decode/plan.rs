//! How a decode call is cut into work items (sequence, query block, key split): the tile and
//! sub-block sizes, the split count, and the [`Plan`] with the buffers of the items' partials.

use crate::blocks::Mask;
use crate::cpu::simd::pad_lanes;
use crate::error::Result;
use crate::memory::{try_collect, try_filled};
use crate::params::DecodeParams;

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
pub(super) const TILE_KEYS: usize = 16;
/// Keys per tile for more than 4 query rows per kv head (MQA, several tokens per step), where
/// the step is bound by arithmetic: longer runs of each register tile over keys (P·V's
/// accumulators put back, the score kernel's per-call work, the softmax calls once per tile).
/// Measured (A/B in one process, 2 threads, 32k keys, 2026-11-23), 32 against 16 keys: MQA f32
/// 0.95, bf16 0.86; 4 tokens f32 0.99, bf16 0.93; 64 keys no better (0.97 / 0.84 / 1.01 / 0.95).
pub(super) const TILE_KEYS_MANY_ROWS: usize = 32;
/// The longest tile of either kind (buffer sizes).
pub(super) const TILE_KEYS_MAX: usize = TILE_KEYS_MANY_ROWS;
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
///
/// [`run_item`]: super::tile_loop::run_item
const SUB_BLOCK_BYTES: usize = 32 << 10;
/// Keys per sub-block of the products (see [`SUB_BLOCK_BYTES`]) when a key's rows of all kv
/// heads take `key_bytes`: 4, 8 or 16 ([`TILE_KEYS`]), so that a sub-block holds whole 4-key
/// register blocks and whole bf16 key pairs, and the sub-blocks tile a tile.
pub(super) fn sub_block_keys(key_bytes: usize) -> usize {
    let keys = (SUB_BLOCK_BYTES / key_bytes.max(1)).clamp(4, TILE_KEYS);
    1 << keys.ilog2()
}

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

/// Query block: sequence, its query rows `i0..i1`, and the keys `lo..hi` they see.
pub(super) type QueryBlock = (usize, usize, usize, usize, usize);

/// How [`attend`] cuts the call into work items, fixed by the shapes before the append, with the
/// buffers of their partial results.
///
/// [`attend`]: super::attend::attend
pub(super) struct Plan {
    pub(super) blocks: Vec<QueryBlock>,
    pub(super) splits: usize,
    /// Split `s` of block `x` is item `x · splits + s`.
    pub(super) items: Vec<Item>,
    /// Rows per item's partials: heads × the most query rows of a block.
    pub(super) rows: usize,
    /// Query rows the sequences cover (packed rows after them belong to none).
    pub(super) covered: usize,
    /// Whether each item writes its final rows of `out` itself (see [`attend`]).
    ///
    /// [`attend`]: super::attend::attend
    pub(super) direct: bool,
    /// The items' LSEs, `rows` each.
    pub(super) part_lse: Vec<f32>,
    /// The items' partial rows (see [`ItemOut::Parts`]), `rows · d` each; empty where `direct`.
    ///
    /// [`ItemOut::Parts`]: super::tile_loop::ItemOut::Parts
    pub(super) part_out: Vec<f32>,
}

impl Plan {
    pub(super) fn new(dp: &DecodeParams) -> Result<Plan> {
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

/// One work item: sequence `b`, query positions `i0..i1` (all heads), keys `n_lo..n_hi`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Item {
    pub(super) b: usize,
    pub(super) i0: usize,
    pub(super) i1: usize,
    pub(super) n_lo: usize,
    pub(super) n_hi: usize,
}

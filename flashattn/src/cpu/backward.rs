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

use super::forward::{
    as_bf16, bf16_inputs, load_pairs, load_pairs_t, load_tile, load_tile_t, packed_v_keys, PackedV,
    ScoreMod, WorkItem,
};
use super::simd::{pad_lanes, Gemm, KC};
use super::{block_sizes, buf, reuse, BlockSizes, Buf, Disjoint, Pass};
use crate::blocks::Mask;
use crate::error::{ErrorKind, Result};
use crate::memory::try_filled;
use crate::params::{GradInputs, Params, LOG2_E};
use crate::tensor::Element;
use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Per-thread tiles of the backward pass. Query rows live in lanes (`np` = rows padded); `dp` is
/// head_dim padded, the lane count of the row-major query-side tiles and of the dK/dV accumulators.
struct Scratch {
    /// k and v tiles, `[cols][d]`.
    k: Buf<f32>,
    v: Buf<f32>,
    /// Scores, then probabilities P̃ (after dropout), `[cols][np]`.
    pt: Buf<f32>,
    /// dP, then dS, `[cols][np]`.
    dst: Buf<f32>,
    /// The second half-sum of the scores.
    tmp: Buf<f32>,
    /// Softcap's derivative `1 - tanh²` per element, `[cols][np]`.
    dtanh: Buf<f32>,
    lse_log2: Buf<f32>,
    delta: Buf<f32>,
    /// Ones and a sink: the online-softmax kernel's alpha and row_sum when it only exponentiates.
    ones: Buf<f32>,
    sink: Buf<f32>,
    /// Dropout mask of the tile, `[rows][cols]`.
    keep: Buf<bool>,
    /// dK and dV `[cols][dp]` (pass 1), or dQᵀ `[d][np]` (pass 2).
    acc_a: Buf<f32>,
    acc_b: Buf<f32>,
    row: Buf<f32>,
    /// bf16 path: k and v as pairs along d (`[cols][d2]`), dS as pairs of keys
    /// (`[cols / 2][np]`); for dK and dV, P̃ᵀ and dSᵀ as pairs of rows (`[cols][np / 2]`).
    k2: Buf<u32>,
    v2: Buf<u32>,
    ds2: Buf<u32>,
    pt2: Buf<u32>,
    dst2: Buf<u32>,
}

impl Scratch {
    fn new(bs: BlockSizes, d: usize) -> Self {
        let (np, bn, dp) = (pad_lanes(bs.block_m), bs.block_n, pad_lanes(d));
        let big = (bn * dp).max(d * np);
        Scratch {
            k: buf(0.0, bn * d),
            v: buf(0.0, bn * d),
            pt: buf(0.0, bn * np),
            dst: buf(0.0, bn * np),
            tmp: buf(0.0, bn * np),
            dtanh: buf(0.0, bn * np),
            lse_log2: buf(0.0, np),
            delta: buf(0.0, np),
            ones: buf(1.0, np),
            sink: buf(0.0, np),
            keep: buf(true, bs.block_m * bn),
            acc_a: buf(0.0, big),
            acc_b: buf(0.0, big),
            row: buf(0.0, d),
            k2: buf(0, bn * d.div_ceil(2)),
            v2: buf(0, bn * d.div_ceil(2)),
            ds2: buf(0, bn.div_ceil(2) * np),
            pt2: buf(0, bn * np / 2),
            dst2: buf(0, bn * np / 2),
        }
    }
}

/// Everything both passes read.
struct Ctx<'a, T> {
    p: &'a Params,
    g: &'a GradInputs,
    k: &'a [T],
    v: &'a [T],
    /// rowsum(dO ∘ O) per row, in `lse` layout.
    delta: &'a [f32],
    tiles: &'a QueryTiles,
    bs: BlockSizes,
    /// bf16 inputs with a bf16 dot product: the inputs as bf16, and k packed for dQ.
    bf: Option<Bf<'a>>,
}

struct Bf<'a> {
    k: &'a [bf16],
    v: &'a [bf16],
    packed_k: PackedV,
}

/// A query block's q and dO: f32 transposed (`[d][np]`, for S and dP) then row-major (`[rows][dp]`,
/// for dK and dV), or bf16 pairs `[d2][np]` followed by q and dO as pairs of rows (`[rows / 2][dp]`).
#[derive(Clone, Copy)]
enum QTiles<'a> {
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
struct QueryTiles {
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

impl Drop for DqPartials {
    fn drop(&mut self) {
        reuse::DQ_COPIES.put(std::mem::take(&mut self.data));
    }
}

impl QueryTiles {
    fn new<T: Element>(
        p: &Params,
        g: &GradInputs,
        (q, dout): (&[T], &[T]),
        bf16_qdo: Option<(&[bf16], &[bf16])>,
        bs: BlockSizes,
    ) -> Result<Self> {
        let bf16_pairs = bf16_qdo.is_some();
        let d = p.head_dim;
        let items = super::forward::work_items(p, bs.block_m);
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
            pairs = reuse::QUERY_PAIRS.take("the backward's query tiles", total, 0)?;
            split_at_offsets(&mut pairs, &offsets)
                .into_par_iter()
                .zip(&items)
                .for_each(|(chunk, it)| {
                    let (q_base, do_base, r) = bases(it);
                    let np = pad_lanes(r);
                    let (qt, rest) = chunk.split_at_mut(d2 * np);
                    let (dot, rest) = rest.split_at_mut(d2 * np);
                    let (q_rm, do_rm) = rest.split_at_mut(r.div_ceil(2) * dp);
                    let do_stride = g.dout.layout.row_stride;
                    load_pairs_t(qb, q_base, p.q.row_stride, (r, d, np), qt);
                    load_pairs_t(dob, do_base, do_stride, (r, d, np), dot);
                    load_row_pairs(qb, q_base, p.q.row_stride, (r, d, dp), q_rm);
                    load_row_pairs(dob, do_base, do_stride, (r, d, dp), do_rm);
                });
        } else {
            data = reuse::QUERY_TILES.take("the backward's query tiles", total, 0.0)?;
            split_at_offsets(&mut data, &offsets)
                .into_par_iter()
                .zip(&items)
                .for_each_init(
                    || vec![0f32; d],
                    |row, (chunk, it)| {
                        let (q_base, do_base, r) = bases(it);
                        let np = pad_lanes(r);
                        let (qt, rest) = chunk.split_at_mut(d * np);
                        let (dot, rest) = rest.split_at_mut(d * np);
                        let (q_rm, do_rm) = rest.split_at_mut(r * dp);
                        let do_stride = g.dout.layout.row_stride;
                        load_tile_t(q, q_base, p.q.row_stride, (r, d, np), row, qt);
                        load_tile_t(dout, do_base, do_stride, (r, d, np), row, dot);
                        load_tile(q, q_base, p.q.row_stride, (r, d, dp), q_rm);
                        load_tile(dout, do_base, do_stride, (r, d, dp), do_rm);
                    },
                );
        }
        Ok(QueryTiles {
            data,
            pairs,
            offsets,
            seq_item0,
        })
    }

    /// (qᵀ, dOᵀ) of (sequence b, head h, query block m_block).
    fn get(&self, p: &Params, b: usize, h: usize, m_block: usize, block_m: usize) -> QTiles<'_> {
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

/// `buf` cut at `offsets` (ascending, from 0 to `buf.len()`), one chunk per window.
fn split_at_offsets<'a, X>(buf: &'a mut [X], offsets: &[usize]) -> Vec<&'a mut [X]> {
    let mut chunks = Vec::with_capacity(offsets.len().saturating_sub(1));
    let mut rest = buf;
    for w in offsets.windows(2) {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(w[1] - w[0]);
        chunks.push(head);
        rest = tail;
    }
    chunks
}

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
        try_filled("`dq`", poison, p.out_len())?,
        try_filled("`dk`", poison, p.dk_len())?,
        try_filled("`dv`", poison, p.dk_len())?,
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
    let poison = T::from_f32(f32::NAN);
    for d in [&mut *dq, &mut *dk, &mut *dv] {
        d.fill(poison);
    }
    backward_poisoned(p, g, inputs, (dq, dk, dv))
}

/// The backward over gradients that arrive poisoned (NaN; every element is written).
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
    let bs = block_sizes(Pass::Backward, p.kernels.isa);
    let delta = compute_delta(p, g, out, dout)?;
    let dsink = sink_grad(p, g, &delta);
    let bf_in = bf16_inputs(p, q, k, v);
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
    let new_scratch = || (Scratch::new(bs, d), vec![T::default(); d]);
    if let Some(chunks) = dq_chunks {
        let mut parts = DqPartials::new(p, bs, chunks)?;
        // One pass: dK, dV and each chunk's copy of dQ, then the copies summed into dq.
        let items = parts.items(p);
        items
            .into_par_iter()
            .for_each_init(new_scratch, |(scr, row_buf), item| {
                let (b, hk, n_blocks, dq_part) = item;
                // Zeroed here, in this worker (a kept buffer holds the last call's values; fresh
                // pages would otherwise be first touched by a read, the products' accumulate,
                // which maps the shared zero page and then faults again on the write).
                dq_part.fill(0.0);
                for n_block in n_blocks {
                    let item = WorkItem {
                        b,
                        h: hk,
                        m_block: n_block,
                    };
                    dkdv_block(&cx, item, scr, row_buf, &dk_w, &dv_w, Some(&mut *dq_part));
                }
            });
        let dq_w = Disjoint::new(dq);
        super::forward::work_items(p, bs.block_m)
            .par_iter()
            .for_each_init(new_scratch, |(scr, row_buf), item| {
                parts.sum_into(p, bs, *item, scr, row_buf, &dq_w)
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
    kv_items
        .par_iter()
        .for_each_init(new_scratch, |(scr, row_buf), item| {
            dkdv_block(&cx, *item, scr, row_buf, &dk_w, &dv_w, None)
        });

    let dq_w = Disjoint::new(dq);
    super::forward::work_items(p, bs.block_m)
        .par_iter()
        .for_each_init(new_scratch, |(scr, row_buf), item| {
            dq_block(&cx, *item, scr, row_buf, &dq_w)
        });
    Ok(dsink)
}

/// What [`backward`] returns: dq, dk, dv and, with sinks, dsink.
pub(crate) type Grads<T> = (Vec<T>, Vec<T>, Vec<T>, Option<Vec<f32>>);

/// At most this many f32 copies of dQ (one per chunk of key blocks) for the one-pass backward.
pub(crate) const MAX_DQ_CHUNKS: usize = 4;

/// The one-pass backward's f32 copies of dQᵀ: per chunk of key blocks `c`, sequence `b` and kv
/// head `hk`, a region of `group · query blocks` tiles `[d][npb]` (head of the group, then query
/// block; `npb` = block_m padded, padded lanes unused). Regions of chunks a sequence does not have
/// (fewer key blocks than chunks) are empty.
struct DqPartials {
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

impl DqPartials {
    fn new(p: &Params, bs: BlockSizes, chunks: usize) -> Result<Self> {
        let (d, npb) = (p.head_dim, pad_lanes(bs.block_m));
        let group = p.heads / p.heads_kv;
        let bounds: Vec<Vec<usize>> = p
            .seqs
            .iter()
            .map(|s| {
                let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
                chunk_bounds(s.seqlen_q, s.seqlen_k, &mask, bs, chunks)
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
    fn items(&mut self, p: &Params) -> Vec<FusedItem<'_>> {
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
    fn sum_into<T: Element>(
        &self,
        p: &Params,
        bs: BlockSizes,
        item: WorkItem,
        scr: &mut Scratch,
        row_buf: &mut [T],
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
        write_dq_rows(p, (b, h, m0, rows), acc, npb, &mut scr.row, row_buf, dq);
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

/// Writes dQᵀ tile `acc` (`[d][ld]`) as rows `m0..m0 + rows` of head `h` of sequence `b` of dq.
fn write_dq_rows<T: Element>(
    p: &Params,
    (b, h, m0, rows): (usize, usize, usize, usize),
    acc: &[f32],
    ld: usize,
    row: &mut [f32],
    row_buf: &mut [T],
    dq: &Disjoint<T>,
) {
    let d = p.head_dim;
    for r in 0..rows {
        for (x, o) in row[..d].iter_mut().enumerate() {
            *o = acc[x * ld + r];
        }
        T::narrow(&row[..d], row_buf);
        // SAFETY: rows m0..m0 + rows of head h of sequence b belong to this work item alone.
        unsafe {
            dq.range(p.out_offset(b, m0 + r, h), d)
                .copy_from_slice(row_buf)
        };
    }
}

/// The gradient of the learnable sinks, when the call has them: for head h, `-Σ_rows
/// exp(sink_h - lse) · D` over every sequence's rows, where `exp(sink - lse)` is the row's sink
/// probability and `D = rowsum(dO ∘ O)` (the same D as the kernels'), summed in f64 in row order
/// (so the same for any thread count). An O(rows) sum over the backward's own D (`delta`).
fn sink_grad(p: &Params, g: &GradInputs, delta: &[f32]) -> Option<Vec<f32>> {
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
fn compute_delta<T: Element>(
    p: &Params,
    g: &GradInputs,
    out: &[T],
    dout: &[T],
) -> Result<Vec<f32>> {
    let d = p.head_dim;
    let mut delta = try_filled("the backward's row terms D", 0f32, p.lse_len())?;
    let delta_w = Disjoint::new(&mut delta);
    let jobs: Vec<(usize, usize)> = (0..p.seqs.len())
        .flat_map(|b| (0..p.heads).map(move |h| (b, h)))
        .collect();
    jobs.par_iter().for_each_init(
        || (vec![0f32; d], vec![0f32; d]),
        |(o, d_o), &(b, h)| {
            let rows = p.seqs[b].seqlen_q;
            // SAFETY: (sequence b, head h)'s rows lie at lse_offset(b, h, 0..rows), a range of
            // its own (lse's layout gives every (sequence, head, row) one element), and each
            // (b, h) is one job.
            let dst = unsafe { delta_w.range(p.lse_offset(b, h, 0), rows) };
            for (i, x) in dst.iter_mut().enumerate() {
                let (oa, da) = (g.out.offset(b, i, h), g.dout.offset(b, i, h));
                T::widen(&out[oa..oa + d], o);
                T::widen(&dout[da..da + d], d_o);
                *x = super::kernels::dot(o, d_o);
            }
        },
    );
    Ok(delta)
}

impl<T: Element> Ctx<'_, T> {
    /// Loads lse and delta of rows `m0..m0 + rows` of (sequence b, head h); their q and dO tiles
    /// come from [`QueryTiles`]. Padded lanes get P = 0 (lse +inf) and dS = 0 (delta 0).
    fn load_query_side(&self, b: usize, h: usize, m0: usize, rows: usize, scr: &mut Scratch) {
        let p = self.p;
        let np = pad_lanes(rows);
        for r in 0..np {
            if r >= rows {
                scr.lse_log2[r] = f32::INFINITY;
                scr.delta[r] = 0.0;
                continue;
            }
            let at = p.lse_offset(b, h, m0 + r);
            let lse = self.g.lse[at];
            // A fully masked row (lse = -inf) has P = 0: +inf makes every exp2 below 0.
            scr.lse_log2[r] = if lse == f32::NEG_INFINITY {
                f32::INFINITY
            } else {
                lse * LOG2_E
            };
            scr.delta[r] = self.delta[at];
        }
    }

    /// Loads k and v of keys `n0..n0 + cols` of (sequence b, kv head hk) into the scratch tiles
    /// (`[cols][d]`), also for f32: see forward's k tile (rows heads·d apart thrash the TLB when the
    /// products re-read them in place).
    /// On the bf16 path, as pairs into `scr.k2`, `scr.v2` (`[cols][d2]`) instead.
    fn load_key_side(&self, b: usize, hk: usize, n0: usize, cols: usize, scr: &mut Scratch) {
        let (p, s, d) = (self.p, self.p.seqs[b], self.p.head_dim);
        let k_base = s.k_base + n0 * p.k.row_stride + hk * p.k.head_stride;
        let v_base = s.v_base + n0 * p.v.row_stride + hk * p.v.head_stride;
        if let Some(bf) = &self.bf {
            load_pairs(bf.k, k_base, p.k.row_stride, cols, d, &mut scr.k2);
            load_pairs(bf.v, v_base, p.v.row_stride, cols, d, &mut scr.v2);
            return;
        }
        load_tile(self.k, k_base, p.k.row_stride, (cols, d, d), &mut scr.k);
        load_tile(self.v, v_base, p.v.row_stride, (cols, d, d), &mut scr.v);
    }

    /// With q-side rows `m0..m1` loaded (`qt`, `dot` their transposes) and keys `n0..n1` in
    /// `scr.k`, `scr.v`: P̃ᵀ into `scr.pt` and (dS·softmax_scale)ᵀ into `scr.dst` (both
    /// `[cols][np]`; padded lanes 0).
    #[allow(clippy::too_many_arguments)]
    fn recompute(
        &self,
        (b, h): (usize, usize),
        (m0, m1): (usize, usize),
        (n0, n1): (usize, usize),
        tiles: QTiles,
        scr: &mut Scratch,
    ) {
        let (p, d) = (self.p, self.p.head_dim);
        let kern = p.kernels;
        let s = p.seqs[b];
        let (rows, cols) = (m1 - m0, n1 - n0);
        let np = pad_lanes(rows);
        let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
        let pt = &mut scr.pt[..cols * np];
        let product = |a, b| Gemm {
            m: cols,
            n: np,
            k: d,
            a,
            a_rs: d,
            a_cs: 1,
            b,
            b_rs: np,
            accumulate: false,
            kc: KC,
        };
        // bf16 pairs: K (or V) `[cols][d2]` times Qᵀ (or dOᵀ) `[d2][np]`.
        let d2 = d.div_ceil(2);
        let product2 = |a, b| Gemm {
            m: cols,
            n: np,
            k: d2,
            a,
            a_rs: d2,
            a_cs: 1,
            b,
            b_rs: np,
            accumulate: false,
            kc: KC,
        };
        // Sᵀ = K·Qᵀ, then P = exp2(S·scale_log2 - lse_log2).
        match tiles {
            QTiles::F32([qt, ..]) => kern.scores(
                &product(&scr.k, qt),
                pt,
                np,
                &mut scr.tmp,
                p.softcap.is_some(),
            ),
            QTiles::Bf16([qt, ..]) => kern.gemm_bf16(&product2(&scr.k2, qt), pt, np),
        }
        let score_mod = ScoreMod::new(p, b, h);
        let masked = mask.needs_mask(m0, m1, n0, n1);
        if score_mod.needs_apply(masked) {
            let dtanh = p.softcap.map(|_| &mut scr.dtanh[..cols * np]);
            score_mod.apply(pt, np, (m0, rows), (n0, cols), &mask, masked, dtanh);
        } else {
            pt.iter_mut().for_each(|x| *x *= score_mod.scale_log2);
        }
        kern.online_softmax(pt, cols, np, &scr.lse_log2, &mut scr.sink, &scr.ones);
        // dP̃ᵀ = V·dOᵀ.
        let ds = &mut scr.dst[..cols * np];
        match tiles {
            QTiles::F32([_, dot, ..]) => kern.gemm(&product(&scr.v, dot), ds, np),
            QTiles::Bf16([_, dot, ..]) => kern.gemm_bf16(&product2(&scr.v2, dot), ds, np),
        }
        // dropped entries get P̃ = 0 and dP = 0, kept ones are scaled by 1/(1-p); then
        // dS = P ∘ (dP - delta) · scale (· 1 - tanh²).
        let drop_scale = p.dropout.map_or(1.0, |dr| dr.scale());
        if let Some(drop) = p.dropout {
            for r in 0..rows {
                drop.keep_row(b, h, m0 + r, n0, &mut scr.keep[r * cols..(r + 1) * cols]);
            }
        }
        let scale = p.softmax_scale;
        if p.dropout.is_none() && p.softcap.is_none() {
            // The common case as a plain loop over lanes, which LLVM vectorises.
            let delta = &scr.delta[..rows];
            for (pr, dr) in pt.chunks_exact(np).zip(ds.chunks_exact_mut(np)) {
                for ((g, &prob), &dl) in dr[..rows].iter_mut().zip(&pr[..rows]).zip(delta) {
                    *g = prob * (*g - dl) * scale;
                }
            }
            return;
        }
        for c in 0..cols {
            for r in 0..rows {
                let at = c * np + r;
                let kept = p.dropout.is_none() || scr.keep[r * cols + c];
                let prob = pt[at];
                let dp = if kept { ds[at] } else { 0.0 };
                let mut g = prob * (dp * drop_scale - scr.delta[r]) * scale;
                if p.softcap.is_some() {
                    g *= scr.dtanh[at];
                }
                ds[at] = g;
                pt[at] = if kept { prob * drop_scale } else { 0.0 };
            }
        }
    }
}

/// dK and dV of keys `n_block` (stored in `item.m_block`) of kv head `item.h`; with `dq_part` (the
/// item's region of [`DqPartials`]), also `dQ += dS·K·scale` of this key block into it.
fn dkdv_block<T: Element>(
    cx: &Ctx<T>,
    item: WorkItem,
    scr: &mut Scratch,
    row_buf: &mut [T],
    dk: &Disjoint<T>,
    dv: &Disjoint<T>,
    mut dq_part: Option<&mut [f32]>,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    let dp = pad_lanes(d);
    let (b, hk, n_block) = (item.b, item.h, item.m_block);
    let s = p.seqs[b];
    let n0 = n_block * bs.block_n;
    let n1 = (n0 + bs.block_n).min(s.seqlen_k);
    let cols = n1 - n0;
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    cx.load_key_side(b, hk, n0, cols, scr);
    scr.acc_a[..cols * dp].fill(0.0);
    scr.acc_b[..cols * dp].fill(0.0);
    let group = p.heads / p.heads_kv;
    for h in hk * group..(hk + 1) * group {
        for m_block in 0..s.seqlen_q.div_ceil(bs.block_m) {
            let m0 = m_block * bs.block_m;
            let m1 = (m0 + bs.block_m).min(s.seqlen_q);
            let (nb0, nb1) = mask.n_block_range(m0, m1, bs.block_n);
            if !(nb0..nb1).contains(&n_block) {
                continue;
            }
            let rows = m1 - m0;
            let np = pad_lanes(rows);
            cx.load_query_side(b, h, m0, rows, scr);
            let tiles = cx.tiles.get(p, b, h, m_block, bs.block_m);
            cx.recompute((b, h), (m0, m1), (n0, n1), tiles, scr);
            // dV += P̃ᵀ·dO and dK += dSᵀ·Q (row-major, dp lanes).
            let f32_product = |a, x, k, a_rs| rows_product((cols, dp), a, x, k, a_rs);
            let bf16_product = |a, x, k, a_rs| rows_product((cols, dp), a, x, k, a_rs);
            let kern = p.kernels;
            if let QTiles::Bf16([_, _, q_rm2, do_rm2]) = tiles {
                // Over pairs of query rows: P̃ᵀ and dSᵀ rounded to bf16 (as flash-attn rounds them
                // for its tensor-core products), q and dO exact.
                kern.narrow_pairs_bf16(&scr.pt[..cols * np], &mut scr.pt2[..cols * np / 2]);
                kern.narrow_pairs_bf16(&scr.dst[..cols * np], &mut scr.dst2[..cols * np / 2]);
                let k2 = rows.div_ceil(2);
                kern.gemm_bf16(
                    &bf16_product(&scr.pt2, do_rm2, k2, np / 2),
                    &mut scr.acc_b,
                    dp,
                );
                kern.gemm_bf16(
                    &bf16_product(&scr.dst2, q_rm2, k2, np / 2),
                    &mut scr.acc_a,
                    dp,
                );
            } else if let QTiles::F32([_, _, q_rm, do_rm]) = tiles {
                kern.gemm(&f32_product(&scr.pt, do_rm, rows, np), &mut scr.acc_b, dp);
                kern.gemm(&f32_product(&scr.dst, q_rm, rows, np), &mut scr.acc_a, dp);
            }
            if let Some(part) = dq_part.as_deref_mut() {
                let npb = pad_lanes(bs.block_m);
                let nmb = s.seqlen_q.div_ceil(bs.block_m);
                let tile = d * npb;
                let at = ((h - hk * group) * nmb + m_block) * tile;
                dq_product(
                    cx,
                    (b, hk, n_block, cols, np),
                    scr,
                    &mut part[at..at + tile],
                    npb,
                );
            }
        }
    }
    for c in 0..cols {
        let at = p.dk_offset(b, n0 + c, hk);
        // SAFETY: keys n0..n1 of kv head hk of sequence b belong to this work item alone.
        unsafe {
            T::narrow(&scr.acc_a[c * dp..c * dp + d], row_buf);
            dk.range(at, d).copy_from_slice(row_buf);
            T::narrow(&scr.acc_b[c * dp..c * dp + d], row_buf);
            dv.range(at, d).copy_from_slice(row_buf);
        }
    }
}

/// The dK/dV product of pass 1: `C[cols][dp] += A·B` over `k` query rows (or pairs of rows), A's
/// rows `a_rs` apart, B row-major with `dp` lanes.
fn rows_product<'a, X>(
    (cols, dp): (usize, usize),
    a: &'a [X],
    x: &'a [X],
    k: usize,
    a_rs: usize,
) -> Gemm<'a, X> {
    Gemm {
        m: cols,
        n: dp,
        k,
        a,
        a_rs,
        a_cs: 1,
        b: x,
        b_rs: dp,
        accumulate: true,
        kc: KC,
    }
}

/// `dQᵀ += Kᵀ·dSᵀ` (`c[x][r] += Σ_j k[j][x] · ds[r][j]`, `c` row stride `ldc`) with dSᵀ of key
/// block `n_block` (`cols` keys, `np` lanes) of kv head `hk` in `scr.dst` and its keys in `scr.k`
/// (f32) or the packed keys (bf16).
fn dq_product<T: Element>(
    cx: &Ctx<T>,
    (b, hk, n_block, cols, np): (usize, usize, usize, usize, usize),
    scr: &mut Scratch,
    c: &mut [f32],
    ldc: usize,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    if let Some(bf) = &cx.bf {
        // As the forward's P·V: k in key pairs `[d][block_n / 2]`, dS rounded to key pairs.
        p.kernels.pack_pairs_bf16(&scr.dst, cols, np, &mut scr.ds2);
        p.kernels.gemm_bf16(
            &Gemm {
                m: d,
                n: np,
                k: cols.div_ceil(2),
                a: bf.packed_k.block(p, b, hk, n_block, bs.block_n),
                a_rs: bs.block_n / 2,
                a_cs: 1,
                b: &scr.ds2,
                b_rs: np,
                accumulate: true,
                kc: KC,
            },
            c,
            ldc,
        );
        return;
    }
    p.kernels.gemm(
        &Gemm {
            m: d,
            n: np,
            k: cols,
            a: &scr.k,
            a_rs: 1,
            a_cs: d,
            b: &scr.dst,
            b_rs: np,
            accumulate: true,
            kc: KC,
        },
        c,
        ldc,
    );
}

/// Second pass of the two-pass backward: dQ of rows `m_block` of head `h`.
fn dq_block<T: Element>(
    cx: &Ctx<T>,
    item: WorkItem,
    scr: &mut Scratch,
    row_buf: &mut [T],
    dq: &Disjoint<T>,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    let WorkItem { b, h, m_block } = item;
    let s = p.seqs[b];
    let m0 = m_block * bs.block_m;
    let m1 = (m0 + bs.block_m).min(s.seqlen_q);
    let rows = m1 - m0;
    let np = pad_lanes(rows);
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    cx.load_query_side(b, h, m0, rows, scr);
    let tiles = cx.tiles.get(p, b, h, m_block, bs.block_m);
    let mut acc = std::mem::take(&mut scr.acc_a);
    acc[..d * np].fill(0.0);
    let (nb0, nb1) = mask.n_block_range(m0, m1, bs.block_n);
    let hk = p.kv_head(h);
    for n_block in nb0..nb1 {
        let n0 = n_block * bs.block_n;
        let n1 = (n0 + bs.block_n).min(s.seqlen_k);
        let cols = n1 - n0;
        cx.load_key_side(b, hk, n0, cols, scr);
        cx.recompute((b, h), (m0, m1), (n0, n1), tiles, scr);
        dq_product(cx, (b, hk, n_block, cols, np), scr, &mut acc, np);
    }
    write_dq_rows(p, (b, h, m0, rows), &acc, np, &mut scr.row, row_buf, dq);
    scr.acc_a = acc;
}

#[cfg(test)]
mod tests {
    use super::*;

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

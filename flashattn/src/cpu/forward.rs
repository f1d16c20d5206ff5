//! The FlashAttention forward on the CPU.
//!
//! For each work item (sequence b, head h, query block m_block): load the q tile once, then stream
//! the key blocks that [`Mask::n_block_range`] says it sees: S = Q·Kᵀ, score modifiers (scale,
//! softcap, ALiBi) and the mask (only on blocks the mask cuts), online softmax, acc_o += P·V. Divide
//! by row_sum once at the end and store the LSE.
//!
//! Query rows sit in SIMD lanes: the item's q is held transposed (`qt[x][r]`), scores as `st[c][r]`
//! and the accumulator as `ot[x][r]`, so both products are [`Kernels::gemm`] calls and the row
//! statistics are vertical vector operations (see [`super::simd`]). Memory: per-thread tiles of
//! O(block · head_dim), plus, on the bf16 dot-product path, v packed in key pairs once per call
//! (the size of v); nothing grows with seqlen_q · seqlen_k.

use super::reuse::{self, Slot};
use super::simd::{pad_lanes, Gemm, Kernels, KC};
use super::softmax::{finalize, fold_sink};
use super::{block_sizes, buf, BlockSizes, Buf, Disjoint, Pass};
use crate::blocks::Mask;
use crate::dropout::Dropout;
use crate::error::Result;
use crate::memory::try_filled;
use crate::params::{Params, RowLayout, LOG2_E};
use crate::tensor::{DType, Element};
use half::bf16;
use rayon::prelude::*;
use std::sync::Mutex;

/// Per-thread tiles, allocated once per worker, never inside the block loops. Query rows live in
/// lanes, padded to `np = pad_lanes(rows)`; padded lanes hold zeros and are never written out.
pub(crate) struct Scratch {
    /// q transposed: `qt[x * np + r]` (f32 products).
    qt: Buf<f32>,
    /// q as bf16 pairs: `qp[xp * np + r]` = `(q[r][2xp], q[r][2xp + 1])` (bf16 dot products).
    qp: Buf<u32>,
    /// A tile of k rows: f32 `[cols][d]`, or bf16 pairs `[cols][d2]` with `d2 = d.div_ceil(2)`.
    k: Buf<f32>,
    kp: Buf<u32>,
    /// A tile of v rows, f32 `[cols][d]` (f32 products).
    v: Buf<f32>,
    /// Scores, then probabilities, transposed: `st[c * np + r]`; `st2` the second half-sum.
    st: Buf<f32>,
    st2: Buf<f32>,
    /// Probabilities as bf16 pairs of keys: `pp[cp * np + r]`.
    pp: Buf<u32>,
    /// The output accumulator, transposed: `ot[x * np + r]`.
    ot: Buf<f32>,
    row_max: Buf<f32>,
    row_sum: Buf<f32>,
    alpha: Buf<f32>,
    m_sub: Buf<f32>,
    keep: Buf<bool>,
    /// One head row in f32.
    row: Buf<f32>,
}

impl Scratch {
    pub fn new(bs: BlockSizes, d: usize) -> Self {
        let (np, bn) = (pad_lanes(bs.block_m), bs.block_n);
        let d2 = d.div_ceil(2);
        Scratch {
            qt: buf(0.0, d * np),
            qp: buf(0, d2 * np),
            k: buf(0.0, bn * d),
            kp: buf(0, bn * d2),
            v: buf(0.0, bn * d),
            st: buf(0.0, bn * np),
            st2: buf(0.0, bn * np),
            pp: buf(0, bn.div_ceil(2) * np),
            ot: buf(0.0, d * np),
            row_max: buf(0.0, np),
            row_sum: buf(0.0, np),
            alpha: buf(0.0, np),
            m_sub: buf(0.0, np),
            keep: buf(true, bn),
            row: buf(0.0, d),
        }
    }
}

/// Scale, softcap and ALiBi, folded for the log2 domain.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScoreMod {
    /// softmax_scale · log2(e): without softcap, one multiply takes a raw dot product to the log2 domain.
    pub scale_log2: f32,
    /// (softmax_scale / softcap, softcap · log2(e)).
    softcap: Option<(f32, f32)>,
    /// slope · log2(e).
    alibi_log2: Option<f32>,
}

impl ScoreMod {
    pub fn new(p: &Params, b: usize, h: usize) -> Self {
        let scale = p.score_scale(b, h);
        ScoreMod {
            scale_log2: scale * LOG2_E,
            softcap: p.softcap.map(|c| (scale / c, c * LOG2_E)),
            alibi_log2: p.alibi_slope(b, h).map(|s| s * LOG2_E),
        }
    }

    /// Whether a block needs [`ScoreMod::apply`] rather than a plain multiply by `scale_log2`.
    pub fn needs_apply(&self, masked: bool) -> bool {
        masked || self.softcap.is_some() || self.alibi_log2.is_some()
    }

    /// Raw dot products of keys `n0..n0 + cols` (rows of `st`) x query rows `m0..m0 + rows`
    /// (lanes, `np` per key) -> log2-domain scores, masked to -inf where `masked` says the mask
    /// cuts this block. With softcap, `dtanh` (if given, same layout as `st`) receives the
    /// derivative `1 - tanh²` that the backward pass needs, from the same `tanh`.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        st: &mut [f32],
        np: usize,
        (m0, rows): (usize, usize),
        (n0, cols): (usize, usize),
        mask: &Mask,
        masked: bool,
        mut dtanh: Option<&mut [f32]>,
    ) {
        for c in 0..cols {
            let row = &mut st[c * np..c * np + rows];
            match (self.softcap, dtanh.as_deref_mut()) {
                (None, _) => row.iter_mut().for_each(|x| *x *= self.scale_log2),
                (Some((pre, post)), None) => {
                    row.iter_mut().for_each(|x| *x = post * (*x * pre).tanh())
                }
                (Some((pre, post)), Some(dt)) => {
                    for (x, t) in row.iter_mut().zip(&mut dt[c * np..c * np + rows]) {
                        let th = (*x * pre).tanh();
                        *t = 1.0 - th * th;
                        *x = post * th;
                    }
                }
            }
            if let Some(slope) = self.alibi_log2 {
                for (r, x) in row.iter_mut().enumerate() {
                    *x -= slope * mask.diagonal_distance(m0 + r, n0 + c).unsigned_abs() as f32;
                }
            }
        }
        if masked {
            for r in 0..rows {
                let (lo, hi) = mask.key_range(m0 + r);
                for c in 0..cols {
                    if !(lo..hi).contains(&(n0 + c)) {
                        st[c * np + r] = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Copies `rows` head rows starting at element `base` (stride `row_stride`) into a packed f32 tile
/// (`[rows][d]`, or rows `ld` apart when `ld > d`).
#[inline]
pub(crate) fn load_tile<T: Element>(
    src: &[T],
    base: usize,
    row_stride: usize,
    (rows, d, ld): (usize, usize, usize),
    dst: &mut [f32],
) {
    for r in 0..rows {
        let at = base + r * row_stride;
        T::widen(&src[at..at + d], &mut dst[r * ld..r * ld + d]);
    }
}

/// Copies `rows` head rows into a transposed f32 tile `dst[x * np + r]`; lanes `rows..np` are 0.
/// `row` is a scratch row of length d.
#[inline]
pub(crate) fn load_tile_t<T: Element>(
    src: &[T],
    base: usize,
    row_stride: usize,
    (rows, d, np): (usize, usize, usize),
    row: &mut [f32],
    dst: &mut [f32],
) {
    for r in 0..rows {
        let at = base + r * row_stride;
        T::widen(&src[at..at + d], row);
        for (x, &val) in row.iter().enumerate() {
            dst[x * np + r] = val;
        }
    }
    for x in 0..d {
        dst[x * np + rows..(x + 1) * np].fill(0.0);
    }
}

/// Where the bf16 dot-product path reads q, k and v: bf16 elements, or FP8 elements widened
/// (exactly) to bf16 as the tiles are built ([`Fp8Source`]), so FP8 inputs need no bf16 copy.
pub(crate) trait Bf16Source: Copy + Sync {
    /// Whether copying a row is as cheap as a memcpy (then k is packed once per call only when
    /// its blocks are revisited; otherwise, always, so each element is converted once).
    const COPY_IS_CHEAP: bool;

    /// The bf16 bits of element `i`.
    fn bits(&self, i: usize) -> u16;

    /// Pair `xp` of the row of `d` elements at `at`: `(e[2xp], e[2xp + 1])`, the high half 0
    /// past the end (the last pair of an odd d).
    #[inline(always)]
    fn pair(&self, at: usize, xp: usize, d: usize) -> u32 {
        let hi = if 2 * xp + 1 < d {
            self.bits(at + 2 * xp + 1)
        } else {
            0
        };
        self.bits(at + 2 * xp) as u32 | (hi as u32) << 16
    }

    /// Elements `at..at + d` as pairs: `dst[xp]` = [`Bf16Source::pair`] `xp`
    /// (`dst.len() = d.div_ceil(2)`).
    #[inline]
    fn row_pairs(&self, at: usize, d: usize, dst: &mut [u32]) {
        for (xp, out) in dst.iter_mut().enumerate() {
            *out = self.pair(at, xp, d);
        }
    }
}

impl Bf16Source for &[bf16] {
    const COPY_IS_CHEAP: bool = true;

    #[inline(always)]
    fn bits(&self, i: usize) -> u16 {
        self[i].to_bits()
    }

    #[inline]
    fn row_pairs(&self, at: usize, d: usize, dst: &mut [u32]) {
        let row = &self[at..at + d];
        let even = d / 2;
        // Little-endian: bf16 elements 2xp, 2xp + 1 are exactly the low and high halves of u32 xp.
        let (head, tail) = dst.split_at_mut(even);
        // SAFETY: `head` holds `even` u32 = 4·even bytes, `row` at least 2·d >= 4·even bytes;
        // u32 and bf16 are plain bit patterns (any bits valid), and the two slices are distinct
        // allocations (input vs scratch), so the byte copy is in bounds and non-overlapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                row.as_ptr().cast::<u8>(),
                head.as_mut_ptr().cast::<u8>(),
                4 * even,
            );
        }
        if let Some(last) = tail.first_mut() {
            *last = row[d - 1].to_bits() as u32; // odd d: the last pair's high half is 0
        }
    }
}

/// FP8 elements (their bytes) read through the format's bf16 table.
#[derive(Clone, Copy)]
pub(crate) struct Fp8Source<'a> {
    pub bytes: &'a [u8],
    pub table: &'static [bf16; 256],
}

impl Bf16Source for Fp8Source<'_> {
    const COPY_IS_CHEAP: bool = false;

    #[inline(always)]
    fn bits(&self, i: usize) -> u16 {
        self.table[self.bytes[i] as usize].to_bits()
    }
}

/// Copies `rows` head rows as pairs: `dst[r * d2 + xp]` = `(row[2xp], row[2xp + 1])`.
pub(crate) fn load_pairs<S: Bf16Source>(
    src: S,
    base: usize,
    row_stride: usize,
    rows: usize,
    d: usize,
    dst: &mut [u32],
) {
    let d2 = d.div_ceil(2);
    for r in 0..rows {
        src.row_pairs(base + r * row_stride, d, &mut dst[r * d2..(r + 1) * d2]);
    }
}

/// Copies `rows` head rows as transposed pairs: `dst[xp * np + r]`; lanes `rows..np` are 0.
pub(crate) fn load_pairs_t<S: Bf16Source>(
    src: S,
    base: usize,
    row_stride: usize,
    (rows, d, np): (usize, usize, usize),
    dst: &mut [u32],
) {
    let d2 = d.div_ceil(2);
    for r in 0..rows {
        let at = base + r * row_stride;
        for xp in 0..d2 {
            dst[xp * np + r] = src.pair(at, xp, d);
        }
    }
    for xp in 0..d2 {
        dst[xp * np + rows..(xp + 1) * np].fill(0);
    }
}

/// One tile per (sequence, kv head, key block) of `block_len` elements each (zero past what
/// the filler writes), built once per call in parallel: the products then read every key block
/// from one contiguous tile instead of copying it from k's or v's strided rows at every visit.
pub(crate) struct KeyTiles<X: Copy + 'static> {
    data: Buf<X>,
    /// Where `data` is kept for the next call (see `cpu::reuse`).
    slot: &'static Slot<X>,
    /// Index of the first block of each sequence (kv head 0).
    seq_block0: Vec<usize>,
    block_len: usize,
}

impl<X: Copy + Default + Send + Sync> KeyTiles<X> {
    /// Tiles filled by `fill(tile, (b, hk, n0, cols))` for keys `n0..n0 + cols` of kv head `hk`
    /// of sequence `b`, or `OutOfMemory` naming `what` (their size follows k's shape alone,
    /// however small the results are).
    pub(crate) fn build(
        p: &Params,
        bs: BlockSizes,
        (block_len, slot, what): (usize, &'static Slot<X>, &'static str),
        fill: impl Fn(&mut [X], (usize, usize, usize, usize)) + Sync,
    ) -> Result<Self> {
        let per_seq = |s: &crate::params::Seq| p.heads_kv * s.seqlen_k.div_ceil(bs.block_n);
        // Tiles first, the larger by far: `block_len` elements against one tuple per block.
        // Counts past usize ask for usize::MAX elements, which no allocator grants.
        let n_blocks = p
            .seqs
            .iter()
            .try_fold(0usize, |n, s| n.checked_add(per_seq(s)))
            .unwrap_or(usize::MAX);
        let mut data = slot.take(what, n_blocks.saturating_mul(block_len), X::default())?;
        // (sequence, kv head, key block) of each tile.
        let mut blocks = try_filled(what, (0, 0, 0), n_blocks)?;
        let mut seq_block0 = Vec::with_capacity(p.seqs.len());
        let mut at = 0;
        for (b, s) in p.seqs.iter().enumerate() {
            seq_block0.push(at);
            for hk in 0..p.heads_kv {
                for nb in 0..s.seqlen_k.div_ceil(bs.block_n) {
                    blocks[at] = (b, hk, nb);
                    at += 1;
                }
            }
        }
        data.par_chunks_mut(block_len)
            .zip(&blocks)
            .for_each(|(out, &(b, hk, nb))| {
                let n0 = nb * bs.block_n;
                let cols = (p.seqs[b].seqlen_k - n0).min(bs.block_n);
                fill(out, (b, hk, n0, cols));
            });
        Ok(KeyTiles {
            data,
            slot,
            seq_block0,
            block_len,
        })
    }

    pub(crate) fn block(
        &self,
        p: &Params,
        b: usize,
        hk: usize,
        n_block: usize,
        block_n: usize,
    ) -> &[X] {
        let per_head = p.seqs[b].seqlen_k.div_ceil(block_n);
        let at = (self.seq_block0[b] + hk * per_head + n_block) * self.block_len;
        &self.data[at..at + self.block_len]
    }
}

impl<X: Copy> Drop for KeyTiles<X> {
    fn drop(&mut self) {
        self.slot.put(std::mem::take(&mut self.data));
    }
}

/// V of every (sequence, kv head, key block) as bf16 pairs of keys, for the P·V product of the
/// bf16 path: block `(b, hk, n_block)` is `[d][block_n / 2]`, element `(x, cp)` =
/// `(v[2cp][x], v[2cp + 1][x])` of the block's keys (0 past its last key). The backward packs K
/// the same way for `dQ += dS·K` ([`packed_v_keys`]).
pub(crate) type PackedV = KeyTiles<u32>;

fn packed_v<S: Bf16Source>(p: &Params, v: S, bs: BlockSizes) -> Result<PackedV> {
    let what = "the packed bf16 pairs of v";
    pack_key_pairs(p, v, bs, |s| s.v_base, (p.v, &reuse::V_PAIRS, what))
}

/// K packed as [`PackedV`] (the backward's dQ product).
pub(crate) fn packed_v_keys(p: &Params, k: &[bf16], bs: BlockSizes) -> Result<PackedV> {
    let what = "the packed bf16 pairs of k";
    pack_key_pairs(p, k, bs, |s| s.k_base, (p.k, &reuse::K_PAIRS, what))
}

fn pack_key_pairs<S: Bf16Source>(
    p: &Params,
    src: S,
    bs: BlockSizes,
    base_of: fn(&crate::params::Seq) -> usize,
    (layout, slot, what): (RowLayout, &'static Slot<u32>, &'static str),
) -> Result<PackedV> {
    let (d, bn2) = (p.head_dim, bs.block_n / 2);
    KeyTiles::build(p, bs, (d * bn2, slot, what), |out, (b, hk, n0, cols)| {
        let base = base_of(&p.seqs[b]) + hk * layout.head_stride;
        let row = |c: usize| base + (n0 + c) * layout.row_stride;
        // 16 output rows (x) at a time: their lines (32 u32 each) stay in L1 while every
        // key pair fills one element of each; reads run along v's rows.
        for x0 in (0..d).step_by(16) {
            let x1 = (x0 + 16).min(d);
            for cp in 0..cols.div_ceil(2) {
                let lo = row(2 * cp);
                let hi = (2 * cp + 1 < cols).then(|| row(2 * cp + 1));
                for x in x0..x1 {
                    let h = hi.map_or(0, |at| src.bits(at + x) as u32);
                    out[x * bn2 + cp] = src.bits(lo + x) as u32 | h << 16;
                }
            }
        }
    })
}

/// Whether key blocks are visited often enough (16 times each on average, by the query blocks
/// of a head and the heads of a GQA group) that packing k and v once per call beats copying each
/// tile at every visit. Packing costs a pass over k and v into fresh memory (its page faults
/// included), while per-visit copies are cheap as long as k and v stay in the caches: f32, d =
/// 128, 16 heads, 2 threads (2026-11-24), packing was 4-10% faster at N = 2048-8192 without a
/// mask (16-64 visits) and up to 20% slower at N = 512 or causal N = 2048 (4-9 visits).
fn key_blocks_revisited(p: &Params, items: &[WorkItem], bs: BlockSizes) -> bool {
    let visits: usize = items.iter().map(|it| key_blocks(p, it, bs)).sum();
    let tiles: usize = p
        .seqs
        .iter()
        .map(|s| s.seqlen_k.div_ceil(bs.block_n))
        .sum::<usize>()
        * p.heads_kv;
    visits >= 16 * tiles.max(1)
}

/// Zeroes the dropped probabilities of the tile of rows `m0..m0 + rows` (lanes), keys
/// `n0..n0 + cols` (the 1/(1-p) factor is applied once, at the end).
#[allow(clippy::too_many_arguments)]
fn apply_dropout(
    drop: Dropout,
    (b, h): (usize, usize),
    (m0, rows): (usize, usize),
    (n0, cols): (usize, usize),
    st: &mut [f32],
    np: usize,
    keep: &mut [bool],
) {
    for r in 0..rows {
        drop.keep_row(b, h, m0 + r, n0, &mut keep[..cols]);
        for (c, &kept) in keep[..cols].iter().enumerate() {
            if !kept {
                st[c * np + r] = 0.0;
            }
        }
    }
}

/// One (sequence, head, query block) work item.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkItem {
    pub b: usize,
    pub h: usize,
    pub m_block: usize,
}

/// All work items, in (sequence, head, query block) order.
pub(crate) fn work_items(p: &Params, block_m: usize) -> Vec<WorkItem> {
    let mut items = Vec::new();
    for (b, s) in p.seqs.iter().enumerate() {
        for h in 0..p.heads {
            items.extend((0..s.seqlen_q.div_ceil(block_m)).map(|m_block| WorkItem {
                b,
                h,
                m_block,
            }));
        }
    }
    items
}

/// Forward attention. Returns `out` (q's dtype, `p.out_shape`) and `lse` (`p.lse_shape`), or
/// `OutOfMemory` where they cannot be allocated.
pub(crate) fn forward<T: Element>(
    p: &Params,
    q: &[T],
    k: &[T],
    v: &[T],
) -> Result<(Vec<T>, Vec<f32>)> {
    // Poisoned: every element is written (rows of no sequence explicitly), and tests check.
    let mut out = try_filled("`out`", T::from_f32(f32::NAN), p.out_len())?;
    let mut lse = try_filled("`lse`", f32::NAN, p.lse_len())?;
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
    out.fill(T::from_f32(f32::NAN));
    lse.fill(f32::NAN);
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
    let mut out = try_filled("`out`", bf16::NAN, p.out_len())?;
    let mut lse = try_filled("`lse`", f32::NAN, p.lse_len())?;
    forward_with::<bf16, _>(p, (&[], &[], &[]), Some((q, k, v)), &mut out, &mut lse)?;
    Ok((out, lse))
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
    let bs = block_sizes(pass, p.kernels.isa);
    // `out` and `lse` arrive poisoned (NaN): every element is written below.
    clear_unused_rows(p, out, lse);
    let mut items = work_items(p, bs.block_m);
    let revisited = key_blocks_revisited(p, &items, bs);
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
        tiles_f32: match bf.is_none() && revisited {
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
    items.par_iter().with_max_len(1).for_each(|item| {
        let slot = rayon::current_thread_index().and_then(|i| pool.get(i));
        let mut guard = slot.map(|m| m.lock().unwrap_or_else(|e| e.into_inner()));
        let mut local = None;
        let (scratch, row_buf) = match guard.as_deref_mut() {
            Some(own) => own,
            None => &mut local,
        }
        .get_or_insert_with(|| (Scratch::new(bs, p.head_dim), vec![T::default(); p.head_dim]));
        forward_block(p, &inputs, *item, bs, scratch, row_buf, &out_w, &lse_w)
    });
    Ok(())
}

/// A worker's tiles and its output row buffer.
type ThreadScratch<T> = (Scratch, Vec<T>);

/// Number of key blocks a work item visits.
pub(crate) fn key_blocks(p: &Params, it: &WorkItem, bs: BlockSizes) -> usize {
    let s = p.seqs[it.b];
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    let m0 = it.m_block * bs.block_m;
    let (lo, hi) = mask.n_block_range(m0, (m0 + bs.block_m).min(s.seqlen_q), bs.block_n);
    hi.saturating_sub(lo)
}

struct Inputs<'a, T, S> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    /// q, k, v as bf16 sources, and v packed in key pairs: present when the bf16 dot-product
    /// path runs.
    bf: Option<(S, S, S)>,
    packed_v: Option<PackedV>,
    /// k as pairs (`[cols][d2]` per key block), when the bf16 path runs and key blocks are
    /// revisited ([`key_blocks_revisited`]); else each visit copies its tile.
    packed_k: Option<KeyTiles<u32>>,
    /// k and v widened to f32 tiles (`[cols][d]` per key block), when the f32 products run and
    /// key blocks are revisited. At N = 8192, 16 heads, f32 d = 128, the per-visit copies from
    /// k's and v's strided rows took ~16% of the forward's samples (perf, 2026-11-24).
    tiles_f32: Option<(KeyTiles<f32>, KeyTiles<f32>)>,
}

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

#[allow(clippy::too_many_arguments)]
fn forward_block<T: Element, S: Bf16Source>(
    p: &Params,
    inp: &Inputs<T, S>,
    item: WorkItem,
    bs: BlockSizes,
    scr: &mut Scratch,
    row_buf: &mut [T],
    out: &Disjoint<T>,
    lse: &Disjoint<f32>,
) {
    let WorkItem { b, h, m_block } = item;
    let kern: &Kernels = p.kernels;
    let seq = p.seqs[b];
    let d = p.head_dim;
    let d2 = d.div_ceil(2);
    let hk = p.kv_head(h);
    let m0 = m_block * bs.block_m;
    let m1 = (m0 + bs.block_m).min(seq.seqlen_q);
    let rows = m1 - m0;
    let np = pad_lanes(rows);
    let mask = Mask::new(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    let score_mod = ScoreMod::new(p, b, h);
    let bf = inp.bf;

    let q_base = seq.q_base + m0 * p.q.row_stride + h * p.q.head_stride;
    match bf {
        Some((qb, _, _)) => load_pairs_t(qb, q_base, p.q.row_stride, (rows, d, np), &mut scr.qp),
        None => load_tile_t(
            inp.q,
            q_base,
            p.q.row_stride,
            (rows, d, np),
            &mut scr.row,
            &mut scr.qt,
        ),
    }
    scr.ot[..d * np].fill(0.0);
    scr.row_max[..np].fill(f32::NEG_INFINITY);
    scr.row_sum[..np].fill(0.0);

    let (n_min, n_max) = mask.n_block_range(m0, m1, bs.block_n);
    for n_block in n_min..n_max {
        let n0 = n_block * bs.block_n;
        let n1 = (n0 + bs.block_n).min(seq.seqlen_k);
        let cols = n1 - n0;
        let k_base = seq.k_base + n0 * p.k.row_stride + hk * p.k.head_stride;
        let st = &mut scr.st[..cols * np];
        // S = Q·Kᵀ, transposed: st[c][r] = Σ_x k[c][x] · q[r][x].
        match bf {
            Some((_, kb, _)) => {
                // As pairs in a contiguous tile (see the f32 branch for why not in place).
                let a = match &inp.packed_k {
                    Some(t) => t.block(p, b, hk, n_block, bs.block_n),
                    None => {
                        load_pairs(kb, k_base, p.k.row_stride, cols, d, &mut scr.kp);
                        &scr.kp[..]
                    }
                };
                let a_rs = d2;
                kern.gemm_bf16(
                    &Gemm {
                        m: cols,
                        n: np,
                        k: d2,
                        a,
                        a_rs,
                        a_cs: 1,
                        b: &scr.qp,
                        b_rs: np,
                        accumulate: false,
                        kc: KC,
                    },
                    st,
                    np,
                );
            }
            None => {
                // Copied (widened) into a contiguous tile, also for f32: rows of k sit heads·d
                // elements apart, each on its own page once that is >= 4 KiB, and the products
                // re-read them; read in place, TLB misses and 4 KiB L1 aliasing cost ~1.4x at
                // N = 8192, 16 heads (measured).
                let a = match &inp.tiles_f32 {
                    Some((kt, _)) => kt.block(p, b, hk, n_block, bs.block_n),
                    None => {
                        load_tile(inp.k, k_base, p.k.row_stride, (cols, d, d), &mut scr.k);
                        &scr.k[..]
                    }
                };
                let a_rs = d;
                kern.scores(
                    &Gemm {
                        m: cols,
                        n: np,
                        k: d,
                        a,
                        a_rs,
                        a_cs: 1,
                        b: &scr.qt,
                        b_rs: np,
                        accumulate: false,
                        kc: KC,
                    },
                    st,
                    np,
                    &mut scr.st2,
                    p.softcap.is_some(),
                );
            }
        }
        let masked = mask.needs_mask(m0, m1, n0, n1);
        let scale = if score_mod.needs_apply(masked) {
            score_mod.apply(st, np, (m0, rows), (n0, cols), &mask, masked, None);
            1.0
        } else {
            score_mod.scale_log2
        };
        kern.max_get_scale(
            st,
            cols,
            np,
            scale,
            &mut scr.row_max,
            &mut scr.alpha,
            &mut scr.m_sub,
        );
        kern.online_softmax(st, cols, np, &scr.m_sub, &mut scr.row_sum, &scr.alpha);
        // alpha is exactly 1 where a lane's maximum did not move (exp2(0) = 1 in every kernel):
        // after the first blocks that is every lane, and the pass over acc_o can be skipped.
        if scr.alpha[..np].iter().any(|&a| a != 1.0) {
            kern.rescale_o(&mut scr.ot, d, np, &scr.alpha);
        }
        if let Some(drop) = p.dropout {
            // row_sum keeps the undropped probabilities (the softmax normaliser); only P·V sees the mask.
            apply_dropout(drop, (b, h), (m0, rows), (n0, cols), st, np, &mut scr.keep);
        }
        // O += P·V, transposed: ot[x][r] += Σ_c v[c][x] · p[r][c].
        match &inp.packed_v {
            Some(pv) => {
                kern.pack_pairs_bf16(st, cols, np, &mut scr.pp);
                let bn2 = bs.block_n / 2;
                kern.gemm_bf16(
                    &Gemm {
                        m: d,
                        n: np,
                        k: cols.div_ceil(2),
                        a: pv.block(p, b, hk, n_block, bs.block_n),
                        a_rs: bn2,
                        a_cs: 1,
                        b: &scr.pp,
                        b_rs: np,
                        accumulate: true,
                        kc: KC,
                    },
                    &mut scr.ot,
                    np,
                );
            }
            None => {
                let a = match &inp.tiles_f32 {
                    Some((_, vt)) => vt.block(p, b, hk, n_block, bs.block_n),
                    None => {
                        let v_base = seq.v_base + n0 * p.v.row_stride + hk * p.v.head_stride;
                        load_tile(inp.v, v_base, p.v.row_stride, (cols, d, d), &mut scr.v);
                        &scr.v[..]
                    }
                };
                let a_cs = d;
                kern.gemm(
                    &Gemm {
                        m: d,
                        n: np,
                        k: cols,
                        a,
                        a_rs: 1,
                        a_cs,
                        b: st,
                        b_rs: np,
                        accumulate: true,
                        kc: KC,
                    },
                    &mut scr.ot,
                    np,
                );
            }
        }
    }

    let out_scale = p.dropout.map_or(1.0, |drop| drop.scale()) * p.out_descale(b, h);
    for r in 0..rows {
        for (x, o) in scr.row.iter_mut().enumerate() {
            *o = scr.ot[x * np + r];
        }
        let mut row_lse = finalize(&mut scr.row, scr.row_max[r], scr.row_sum[r], out_scale);
        if let Some(s) = &p.sink {
            row_lse = fold_sink(&mut scr.row, row_lse, s[h]);
        }
        T::narrow(&scr.row, row_buf);
        // SAFETY: rows m0..m1 of head h of sequence b belong to this work item alone.
        unsafe {
            out.range(p.out_offset(b, m0 + r, h), d)
                .copy_from_slice(row_buf);
            *lse.range(p.lse_offset(b, h, m0 + r), 1)
                .first_mut()
                .expect("len 1") = row_lse;
        }
    }
}

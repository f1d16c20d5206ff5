//! Loading and packing tiles of q, k and v: f32 tiles, bf16 pairs (from bf16 or FP8 sources), and
//! the key tiles packed once per call.

use crate::cpu::reuse::{self, Slot};
use crate::cpu::{BlockSizes, Buf};
use crate::error::Result;
use crate::memory::try_filled;
use crate::params::{Params, RowLayout};
use crate::tensor::Element;
use half::bf16;
use rayon::prelude::*;

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

/// Asks the caches for rows `r0..r1` of a tile of `d` elements per row starting at element
/// `base` of `src` (stride `row_stride`), every line of each (x86-64; a no-op elsewhere and past
/// `src`'s end). For the next work item's q rows while this one computes: each row sits on its
/// own page at 16 heads, and its first read, met in `load_tile_t`, waited on a page walk and
/// memory.
#[inline]
pub(crate) fn prefetch_rows<T>(
    src: &[T],
    base: usize,
    row_stride: usize,
    (r0, r1, d): (usize, usize, usize),
) {
    for r in r0..r1 {
        let at = base + r * row_stride;
        if at + d > src.len() {
            return;
        }
        prefetch_span(&src[at..at + d]);
    }
}

/// Asks the caches (L2) for every line of `span` (x86-64; a no-op elsewhere).
#[inline]
pub(crate) fn prefetch_span<T>(span: &[T]) {
    const LINE: usize = 64;
    let start = span.as_ptr() as usize;
    for line in (start & !(LINE - 1)..start + std::mem::size_of_val(span)).step_by(LINE) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint that never faults; the address is not dereferenced.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(line as *const i8);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = line;
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
/// the filler writes; the filler writes every element of a tile of `block_n` keys), built once per call in parallel: the products then read every key block
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
        // Full tiles are written whole by `fill`; only a sequence's last, short tile is zeroed
        // first (zeroing every tile was a pass over all of them, 1.5-2% of a forward's samples).
        let mut data =
            slot.take_for_overwrite(what, n_blocks.saturating_mul(block_len), X::default())?;
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
                if cols < bs.block_n {
                    out.fill(X::default());
                }
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

pub(super) fn packed_v<S: Bf16Source>(p: &Params, v: S, bs: BlockSizes) -> Result<PackedV> {
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

//! A reusable block mask (FlexAttention's `BlockMask`): a mask evaluated once for a shape
//! `(batch, heads, seqlen_q, seqlen_k)` into a summary per block of [`MASK_BLOCK`] × [`MASK_BLOCK`]
//! pairs (no pair shown, every pair shown, or some) plus the bits of the partial blocks. A call
//! then answers the kernels' block and element questions from the summary and the bits, without
//! calling a function: a whole block is one lookup, a row of a partial block one 64-bit word.
//!
//! Built from a function ([`BlockMask::from_fn`]), a dense boolean mask ([`BlockMask::from_dense`])
//! or rows handed over in chunks ([`BlockMaskBuilder`], so a caller evaluating its mask in
//! pieces keeps its memory bounded). Batch and heads may be 1: the mask is then the same for
//! every sequence or every query head.

use std::fmt;
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::{ErrorKind, Result};

/// The coordinates a [`crate::MaskMod`] is asked about: sequence `batch` (the packed call's sequence
/// index), query head `head`, and query row `q` and key `k` within that sequence (the coordinates
/// of the causal rule, before its bottom-right alignment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaskIndex {
    pub batch: usize,
    pub head: usize,
    pub q: usize,
    pub k: usize,
}

/// Rows and keys of one mask block: a row of a partial block is one `u64` word.
pub const MASK_BLOCK: usize = 64;

/// What one block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    /// No pair is shown.
    Empty,
    /// Every pair (of the mask's shape) is shown.
    Full,
    /// Some pairs: the block's [`MASK_BLOCK`] row words start at `bits[index * MASK_BLOCK]`.
    Partial(u32),
}

/// The dimensions of a block mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaskShape {
    /// Sequences (1: one mask for every sequence).
    pub batch: usize,
    /// Query heads (1: one mask for every head).
    pub heads: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
}

impl MaskShape {
    fn m_blocks(&self) -> usize {
        self.seqlen_q.div_ceil(MASK_BLOCK)
    }
    fn n_blocks(&self) -> usize {
        self.seqlen_k.div_ceil(MASK_BLOCK)
    }
    /// Block rows: one per (sequence, head, block of query rows).
    fn block_rows(&self) -> usize {
        self.batch * self.heads * self.m_blocks()
    }
    /// Refuses a shape whose block table or dense form would not fit `usize`.
    fn check(&self) -> Result<()> {
        let dense = [self.batch, self.heads, self.seqlen_q, self.seqlen_k]
            .iter()
            .try_fold(1usize, |a, &x| a.checked_mul(x));
        if dense.is_none() {
            return Err(ErrorKind::BlockMaskInput {
                detail: format!("{self} has more pairs than usize holds"),
            }
            .into());
        }
        Ok(())
    }
}

impl fmt::Display for MaskShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "(batch {}, heads {}, seqlen_q {}, seqlen_k {})",
            self.batch, self.heads, self.seqlen_q, self.seqlen_k
        )
    }
}

/// [`BlockMaskParts::kinds`] of a block with no pair shown.
pub const KIND_EMPTY: i32 = -1;
/// [`BlockMaskParts::kinds`] of a block with every pair shown.
pub const KIND_FULL: i32 = -2;

/// A [`BlockMask`] as plain arrays.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMaskParts {
    /// One per block at `((b * heads + h) * m_blocks + m_block) * n_blocks + n_block`:
    /// [`KIND_EMPTY`], [`KIND_FULL`], or `p >= 0`, a partial block whose row words are
    /// `bits[p * MASK_BLOCK..][..MASK_BLOCK]`.
    pub kinds: Vec<i32>,
    /// Word `r` of a partial block: row `m_block * MASK_BLOCK + r`, bit `c` key
    /// `n_block * MASK_BLOCK + c`.
    pub bits: Vec<u64>,
}

/// A mask summarised per block. Cheap to clone (shared).
#[derive(Clone)]
pub struct BlockMask(Arc<Inner>);

struct Inner {
    shape: MaskShape,
    /// The arrays of [`BlockMaskParts`], checked: every kind is [`KIND_EMPTY`], [`KIND_FULL`] or
    /// a partial block's index, and bits past the shape's edges are 0.
    parts: Parts,
}

/// Where a mask's arrays live.
enum Parts {
    Owned {
        kinds: Vec<i32>,
        bits: Vec<u64>,
    },
    /// Memory lent by `_owner` ([`BlockMask::from_parts_lent`]), which keeps it alive and
    /// unchanged while it lives; the slices never leave this struct with their `'static`.
    Lent {
        kinds: &'static [i32],
        bits: &'static [u64],
        _owner: Box<dyn Send + Sync>,
    },
}

impl Parts {
    #[inline]
    fn kinds(&self) -> &[i32] {
        match self {
            Parts::Owned { kinds, .. } => kinds,
            Parts::Lent { kinds, .. } => kinds,
        }
    }
    #[inline]
    fn bits(&self) -> &[u64] {
        match self {
            Parts::Owned { bits, .. } => bits,
            Parts::Lent { bits, .. } => bits,
        }
    }
}

/// A checked kind (see [`Inner::parts`]) as a [`BlockKind`].
#[inline]
fn kind_of(k: i32) -> BlockKind {
    match k {
        KIND_EMPTY => BlockKind::Empty,
        KIND_FULL => BlockKind::Full,
        p => BlockKind::Partial(p as u32),
    }
}

/// A [`BlockKind`] as [`BlockMaskParts::kinds`] holds it.
fn kind_code(k: BlockKind) -> i32 {
    match k {
        BlockKind::Empty => KIND_EMPTY,
        BlockKind::Full => KIND_FULL,
        BlockKind::Partial(p) => p as i32,
    }
}

/// One block row classified: its kinds, with `Partial` indices local to `bits`.
struct BlockRow {
    kinds: Vec<BlockKind>,
    bits: Vec<u64>,
}

/// Bits `a..e` (`a < e <= 64`) of a word.
#[inline]
fn span(a: usize, e: usize) -> u64 {
    let hi = if e == 64 { !0 } else { (1u64 << e) - 1 };
    hi & !((1u64 << a) - 1)
}

/// Classifies rows `0..rows` (at most [`MASK_BLOCK`]) of one block row, `shown(r, j)` telling
/// whether row `r` sees key `j < seqlen_k`.
fn block_row(seqlen_k: usize, rows: usize, shown: impl Fn(usize, usize) -> bool) -> BlockRow {
    let n_blocks = seqlen_k.div_ceil(MASK_BLOCK);
    let mut words = vec![0u64; n_blocks * MASK_BLOCK];
    for r in 0..rows {
        for j in 0..seqlen_k {
            if shown(r, j) {
                words[(j / MASK_BLOCK) * MASK_BLOCK + r] |= 1 << (j % MASK_BLOCK);
            }
        }
    }
    let mut out = BlockRow {
        kinds: Vec::with_capacity(n_blocks),
        bits: Vec::new(),
    };
    for (nb, w) in words.chunks_exact(MASK_BLOCK).enumerate() {
        let full = span(0, (seqlen_k - nb * MASK_BLOCK).min(MASK_BLOCK));
        let w = &w[..rows];
        out.kinds.push(if w.iter().all(|&x| x == 0) {
            BlockKind::Empty
        } else if w.iter().all(|&x| x == full) {
            BlockKind::Full
        } else {
            let index = out.bits.len() / MASK_BLOCK;
            out.bits.extend_from_slice(w);
            out.bits.resize((index + 1) * MASK_BLOCK, 0);
            BlockKind::Partial(index as u32)
        });
    }
    out
}

impl BlockMask {
    /// Evaluates `f` once for every pair of `shape` (with `batch` and `head` the sequence and
    /// query head, each 0 where the shape has 1), on the current rayon pool.
    pub fn from_fn(shape: MaskShape, f: impl Fn(MaskIndex) -> bool + Send + Sync) -> Result<Self> {
        shape.check()?;
        let (heads, m_blocks) = (shape.heads, shape.m_blocks());
        let rows: Vec<BlockRow> = (0..shape.block_rows())
            .into_par_iter()
            .map(|br| {
                let (batch, head) = (br / (heads * m_blocks), br / m_blocks % heads);
                let q0 = br % m_blocks * MASK_BLOCK;
                let n = (shape.seqlen_q - q0).min(MASK_BLOCK);
                block_row(shape.seqlen_k, n, |r, k| {
                    f(MaskIndex {
                        batch,
                        head,
                        q: q0 + r,
                        k,
                    })
                })
            })
            .collect();
        Ok(Self::assemble(shape, rows))
    }

    /// From a dense mask, `true` where a query sees a key, laid out `[batch, heads, seqlen_q,
    /// seqlen_k]` row-major (SDPA's boolean `attn_mask`).
    pub fn from_dense(shape: MaskShape, mask: &[bool]) -> Result<Self> {
        let mut b = BlockMaskBuilder::new(shape)?;
        let per_head = shape.seqlen_q * shape.seqlen_k;
        if mask.len() != per_head * shape.batch * shape.heads {
            return Err(ErrorKind::BlockMaskInput {
                detail: format!(
                    "a dense mask of {shape} has {} elements, not {}",
                    per_head * shape.batch * shape.heads,
                    mask.len()
                ),
            }
            .into());
        }
        for bh in 0..shape.batch * shape.heads {
            let rows = &mask[bh * per_head..(bh + 1) * per_head];
            b.rows_with(bh / shape.heads, bh % shape.heads, 0, shape.seqlen_q, |i| {
                rows[i]
            })?;
        }
        b.finish()
    }

    fn assemble(shape: MaskShape, rows: Vec<BlockRow>) -> Self {
        let mut kinds = Vec::with_capacity(shape.block_rows() * shape.n_blocks());
        let mut bits = Vec::new();
        for row in rows {
            let base = (bits.len() / MASK_BLOCK) as u32;
            kinds.extend(row.kinds.iter().map(|&k| {
                kind_code(match k {
                    BlockKind::Partial(i) => BlockKind::Partial(base + i),
                    k => k,
                })
            }));
            bits.extend_from_slice(&row.bits);
        }
        BlockMask(Arc::new(Inner {
            shape,
            parts: Parts::Owned { kinds, bits },
        }))
    }

    pub fn shape(&self) -> MaskShape {
        self.0.shape
    }

    /// The summary and bits as plain arrays (for a caller that carries the mask as tensors):
    /// one kind per block in the layout of [`BlockMaskParts::kinds`].
    pub fn to_parts(&self) -> BlockMaskParts {
        BlockMaskParts {
            kinds: self.0.parts.kinds().to_vec(),
            bits: self.0.parts.bits().to_vec(),
        }
    }

    /// A mask from [`BlockMask::to_parts`]'s arrays for `shape`, checked: the lengths, every
    /// kind, and no bit set past the shape's edges. Copies them.
    pub fn from_parts(shape: MaskShape, kinds: &[i32], bits: &[u64]) -> Result<Self> {
        check_parts(shape, kinds, bits)?;
        Ok(BlockMask(Arc::new(Inner {
            shape,
            parts: Parts::Owned {
                kinds: kinds.to_vec(),
                bits: bits.to_vec(),
            },
        })))
    }

    /// [`BlockMask::from_parts`] reading the arrays in place, without a copy: for a caller
    /// whose arrays live elsewhere (a tensor) and are checked again for every call.
    ///
    /// # Safety
    /// `kinds` and `bits` stay valid and unchanged for as long as `owner` lives (the mask and
    /// its clones hold `owner` and drop it last).
    pub unsafe fn from_parts_lent(
        shape: MaskShape,
        kinds: &[i32],
        bits: &[u64],
        owner: Box<dyn Send + Sync>,
    ) -> Result<Self> {
        check_parts(shape, kinds, bits)?;
        // SAFETY: the caller keeps both arrays alive and unchanged while `owner` lives; the
        // mask holds `owner` and hands the slices out only borrowed from itself.
        let (kinds, bits) = unsafe {
            (
                std::slice::from_raw_parts(kinds.as_ptr(), kinds.len()),
                std::slice::from_raw_parts(bits.as_ptr(), bits.len()),
            )
        };
        Ok(BlockMask(Arc::new(Inner {
            shape,
            parts: Parts::Lent {
                kinds,
                bits,
                _owner: owner,
            },
        })))
    }

    /// Blocks with no pair shown, with every pair shown, and partial ones, over the whole mask.
    pub fn block_counts(&self) -> BlockCounts {
        let mut c = BlockCounts::default();
        for &k in self.0.parts.kinds() {
            match kind_of(k) {
                BlockKind::Empty => c.empty += 1,
                BlockKind::Full => c.full += 1,
                BlockKind::Partial(_) => c.partial += 1,
            }
        }
        c
    }

    /// Bytes of the summary and the partial blocks' bits (held, or read in place when lent).
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.0.parts.kinds()) + std::mem::size_of_val(self.0.parts.bits())
    }

    /// The kind of the block holding (row `i`, key `j`) of (sequence `b`, head `h`) and the row
    /// index within it. Broadcast dimensions (1) serve every sequence or head.
    #[inline]
    fn block(&self, b: usize, h: usize, i: usize, nb: usize) -> BlockKind {
        let s = &self.0.shape;
        let (b, h) = (
            if s.batch == 1 { 0 } else { b },
            if s.heads == 1 { 0 } else { h },
        );
        let mb = i / MASK_BLOCK;
        kind_of(self.0.parts.kinds()[((b * s.heads + h) * s.m_blocks() + mb) * s.n_blocks() + nb])
    }

    #[inline]
    fn word(&self, p: u32, i: usize) -> u64 {
        self.0.parts.bits()[p as usize * MASK_BLOCK + i % MASK_BLOCK]
    }

    /// Whether query `i` of (sequence `b`, head `h`) sees key `j` (inside the mask's shape).
    #[inline]
    pub fn allows(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        match self.block(b, h, i, j / MASK_BLOCK) {
            BlockKind::Empty => false,
            BlockKind::Full => true,
            BlockKind::Partial(p) => self.word(p, i) >> (j % MASK_BLOCK) & 1 == 1,
        }
    }

    /// Whether row `i` of (sequence `b`, head `h`) shows some key of `lo..hi` (non-empty), and
    /// whether it hides some: one lookup per mask block the range touches.
    pub(crate) fn row_cover(&self, b: usize, h: usize, i: usize, lo: usize, hi: usize) -> RowCover {
        let mut c = RowCover {
            shown: false,
            hidden: false,
        };
        for nb in lo / MASK_BLOCK..hi.div_ceil(MASK_BLOCK) {
            match self.block(b, h, i, nb) {
                BlockKind::Empty => c.hidden = true,
                BlockKind::Full => c.shown = true,
                BlockKind::Partial(p) => {
                    let n0 = nb * MASK_BLOCK;
                    let m = span(lo.max(n0) - n0, hi.min(n0 + MASK_BLOCK) - n0);
                    let w = self.word(p, i) & m;
                    c.shown |= w != 0;
                    c.hidden |= w != m;
                }
            }
            if c.shown && c.hidden {
                break;
            }
        }
        c
    }

    /// Calls `hide(j)` for each key `j` of `lo..hi` that row `i` of (sequence `b`, head `h`)
    /// does not see, in increasing order.
    pub(crate) fn for_each_hidden(
        &self,
        b: usize,
        h: usize,
        i: usize,
        (lo, hi): (usize, usize),
        mut hide: impl FnMut(usize),
    ) {
        for nb in lo / MASK_BLOCK..hi.div_ceil(MASK_BLOCK) {
            let n0 = nb * MASK_BLOCK;
            let (a, e) = (lo.max(n0), hi.min(n0 + MASK_BLOCK));
            match self.block(b, h, i, nb) {
                BlockKind::Empty => (a..e).for_each(&mut hide),
                BlockKind::Full => {}
                BlockKind::Partial(p) => {
                    let mut w = !self.word(p, i) & span(a - n0, e - n0);
                    while w != 0 {
                        hide(n0 + w.trailing_zeros() as usize);
                        w &= w - 1;
                    }
                }
            }
        }
    }

    /// Refuses a call this mask was not made for: `batch` sequences (or 1), `heads` query heads
    /// (or 1), and, batched, exactly `seqlen_q` × `seqlen_k`; packed (`varlen`), at least every
    /// sequence's lengths (`seqlen_q`, `seqlen_k` then being the longest).
    pub(crate) fn check_call(&self, call: MaskShape, packed: bool) -> Result<()> {
        let s = self.0.shape;
        let shape_err = |dim: &'static str, mask: usize, call: usize| {
            Err(ErrorKind::BlockMaskShape {
                dim,
                mask,
                call,
                packed,
            }
            .into())
        };
        if s.batch != 1 && s.batch != call.batch {
            return shape_err("batch", s.batch, call.batch);
        }
        if s.heads != 1 && s.heads != call.heads {
            return shape_err("heads", s.heads, call.heads);
        }
        let fits = |mask: usize, call: usize| if packed { mask >= call } else { mask == call };
        if !fits(s.seqlen_q, call.seqlen_q) {
            return shape_err("seqlen_q", s.seqlen_q, call.seqlen_q);
        }
        if !fits(s.seqlen_k, call.seqlen_k) {
            return shape_err("seqlen_k", s.seqlen_k, call.seqlen_k);
        }
        Ok(())
    }
}

impl fmt::Debug for BlockMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = self.block_counts();
        write!(
            f,
            "BlockMask{} {{ empty: {}, full: {}, partial: {} }}",
            self.0.shape, c.empty, c.full, c.partial
        )
    }
}

/// The checks of [`BlockMask::from_parts`]: the lengths, every kind, and no bit set past the
/// shape's edges.
fn check_parts(shape: MaskShape, kinds: &[i32], bits: &[u64]) -> Result<()> {
    shape.check()?;
    let bad = |detail: String| Err(ErrorKind::BlockMaskInput { detail }.into());
    let (m_blocks, n_blocks) = (shape.m_blocks(), shape.n_blocks());
    if kinds.len() != shape.block_rows() * n_blocks {
        return bad(format!(
            "{shape} has {} blocks, got {} kinds",
            shape.block_rows() * n_blocks,
            kinds.len()
        ));
    }
    if !bits.len().is_multiple_of(MASK_BLOCK) {
        return bad(format!("{} words of bits are no whole blocks", bits.len()));
    }
    let partials = bits.len() / MASK_BLOCK;
    for (x, &k) in kinds.iter().enumerate() {
        match k {
            KIND_EMPTY | KIND_FULL => {}
            p if p >= 0 && (p as usize) < partials => {
                let (mb, nb) = (x / n_blocks % m_blocks, x % n_blocks);
                let rows = (shape.seqlen_q - mb * MASK_BLOCK).min(MASK_BLOCK);
                let keys = span(0, (shape.seqlen_k - nb * MASK_BLOCK).min(MASK_BLOCK));
                let words = &bits[p as usize * MASK_BLOCK..][..MASK_BLOCK];
                if words
                    .iter()
                    .enumerate()
                    .any(|(r, &w)| w & !keys != 0 || (r >= rows && w != 0))
                {
                    return bad(format!("partial block {p} has bits past {shape}"));
                }
            }
            p => return bad(format!("block kind {p} (of {partials} partial blocks)")),
        }
    }
    Ok(())
}

/// Blocks of a [`BlockMask`] by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCounts {
    pub empty: usize,
    pub full: usize,
    pub partial: usize,
}

/// What a row shows of a key range ([`BlockMask::row_cover`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowCover {
    pub shown: bool,
    pub hidden: bool,
}

/// Builds a [`BlockMask`] from rows handed over in chunks of whole blocks, in any order: each
/// chunk is classified as it arrives, so only the summary and the partial blocks stay.
pub struct BlockMaskBuilder {
    shape: MaskShape,
    rows: Vec<Option<BlockRow>>,
}

impl BlockMaskBuilder {
    pub fn new(shape: MaskShape) -> Result<Self> {
        shape.check()?;
        let mut rows = Vec::new();
        // Without keys every block row is complete (and empty) already.
        rows.resize_with(shape.block_rows(), || {
            (shape.seqlen_k == 0).then(|| BlockRow {
                kinds: Vec::new(),
                bits: Vec::new(),
            })
        });
        Ok(BlockMaskBuilder { shape, rows })
    }

    pub fn shape(&self) -> MaskShape {
        self.shape
    }

    /// Rows `q0..q0 + n` of (sequence `b`, head `h`) from `mask`, `n` rows of `seqlen_k` bytes,
    /// nonzero where the query sees the key. `q0` is a multiple of [`MASK_BLOCK`], and `n` too
    /// unless the chunk ends at `seqlen_q`.
    pub fn rows(&mut self, b: usize, h: usize, q0: usize, mask: &[u8]) -> Result<()> {
        let sk = self.shape.seqlen_k;
        let n = mask.len().checked_div(sk).unwrap_or(0);
        if sk != 0 && mask.len() != n * sk {
            return Err(ErrorKind::BlockMaskInput {
                detail: format!(
                    "a chunk of {} bytes is not whole rows of {sk} keys",
                    mask.len()
                ),
            }
            .into());
        }
        self.rows_with(b, h, q0, n, |i| mask[i] != 0)
    }

    /// [`BlockMaskBuilder::rows`] with `shown(r * seqlen_k + j)` for row `q0 + r`, key `j`.
    fn rows_with(
        &mut self,
        b: usize,
        h: usize,
        q0: usize,
        n: usize,
        shown: impl Fn(usize) -> bool + Sync,
    ) -> Result<()> {
        let s = self.shape;
        let bad = |detail: String| Err(ErrorKind::BlockMaskInput { detail }.into());
        if b >= s.batch || h >= s.heads {
            return bad(format!("rows of (sequence {b}, head {h}) outside {s}"));
        }
        let end = q0.checked_add(n).filter(|&e| e <= s.seqlen_q);
        if !q0.is_multiple_of(MASK_BLOCK) || end.is_none() {
            return bad(format!(
                "rows {q0}..{q0}+{n} are not whole blocks of {MASK_BLOCK} rows within seqlen_q {}",
                s.seqlen_q
            ));
        }
        if !n.is_multiple_of(MASK_BLOCK) && end != Some(s.seqlen_q) {
            return bad(format!(
                "a chunk of {n} rows that does not end at seqlen_q {} must be whole blocks of \
                 {MASK_BLOCK} rows",
                s.seqlen_q
            ));
        }
        let sk = s.seqlen_k;
        let first = (b * s.heads + h) * s.m_blocks() + q0 / MASK_BLOCK;
        let done: Vec<BlockRow> = (0..n.div_ceil(MASK_BLOCK))
            .into_par_iter()
            .map(|c| {
                let r0 = c * MASK_BLOCK;
                block_row(sk, (n - r0).min(MASK_BLOCK), |r, j| {
                    shown((r0 + r) * sk + j)
                })
            })
            .collect();
        for (slot, row) in self.rows[first..].iter_mut().zip(done) {
            *slot = Some(row);
        }
        Ok(())
    }

    /// The mask, once every row was given.
    pub fn finish(self) -> Result<BlockMask> {
        let s = self.shape;
        let m_blocks = s.m_blocks();
        let mut rows = Vec::with_capacity(self.rows.len());
        for (br, row) in self.rows.into_iter().enumerate() {
            match row {
                Some(r) => rows.push(r),
                None => {
                    let (b, h) = (br / (s.heads * m_blocks), br / m_blocks % s.heads);
                    let q0 = br % m_blocks * MASK_BLOCK;
                    return Err(ErrorKind::BlockMaskInput {
                        detail: format!(
                            "rows from {q0} of (sequence {b}, head {h}) were never given"
                        ),
                    }
                    .into());
                }
            }
        }
        Ok(BlockMask::assemble(s, rows))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, heads: usize, seqlen_q: usize, seqlen_k: usize) -> MaskShape {
        MaskShape {
            batch,
            heads,
            seqlen_q,
            seqlen_k,
        }
    }

    fn f(x: MaskIndex) -> bool {
        match x.head {
            0 => x.k <= x.q,
            _ => !(x.q * 7 + x.k * 3 + x.batch).is_multiple_of(5),
        }
    }

    /// The parts rebuild the same mask; lengths, kinds and stray bits are refused.
    #[test]
    fn parts_round_trip_and_are_checked() {
        let s = shape(2, 2, 113, 203);
        let bm = BlockMask::from_fn(s, f).unwrap();
        let p = bm.to_parts();
        let back = BlockMask::from_parts(s, &p.kinds, &p.bits).unwrap();
        assert_eq!(back.to_parts(), p);
        // Read in place: the same mask; `owner` holds the arrays (a clone of them here).
        let held = Arc::new(p.clone());
        // SAFETY: `held` owns the arrays, is never written, and goes into the mask as owner.
        let lent = unsafe {
            BlockMask::from_parts_lent(s, &held.kinds, &held.bits, Box::new(held.clone()))
        }
        .unwrap();
        assert_eq!(lent.to_parts(), p);
        assert_eq!(lent.bytes(), back.bytes());
        // SAFETY: as above.
        let bad = unsafe {
            BlockMask::from_parts_lent(s, &held.kinds[1..], &held.bits, Box::new(held.clone()))
        };
        assert!(bad.is_err());
        for (b, h, i, j) in [
            (0, 0, 0, 0),
            (1, 1, 112, 202),
            (0, 1, 70, 130),
            (1, 0, 64, 63),
        ] {
            assert_eq!(back.allows(b, h, i, j), bm.allows(b, h, i, j));
            assert_eq!(lent.allows(b, h, i, j), bm.allows(b, h, i, j));
        }
        assert!(BlockMask::from_parts(s, &p.kinds[1..], &p.bits).is_err());
        assert!(BlockMask::from_parts(s, &p.kinds, &p.bits[1..]).is_err());
        let last = p.bits.len() / MASK_BLOCK;
        for k in [-3, last as i32] {
            let mut kinds = p.kinds.clone();
            kinds[0] = k;
            assert!(
                BlockMask::from_parts(s, &kinds, &p.bits).is_err(),
                "kind {k}"
            );
        }
        // Key 203 is past the edge of the last column of blocks (203 = 3 * 64 + 11).
        // Block (sequence 0, head 1, m_block 0, n_block 3) of 2 x 4 blocks per head.
        let edge = p.kinds[2 * 4 + 3];
        assert!(edge >= 0, "that block is partial");
        let mut bits = p.bits.clone();
        bits[edge as usize * MASK_BLOCK] |= 1 << 11;
        assert!(BlockMask::from_parts(s, &p.kinds, &bits).is_err());
    }

    /// Every pair, every row range and every hidden key against the function it was built from.
    #[test]
    fn queries_agree_with_the_function() {
        for (sq, sk) in [(1, 1), (64, 64), (113, 203), (203, 65), (130, 1)] {
            let s = shape(2, 2, sq, sk);
            let bm = BlockMask::from_fn(s, f).unwrap();
            for b in 0..2 {
                for h in 0..2 {
                    for i in 0..sq {
                        let want: Vec<bool> = (0..sk)
                            .map(|k| {
                                f(MaskIndex {
                                    batch: b,
                                    head: h,
                                    q: i,
                                    k,
                                })
                            })
                            .collect();
                        for (k, &w) in want.iter().enumerate() {
                            assert_eq!(bm.allows(b, h, i, k), w, "{s} ({b} {h} {i} {k})");
                        }
                        for (lo, hi) in [(0, sk), (sk / 3, sk), (sk / 4, (sk / 2).max(sk / 4 + 1))]
                        {
                            let c = bm.row_cover(b, h, i, lo, hi);
                            assert_eq!(c.shown, want[lo..hi].iter().any(|&x| x));
                            assert_eq!(c.hidden, want[lo..hi].iter().any(|&x| !x));
                            let mut got = Vec::new();
                            bm.for_each_hidden(b, h, i, (lo, hi), |j| got.push(j));
                            let exp: Vec<usize> = (lo..hi).filter(|&j| !want[j]).collect();
                            assert_eq!(got, exp);
                        }
                    }
                }
            }
            let c = bm.block_counts();
            assert_eq!(
                c.empty + c.full + c.partial,
                4 * sq.div_ceil(64) * sk.div_ceil(64)
            );
        }
    }

    /// Dense and chunked construction give the function's mask; a missing chunk is an error.
    #[test]
    fn dense_and_chunks_agree() {
        let s = shape(1, 2, 150, 70);
        let by_fn = BlockMask::from_fn(s, f).unwrap();
        let dense: Vec<bool> = (0..2 * 150 * 70)
            .map(|x| {
                let (h, i, k) = (x / (150 * 70), x / 70 % 150, x % 70);
                f(MaskIndex {
                    batch: 0,
                    head: h,
                    q: i,
                    k,
                })
            })
            .collect();
        let d = BlockMask::from_dense(s, &dense).unwrap();
        let mut b = BlockMaskBuilder::new(s).unwrap();
        let bytes: Vec<u8> = dense.iter().map(|&x| x as u8).collect();
        for h in [1, 0] {
            let head = &bytes[h * 150 * 70..(h + 1) * 150 * 70];
            b.rows(0, h, 128, &head[128 * 70..]).unwrap();
            b.rows(0, h, 0, &head[..128 * 70]).unwrap();
        }
        let c = b.finish().unwrap();
        for m in [&d, &c] {
            assert_eq!(m.to_parts(), by_fn.to_parts());
        }
        let mut b = BlockMaskBuilder::new(s).unwrap();
        b.rows(0, 0, 0, &bytes[..150 * 70]).unwrap();
        assert!(b.finish().is_err());
        let mut b = BlockMaskBuilder::new(s).unwrap();
        assert!(b.rows(0, 0, 10, &bytes[..64 * 70]).is_err());
        assert!(b.rows(0, 0, 0, &bytes[..100 * 70]).is_err());
        assert!(b.rows(0, 2, 0, &bytes[..64 * 70]).is_err());
        assert!(b.rows(0, 0, 0, &bytes[..64 * 70 + 1]).is_err());
        assert!(BlockMask::from_dense(s, &dense[1..]).is_err());
    }
}

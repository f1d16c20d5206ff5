//! The one owner of masking and iteration bounds: which keys a query row sees, which key blocks a
//! query block visits, and which of those need the per-element mask.
//!
//! Causal is the window (-1, 0). With `offset = seqlen_k - seqlen_q` (bottom-right alignment), query
//! row `i` sees key `j` iff `i + offset - left <= j <= i + offset + right`, clipped to `0..seqlen_k`.
//! Both ends grow with `i`, so a block of rows `m0..m1` sees at most keys `lo(m0)..hi(m1 - 1)`, and
//! every row of it sees all of `n0..n1` iff `lo(m1 - 1) <= n0` and `hi(m0) >= n1`.

use std::fmt;
use std::sync::Arc;

use crate::block_mask::BlockMask;
pub use crate::block_mask::MaskIndex;

/// A custom mask (FlexAttention's `mask_mod`): key `k` is visible to query `q` iff the built-in
/// masks (causal, window) and the mask both allow it. Either a function, which must be pure (the
/// kernels call it any number of times per pair, in any order, from several threads), or a
/// [`BlockMask`] evaluated once, which answers the same questions from its block summaries and
/// bits. CPU only.
#[derive(Clone)]
pub struct MaskMod(Source);

#[derive(Clone)]
enum Source {
    Fn(Arc<dyn Fn(MaskIndex) -> bool + Send + Sync>),
    Blocks(BlockMask),
}

impl MaskMod {
    pub fn new(f: impl Fn(MaskIndex) -> bool + Send + Sync + 'static) -> Self {
        MaskMod(Source::Fn(Arc::new(f)))
    }

    /// Whether the mask shows key `k` to query `q` of (sequence `batch`, head `head`).
    #[inline]
    pub fn allows(&self, batch: usize, head: usize, q: usize, k: usize) -> bool {
        match &self.0 {
            Source::Fn(f) => f(MaskIndex { batch, head, q, k }),
            Source::Blocks(m) => m.allows(batch, head, q, k),
        }
    }

    /// The block mask this was made from, if any.
    pub fn block_mask(&self) -> Option<&BlockMask> {
        match &self.0 {
            Source::Fn(_) => None,
            Source::Blocks(m) => Some(m),
        }
    }

    /// How much of the block of rows `m0..m1` × keys `n0..n1` of (sequence b, head h) both
    /// `mask` and this mask show. A function is called for each pair `mask` shows until both a
    /// shown and a hidden pair are found; a block mask looks up each mask block a row touches.
    pub(crate) fn cover(
        &self,
        (b, h): (usize, usize),
        (m0, m1): (usize, usize),
        (n0, n1): (usize, usize),
        mask: &Mask,
    ) -> Cover {
        let (mut shown, mut hidden) = (false, false);
        for i in m0..m1 {
            let (lo, hi) = mask.key_range(i);
            let (lo, hi) = (lo.max(n0), hi.min(n1));
            hidden |= lo > n0 || hi < n1;
            match &self.0 {
                Source::Fn(_) => {
                    for j in lo..hi {
                        if self.allows(b, h, i, j) {
                            shown = true;
                        } else {
                            hidden = true;
                        }
                        if shown && hidden {
                            return Cover::Some;
                        }
                    }
                }
                Source::Blocks(m) if lo < hi => {
                    let c = m.row_cover(b, h, i, lo, hi);
                    shown |= c.shown;
                    hidden |= c.hidden;
                }
                Source::Blocks(_) => {}
            }
            if shown && hidden {
                return Cover::Some;
            }
        }
        match (shown, hidden) {
            (false, _) => Cover::None,
            (true, false) => Cover::All,
            (true, true) => Cover::Some,
        }
    }

    /// Sets to -inf the scores of the block (keys `n0..n0 + cols` in rows of `st`, query rows
    /// `m0..m0 + rows` in lanes, `np` per key) that `mask` shows and the function hides.
    pub(crate) fn hide(
        &self,
        (b, h): (usize, usize),
        st: &mut [f32],
        np: usize,
        (m0, rows): (usize, usize),
        (n0, cols): (usize, usize),
        mask: &Mask,
    ) {
        for r in 0..rows {
            let (lo, hi) = mask.key_range(m0 + r);
            let (lo, hi) = (lo.max(n0), hi.min(n0 + cols));
            let hide = |j: usize| st[(j - n0) * np + r] = f32::NEG_INFINITY;
            match &self.0 {
                Source::Fn(f) => (lo..hi)
                    .filter(|&k| {
                        !f(MaskIndex {
                            batch: b,
                            head: h,
                            q: m0 + r,
                            k,
                        })
                    })
                    .for_each(hide),
                Source::Blocks(m) if lo < hi => m.for_each_hidden(b, h, m0 + r, (lo, hi), hide),
                Source::Blocks(_) => {}
            }
        }
    }
}

impl From<BlockMask> for MaskMod {
    fn from(m: BlockMask) -> Self {
        MaskMod(Source::Blocks(m))
    }
}

impl fmt::Debug for MaskMod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Fn(_) => f.write_str("MaskMod(<fn>)"),
            Source::Blocks(m) => write!(f, "MaskMod({m:?})"),
        }
    }
}

/// How much of a block a mask shows ([`MaskMod::cover`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cover {
    /// No pair: the block is skipped.
    None,
    /// Some pairs: the block takes the masked path.
    Some,
    /// Every pair: the block takes the unmasked path.
    All,
}

/// The visibility rule of one sequence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mask {
    seqlen_k: usize,
    offset: i64,
    left: Option<usize>,
    right: Option<usize>,
}

impl Mask {
    pub fn new(
        seqlen_q: usize,
        seqlen_k: usize,
        left: Option<usize>,
        right: Option<usize>,
    ) -> Self {
        Mask {
            seqlen_k,
            offset: seqlen_k as i64 - seqlen_q as i64,
            left,
            right,
        }
    }

    /// First visible key of row `i` (clipped to `0..=seqlen_k`).
    #[inline]
    fn lo(&self, i: usize) -> usize {
        match self.left {
            None => 0,
            // i128: window sides up to i64::MAX cannot overflow.
            Some(l) => {
                (i as i128 + self.offset as i128 - l as i128).clamp(0, self.seqlen_k as i128)
                    as usize
            }
        }
    }

    /// One past the last visible key of row `i` (clipped to `0..=seqlen_k`).
    #[inline]
    fn hi(&self, i: usize) -> usize {
        match self.right {
            None => self.seqlen_k,
            Some(r) => (i as i128 + self.offset as i128 + r as i128 + 1)
                .clamp(0, self.seqlen_k as i128) as usize,
        }
    }

    /// The keys row `i` sees, `lo..hi`; empty (`lo >= hi`) when the row is fully masked.
    #[inline]
    pub fn key_range(&self, i: usize) -> (usize, usize) {
        (self.lo(i), self.hi(i))
    }

    /// Key blocks `n_min..n_max` of width `block_n` that rows `m0..m1` (non-empty) must visit.
    pub fn n_block_range(&self, m0: usize, m1: usize, block_n: usize) -> (usize, usize) {
        let (lo, hi) = (self.lo(m0), self.hi(m1 - 1));
        if hi <= lo {
            return (0, 0);
        }
        (lo / block_n, hi.div_ceil(block_n))
    }

    /// Whether some row of `m0..m1` does not see some key of `n0..n1` (then the block is masked
    /// element by element; otherwise the mask is skipped).
    #[inline]
    pub fn needs_mask(&self, m0: usize, m1: usize, n0: usize, n1: usize) -> bool {
        !(self.lo(m1 - 1) <= n0 && self.hi(m0) >= n1)
    }

    /// How much of rows `m0..m1` × keys `n0..n1` of (sequence b, head h) this mask and `mask_mod`
    /// show. Without a function never [`Cover::None`]: the blocks [`Mask::n_block_range`] gives
    /// are all visited, masked where [`Mask::needs_mask`] says.
    pub fn cover(
        &self,
        mask_mod: Option<&MaskMod>,
        bh: (usize, usize),
        (m0, m1): (usize, usize),
        (n0, n1): (usize, usize),
    ) -> Cover {
        match mask_mod {
            Some(f) => f.cover(bh, (m0, m1), (n0, n1), self),
            None if self.needs_mask(m0, m1, n0, n1) => Cover::Some,
            None => Cover::All,
        }
    }

    /// Signed distance `i + offset - j` that ALiBi's bias uses.
    #[inline]
    pub fn diagonal_distance(&self, i: usize, j: usize) -> i64 {
        i as i64 + self.offset - j as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(m: &Mask, i: usize, j: usize) -> bool {
        let (lo, hi) = m.key_range(i);
        lo <= j && j < hi
    }

    /// Exhaustive check of the block bounds against the per-element rule on small shapes.
    #[test]
    fn block_bounds_agree_with_elementwise_rule() {
        let windows = [None, Some(0), Some(1), Some(5), Some(40)];
        for sq in [1usize, 3, 7, 16, 33] {
            for sk in [0usize, 1, 5, 16, 40] {
                for &left in &windows {
                    for &right in &windows {
                        let m = Mask::new(sq, sk, left, right);
                        for bm in [1usize, 4, 16] {
                            for bn in [1usize, 3, 16] {
                                for m0 in (0..sq).step_by(bm) {
                                    let m1 = (m0 + bm).min(sq);
                                    let (nb0, nb1) = m.n_block_range(m0, m1, bn);
                                    for j in 0..sk {
                                        let in_range = j / bn >= nb0 && j / bn < nb1;
                                        let any = (m0..m1).any(|i| visible(&m, i, j));
                                        assert!(in_range || !any, "sq={sq} sk={sk} {left:?} {right:?} rows {m0}..{m1} key {j}");
                                    }
                                    for nb in nb0..nb1 {
                                        let (n0, n1) = (nb * bn, ((nb + 1) * bn).min(sk));
                                        let all =
                                            (m0..m1).all(|i| (n0..n1).all(|j| visible(&m, i, j)));
                                        assert_eq!(!m.needs_mask(m0, m1, n0, n1), all);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// `cover` and `hide` against the per-element rule, with a function that hides some pairs and
    /// the block mask built from it (tiles within one mask block and spanning several).
    #[test]
    fn cover_and_hide_agree_with_elementwise_rule() {
        let g = |x: MaskIndex| !(x.q * 3 + x.k + x.head).is_multiple_of(5) && x.k != 4;
        for (sq, sk) in [(1usize, 1usize), (7, 16), (16, 7), (33, 40), (130, 150)] {
            let shape = crate::MaskShape {
                batch: 1,
                heads: 2,
                seqlen_q: sq,
                seqlen_k: sk,
            };
            let blocks = MaskMod::from(BlockMask::from_fn(shape, g).unwrap());
            for f in [MaskMod::new(g), blocks] {
                let shown = |m: &Mask, i, j| {
                    visible(m, i, j)
                        && g(MaskIndex {
                            batch: 0,
                            head: 1,
                            q: i,
                            k: j,
                        })
                };
                for (left, right) in [(None, None), (None, Some(0)), (Some(2), Some(1))] {
                    let m = Mask::new(sq, sk, left, right);
                    for (bm, bn) in [(1usize, 1usize), (4, 3), (16, 16), (80, 100)] {
                        for m0 in (0..sq).step_by(bm) {
                            let m1 = (m0 + bm).min(sq);
                            for n0 in (0..sk).step_by(bn) {
                                let n1 = (n0 + bn).min(sk);
                                let pairs = || (m0..m1).flat_map(|i| (n0..n1).map(move |j| (i, j)));
                                let want = if pairs().all(|(i, j)| shown(&m, i, j)) {
                                    Cover::All
                                } else if pairs().any(|(i, j)| shown(&m, i, j)) {
                                    Cover::Some
                                } else {
                                    Cover::None
                                };
                                let got = m.cover(Some(&f), (0, 1), (m0, m1), (n0, n1));
                                assert_eq!(
                                    got, want,
                                    "{f:?} {sq}x{sk} {left:?} {right:?} {m0}..{m1} {n0}..{n1}"
                                );
                                let (rows, cols, np) = (m1 - m0, n1 - n0, m1 - m0 + 1);
                                let mut st = vec![1.0f32; cols * np];
                                f.hide((0, 1), &mut st, np, (m0, rows), (n0, cols), &m);
                                for (i, j) in pairs() {
                                    let hidden = visible(&m, i, j) && !shown(&m, i, j);
                                    let x = st[(j - n0) * np + i - m0];
                                    assert_eq!(x == f32::NEG_INFINITY, hidden, "({i}, {j})");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn causal_is_bottom_right_aligned() {
        // seqlen_q = 2, seqlen_k = 5: row 0 sees keys 0..=3, row 1 sees 0..=4.
        let m = Mask::new(2, 5, None, Some(0));
        assert_eq!(m.key_range(0), (0, 4));
        assert_eq!(m.key_range(1), (0, 5));
        // seqlen_q = 5, seqlen_k = 2: rows 0..=2 see nothing.
        let m = Mask::new(5, 2, None, Some(0));
        assert!(m.key_range(2).0 >= m.key_range(2).1);
        assert_eq!(m.key_range(3), (0, 1));
    }
}

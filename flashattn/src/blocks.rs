//! The one owner of masking and iteration bounds: which keys a query row sees, which key blocks a
//! query block visits, and which of those need the per-element mask.
//!
//! Causal is the window (-1, 0). With `offset = seqlen_k - seqlen_q` (bottom-right alignment), query
//! row `i` sees key `j` iff `i + offset - left <= j <= i + offset + right`, clipped to `0..seqlen_k`.
//! Both ends grow with `i`, so a block of rows `m0..m1` sees at most keys `lo(m0)..hi(m1 - 1)`, and
//! every row of it sees all of `n0..n1` iff `lo(m1 - 1) <= n0` and `hi(m0) >= n1`.

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

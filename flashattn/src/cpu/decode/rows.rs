//! The rows the products read: [`KeyRows`], where a kv head's k or v rows of a tile's keys lie in
//! a cache, and [`PRows`], the probabilities of a few query rows for P·V.

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
    pub(super) keys: &'a [usize],
    last: usize,
    pub(super) head: usize,
    pub(super) d: usize,
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
    pub(super) fn check(&self, len: usize) {
        // The row furthest in ends furthest in: one bound for all keys.
        let inside = self
            .last
            .checked_add(self.head)
            .and_then(|x| x.checked_add(self.d))
            .is_some_and(|e| e <= len);
        assert!(inside, "decode: key rows out of bounds");
    }
}

/// Probabilities of a few query rows for [`pv_acc`]: `f32[c · np + r]` for row `r < rows` and key
/// `c` (a window into a wider tile), and, when the bf16 dot product is to be used, the same as
/// bf16 pairs of keys: `bf16_pairs[cp · np + r]` = (key 2cp, key 2cp + 1) of row r, as
/// [`Kernels::pack_pairs_bf16`] writes them.
///
/// [`pv_acc`]: super::pv::pv_acc
/// [`Kernels::pack_pairs_bf16`]: crate::cpu::simd::Kernels::pack_pairs_bf16
#[derive(Clone, Copy, Debug)]
pub(crate) struct PRows<'a> {
    pub f32: &'a [f32],
    pub bf16_pairs: Option<&'a [u32]>,
    pub rows: usize,
    pub np: usize,
}

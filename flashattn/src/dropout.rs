//! Dropout on the attention probabilities, with a keep-mask that is never stored.
//!
//! Each (sequence, head, query row, key) gets a 32-bit uniform number from Philox 4x32-10
//! (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), a counter-based
//! generator: the number is a pure function of the seed and the position, so the forward and
//! backward passes regenerate the same mask tile by tile, on any number of threads, and a GPU kernel
//! can reproduce it bit for bit.
//!
//! Layout: key `(seed low 32 bits, seed high 32 bits)`; counter `(key / 4, query row, head, sequence)`;
//! the 4 output words serve keys `4·(key / 4) + 0..4`. A key is kept iff its word is below
//! `round((1 - p) · 2^32)`; kept probabilities are multiplied by `1 / (1 - p)`.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4x32 with 10 rounds.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 as u64 * c[0] as u64;
        let p1 = M1 as u64 * c[2] as u64;
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// Dropout parameters, validated (`0 < p < 1`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    p: f32,
    seed: u64,
    /// Keep iff the random word is `< threshold` (at most 2^32).
    threshold: u64,
}

impl Dropout {
    /// `None` when `p == 0` (no dropout). `p` must lie in `[0, 1)`; callers validate.
    pub(crate) fn new(p: f32, seed: u64) -> Option<Self> {
        (p > 0.0).then(|| Dropout {
            p,
            seed,
            threshold: ((1.0 - p as f64) * 4_294_967_296.0).round() as u64,
        })
    }

    pub fn p(&self) -> f32 {
        self.p
    }

    /// The factor applied to kept probabilities, `1 / (1 - p)`.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.p as f64)) as f32
    }

    /// The mask's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A key is kept iff its 32-bit word is below this (`round((1 - p) · 2^32)`, at most 2^32).
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    fn key(&self) -> [u32; 2] {
        [self.seed as u32, (self.seed >> 32) as u32]
    }

    /// Fills `keep[c]` for keys `n0..n0 + keep.len()` of (sequence `b`, head `h`, query `row`).
    pub(crate) fn keep_row(&self, b: usize, h: usize, row: usize, n0: usize, keep: &mut [bool]) {
        let key = self.key();
        let mut j = n0;
        let end = n0 + keep.len();
        while j < end {
            let group = j / 4;
            let words = philox4x32_10([group as u32, row as u32, h as u32, b as u32], key);
            let stop = end.min(group * 4 + 4);
            for jj in j..stop {
                keep[jj - n0] = (words[jj % 4] as u64) < self.threshold;
            }
            j = stop;
        }
    }
}

/// The keep-mask of one (sequence `b`, head `h`) as `seqlen_q x seqlen_k` booleans, row-major,
/// exactly as the forward and backward passes regenerate it (like flash-attn's
/// `return_attn_probs`, for tests and debugging). All `true` when `p == 0`.
pub fn keep_mask(
    seed: u64,
    p: f32,
    b: usize,
    h: usize,
    seqlen_q: usize,
    seqlen_k: usize,
) -> Vec<bool> {
    let mut keep = vec![true; seqlen_q * seqlen_k];
    if let Some(d) = Dropout::new(p, seed).filter(|_| seqlen_k > 0) {
        for (row, chunk) in keep.chunks_exact_mut(seqlen_k).enumerate() {
            d.keep_row(b, h, row, 0, chunk);
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of Random123's `kat_vectors` for philox4x32 10.
    #[test]
    fn philox_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    /// A row generated in pieces (as tiles do) equals the row generated at once.
    #[test]
    fn tiles_agree_with_whole_rows() {
        let d = Dropout::new(0.3, 0xDEAD_BEEF_1234).unwrap();
        let mut whole = vec![false; 203];
        d.keep_row(1, 2, 7, 0, &mut whole);
        let mut pieces = vec![false; 203];
        for (n0, n1) in [(0, 5), (5, 64), (64, 67), (67, 203)] {
            d.keep_row(1, 2, 7, n0, &mut pieces[n0..n1]);
        }
        assert_eq!(whole, pieces);
    }

    /// Keep rate within 5 standard deviations of 1 - p.
    #[test]
    fn keep_rate_matches() {
        for p in [0.1f32, 0.5, 0.9] {
            let m = keep_mask(42, p, 0, 3, 256, 512);
            let n = m.len() as f64;
            let rate = m.iter().filter(|&&k| k).count() as f64 / n;
            let q = 1.0 - p as f64;
            let sigma = (q * (1.0 - q) / n).sqrt();
            assert!(
                (rate - q).abs() < 5.0 * sigma,
                "p={p}: keep rate {rate}, expected {q} ± {sigma}"
            );
        }
    }
}

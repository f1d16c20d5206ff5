//! Which lanes and keys of a masked key block the products compute.
//!
//! On a block the mask cuts (the diagonal of causal, a window's edges), a query row sees a run of
//! its keys that grows with the row ([`crate::blocks`]), so the rows that see any key of the block
//! are one run of lanes, and a group of lanes sees no key past the one its last row sees. The
//! block is computed as a few [`Part`]s: lane strips of the rows that see something, each with
//! only the keys up to the last one its rows see. Lanes outside every part would have had -inf
//! scores only (their row statistics and acc_o unchanged), and the keys cut off the end of a part
//! only probabilities of 0 added after its others: the lanes computed get the same values, and the
//! products' sums over keys keep their chunk boundaries (leading keys are never cut).

use crate::blocks::Mask;
use crate::cpu::simd::{Isa, LANES};

/// Lanes `l0..l1` (multiples of [`LANES`]) × keys `n0..n0 + cols` of a key block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Part {
    pub l0: usize,
    pub l1: usize,
    pub cols: usize,
}

/// Lanes per strip whose keys are cut separately: one strip of the AVX2 products (16 lanes); the
/// AVX-512 products keep two vectors per strip (their tiles lose FMA chains below that).
pub(super) fn strip_lanes(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 2 * LANES,
        _ => LANES,
    }
}

/// The parts of key block `n0..n1` for query rows `m0..m0 + rows` (lanes `0..np`), strips of
/// `strip` lanes (a multiple of [`LANES`]) with the same key count merged; `out` receives them,
/// in lane order. No part when no row sees a key of the block.
pub(super) fn masked_parts(
    mask: &Mask,
    (m0, rows, np): (usize, usize, usize),
    (n0, n1): (usize, usize),
    strip: usize,
    out: &mut Vec<Part>,
) {
    out.clear();
    let sees = |r: usize| {
        let (lo, hi) = mask.key_range(m0 + r);
        lo < hi && lo < n1 && hi > n0
    };
    let Some(first) = (0..rows).find(|&r| sees(r)) else {
        return;
    };
    // Both ends of the visible keys grow with the row: the rows that see the block are a run.
    let last = (first..rows).rev().find(|&r| sees(r)).unwrap_or(first);
    let l0 = first / LANES * LANES;
    let l1 = (last + 1).div_ceil(LANES) * LANES;
    debug_assert!(l1 <= np);
    let mut s = l0;
    while s < l1 {
        let e = (s + strip).min(l1);
        // The strip's last row sees the most keys of it.
        let r = (e.min(last + 1)) - 1;
        let cols = mask.key_range(m0 + r).1.min(n1) - n0;
        match out.last_mut() {
            Some(prev) if prev.cols == cols => prev.l1 = e,
            _ => out.push(Part { l0: s, l1: e, cols }),
        }
        s = e;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the per-element rule: every visible pair lies in a part, and the lanes and keys
    /// outside the parts see nothing.
    #[test]
    fn parts_cover_every_visible_pair() {
        let windows = [None, Some(0), Some(3), Some(40)];
        for (sq, sk) in [
            (96usize, 96usize),
            (100, 37),
            (37, 100),
            (128, 128),
            (20, 300),
        ] {
            for &left in &windows {
                for &right in &windows {
                    let m = Mask::new(sq, sk, left, right);
                    for (bm, strip) in [(96usize, 16usize), (128, 32), (64, 16)] {
                        for m0 in (0..sq).step_by(bm) {
                            let rows = (m0 + bm).min(sq) - m0;
                            let np = rows.div_ceil(LANES) * LANES;
                            for n0 in (0..sk).step_by(64) {
                                let n1 = (n0 + 64).min(sk);
                                let mut parts = Vec::new();
                                masked_parts(&m, (m0, rows, np), (n0, n1), strip, &mut parts);
                                for w in parts.windows(2) {
                                    assert_eq!(w[0].l1, w[1].l0);
                                    assert_ne!(w[0].cols, w[1].cols);
                                }
                                for r in 0..rows {
                                    let (lo, hi) = m.key_range(m0 + r);
                                    for j in n0..n1 {
                                        if !(lo <= j && j < hi) {
                                            continue;
                                        }
                                        let inside = parts
                                            .iter()
                                            .any(|p| p.l0 <= r && r < p.l1 && j < n0 + p.cols);
                                        assert!(
                                            inside,
                                            "{sq}x{sk} {left:?} {right:?} row {r} key {j}: {parts:?}"
                                        );
                                    }
                                }
                                for p in &parts {
                                    assert!(p.l0 % LANES == 0 && p.l1 % LANES == 0);
                                    assert!(p.l0 < p.l1 && p.l1 <= np);
                                    assert!(p.cols >= 1 && p.cols <= n1 - n0);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The causal diagonal of 128 rows × 64 keys: the second key block skips the first 64 rows,
    /// and each 32-lane strip keeps the keys up to its last row's.
    #[test]
    fn causal_diagonal_parts() {
        let m = Mask::new(1024, 1024, None, Some(0));
        let mut parts = Vec::new();
        masked_parts(&m, (128, 128, 128), (192, 256), 32, &mut parts);
        let want = [
            Part {
                l0: 64,
                l1: 96,
                cols: 32,
            },
            Part {
                l0: 96,
                l1: 128,
                cols: 64,
            },
        ];
        assert_eq!(parts, want);
        masked_parts(&m, (128, 128, 128), (128, 192), 32, &mut parts);
        assert_eq!(
            parts,
            [
                Part {
                    l0: 0,
                    l1: 32,
                    cols: 32
                },
                Part {
                    l0: 32,
                    l1: 128,
                    cols: 64
                }
            ]
        );
    }
}

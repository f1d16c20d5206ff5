//! AVX2 + FMA kernels of the backward pass only (8 f32 lanes).
//!
//! Safety: as in `x86_avx2`: the CPU has the features of each `target_feature` attribute, and the
//! operands passed [`super::Kernels`]'s checks.

use super::x86_avx2::exp2_ps;
use std::arch::x86_64::*;

const W: usize = 8;

/// [`super::Kernels::probs_and_ds`]: per element of `cols` rows of `n` lanes, `x = s ·
/// scale_log2`, `p = exp2(x - lse_log2)`, `ds = p · (dp - delta) · scale`, in one pass over the
/// tile; the same operations, in the same order, as the scale multiply, `online_softmax` and
/// the dS loop one after the other.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn probs_and_ds(
    pt: &mut [f32],
    ds: &mut [f32],
    cols: usize,
    n: usize,
    scale_log2: f32,
    lse_log2: &[f32],
    delta: &[f32],
    scale: f32,
) {
    let (pp, dp) = (pt.as_mut_ptr(), ds.as_mut_ptr());
    let (sl, sc) = (_mm256_set1_ps(scale_log2), _mm256_set1_ps(scale));
    for j in (0..n).step_by(W) {
        let m = _mm256_loadu_ps(lse_log2.as_ptr().add(j));
        let dl = _mm256_loadu_ps(delta.as_ptr().add(j));
        for c in 0..cols {
            let (ps, dsp) = (pp.add(c * n + j), dp.add(c * n + j));
            let x = _mm256_mul_ps(_mm256_loadu_ps(ps), sl);
            let p = exp2_ps(_mm256_sub_ps(x, m));
            _mm256_storeu_ps(ps, p);
            let g = _mm256_sub_ps(_mm256_loadu_ps(dsp), dl);
            _mm256_storeu_ps(dsp, _mm256_mul_ps(_mm256_mul_ps(p, g), sc));
        }
    }
}

/// [`super::Kernels::transpose`] in 8×8 blocks (AVX: also the AVX-512 table's): `dst[c · ds +
/// r] = src[r · ss + c]` for `r < rows`, `c < cols`; the edges past the last whole blocks element
/// by element. Eight rows load as eight vectors and leave as eight, through 24 shuffles, instead
/// of 64 scalar loads and stores (the backward's query tiles and dQ rows).
#[target_feature(enable = "avx")]
pub(crate) unsafe fn transpose(
    src: &[f32],
    ss: usize,
    (rows, cols): (usize, usize),
    dst: &mut [f32],
    ds: usize,
) {
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    let (r8, c8) = (rows - rows % W, cols - cols % W);
    for r0 in (0..r8).step_by(W) {
        for c0 in (0..c8).step_by(W) {
            let s = sp.add(r0 * ss + c0);
            let x: [__m256; W] = std::array::from_fn(|i| _mm256_loadu_ps(s.add(i * ss)));
            // Pairs of rows interleaved, then quads, then the 128-bit halves swapped.
            let lo01 = _mm256_unpacklo_ps(x[0], x[1]);
            let hi01 = _mm256_unpackhi_ps(x[0], x[1]);
            let lo23 = _mm256_unpacklo_ps(x[2], x[3]);
            let hi23 = _mm256_unpackhi_ps(x[2], x[3]);
            let lo45 = _mm256_unpacklo_ps(x[4], x[5]);
            let hi45 = _mm256_unpackhi_ps(x[4], x[5]);
            let lo67 = _mm256_unpacklo_ps(x[6], x[7]);
            let hi67 = _mm256_unpackhi_ps(x[6], x[7]);
            let q0 = _mm256_shuffle_ps::<0x44>(lo01, lo23);
            let q1 = _mm256_shuffle_ps::<0xEE>(lo01, lo23);
            let q2 = _mm256_shuffle_ps::<0x44>(hi01, hi23);
            let q3 = _mm256_shuffle_ps::<0xEE>(hi01, hi23);
            let q4 = _mm256_shuffle_ps::<0x44>(lo45, lo67);
            let q5 = _mm256_shuffle_ps::<0xEE>(lo45, lo67);
            let q6 = _mm256_shuffle_ps::<0x44>(hi45, hi67);
            let q7 = _mm256_shuffle_ps::<0xEE>(hi45, hi67);
            let out = [
                _mm256_permute2f128_ps::<0x20>(q0, q4),
                _mm256_permute2f128_ps::<0x20>(q1, q5),
                _mm256_permute2f128_ps::<0x20>(q2, q6),
                _mm256_permute2f128_ps::<0x20>(q3, q7),
                _mm256_permute2f128_ps::<0x31>(q0, q4),
                _mm256_permute2f128_ps::<0x31>(q1, q5),
                _mm256_permute2f128_ps::<0x31>(q2, q6),
                _mm256_permute2f128_ps::<0x31>(q3, q7),
            ];
            let d = dp.add(c0 * ds + r0);
            for (j, v) in out.into_iter().enumerate() {
                _mm256_storeu_ps(d.add(j * ds), v);
            }
        }
    }
    for r in 0..rows {
        let c_from = if r < r8 { c8 } else { 0 };
        for c in c_from..cols {
            *dp.add(c * ds + r) = *sp.add(r * ss + c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Isa, Kernels};

    /// The fused pass gives the bits of the separate passes it replaces (scale multiply,
    /// `online_softmax`, dS loop), on every lane whose row is used, with masked (+inf) rows too;
    /// on every x86 table this CPU runs (AVX2 here, AVX-512 in `x86_avx512_bwd`).
    #[test]
    fn probs_and_ds_match_the_separate_passes() {
        for isa in [Isa::Avx2, Isa::Avx512] {
            let Ok(kern) = Kernels::for_isa(isa) else {
                continue;
            };
            assert!(kern.has_probs_and_ds(), "{isa}");
            for (cols, n, rows) in [(37, 64, 53), (64, 64, 64), (5, 16, 1), (64, 128, 97)] {
                check(kern, (cols, n, rows));
            }
        }
    }

    /// The 8×8 blocks and the edges put every element where the element-by-element loop does
    /// and write nothing else (row and column counts around the blocks, strides wider than the
    /// operands).
    #[test]
    fn transpose_matches_the_loop() {
        for isa in [Isa::Avx2, Isa::Avx512, Isa::Scalar] {
            let Ok(kern) = Kernels::for_isa(isa) else {
                continue;
            };
            for rows in [1, 7, 8, 9, 16, 23, 64] {
                for cols in [1, 5, 8, 13, 40, 64] {
                    let (ss, ds) = (cols + 3, rows + 5);
                    let src: Vec<f32> = (0..rows * ss).map(|i| i as f32).collect();
                    let mut want = vec![-1f32; cols * ds];
                    for r in 0..rows {
                        for c in 0..cols {
                            want[c * ds + r] = src[r * ss + c];
                        }
                    }
                    let mut got = vec![-1f32; cols * ds];
                    kern.transpose(&src, ss, (rows, cols), &mut got, ds);
                    assert_eq!(want, got, "{isa} rows {rows} cols {cols}");
                }
            }
        }
    }

    fn check(kern: &Kernels, (cols, n, rows): (usize, usize, usize)) {
        let ctx = format!("{} cols {cols} n {n} rows {rows}", kern.isa);
        let mut x = 12345u32;
        let mut next = || {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        };
        let s: Vec<f32> = (0..cols * n).map(|_| 12.0 * next()).collect();
        let dp: Vec<f32> = (0..cols * n).map(|_| 3.0 * next()).collect();
        let mut lse: Vec<f32> = (0..n).map(|_| 8.0 * next()).collect();
        let mut delta: Vec<f32> = (0..n).map(|_| next()).collect();
        lse[rows / 2] = f32::INFINITY;
        for r in rows..n {
            lse[r] = f32::INFINITY;
            delta[r] = 0.0;
        }
        let (scale_log2, scale) = (0.127_525_5_f32, 0.088_388_35_f32);
        // The separate passes.
        let mut pt = s.clone();
        pt.iter_mut().for_each(|x| *x *= scale_log2);
        let (mut sink, ones) = (vec![0f32; n], vec![1f32; n]);
        kern.online_softmax(&mut pt, cols, n, &lse, &mut sink, &ones);
        let mut ds = dp.clone();
        for (pr, dr) in pt.chunks_exact(n).zip(ds.chunks_exact_mut(n)) {
            for ((g, &prob), &dl) in dr[..rows].iter_mut().zip(&pr[..rows]).zip(&delta) {
                *g = prob * (*g - dl) * scale;
            }
        }
        // The fused one.
        let (mut pt2, mut ds2) = (s.clone(), dp.clone());
        let lanes = (cols, n);
        assert!(kern.probs_and_ds(&mut pt2, &mut ds2, lanes, scale_log2, &lse, &delta, scale));
        for c in 0..cols {
            for r in 0..rows {
                let at = c * n + r;
                assert_eq!(pt[at].to_bits(), pt2[at].to_bits(), "p at {c}, {r}: {ctx}");
                assert_eq!(ds[at].to_bits(), ds2[at].to_bits(), "ds at {c}, {r}: {ctx}");
            }
            for r in rows..n {
                assert_eq!(pt2[c * n + r], 0.0, "padded p at {c}, {r}: {ctx}");
            }
        }
    }
}

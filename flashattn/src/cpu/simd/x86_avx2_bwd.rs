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

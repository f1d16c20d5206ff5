//! AVX-512 kernels of the backward pass only (16 f32 lanes): the fused P and dS pass.
//!
//! Safety: as in `x86_avx512`: the CPU has the features of each `target_feature` attribute, and
//! the operands passed [`super::Kernels`]'s checks.

use super::x86_avx512::exp2_ps;
use std::arch::x86_64::*;

const W: usize = 16;

/// [`super::Kernels::probs_and_ds`]: per element of `cols` rows of `n` lanes, `x = s ·
/// scale_log2`, `p = exp2(x - lse_log2)`, `ds = p · (dp - delta) · scale`, in one pass over the
/// tile; the same operations, in the same order, as the scale multiply, `online_softmax` and the
/// dS loop one after the other (tested beside the AVX2 kernel, in `x86_avx2_bwd`). Row by row
/// (a row's lanes are contiguous), lse and delta reloaded from L1 per lane group.
#[target_feature(enable = "avx512f")]
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
    let (lp, dlp) = (lse_log2.as_ptr(), delta.as_ptr());
    let (sl, sc) = (_mm512_set1_ps(scale_log2), _mm512_set1_ps(scale));
    for c in 0..cols {
        for j in (0..n).step_by(W) {
            let (ps, dsp) = (pp.add(c * n + j), dp.add(c * n + j));
            let x = _mm512_mul_ps(_mm512_loadu_ps(ps), sl);
            let p = exp2_ps(_mm512_sub_ps(x, _mm512_loadu_ps(lp.add(j))));
            _mm512_storeu_ps(ps, p);
            let g = _mm512_sub_ps(_mm512_loadu_ps(dsp), _mm512_loadu_ps(dlp.add(j)));
            _mm512_storeu_ps(dsp, _mm512_mul_ps(_mm512_mul_ps(p, g), sc));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{backward_bf16_dot_rule, caches, x86_avx512, Gemm, Isa, Kernels};

    /// The AVX-512 score kernel's 3 × 64 tiles give the bits of its 6 × 32 walk (row counts
    /// around the 3-row tiles, widths that it tiles and that it hands on, k below, at and above a
    /// chunk, odd k).
    #[test]
    fn score_tiles_match_the_lanes_walk() {
        let Ok(kern) = Kernels::for_isa(Isa::Avx512) else {
            return;
        };
        let mut x = 777u32;
        let mut next = || {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        };
        for (m, n, k) in [
            (64, 64, 128),
            (64, 64, 64),
            (61, 64, 59),
            (1, 64, 111),
            (2, 128, 40),
            (5, 64, 7),
            (64, 64, 15),
            (64, 64, 16),
            (17, 48, 128),
            (3, 16, 33),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| 4.0 * next()).collect();
            let b: Vec<f32> = (0..k * n).map(|_| 4.0 * next()).collect();
            let g = Gemm {
                m,
                n,
                k,
                a: &a,
                a_rs: k,
                a_cs: 1,
                b: &b,
                b_rs: n,
                accumulate: false,
                kc: super::super::KC_SCORES,
            };
            let (mut want, mut got) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            let mut tmp = vec![0f32; m * n];
            // SAFETY: the table exists, so AVX-512F is available; C has m rows of n lanes.
            unsafe { x86_avx512::gemm_scores_lanes(&g, &mut want, n) };
            kern.gemm_scores(&g, &mut got, n, &mut tmp);
            for (at, (w, h)) in want.iter().zip(&got).enumerate() {
                assert_eq!(w.to_bits(), h.to_bits(), "{m}x{n}x{k} at {at}");
            }
        }
    }

    /// The bf16 backward's path: the setting when it names one, else the dot product except on
    /// Intel (AMD Zen 4 and CPUs of other vendors keep it).
    #[test]
    fn backward_bf16_path_rule() {
        for intel in [false, true] {
            assert!(backward_bf16_dot_rule(Some("dot"), intel));
            assert!(!backward_bf16_dot_rule(Some("f32"), intel));
            for unset in [None, Some(""), Some("DOT"), Some("bf16")] {
                assert_eq!(backward_bf16_dot_rule(unset, intel), !intel, "{unset:?}");
            }
        }
        // This process's table follows the rule (the variable is read once, by the table).
        let Ok(kern) = Kernels::for_isa(Isa::Avx512) else {
            return;
        };
        let setting = std::env::var("FLASHATTN_BWD_BF16").ok();
        let want = kern.has_bf16_dot()
            && backward_bf16_dot_rule(setting.as_deref(), caches::cpu_is_intel());
        assert_eq!(kern.backward_bf16_dot(), want);
    }
}

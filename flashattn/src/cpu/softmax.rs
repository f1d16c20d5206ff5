//! Online softmax, as four named steps (the vocabulary of FlashAttention-3's `softmax.h`):
//! `max_get_scale` finds each row's new running maximum and the factor `alpha` that rescales what
//! was accumulated under the old one; `online_softmax` turns scores into probabilities and updates
//! `row_sum`; `rescale_o` applies `alpha` to `acc_o` (those three are vector kernels over query
//! rows in lanes, in [`super::simd::Kernels`]); [`finalize`] divides by `row_sum` once at the end and
//! yields the LSE. This module holds the scalar `exp2` every kernel's version reproduces.
//!
//! Scores arrive in the log2 domain (already multiplied by `log2(e)`), so every exponential is an
//! `exp2`. A row whose maximum is still -inf has seen only masked keys: its maximum is taken as 0
//! (otherwise `-inf - -inf` = NaN) and its probabilities are exactly 0.

/// The coefficients of [`exp2`]'s polynomial `p(f) ≈ 2^f` on `|f| <= 1/2`, highest degree first
/// (Horner's order): a degree-6 minimax fit of the relative error with `p(0) = 1` exactly, so
/// `exp2` of an integer is exact, and `f = x - n` needs no `ln2` multiply. Relative error of the
/// polynomial with these f32 coefficients 9e-9; evaluated in f32 with FMAs, at most 0.8 ulp over
/// the interval (simulated; the degree-7 Taylor series of `e^(f·ln2)` it replaced: 0.92 ulp, and
/// 2 more µops; a degree-5 fit: 2.1 ulp). Every kernel's `exp2` evaluates this one list.
pub(crate) const EXP2_POLY: [f32; 7] = [
    0.000_149_025_2,
    0.001_338_958_2,
    0.009_620_018,
    0.055_503_65,
    0.240_226_37,
    std::f32::consts::LN_2, // the fit's f32 coefficient is ln2 rounded
    1.0,
];

/// `2^x`, accurate to ~1 ulp, branch-free so loops over it vectorise. Exactly 0 below -126 (and for
/// -inf), NaN for NaN. Inputs above 127 are clamped (softmax only feeds it `x <= 0`).
#[inline(always)]
pub(crate) fn exp2(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-126.0, 127.0); // NaN stays NaN
    let shifted = xc + ROUND;
    let n = shifted - ROUND;
    let f = xc - n; // exact, |f| <= 1/2
    let poly = EXP2_POLY[1..].iter().fold(EXP2_POLY[0], |p, &c| p * f + c);
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) << 23) as u32);
    if x < -126.0 {
        0.0
    } else {
        poly * scale
    }
}

/// Normalises `acc_o` by `row_sum` (times `out_scale`, dropout's 1/(1-p)) and returns the row's
/// natural-log LSE; a row that saw no key (`row_sum == 0`) becomes 0 with LSE -inf.
pub(crate) fn finalize(acc_row: &mut [f32], row_max: f32, row_sum: f32, out_scale: f32) -> f32 {
    if row_sum == 0.0 {
        acc_row.iter_mut().for_each(|x| *x = 0.0);
        return f32::NEG_INFINITY;
    }
    let inv = out_scale / row_sum;
    acc_row.iter_mut().for_each(|x| *x *= inv);
    (row_max + row_sum.log2()) * std::f32::consts::LN_2
}

/// The end of [`finalize`] for a row already multiplied by `out_scale / row_sum` (in lanes, by the
/// forward): zeroes a row that saw no key (`row_sum == 0`) and returns the row's LSE.
pub(crate) fn finalize_lse(acc_row: &mut [f32], row_max: f32, row_sum: f32) -> f32 {
    if row_sum == 0.0 {
        acc_row.iter_mut().for_each(|x| *x = 0.0);
        return f32::NEG_INFINITY;
    }
    (row_max + row_sum.log2()) * std::f32::consts::LN_2
}

/// Adds a learnable sink (a logit with no value) to a finalised row's normaliser: the row
/// (normalised by its keys alone, LSE `lse`) becomes `row · exp(lse - lse')` with `lse' =
/// log(exp(lse) + exp(sink))`, which is returned. A row that saw no key (0, lse -inf) stays 0
/// with lse' = sink. Once per row, in f64, so only the final multiply rounds.
pub(crate) fn fold_sink(row: &mut [f32], lse: f32, sink: f32) -> f32 {
    let (l, s) = (lse as f64, sink as f64);
    let m = l.max(s);
    let total = m + ((l - m).exp() + (s - m).exp()).ln();
    let factor = (l - total).exp() as f32;
    row.iter_mut().for_each(|x| *x *= factor);
    total as f32
}

#[cfg(test)]
mod tests {
    use super::exp2;

    #[test]
    fn exp2_is_accurate_and_exact_at_the_edges() {
        let mut worst = 0f64;
        let mut x = -126.0f32;
        while x <= 20.0 {
            let want = (x as f64).exp2();
            worst = worst.max(((exp2(x) as f64) - want).abs() / want);
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2(0.0), 1.0);
        assert_eq!(exp2(-1.0), 0.5);
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(-1000.0), 0.0);
        assert!(exp2(f32::NAN).is_nan());
    }
}

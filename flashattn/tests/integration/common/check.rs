//! The error bound: flashattn against the f64 oracle, with the naive algorithm as the yardstick.

use super::*;

/// Multiple of the naive algorithm's error that flashattn may reach.
pub const NAIVE_FACTOR: f64 = 2.0;
/// Rounding floor, in units of `dtype.epsilon()` (unit roundoff) times the largest reference
/// magnitude: absorbs the final rounding of the output to its dtype (at most 1 unit relative to the
/// element) when naive happens to be nearly exact (e.g. seqlen_k = 1, where both just copy v).
pub const FLOOR_UNITS: f64 = 4.0;
/// Score-rounding floor of out, in units of `eps_f32 · |s| · max|v|`, with `|s|` the magnitude of
/// the largest scores (estimated from the reference lse, see [`check_bound`]).
///
/// Why: flashattn works in the log2 domain and rounds `s · log2(e)` to f32 *before* subtracting the
/// row maximum, so each score carries an absolute error up to `eps_f32 · |s|` (plus a systematic
/// relative `eps_f32` from rounding `scale · log2(e)`), which moves out by up to
/// `2 · eps_f32 · |s| · max|v|`. Naive has the same error in general (it rounds `dot · scale`), but
/// not when the scale is a power of two (`d` = 1, 64, 256 with the default scale, or scale 0.5 / 2):
/// then its scores are exact products and, with scores of ~1e3 (`Dist::Huge`), it can beat flashattn
/// by more than 2x although flashattn is as accurate as any f32 score allows. Negligible for
/// ordinary scores (|s| of a few units) and for f16/bf16 (whose eps dominates).
pub const SCORE_UNITS: f64 = 2.0;

/// Measured errors of one comparison (max-abs against the f64 reference).
#[derive(Clone, Copy, Debug, Default)]
pub struct Errors {
    pub out_flash: f64,
    pub out_naive: f64,
    pub out_floor: f64,
    pub lse_flash: f64,
    pub lse_naive: f64,
    pub lse_floor: f64,
}

impl Errors {
    /// `err_flash / (2 · err_naive + floor)`: the check passes iff both are <= 1.
    /// An exact result (error 0) is 0 even when the bound is 0 (e.g. an all-zero output).
    pub fn normalised(&self) -> (f64, f64) {
        let ratio = |err: f64, naive: f64, floor: f64| {
            if err == 0.0 {
                0.0
            } else {
                err / (NAIVE_FACTOR * naive + floor)
            }
        };
        (
            ratio(self.out_flash, self.out_naive, self.out_floor),
            ratio(self.lse_flash, self.lse_naive, self.lse_floor),
        )
    }
}

impl fmt::Display for Errors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (no, nl) = self.normalised();
        write!(
            f,
            "out: flash {:.3e}, naive {:.3e}, floor {:.3e}, normalised {:.3}; \
             lse: flash {:.3e}, naive {:.3e}, floor {:.3e}, normalised {:.3}",
            self.out_flash,
            self.out_naive,
            self.out_floor,
            no,
            self.lse_flash,
            self.lse_naive,
            self.lse_floor,
            nl
        )
    }
}

/// Checks `flash` against the f64 `reference`, with `naive` as the yardstick:
///
/// - shapes and dtypes as documented (out in the input dtype, lse f32);
/// - no NaN in flash's out or lse (the library poisons out/lse with NaN before the kernels run, so
///   this also checks that every element was written);
/// - the -inf pattern of lse equals the reference's exactly, and those rows of out are exactly 0;
/// - `max|out_flash - ref| <= 2 · max|out_naive - ref| + floor` with
///   `floor = 4 · eps(dtype) · max|ref out| + 2 · eps_f32 · S · v_max`, and for lse over its finite
///   entries `max|lse_flash - ref| <= 2 · max|lse_naive - ref| + 4 · eps(dtype) · max(1, max|ref lse|)`;
///   `eps` is the unit roundoff [`DType::epsilon`], `v_max = max|v|`, and `S` bounds the largest
///   score of a row: `max(|lse|, |lse - ln(max_keys)|)` over rows (a row's max score lies in
///   `[lse - ln(keys), lse]`). See [`FLOOR_UNITS`] and [`SCORE_UNITS`].
///
/// `naive` holds one or more naive results (e.g. both [`flashattn::naive::DotOrder`]s); the
/// naive error is the largest of theirs.
///
/// Panics with the problem, both errors and the normalised error on failure.
pub fn check_bound(
    what: &str,
    dtype: DType,
    flash: &AttnOutput,
    naives: &[AttnOutput],
    r: &Reference,
    v_max: f64,
    max_keys: usize,
) -> Errors {
    assert_eq!(flash.out.dtype(), dtype, "{what}: out dtype");
    assert_eq!(flash.lse.dtype(), DType::F32, "{what}: lse dtype");
    assert_eq!(
        flash.out.shape(),
        r.out_shape.as_slice(),
        "{what}: out shape"
    );
    assert_eq!(
        flash.lse.shape(),
        r.lse_shape.as_slice(),
        "{what}: lse shape"
    );
    assert!(!naives.is_empty(), "{what}: no naive result");
    for naive in naives {
        assert_eq!(
            naive.out.shape(),
            r.out_shape.as_slice(),
            "{what}: naive out shape"
        );
        assert_eq!(
            naive.lse.shape(),
            r.lse_shape.as_slice(),
            "{what}: naive lse shape"
        );
    }
    let (fo, no) = (flash.out.to_f64_vec(), naives[0].out.to_f64_vec());
    let (fl, nl) = (flash.lse.to_f64_vec(), naives[0].lse.to_f64_vec());
    let eps = dtype.epsilon();

    // lse: NaN, the -inf pattern.
    let lse_shape = &r.lse_shape;
    let (heads, rows) = (
        lse_shape[lse_shape.len() - 2],
        lse_shape[lse_shape.len() - 1],
    );
    let d = r.out_shape[r.out_shape.len() - 1];
    let mut masked_rows = vec![false; fl.len()];
    for (i, (&f, &x)) in fl.iter().zip(&r.lse).enumerate() {
        assert!(!f.is_nan(), "{what}: lse[{i}] is NaN (reference {x})");
        assert!(
            x != f64::INFINITY && !x.is_nan(),
            "{what}: reference lse[{i}] = {x}"
        );
        assert_eq!(
            f == f64::NEG_INFINITY,
            x == f64::NEG_INFINITY,
            "{what}: lse[{i}] = {f} but reference {x}: the -inf (fully masked) pattern differs"
        );
        assert!(
            f != f64::INFINITY,
            "{what}: lse[{i}] = +inf (reference {x})"
        );
        masked_rows[i] = x == f64::NEG_INFINITY;
    }
    // Fully masked rows of out are exactly 0. lse index (.., h, row) <-> out row (.., row, h, ..).
    let batch = fl.len() / (heads * rows).max(1);
    for bi in 0..batch {
        for h in 0..heads {
            for row in 0..rows {
                if masked_rows[(bi * heads + h) * rows + row] {
                    let o = ((bi * rows + row) * heads + h) * d;
                    assert!(
                        fo[o..o + d].iter().all(|&x| x == 0.0),
                        "{what}: (b {bi}, row {row}, head {h}) sees no key but out is {:?}",
                        &fo[o..o + d.min(8)]
                    );
                }
            }
        }
    }

    // out: NaN, errors.
    let ref_out_max = r.out.iter().fold(0f64, |m, x| m.max(x.abs()));
    let ln_keys = (max_keys.max(1) as f64).ln();
    let score_max = r
        .lse
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs()).max((x - ln_keys).abs()));
    let out_floor =
        FLOOR_UNITS * eps * ref_out_max + SCORE_UNITS * DType::F32.epsilon() * score_max * v_max;
    let mut e = Errors {
        out_floor,
        ..Errors::default()
    };
    let mut worst = 0;
    for (i, (&f, &x)) in fo.iter().zip(&r.out).enumerate() {
        assert!(x.is_finite(), "{what}: reference out[{i}] = {x}");
        assert!(
            !f.is_nan(),
            "{what}: out[{i}] is NaN (reference {x}): not written, or a NaN leaked in"
        );
        if (f - x).abs() > e.out_flash {
            e.out_flash = (f - x).abs();
            worst = i;
        }
    }
    for naive in naives {
        let no = naive.out.to_f64_vec();
        e.out_naive = no
            .iter()
            .zip(&r.out)
            .fold(e.out_naive, |m, (n, x)| m.max((n - x).abs()));
    }
    let ref_lse_max = r
        .lse
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs()));
    e.lse_floor = FLOOR_UNITS * eps * ref_lse_max.max(1.0);
    let mut worst_lse = 0;
    for (i, (&f, &x)) in fl.iter().zip(&r.lse).enumerate() {
        if x.is_finite() && (f - x).abs() > e.lse_flash {
            e.lse_flash = (f - x).abs();
            worst_lse = i;
        }
    }
    for naive in naives {
        let nl = naive.lse.to_f64_vec();
        e.lse_naive = nl
            .iter()
            .zip(&r.lse)
            .filter(|(_, x)| x.is_finite())
            .fold(e.lse_naive, |m, (n, x)| m.max((n - x).abs()));
    }
    assert!(
        e.out_naive.is_finite() && e.lse_naive.is_finite(),
        "{what}: the naive yardstick itself broke (non-finite error): {e}"
    );
    let (n_out, n_lse) = e.normalised();
    assert!(
        n_out <= 1.0 && e.out_flash.is_finite(),
        "{what}: out error too large: {e}; worst at out[{worst}]: flash {} vs reference {} (naive {}); max|ref| {ref_out_max:.3e}",
        fo[worst],
        r.out[worst],
        no[worst]
    );
    assert!(
        n_lse <= 1.0 && e.lse_flash.is_finite(),
        "{what}: lse error too large: {e}; worst at lse[{worst_lse}]: flash {} vs reference {} (naive {})",
        fl[worst_lse],
        r.lse[worst_lse],
        nl[worst_lse]
    );
    e
}

/// Widens any element type's value to f64 (for hand-written expectations).
pub fn f64_of<T: Element>(x: T) -> f64 {
    x.to_f64()
}

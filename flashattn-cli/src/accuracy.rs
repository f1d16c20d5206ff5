//! The benchmarks' accuracy checks: the largest |out - f64 reference| over a few sampled rows.

use crate::error::Result;
use flashattn::{reference, AttnOptions, AttnOutput, Buffer};

/// Rows checked against the f64 oracle per measurement.
pub const ERR_ROWS: usize = 16;

/// One row of the f64 oracle: (batch, head, query row, output row).
pub struct RefRow {
    pub b: usize,
    pub h: usize,
    pub i: usize,
    pub out: Vec<f64>,
}

/// Up to [`ERR_ROWS`] rows: (batch, head) pairs taken in turn, query rows spread evenly from the
/// first to the last (the last query sees the most keys, the first the fewest under a causal mask).
pub fn sample_rows(batch: usize, heads: usize, sq: usize) -> Vec<(usize, usize, usize)> {
    let n = ERR_ROWS.min(batch * heads * sq);
    let mut rows: Vec<(usize, usize, usize)> = (0..n)
        .map(|r| {
            let bh = r % (batch * heads);
            let i = if n > 1 { r * (sq - 1) / (n - 1) } else { 0 };
            (bh / heads, bh % heads, i)
        })
        .collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Largest |out - reference| over the sampled rows; NaN is reported, not hidden.
pub fn max_abs_err(
    res: &AttnOutput,
    refs: &[RefRow],
    sq: usize,
    heads: usize,
    d: usize,
) -> Option<f64> {
    if refs.is_empty() {
        return None;
    }
    let buf = res.out.buffer();
    let get = |idx: usize| -> Option<f64> {
        match buf {
            Buffer::F32(v) => v.get(idx).map(|&x| x as f64),
            Buffer::F16(v) => v.get(idx).map(|x| x.to_f64()),
            Buffer::BF16(v) => v.get(idx).map(|x| x.to_f64()),
        }
    };
    let mut worst = 0.0f64;
    for r in refs {
        let base = ((r.b * sq + r.i) * heads + r.h) * d;
        for (x, want) in r.out.iter().enumerate() {
            let e = (get(base + x)? - want).abs();
            if e > worst || e.is_nan() {
                worst = e;
                if e.is_nan() {
                    return Some(f64::NAN);
                }
            }
        }
    }
    Some(worst)
}

/// The largest |out - f64 reference| over three heads (first, middle, last) of the last query of
/// the last sequence, attending the caches `kv` (`[batch, cap, heads_kv, d]` views, as appended by
/// the timed steps); NaN when any element is NaN. `out` is the step's `[batch, sq, heads, d]`.
pub fn last_rows_error(
    q: &flashattn::TensorRef,
    (kv, vv): (&flashattn::TensorRef, &flashattn::TensorRef),
    attn: &AttnOptions,
    out: &[f64],
) -> Result<f64> {
    let (batch, sq, heads, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let mut worst = 0f64;
    for h in [0, heads / 2, heads - 1] {
        let (b, i) = (batch - 1, sq - 1);
        let (want, _) = reference::attention_row(q, kv, vv, attn, b, h, i)?;
        let at = ((b * sq + i) * heads + h) * d;
        for (x, w) in out[at..at + d].iter().zip(&want) {
            let e = (x - w).abs();
            worst = if e.is_nan() { f64::NAN } else { worst.max(e) };
        }
    }
    Ok(worst)
}

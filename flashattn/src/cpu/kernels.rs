//! The inner block products of the CPU path, in one place. These are the portable versions, written
//! so that LLVM vectorises them (8 independent accumulators, fixed summation order); run-time
//! dispatched SIMD microkernels go here, each tested against these twins.
//!
//! All operands are packed row-major f32 tiles in thread-local scratch.

/// `s[r * cols + c] = q[r] · k[c]` for a `rows x d` tile of q and a `cols x d` tile of k.
pub(crate) fn qk(q: &[f32], k: &[f32], s: &mut [f32], rows: usize, cols: usize, d: usize) {
    for r in 0..rows {
        let qr = &q[r * d..(r + 1) * d];
        let sr = &mut s[r * cols..(r + 1) * cols];
        for (c, sc) in sr.iter_mut().enumerate() {
            *sc = dot(qr, &k[c * d..(c + 1) * d]);
        }
    }
}

/// `acc[r] += Σ_c p[r * cols + c] · v[c]` for a `rows x cols` tile of probabilities and a
/// `cols x d` tile of v.
pub(crate) fn pv(p: &[f32], v: &[f32], acc: &mut [f32], rows: usize, cols: usize, d: usize) {
    for r in 0..rows {
        let ar = &mut acc[r * d..(r + 1) * d];
        for (c, &prc) in p[r * cols..(r + 1) * cols].iter().enumerate() {
            axpy(prc, &v[c * d..(c + 1) * d], ar);
        }
    }
}

/// `acc[c] += Σ_r p[r * cols + c] · x[r]` for a `rows x cols` tile `p` and a `rows x d` tile `x`
/// (the transposed product of the backward pass: dV += Pᵀ·dO, dK += dSᵀ·Q).
pub(crate) fn ptx(p: &[f32], x: &[f32], acc: &mut [f32], rows: usize, cols: usize, d: usize) {
    for r in 0..rows {
        let xr = &x[r * d..(r + 1) * d];
        for (c, &prc) in p[r * cols..(r + 1) * cols].iter().enumerate() {
            axpy(prc, xr, &mut acc[c * d..(c + 1) * d]);
        }
    }
}

/// Dot product with 8 independent partial sums combined in a fixed order (deterministic).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a · x`.
#[inline(always)]
pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_match_f64() {
        let (rows, cols) = (5, 7);
        for d in [1usize, 7, 8, 9, 40, 59] {
            let q: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                .collect();
            let k: Vec<f32> = (0..cols * d)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
                .collect();
            let mut s = vec![f32::NAN; rows * cols];
            qk(&q, &k, &mut s, rows, cols, d);
            for r in 0..rows {
                for c in 0..cols {
                    let want: f64 = (0..d)
                        .map(|x| q[r * d + x] as f64 * k[c * d + x] as f64)
                        .sum();
                    assert!((s[r * cols + c] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()));
                }
            }
            let mut acct = vec![0.5f32; cols * d];
            ptx(&s, &q, &mut acct, rows, cols, d);
            for c in 0..cols {
                for x in 0..d {
                    let want: f64 = 0.5
                        + (0..rows)
                            .map(|r| s[r * cols + c] as f64 * q[r * d + x] as f64)
                            .sum::<f64>();
                    assert!((acct[c * d + x] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()));
                }
            }
            let mut acc = vec![1.0f32; rows * d];
            pv(&s, &k, &mut acc, rows, cols, d);
            for r in 0..rows {
                for x in 0..d {
                    let want: f64 = 1.0
                        + (0..cols)
                            .map(|c| s[r * cols + c] as f64 * k[c * d + x] as f64)
                            .sum::<f64>();
                    assert!((acc[r * d + x] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()));
                }
            }
        }
    }
}

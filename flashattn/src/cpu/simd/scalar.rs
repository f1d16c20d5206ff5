//! Portable twins of the microkernels: plain loops with the same contracts (see [`super::Kernels`]),
//! the fallback on every CPU and the reference the SIMD kernels are tested against. They index
//! with bounds checks; the `unsafe` on their signatures is only the table's common type.

use super::Gemm;
use crate::cpu::softmax::exp2;
use half::bf16;

/// Sums in f64 (then rounds once to f32): the twin is the oracle of the SIMD products and the
/// fallback on CPUs without them, so it takes accuracy over speed (`kc` does not apply). With
/// huge logits under softcap, an f32 twin without FMA measured 3× the naive lse error.
pub(crate) unsafe fn gemm(g: &Gemm<f32>, c: &mut [f32], c_rs: usize) {
    let mut acc = vec![0f64; g.n];
    for i in 0..g.m {
        let ci = &mut c[i * c_rs..i * c_rs + g.n];
        acc.fill(0.0);
        for k in 0..g.k {
            let a = g.a[i * g.a_rs + k * g.a_cs] as f64;
            let bk = &g.b[k * g.b_rs..k * g.b_rs + g.n];
            for (s, &bj) in acc.iter_mut().zip(bk) {
                *s += a * bj as f64;
            }
        }
        for (cj, &s) in ci.iter_mut().zip(&acc) {
            *cj = if g.accumulate {
                (*cj as f64 + s) as f32
            } else {
                s as f32
            };
        }
    }
}

/// The two bf16 halves of a pair, widened.
#[inline(always)]
pub(crate) fn unpair(p: u32) -> (f32, f32) {
    (
        bf16::from_bits(p as u16).to_f32(),
        bf16::from_bits((p >> 16) as u16).to_f32(),
    )
}

/// Two bf16 as a pair (`lo` is the element with the even index).
#[inline(always)]
pub(crate) fn pair(lo: bf16, hi: bf16) -> u32 {
    lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
}

/// The bf16 twin: exact products of bf16 pairs, accumulated in f32 (`vdpbf16ps` adds both
/// products of a pair before accumulating; here they are added one by one).
/// The bf16 twin: exact products of bf16 pairs, summed in f64 as [`gemm`].
pub(crate) unsafe fn gemm_bf16(g: &Gemm<u32>, c: &mut [f32], c_rs: usize) {
    let mut acc = vec![0f64; g.n];
    for i in 0..g.m {
        let ci = &mut c[i * c_rs..i * c_rs + g.n];
        acc.fill(0.0);
        for k in 0..g.k {
            let (a0, a1) = unpair(g.a[i * g.a_rs + k * g.a_cs]);
            let bk = &g.b[k * g.b_rs..k * g.b_rs + g.n];
            for (s, &bj) in acc.iter_mut().zip(bk) {
                let (b0, b1) = unpair(bj);
                *s += a0 as f64 * b0 as f64 + a1 as f64 * b1 as f64;
            }
        }
        for (cj, &s) in ci.iter_mut().zip(&acc) {
            *cj = if g.accumulate {
                (*cj as f64 + s) as f32
            } else {
                s as f32
            };
        }
    }
}

pub(crate) unsafe fn max_get_scale(
    st: &mut [f32],
    cols: usize,
    n: usize,
    scale: f32,
    row_max: &mut [f32],
    alpha: &mut [f32],
    m_sub: &mut [f32],
) {
    let mut block_max = [f32::NEG_INFINITY; super::LANES];
    for j0 in (0..n).step_by(super::LANES) {
        block_max.fill(f32::NEG_INFINITY);
        for c in 0..cols {
            let row = &mut st[c * n + j0..c * n + j0 + super::LANES];
            for (x, m) in row.iter_mut().zip(&mut block_max) {
                *x *= scale;
                *m = m.max(*x);
            }
        }
        for (j, &bm) in (j0..).zip(&block_max) {
            let new = row_max[j].max(bm);
            alpha[j] = if new == f32::NEG_INFINITY {
                1.0
            } else {
                exp2(row_max[j] - new)
            };
            m_sub[j] = if new == f32::NEG_INFINITY { 0.0 } else { new };
            row_max[j] = new;
        }
    }
}

pub(crate) unsafe fn online_softmax(
    st: &mut [f32],
    cols: usize,
    n: usize,
    m_sub: &[f32],
    row_sum: &mut [f32],
    alpha: &[f32],
) {
    for j in 0..n {
        row_sum[j] *= alpha[j];
    }
    for c in 0..cols {
        for (j, x) in st[c * n..(c + 1) * n].iter_mut().enumerate() {
            *x = exp2(*x - m_sub[j]);
            row_sum[j] += *x;
        }
    }
}

pub(crate) unsafe fn rescale_o(ot: &mut [f32], rows: usize, n: usize, alpha: &[f32]) {
    for row in ot[..rows * n].chunks_exact_mut(n) {
        for (x, &a) in row.iter_mut().zip(alpha) {
            *x *= a;
        }
    }
}

pub(crate) unsafe fn narrow_pairs_bf16(src: &[f32], out: &mut [u32]) {
    for (o, x) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = pair(bf16::from_f32(x[0]), bf16::from_f32(x[1]));
    }
}

pub(crate) unsafe fn pack_pairs_bf16(st: &[f32], cols: usize, n: usize, out: &mut [u32]) {
    for cp in 0..cols.div_ceil(2) {
        let c = 2 * cp;
        for j in 0..n {
            let lo = bf16::from_f32(st[c * n + j]);
            let hi = if c + 1 < cols {
                bf16::from_f32(st[(c + 1) * n + j])
            } else {
                bf16::ZERO
            };
            out[cp * n + j] = pair(lo, hi);
        }
    }
}

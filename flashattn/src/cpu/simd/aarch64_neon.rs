//! aarch64 Advanced SIMD (NEON) microkernels (4 f32 lanes per 128-bit register).
//!
//! Register budget of the product tile: MR = 6 rows × NV = 4 vectors (16 lanes, one [`LANES`]
//! block) = 24 accumulators, + 4 vectors of B loaded per k, + the A values of the step (scalars
//! loaded into the low lane of a register and used by `fmla v.4s, v.4s, v.s[0]`, one or two live
//! at a time) = 29-30 of the 32 v registers. Per k step: 4 vector loads, 6 scalar loads, 24 FMAs.
//! Every element sums its k products in the same order as the AVX2 and AVX-512 kernels (chunks of
//! `kc` FMAs from 0, each chunk then added to C), so all SIMD tables give the same bits.
//!
//! The softmax kernels work on one 16-lane block at a time (4 independent vectors, for
//! instruction-level parallelism through `exp2`'s dependency chain).
//!
//! Safety: every function here requires the CPU features of its `target_feature` attribute (the
//! kernel table is built only after detection; NEON is baseline on aarch64) and operands that
//! passed [`super::Kernels`]'s bounds checks (`n` a multiple of [`LANES`], slices long enough for
//! every `m`, `k`, `n`, stride and `cols` / `rows` given); every pointer offset below stays inside
//! those checked ranges.

use super::{Gemm, LANES};
use crate::cpu::softmax::EXP2_POLY;
use std::arch::aarch64::*;

/// Rows of the product tile.
const MR: usize = 6;
/// Vectors per tile row (NV · W = LANES).
const NV: usize = 4;
/// f32 lanes of one register.
const W: usize = 4;

#[target_feature(enable = "neon")]
pub(crate) unsafe fn gemm(g: &Gemm<f32>, c: &mut [f32], c_rs: usize) {
    let cp = c.as_mut_ptr();
    for j in (0..g.n).step_by(NV * W) {
        let mut i = 0;
        while i + MR <= g.m {
            tile::<MR>(g, cp, c_rs, i, j);
            i += MR;
        }
        match g.m - i {
            5 => tile::<5>(g, cp, c_rs, i, j),
            4 => tile::<4>(g, cp, c_rs, i, j),
            3 => tile::<3>(g, cp, c_rs, i, j),
            2 => tile::<2>(g, cp, c_rs, i, j),
            1 => tile::<1>(g, cp, c_rs, i, j),
            _ => {}
        }
    }
}

/// Rows `i..i + R`, lanes `j..j + 16` of C.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn tile<const R: usize>(g: &Gemm<f32>, cp: *mut f32, c_rs: usize, i: usize, j: usize) {
    let a = g.a.as_ptr().add(i * g.a_rs);
    let b = g.b.as_ptr().add(j);
    let zero = vdupq_n_f32(0.0);
    let mut first = !g.accumulate;
    if g.k == 0 && first {
        store_tile::<R>(&[[zero; NV]; R], cp, c_rs, i, j, true);
    }
    for k0 in (0..g.k).step_by(g.kc) {
        let mut acc = [[zero; NV]; R];
        for k in k0..(k0 + g.kc).min(g.k) {
            let bk = b.add(k * g.b_rs);
            let mut bv = [zero; NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = vld1q_f32(bk.add(W * v));
            }
            let ak = a.add(k * g.a_cs);
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let ar = *ak.add(r * g.a_rs);
                for (x, bx) in acc_r.iter_mut().zip(&bv) {
                    // x + bx · ar, one rounding (FMLA by element).
                    *x = vfmaq_n_f32(*x, *bx, ar);
                }
            }
        }
        store_tile::<R>(&acc, cp, c_rs, i, j, first);
        first = false;
    }
}

/// Writes (`overwrite`) or adds a tile of partial sums to C.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn store_tile<const R: usize>(
    acc: &[[float32x4_t; NV]; R],
    cp: *mut f32,
    c_rs: usize,
    i: usize,
    j: usize,
    overwrite: bool,
) {
    for (r, acc_r) in acc.iter().enumerate() {
        for (v, x) in acc_r.iter().enumerate() {
            let at = cp.add((i + r) * c_rs + j + W * v);
            let val = if overwrite {
                *x
            } else {
                vaddq_f32(vld1q_f32(at), *x)
            };
            vst1q_f32(at, val);
        }
    }
}

/// `2^x` per lane, as [`crate::cpu::softmax::exp2`] (same reduction and polynomial, [`EXP2_POLY`], with FMAs).
#[target_feature(enable = "neon")]
#[inline]
unsafe fn exp2_v(x: float32x4_t) -> float32x4_t {
    // FMAX / FMIN return NaN when either operand is NaN, so NaN passes through as in `clamp`.
    let xc = vminq_f32(vdupq_n_f32(127.0), vmaxq_f32(vdupq_n_f32(-126.0), x));
    // FRINTN: to nearest, ties to even (the scalar version's 1.5·2^23 trick under the default
    // rounding mode).
    let n = vrndnq_f32(xc);
    let f = vsubq_f32(xc, n);
    let mut p = vdupq_n_f32(EXP2_POLY[0]);
    for c in &EXP2_POLY[1..] {
        // c + p · f, one rounding.
        p = vfmaq_f32(vdupq_n_f32(*c), p, f);
    }
    // 2^n from its exponent bits; n is an integer in [-126, 127] here (NaN converts to 0, and
    // the NaN of `p` survives the product).
    let bits = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
    let r = vmulq_f32(p, vreinterpretq_f32_s32(bits));
    // Exactly 0 below -126 and for -inf (false for NaN).
    let under = vcltq_f32(x, vdupq_n_f32(-126.0));
    vbslq_f32(under, vdupq_n_f32(0.0), r)
}

#[target_feature(enable = "neon")]
pub(crate) unsafe fn max_get_scale(
    st: &mut [f32],
    cols: usize,
    n: usize,
    scale: f32,
    row_max: &mut [f32],
    alpha: &mut [f32],
    m_sub: &mut [f32],
) {
    let sp = st.as_mut_ptr();
    let sc = vdupq_n_f32(scale);
    let neg_inf = vdupq_n_f32(f32::NEG_INFINITY);
    for j0 in (0..n).step_by(LANES) {
        let mut bm = [neg_inf; NV];
        for c in 0..cols {
            for (v, m) in bm.iter_mut().enumerate() {
                let p = sp.add(c * n + j0 + W * v);
                let x = vmulq_f32(vld1q_f32(p), sc);
                vst1q_f32(p, x);
                // FMAXNM (IEEE maxNum), as the scalar twin's `f32::max`: a quiet NaN loses.
                *m = vmaxnmq_f32(*m, x);
            }
        }
        for (v, m) in bm.iter().enumerate() {
            let j = j0 + W * v;
            let old = vld1q_f32(row_max.as_ptr().add(j));
            let new = vmaxnmq_f32(old, *m);
            let none = vceqq_f32(new, neg_inf);
            let a = exp2_v(vsubq_f32(old, new));
            vst1q_f32(
                alpha.as_mut_ptr().add(j),
                vbslq_f32(none, vdupq_n_f32(1.0), a),
            );
            vst1q_f32(
                m_sub.as_mut_ptr().add(j),
                vbslq_f32(none, vdupq_n_f32(0.0), new),
            );
            vst1q_f32(row_max.as_mut_ptr().add(j), new);
        }
    }
}

#[target_feature(enable = "neon")]
pub(crate) unsafe fn online_softmax(
    st: &mut [f32],
    cols: usize,
    n: usize,
    m_sub: &[f32],
    row_sum: &mut [f32],
    alpha: &[f32],
) {
    let sp = st.as_mut_ptr();
    let zero = vdupq_n_f32(0.0);
    for j0 in (0..n).step_by(LANES) {
        let mut m = [zero; NV];
        let mut sum = [zero; NV];
        for v in 0..NV {
            let j = j0 + W * v;
            m[v] = vld1q_f32(m_sub.as_ptr().add(j));
            sum[v] = vmulq_f32(
                vld1q_f32(row_sum.as_ptr().add(j)),
                vld1q_f32(alpha.as_ptr().add(j)),
            );
        }
        for c in 0..cols {
            for v in 0..NV {
                let p = sp.add(c * n + j0 + W * v);
                let e = exp2_v(vsubq_f32(vld1q_f32(p), m[v]));
                vst1q_f32(p, e);
                sum[v] = vaddq_f32(sum[v], e);
            }
        }
        for (v, s) in sum.iter().enumerate() {
            vst1q_f32(row_sum.as_mut_ptr().add(j0 + W * v), *s);
        }
    }
}

#[target_feature(enable = "neon")]
pub(crate) unsafe fn rescale_o(ot: &mut [f32], rows: usize, n: usize, alpha: &[f32]) {
    let op = ot.as_mut_ptr();
    for j in (0..n).step_by(W) {
        let a = vld1q_f32(alpha.as_ptr().add(j));
        for x in 0..rows {
            let p = op.add(x * n + j);
            vst1q_f32(p, vmulq_f32(vld1q_f32(p), a));
        }
    }
}

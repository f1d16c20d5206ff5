//! AVX2 + FMA microkernels (8 f32 lanes).
//!
//! Register budget of the product tile: MR = 6 rows × 2 ymm (16 lanes) = 12 accumulators, + 2 ymm
//! of B per k, + 1 broadcast = 15 of the 16 ymm registers; per k step 2 loads, 6 broadcasts, 12
//! FMAs (the shape of BLIS's Haswell kernel). 4 rows (8 accumulators: the two FMA units' latency
//! of 4 cycles with no slack) ran the f32 forward at 76-84 GFLOP/s against 88-99 for 6 rows
//! (N = 1024 and 4096, d = 128, 16 heads, 2 threads, alternating runs, 2026-11-26, AVX2-only
//! Zen 4 host; docs/PERFORMANCE.md).
//!
//! Safety: as in `x86_avx512`: the CPU has the features of each `target_feature` attribute, and the
//! operands passed [`super::Kernels`]'s bounds checks.

use super::Gemm;
use crate::cpu::softmax::EXP2_POLY;
use std::arch::x86_64::*;

const MR: usize = 6;
const W: usize = 8;

/// How a tile reads A's broadcasts: the two layouts the forward and backward use get addresses the
/// core computes for free (a base register plus an immediate or a scaled index), instead of
/// `k·a_cs + r·a_rs` per element, which cost ~7 integer µops per k step beside the 12 FMAs (29
/// µops for 6 cycles of FMA). Measured alone (criterion) the products ran 1.2-1.8× as fast; the
/// whole forward moved less than its run-to-run spread on an Intel core (docs/PERFORMANCE.md).
#[derive(Clone, Copy, PartialEq, Eq)]
enum ALayout {
    /// Any strides.
    Strided,
    /// `a_rs == 1`: a k step's R values are adjacent (P·V reading V, dV/dK products).
    AdjacentRows,
    /// `a_cs == 1`: each row is contiguous in k (Q·Kᵀ reading K rows): one pointer per row.
    ContiguousK,
}

#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gemm(g: &Gemm<f32>, c: &mut [f32], c_rs: usize) {
    gemm_scaled::<false>(g, c, c_rs, std::ptr::null())
}

/// [`gemm`] adding to `C · col_scale` (per lane j), with the same two roundings as
/// [`rescale_o`] and then [`gemm`]: the first chunk of each tile multiplies C as it loads it,
/// which saves rescale_o's pass over C. `g.accumulate` and `g.k > 0` (checked by the caller).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gemm_rescaled(g: &Gemm<f32>, c: &mut [f32], c_rs: usize, col_scale: &[f32]) {
    gemm_scaled::<true>(g, c, c_rs, col_scale.as_ptr())
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn gemm_scaled<const S: bool>(g: &Gemm<f32>, c: &mut [f32], c_rs: usize, sc: *const f32) {
    if g.a_rs == 1 {
        gemm_as::<{ ALayout::AdjacentRows as u8 }, S>(g, c, c_rs, sc)
    } else if g.a_cs == 1 {
        gemm_as::<{ ALayout::ContiguousK as u8 }, S>(g, c, c_rs, sc)
    } else {
        gemm_as::<{ ALayout::Strided as u8 }, S>(g, c, c_rs, sc)
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn gemm_as<const L: u8, const S: bool>(
    g: &Gemm<f32>,
    c: &mut [f32],
    c_rs: usize,
    sc: *const f32,
) {
    let cp = c.as_mut_ptr();
    for j in (0..g.n).step_by(2 * W) {
        // The first tile of a strip also prefetches B (see `tile`).
        let mut i = 0;
        while i + MR <= g.m {
            if i == 0 {
                tile::<MR, L, true, S>(g, cp, c_rs, i, j, sc);
            } else {
                tile::<MR, L, false, S>(g, cp, c_rs, i, j, sc);
            }
            i += MR;
        }
        match g.m - i {
            5 => tile::<5, L, false, S>(g, cp, c_rs, i, j, sc),
            4 => tile::<4, L, false, S>(g, cp, c_rs, i, j, sc),
            3 => tile::<3, L, false, S>(g, cp, c_rs, i, j, sc),
            2 => tile::<2, L, false, S>(g, cp, c_rs, i, j, sc),
            1 => tile::<1, L, false, S>(g, cp, c_rs, i, j, sc),
            _ => {}
        }
    }
}

/// Rows `i..i + R`, lanes `j..j + 16` of C; `L` is an [`ALayout`] the operands satisfy.
///
/// Each k step also prefetches (into L1) the A that a later tile reads, and with `PB` (the
/// first tile of a strip) the B lanes of the next strip and of its own 16 rows ahead; a tile that
/// adds to C prefetches the next tile's C rows. Packed k and v tiles arrive from L3 or memory at
/// every key block (the forward's), the backward's query tiles and dQ copies at every query
/// block, and the hardware prefetchers cover their strided first reads badly: with A rotating
/// through 16 MiB of tiles, one core, the products ran at 62-82% of the FMA peak without these
/// prefetches and 79-90% with them, against 80-98% with A in cache (`examples/gemm_fma.rs`).
/// ContiguousK: the next tile's rows, one line per k step (its `R · a_rs` floats span at most
/// `16 k` when `a_rs <= 2.6 k`, as the packed tiles' `a_rs = k` does); AdjacentRows: the line 16
/// floats ahead in the current k row (a tile's R columns share it with the next tiles).
/// Prefetches never fault: the addresses past the operands are only formed (`wrapping_add`),
/// never read. With `S`, the first chunk adds to C multiplied by `sc[j..j + 16]`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile<const R: usize, const L: u8, const PB: bool, const S: bool>(
    g: &Gemm<f32>,
    cp: *mut f32,
    c_rs: usize,
    i: usize,
    j: usize,
    sc: *const f32,
) {
    // wrapping_add: with k = 0 (A empty) these addresses are formed but never read.
    let a = g.a.as_ptr().wrapping_add(i * g.a_rs);
    let b = g.b.as_ptr().add(j);
    let mut rows = [a; R];
    for (r, p) in rows.iter_mut().enumerate() {
        *p = a.wrapping_add(r * g.a_rs);
    }
    // Opaque to the optimiser, so it keeps R row pointers (base + k·4 addressing) instead of
    // re-deriving each row's address from a_rs at every k step.
    let rows = std::hint::black_box(rows);
    // A's prefetch cursor and its step per k (floats).
    let (pa, pa_step) = if L == ALayout::ContiguousK as u8 {
        (a.wrapping_add(R * g.a_rs), 2 * W)
    } else if L == ALayout::AdjacentRows as u8 {
        (a.wrapping_add(2 * W), g.a_cs)
    } else {
        (a, 0)
    };
    // B's next strip (its own lanes again when there is none: a hit), and this strip 16 rows on.
    let pb = b.wrapping_add(if j + 2 * W < g.n { 2 * W } else { 0 });
    let pb_own = b.wrapping_add(16 * g.b_rs);
    if g.accumulate {
        for r in R..2 * R {
            _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add((i + r) * c_rs + j) as *const i8);
        }
    }
    let mut first = !g.accumulate;
    let mut scale_c = S;
    if g.k == 0 && first {
        store_tile::<R>(&[[_mm256_setzero_ps(); 2]; R], cp, c_rs, i, j, true);
    }
    for k0 in (0..g.k).step_by(g.kc) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for k in k0..(k0 + g.kc).min(g.k) {
            let bk = b.add(k * g.b_rs);
            if L != ALayout::Strided as u8 {
                _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(k * pa_step) as *const i8);
            }
            if PB {
                _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(k * g.b_rs) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(pb_own.wrapping_add(k * g.b_rs) as *const i8);
            }
            let bv = [_mm256_loadu_ps(bk), _mm256_loadu_ps(bk.add(W))];
            let ak = a.add(k * g.a_cs);
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let x = if L == ALayout::AdjacentRows as u8 {
                    *ak.add(r)
                } else if L == ALayout::ContiguousK as u8 {
                    *rows[r].add(k)
                } else {
                    *ak.add(r * g.a_rs)
                };
                let ar = _mm256_set1_ps(x);
                for (x, bx) in acc_r.iter_mut().zip(&bv) {
                    *x = _mm256_fmadd_ps(ar, *bx, *x);
                }
            }
        }
        if scale_c {
            store_tile_scaled::<R>(&acc, cp, c_rs, i, j, sc);
            scale_c = false;
        } else {
            store_tile::<R>(&acc, cp, c_rs, i, j, first);
        }
        first = false;
    }
}

/// Adds a tile of partial sums to C multiplied by `sc[j..j + 16]` (`C · sc`, rounded, `+ acc`).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn store_tile_scaled<const R: usize>(
    acc: &[[__m256; 2]; R],
    cp: *mut f32,
    c_rs: usize,
    i: usize,
    j: usize,
    sc: *const f32,
) {
    let s = [_mm256_loadu_ps(sc.add(j)), _mm256_loadu_ps(sc.add(j + W))];
    for (r, acc_r) in acc.iter().enumerate() {
        for (v, x) in acc_r.iter().enumerate() {
            let at = cp.add((i + r) * c_rs + j + W * v);
            let scaled = _mm256_mul_ps(_mm256_loadu_ps(at), s[v]);
            _mm256_storeu_ps(at, _mm256_add_ps(scaled, *x));
        }
    }
}

/// Writes (`overwrite`) or adds a tile of partial sums to C.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn store_tile<const R: usize>(
    acc: &[[__m256; 2]; R],
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
                _mm256_add_ps(_mm256_loadu_ps(at), *x)
            };
            _mm256_storeu_ps(at, val);
        }
    }
}

/// `2^x` per lane, as [`crate::cpu::softmax::exp2`] (same reduction and polynomial, [`EXP2_POLY`], with FMAs).
/// The rounding adds and subtracts 1.5 · 2^23 (2 µops, where `vroundps` and `vcvtps2dq` take 3 on
/// the FMA ports), the integer comes from the sum's low mantissa bits, and the underflow lanes
/// are cleared with `vandnps` (any vector port) instead of a blend: the same values as rounding
/// with `vroundps` to nearest-even (exact for |x| <= 127) and blending, lane for lane.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn exp2_ps(x: __m256) -> __m256 {
    const ROUND: f32 = 12_582_912.0;
    // max/min return their second operand when either is NaN, so NaN passes through.
    let xc = _mm256_min_ps(
        _mm256_set1_ps(127.0),
        _mm256_max_ps(_mm256_set1_ps(-126.0), x),
    );
    let shifted = _mm256_add_ps(xc, _mm256_set1_ps(ROUND));
    let n = _mm256_sub_ps(shifted, _mm256_set1_ps(ROUND));
    let f = _mm256_sub_ps(xc, n);
    let mut p = _mm256_set1_ps(EXP2_POLY[0]);
    for c in &EXP2_POLY[1..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(*c));
    }
    // 2^n from its exponent bits: `shifted`'s bits are ROUND's plus n (n in [-126, 127]); the
    // shift drops ROUND's own mantissa bit, leaving (n + 127) << 23.
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_castps_si256(shifted),
        _mm256_set1_epi32(127),
    ));
    let r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-126.0));
    _mm256_andnot_ps(under, r)
}

#[target_feature(enable = "avx2,fma")]
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
    let sc = _mm256_set1_ps(scale);
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    for j in (0..n).step_by(W) {
        let mut bm = neg_inf;
        for c in 0..cols {
            let p = sp.add(c * n + j);
            let x = _mm256_mul_ps(_mm256_loadu_ps(p), sc);
            _mm256_storeu_ps(p, x);
            bm = _mm256_max_ps(bm, x);
        }
        let old = _mm256_loadu_ps(row_max.as_ptr().add(j));
        let new = _mm256_max_ps(old, bm);
        let none = _mm256_cmp_ps::<_CMP_EQ_OQ>(new, neg_inf);
        let a = exp2_ps(_mm256_sub_ps(old, new));
        _mm256_storeu_ps(
            alpha.as_mut_ptr().add(j),
            _mm256_blendv_ps(a, _mm256_set1_ps(1.0), none),
        );
        _mm256_storeu_ps(
            m_sub.as_mut_ptr().add(j),
            _mm256_blendv_ps(new, _mm256_setzero_ps(), none),
        );
        _mm256_storeu_ps(row_max.as_mut_ptr().add(j), new);
    }
}

#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn online_softmax(
    st: &mut [f32],
    cols: usize,
    n: usize,
    m_sub: &[f32],
    row_sum: &mut [f32],
    alpha: &[f32],
) {
    let sp = st.as_mut_ptr();
    for j in (0..n).step_by(W) {
        let m = _mm256_loadu_ps(m_sub.as_ptr().add(j));
        let mut sum = _mm256_mul_ps(
            _mm256_loadu_ps(row_sum.as_ptr().add(j)),
            _mm256_loadu_ps(alpha.as_ptr().add(j)),
        );
        for c in 0..cols {
            let p = sp.add(c * n + j);
            let e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(p), m));
            _mm256_storeu_ps(p, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(row_sum.as_mut_ptr().add(j), sum);
    }
}

#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn rescale_o(ot: &mut [f32], rows: usize, n: usize, alpha: &[f32]) {
    let op = ot.as_mut_ptr();
    for j in (0..n).step_by(W) {
        let a = _mm256_loadu_ps(alpha.as_ptr().add(j));
        for x in 0..rows {
            let p = op.add(x * n + j);
            _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), a));
        }
    }
}

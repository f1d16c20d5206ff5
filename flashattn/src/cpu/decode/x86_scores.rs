//! The AVX-512 score kernels over q as rows: dot products along `d` in register blocks of 4 keys
//! × 4 rows, then transposing reductions ([`reduce16`], [`reduce4`]); f32/f16/bf16 widened, and
//! bf16 pairs by `vdpbf16ps`.

use super::prefetch::Ahead;
use super::rows::KeyRows;
use super::x86_blocks::load16;
use crate::cpu::simd::LANES;
use crate::tensor::Element;
use half::bf16;

/// Writes a `K` keys × `R` rows block of scores: `out[j · np + i]` = the lane sum of `acc[j][i]`
/// plus `q[i][x] · k[j][x]` over the tail dims `from..d`, element by element (q row i at
/// `qp + i · dpad`, k row j at `kp[j]`). A full 4 × 4 block is reduced by [`reduce16`], 4 keys of
/// one row by [`reduce4`]. A macro, not a function: the accumulators must stay in registers, and
/// a `#[target_feature]` function cannot be forced inline (the first version, a function, was
/// not inlined and took 12% of the decode step, the accumulators passed through memory).
/// Expands inside an `unsafe` block of an AVX-512F function with `K`, `R` in scope.
macro_rules! store_scores {
    ($acc:expr, ($qp:expr, $dpad:expr), $kp:expr, ($from:expr, $d:expr), ($out:expr, $np:expr)) => {{
        use std::arch::x86_64::*;
        let (acc, qp, dpad, kp, from, d, out, np) = (&$acc, $qp, $dpad, &$kp, $from, $d, $out, $np);
        let flat = acc.as_flattened();
        // sums[j][i]: key j, row i (row-major, so lane 4j + i of reduce16's result).
        let mut sums = [[0f32; 4]; 4];
        if K == 4 && R == 4 {
            _mm512_storeu_ps(sums.as_mut_ptr().cast(), reduce16(flat));
        } else if K == 4 && R == 1 {
            let mut s = [0f32; 4];
            _mm_storeu_ps(
                s.as_mut_ptr(),
                reduce4([flat[0], flat[1], flat[2], flat[3]]),
            );
            (0..4).for_each(|j| sums[j][0] = s[j]);
        } else if R == 4 {
            for (j, aj) in flat.chunks_exact(4).enumerate() {
                _mm_storeu_ps(sums[j].as_mut_ptr(), reduce4([aj[0], aj[1], aj[2], aj[3]]));
            }
        } else {
            for (j, aj) in acc.iter().enumerate() {
                for (s, a) in sums[j].iter_mut().zip(aj) {
                    *s = _mm512_reduce_add_ps(*a);
                }
            }
        }
        for (j, (sj, kj)) in sums.iter().zip(kp.iter()).enumerate() {
            for (i, &s) in sj.iter().take(R).enumerate() {
                let mut s = s;
                for x in from..d {
                    s += *qp.add(i * dpad + x) * (*kj.add(x)).to_f32();
                }
                *out.add(j * np + i) = s;
            }
        }
    }};
}

/// [`scores`] in AVX-512, register-blocked: 4 keys × 4 query rows = 16 zmm accumulators, + 4
/// zmm of q and 1 of k per 16 dims (21 of 32 registers). Per 16 dims: 8 loads for 16 FMAs, so
/// the loop is bound by the FMA unit (one 512-bit FMA per cycle on Zen 4), not by loads; the
/// first version (one key × 4 rows, q re-read per key) issued 5 loads per 4 FMAs and took twice
/// as long as the P·V product of the same size. Then one horizontal sum per score ([`reduce4`]
/// for 4 rows at once); the `d % 16` tail of a row element by element.
///
/// # Safety
/// AVX-512F present; operands as checked by [`scores`].
///
/// [`scores`]: super::scores::scores
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores_avx512<T: Element>(
    q: &[f32],
    rows: usize,
    dpad: usize,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every block stays inside rows × cols.
    score_blocks!((kr, 4), rows, ahead, |c0, r0, kb, rb| {
        let at = (q, r0, dpad, src, kr, c0, &mut *st, np);
        by_tile!(kb, rb, |A, B| unsafe { scores_tile::<A, B, T>(at) });
    });
}

/// Operands of one [`scores_tile`]: q, its first row, dpad, the cache, its rows, the first key,
/// st, np.
pub(super) type ScoresAt<'a, T> = (
    &'a [f32],
    usize,
    usize,
    &'a [T],
    KeyRows<'a>,
    usize,
    &'a mut [f32],
    usize,
);

/// Keys `c0..c0 + K` × rows `r0..r0 + R` of [`scores_avx512`].
///
/// # Safety
/// As [`scores_avx512`]; `c0 + K <= cols`, `r0 + R <= rows`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_tile<const K: usize, const R: usize, T: Element>(at: ScoresAt<T>) {
    use std::arch::x86_64::*;
    let (q, r0, dpad, src, kr, c0, st, np) = at;
    let full = kr.d / LANES * LANES;
    // SAFETY: the caller's contract.
    unsafe {
        let qp = q.as_ptr().add(r0 * dpad);
        let kp: [*const T; K] = std::array::from_fn(|j| src.as_ptr().add(kr.at(c0 + j)));
        let mut acc = [[_mm512_setzero_ps(); R]; K];
        for x in (0..full).step_by(LANES) {
            let qv: [__m512; R] = std::array::from_fn(|i| _mm512_loadu_ps(qp.add(i * dpad + x)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let kv = load16(kp[j].add(x));
                for (a, qi) in aj.iter_mut().zip(&qv) {
                    *a = _mm512_fmadd_ps(*qi, kv, *a);
                }
            }
        }
        let out = st.as_mut_ptr().add(c0 * np + r0);
        store_scores!(acc, (qp, dpad), kp, (full, kr.d), (out, np));
    }
}

/// [`scores_avx512`] for bf16 with `vdpbf16ps`: each k row is read as it lies, 32 bf16 (16 pairs)
/// per load, against q as bf16 pairs; one instruction does 32 multiply-adds where the widening
/// path needs a load, two conversion instructions and two FMAs. Same 4 keys × 4 rows blocking;
/// a remaining 16 dims (d % 32 >= 16) go through the f32 path, the last d % 16 element by element.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`scores`].
///
/// [`scores`]: super::scores::scores
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores_avx512_bf16(
    q: &[f32],
    qb: &[u32],
    rows: usize,
    dpad: usize,
    src: &[bf16],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every block stays inside rows × cols.
    score_blocks!((kr, 4), rows, ahead, |c0, r0, kb, rb| {
        let at = (q, r0, dpad, src, kr, c0, &mut *st, np);
        by_tile!(kb, rb, |A, B| unsafe { scores_tile_bf16::<A, B>(at, qb) });
    });
}

/// Keys `c0..c0 + K` × rows `r0..r0 + R` of [`scores_avx512_bf16`].
///
/// # Safety
/// As [`scores_avx512_bf16`]; `c0 + K <= cols`, `r0 + R <= rows`.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn scores_tile_bf16<const K: usize, const R: usize>(at: ScoresAt<bf16>, qb: &[u32]) {
    use std::arch::x86_64::{
        __m512, __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
        _mm512_loadu_si512, _mm512_setzero_ps,
    };
    let (q, r0, dpad, src, kr, c0, st, np) = at;
    let (full32, full16) = (kr.d / 32 * 32, kr.d / LANES * LANES);
    // SAFETY: the caller's contract; q pairs of row r cover dims 0..dpad, k rows 0..d.
    unsafe {
        let qp = q.as_ptr().add(r0 * dpad);
        let qbp = qb.as_ptr().add(r0 * dpad / 2);
        let kp: [*const bf16; K] = std::array::from_fn(|j| src.as_ptr().add(kr.at(c0 + j)));
        let mut acc = [[_mm512_setzero_ps(); R]; K];
        for x in (0..full32).step_by(32) {
            let qv: [__m512bh; R] = std::array::from_fn(|i| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    qbp.add(i * dpad / 2 + x / 2).cast(),
                ))
            });
            for (j, aj) in acc.iter_mut().enumerate() {
                let kv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    kp[j].add(x).cast(),
                ));
                for (a, qi) in aj.iter_mut().zip(&qv) {
                    *a = _mm512_dpbf16_ps(*a, *qi, kv);
                }
            }
        }
        if full16 > full32 {
            let x = full32;
            let qv: [__m512; R] = std::array::from_fn(|i| _mm512_loadu_ps(qp.add(i * dpad + x)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let kv = load16(kp[j].add(x));
                for (a, qi) in aj.iter_mut().zip(&qv) {
                    *a = _mm512_fmadd_ps(*qi, kv, *a);
                }
            }
        }
        let out = st.as_mut_ptr().add(c0 * np + r0);
        store_scores!(acc, (qp, dpad), kp, (full16, kr.d), (out, np));
    }
}

/// The lane sums of 16 vectors `a[4j + i]`, as lane `4j + i` of one vector: 256-bit halves
/// added pairwise (two keys at a time), then 128-bit quarters, then two in-lane rounds, 45
/// instructions where 16 separate reductions take ~140.
///
/// # Safety
/// AVX-512F present; `a.len() == 16`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce16(a: &[std::arch::x86_64::__m512]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    debug_assert_eq!(a.len(), 16);
    // [x.q0 + x.q2, x.q1 + x.q3, y.q0 + y.q2, y.q1 + y.q3] (q: 128-bit quarters).
    let halves = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    };
    // t = [A0, A1, B0, B1], u = [C0, C1, D0, D1] -> [A0 + A1, B0 + B1, C0 + C1, D0 + D1].
    let quarters = |t: __m512, u: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(t, u),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(t, u),
        )
    };
    // Per 128-bit lane: [x0 + x1, x2 + x3, y0 + y1, y2 + y3].
    let pairs = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(x, y),
            _mm512_shuffle_ps::<0b11_01_11_01>(x, y),
        )
    };
    // w[i]: quarter j holds 4 partial sums of a[4j + i].
    let w: [__m512; 4] =
        std::array::from_fn(|i| quarters(halves(a[i], a[4 + i]), halves(a[8 + i], a[12 + i])));
    // Quarter j, lane i: Σ a[4j + i].
    pairs(pairs(w[0], w[1]), pairs(w[2], w[3]))
}

/// The horizontal sums of 4 vectors, `[Σ a[0], Σ a[1], Σ a[2], Σ a[3]]`: halves added, then
/// three `hadd`s and a final fold, ~19 instructions where four separate reductions take ~36.
///
/// # Safety
/// AVX-512F present.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce4(a: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let half = |x: __m512| {
        _mm256_add_ps(
            _mm512_castps512_ps256(x),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))),
        )
    };
    let (b0, b1, b2, b3) = (half(a[0]), half(a[1]), half(a[2]), half(a[3]));
    // [b0 01, b0 23, b1 01, b1 23 | b0 45, b0 67, b1 45, b1 67], likewise for b2, b3, then
    // [Σ b0 0..4, Σ b1 0..4, Σ b2 0..4, Σ b3 0..4 | the same of lanes 4..8].
    let h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

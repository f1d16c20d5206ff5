//! The AVX-512 score kernels over q in a [`QTrans`](super::scores::QTrans) form: outer products
//! against q transposed for many rows per kv head, and bf16 pairs in 4-row blocks (`Quads`) for a
//! few.

use super::prefetch::Ahead;
use super::rows::KeyRows;
use crate::cpu::simd::LANES;
use crate::tensor::Element;
use half::bf16;

/// [`scores`] in AVX-512 for a kv head with many query rows ([`bcast_min_rows`] or more: MQA,
/// several tokens per step): outer products, no horizontal sums. Each k element is broadcast
/// against a vector of 16 rows of q transposed (`qt[x · ld + r]`), in register tiles of 4 keys ×
/// 4 vectors (64 rows): 16 zmm accumulators, 4 of q, one broadcast; per dim 4 loads, 4
/// broadcasts and 16 FMAs. The dot-product blocks of [`scores_avx512`] spend a 45-instruction
/// reduction per 16 scores and reload q per 4 keys. Lanes past `rows` are not stored.
///
/// # Safety
/// AVX-512F present; operands as checked by [`scores`] (`qt` holds `kr.d` rows of `ld >=
/// rows` rounded up to 16 lanes).
///
/// [`bcast_min_rows`]: super::scores::bcast_min_rows
/// [`scores`]: super::scores::scores
/// [`scores_avx512`]: super::x86_scores::scores_avx512
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores_bcast_avx512<T: Element>(
    qt: &[f32],
    ld: usize,
    rows: usize,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every tile stays inside keys × rows.
    score_blocks!((kr, 4), rows.div_ceil(LANES), ahead, |c0, v0, kb, vb| {
        let at = (qt, ld, rows, src, kr, (c0, v0), &mut *st, np);
        by_tile!(kb, vb, |A, B| unsafe { scores_bcast_tile::<A, B, T>(at) });
    });
}

/// Stores a tile's accumulators (key `c0 + i`, rows of vector `v0 + j`) into `st` through
/// [`store_rows`].
///
/// # Safety
/// AVX-512F present; every stored key and vector inside `st` as [`store_rows`] requires.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile<const K: usize, const V: usize>(
    acc: &[[std::arch::x86_64::__m512; V]; K],
    st: &mut [f32],
    np: usize,
    (c0, v0): (usize, usize),
    rows: usize,
) {
    for (i, ai) in acc.iter().enumerate() {
        for (j, a) in ai.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { store_rows(*a, st, np, c0 + i, v0 + j, rows) };
        }
    }
}

/// Operands of one [`scores_bcast_tile`] (`P = f32`) or [`scores_bcast_tile_bf16`] (`P = u32`):
/// q transposed, its `ld`, rows, the cache, its rows, (first key, first vector of rows), st, np.
type BcastAt<'a, P, T> = (
    &'a [P],
    usize,
    usize,
    &'a [T],
    KeyRows<'a>,
    (usize, usize),
    &'a mut [f32],
    usize,
);

/// Stores accumulator `a` (rows `16 · v..16 · v + 16` of key `c`) into `st`, lanes past `rows`
/// masked off.
///
/// # Safety
/// AVX-512F present; `c · np + min(rows, 16 · v + 16) <= st.len()`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_rows(
    a: std::arch::x86_64::__m512,
    st: &mut [f32],
    np: usize,
    c: usize,
    v: usize,
    rows: usize,
) {
    use std::arch::x86_64::_mm512_mask_storeu_ps;
    let r = v * LANES;
    let n = (rows - r).min(LANES);
    let m = if n == LANES {
        u16::MAX
    } else {
        (1u16 << n) - 1
    };
    // SAFETY: the caller's contract; masked-off lanes are not written.
    unsafe { _mm512_mask_storeu_ps(st.as_mut_ptr().add(c * np + r), m, a) };
}

/// Keys `c0..c0 + K` × row vectors `v0..v0 + V` of [`scores_bcast_avx512`].
///
/// # Safety
/// As [`scores_bcast_avx512`]; `c0 + K <= cols`, `v0 + V <= rows.div_ceil(16)`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_bcast_tile<const K: usize, const V: usize, T: Element>(at: BcastAt<f32, T>) {
    use std::arch::x86_64::*;
    let (qt, ld, rows, src, kr, (c0, v0), st, np) = at;
    // SAFETY: the caller's contract.
    unsafe {
        let kp: [*const T; K] = std::array::from_fn(|i| src.as_ptr().add(kr.at(c0 + i)));
        let qp = qt.as_ptr().add(v0 * LANES);
        let mut acc = [[_mm512_setzero_ps(); V]; K];
        for x in 0..kr.d {
            let qv: [__m512; V] =
                std::array::from_fn(|j| _mm512_loadu_ps(qp.add(x * ld + j * LANES)));
            for (ai, kpi) in acc.iter_mut().zip(&kp) {
                let kx = _mm512_set1_ps((*kpi.add(x)).to_f32());
                for (a, qj) in ai.iter_mut().zip(&qv) {
                    *a = _mm512_fmadd_ps(kx, *qj, *a);
                }
            }
        }
        store_tile(&acc, st, np, (c0, v0), rows);
    }
}

/// [`scores_bcast_avx512`] for bf16 with `vdpbf16ps`: the pair of k dims `2x, 2x + 1`
/// broadcast as one u32 against the rows' pairs (`qt[x · ld + r]`); d even.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`scores`] (`qt` holds `kr.d / 2`
/// rows of `ld`).
///
/// [`scores`]: super::scores::scores
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores_bcast_avx512_bf16(
    qt: &[u32],
    ld: usize,
    rows: usize,
    src: &[bf16],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    // SAFETY (all calls): the caller's contract; every tile stays inside keys × rows.
    score_blocks!((kr, 4), rows.div_ceil(LANES), ahead, |c0, v0, kb, vb| {
        let at = (qt, ld, rows, src, kr, (c0, v0), &mut *st, np);
        by_tile!(kb, vb, |A, B| unsafe { scores_bcast_tile_bf16::<A, B>(at) });
    });
}

/// Keys `c0..c0 + K` × row vectors `v0..v0 + V` of [`scores_bcast_avx512_bf16`].
///
/// # Safety
/// As [`scores_bcast_avx512_bf16`]; `c0 + K <= cols`, `v0 + V <= rows.div_ceil(16)`.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn scores_bcast_tile_bf16<const K: usize, const V: usize>(at: BcastAt<u32, bf16>) {
    use std::arch::x86_64::*;
    let (qt, ld, rows, src, kr, (c0, v0), st, np) = at;
    let bh = |x: __m512i| std::mem::transmute::<__m512i, __m512bh>(x);
    // SAFETY: the caller's contract; a k pair is read unaligned (a row may start at an odd
    // element).
    unsafe {
        let kp: [*const half::bf16; K] = std::array::from_fn(|i| src.as_ptr().add(kr.at(c0 + i)));
        let qp = qt.as_ptr().add(v0 * LANES);
        let mut acc = [[_mm512_setzero_ps(); V]; K];
        for x in 0..kr.d / 2 {
            let qv: [__m512i; V] =
                std::array::from_fn(|j| _mm512_loadu_si512(qp.add(x * ld + j * LANES).cast()));
            for (ai, kpi) in acc.iter_mut().zip(&kp) {
                let pair = kpi.add(2 * x).cast::<i32>().read_unaligned();
                let kx = bh(_mm512_set1_epi32(pair));
                for (a, qj) in ai.iter_mut().zip(&qv) {
                    *a = _mm512_dpbf16_ps(*a, kx, bh(*qj));
                }
            }
        }
        store_tile(&acc, st, np, (c0, v0), rows);
    }
}

/// Keys per register block of [`scores_quad_avx512_bf16`]: 16 accumulators, two vectors of q
/// and the broadcasts of k.
const QUAD_KEYS: usize = 8;

/// [`scores`] for bf16 with `vdpbf16ps` and a few query rows per kv head (GQA with
/// [`QUAD_MIN_ROWS`] rows or more, fewer than [`bcast_min_rows`]): q in the `Quads` form
/// ([`QTrans::quads`]), a vector holding 8 pairs of each of two rows; 16 dims of a k row (32
/// bytes) are broadcast to both 256-bit halves and multiply two such vectors (4 rows), so a
/// key's two accumulators hold its 4 scores as 8 partial sums each. 4 keys' accumulators then
/// reduce to their 16 scores with 21 instructions and one permute, where the dot-product blocks
/// of [`scores_avx512_bf16`] need 45 per 16 (scratch timing of the inner loops alone, data in
/// L1, 2026-11-23: both at ~1.05 cycles per `vdpbf16ps`; a 128-bit broadcast per
/// `vdpbf16ps` instead takes 1.4-1.65). d a multiple of 16. Against the dot-product kernel (A/B
/// in one process, the variants alternating call by call, both orders, bf16, 2026-11-23): the
/// decode benchmark shape (GQA 4, 32k keys, two threads) 0.96-0.99 in six runs; 4 tokens a step
/// (16 rows) and GQA 8 (8 rows) 0.94-0.96 when it runs second in each pair, 0.99 when first;
/// with the cache in L2/L3 (one thread) 0.98-1.02.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`scores`] (`qt` holds
/// `rows.div_ceil(4) · d / 16 · 32` pairs).
///
/// [`QTrans::quads`]: super::scores::QTrans::quads
/// [`QUAD_MIN_ROWS`]: super::scores::QUAD_MIN_ROWS
/// [`bcast_min_rows`]: super::scores::bcast_min_rows
/// [`scores`]: super::scores::scores
/// [`scores_avx512_bf16`]: super::x86_scores::scores_avx512_bf16
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn scores_quad_avx512_bf16(
    qt: &[u32],
    rows: usize,
    src: &[bf16],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    let blocks = rows.div_ceil(4);
    let mut c0 = 0;
    while c0 < kr.cols() {
        let kb = (kr.cols() - c0).min(QUAD_KEYS);
        ahead.step(kb);
        let mut b = 0;
        while b < blocks {
            // SAFETY: the caller's contract; keys c0..c0 + kb and rows 4b..min(4b + 8, rows)
            // lie inside kr and st.
            unsafe {
                // Two row blocks share each broadcast of k (4 keys at a time, 16 accumulators
                // still): 8-16 rows per kv head, one thread, 1024-2048 keys, 0.973-0.979 of the
                // time of one block per pass (A/B in one process, both orders, 2026-11-24).
                if b + 1 < blocks {
                    for h in (0..kb).step_by(QUAD_KEYS / 2) {
                        let kh = (kb - h).min(QUAD_KEYS / 2);
                        scores_quad_tile::<2, { QUAD_KEYS / 2 }>(
                            qt,
                            (rows, b),
                            src,
                            kr,
                            (c0 + h, kh),
                            st,
                            np,
                        );
                    }
                    b += 2;
                } else {
                    scores_quad_tile::<1, QUAD_KEYS>(qt, (rows, b), src, kr, (c0, kb), st, np);
                    b += 1;
                }
            }
        }
        c0 += kb;
    }
}

/// Keys `c0..c0 + kb` (`kb <= KEYS`) × the `NB` row blocks from `b` (rows `4b..4b + 4·NB`) of
/// [`scores_quad_avx512_bf16`]: `2·NB·KEYS` accumulators (16 for 1 × 8 and 2 × 4). Keys past
/// `kb` repeat the last one and are not stored; rows past `rows` are not stored.
///
/// # Safety
/// As [`scores_quad_avx512_bf16`]; `c0 + kb <= cols`, `4(b + NB - 1) < rows`, `KEYS` a multiple
/// of 4.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn scores_quad_tile<const NB: usize, const KEYS: usize>(
    qt: &[u32],
    (rows, b): (usize, usize),
    src: &[bf16],
    kr: KeyRows,
    (c0, kb): (usize, usize),
    st: &mut [f32],
    np: usize,
) {
    use std::arch::x86_64::*;
    let steps = kr.d / 16;
    let bh = |x: __m512i| std::mem::transmute::<__m512i, __m512bh>(x);
    // SAFETY: the caller's contract; each k read is 16 dims inside a row of d.
    unsafe {
        let kp: [*const half::bf16; KEYS] =
            std::array::from_fn(|j| src.as_ptr().add(kr.at(c0 + j.min(kb - 1))));
        let qp: [*const u32; NB] = std::array::from_fn(|n| qt.as_ptr().add((b + n) * steps * 32));
        let mut acc = [[[_mm512_setzero_ps(); 2]; NB]; KEYS];
        for s in 0..steps {
            let qv: [[__m512bh; 2]; NB] = std::array::from_fn(|n| {
                [
                    bh(_mm512_loadu_si512(qp[n].add(s * 32).cast())),
                    bh(_mm512_loadu_si512(qp[n].add(s * 32 + 16).cast())),
                ]
            });
            for (a, kpj) in acc.iter_mut().zip(&kp) {
                let kv = bh(_mm512_broadcast_i64x4(_mm256_loadu_si256(
                    kpj.add(16 * s).cast(),
                )));
                for (an, qn) in a.iter_mut().zip(&qv) {
                    an[0] = _mm512_dpbf16_ps(an[0], qn[0], kv);
                    an[1] = _mm512_dpbf16_ps(an[1], qn[1], kv);
                }
            }
        }
        // Per key: 128-bit lane i = 4 partial sums of row 4b + i.
        let by_row = |a: &[__m512; 2]| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a[0], a[1]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a[0], a[1]),
            )
        };
        for n in 0..NB {
            let bn = b + n;
            let nr = (rows - 4 * bn).min(4);
            for (g, a) in acc.chunks_exact(4).enumerate() {
                let s = quad_scores([
                    by_row(&a[0][n]),
                    by_row(&a[1][n]),
                    by_row(&a[2][n]),
                    by_row(&a[3][n]),
                ]);
                let at = st.as_mut_ptr().add((c0 + 4 * g) * np + 4 * bn);
                let mut x = [[0f32; 4]; 4];
                _mm512_storeu_ps(x.as_mut_ptr().cast(), s);
                for (j, xj) in x.iter().enumerate().take(kb.saturating_sub(4 * g)) {
                    if nr == 4 {
                        _mm_storeu_ps(at.add(j * np), _mm_loadu_ps(xj.as_ptr()));
                    } else {
                        (0..nr).for_each(|i| *at.add(j * np + i) = xj[i]);
                    }
                }
            }
        }
    }
}

/// The scores of 4 keys' quad accumulators (lane `i` of `a[j]`: 4 partial sums of row `i`,
/// key `j`), as lane `j`, element `i` of one vector: two in-lane transposing rounds (6
/// shuffles, 3 adds), then one permute from rows × keys to keys × rows.
///
/// # Safety
/// AVX-512F present.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn quad_scores(a: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Per lane: [x0 + x2, y0 + y2, x1 + x3, y1 + y3].
    let mix =
        |x: __m512, y: __m512| _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    let (s01, s23) = (mix(a[0], a[1]), mix(a[2], a[3]));
    let pd = _mm512_castps_pd;
    // Per lane: [Σ a0, Σ a1, Σ a2, Σ a3] (row i's score of keys 0..4 in lane i).
    let s = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(pd(s01), pd(s23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(pd(s01), pd(s23))),
    );
    let keys_by_rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(keys_by_rows, s)
}

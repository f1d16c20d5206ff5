//! The decode products in AVX2 + FMA + F16C (8 f32 lanes, 16 ymm registers): [`scores`] and
//! [`pv`], for f32, f16 (widened by `vcvtph2ps`) and bf16 caches. The AVX2 kernel table needs only
//! AVX2 and FMA, so the callers check F16C, and a CPU without it takes the portable kernels.
//!
//! Without AVX-512 there is no bf16 dot product, and one token of GQA 4 (4 query rows per kv
//! head) does 2 · 4 multiply-adds per cache element: at AVX2's 16 f32 FMAs a cycle per core the
//! arithmetic of a bf16 step takes about as long as its read at ~44 GB/s (2 cores; see
//! docs/PERFORMANCE.md), so the kernels are written to keep both FMA units busy:
//! - bf16 rows are widened in pairs: one 256-bit load holds 16 values as 8 u32 lanes `(even,
//!   odd)`; a shift left by 16 gives the even values as f32, a mask of the high halves the odd
//!   ones, exactly. Two integer instructions per 16 values, where zero-extending 8 at a time takes
//!   a cross-lane `vpmovzxwd` and a shift per 8. The products then see each 16-dim chunk in the
//!   order `0, 2, .., 14, 1, 3, .., 15`: q is stored in that order ([`even_odd`]), and so are an
//!   item's acc_o rows, which P·V adds its accumulators to as they are; the item puts them back
//!   in dim order once, at its end ([`acc_to_dim_order`]), where P·V used to shuffle them back
//!   (four shuffles per row and chunk) at the end of every call.
//! - register tiles sized for 16 registers: scores 2 keys × 4 rows (8 accumulators, 4 of k, one
//!   of q, the mask: 14), for f32 keys at d = 128 3 keys × 4 rows (12 accumulators, 3 of k, one
//!   of q: 16), P·V 4 rows × 16 dims (8 accumulators, 2 of v, a broadcast, the mask: 12). The
//!   earlier P·V tile of 4 rows × 24 dims needed all 16 registers, and LLVM kept two
//!   accumulators on the stack and moved the others round each key (~6 instructions per FMA).
//!
//! Dims past the last whole chunk of 16 go element by element (d = 40, 59, ...).
//!
//! Safety: every function here needs AVX2, FMA and F16C (the kernel table of [`Isa::Avx2`] exists
//! only on a CPU with the first two; the callers check the third) and operands that passed the
//! bounds checks of [`super::scores`] and [`super::pv_acc`].
//!
//! [`Isa::Avx2`]: crate::cpu::simd::Isa::Avx2
//!
//! [`super::pv_acc`]: super::pv::pv_acc

use super::prefetch::Ahead;
use super::rows::KeyRows;
use super::x86_pv::{pv_tail, PvAt};
use super::x86_scores::ScoresAt;
use crate::tensor::{DType, Element};
use std::arch::x86_64::*;

/// Dims per chunk: one 256-bit load of bf16, two of f32.
pub(crate) const CHUNK: usize = 16;

/// `rows` rows of `dpad` f32 (`q`) with each whole 16-dim chunk of the first `d` dims stored even
/// dims first: `q[16c + 0], q[16c + 2], .., q[16c + 14], q[16c + 1], .., q[16c + 15]`, the form
/// [`scores`] takes q in for bf16 keys. Dims from `d / 16 · 16` on stay in order.
pub(crate) fn even_odd(q: &[f32], rows: usize, d: usize, dpad: usize) -> crate::cpu::Buf<f32> {
    let mut t = crate::cpu::buf_from(q[..rows * dpad].iter().copied());
    for r in 0..rows {
        let row = &q[r * dpad..r * dpad + d / CHUNK * CHUNK];
        let dst = &mut t[r * dpad..];
        for (c, chunk) in row.chunks_exact(CHUNK).enumerate() {
            for i in 0..CHUNK / 2 {
                dst[c * CHUNK + i] = chunk[2 * i];
                dst[c * CHUNK + CHUNK / 2 + i] = chunk[2 * i + 1];
            }
        }
    }
    t
}

/// Puts a row of acc_o kept in [`even_odd`] order (each whole 16-dim chunk even dims first) back
/// in dim order; dims past the last whole chunk are in order already. An item's rows over bf16
/// caches are in that order while [`pv`] adds to them (see [`super::pv::acc_in_even_odd_order`]).
pub(crate) fn acc_to_dim_order(row: &mut [f32]) {
    let mut t = [0f32; CHUNK];
    for c in row.chunks_exact_mut(CHUNK) {
        for i in 0..CHUNK / 2 {
            t[2 * i] = c[i];
            t[2 * i + 1] = c[CHUNK / 2 + i];
        }
        c.copy_from_slice(&t);
    }
}

/// The 16 values of a chunk at `p` as two f32 vectors: bf16 as (even dims, odd dims), widened
/// exactly (a shift and a mask); f32 as (dims 0..8, dims 8..16); f16 the same, widened exactly
/// by `vcvtph2ps`.
///
/// # Safety
/// AVX2 and F16C present; 16 elements readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_chunk<T: Element>(p: *const T, high: __m256i) -> (__m256, __m256) {
    // SAFETY: the caller's contract.
    unsafe {
        if T::DTYPE == DType::BF16 {
            let raw = _mm256_loadu_si256(p.cast());
            (
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw)),
                _mm256_castsi256_ps(_mm256_and_si256(raw, high)),
            )
        } else if T::DTYPE == DType::F16 {
            let p = p.cast::<__m128i>();
            (
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            )
        } else {
            let p = p.cast::<f32>();
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
    }
}

/// Whether this CPU has F16C, which the kernels here need beside the AVX2 table's AVX2 and FMA
/// (`is_x86_feature_detected!` caches its answer).
pub(crate) fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("f16c")
}

/// The 32-bit mask of the high halves (bf16 odd dims).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn high_halves() -> __m256i {
    _mm256_set1_epi32(0xffff_0000u32 as i32)
}

/// `st[c · np + r] = Σ_x q[r][x] · k[c][x]`, as [`super::scores`] for [`super::Isa::Avx2`]: q as
/// rows of `dpad` f32, in [`even_odd`] order when `T` is bf16 (and in dim order for f32).
///
/// Register tiles of 2 keys × up to 4 rows (8 accumulators; per 16 dims 2 loads of k, for bf16
/// their widening, 8 loads of q, 16 FMAs), or 3 keys × 4 rows for f32 keys at d = 128, then one
/// horizontal reduction per key and one 128-bit store for 4 rows: `st`'s rows of a key are
/// adjacent. The bound here is the loads (2 of 256 bits a cycle): q read by the FMAs from memory
/// (1 key × 4 rows, 9 loads per 8 FMAs) ran at 0.5-0.8 of the FMA peak in a micro-benchmark, this
/// tile at 0.65-0.85.
///
/// # Safety
/// AVX2, FMA and F16C present; operands as checked by [`super::scores`].
///
/// [`super::Isa::Avx2`]: crate::cpu::simd::Isa::Avx2
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn scores<T: Element>(
    q: &[f32],
    rows: usize,
    dpad: usize,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    let cols = kr.cols();
    let mut r0 = 0;
    // SAFETY: the caller's contract; every block stays inside rows × cols.
    unsafe {
        while r0 < rows {
            let (mut c0, mut pf_at) = (0, 0);
            while c0 < cols {
                // The prefetches spread over the first row block's keys, four at a time.
                if r0 == 0 && c0 >= pf_at {
                    ahead.step((cols - c0).min(PF_KEYS));
                    pf_at = c0 + PF_KEYS;
                }
                let at = (q, r0, dpad, src, kr, c0, &mut *st, np);
                // The usual head dims with q rows unpadded (dpad = d) have the dim loop
                // unrolled and q at constant offsets.
                let nc = if dpad == kr.d { kr.d / CHUNK } else { 0 };
                // f32 keys need no mask register: 3 keys × 4 rows (12 accumulators, 3 of k,
                // one of q) fit the 16 registers, with 12 FMA chains where the 2 × 4 tile's 8
                // just cover the FMA latency, and 7 loads per 12 FMAs against 6 per 8. The
                // product alone on one sub-block: 63-66% -> 68-71% of the FMA peak; the whole
                // step with the cache in L2/L3 ~2% faster, at 32k keys no change (see
                // docs/PERFORMANCE.md, 2026-11-26).
                if T::DTYPE == DType::F32 && cols - c0 >= 3 && rows - r0 >= 4 && nc == 8 {
                    scores_tile::<3, 4, 8, T>(at);
                    c0 += 3;
                    continue;
                }
                match (cols - c0 >= 2, rows - r0, nc) {
                    (true, 4.., 8) => scores_tile::<2, 4, 8, T>(at),
                    (true, 4.., 4) => scores_tile::<2, 4, 4, T>(at),
                    (true, 4.., _) => scores_tile::<2, 4, 0, T>(at),
                    (true, 3, _) => scores_tile::<2, 3, 0, T>(at),
                    (true, 2, _) => scores_tile::<2, 2, 0, T>(at),
                    (true, _, _) => scores_tile::<2, 1, 0, T>(at),
                    (false, 4.., _) => scores_tile::<1, 4, 0, T>(at),
                    (false, 3, _) => scores_tile::<1, 3, 0, T>(at),
                    (false, 2, _) => scores_tile::<1, 2, 0, T>(at),
                    (false, _, _) => scores_tile::<1, 1, 0, T>(at),
                }
                c0 += 2;
            }
            r0 += 4;
        }
    }
}

/// Keys per prefetch step of the products (the next tile's lines asked for a few keys at a
/// time; see [`Ahead`]): every key's step took ~600 instructions a key (bf16, 8 kv heads), a
/// sixth of all, and the whole call's at once held up the call's own loads.
const PF_KEYS: usize = 4;

/// The horizontal sums of 4 vectors, `[Σ a[0], Σ a[1], Σ a[2], Σ a[3]]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn reduce4(a: [__m256; 4]) -> __m128 {
    // Per 128-bit half: [Σ a0, Σ a1, Σ a2, Σ a3] of that half's 4 lanes.
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

/// Keys `c0..c0 + K` × rows `r0..r0 + R` of [`scores`]; `NC > 0`: d = dpad = 16 · NC.
///
/// # Safety
/// As [`scores`]; `c0 + K <= cols`, `r0 + R <= rows`, `R <= 4`; `NC` is 0 or `d / 16` with
/// `dpad == d`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scores_tile<const K: usize, const R: usize, const NC: usize, T: Element>(
    at: ScoresAt<T>,
) {
    let (q, r0, dpad, src, kr, c0, st, np) = at;
    let (d, full, dpad) = if NC > 0 {
        (NC * CHUNK, NC * CHUNK, NC * CHUNK)
    } else {
        (kr.d, kr.d / CHUNK * CHUNK, dpad)
    };
    let high = high_halves();
    // SAFETY: the caller's contract: q rows r0..r0 + R of dpad >= d values, k rows of d values
    // at kr's offsets, st rows of np >= r0 + R lanes per key.
    unsafe {
        let qp = q.as_ptr().add(r0 * dpad);
        let kp: [*const T; K] = std::array::from_fn(|j| src.as_ptr().add(kr.at(c0 + j)));
        let mut acc = [[_mm256_setzero_ps(); R]; K];
        for x in (0..full).step_by(CHUNK) {
            let kv: [(__m256, __m256); K] = std::array::from_fn(|j| load_chunk(kp[j].add(x), high));
            // Row i's q against both keys: acc is indexed [key][row], the loop runs by row.
            #[allow(clippy::needless_range_loop)]
            for i in 0..R {
                let q0 = _mm256_loadu_ps(qp.add(i * dpad + x));
                for j in 0..K {
                    acc[j][i] = _mm256_fmadd_ps(q0, kv[j].0, acc[j][i]);
                }
                let q1 = _mm256_loadu_ps(qp.add(i * dpad + x + 8));
                for j in 0..K {
                    acc[j][i] = _mm256_fmadd_ps(q1, kv[j].1, acc[j][i]);
                }
            }
        }
        // Rows past R summed as zeros; all 4 lanes stored when there are 4 rows and no tail
        // (kept apart from the general case: LLVM otherwise left the accumulators on the
        // stack and looped over them).
        let zero = _mm256_setzero_ps();
        let sums: [__m128; K] = std::array::from_fn(|j| {
            reduce4(std::array::from_fn(|i| {
                if i < R {
                    acc[j][i.min(R - 1)]
                } else {
                    zero
                }
            }))
        });
        let out = st.as_mut_ptr().add(c0 * np + r0);
        if R == 4 && full == d {
            for (j, s) in sums.into_iter().enumerate() {
                _mm_storeu_ps(out.add(j * np), s);
            }
        } else {
            score_tails::<K, R, T>(sums, (qp, dpad), kp, (full, d), (out, np));
        }
    }
}

/// Writes the `K` keys × `R` rows of scores `sums[j][i]` (lane i) to `out[j · np + i]`, each
/// plus `q[i][x] · k[j][x]` over the tail dims `full..d` (q row i at `qp + i · dpad`, k row j at
/// `kp[j]`).
///
/// # Safety
/// As [`scores_tile`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline(never)]
unsafe fn score_tails<const K: usize, const R: usize, T: Element>(
    sums: [__m128; K],
    (qp, dpad): (*const f32, usize),
    kp: [*const T; K],
    (full, d): (usize, usize),
    (out, np): (*mut f32, usize),
) {
    // SAFETY: the caller's contract.
    unsafe {
        for (j, (s, kj)) in sums.into_iter().zip(kp).enumerate() {
            let mut v = [0f32; 4];
            _mm_storeu_ps(v.as_mut_ptr(), s);
            for (i, &s) in v.iter().take(R).enumerate() {
                let mut s = s;
                for x in full..d {
                    s += *qp.add(i * dpad + x) * (*kj.add(x)).to_f32();
                }
                *out.add(j * np + i) = s;
            }
        }
    }
}

/// `acc[r · dpad + x] += Σ_c p[c][r] · v[c][x]`, as [`super::pv_acc`] for [`super::Isa::Avx2`],
/// with acc's rows in [`even_odd`] order when `T` is bf16 (in dim order otherwise).
///
/// Register tiles of up to 4 rows × 16 dims (8 accumulators; per key one load of v, for bf16 its
/// two widening instructions, 4 broadcasts of p, 8 FMAs: 5 loads per 8 FMAs) over all keys; the
/// dims past the last whole chunk element by element. In a micro-benchmark this tile ran at
/// 0.75-0.95 of the FMA peak; p read by the FMAs from a buffer of broadcast vectors (9 loads per
/// 8 FMAs) at 0.65-0.8, and the earlier 4 rows × 24 dims needed all 16 registers, so LLVM kept
/// two accumulators on the stack. `ahead` is stepped by the keys' count on entry.
///
/// # Safety
/// AVX2, FMA and F16C present; operands as checked by [`super::pv_acc`].
///
/// [`super::Isa::Avx2`]: crate::cpu::simd::Isa::Avx2
/// [`super::pv_acc`]: super::pv::pv_acc
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pv<T: Element>(
    st: &[f32],
    np: usize,
    rows: usize,
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    ahead: &mut Ahead,
) {
    let full = vr.d / CHUNK * CHUNK;
    let mut first = Some(ahead);
    let mut r0 = 0;
    // SAFETY: the caller's contract; every tile below stays inside rows × d.
    unsafe {
        while r0 < rows {
            let rb = (rows - r0).min(4);
            for x0 in (0..full).step_by(CHUNK) {
                let at = (st, np, r0, src, vr, x0, &mut *acc, dpad, first.take());
                match rb {
                    4 => pv_tile::<4, T>(at),
                    3 => pv_tile::<3, T>(at),
                    2 => pv_tile::<2, T>(at),
                    _ => pv_tile::<1, T>(at),
                }
            }
            // The tail dims full..d (and every key's step when there was no tile: d < 16).
            pv_tail(st, np, (r0, rb), src, vr, acc, dpad, full, first.take());
            r0 += rb;
        }
    }
}

/// Rows `r0..r0 + R`, dims `x0..x0 + 16` of [`pv`] (`x0`, the operands' first dim, a multiple of
/// 16; the operands as [`super::PvAt`]).
///
/// # Safety
/// As [`pv`]; `r0 + R <= rows`, `x0 + 16 <= d`.
///
/// [`super::PvAt`]: super::x86_pv::PvAt
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pv_tile<const R: usize, T: Element>(at: PvAt<f32, T>) {
    let (st, np, r0, src, vr, x0, acc, dpad, ahead) = at;
    let high = high_halves();
    // SAFETY: the caller's contract.
    unsafe {
        // bf16: a[i] = (even dims, odd dims) of the chunk; f32: (dims 0..8, dims 8..16).
        let mut a = [(_mm256_setzero_ps(), _mm256_setzero_ps()); R];
        let base = src.as_ptr().add(x0 + vr.head);
        let mut pc = st.as_ptr().add(r0);
        let mut step = |key: usize, pc: *const f32| {
            let (v0, v1) = load_chunk(base.add(key), high);
            for (i, ai) in a.iter_mut().enumerate() {
                let p = _mm256_broadcast_ss(&*pc.add(i));
                ai.0 = _mm256_fmadd_ps(p, v0, ai.0);
                ai.1 = _mm256_fmadd_ps(p, v1, ai.1);
            }
        };
        // Two keys an iteration: the loop's own instructions are a fifth of a key's. The first
        // tile steps the prefetches every PF_KEYS keys, in a loop of its own (a check per
        // iteration in the common loop cost it 7 of its 38 instructions). Keys by index: over
        // `chunks_exact(2)` one build kept the f32 loop's bound on the stack, and its f32 step
        // took 1.05-1.10× the time (one thread, cache in L2).
        let mut keys = |ks: &[usize], pc: &mut *const f32| {
            let mut c = 0;
            while c + 2 <= ks.len() {
                step(ks[c], *pc);
                step(ks[c + 1], pc.add(np));
                *pc = pc.add(2 * np);
                c += 2;
            }
            if c < ks.len() {
                step(ks[c], *pc);
                *pc = pc.add(np);
            }
        };
        match ahead {
            Some(ah) => {
                for ks in vr.keys.chunks(PF_KEYS) {
                    ah.step(ks.len());
                    keys(ks, &mut pc);
                }
            }
            None => keys(vr.keys, &mut pc),
        }
        // bf16: (even dims, odd dims) of the chunk, added as they are (acc in even-odd order).
        let ap = acc.as_mut_ptr();
        for (i, &(y0, y1)) in a.iter().enumerate() {
            let at = ap.add((r0 + i) * dpad + x0);
            _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), y0));
            _mm256_storeu_ps(at.add(8), _mm256_add_ps(_mm256_loadu_ps(at.add(8)), y1));
        }
    }
}

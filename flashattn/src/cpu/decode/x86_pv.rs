//! The AVX-512 P·V kernels (f32/f16/bf16 widened, and bf16 pairs of keys by `vdpbf16ps`), and
//! the element-by-element tail shared with the AVX2 ones ([`pv_tail`]).

use super::prefetch::Ahead;
use super::rows::{KeyRows, PRows};
use super::x86_blocks::load16;
use crate::cpu::simd::LANES;
use crate::tensor::Element;
use half::bf16;

/// The tail of a P·V row block, element by element: `acc[r][x] += p[c][r] · v[c][x]` for rows
/// `r0..r0 + rb`, dims `from..d`, every key; `ahead` (if given: no vector tile stepped it) is
/// stepped once per key. Shared by the AVX2 and AVX-512 products, whose vector widths leave
/// `d % 8` and `d % 16` dims.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn pv_tail<T: Element>(
    st: &[f32],
    np: usize,
    (r0, rb): (usize, usize),
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    from: usize,
    mut ahead: Option<&mut Ahead>,
) {
    if from >= vr.d && ahead.is_none() {
        return; // d a multiple of the vector width: nothing to add (the usual case)
    }
    for c in 0..vr.cols() {
        if let Some(a) = ahead.as_deref_mut() {
            a.step(1);
        }
        let row = &src[vr.at(c)..vr.at(c) + vr.d];
        for r in r0..r0 + rb {
            let p = st[c * np + r];
            let acc_r = &mut acc[r * dpad..r * dpad + vr.d];
            for (a, v) in acc_r[from..].iter_mut().zip(&row[from..]) {
                *a += p * v.to_f32();
            }
        }
    }
}

/// [`pv_acc`] in AVX-512 from the 16-dim vector `x_start` on: tiles of up to 4 rows × 4 vectors
/// (64 dims) held in 16 zmm accumulators over all keys, + 4 zmm of v per key and a broadcast of
/// p: 21 of 32 registers (the budget of `simd::x86_avx512::gemm`). Per key: 4 loads (widened),
/// 4 broadcasts, 16 FMAs. The `d % 16` tail element by element. `ahead` (if given) is stepped
/// once per key, in the first tile.
///
/// # Safety
/// AVX-512F present; operands as checked by [`pv_acc`].
///
/// [`pv_acc`]: super::pv::pv_acc
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv_avx512<T: Element>(
    st: &[f32],
    np: usize,
    rows: usize,
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    x_start: usize,
    mut ahead: Option<&mut Ahead>,
) {
    let nv = vr.d / LANES;
    let mut r0 = 0;
    // SAFETY: the caller's contract; every tile below stays inside rows × d.
    unsafe {
        // Row blocks of up to 6 (`pv_row_block`; 6 × 4 vectors: 24 accumulators, each key's 4
        // loads of v feeding 24 FMAs). 4 tokens a step at GQA 4 (16 rows), f32, one thread,
        // 1024 keys: 0.955-0.964 of the time with blocks of 4; 2 tokens at GQA 8: 0.97; MQA
        // 0.98-0.99 (A/B in one process, both orders, 2026-11-24).
        let mut blk = 0;
        while r0 < rows {
            let rb = pv_row_block(rows, blk);
            blk += 1;
            let mut x0 = x_start;
            while x0 < nv {
                let xv = (nv - x0).min(4);
                match (rb, xv) {
                    (6, 4) => {
                        pv_tile::<6, 4, T>((st, np, r0, src, vr, x0, &mut *acc, dpad, ahead.take()))
                    }
                    (5, 4) => {
                        pv_tile::<5, 4, T>((st, np, r0, src, vr, x0, &mut *acc, dpad, ahead.take()))
                    }
                    _ => {
                        let mut r = r0;
                        while r < r0 + rb {
                            let h = (r0 + rb - r).min(4);
                            let at = (st, np, r, src, vr, x0, &mut *acc, dpad, ahead.take());
                            by_tile!(h, xv, |A, B| pv_tile::<A, B, T>(at));
                            r += h;
                        }
                    }
                }
                x0 += xv;
            }
            // The tail dims d - d % 16..d (and every key's step when there was no tile: d < 16).
            pv_tail(
                st,
                np,
                (r0, rb),
                src,
                vr,
                acc,
                dpad,
                nv * LANES,
                ahead.take(),
            );
            r0 += rb;
        }
    }
}

/// Rows of the `blk`-th register block of the P·V products over `rows` rows: all of them up to
/// 4, else balanced blocks of up to 6 (16 rows as 6, 5, 5; 32 as 6, 6, 5, 5, 5, 5), which the
/// callers run as 5- and 6-row tiles where the dims allow.
fn pv_row_block(rows: usize, blk: usize) -> usize {
    if rows <= 4 {
        return rows;
    }
    let nb = rows.div_ceil(6);
    rows / nb + usize::from(blk < rows % nb)
}

/// Operands of one [`pv_tile`] (`P = f32`) or [`pv_tile_bf16`] (`P = u32`, p as bf16 pairs,
/// `T = bf16`): p, np, the first row, the cache, its rows, the first vector or chunk, acc,
/// dpad, and the prefetcher to step (first tile only).
pub(super) type PvAt<'a, P, T> = (
    &'a [P],
    usize,
    usize,
    &'a [T],
    KeyRows<'a>,
    usize,
    &'a mut [f32],
    usize,
    Option<&'a mut Ahead>,
);

/// Rows `r0..r0 + R`, vectors `x0..x0 + V` (dims `16·x0..16·(x0 + V)`) of [`pv_avx512`].
///
/// # Safety
/// As [`pv_avx512`]; `r0 + R <= rows`, `16 · (x0 + V) <= d`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pv_tile<const R: usize, const V: usize, T: Element>(at: PvAt<f32, T>) {
    use std::arch::x86_64::*;
    let (st, np, r0, src, vr, x0, acc, dpad, mut ahead) = at;
    // SAFETY: the caller's contract.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); V]; R];
        let sp = st.as_ptr().add(r0);
        for c in 0..vr.cols() {
            if let Some(ah) = ahead.as_deref_mut() {
                ah.step(1);
            }
            let row = src.as_ptr().add(vr.at(c) + x0 * LANES);
            let mut vv = [_mm512_setzero_ps(); V];
            for (j, x) in vv.iter_mut().enumerate() {
                *x = load16(row.add(j * LANES));
            }
            let pc = sp.add(c * np);
            for (i, ai) in a.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*pc.add(i));
                for (x, vx) in ai.iter_mut().zip(&vv) {
                    *x = _mm512_fmadd_ps(p, *vx, *x);
                }
            }
        }
        let ap = acc.as_mut_ptr();
        for (i, ai) in a.iter().enumerate() {
            for (j, x) in ai.iter().enumerate() {
                let at = ap.add((r0 + i) * dpad + (x0 + j) * LANES);
                _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), *x));
            }
        }
    }
}

/// [`pv_acc`] for bf16 with `vdpbf16ps`: the dims in whole 32-dim chunks take keys two at a
/// time, their v rows interleaved in registers (`vpunpck{l,h}wd`: lane t of 128-bit lane L pairs
/// dim 8L + t of both keys, the high unpack dim 8L + 4 + t) against p as bf16 pairs, so one
/// instruction does 32 multiply-adds where the widening path needs two conversions and two FMAs
/// per 16; the accumulators stay in that permuted order over all keys and are put back in dim
/// order once per tile. An odd last key and the dims after the last whole chunk go through the
/// f32 path.
///
/// # Safety
/// AVX-512F and AVX512_BF16 present; operands as checked by [`pv_acc`].
///
/// [`pv_acc`]: super::pv::pv_acc
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pv_avx512_bf16(
    p: PRows,
    pairs: &[u32],
    src: &[bf16],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    ahead: &mut Ahead,
) {
    let PRows { rows, np, .. } = p;
    let chunks = vr.d / 32;
    if chunks == 0 {
        // SAFETY: the caller's contract.
        return unsafe { pv_avx512(p.f32, np, rows, src, vr, acc, dpad, 0, Some(ahead)) };
    }
    let mut first = Some(ahead);
    // SAFETY: the caller's contract; every tile below stays inside rows × d.
    unsafe {
        // Row blocks of up to 6 (`pv_row_block`): each key pair's loads and unpacks of v feed
        // up to 24 `vdpbf16ps` instead of 16. 4 tokens a step at GQA 4 (16 rows), bf16, one
        // thread, 1024 keys: 0.95 of the time with blocks of 4 (A/B in one process, both
        // orders, 2026-11-24); MQA (32 rows) unchanged.
        let mut r0 = 0;
        let mut blk = 0;
        while r0 < rows {
            let rb = pv_row_block(rows, blk);
            let mut x0 = 0;
            while x0 < chunks {
                let xv = (chunks - x0).min(2);
                let at = (pairs, np, r0, src, vr, x0, &mut *acc, dpad, first.take());
                match (rb, xv) {
                    (6, 2) => pv_tile_bf16::<6, 2>(at),
                    (5, 2) => pv_tile_bf16::<5, 2>(at),
                    (6, _) => pv_tile_bf16::<6, 1>(at),
                    (5, _) => pv_tile_bf16::<5, 1>(at),
                    _ => by_tile!(rb, xv, |A, B| pv_tile_bf16::<A, B>(at)),
                }
                x0 += xv;
            }
            r0 += rb;
            blk += 1;
        }
        // An odd last key, dims 0..32 · chunks, in f32.
        if vr.cols() % 2 == 1 {
            use std::arch::x86_64::*;
            let c = vr.cols() - 1;
            let row = src.as_ptr().add(vr.at(c));
            for r in 0..rows {
                let pv = _mm512_set1_ps(*p.f32.as_ptr().add(c * np + r));
                let ar = acc.as_mut_ptr().add(r * dpad);
                for x in (0..32 * chunks).step_by(LANES) {
                    let y = _mm512_fmadd_ps(pv, load16(row.add(x)), _mm512_loadu_ps(ar.add(x)));
                    _mm512_storeu_ps(ar.add(x), y);
                }
            }
        }
        // Dims 32 · chunks..d.
        if 32 * chunks < vr.d {
            pv_avx512(p.f32, np, rows, src, vr, acc, dpad, 2 * chunks, None);
        }
    }
}

/// Rows `r0..r0 + R`, chunks `x0..x0 + V` (dims `32·x0..32·(x0 + V)`) of [`pv_avx512_bf16`],
/// keys `0..cols - cols % 2`: up to 6 × 2 × 2 = 24 zmm accumulators, 4 of interleaved v, a
/// broadcast p pair. Per key pair: 4 loads, 4 unpacks, R broadcasts, 4R `vdpbf16ps`.
///
/// # Safety
/// As [`pv_avx512_bf16`]; `r0 + R <= rows`, `32 · (x0 + V) <= d`.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn pv_tile_bf16<const R: usize, const V: usize>(at: PvAt<u32, bf16>) {
    use std::arch::x86_64::*;
    let (pairs, np, r0, src, vr, x0, acc, dpad, mut ahead) = at;
    let bh = |x: __m512i| std::mem::transmute::<__m512i, __m512bh>(x);
    // SAFETY: the caller's contract.
    unsafe {
        let mut lo = [[_mm512_setzero_ps(); V]; R];
        let mut hi = [[_mm512_setzero_ps(); V]; R];
        let pp = pairs.as_ptr().add(r0);
        for cp in 0..vr.cols() / 2 {
            if let Some(ah) = ahead.as_deref_mut() {
                ah.step(2);
            }
            let row0 = src.as_ptr().add(vr.at(2 * cp) + x0 * 32);
            let row1 = src.as_ptr().add(vr.at(2 * cp + 1) + x0 * 32);
            let mut vl = [_mm512_setzero_si512(); V];
            let mut vh = [_mm512_setzero_si512(); V];
            for j in 0..V {
                let a = _mm512_loadu_si512(row0.add(j * 32).cast());
                let b = _mm512_loadu_si512(row1.add(j * 32).cast());
                vl[j] = _mm512_unpacklo_epi16(a, b);
                vh[j] = _mm512_unpackhi_epi16(a, b);
            }
            let pc = pp.add(cp * np);
            for i in 0..R {
                let p = bh(_mm512_set1_epi32(*pc.add(i) as i32));
                for j in 0..V {
                    lo[i][j] = _mm512_dpbf16_ps(lo[i][j], p, bh(vl[j]));
                    hi[i][j] = _mm512_dpbf16_ps(hi[i][j], p, bh(vh[j]));
                }
            }
        }
        // Lane 4L + t of lo is dim 8L + t, of hi dim 8L + 4 + t: back to dim order.
        let first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        let second =
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        let ap = acc.as_mut_ptr();
        for i in 0..R {
            for j in 0..V {
                let at = ap.add((r0 + i) * dpad + (x0 + j) * 32);
                let d0 = _mm512_permutex2var_ps(lo[i][j], first, hi[i][j]);
                let d1 = _mm512_permutex2var_ps(lo[i][j], second, hi[i][j]);
                _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), d0));
                _mm512_storeu_ps(at.add(16), _mm512_add_ps(_mm512_loadu_ps(at.add(16)), d1));
            }
        }
    }
}

//! AVX-512 microkernels (16 f32 lanes), and bf16 products with `vdpbf16ps` (AVX512_BF16).
//!
//! Register budget of the product tile: MR = 4 rows × NV = 4 vectors (64 lanes) = 16 zmm
//! accumulators, + 4 zmm of B loaded per k, + 1 broadcast of A = 21 of the 32 zmm registers. Per k
//! step: 4 loads, 4 broadcasts, 16 FMAs, so the loop is bound by the FMA units (one 512-bit FMA
//! per cycle on Zen 4), not by loads. Measured alone (64×64 tile, d = 128) such a tile reaches
//! ~111 GFLOP/s of the core's 115 (shared/FACTS.md).
//!
//! Safety: every function here requires the CPU features of its `target_feature` attribute (the
//! kernel table is built only after detection) and operands that passed [`super::Kernels`]'s bounds
//! checks; pointer offsets below stay inside those checked ranges.

use super::Gemm;
use crate::cpu::softmax::EXP2_POLY;
use std::arch::x86_64::*;

const MR: usize = 4;
const NV: usize = 4;
const W: usize = 16;

/// Defines `$name::<V, S>`, the row walk of a driver over lanes `j..j + 16·V` of C:
/// `$tile::<MR, V, S>` for each whole block of MR rows, then one `$tile` for the rest (`S`: the
/// first chunk adds to C scaled by `sc`, see [`tile`]). The drivers differ only in their tile
/// (and its element type and target features).
macro_rules! row_walk {
    ($name:ident, $tile:ident, $elem:ty, $features:literal) => {
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn $name<const V: usize, const S: bool>(
            g: &Gemm<$elem>,
            cp: *mut f32,
            c_rs: usize,
            j: usize,
            sc: *const f32,
        ) {
            let mut i = 0;
            while i + MR <= g.m {
                $tile::<MR, V, S>(g, cp, c_rs, (i, j), sc);
                i += MR;
            }
            match g.m - i {
                3 => $tile::<3, V, S>(g, cp, c_rs, (i, j), sc),
                2 => $tile::<2, V, S>(g, cp, c_rs, (i, j), sc),
                1 => $tile::<1, V, S>(g, cp, c_rs, (i, j), sc),
                _ => {}
            }
        }
    };
}

/// The lane walk of a driver: `$rows::<NV, S>` for each whole block of NV vectors, then one
/// `$rows` for the remaining whole vectors (the callers' n is a multiple of 16).
macro_rules! lane_walk {
    ($g:ident, $c:ident, $c_rs:ident, $rows:ident, $s:literal, $sc:expr) => {{
        let (cp, sc) = ($c.as_mut_ptr(), $sc);
        let mut j = 0;
        while j + NV * W <= $g.n {
            $rows::<NV, $s>($g, cp, $c_rs, j, sc);
            j += NV * W;
        }
        match ($g.n - j) / W {
            3 => $rows::<3, $s>($g, cp, $c_rs, j, sc),
            2 => $rows::<2, $s>($g, cp, $c_rs, j, sc),
            1 => $rows::<1, $s>($g, cp, $c_rs, j, sc),
            _ => {}
        }
    }};
}

/// The addresses of rows `i..i + R` of A, opaque to the optimiser: the k loop then reads
/// `rows[r] + k·a_cs` (a base register and a scaled index) instead of re-deriving each row's
/// address from `a_rs` at every step, which cost ~4 integer µops per k beside the FMAs.
/// `wrapping_add`: with k = 0 (A empty) these addresses are formed but never read.
#[inline(always)]
fn row_ptrs<T, const R: usize>(g: &Gemm<T>, i: usize) -> [*const T; R] {
    let a = g.a.as_ptr();
    let mut rows = [a; R];
    for (r, p) in rows.iter_mut().enumerate() {
        *p = a.wrapping_add((i + r) * g.a_rs);
    }
    std::hint::black_box(rows)
}

#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemm(g: &Gemm<f32>, c: &mut [f32], c_rs: usize) {
    lane_walk!(g, c, c_rs, rows, false, std::ptr::null())
}

row_walk!(rows, tile, f32, "avx512f");

/// Rows `i..i + R`, lanes `j..j + 16·V` of C.
///
/// Each k step also prefetches (into L1) A that a later tile reads, as the AVX2 tile does: with
/// `a_rs == 1` (P·V reading a v tile, the backward's dQ) the line 16 floats ahead in the current
/// k row, with `a_cs == 1` the next tile's rows, one line per k step; a tile that adds to C
/// prefetches the next tile's C rows. The forward's packed v tiles arrive from L3 at every key
/// block. Prefetches never fault: addresses past the operands are only formed (`wrapping_add`).
/// With `S`, the first chunk adds to C multiplied by `sc[j..j + 16·V]` (`g.accumulate` and
/// `g.k > 0`, as [`gemm_rescaled`] is called); without, `sc` is not read.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile<const R: usize, const V: usize, const S: bool>(
    g: &Gemm<f32>,
    cp: *mut f32,
    c_rs: usize,
    (i, j): (usize, usize),
    sc: *const f32,
) {
    let rows = row_ptrs::<_, R>(g, i);
    let b = g.b.as_ptr().add(j);
    let a = g.a.as_ptr().wrapping_add(i * g.a_rs);
    // A's prefetch cursor and its step per k (floats); a step of 0 re-touches a line in L1.
    let (pa, pa_step) = if g.a_rs == 1 {
        (a.wrapping_add(W), g.a_cs)
    } else if g.a_cs == 1 {
        (a.wrapping_add(R * g.a_rs), W)
    } else {
        (a, 0)
    };
    if g.accumulate {
        for r in R..2 * R {
            for v in 0..V {
                let at = cp.wrapping_add((i + r) * c_rs + j + W * v);
                _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
            }
        }
    }
    let mut first = !g.accumulate;
    if g.k == 0 && first {
        store_tile::<R, V>(&[[_mm512_setzero_ps(); V]; R], cp, c_rs, i, j, true);
    }
    for k0 in (0..g.k).step_by(g.kc) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for k in k0..(k0 + g.kc).min(g.k) {
            _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(k * pa_step) as *const i8);
            let bk = b.add(k * g.b_rs);
            let mut bv = [_mm512_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(bk.add(W * v));
            }
            let ak = k * g.a_cs;
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let ar = _mm512_set1_ps(*rows[r].add(ak));
                for (x, bx) in acc_r.iter_mut().zip(&bv) {
                    *x = _mm512_fmadd_ps(ar, *bx, *x);
                }
            }
        }
        if S && k0 == 0 {
            store_tile_scaled::<R, V>(&acc, cp, c_rs, (i, j), sc);
        } else {
            store_tile::<R, V>(&acc, cp, c_rs, i, j, first);
        }
        first = false;
    }
}

/// [`super::Kernels::gemm_rescaled`]: [`gemm`] adding to `C · col_scale` (per lane j), with the
/// same two roundings as [`rescale_o`] and then [`gemm`] (multiply, then add the first chunk):
/// C is multiplied as the first chunk's store loads it, which saves rescale_o's pass over C
/// (the forward's acc_o before its P·V product). `g.accumulate` and `g.k > 0`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemm_rescaled(g: &Gemm<f32>, c: &mut [f32], c_rs: usize, col_scale: &[f32]) {
    lane_walk!(g, c, c_rs, rows, true, col_scale.as_ptr())
}

/// Adds a tile of partial sums to C multiplied by `sc[j..j + 16·V]` (`C · sc`, rounded, `+ acc`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile_scaled<const R: usize, const V: usize>(
    acc: &[[__m512; V]; R],
    cp: *mut f32,
    c_rs: usize,
    (i, j): (usize, usize),
    sc: *const f32,
) {
    let mut s = [_mm512_setzero_ps(); V];
    for (v, x) in s.iter_mut().enumerate() {
        *x = _mm512_loadu_ps(sc.add(j + W * v));
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (v, x) in acc_r.iter().enumerate() {
            let at = cp.add((i + r) * c_rs + j + W * v);
            let scaled = _mm512_mul_ps(_mm512_loadu_ps(at), s[v]);
            _mm512_storeu_ps(at, _mm512_add_ps(scaled, *x));
        }
    }
}

/// Writes (`overwrite`) or adds a tile of partial sums to C.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile<const R: usize, const V: usize>(
    acc: &[[__m512; V]; R],
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
                _mm512_add_ps(_mm512_loadu_ps(at), *x)
            };
            _mm512_storeu_ps(at, val);
        }
    }
}

/// Rows of a [`gemm_scores`] tile: 6 rows × 2 vectors (32 lanes) = 12 chunk accumulators + 12
/// half-sums + 2 B vectors + 1 broadcast = 27 of 32 zmm; per k 6 broadcasts, 2 loads, 12 FMAs
/// (12 independent chains cover the FMA latency of two ports; 4 rows, 8 chains, did not).
const MR_SCORES: usize = 6;

/// [`super::Kernels::gemm_scores`]: `C = A·B` with k split in two halves, each summed in chunks of
/// `KC_SCORES` that are added to a running sum per half, the halves added at the end: the same
/// order of additions as the portable version (two chunked `gemm` calls and an add pass), so the
/// same bits, but the half-sums stay in registers: no loads, stores or add pass per chunk.
///
/// The halves run one after the other over the whole of C: the low half's sums are stored, the
/// high half's added to them (`lo + hi`, the same sum). Within a half the rows of A are the outer
/// walk and the 32-lane strips the inner one, so a tile's rows of A stay in L1 across the strips
/// and the half of B (k/2 rows, 32 KiB at d = 128 and 128 lanes) is read contiguously and stays
/// in L1 across the row blocks (walking strips outermost, a strip of B's rows 512 bytes apart
/// maps onto a quarter of L1's sets). The first strip of each row block prefetches the next row
/// block's A, which arrives from L3 at every key block (the packed k tiles). With the `gemm`
/// prefetches and packing from 8 visits, the f32 forward took 0.81-0.95 of the time at N = 512 to
/// 4096 (A/B on a loaded host, docs/journal/2026-11-29-fifth-session-avx2fwd.md); `gemm_fma`'s
/// rates on that host moved too much between runs to tell the kernels apart alone.
///
/// Where C's width is a multiple of 64 lanes (the backward's block_m 64, the forward's key blocks)
/// the tiles are 3 rows × 64 lanes instead (12 chunk sums, 12 half-sums, 4 B vectors: 29 zmm):
/// 3 broadcasts of A per 12 FMAs against 6, and each half of B read once per row block. On Zen 4
/// the backward's S took ~21% of the AVX-512 f32 backward's samples in 6 × 32 tiles against
/// 12-14% for each other product; in 3 × 64 tiles the backward took 0.95 of its CPU time and the
/// forward 0.93-0.99 (N = 1024 and 4096, d = 64 and 128, A/B on a loaded host). Same bits
/// (tested against the 6 × 32 walk, [`gemm_scores_lanes`]).
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemm_scores(g: &Gemm<f32>, c: &mut [f32], c_rs: usize) {
    if !g.n.is_multiple_of(4 * W) {
        return gemm_scores_lanes(g, c, c_rs);
    }
    let cp = c.as_mut_ptr();
    let half = scores_half(g);
    for (k_lo, k_hi, add) in [(0, half, false), (half, g.k, true)] {
        if k_lo == k_hi && add {
            break;
        }
        let ks = (k_lo, k_hi);
        for j in (0..g.n).step_by(4 * W) {
            let mut i = 0;
            while i + 3 <= g.m {
                scores_tile::<3, 4, true>(g, cp, c_rs, (i, j), ks, add);
                i += 3;
            }
            match g.m - i {
                2 => scores_tile::<2, 4, true>(g, cp, c_rs, (i, j), ks, add),
                1 => scores_tile::<1, 4, true>(g, cp, c_rs, (i, j), ks, add),
                _ => {}
            }
        }
    }
}

/// Where [`gemm_scores`] splits k: two halves unless a half is shorter than one chunk.
fn scores_half(g: &Gemm<f32>) -> usize {
    if g.k / 2 < super::KC_SCORES {
        g.k
    } else {
        g.k / 2
    }
}

/// [`gemm_scores`] in tiles of [`MR_SCORES`] rows × 32 lanes, row blocks outermost (any width
/// that is a multiple of 16 lanes).
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemm_scores_lanes(g: &Gemm<f32>, c: &mut [f32], c_rs: usize) {
    let cp = c.as_mut_ptr();
    let half = scores_half(g);
    for (k_lo, k_hi, add) in [(0, half, false), (half, g.k, true)] {
        if k_lo == k_hi && add {
            break;
        }
        let mut i = 0;
        while i + MR_SCORES <= g.m {
            scores_lanes::<MR_SCORES>(g, cp, c_rs, i, (k_lo, k_hi), add);
            i += MR_SCORES;
        }
        match g.m - i {
            5 => scores_lanes::<5>(g, cp, c_rs, i, (k_lo, k_hi), add),
            4 => scores_lanes::<4>(g, cp, c_rs, i, (k_lo, k_hi), add),
            3 => scores_lanes::<3>(g, cp, c_rs, i, (k_lo, k_hi), add),
            2 => scores_lanes::<2>(g, cp, c_rs, i, (k_lo, k_hi), add),
            1 => scores_lanes::<1>(g, cp, c_rs, i, (k_lo, k_hi), add),
            _ => {}
        }
    }
}

/// Rows `i..i + R` of C over all its lanes (the callers' n is a multiple of 16), k in `ks`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_lanes<const R: usize>(
    g: &Gemm<f32>,
    cp: *mut f32,
    c_rs: usize,
    i: usize,
    ks: (usize, usize),
    add: bool,
) {
    let mut j = 0;
    while j < g.n {
        let first = j == 0;
        if g.n - j >= 2 * W {
            if first {
                scores_tile::<R, 2, true>(g, cp, c_rs, (i, j), ks, add);
            } else {
                scores_tile::<R, 2, false>(g, cp, c_rs, (i, j), ks, add);
            }
            j += 2 * W;
        } else {
            if first {
                scores_tile::<R, 1, true>(g, cp, c_rs, (i, j), ks, add);
            } else {
                scores_tile::<R, 1, false>(g, cp, c_rs, (i, j), ks, add);
            }
            j += W;
        }
    }
}

/// One half's sum (k in `k_lo..k_hi`, chunks of `KC_SCORES`) of rows `i..i + R`, lanes
/// `j..j + 16·V`: stored, or (`add`) added to what C holds. `PA`: prefetch the next R rows of A
/// (one line per k step, when they span at most 16 floats per k step, as the packed tiles'
/// contiguous rows do).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_tile<const R: usize, const V: usize, const PA: bool>(
    g: &Gemm<f32>,
    cp: *mut f32,
    c_rs: usize,
    (i, j): (usize, usize),
    (k_lo, k_hi): (usize, usize),
    add: bool,
) {
    let rows = row_ptrs::<_, R>(g, i);
    let b = g.b.as_ptr().add(j);
    // The next row block's A from this half's start: R rows of a_rs floats, contiguous when
    // a_cs == 1 (`wrapping_add`: formed, never read, past A's end).
    let pa = g.a.as_ptr().wrapping_add((i + R) * g.a_rs + k_lo * g.a_cs);
    let pa_on = PA && g.a_cs == 1 && R * g.a_rs <= W * (k_hi - k_lo) + W;
    // One k step: loads B's lanes, broadcasts A's R values of step k (at `rows[r] + ak`).
    let step = |acc: &mut [[__m512; V]; R], k: usize, ak: usize| {
        if pa_on {
            _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add((k - k_lo) * W) as *const i8);
        }
        let bk = b.add(k * g.b_rs);
        let mut bv = [_mm512_setzero_ps(); V];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(bk.add(W * v));
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let ar = _mm512_set1_ps(*rows[r].add(ak));
            for (x, bx) in acc_r.iter_mut().zip(&bv) {
                *x = _mm512_fmadd_ps(ar, *bx, *x);
            }
        }
    };
    let mut sum = [[_mm512_setzero_ps(); V]; R];
    for k0 in (k_lo..k_hi).step_by(super::KC_SCORES) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        if g.a_cs == 1 && k0 + super::KC_SCORES <= k_hi {
            // A whole chunk with contiguous rows (the forward's k tiles), unrolled: A's
            // addresses are each row's pointer plus k0 and an immediate.
            for t in 0..super::KC_SCORES {
                step(&mut acc, k0 + t, k0 + t);
            }
        } else {
            for k in k0..(k0 + super::KC_SCORES).min(k_hi) {
                step(&mut acc, k, k * g.a_cs);
            }
        }
        for (s_r, acc_r) in sum.iter_mut().zip(&acc) {
            for (s, x) in s_r.iter_mut().zip(acc_r) {
                *s = _mm512_add_ps(*s, *x);
            }
        }
    }
    for (r, s_r) in sum.iter().enumerate() {
        for (v, x) in s_r.iter().enumerate() {
            let at = cp.add((i + r) * c_rs + j + W * v);
            let val = if add {
                _mm512_add_ps(_mm512_loadu_ps(at), *x)
            } else {
                *x
            };
            _mm512_storeu_ps(at, val);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn gemm_bf16(g: &Gemm<u32>, c: &mut [f32], c_rs: usize) {
    lane_walk!(g, c, c_rs, rows_bf16, false, std::ptr::null())
}

row_walk!(rows_bf16, tile_bf16, u32, "avx512f,avx512bf16");

/// As [`tile`] (`S` included), one bf16 pair per lane and k step: `vdpbf16ps` adds both
/// products of the pair.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn tile_bf16<const R: usize, const V: usize, const S: bool>(
    g: &Gemm<u32>,
    cp: *mut f32,
    c_rs: usize,
    (i, j): (usize, usize),
    sc: *const f32,
) {
    let rows = row_ptrs::<_, R>(g, i);
    let b = g.b.as_ptr().add(j);
    let mut first = !g.accumulate;
    if g.k == 0 && first {
        store_tile::<R, V>(&[[_mm512_setzero_ps(); V]; R], cp, c_rs, i, j, true);
    }
    for k0 in (0..g.k).step_by(g.kc.div_ceil(2)) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for k in k0..(k0 + g.kc.div_ceil(2)).min(g.k) {
            let bk = b.add(k * g.b_rs);
            let mut bv = [_mm512_setzero_si512(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_loadu_si512(bk.add(W * v).cast());
            }
            let ak = k * g.a_cs;
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let ar: __m512bh = std::mem::transmute(_mm512_set1_epi32(*rows[r].add(ak) as i32));
                for (x, bx) in acc_r.iter_mut().zip(&bv) {
                    *x = _mm512_dpbf16_ps(*x, ar, std::mem::transmute::<__m512i, __m512bh>(*bx));
                }
            }
        }
        if S && k0 == 0 {
            store_tile_scaled::<R, V>(&acc, cp, c_rs, (i, j), sc);
        } else {
            store_tile::<R, V>(&acc, cp, c_rs, i, j, first);
        }
        first = false;
    }
}

/// [`super::Kernels::gemm_bf16_rescaled`]: [`gemm_bf16`] adding to `C · col_scale`, as
/// [`gemm_rescaled`] does for f32 (the forward's bf16 P·V product). `g.accumulate` and `g.k > 0`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn gemm_bf16_rescaled(
    g: &Gemm<u32>,
    c: &mut [f32],
    c_rs: usize,
    col_scale: &[f32],
) {
    lane_walk!(g, c, c_rs, rows_bf16, true, col_scale.as_ptr())
}

/// `2^x` per lane, as [`crate::cpu::softmax::exp2`]: the same reduction (`x = n + f`, n rounded to
/// nearest) and polynomial ([`EXP2_POLY`]), with FMAs; exactly 0 below -126 and for -inf, NaN for NaN.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn exp2_ps(x: __m512) -> __m512 {
    // max/min return their second operand when either is NaN, so NaN passes through.
    let xc = _mm512_min_ps(
        _mm512_set1_ps(127.0),
        _mm512_max_ps(_mm512_set1_ps(-126.0), x),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(xc);
    let f = _mm512_sub_ps(xc, n);
    let mut p = _mm512_set1_ps(EXP2_POLY[0]);
    for c in &EXP2_POLY[1..] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(*c));
    }
    let r = _mm512_scalef_ps(p, n);
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-126.0));
    _mm512_mask_blend_ps(under, r, _mm512_setzero_ps())
}

#[target_feature(enable = "avx512f")]
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
    let sc = _mm512_set1_ps(scale);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    for j in (0..n).step_by(W) {
        let mut bm = neg_inf;
        for c in 0..cols {
            let p = sp.add(c * n + j);
            let x = _mm512_mul_ps(_mm512_loadu_ps(p), sc);
            _mm512_storeu_ps(p, x);
            bm = _mm512_max_ps(bm, x);
        }
        let old = _mm512_loadu_ps(row_max.as_ptr().add(j));
        let new = _mm512_max_ps(old, bm);
        let none = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(new, neg_inf);
        let a = exp2_ps(_mm512_sub_ps(old, new));
        let one = _mm512_set1_ps(1.0);
        _mm512_storeu_ps(
            alpha.as_mut_ptr().add(j),
            _mm512_mask_blend_ps(none, a, one),
        );
        let zero = _mm512_setzero_ps();
        _mm512_storeu_ps(
            m_sub.as_mut_ptr().add(j),
            _mm512_mask_blend_ps(none, new, zero),
        );
        _mm512_storeu_ps(row_max.as_mut_ptr().add(j), new);
    }
}

#[target_feature(enable = "avx512f")]
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
        let m = _mm512_loadu_ps(m_sub.as_ptr().add(j));
        let mut sum = _mm512_mul_ps(
            _mm512_loadu_ps(row_sum.as_ptr().add(j)),
            _mm512_loadu_ps(alpha.as_ptr().add(j)),
        );
        for c in 0..cols {
            let p = sp.add(c * n + j);
            let e = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(p), m));
            _mm512_storeu_ps(p, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(row_sum.as_mut_ptr().add(j), sum);
    }
}

/// [`super::Kernels::softmax_step`]: per group of up to 4 lane vectors, the maximum of the raw
/// scores (loads only), then `exp2(s · scale - m_sub)` and the sum while the group's scores are in
/// L1; the same operations per lane as [`max_get_scale`] then [`online_softmax`] (the multiply and
/// the subtraction rounded separately), so the same bits. The group's vectors are independent
/// chains of `max` and of the sum (one vector alone waits on each step's latency).
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn softmax_step(
    st: &mut [f32],
    cols: usize,
    n: usize,
    scale: f32,
    row_max: &mut [f32],
    alpha: &mut [f32],
    m_sub: &mut [f32],
    row_sum: &mut [f32],
) {
    let sp = st.as_mut_ptr();
    let state = (
        row_max.as_mut_ptr(),
        alpha.as_mut_ptr(),
        m_sub.as_mut_ptr(),
        row_sum.as_mut_ptr(),
    );
    let mut j = 0;
    while j < n {
        match (n - j) / W {
            1 => softmax_group::<1>(sp, cols, n, j, scale, state),
            2 => softmax_group::<2>(sp, cols, n, j, scale, state),
            3 => softmax_group::<3>(sp, cols, n, j, scale, state),
            _ => softmax_group::<4>(sp, cols, n, j, scale, state),
        }
        j += 4 * W;
    }
}

/// [`softmax_step`] over lanes `j..j + G·W` (`state`: row_max, alpha, m_sub, row_sum).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn softmax_group<const G: usize>(
    sp: *mut f32,
    cols: usize,
    n: usize,
    j: usize,
    scale: f32,
    (row_max, alpha, m_sub, row_sum): (*mut f32, *mut f32, *mut f32, *mut f32),
) {
    let sc = _mm512_set1_ps(scale);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut bm = [neg_inf; G];
    for c in 0..cols {
        for (g, x) in bm.iter_mut().enumerate() {
            *x = _mm512_max_ps(*x, _mm512_loadu_ps(sp.add(c * n + j + g * W)));
        }
    }
    let mut m = [neg_inf; G];
    let mut sum = [neg_inf; G];
    for g in 0..G {
        let at = j + g * W;
        let old = _mm512_loadu_ps(row_max.add(at));
        let new = _mm512_max_ps(old, _mm512_mul_ps(bm[g], sc));
        let none = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(new, neg_inf);
        let a = exp2_ps(_mm512_sub_ps(old, new));
        let a = _mm512_mask_blend_ps(none, a, _mm512_set1_ps(1.0));
        _mm512_storeu_ps(alpha.add(at), a);
        m[g] = _mm512_mask_blend_ps(none, new, _mm512_setzero_ps());
        _mm512_storeu_ps(m_sub.add(at), m[g]);
        _mm512_storeu_ps(row_max.add(at), new);
        sum[g] = _mm512_mul_ps(_mm512_loadu_ps(row_sum.add(at)), a);
    }
    for c in 0..cols {
        for g in 0..G {
            let p = sp.add(c * n + j + g * W);
            let x = _mm512_mul_ps(_mm512_loadu_ps(p), sc);
            let e = exp2_ps(_mm512_sub_ps(x, m[g]));
            _mm512_storeu_ps(p, e);
            sum[g] = _mm512_add_ps(sum[g], e);
        }
    }
    for (g, s) in sum.iter().enumerate() {
        _mm512_storeu_ps(row_sum.add(j + g * W), *s);
    }
}

#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn rescale_o(ot: &mut [f32], rows: usize, n: usize, alpha: &[f32]) {
    let op = ot.as_mut_ptr();
    for j in (0..n).step_by(W) {
        let a = _mm512_loadu_ps(alpha.as_ptr().add(j));
        for x in 0..rows {
            let p = op.add(x * n + j);
            _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_loadu_ps(p), a));
        }
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn narrow_pairs_bf16(src: &[f32], out: &mut [u32]) {
    let (sp, op, n) = (src.as_ptr(), out.as_mut_ptr(), out.len());
    let mut i = 0;
    // 32 values to 16 pairs: `vcvtne2ps2bf16` puts its second operand in the low half.
    while i + W <= n {
        let lo = _mm512_loadu_ps(sp.add(2 * i));
        let hi = _mm512_loadu_ps(sp.add(2 * i + W));
        let v = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(op.add(i).cast(), v);
        i += W;
    }
    if i + W / 2 <= n {
        let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(sp.add(2 * i)));
        _mm256_storeu_si256(
            op.add(i).cast(),
            std::mem::transmute::<__m256bh, __m256i>(v),
        );
        i += W / 2;
    }
    // The rest (fewer than 8 pairs) as the scalar twin rounds it.
    super::scalar::narrow_pairs_bf16(&src[2 * i..], &mut out[i..]);
}

#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn pack_pairs_bf16(st: &[f32], cols: usize, n: usize, out: &mut [u32]) {
    let sp = st.as_ptr();
    let op = out.as_mut_ptr();
    for cp in 0..cols.div_ceil(2) {
        let c = 2 * cp;
        for j in (0..n).step_by(W) {
            let lo = _mm512_cvtneps_pbh(_mm512_loadu_ps(sp.add(c * n + j)));
            let hi = if c + 1 < cols {
                _mm512_cvtneps_pbh(_mm512_loadu_ps(sp.add((c + 1) * n + j)))
            } else {
                std::mem::transmute::<__m256i, __m256bh>(_mm256_setzero_si256())
            };
            let lo32 = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(lo));
            let hi32 = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(std::mem::transmute::<
                __m256bh,
                __m256i,
            >(hi)));
            _mm512_storeu_si512(op.add(cp * n + j).cast(), _mm512_or_si512(lo32, hi32));
        }
    }
}

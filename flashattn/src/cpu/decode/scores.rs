//! The score product `S = Q·Kᵀ` of a few query rows against a tile's keys ([`scores`]): q's
//! forms ([`QRows`], [`QTrans`]) and the dispatch to the kernels the kernel table names
//! ([`DecodeKernels`]), with the portable one.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::prefetch::Ahead;
use super::pv::{widen_row, MAX_D};
use super::rows::KeyRows;
#[cfg(target_arch = "x86_64")]
use super::x86_scores::{scores_avx512, scores_avx512_bf16};
#[cfg(target_arch = "x86_64")]
use super::x86_scores_qt::{
    scores_bcast_avx512, scores_bcast_avx512_bf16, scores_quad_avx512_bf16,
};
use crate::cpu::simd::{DecodeKernels, LANES};
use crate::cpu::{buf, Buf};
#[cfg(target_arch = "x86_64")]
use crate::tensor::DType;
use crate::tensor::Element;
#[cfg(target_arch = "x86_64")]
use half::bf16;

/// The query rows of one kv group: `rows` rows of `dpad` f32 ([`LANES`]-padded with zeros), and
/// the same as bf16 pairs (`dpad / 2` u32 per row) when the bf16 dot product is to be used;
/// `t`, when given, the same rows transposed for [`scores_bcast_avx512`] or in blocks of 4
/// rows for [`scores_quad_avx512_bf16`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct QRows<'a> {
    pub f32: &'a [f32],
    pub bf16_pairs: Option<&'a [u32]>,
    pub rows: usize,
    pub dpad: usize,
    pub t: Option<QTrans<'a>>,
}

/// Query rows in the layout of an AVX-512 score kernel other than plain rows. `F32` and
/// `Pairs` are transposed, rows along the lanes: element `x · ld + r` is dim `x` of row `r`
/// (`F32`, `x < d`) or the bf16 pair of dims `2x, 2x + 1` (`Pairs`, `x < d / 2`, d even); `ld`
/// is `rows` rounded up to [`LANES`], the lanes past `rows` zero.
///
/// `Quads`: bf16 pairs in blocks of 4 rows for [`scores_quad_avx512_bf16`] (d a multiple of
/// 16): element `((b · d / 16 + s) · 2 + h) · 16 + 8u + t` is the pair of dims `16s + 2t,
/// 16s + 2t + 1` of row `4b + 2h + u`, so one vector holds 8 pairs of each of 2 rows (one per
/// 256-bit half); rows past `rows` zero.
///
/// `EvenOdd` (AVX2, bf16 keys): rows of `dpad` f32 with each whole 16-dim chunk stored even
/// dims first ([`avx2::even_odd`]), the order in which the AVX2 kernel widens bf16 pairs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum QTrans<'a> {
    F32 { qt: &'a [f32], ld: usize },
    Pairs { qt: &'a [u32], ld: usize },
    Quads { qt: &'a [u32] },
    EvenOdd { qt: &'a [f32] },
}

/// Fewest query rows per kv head for which bf16 scores take q in the `Quads` form
/// ([`scores_quad_avx512_bf16`]): with fewer, most of each vector's 4 rows would be empty (one
/// row per kv head keeps the dot-product kernel's 4-key reduction).
pub(super) const QUAD_MIN_ROWS: usize = 4;

/// Fewest query rows per kv head for which the score product takes q transposed
/// ([`scores_bcast_avx512`]): one 16-lane vector of rows (f32, f16, bf16 widened), two for bf16
/// pairs. Fewer would leave lanes empty. Measured (A/B in one process, one thread, cache in
/// L2/L3, 2026-11-23): 16 rows (4 tokens, GQA 4) f32 0.945 of the dot-product kernel's time,
/// bf16 pairs 1.04; 32 rows (MQA) f32 0.90, bf16 0.94. Tiles of 8 or 16 keys for one or two
/// vectors of rows (more independent accumulators) were slower: 1.2-1.4.
pub(super) fn bcast_min_rows(bf16_pairs: bool) -> usize {
    if bf16_pairs {
        2 * LANES
    } else {
        LANES
    }
}

impl QTrans<'_> {
    /// q in the form the score kernel of `kern` takes for this many rows per kv group, for all of an
    /// item's groups: transposed for the outer-product kernel from [`bcast_min_rows`] on (as
    /// bf16 pairs where [`QTrans::build`] makes them), in 4-row blocks of bf16 pairs for
    /// [`scores_quad_avx512_bf16`] from [`QUAD_MIN_ROWS`] on; on AVX2 with bf16 keys
    /// (`bf16_keys`), in even-odd order for any number of rows; `None` for plain rows.
    pub fn for_item(
        kern: DecodeKernels,
        q: &[f32],
        (qb, bf16_keys): (Option<&[u32]>, bool),
        shape @ (heads_kv, rows, d, dpad): (usize, usize, usize, usize),
    ) -> Option<QTransBuf> {
        let pairs = qb.is_some() && d.is_multiple_of(2);
        #[cfg(target_arch = "x86_64")]
        if kern == DecodeKernels::Avx2 && bf16_keys {
            return Some(QTransBuf::EvenOdd {
                t: avx2::even_odd(q, heads_kv * rows, d, dpad),
                stride: rows * dpad,
            });
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (bf16_keys, heads_kv, dpad);
        if !matches!(kern, DecodeKernels::Avx512 | DecodeKernels::Avx512Bf16) {
            return None;
        }
        if rows >= bcast_min_rows(pairs) {
            return Some(Self::build(q, qb, shape));
        }
        qb.filter(|_| rows >= QUAD_MIN_ROWS && d.is_multiple_of(16))
            .map(|qb| Self::quads(qb, shape))
    }

    /// The `Quads` form of `rows` rows of bf16 pairs `qb` (`dpad / 2` each, kv head by kv head:
    /// `heads_kv` groups); d a multiple of 16.
    pub fn quads(qb: &[u32], (heads_kv, rows, d, dpad): (usize, usize, usize, usize)) -> QTransBuf {
        debug_assert!(d.is_multiple_of(16));
        let (blocks, steps) = (rows.div_ceil(4), d / 16);
        let stride = blocks * steps * 32;
        let mut t = buf(0u32, heads_kv * stride);
        for g in 0..heads_kv {
            for r in 0..rows {
                let row = &qb[(g * rows + r) * dpad / 2..][..d / 2];
                let (b, h, u) = (r / 4, r % 4 / 2, r % 2);
                for (s, eight) in row.chunks_exact(8).enumerate() {
                    let at = g * stride + ((b * steps + s) * 2 + h) * 16 + 8 * u;
                    t[at..at + 8].copy_from_slice(eight);
                }
            }
        }
        QTransBuf::Quads { t, stride }
    }

    /// Builds the transposed form of `rows` rows of `q` (`dpad` f32 each, kv head by kv head:
    /// `heads_kv` groups) or of their bf16 pairs `qb` (`dpad / 2` each) when given and `d` is
    /// even. Returns the buffer of all groups and a group's stride in it.
    pub fn build(
        q: &[f32],
        qb: Option<&[u32]>,
        (heads_kv, rows, d, dpad): (usize, usize, usize, usize),
    ) -> QTransBuf {
        let ld = rows.next_multiple_of(LANES);
        // Group g's row r, elements 0..n of its `w`-element row in `src`, to column r of the
        // group's n × ld block.
        fn transpose<E: Copy + Default>(
            src: &[E],
            (groups, rows, n, w, ld): (usize, usize, usize, usize, usize),
        ) -> Buf<E> {
            let mut t = buf(E::default(), groups * n * ld);
            for g in 0..groups {
                for r in 0..rows {
                    let row = &src[(g * rows + r) * w..][..n];
                    for (x, &v) in row.iter().enumerate() {
                        t[g * n * ld + x * ld + r] = v;
                    }
                }
            }
            t
        }
        match qb.filter(|_| d.is_multiple_of(2)) {
            Some(qb) => QTransBuf::Pairs {
                t: transpose(qb, (heads_kv, rows, d / 2, dpad / 2, ld)),
                ld,
                stride: d / 2 * ld,
            },
            None => QTransBuf::F32 {
                t: transpose(q, (heads_kv, rows, d, dpad, ld)),
                ld,
                stride: d * ld,
            },
        }
    }
}

/// The buffer behind [`QTrans`] for all kv groups of an item (`stride` elements a group).
pub(crate) enum QTransBuf {
    F32 {
        t: Buf<f32>,
        ld: usize,
        stride: usize,
    },
    Pairs {
        t: Buf<u32>,
        ld: usize,
        stride: usize,
    },
    Quads {
        t: Buf<u32>,
        stride: usize,
    },
    /// AVX2 only (x86-64).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    EvenOdd {
        t: Buf<f32>,
        stride: usize,
    },
}

impl QTransBuf {
    /// Group `g`'s rows in the buffer's form.
    pub fn group(&self, g: usize) -> QTrans<'_> {
        match self {
            QTransBuf::F32 { t, ld, stride } => QTrans::F32 {
                qt: &t[g * stride..(g + 1) * stride],
                ld: *ld,
            },
            QTransBuf::Pairs { t, ld, stride } => QTrans::Pairs {
                qt: &t[g * stride..(g + 1) * stride],
                ld: *ld,
            },
            QTransBuf::Quads { t, stride } => QTrans::Quads {
                qt: &t[g * stride..(g + 1) * stride],
            },
            QTransBuf::EvenOdd { t, stride } => QTrans::EvenOdd {
                qt: &t[g * stride..(g + 1) * stride],
            },
        }
    }
}

/// Scores of a few query rows against keys read in place from the cache, transposed:
/// `st[c · np + r] = Σ_x q[r][x] · k[c][x]` for `r < rows`, `c < kr.cols()`, with `k[c]` the row
/// of `src` that `kr` names, widened to f32 as it is loaded (or, for bf16 with `q.bf16_pairs` on
/// a CPU with AVX512_BF16, multiplied as bf16 pairs by `vdpbf16ps`). Lanes `rows..np` are not
/// written: `st` may be a window into a wider tile whose other lanes belong to other kv heads.
pub(crate) fn scores<T: Element>(
    kern: DecodeKernels,
    q: QRows,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    let QRows { rows, dpad, .. } = q;
    kr.check(src.len());
    assert!(
        dpad.is_multiple_of(LANES)
            && kr.d <= dpad
            && rows <= np
            && q.f32.len() >= rows * dpad
            && q.bf16_pairs.is_none_or(|b| b.len() >= rows * dpad / 2)
            && (kr.cols() == 0 || st.len() >= (kr.cols() - 1) * np + rows),
        "decode scores: operands too short"
    );
    if let Some(t) = q.t {
        let lanes = rows.next_multiple_of(LANES);
        let fits = match t {
            QTrans::F32 { qt, ld } => ld >= lanes && qt.len() >= kr.d * ld,
            QTrans::Pairs { qt, ld } => ld >= lanes && qt.len() >= kr.d / 2 * ld,
            QTrans::Quads { qt } => qt.len() >= rows.div_ceil(4) * (kr.d / 16) * 32,
            QTrans::EvenOdd { qt } => qt.len() >= rows * dpad,
        };
        assert!(fits, "decode scores: transposed q too short");
    }
    #[cfg(target_arch = "x86_64")]
    if let DecodeKernels::Avx512 | DecodeKernels::Avx512Bf16 = kern {
        let bf16_dot = kern == DecodeKernels::Avx512Bf16;
        match q.t {
            Some(QTrans::F32 { qt, ld }) => {
                // SAFETY: AVX-512F present (the kernel table's ISA); bounds checked above.
                return unsafe { scores_bcast_avx512(qt, ld, rows, src, kr, st, np, ahead) };
            }
            Some(QTrans::Pairs { qt, ld }) if kr.d.is_multiple_of(2) => {
                if let (Some(k), true) = (bf16::unwrap(T::wrap(src)), bf16_dot) {
                    // SAFETY: AVX-512F and AVX512_BF16 present (only their table has
                    // `Avx512Bf16`, `Kernels::for_isa`); bounds checked above.
                    return unsafe { scores_bcast_avx512_bf16(qt, ld, rows, k, kr, st, np, ahead) };
                }
            }
            Some(QTrans::Quads { qt }) if kr.d.is_multiple_of(16) => {
                if let (Some(k), true) = (bf16::unwrap(T::wrap(src)), bf16_dot) {
                    // SAFETY: AVX-512F and AVX512_BF16 present (only their table has
                    // `Avx512Bf16`, `Kernels::for_isa`); bounds checked above.
                    return unsafe { scores_quad_avx512_bf16(qt, rows, k, kr, st, np, ahead) };
                }
            }
            _ => {}
        }
        if let (Some(pairs), Some(k)) = (q.bf16_pairs, bf16::unwrap(T::wrap(src))) {
            if bf16_dot {
                // SAFETY: AVX-512F and AVX512_BF16 present (only their table has
                // `Avx512Bf16`, `Kernels::for_isa`); bounds checked above.
                return unsafe {
                    scores_avx512_bf16(q.f32, pairs, rows, dpad, k, kr, st, np, ahead)
                };
            }
        }
        // SAFETY: a kernel table with the AVX-512 decode kernels exists only on a CPU with
        // AVX-512F (`Kernels::for_isa`); bounds checked above.
        return unsafe { scores_avx512(q.f32, rows, dpad, src, kr, st, np, ahead) };
    }
    #[cfg(target_arch = "x86_64")]
    if kern == DecodeKernels::Avx2 && avx2::has_f16c() {
        // bf16 keys take q in even-odd order (`avx2::even_odd`), other dtypes as rows.
        let qf = match (q.t, T::DTYPE) {
            (Some(QTrans::EvenOdd { qt }), DType::BF16) => qt,
            (_, DType::BF16) => {
                return scores_portable(q.f32, rows, dpad, src, kr, st, np, ahead);
            }
            _ => q.f32,
        };
        // SAFETY: a kernel table with the AVX2 decode kernels exists only on a CPU with AVX2
        // and FMA (`Kernels::for_isa`), F16C checked; bounds checked above.
        return unsafe { avx2::scores(qf, rows, dpad, src, kr, st, np, ahead) };
    }
    let _ = kern;
    scores_portable(q.f32, rows, dpad, src, kr, st, np, ahead);
}

/// [`scores`] without intrinsics: one key row widened to f32, then 16 lane sums per query row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scores_portable<T: Element>(
    q: &[f32],
    rows: usize,
    dpad: usize,
    src: &[T],
    kr: KeyRows,
    st: &mut [f32],
    np: usize,
    ahead: &mut Ahead,
) {
    let mut krow = [0f32; MAX_D];
    let krow = &mut krow[..dpad];
    for c in 0..kr.cols() {
        ahead.step(1);
        let at = kr.at(c);
        widen_row(&src[at..at + kr.d], &mut krow[..kr.d]);
        for r in 0..rows {
            let qr = &q[r * dpad..(r + 1) * dpad];
            // 16 lane sums added pairwise: the AVX-512 kernel's order, roughly.
            let mut lanes = [0f32; LANES];
            for (qc, kc) in qr.chunks_exact(LANES).zip(krow.chunks_exact(LANES)) {
                for l in 0..LANES {
                    lanes[l] += qc[l] * kc[l];
                }
            }
            let mut n = LANES;
            while n > 1 {
                n /= 2;
                for l in 0..n {
                    lanes[l] += lanes[l + n];
                }
            }
            st[c * np + r] = lanes[0];
        }
    }
}

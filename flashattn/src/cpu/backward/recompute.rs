//! What both passes share: the per-thread tiles, the call's context, and the recomputation of P and
//! dS for one (query block, key block) tile.

use super::query_tiles::{QTiles, QueryTiles};
use crate::blocks::{Cover, Mask};
use crate::cpu::forward::{load_pairs, load_tile, prefetch_rows, PackedV, ScoreMod};
use crate::cpu::simd::{pad_lanes, Gemm, KC, LANES};
use crate::cpu::{buf, BlockSizes, Buf};
use crate::params::{GradInputs, Params, LOG2_E};
use crate::tensor::Element;
use half::bf16;

/// Per-thread tiles of the backward pass. Query rows live in lanes (`np` = rows padded); `dp` is
/// head_dim padded, the lane count of the row-major query-side tiles and of the dK/dV accumulators.
pub(super) struct Scratch {
    /// k and v tiles, `[cols][d]`.
    pub(super) k: Buf<f32>,
    pub(super) v: Buf<f32>,
    /// Scores, then probabilities P̃ (after dropout), `[cols][np]`.
    pub(super) pt: Buf<f32>,
    /// dP, then dS, `[cols][np]`.
    pub(super) dst: Buf<f32>,
    /// The second half-sum of the scores.
    pub(super) tmp: Buf<f32>,
    /// Softcap's derivative `1 - tanh²` per element, `[cols][np]`.
    pub(super) dtanh: Buf<f32>,
    pub(super) lse_log2: Buf<f32>,
    pub(super) delta: Buf<f32>,
    /// Ones and a sink: the online-softmax kernel's alpha and row_sum when it only exponentiates.
    pub(super) ones: Buf<f32>,
    pub(super) sink: Buf<f32>,
    /// Dropout mask of the tile, `[rows][cols]`.
    pub(super) keep: Buf<bool>,
    /// dK and dV `[cols][dp]` (pass 1), or dQᵀ `[d][np]` (pass 2).
    pub(super) acc_a: Buf<f32>,
    pub(super) acc_b: Buf<f32>,
    /// Eight rows of dQ being written (`[8][d]`).
    pub(super) row: Buf<f32>,
    /// bf16 path: k and v as pairs along d (`[cols][d2]`), dS as pairs of keys
    /// (`[cols / 2][np]`); for dK and dV, P̃ᵀ and dSᵀ as pairs of rows (`[cols][np / 2]`).
    pub(super) k2: Buf<u32>,
    pub(super) v2: Buf<u32>,
    pub(super) ds2: Buf<u32>,
    pub(super) pt2: Buf<u32>,
    pub(super) dst2: Buf<u32>,
    /// The tiles a key block visits (pass 1), kept between key blocks.
    pub(super) visits: Vec<Visit>,
}

impl Scratch {
    pub(super) fn new(bs: BlockSizes, d: usize) -> Self {
        let (np, bn, dp) = (pad_lanes(bs.block_m), bs.block_n, pad_lanes(d));
        let big = (bn * dp).max(d * np);
        Scratch {
            k: buf(0.0, bn * d),
            v: buf(0.0, bn * d),
            pt: buf(0.0, bn * np),
            dst: buf(0.0, bn * np),
            tmp: buf(0.0, bn * np),
            dtanh: buf(0.0, bn * np),
            lse_log2: buf(0.0, np),
            delta: buf(0.0, np),
            ones: buf(1.0, np),
            sink: buf(0.0, np),
            keep: buf(true, bs.block_m * bn),
            acc_a: buf(0.0, big),
            acc_b: buf(0.0, big),
            row: buf(0.0, 8 * d),
            k2: buf(0, bn * d.div_ceil(2)),
            v2: buf(0, bn * d.div_ceil(2)),
            ds2: buf(0, bn.div_ceil(2) * np),
            pt2: buf(0, bn * np / 2),
            dst2: buf(0, bn * np / 2),
            visits: Vec::new(),
        }
    }
}

/// A (query head, query block) tile that sees a key block, and how (pass 1).
#[derive(Clone, Copy)]
pub(super) struct Visit {
    pub(super) h: usize,
    pub(super) m_block: usize,
    pub(super) cover: Cover,
}

/// Everything both passes read.
pub(super) struct Ctx<'a, T> {
    pub(super) p: &'a Params,
    pub(super) g: &'a GradInputs,
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    /// rowsum(dO ∘ O) per row, in `lse` layout.
    pub(super) delta: &'a [f32],
    pub(super) tiles: &'a QueryTiles,
    pub(super) bs: BlockSizes,
    /// bf16 inputs with a bf16 dot product: the inputs as bf16, and k packed for dQ.
    pub(super) bf: Option<Bf<'a>>,
    /// Whether masked tiles may take the fused P and dS pass (always, except in the test that
    /// compares it with the three passes).
    pub(super) fused_masked: bool,
}

pub(super) struct Bf<'a> {
    pub(super) k: &'a [bf16],
    pub(super) v: &'a [bf16],
    pub(super) packed_k: PackedV,
}

impl<T: Element> Ctx<'_, T> {
    /// Loads lse and delta of rows `m0..m0 + rows` of (sequence b, head h); their q and dO tiles
    /// come from [`QueryTiles`]. Padded lanes get P = 0 (lse +inf) and dS = 0 (delta 0).
    pub(super) fn load_query_side(
        &self,
        b: usize,
        h: usize,
        m0: usize,
        rows: usize,
        scr: &mut Scratch,
    ) {
        let p = self.p;
        let np = pad_lanes(rows);
        for r in 0..np {
            if r >= rows {
                scr.lse_log2[r] = f32::INFINITY;
                scr.delta[r] = 0.0;
                continue;
            }
            let at = p.lse_offset(b, h, m0 + r);
            let lse = self.g.lse[at];
            // A fully masked row (lse = -inf) has P = 0: +inf makes every exp2 below 0.
            scr.lse_log2[r] = if lse == f32::NEG_INFINITY {
                f32::INFINITY
            } else {
                lse * LOG2_E
            };
            scr.delta[r] = self.delta[at];
        }
    }

    /// Loads k and v of keys `n0..n0 + cols` of (sequence b, kv head hk) into the scratch tiles
    /// (`[cols][d]`), also for f32: see forward's k tile (rows heads·d apart thrash the TLB when the
    /// products re-read them in place).
    /// On the bf16 path, as pairs into `scr.k2`, `scr.v2` (`[cols][d2]`) instead.
    pub(super) fn load_key_side(
        &self,
        b: usize,
        hk: usize,
        n0: usize,
        cols: usize,
        scr: &mut Scratch,
    ) {
        let (p, s, d) = (self.p, self.p.seqs[b], self.p.head_dim);
        let k_base = s.k_base + n0 * p.k.row_stride + hk * p.k.head_stride;
        let v_base = s.v_base + n0 * p.v.row_stride + hk * p.v.head_stride;
        if let Some(bf) = &self.bf {
            load_pairs(bf.k, k_base, p.k.row_stride, cols, d, &mut scr.k2);
            load_pairs(bf.v, v_base, p.v.row_stride, cols, d, &mut scr.v2);
            return;
        }
        load_tile(self.k, k_base, p.k.row_stride, (cols, d, d), &mut scr.k);
        load_tile(self.v, v_base, p.v.row_stride, (cols, d, d), &mut scr.v);
    }

    /// Asks L2 for rows `r0..r1` of the k and v tiles of keys from `n0` of (sequence b, kv head
    /// hk), as [`Self::load_key_side`] will read them.
    pub(super) fn prefetch_key_rows(
        &self,
        b: usize,
        hk: usize,
        n0: usize,
        (r0, r1): (usize, usize),
    ) {
        let (p, s, d) = (self.p, self.p.seqs[b], self.p.head_dim);
        let k_base = s.k_base + n0 * p.k.row_stride + hk * p.k.head_stride;
        let v_base = s.v_base + n0 * p.v.row_stride + hk * p.v.head_stride;
        prefetch_rows(self.k, k_base, p.k.row_stride, (r0, r1, d));
        prefetch_rows(self.v, v_base, p.v.row_stride, (r0, r1, d));
    }

    /// With q-side rows `m0..m1` loaded (`qt`, `dot` their transposes) and keys `n0..n1` in
    /// `scr.k`, `scr.v`: P̃ᵀ into `scr.pt` and (dS·softmax_scale)ᵀ into `scr.dst` (both
    /// `[cols][np]`; padded lanes 0). `cover` is [`Mask::cover`] of the tile, not
    /// [`Cover::None`] (such tiles are skipped). Returns whether the tile was computed by strips
    /// ([`strip_keys`]): then dS is 0 outside each strip's keys, which dQ's product may skip.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn recompute(
        &self,
        (b, h): (usize, usize),
        (m0, m1): (usize, usize),
        (n0, n1): (usize, usize),
        cover: Cover,
        tiles: QTiles,
        scr: &mut Scratch,
    ) -> bool {
        let (p, d) = (self.p, self.p.head_dim);
        let kern = p.kernels;
        let s = p.seqs[b];
        let (rows, cols) = (m1 - m0, n1 - n0);
        let np = pad_lanes(rows);
        let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
        let pt = &mut scr.pt[..cols * np];
        let product = |a, b| Gemm {
            m: cols,
            n: np,
            k: d,
            a,
            a_rs: d,
            a_cs: 1,
            b,
            b_rs: np,
            accumulate: false,
            kc: KC,
        };
        // bf16 pairs: K (or V) `[cols][d2]` times Qᵀ (or dOᵀ) `[d2][np]`.
        let d2 = d.div_ceil(2);
        let product2 = |a, b| Gemm {
            m: cols,
            n: np,
            k: d2,
            a,
            a_rs: d2,
            a_cs: 1,
            b,
            b_rs: np,
            accumulate: false,
            kc: KC,
        };
        let score_mod = ScoreMod::new(p, b, h);
        let masked = cover == Cover::Some;
        // `dtanh` holds d(score)/d(scaled product) under softcap or a score function.
        let dscore = p.softcap.is_some() || p.score_fn.is_some();
        let no_mods = p.dropout.is_none() && !dscore;
        // A tile the causal or window mask cuts, with no other modifier: the mask set on the raw
        // scores (-inf · scale_log2 stays -inf), then the fused pass (the diagonal tiles of a
        // causal call took the three passes below).
        let mask_raw = masked && no_mods && p.mask_mod.is_none() && score_mod.mask_only();
        let plain = no_mods && (!score_mod.needs_apply(masked) || mask_raw);
        let fused = plain && kern.has_probs_and_ds() && (self.fused_masked || !masked);
        if let (true, true, QTiles::F32([qt, dot, ..])) = (fused, masked, tiles) {
            // By strips of query lanes, the products only over the keys each strip sees; the
            // other keys' S is -inf and dP 0, what the mask and dS would make of them. f32 tiles
            // only: the AVX-512 bf16 products by 16-lane strips took 1.03-1.06 of the whole
            // tiles' time (d = 64, causal), where f32 gained.
            let ds = &mut scr.dst[..cols * np];
            for j in (0..np).step_by(LANES) {
                let (lo, hi) = strip_keys(&mask, (m0, rows), (n0, cols), j);
                if hi > lo {
                    let (c_pt, c_ds) = (&mut pt[lo * np + j..], &mut ds[lo * np + j..]);
                    let g = strip(product(&scr.k, qt), (lo, hi), j);
                    kern.scores(&g, c_pt, np, &mut scr.tmp, false);
                    kern.gemm(&strip(product(&scr.v, dot), (lo, hi), j), c_ds, np);
                }
                for c in (0..lo).chain(hi.max(lo)..cols) {
                    pt[c * np + j..][..LANES].fill(f32::NEG_INFINITY);
                    ds[c * np + j..][..LANES].fill(0.0);
                }
            }
            ScoreMod::mask_raw(pt, np, (m0, rows), (n0, cols), &mask);
            let (lse, delta) = (&scr.lse_log2[..], &scr.delta[..]);
            let (sl, scale) = (score_mod.scale_log2, p.softmax_scale);
            kern.probs_and_ds(pt, ds, (cols, np), sl, lse, delta, scale);
            return true;
        }
        // Sᵀ = K·Qᵀ, then P = exp2(S·scale_log2 - lse_log2).
        match tiles {
            QTiles::F32([qt, ..]) => kern.scores(
                &product(&scr.k, qt),
                pt,
                np,
                &mut scr.tmp,
                p.softcap.is_some() || p.score_fn.is_some(),
            ),
            QTiles::Bf16([qt, ..]) => kern.gemm_bf16(&product2(&scr.k2, qt), pt, np),
        }
        if fused {
            if masked {
                ScoreMod::mask_raw(pt, np, (m0, rows), (n0, cols), &mask);
            }
            // dP̃ᵀ = V·dOᵀ first, then P and dS in one pass over the tile (the same bits as the
            // passes below).
            let ds = &mut scr.dst[..cols * np];
            match tiles {
                QTiles::F32([_, dot, ..]) => kern.gemm(&product(&scr.v, dot), ds, np),
                QTiles::Bf16([_, dot, ..]) => kern.gemm_bf16(&product2(&scr.v2, dot), ds, np),
            }
            let (lse, delta) = (&scr.lse_log2[..], &scr.delta[..]);
            let (sl, scale) = (score_mod.scale_log2, p.softmax_scale);
            kern.probs_and_ds(pt, ds, (cols, np), sl, lse, delta, scale);
            return false;
        }
        if score_mod.needs_apply(masked) {
            let dtanh = dscore.then(|| &mut scr.dtanh[..cols * np]);
            score_mod.apply(pt, np, (m0, rows), (n0, cols), &mask, masked, dtanh);
            if let (true, Some(f)) = (masked, &p.mask_mod) {
                f.hide((b, h), pt, np, (m0, rows), (n0, cols), &mask);
            }
        } else {
            pt.iter_mut().for_each(|x| *x *= score_mod.scale_log2);
        }
        kern.online_softmax(pt, cols, np, &scr.lse_log2, &mut scr.sink, &scr.ones);
        // dP̃ᵀ = V·dOᵀ.
        let ds = &mut scr.dst[..cols * np];
        match tiles {
            QTiles::F32([_, dot, ..]) => kern.gemm(&product(&scr.v, dot), ds, np),
            QTiles::Bf16([_, dot, ..]) => kern.gemm_bf16(&product2(&scr.v2, dot), ds, np),
        }
        // dropped entries get P̃ = 0 and dP = 0, kept ones are scaled by 1/(1-p); then
        // dS = P ∘ (dP - delta) · scale (· 1 - tanh²).
        let drop_scale = p.dropout.map_or(1.0, |dr| dr.scale());
        if let Some(drop) = p.dropout {
            for r in 0..rows {
                drop.keep_row(b, h, m0 + r, n0, &mut scr.keep[r * cols..(r + 1) * cols]);
            }
        }
        let scale = p.softmax_scale;
        if p.dropout.is_none() && !dscore {
            // The common case as a plain loop over lanes, which LLVM vectorises.
            let delta = &scr.delta[..rows];
            for (pr, dr) in pt.chunks_exact(np).zip(ds.chunks_exact_mut(np)) {
                for ((g, &prob), &dl) in dr[..rows].iter_mut().zip(&pr[..rows]).zip(delta) {
                    *g = prob * (*g - dl) * scale;
                }
            }
            return false;
        }
        for c in 0..cols {
            for r in 0..rows {
                let at = c * np + r;
                let kept = p.dropout.is_none() || scr.keep[r * cols + c];
                let prob = pt[at];
                let dp = if kept { ds[at] } else { 0.0 };
                let mut g = prob * (dp * drop_scale - scr.delta[r]) * scale;
                if dscore {
                    // A score function's derivative may be non-finite where P = 0 (hidden pairs).
                    g = if prob == 0.0 && p.score_fn.is_some() {
                        0.0
                    } else {
                        g * scr.dtanh[at]
                    };
                }
                ds[at] = g;
                pt[at] = if kept { prob * drop_scale } else { 0.0 };
            }
        }
        false
    }
}

/// Product `g` (A's rows the tile's keys, B's and C's lanes its query rows) restricted to keys
/// `lo..hi` and the strip of lanes from `j` (the caller offsets C).
fn strip<X>(g: Gemm<'_, X>, (lo, hi): (usize, usize), j: usize) -> Gemm<'_, X> {
    Gemm {
        m: hi - lo,
        n: LANES,
        a: &g.a[lo * g.a_rs..],
        b: &g.b[j..],
        ..g
    }
}

/// The keys (tile-local, `lo..hi`, empty when none) that some row of the strip of query lanes
/// `j..j + LANES` sees, in a tile of rows `m0..m0 + rows` and keys `n0..n0 + cols` that a causal
/// or window mask cuts: the visible keys of a row start and end no earlier than the previous
/// row's, so the strip's are those from its first row's start to its last row's end. On the
/// causal diagonal about 3/8 of each product's strips (64 × 64 tiles) fall outside.
pub(super) fn strip_keys(
    mask: &Mask,
    (m0, rows): (usize, usize),
    (n0, cols): (usize, usize),
    j: usize,
) -> (usize, usize) {
    let last = (j + LANES).min(rows) - 1;
    let clip = |key: usize| key.clamp(n0, n0 + cols) - n0;
    let lo = clip(mask.key_range(m0 + j).0);
    let hi = clip(mask.key_range(m0 + last).1);
    (lo, hi.max(lo))
}

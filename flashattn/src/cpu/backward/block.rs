//! The tile loops of the two passes: dK and dV (and the one-pass dQ) of a key block, and the
//! second pass's dQ of a query block.

use super::dq_partials::write_dq_rows;
use super::query_tiles::QTiles;
use super::recompute::{strip_keys, Ctx, Scratch, Visit};
use crate::blocks::{Cover, Mask};
use crate::cpu::forward::{prefetch_span, WorkItem};
use crate::cpu::simd::{pad_lanes, Gemm, KC, LANES};
use crate::cpu::Disjoint;
use crate::tensor::Element;

/// dK and dV of keys `n_block` (stored in `item.m_block`) of kv head `item.h`; with `dq_part` (the
/// item's region of [`DqPartials`]), also `dQ += dS·K·scale` of this key block into it.
/// `next_keys`: the same worker goes on to key block `n_block + 1` (whose rows it prefetches).
///
/// [`DqPartials`]: super::dq_partials::DqPartials
pub(super) fn dkdv_block<T: Element>(
    cx: &Ctx<T>,
    item: WorkItem,
    scr: &mut Scratch,
    dk: &Disjoint<T>,
    dv: &Disjoint<T>,
    mut dq_part: Option<&mut [f32]>,
    next_keys: bool,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    let dp = pad_lanes(d);
    let (b, hk, n_block) = (item.b, item.h, item.m_block);
    let s = p.seqs[b];
    let n0 = n_block * bs.block_n;
    let n1 = (n0 + bs.block_n).min(s.seqlen_k);
    let cols = n1 - n0;
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    cx.load_key_side(b, hk, n0, cols, scr);
    scr.acc_a[..cols * dp].fill(0.0);
    scr.acc_b[..cols * dp].fill(0.0);
    let group = p.heads / p.heads_kv;
    let mut visits = std::mem::take(&mut scr.visits);
    visits.clear();
    for h in hk * group..(hk + 1) * group {
        for m_block in 0..s.seqlen_q.div_ceil(bs.block_m) {
            let m0 = m_block * bs.block_m;
            let m1 = (m0 + bs.block_m).min(s.seqlen_q);
            let (nb0, nb1) = mask.n_block_range(m0, m1, bs.block_n);
            if !(nb0..nb1).contains(&n_block) {
                continue;
            }
            let cover = mask.cover(p.mask_mod.as_ref(), (b, h), (m0, m1), (n0, n1));
            if cover != Cover::None {
                visits.push(Visit { h, m_block, cover });
            }
        }
    }
    // The last PREFETCH_VISITS tiles ask L2 for the next key block's k and v rows (when this item
    // goes on to it) and for this block's dK and dV rows: each row sits on its own page at 16
    // heads, and their copies (`load_tile`, the narrowing stores below) waited on memory.
    let ahead = next_keys.then(|| (n1, (n1 + bs.block_n).min(s.seqlen_k)));
    let first_pf = visits.len().saturating_sub(PREFETCH_VISITS);
    for (i, &Visit { h, m_block, cover }) in visits.iter().enumerate() {
        if i >= first_pf {
            let (step, steps) = (i - first_pf, visits.len() - first_pf);
            if let Some((a0, a1)) = ahead {
                let span = |n| (step * n / steps, (step + 1) * n / steps);
                cx.prefetch_key_rows(b, hk, a0, span(a1 - a0));
            }
            for c in step * cols / steps..(step + 1) * cols / steps {
                let at = p.dk_offset(b, n0 + c, hk);
                // SAFETY: keys n0..n1 of kv head hk of sequence b belong to this work item alone;
                // the slices live only for the prefetch.
                unsafe {
                    prefetch_span(dk.range(at, d));
                    prefetch_span(dv.range(at, d));
                }
            }
        }
        let m0 = m_block * bs.block_m;
        let m1 = (m0 + bs.block_m).min(s.seqlen_q);
        let rows = m1 - m0;
        let np = pad_lanes(rows);
        cx.load_query_side(b, h, m0, rows, scr);
        let tiles = cx.tiles.get(p, b, h, m_block, bs.block_m);
        let by_strips = cx.recompute((b, h), (m0, m1), (n0, n1), cover, tiles, scr);
        // dV += P̃ᵀ·dO and dK += dSᵀ·Q (row-major, dp lanes).
        let f32_product = |a, x, k, a_rs| rows_product((cols, dp), a, x, k, a_rs);
        let bf16_product = |a, x, k, a_rs| rows_product((cols, dp), a, x, k, a_rs);
        let kern = p.kernels;
        if let QTiles::Bf16([_, _, q_rm2, do_rm2]) = tiles {
            // Over pairs of query rows: P̃ᵀ and dSᵀ rounded to bf16 (as flash-attn rounds them
            // for its tensor-core products), q and dO exact.
            kern.narrow_pairs_bf16(&scr.pt[..cols * np], &mut scr.pt2[..cols * np / 2]);
            kern.narrow_pairs_bf16(&scr.dst[..cols * np], &mut scr.dst2[..cols * np / 2]);
            let k2 = rows.div_ceil(2);
            kern.gemm_bf16(
                &bf16_product(&scr.pt2, do_rm2, k2, np / 2),
                &mut scr.acc_b,
                dp,
            );
            kern.gemm_bf16(
                &bf16_product(&scr.dst2, q_rm2, k2, np / 2),
                &mut scr.acc_a,
                dp,
            );
        } else if let QTiles::F32([_, _, q_rm, do_rm]) = tiles {
            kern.gemm(&f32_product(&scr.pt, do_rm, rows, np), &mut scr.acc_b, dp);
            kern.gemm(&f32_product(&scr.dst, q_rm, rows, np), &mut scr.acc_a, dp);
        }
        if let Some(part) = dq_part.as_deref_mut() {
            let npb = pad_lanes(bs.block_m);
            let nmb = s.seqlen_q.div_ceil(bs.block_m);
            let tile = d * npb;
            let at = ((h - hk * group) * nmb + m_block) * tile;
            let strips = by_strips.then_some(Strips {
                mask: &mask,
                rows: (m0, rows),
                keys: (n0, cols),
            });
            dq_product(
                cx,
                (b, hk, n_block, cols, np),
                strips,
                scr,
                &mut part[at..at + tile],
                npb,
            );
        }
    }
    scr.visits = visits;
    for c in 0..cols {
        let at = p.dk_offset(b, n0 + c, hk);
        // SAFETY: keys n0..n1 of kv head hk of sequence b belong to this work item alone.
        unsafe {
            T::narrow(&scr.acc_a[c * dp..c * dp + d], dk.range(at, d));
            T::narrow(&scr.acc_b[c * dp..c * dp + d], dv.range(at, d));
        }
    }
}

/// Tiles whose products hide the prefetches of a key block's next rows and its outputs' rows: the
/// last few, so that the lines are still in L2 when they are read or written.
const PREFETCH_VISITS: usize = 4;

/// The dK/dV product of pass 1: `C[cols][dp] += A·B` over `k` query rows (or pairs of rows), A's
/// rows `a_rs` apart, B row-major with `dp` lanes.
fn rows_product<'a, X>(
    (cols, dp): (usize, usize),
    a: &'a [X],
    x: &'a [X],
    k: usize,
    a_rs: usize,
) -> Gemm<'a, X> {
    Gemm {
        m: cols,
        n: dp,
        k,
        a,
        a_rs,
        a_cs: 1,
        b: x,
        b_rs: dp,
        accumulate: true,
        kc: KC,
    }
}

/// `dQᵀ += Kᵀ·dSᵀ` (`c[x][r] += Σ_j k[j][x] · ds[r][j]`, `c` row stride `ldc`) with dSᵀ of key
/// block `n_block` (`cols` keys, `np` lanes) of kv head `hk` in `scr.dst` and its keys in `scr.k`
/// (f32) or the packed keys (bf16). With `strips` (the tile's mask, rows and keys, when
/// [`Ctx::recompute`] computed it by strips, f32 only), each strip of lanes sums only the chunks
/// of keys that hold its keys ([`strip_keys`]): the chunks skipped, and the terms cut after the
/// last, are zeros, which leave the sums' bits as they are.
fn dq_product<T: Element>(
    cx: &Ctx<T>,
    (b, hk, n_block, cols, np): (usize, usize, usize, usize, usize),
    strips: Option<Strips>,
    scr: &mut Scratch,
    c: &mut [f32],
    ldc: usize,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    if let Some(bf) = &cx.bf {
        // As the forward's P·V: k in key pairs `[d][block_n / 2]`, dS rounded to key pairs
        // (never by strips: see `Ctx::recompute`).
        debug_assert!(strips.is_none());
        p.kernels.pack_pairs_bf16(&scr.dst, cols, np, &mut scr.ds2);
        p.kernels.gemm_bf16(
            &Gemm {
                m: d,
                n: np,
                k: cols.div_ceil(2),
                a: bf.packed_k.block(p, b, hk, n_block, bs.block_n),
                a_rs: bs.block_n / 2,
                a_cs: 1,
                b: &scr.ds2,
                b_rs: np,
                accumulate: true,
                kc: KC,
            },
            c,
            ldc,
        );
        return;
    }
    // The lanes and keys of each call, `(j, n, k0, k1)`: one call over the tile, or one per strip.
    let whole = strips.is_none().then_some((0, np, 0, cols));
    let by_strip = strips.into_iter().flat_map(|Strips { mask, rows, keys }| {
        (0..np).step_by(LANES).filter_map(move |j| {
            let (lo, hi) = strip_keys(mask, rows, keys, j);
            (hi > lo).then_some((j, LANES, lo / KC * KC, hi))
        })
    });
    let calls = whole.into_iter().chain(by_strip);
    for (j, n, k0, k1) in calls {
        p.kernels.gemm(
            &Gemm {
                m: d,
                n,
                k: k1 - k0,
                a: &scr.k[k0 * d..],
                a_rs: 1,
                a_cs: d,
                b: &scr.dst[k0 * np + j..],
                b_rs: np,
                accumulate: true,
                kc: KC,
            },
            &mut c[j..],
            ldc,
        );
    }
}

/// A tile that [`Ctx::recompute`] computed by strips: its mask, query rows `(m0, rows)` and keys
/// `(n0, cols)`, for [`strip_keys`].
#[derive(Clone, Copy)]
struct Strips<'a> {
    mask: &'a Mask,
    rows: (usize, usize),
    keys: (usize, usize),
}

/// Second pass of the two-pass backward: dQ of rows `m_block` of head `h`.
pub(super) fn dq_block<T: Element>(
    cx: &Ctx<T>,
    item: WorkItem,
    scr: &mut Scratch,
    dq: &Disjoint<T>,
) {
    let (p, bs, d) = (cx.p, cx.bs, cx.p.head_dim);
    let WorkItem { b, h, m_block } = item;
    let s = p.seqs[b];
    let m0 = m_block * bs.block_m;
    let m1 = (m0 + bs.block_m).min(s.seqlen_q);
    let rows = m1 - m0;
    let np = pad_lanes(rows);
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    cx.load_query_side(b, h, m0, rows, scr);
    let tiles = cx.tiles.get(p, b, h, m_block, bs.block_m);
    let mut acc = std::mem::take(&mut scr.acc_a);
    acc[..d * np].fill(0.0);
    let (nb0, nb1) = mask.n_block_range(m0, m1, bs.block_n);
    let hk = p.kv_head(h);
    for n_block in nb0..nb1 {
        let n0 = n_block * bs.block_n;
        let n1 = (n0 + bs.block_n).min(s.seqlen_k);
        let cover = mask.cover(p.mask_mod.as_ref(), (b, h), (m0, m1), (n0, n1));
        if cover == Cover::None {
            continue;
        }
        let cols = n1 - n0;
        cx.load_key_side(b, hk, n0, cols, scr);
        let by_strips = cx.recompute((b, h), (m0, m1), (n0, n1), cover, tiles, scr);
        let strips = by_strips.then_some(Strips {
            mask: &mask,
            rows: (m0, rows),
            keys: (n0, cols),
        });
        dq_product(cx, (b, hk, n_block, cols, np), strips, scr, &mut acc, np);
    }
    write_dq_rows(p, (b, h, m0, rows), &acc, np, &mut scr.row, dq);
    scr.acc_a = acc;
}

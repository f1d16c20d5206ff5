//! One work item of the forward: the per-thread tiles and the loop over its key blocks.

use super::items::WorkItem;
use super::parts::{masked_parts, strip_lanes, Part};
use super::score_mod::ScoreMod;
use super::tiles::{
    load_pairs, load_pairs_t, load_tile, load_tile_t, prefetch_rows, prefetch_span, Bf16Source,
    KeyTiles, PackedV,
};
use crate::blocks::{Cover, Mask};
use crate::cpu::simd::{pad_lanes, Gemm, Kernels, KC, LANES};
use crate::cpu::softmax::{finalize_lse, fold_sink};
use crate::cpu::{buf, BlockSizes, Buf, Disjoint};
use crate::dropout::Dropout;
use crate::params::Params;
use crate::tensor::Element;

/// Per-thread tiles, allocated once per worker, never inside the block loops. Query rows live in
/// lanes, padded to `np = pad_lanes(rows)`; padded lanes hold zeros and are never written out.
pub(crate) struct Scratch {
    /// q transposed: `qt[x * np + r]` (f32 products).
    qt: Buf<f32>,
    /// q as bf16 pairs: `qp[xp * np + r]` = `(q[r][2xp], q[r][2xp + 1])` (bf16 dot products).
    qp: Buf<u32>,
    /// A tile of k rows: f32 `[cols][d]`, or bf16 pairs `[cols][d2]` with `d2 = d.div_ceil(2)`.
    k: Buf<f32>,
    kp: Buf<u32>,
    /// A tile of v rows, f32 `[cols][d]` (f32 products).
    v: Buf<f32>,
    /// Scores, then probabilities, transposed: `st[c * np + r]`; `st2` the second half-sum.
    st: Buf<f32>,
    st2: Buf<f32>,
    /// Probabilities as bf16 pairs of keys: `pp[cp * np + r]`.
    pp: Buf<u32>,
    /// The output accumulator, transposed: `ot[x * np + r]`.
    ot: Buf<f32>,
    row_max: Buf<f32>,
    row_sum: Buf<f32>,
    alpha: Buf<f32>,
    m_sub: Buf<f32>,
    keep: Buf<bool>,
    /// One head row in f32.
    row: Buf<f32>,
    /// [`GATHER_ROWS`] head rows in f32, gathered from `ot`.
    gather: Buf<f32>,
    /// The parts of the current key block ([`masked_parts`]).
    parts: Vec<Part>,
}

impl Scratch {
    /// Tiles for items of at most `rows` query rows and `cols` keys per block (`bs.block_m` and
    /// `bs.block_n`, or less for a call whose sequences are shorter: a one-row, one-key call then
    /// allocates and zeroes a few hundred bytes instead of full blocks).
    pub fn new(bs: BlockSizes, d: usize, (rows, cols): (usize, usize)) -> Self {
        debug_assert!(rows <= bs.block_m && cols <= bs.block_n);
        let (np, bn) = (pad_lanes(rows), cols);
        let d2 = d.div_ceil(2);
        Scratch {
            qt: buf(0.0, d * np),
            qp: buf(0, d2 * np),
            k: buf(0.0, bn * d),
            kp: buf(0, bn * d2),
            v: buf(0.0, bn * d),
            st: buf(0.0, bn * np),
            st2: buf(0.0, bn * np),
            pp: buf(0, bn.div_ceil(2) * np),
            ot: buf(0.0, d * np),
            row_max: buf(0.0, np),
            row_sum: buf(0.0, np),
            alpha: buf(0.0, np),
            m_sub: buf(0.0, np),
            keep: buf(true, bn),
            row: buf(0.0, d),
            gather: buf(0.0, GATHER_ROWS * d),
            parts: Vec::with_capacity(np / LANES + 1),
        }
    }
}

/// Zeroes the dropped probabilities of the tile of rows `m0..m0 + rows` (lanes), keys
/// `n0..n0 + cols` (the 1/(1-p) factor is applied once, at the end).
#[allow(clippy::too_many_arguments)]
fn apply_dropout(
    drop: Dropout,
    (b, h): (usize, usize),
    (m0, rows): (usize, usize),
    (n0, cols): (usize, usize),
    st: &mut [f32],
    np: usize,
    keep: &mut [bool],
) {
    for r in 0..rows {
        drop.keep_row(b, h, m0 + r, n0, &mut keep[..cols]);
        for (c, &kept) in keep[..cols].iter().enumerate() {
            if !kept {
                st[c * np + r] = 0.0;
            }
        }
    }
}

pub(super) struct Inputs<'a, T, S> {
    pub(super) q: &'a [T],
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    /// q, k, v as bf16 sources, and v packed in key pairs: present when the bf16 dot-product
    /// path runs.
    pub(super) bf: Option<(S, S, S)>,
    pub(super) packed_v: Option<PackedV>,
    /// k as pairs (`[cols][d2]` per key block), when the bf16 path runs and key blocks are
    /// revisited ([`key_block_visits`]); else each visit copies its tile.
    ///
    /// [`key_block_visits`]: super::items::key_block_visits
    pub(super) packed_k: Option<KeyTiles<u32>>,
    /// k and v widened to f32 tiles (`[cols][d]` per key block), when the f32 products run and
    /// key blocks are revisited (4 visits for f32 inputs on x86, 16 elsewhere; 2 for bf16 and f16, which the copies
    /// widen; [`key_block_visits`]). At N = 8192, 16 heads, f32 d = 128, the per-visit
    /// copies from k's and v's strided rows took ~16% of the forward's samples (perf,
    /// 2026-11-24).
    ///
    /// [`key_block_visits`]: super::items::key_block_visits
    pub(super) tiles_f32: Option<(KeyTiles<f32>, KeyTiles<f32>)>,
}

/// Runs work item `item`; `next` is the item this worker probably runs after it, whose q rows are
/// prefetched meanwhile (any item, or none, gives the same results).
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_block<T: Element, S: Bf16Source>(
    p: &Params,
    inp: &Inputs<T, S>,
    (item, next): (WorkItem, Option<WorkItem>),
    bs: BlockSizes,
    scr: &mut Scratch,
    row_buf: &mut [T],
    out: &Disjoint<T>,
    lse: &Disjoint<f32>,
) {
    let WorkItem { b, h, m_block } = item;
    let kern: &Kernels = p.kernels;
    let seq = p.seqs[b];
    let d = p.head_dim;
    let d2 = d.div_ceil(2);
    let hk = p.kv_head(h);
    let m0 = m_block * bs.block_m;
    let m1 = (m0 + bs.block_m).min(seq.seqlen_q);
    let rows = m1 - m0;
    let np = pad_lanes(rows);
    let mask = Mask::new(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    let score_mod = ScoreMod::new(p, b, h);
    let bf = inp.bf;

    let q_base = seq.q_base + m0 * p.q.row_stride + h * p.q.head_stride;
    match bf {
        Some((qb, _, _)) => load_pairs_t(qb, q_base, p.q.row_stride, (rows, d, np), &mut scr.qp),
        None => load_tile_t(
            inp.q,
            q_base,
            p.q.row_stride,
            (rows, d, np),
            &mut scr.row,
            &mut scr.qt,
        ),
    }
    scr.ot[..d * np].fill(0.0);
    scr.row_max[..np].fill(f32::NEG_INFINITY);
    scr.row_sum[..np].fill(0.0);

    let (n_min, n_max) = mask.n_block_range(m0, m1, bs.block_n);
    let strip = strip_lanes(kern.isa);
    // A share at each key block, prefetched into L2: the q rows of the item this worker most
    // likely runs next (`next`, the next in the list) and this item's output rows. At 16 heads
    // each row sits on its own page, and their first touches (the q tile's loads, the output
    // rows' writes) waited on a page walk and memory: ~8% of the f32 forward's samples at
    // N = 1024 on a Zen 4 VM; with these prefetches (and `gemm_rescaled`) 0.96-0.97 of its
    // CPU time on AVX2 and AVX-512, bf16 0.93-0.96; level at N = 4096.
    let next_q = next.map(|nx| {
        let s = p.seqs[nx.b];
        let r0 = nx.m_block * bs.block_m;
        let rows = (r0 + bs.block_m).min(s.seqlen_q) - r0;
        let base = s.q_base + r0 * p.q.row_stride + nx.h * p.q.head_stride;
        (base, rows)
    });
    for n_block in n_min..n_max {
        let (i, blocks) = (n_block - n_min, n_max - n_min);
        if let Some((base, next_rows)) = next_q {
            let span = (i * next_rows / blocks, (i + 1) * next_rows / blocks, d);
            prefetch_rows(inp.q, base, p.q.row_stride, span);
        }
        for r in i * rows / blocks..(i + 1) * rows / blocks {
            // SAFETY: rows m0..m1 of head h of sequence b belong to this work item alone; the
            // slice lives only for the prefetch.
            prefetch_span(unsafe { out.range(p.out_offset(b, m0 + r, h), d) });
        }
        let n0 = n_block * bs.block_n;
        let n1 = (n0 + bs.block_n).min(seq.seqlen_k);
        let cover = mask.cover(p.mask_mod.as_ref(), (b, h), (m0, m1), (n0, n1));
        if cover == Cover::None {
            // Every score would be -inf: the block changes nothing.
            continue;
        }
        let block_cols = n1 - n0;
        if cover == Cover::Some {
            masked_parts(&mask, (m0, rows, np), (n0, n1), strip, &mut scr.parts);
        } else {
            scr.parts.clear();
            scr.parts.push(Part {
                l0: 0,
                l1: np,
                cols: block_cols,
            });
        }
        let k_base = seq.k_base + n0 * p.k.row_stride + hk * p.k.head_stride;
        // The block's k and v tiles, read by each of its parts: packed once per call, or copied
        // (widened) here into contiguous tiles, also for f32: rows of k sit heads·d elements
        // apart, each on its own page once that is >= 4 KiB, and the products re-read them; read
        // in place, TLB misses and 4 KiB L1 aliasing cost ~1.4x at N = 8192, 16 heads (measured).
        match (bf, &inp.tiles_f32) {
            (Some((_, kb, _)), _) => {
                if inp.packed_k.is_none() {
                    load_pairs(kb, k_base, p.k.row_stride, block_cols, d, &mut scr.kp);
                }
            }
            (None, None) => {
                load_tile(
                    inp.k,
                    k_base,
                    p.k.row_stride,
                    (block_cols, d, d),
                    &mut scr.k,
                );
                let v_base = seq.v_base + n0 * p.v.row_stride + hk * p.v.head_stride;
                load_tile(
                    inp.v,
                    v_base,
                    p.v.row_stride,
                    (block_cols, d, d),
                    &mut scr.v,
                );
            }
            (None, Some(_)) => {}
        }
        for at in 0..scr.parts.len() {
            let Part { l0, l1, cols } = scr.parts[at];
            // Lanes l0..l1 of the item, rows m0 + l0.. (those of them below `rows` are real).
            let nw = l1 - l0;
            let (pm0, prows) = (m0 + l0, rows.min(l1) - l0);
            let st = &mut scr.st[..cols * nw];
            // S = Q·Kᵀ, transposed: st[c][r] = Σ_x k[c][x] · q[r][x].
            match bf {
                Some(_) => {
                    let a = match &inp.packed_k {
                        Some(t) => t.block(p, b, hk, n_block, bs.block_n),
                        None => &scr.kp[..],
                    };
                    kern.gemm_bf16(
                        &Gemm {
                            m: cols,
                            n: nw,
                            k: d2,
                            a,
                            a_rs: d2,
                            a_cs: 1,
                            b: &scr.qp[l0..],
                            b_rs: np,
                            accumulate: false,
                            kc: KC,
                        },
                        st,
                        nw,
                    );
                }
                None => {
                    let a = match &inp.tiles_f32 {
                        Some((kt, _)) => kt.block(p, b, hk, n_block, bs.block_n),
                        None => &scr.k[..],
                    };
                    kern.scores(
                        &Gemm {
                            m: cols,
                            n: nw,
                            k: d,
                            a,
                            a_rs: d,
                            a_cs: 1,
                            b: &scr.qt[l0..],
                            b_rs: np,
                            accumulate: false,
                            kc: KC,
                        },
                        st,
                        nw,
                        &mut scr.st2,
                        p.softcap.is_some() || p.score_fn.is_some(),
                    );
                }
            }
            // A part whose rows all see all its keys takes the unmasked path (without a mask
            // function: `hide` needs the masked one).
            let masked = cover == Cover::Some
                && (p.mask_mod.is_some() || mask.needs_mask(pm0, pm0 + prows, n0, n0 + cols));
            // A masked block without other modifiers is only masked here, its scale is the
            // softmax kernel's (as for unmasked blocks): the same values as `apply`'s multiply
            // per element.
            let scale = if masked && score_mod.mask_only() {
                ScoreMod::mask_raw(st, nw, (pm0, prows), (n0, cols), &mask);
                score_mod.scale_log2
            } else if score_mod.needs_apply(masked) {
                score_mod.apply(st, nw, (pm0, prows), (n0, cols), &mask, masked, None);
                1.0
            } else {
                score_mod.scale_log2
            };
            if let (true, Some(f)) = (masked, &p.mask_mod) {
                // -inf whether `apply` scaled the block or the softmax kernel scales it (by a
                // positive factor, `mask_only`).
                f.hide((b, h), st, nw, (pm0, prows), (n0, cols), &mask);
            }
            kern.softmax_step(
                st,
                cols,
                nw,
                scale,
                &mut scr.row_max[l0..],
                &mut scr.alpha[l0..],
                &mut scr.m_sub[l0..],
                &mut scr.row_sum[l0..],
            );
            // alpha is exactly 1 where a lane's maximum did not move (exp2(0) = 1 in every
            // kernel): after the first blocks that is every lane, and acc_o's rescale can be
            // skipped. The P·V product rescales acc_o as it first adds to it (`gemm_rescaled`,
            // `gemm_bf16_rescaled`: same bits, one pass over acc_o fewer; on a Zen 4 AVX2 0.5-1.5%
            // of the CPU time at N = 1024, AVX-512 f32 and bf16 ~2-3%).
            let rescale = scr.alpha[l0..l1].iter().any(|&a| a != 1.0);
            if let Some(drop) = p.dropout {
                // row_sum keeps the undropped probabilities (the softmax normaliser); only P·V
                // sees the mask.
                apply_dropout(
                    drop,
                    (b, h),
                    (pm0, prows),
                    (n0, cols),
                    st,
                    nw,
                    &mut scr.keep,
                );
            }
            // O += P·V, transposed: ot[x][r] += Σ_c v[c][x] · p[r][c].
            match &inp.packed_v {
                Some(pv) => {
                    kern.pack_pairs_bf16(st, cols, nw, &mut scr.pp);
                    let g = Gemm {
                        m: d,
                        n: nw,
                        k: cols.div_ceil(2),
                        a: pv.block(p, b, hk, n_block, bs.block_n),
                        a_rs: bs.block_n / 2,
                        a_cs: 1,
                        b: &scr.pp,
                        b_rs: nw,
                        accumulate: true,
                        kc: KC,
                    };
                    if rescale {
                        kern.gemm_bf16_rescaled(&g, &mut scr.ot[l0..], np, &scr.alpha[l0..]);
                    } else {
                        kern.gemm_bf16(&g, &mut scr.ot[l0..], np);
                    }
                }
                None => {
                    let a = match &inp.tiles_f32 {
                        Some((_, vt)) => vt.block(p, b, hk, n_block, bs.block_n),
                        None => &scr.v[..],
                    };
                    let g = Gemm {
                        m: d,
                        n: nw,
                        k: cols,
                        a,
                        a_rs: 1,
                        a_cs: d,
                        b: st,
                        b_rs: nw,
                        accumulate: true,
                        kc: KC,
                    };
                    if rescale {
                        kern.gemm_rescaled(&g, &mut scr.ot[l0..], np, &scr.alpha[l0..]);
                    } else {
                        kern.gemm(&g, &mut scr.ot[l0..], np);
                    }
                }
            }
        }
    }

    let out_scale = p.dropout.map_or(1.0, |drop| drop.scale()) * p.out_descale(b, h);
    write_rows(p, (b, h, m0, rows, np), out_scale, scr, row_buf, out, lse);
}

/// Rows gathered from the transposed accumulator at a time by [`write_rows`].
const GATHER_ROWS: usize = 8;

/// Divides acc_o by row_sum and writes the item's rows of `out` and `lse`: the division runs in
/// lanes over the transposed tile (the multiply [`finalize`] does per row, element for element),
/// then [`GATHER_ROWS`] rows at a time are gathered from it, reading each lane group once instead
/// of one strided element per row. At N = 1024, d = 64 the per-row strided gather and divide took
/// most of `forward_block`'s own 4-8% of the samples.
///
/// [`finalize`]: crate::cpu::softmax::finalize
#[allow(clippy::too_many_arguments)]
fn write_rows<T: Element>(
    p: &Params,
    (b, h, m0, rows, np): (usize, usize, usize, usize, usize),
    out_scale: f32,
    scr: &mut Scratch,
    row_buf: &mut [T],
    out: &Disjoint<T>,
    lse: &Disjoint<f32>,
) {
    let d = p.head_dim;
    for (a, &sum) in scr.alpha[..np].iter_mut().zip(&scr.row_sum[..np]) {
        *a = if sum == 0.0 { 0.0 } else { out_scale / sum };
    }
    p.kernels.rescale_o(&mut scr.ot, d, np, &scr.alpha);
    for r0 in (0..rows).step_by(GATHER_ROWS) {
        let n = GATHER_ROWS.min(rows - r0);
        for x in 0..d {
            let lanes = &scr.ot[x * np + r0..x * np + r0 + n];
            for (j, &val) in lanes.iter().enumerate() {
                scr.gather[j * d + x] = val;
            }
        }
        for j in 0..n {
            let r = r0 + j;
            let row = &mut scr.gather[j * d..(j + 1) * d];
            let mut row_lse = finalize_lse(row, scr.row_max[r], scr.row_sum[r]);
            if let Some(s) = &p.sink {
                row_lse = fold_sink(row, row_lse, s[h]);
            }
            T::narrow(row, row_buf);
            // SAFETY: rows m0..m1 of head h of sequence b belong to this work item alone.
            unsafe {
                out.range(p.out_offset(b, m0 + r, h), d)
                    .copy_from_slice(row_buf);
                *lse.range(p.lse_offset(b, h, m0 + r), 1)
                    .first_mut()
                    .expect("len 1") = row_lse;
            }
        }
    }
}

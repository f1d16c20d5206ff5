//! The split-KV loop of one work item: its keys tile by tile, both products per kv head, one
//! online-softmax step per tile for all heads, and the item's normalised rows at the end.

use super::plan::{sub_block_keys, Item, TILE_KEYS, TILE_KEYS_MANY_ROWS, TILE_KEYS_MAX};
use super::prefetch::Ahead;
use super::pv::{acc_in_even_odd_order, acc_to_dim_order, pv_acc};
use super::rows::KeyRows;
use super::rows::PRows;
use super::scores::{scores, QRows, QTrans};
use crate::blocks::Mask;
use crate::cpu::forward::ScoreMod;
use crate::cpu::fp8::widen;
use crate::cpu::simd::{pad_lanes, Isa, Kernels};
use crate::cpu::softmax::{finalize, fold_sink};
use crate::cpu::{buf, buf_from, Buf};
use crate::dtype::Fp8Format;
use crate::params::DecodeParams;
use crate::tensor::{DType, Element, Slice};
use half::bf16;

/// The caches an attention reads: in q's dtype, read in place; or FP8 bytes, widened (exactly)
/// to q's dtype a sub-block of keys at a time into a scratch tile that the same products read.
#[derive(Clone, Copy)]
pub(super) enum Kv<'a, T> {
    Plain(&'a [T], &'a [T]),
    Fp8(&'a [u8], &'a [u8], Fp8Format),
}

/// Where an item puts its rows: row `h · m + il` of query block `i0..i0 + m` (`m` positions of
/// every head) is query position `i0 + il` of head `h` (its LSE goes to `lse[h · m + il]` either
/// way).
pub(super) enum ItemOut<'a, T> {
    /// A split's partial result: the row, normalised, in f32 at `[(h · m + il) · d..]`, to be
    /// merged through the LSEs.
    Parts(&'a mut [f32]),
    /// The final result (the only split): the row rounded to `T` at `[(il · heads + h) · d..]`,
    /// the block's rows of the call's output.
    Rows(&'a mut [T]),
}

/// The split-KV loop of one item over its keys, for all heads, writing the item's normalised
/// rows into `dst` (see [`ItemOut`]) and their LSEs into `lse`; `next`, the item after it, has its first
/// tile prefetched during this item's last. See the module docs.
pub(super) fn run_item<T: Element>(
    dp: &DecodeParams,
    q: &[T],
    kv: Kv<T>,
    (it, next): (Item, Option<Item>),
    (mut dst, lse): (ItemOut<T>, &mut [f32]),
) {
    let (p, cache) = (&dp.p, &dp.cache);
    let kern: &Kernels = p.kernels;
    let Item {
        b,
        i0,
        i1,
        n_lo,
        n_hi,
    } = it;
    let seq = p.seqs[b];
    let (d, dpad) = (p.head_dim, pad_lanes(p.head_dim));
    let (heads_kv, group) = (p.heads_kv, p.heads / p.heads_kv);
    let m_rows = i1 - i0;
    // Row (h, i) of the item is h · m_rows + (i - i0): the rows of kv head hk are
    // hk · rows..(hk + 1) · rows. Every row of the item is a lane of the score tile (np lanes
    // per key), so one softmax step covers all heads.
    let rows = group * m_rows;
    let all_rows = heads_kv * rows;
    let np = pad_lanes(all_rows);
    let mask = Mask::new(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);

    // q in f32, rotated, rows of `dpad` (padding 0).
    let mut qf = buf(0f32, all_rows * dpad);
    let masked = p.window_left.is_some() || p.window_right.is_some();
    for h in 0..p.heads {
        for i in i0..i1 {
            let src = seq.q_base + i * p.q.row_stride + h * p.q.head_stride;
            let dst = &mut qf[(h * m_rows + i - i0) * dpad..][..d];
            T::widen(&q[src..src + d], dst);
            if let Some(rot) = &dp.rotary {
                // flash-attn's rule: with a causal or windowed mask query i sits at position
                // cache_seqlens[b] + i; without one, every query sits at cache_seqlens[b]. The
                // rotated q is rounded to q's dtype, as flash-attn hands it over.
                rot.rotate_to::<T>(dst, b, if masked { i } else { 0 });
            }
        }
    }
    // bf16 with `vdpbf16ps`: q also as bf16 pairs (exact: q is bf16, rotated or not), rows of
    // dpad / 2 pairs.
    let qb: Option<Buf<u32>> = (T::DTYPE == DType::BF16 && kern.has_bf16_dot()).then(|| {
        let pair = |a: bf16, b: bf16| a.to_bits() as u32 | (b.to_bits() as u32) << 16;
        match T::wrap(q) {
            // Unrotated bf16 q: its own bits, as rounding its f32 widening would give back
            // (~7% of a 64 × 128-key bf16 step when rounded element by element).
            Slice::BF16(qs) if dp.rotary.is_none() => {
                let mut qb = buf(0u32, all_rows * dpad / 2);
                for h in 0..p.heads {
                    for i in i0..i1 {
                        let src = &qs[seq.q_base + i * p.q.row_stride + h * p.q.head_stride..][..d];
                        let dst = &mut qb[(h * m_rows + i - i0) * dpad / 2..][..d.div_ceil(2)];
                        let pairs = src.chunks_exact(2);
                        if let [last] = pairs.remainder() {
                            dst[d / 2] = pair(*last, bf16::ZERO);
                        }
                        for (o, x) in dst.iter_mut().zip(pairs) {
                            *o = pair(x[0], x[1]);
                        }
                    }
                }
                qb
            }
            _ => buf_from(
                qf.chunks_exact(2)
                    .map(|x| pair(bf16::from_f32(x[0]), bf16::from_f32(x[1]))),
            ),
        }
    });
    // Many rows per kv head (MQA, several tokens per step) on AVX-512: q also transposed, for
    // the outer-product score kernel; bf16 keys on AVX2: q in even-odd order.
    let bf16_keys = T::DTYPE == DType::BF16;
    let qt = QTrans::for_item(
        kern.decode,
        &qf,
        (qb.as_deref(), bf16_keys),
        (heads_kv, rows, d, dpad),
    );
    let mut acc = buf(0f32, all_rows * dpad);
    let mut row_max = vec![f32::NEG_INFINITY; np];
    let mut row_sum = vec![0f32; np];
    let (mut alpha, mut m_sub) = (vec![0f32; np], vec![0f32; np]);
    // Lanes all_rows..np are never written by the products; zero here, they stay finite through
    // the softmax and are never read back.
    let mut st = buf(0f32, TILE_KEYS_MAX * np);
    // bf16 with `vdpbf16ps`: P as bf16 pairs of keys for the P·V product.
    let mut pp: Option<Buf<u32>> = qb
        .is_some()
        .then(|| buf(0u32, TILE_KEYS_MAX.div_ceil(2) * np));
    let mods: Vec<ScoreMod> = (0..p.heads).map(|h| ScoreMod::new(p, b, h)).collect();
    // One score scale for all heads, unless FP8 k descale factors differ between kv heads: then
    // each head's rows are scaled by `ScoreMod::apply`.
    let one_scale = mods.iter().all(|m| m.scale_log2 == mods[0].scale_log2);
    // The tile after n0: keys n0..n1, cut at the split's end; the rows' offsets (kv head 0) in
    // k and v, which may lie on several pages.
    // Sub-blocks only where one register block holds a kv head's query rows (one token per
    // step): with more rows the products do several times the arithmetic per byte read, and the
    // sub-blocks' extra passes over the accumulators cost more than the reads gain (see
    // SUB_BLOCK_BYTES); those shapes take longer tiles whole instead.
    let (tile_keys, sub) = if rows <= 4 {
        (
            TILE_KEYS,
            sub_block_keys(heads_kv * d * std::mem::size_of::<T>()),
        )
    } else {
        (TILE_KEYS_MANY_ROWS, TILE_KEYS_MANY_ROWS)
    };
    let tile = |n0: usize, kt: &mut [usize; TILE_KEYS_MAX], vt: &mut [usize; TILE_KEYS_MAX]| {
        let n1 = n_hi.min(n0 + tile_keys);
        cache.key_offsets_run(b, n0, &mut kt[..n1 - n0], &mut vt[..n1 - n0]);
        n1
    };
    let (mut kt, mut vt) = ([0usize; TILE_KEYS_MAX], [0usize; TILE_KEYS_MAX]);
    let (mut kt_next, mut vt_next) = ([0usize; TILE_KEYS_MAX], [0usize; TILE_KEYS_MAX]);
    // Refilled in place per tile (its run buffers are a few KiB).
    let mut ahead = Ahead::none();
    // FP8 caches: the sub-block being multiplied, widened to q's dtype (see `Kv`), as rows
    // [key][kv head][d]; `scratch_rows` names them (kv head 0) for the products.
    let span = heads_kv * d;
    let mut scratch: Vec<T> = match kv {
        Kv::Fp8(..) => vec![T::default(); TILE_KEYS_MAX * span],
        Kv::Plain(..) => Vec::new(),
    };
    let scratch_keys: [usize; TILE_KEYS_MAX] = std::array::from_fn(|c| c * span);
    let scratch_rows = KeyRows::new(&scratch_keys, 0, d);

    // The query rows of kv head hk (the same for every tile).
    let q_rows = |hk: usize| QRows {
        f32: &qf[hk * rows * dpad..(hk + 1) * rows * dpad],
        bf16_pairs: qb
            .as_ref()
            .map(|qb| &qb[hk * rows * dpad / 2..(hk + 1) * rows * dpad / 2]),
        rows,
        dpad,
        t: qt.as_ref().map(|t| t.group(hk)),
    };

    let mut n0 = n_lo;
    let mut n1 = tile(n0, &mut kt, &mut vt);
    while n0 < n_hi {
        let cols = n1 - n0;
        // The rows of kv head hk for the tile's keys c0..c1.
        let (kt_rows, vt_rows) = (
            KeyRows::new(&kt[..cols], 0, d),
            KeyRows::new(&vt[..cols], 0, d),
        );
        let k_rows =
            |hk: usize, c0: usize, c1: usize| kt_rows.sub(c0, c1, hk * cache.k.head_stride);
        let v_rows =
            |hk: usize, c0: usize, c1: usize| vt_rows.sub(c0, c1, hk * cache.v.head_stride);
        // The next tile is fetched while this one computes: a few cache lines per key of both
        // products (see `Ahead`).
        // After the last tile: the first tile of the next item, which this thread most often
        // takes next (rayon hands out consecutive items); 64 sequences × 128 keys bf16 0.92-0.93
        // on one thread, 0.93-0.94 on two, × 512 keys 0.96-0.98, f32 0.94; one 32k-key
        // sequence unchanged (A/B in one process, alternating, both orders, 2026-11-23).
        let (n2, pf) = if n1 < n_hi {
            let n2 = tile(n1, &mut kt_next, &mut vt_next);
            (n2, n2 - n1)
        } else if let Some(nx) = next {
            let m = (nx.n_hi - nx.n_lo).min(TILE_KEYS);
            cache.key_offsets_run(nx.b, nx.n_lo, &mut kt_next[..m], &mut vt_next[..m]);
            (n1, m)
        } else {
            (n1, 0)
        };
        let steps = 2 * heads_kv * cols;
        match kv {
            Kv::Plain(k, v) => ahead.set(
                (k, &kt_next[..pf], cache.k),
                (v, &vt_next[..pf], cache.v),
                (heads_kv, d),
                steps,
            ),
            Kv::Fp8(k, v, _) => ahead.set(
                (k, &kt_next[..pf], cache.k),
                (v, &vt_next[..pf], cache.v),
                (heads_kv, d),
                steps,
            ),
        }
        let masked = mask.needs_mask(i0, i1, n0, n1);
        let apply = !one_scale || mods[0].needs_apply(masked);
        let st = &mut st[..cols * np];
        for c0 in (0..cols).step_by(sub) {
            let c1 = cols.min(c0 + sub);
            if let Kv::Fp8(k, _, format) = kv {
                let src = (k, &kt[c0..c1], cache.k);
                widen_keys(kern.isa, format, src, (heads_kv, d), &mut scratch);
            }
            for hk in 0..heads_kv {
                let st = &mut st[c0 * np + hk * rows..];
                let (src, kr) = match kv {
                    Kv::Plain(k, _) => (k, k_rows(hk, c0, c1)),
                    Kv::Fp8(..) => (&scratch[..], scratch_rows.sub(0, c1 - c0, hk * d)),
                };
                scores(kern.decode, q_rows(hk), src, kr, st, np, &mut ahead);
            }
        }
        if apply {
            for hk in 0..heads_kv {
                for hl in 0..group {
                    mods[hk * group + hl].apply(
                        &mut st[hk * rows + hl * m_rows..],
                        np,
                        (i0, m_rows),
                        (n0, cols),
                        &mask,
                        masked,
                        None,
                    );
                }
            }
        }
        let scale = if apply { 1.0 } else { mods[0].scale_log2 };
        kern.max_get_scale(st, cols, np, scale, &mut row_max, &mut alpha, &mut m_sub);
        kern.online_softmax(st, cols, np, &m_sub, &mut row_sum, &alpha);
        // alpha is exactly 1 where a row's maximum did not move (as in the forward).
        for (acc_row, &a) in acc.chunks_exact_mut(dpad).zip(&alpha) {
            if a != 1.0 {
                acc_row.iter_mut().for_each(|x| *x *= a);
            }
        }
        if let Some(pp) = pp.as_mut() {
            kern.pack_pairs_bf16(st, cols, np, pp);
        }
        for c0 in (0..cols).step_by(sub) {
            let c1 = cols.min(c0 + sub);
            if let Kv::Fp8(_, v, format) = kv {
                let src = (v, &vt[c0..c1], cache.v);
                widen_keys(kern.isa, format, src, (heads_kv, d), &mut scratch);
            }
            for hk in 0..heads_kv {
                let acc_hk = &mut acc[hk * rows * dpad..(hk + 1) * rows * dpad];
                // c0 is even: a whole number of bf16 key pairs precedes it.
                let pr = PRows {
                    f32: &st[c0 * np + hk * rows..],
                    bf16_pairs: pp.as_ref().map(|pp| &pp[c0 / 2 * np + hk * rows..]),
                    rows,
                    np,
                };
                let (src, vr) = match kv {
                    Kv::Plain(_, v) => (v, v_rows(hk, c0, c1)),
                    Kv::Fp8(..) => (&scratch[..], scratch_rows.sub(0, c1 - c0, hk * d)),
                };
                pv_acc(kern.decode, pr, src, vr, acc_hk, dpad, &mut ahead);
            }
        }
        (n0, n1) = (n1, n2);
        (kt, vt) = (kt_next, vt_next);
    }

    // The AVX2 P·V over bf16 values keeps acc_o rows in even-odd order (see `pv_acc`).
    let even_odd = acc_in_even_odd_order::<T>(kern.decode);
    for row in 0..all_rows {
        let acc_row = &mut acc[row * dpad..row * dpad + d];
        if even_odd {
            acc_to_dim_order(acc_row);
        }
        // FP8 caches: v's descale factor (1 otherwise).
        let out_scale = p.out_descale(b, row / m_rows);
        lse[row] = finalize(acc_row, row_max[row], row_sum[row], out_scale);
        match &mut dst {
            // A split's partial: the sink joins after the merge (see `attend`).
            ItemOut::Parts(out) => out[row * d..(row + 1) * d].copy_from_slice(acc_row),
            // The item covers all of its rows' keys: the sink joins here.
            ItemOut::Rows(out) => {
                let (h, il) = (row / m_rows, row % m_rows);
                if let Some(s) = &p.sink {
                    lse[row] = fold_sink(acc_row, lse[row], s[h]);
                }
                T::narrow(acc_row, &mut out[(il * p.heads + h) * d..][..d]);
            }
        }
    }
}

/// Widens the rows of all `heads_kv` kv heads of the keys at row offsets `keys` (kv head 0) in
/// the FP8 cache `src` (layout `l`) into `dst` as rows `[key][kv head][d]` from its start. Where a
/// key's heads lie together (flash-attn's `[.., seqlen, heads_kv, d]`), each run of consecutive
/// keys is one call: one per sub-block of a contiguous cache, one per page of a paged one.
fn widen_keys<T: Element>(
    isa: Isa,
    format: Fp8Format,
    (src, keys, l): (&[u8], &[usize], crate::params::RowLayout),
    (heads_kv, d): (usize, usize),
    dst: &mut [T],
) {
    let span = heads_kv * d;
    if heads_kv == 1 || l.head_stride == d {
        let mut c = 0;
        while c < keys.len() {
            let mut e = c + 1;
            while e < keys.len() && keys[e] == keys[e - 1] + span {
                e += 1;
            }
            let n = (e - c) * span;
            widen(
                isa,
                format,
                &src[keys[c]..keys[c] + n],
                &mut dst[c * span..c * span + n],
            );
            c = e;
        }
    } else {
        for (c, &k) in keys.iter().enumerate() {
            for hk in 0..heads_kv {
                let at = k + hk * l.head_stride;
                let o = c * span + hk * d;
                widen(isa, format, &src[at..at + d], &mut dst[o..o + d]);
            }
        }
    }
}

//! `fp8::quantize_qkv`: incoherent processing leaves QKᵀ unchanged (f64), quantisation round
//! trips within half a step of the format, factors follow the granularity, and on data with
//! outliers incoherent processing lowers the FP8 forward's error against the f64 reference.
//!
//! The accuracy table of docs/SEMANTICS.md is printed by
//! `cargo test -p flashattn --test integration fp8::quantize::accuracy_with_outliers -- --nocapture`.

use super::*;
use flashattn::fp8::{
    quantize_qkv, quantize_qkv_varlen, Granularity, Incoherent, QuantizeOptions, QuantizedQkv,
};

/// A standard normal sample (Box–Muller).
fn normal(g: &mut ChaCha8Rng) -> f64 {
    let (u, v): (f64, f64) = (g.gen_range(f64::EPSILON..1.0), g.gen_range(0.0..1.0));
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

/// FlashAttention-3's test distribution: N(0, 1), plus for 0.1% of the entries an independent
/// N(0, 10²) term (outliers).
pub(super) fn outlier_data(g: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let mut x = normal(g);
            if g.gen_bool(0.001) {
                x += 10.0 * normal(g);
            }
            x as f32
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `x·D·H/√d` keeps every dot product (`M` is orthogonal), checked in f64; `M`'s rows are
/// orthonormal; an outlier coordinate is spread over the row.
#[test]
fn incoherent_transform_keeps_qk() {
    let mut g = rng(3);
    for d in [1usize, 2, 16, 64, 128, 256] {
        let rot = Incoherent::new(d, 11 + d as u64).unwrap();
        for _ in 0..20 {
            let q: Vec<f64> = (0..d).map(|_| normal(&mut g)).collect();
            let k: Vec<f64> = (0..d).map(|_| normal(&mut g)).collect();
            let (mut qm, mut km) = (q.clone(), k.clone());
            rot.apply(&mut qm);
            rot.apply(&mut km);
            let (want, got) = (dot(&q, &k), dot(&qm, &km));
            let bound = 1e-13 * (dot(&q, &q) * dot(&k, &k)).sqrt().max(1.0);
            assert!((want - got).abs() <= bound, "d {d}: {want} vs {got}");
        }
        // Rows of M: e_i·M; their Gram matrix is the identity.
        let rows: Vec<Vec<f64>> = (0..d)
            .map(|i| {
                let mut e = vec![0.0; d];
                e[i] = 1.0;
                rot.apply(&mut e);
                e
            })
            .collect();
        for i in 0..d {
            for j in 0..d {
                let want = if i == j { 1.0 } else { 0.0 };
                assert!(
                    (dot(&rows[i], &rows[j]) - want).abs() < 1e-14,
                    "d {d} ({i}, {j})"
                );
            }
            // Every entry of a row is ±1/√d: a one-hot outlier is spread evenly.
            for &x in &rows[i] {
                assert!((x.abs() - 1.0 / (d as f64).sqrt()).abs() < 1e-15);
            }
        }
    }
}

/// Half a step of e4m3 / e5m2 at `x` for a factor `s`: relative 2^-4 / 2^-3 for normal values,
/// absolute half the subnormal spacing below.
fn half_step(format: Fp8Format, x: f64, s: f64) -> f64 {
    let (rel, sub) = match format {
        Fp8Format::E4M3 => (2f64.powi(-4), 2f64.powi(-10)),
        Fp8Format::E5M2 => (2f64.powi(-3), 2f64.powi(-17)),
    };
    (x.abs() * rel).max(sub * s) * (1.0 + 1e-12)
}

/// The values of a [`TensorRef`] of f32 in its logical (contiguous) order.
fn logical(x: &[f32], shape: &[usize], strides: &[usize]) -> Vec<f64> {
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut i| {
            let mut at = 0;
            for (&len, &st) in shape.iter().zip(strides).rev() {
                at += (i % len) * st;
                i /= len;
            }
            x[at] as f64
        })
        .collect()
}

/// The inverse of the transform on a row: `y·Mᵀ = (y·H/√d)∘D`.
fn untransform(rot: &Incoherent, row: &mut [f64]) {
    flashattn::fp8::walsh_hadamard(row);
    let norm = 1.0 / (row.len() as f64).sqrt();
    for (x, s) in row.iter_mut().zip(rot.signs()) {
        *x *= norm * s;
    }
}

/// Round trips: each dequantised value is within half a step of the (transformed) input; each
/// factor's largest value is the format's max; per-head factors are `[batch, heads_kv]`, q's
/// heads sharing their kv head's factor; a strided q reads the same as a contiguous one.
#[test]
fn round_trip_and_factors() {
    let (b, s, h, hk, d) = (2, 37, 6, 2, 32);
    let mut g = rng(5);
    // q strided: heads padded to d + 5 elements.
    let hs = d + 5;
    let q_strides = [s * h * hs, h * hs, hs, 1];
    let q: Vec<f32> = outlier_data(&mut g, b * s * h * hs);
    let k: Vec<f32> = outlier_data(&mut g, b * s * hk * d);
    // v with per-head magnitudes that differ by 1000x, so per-head factors differ.
    let mut v: Vec<f32> = outlier_data(&mut g, b * s * hk * d);
    for (i, x) in v.iter_mut().enumerate() {
        if i / d % hk == 1 {
            *x *= 1000.0;
        }
    }
    let kv_shape = [b, s, hk, d];
    let kv_strides = [s * hk * d, hk * d, d, 1];
    let qv = TensorRef::new(&q, &[b, s, h, d], &q_strides);
    let (kt, vt) = (
        TensorRef::contiguous(&k, &kv_shape),
        TensorRef::contiguous(&v, &kv_shape),
    );
    let inputs = [
        logical(&q, &[b, s, h, d], &q_strides),
        logical(&k, &kv_shape, &kv_strides),
        logical(&v, &kv_shape, &kv_strides),
    ];
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for granularity in [
            Granularity::PerTensor,
            Granularity::PerHead,
            Granularity::PerBlock,
        ] {
            for incoherent in [None, Some(9u64)] {
                let mut o = QuantizeOptions::default()
                    .format(format)
                    .granularity(granularity);
                o.incoherent = incoherent;
                let ctx = format!("{format} {granularity:?} incoherent {incoherent:?}");
                let qkv = quantize_qkv(&qv, &kt, &vt, &o).unwrap();
                for (t, x) in [&qkv.q, &qkv.k, &qkv.v].into_iter().enumerate() {
                    let nh = if t == 0 { h } else { hk };
                    // Per block: s = 37 rows, one block per (sequence, head).
                    let n_factors = match granularity {
                        Granularity::PerTensor => 1,
                        Granularity::PerHead => b * hk,
                        Granularity::PerBlock => b * nh,
                    };
                    assert_eq!(x.granularity(), granularity);
                    assert_eq!(x.shape(), &[b, s, nh, d], "{ctx}");
                    assert_eq!(x.descale().len(), n_factors, "{ctx}");
                    assert_eq!(x.format(), format);
                    // Transformed inputs, in f64.
                    let mut want = inputs[t].clone();
                    if t < 2 {
                        if let Some(rot) = &qkv.incoherent {
                            want.chunks_mut(d).for_each(|r| rot.apply(r));
                        }
                    }
                    let deq = x.dequantized();
                    let factor = |i: usize| {
                        let (bb, head) = (i / (s * nh * d), i / d % nh);
                        let kvh = if t == 0 { head / (h / hk) } else { head };
                        match granularity {
                            Granularity::PerTensor => 0,
                            Granularity::PerHead => bb * hk + kvh,
                            Granularity::PerBlock => bb * nh + head,
                        }
                    };
                    let mut amax = vec![0f64; n_factors];
                    for (i, (&w, &got)) in want.iter().zip(&deq).enumerate() {
                        let f = factor(i);
                        let sc = x.descale()[f] as f64;
                        assert!(
                            (w - got).abs() <= half_step(format, w, sc),
                            "{ctx} tensor {t} element {i}: {w} -> {got} (factor {sc})"
                        );
                        amax[f] = amax[f].max(w.abs());
                    }
                    for (f, &a) in amax.iter().enumerate() {
                        let sc = x.descale()[f] as f64;
                        // The factor is amax / max, rounded once to f32.
                        assert_eq!(x.descale()[f], (a / format.max() as f64) as f32, "{ctx}");
                        assert!(a / sc <= format.max() as f64 * (1.0 + 1e-6), "{ctx}");
                    }
                    if granularity == Granularity::PerHead && t == 2 {
                        let r = x.descale()[1] / x.descale()[0];
                        assert!(r > 100.0, "{ctx}: v's per-head factors {:?}", x.descale());
                    }
                }
                // With the transform undone, q and k come back within the error the rounding
                // allows (each coordinate's error spreads over the row, with the same norm).
                if let Some(rot) = &qkv.incoherent {
                    for (t, x) in [&qkv.q, &qkv.k].into_iter().enumerate() {
                        let mut deq = x.dequantized();
                        deq.chunks_mut(d).for_each(|r| untransform(rot, r));
                        let scale = x.descale().iter().fold(0f32, |m, &v| m.max(v)) as f64;
                        let step = match format {
                            Fp8Format::E4M3 => 32.0,
                            Fp8Format::E5M2 => 16384.0,
                        };
                        for (row_w, row_g) in inputs[t].chunks(d).zip(deq.chunks(d)) {
                            let err: f64 = row_w
                                .iter()
                                .zip(row_g)
                                .map(|(a, b)| (a - b) * (a - b))
                                .sum::<f64>()
                                .sqrt();
                            assert!(err <= scale * step * (d as f64).sqrt(), "{ctx}: {err}");
                        }
                    }
                }
            }
        }
    }
}

/// Packed sequences: one factor per (sequence, kv head); the same values as the batched call
/// when the sequences have equal lengths; an empty sequence takes factor 1.
#[test]
fn varlen_factors_per_sequence() {
    let (h, hk, d) = (4, 2, 16);
    let mut g = rng(8);
    let lens = [5usize, 0, 9];
    let total: usize = lens.iter().sum();
    let q = outlier_data(&mut g, total * h * d);
    let k = outlier_data(&mut g, total * hk * d);
    let cu1 = cu(&lens);
    let o = QuantizeOptions::default().incoherent(1);
    let qkv = quantize_qkv_varlen(
        &TensorRef::contiguous(&q, &[total, h, d]),
        &TensorRef::contiguous(&k, &[total, hk, d]),
        &TensorRef::contiguous(&k, &[total, hk, d]),
        &cu1,
        &cu1,
        &o,
    )
    .unwrap();
    assert_eq!(qkv.q.shape(), &[total, h, d]);
    assert_eq!(qkv.q.descale().len(), 3 * hk);
    assert_eq!(&qkv.k.descale()[2..4], &[1.0, 1.0]);
    // Batched with two sequences of 7 = packed with [7, 7].
    let (b, s) = (2, 7);
    let qb = &q[..b * s * h * d];
    let kb = &k[..b * s * hk * d];
    let batched = quantize_qkv(
        &TensorRef::contiguous(qb, &[b, s, h, d]),
        &TensorRef::contiguous(kb, &[b, s, hk, d]),
        &TensorRef::contiguous(kb, &[b, s, hk, d]),
        &o,
    )
    .unwrap();
    let cu2 = cu(&[7, 7]);
    let packed = quantize_qkv_varlen(
        &TensorRef::contiguous(qb, &[b * s, h, d]),
        &TensorRef::contiguous(kb, &[b * s, hk, d]),
        &TensorRef::contiguous(kb, &[b * s, hk, d]),
        &cu2,
        &cu2,
        &o,
    )
    .unwrap();
    assert_eq!(batched.q.bytes(), packed.q.bytes());
    assert_eq!(batched.k.descale(), packed.k.descale());
}

/// Per block: one factor per 128 rows of each (sequence, head), counted from each sequence's
/// first row, in `[batch, heads, blocks]` tables padded with 1 (an empty sequence, a shorter
/// one's missing blocks); each factor is its block's amax over the format's max, every value
/// within half a step; the views and factors feed the FP8 forward as they are.
#[test]
fn per_block_factors() {
    let (h, hk, d) = (2, 1, 16);
    let mut g = rng(12);
    let lens = [130usize, 0, 200];
    let total: usize = lens.iter().sum();
    let mut q = outlier_data(&mut g, total * h * d);
    // Block 1 of sequence 2 (its rows 128..200) a hundred times larger: its own factor.
    for (i, x) in q.iter_mut().enumerate() {
        let tok = i / (h * d);
        if tok >= 130 + 128 {
            *x *= 100.0;
        }
    }
    let k = outlier_data(&mut g, total * hk * d);
    let cu1 = cu(&lens);
    let o = QuantizeOptions::default().granularity(Granularity::PerBlock);
    let (qt, kt) = (
        TensorRef::contiguous(&q, &[total, h, d]),
        TensorRef::contiguous(&k, &[total, hk, d]),
    );
    let qkv = quantize_qkv_varlen(&qt, &kt, &kt, &cu1, &cu1, &o).unwrap();
    assert_eq!(qkv.q.descale().len(), 3 * h * 2);
    assert_eq!(qkv.k.descale().len(), 3 * hk * 2);
    assert!(qkv.descale().per_block);
    // Sequence 1 (empty) and sequence 0's second k block... (130 rows: two blocks) all used;
    // sequence 1's are padding.
    assert_eq!(&qkv.q.descale()[4..8], &[1.0; 4]);
    for (t, (x, nh, src)) in [(&qkv.q, h, &q), (&qkv.k, hk, &k)].into_iter().enumerate() {
        let deq = x.dequantized();
        let mut starts = vec![0];
        starts.extend(lens.iter().scan(0, |a, &l| {
            *a += l;
            Some(*a)
        }));
        for (bb, &len) in lens.iter().enumerate() {
            for head in 0..nh {
                for blk in 0..len.div_ceil(128) {
                    let rows = starts[bb] + 128 * blk..starts[bb] + (128 * (blk + 1)).min(len);
                    let at = |r: usize, j: usize| (r * nh + head) * d + j;
                    let amax = rows
                        .clone()
                        .flat_map(|r| (0..d).map(move |j| src[at(r, j)].abs() as f64))
                        .fold(0f64, f64::max);
                    let f = x.descale()[(bb * nh + head) * 2 + blk];
                    assert_eq!(f, (amax / 448.0) as f32, "tensor {t} ({bb}, {head}, {blk})");
                    for r in rows {
                        for j in 0..d {
                            let w = src[at(r, j)] as f64;
                            let got = deq[at(r, j)];
                            assert!((w - got).abs() <= half_step(Fp8Format::E4M3, w, f as f64));
                        }
                    }
                }
            }
        }
    }
    let r = qkv.q.descale()[(2 * h) * 2 + 1] / qkv.q.descale()[(2 * h) * 2];
    assert!(r > 30.0, "the large block's factor: {:?}", qkv.q.descale());
    // The FP8 forward takes the views and tables as they are.
    let [qv, kv, vv] = qkv.views();
    let opts = AttnOptions::default()
        .varlen(&cu1, &cu1)
        .descale(qkv.descale());
    assert!(flash_attn_fp8(&qv, &kv, &vv, &opts).is_ok());
}

/// Bad input is refused by name: a head_dim that is not a power of two with incoherent
/// processing (fine without), and the attention call's own shape checks.
#[test]
fn quantize_rejects_bad_input() {
    let x = vec![1.0f32; 2 * 3 * 2 * 24];
    let t = TensorRef::contiguous(&x, &[2, 3, 2, 24]);
    let e = quantize_qkv(&t, &t, &t, &QuantizeOptions::default().incoherent(0)).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::IncoherentHeadDim { head_dim: 24 }),
        "{e}"
    );
    assert!(quantize_qkv(&t, &t, &t, &QuantizeOptions::default()).is_ok());
    let k = TensorRef::contiguous(&x[..2 * 3 * 2 * 12], &[2, 3, 2, 12]);
    let e = quantize_qkv(&t, &k, &k, &QuantizeOptions::default()).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Shape { tensor: "k", .. }),
        "{e}"
    );
    // All-zero input: factor 1, zero bytes.
    let z = vec![0f32; 2 * 3 * 2 * 16];
    let zt = TensorRef::contiguous(&z, &[2, 3, 2, 16]);
    let qkv = quantize_qkv(&zt, &zt, &zt, &QuantizeOptions::default()).unwrap();
    assert!(qkv.q.descale().iter().all(|&f| f == 1.0));
    assert!(qkv.q.bytes().iter().all(|&b| b == 0));
}

/// RMSE of `out` against `want`.
pub(super) fn rmse(out: &[f32], want: &[f64]) -> f64 {
    let s: f64 = out
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b) * (a as f64 - b))
        .sum();
    (s / want.len() as f64).sqrt()
}

/// The CPU FP8 forward on `qkv`, its RMSE against `want`.
fn fp8_rmse(qkv: &QuantizedQkv, opts: &AttnOptions, want: &[f64]) -> f64 {
    let [q, k, v] = qkv.views();
    let res = flash_attn_fp8(&q, &k, &v, &opts.clone().descale(qkv.descale())).unwrap();
    rmse(&res.out.to_f32_vec(), want)
}

/// FlashAttention-3's accuracy experiment (its section 3.3 and Table 3), on the CPU FP8 forward:
/// q, k, v from N(0, 1) with 0.1% outliers, e4m3; RMSE of `out` against the f64 reference on
/// the unquantised inputs. Incoherent processing must lower the per-tensor error by a clear
/// margin. Prints the table of docs/SEMANTICS.md (`-- --nocapture`).
#[test]
fn accuracy_with_outliers() {
    let (b, s, h, d) = (1, 1024, 4, 128);
    let mut g = rng(2024);
    let shape = [b, s, h, d];
    let (q, k, v) = (
        outlier_data(&mut g, b * s * h * d),
        outlier_data(&mut g, b * s * h * d),
        outlier_data(&mut g, b * s * h * d),
    );
    let (qt, kt, vt) = (
        TensorRef::contiguous(&q, &shape),
        TensorRef::contiguous(&k, &shape),
        TensorRef::contiguous(&v, &shape),
    );
    let opts = AttnOptions::default();
    let want = reference::attention(&qt, &kt, &vt, &opts).unwrap().out;
    // The bf16 forward on the bf16-rounded inputs: the floor FP8 cannot beat.
    let [qb, kb, vb] =
        [&q, &k, &v].map(|x| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
    let bf = flashattn::flash_attn(
        &TensorRef::contiguous(&qb, &shape),
        &TensorRef::contiguous(&kb, &shape),
        &TensorRef::contiguous(&vb, &shape),
        &opts,
    )
    .unwrap();
    let bf16_rmse = rmse(&bf.out.to_f32_vec(), &want);
    let seed = 0x5eed;
    let run = |granularity: Granularity, incoherent: bool| {
        let mut o = QuantizeOptions::default().granularity(granularity);
        if incoherent {
            o = o.incoherent(seed);
        }
        fp8_rmse(&quantize_qkv(&qt, &kt, &vt, &o).unwrap(), &opts, &want)
    };
    let rows = [
        (
            "per tensor",
            run(Granularity::PerTensor, false),
            run(Granularity::PerTensor, true),
        ),
        (
            "per (sequence, kv head)",
            run(Granularity::PerHead, false),
            run(Granularity::PerHead, true),
        ),
        (
            "per block of 128 rows",
            run(Granularity::PerBlock, false),
            run(Granularity::PerBlock, true),
        ),
    ];
    println!(
        "e4m3, q k v [{b}, {s}, {h}, {d}], N(0,1) + 0.1% N(0,10^2) outliers; RMSE of out vs f64"
    );
    println!("bf16 forward on bf16 inputs: {bf16_rmse:.2e}");
    println!("| descale factors | plain | incoherent | ratio |");
    for (name, plain, inc) in rows {
        println!("| {name} | {plain:.2e} | {inc:.2e} | {:.2} |", plain / inc);
    }
    let (plain, inc) = (rows[0].1, rows[0].2);
    assert!(
        inc < 0.75 * plain,
        "incoherent processing should lower the per-tensor RMSE by 25%: {plain:e} -> {inc:e}"
    );
    let (plain, inc) = (rows[1].1, rows[1].2);
    assert!(inc < 0.75 * plain, "per head: {plain:e} -> {inc:e}");
    // Per block (the library's PerBlock on the CPU forward): the same gain, and on this data
    // (outliers in every block) within 10% of per (sequence, kv head), as the paper finds.
    let (pb, pbi) = (rows[2].1, rows[2].2);
    assert!(pbi < 0.75 * pb, "per block: {pb:e} -> {pbi:e}");
    for (a, b) in [(pb, plain), (pbi, inc)] {
        assert!(
            (a / b - 1.0).abs() < 0.1,
            "per block {a:e} vs per head {b:e}"
        );
    }
    // Every FP8 variant is worse than bf16, and none is wildly off.
    for (name, plain, inc) in rows {
        assert!(plain > bf16_rmse && inc > bf16_rmse, "{name}");
        assert!(plain < 0.2 && inc < 0.2, "{name}: {plain} {inc}");
    }
}

//! Unit tests of the decode kernels, the prefetcher and the plan's rules.

use super::plan::{choose_splits, sub_block_keys, TILE_KEYS};
use super::prefetch::Ahead;
use super::pv::{acc_in_even_odd_order, acc_to_dim_order, pv_acc};
use super::rows::{KeyRows, PRows};
use super::scores::{scores, QRows, QTrans};
use super::*;
use crate::cpu::simd::{pad_lanes, DecodeKernels, Isa, Kernels};
use crate::tensor::DType;
use crate::test_util::lcg;

/// Every ISA's scores and P·V kernels agree with f64 sums over edge sizes, in every dtype,
/// reading rows in place at a stride (with NaN between rows, which must not be read).
#[test]
fn kernels_match_f64_on_every_isa() {
    use half::f16;
    let mut seed = 1u64;
    for isa in crate::cpu::simd::available() {
        for &(rows, cols, d) in &[
            (1, 1, 1),
            (4, 3, 16),
            (5, 17, 40),
            (13, 32, 128),
            (32, 2, 256),
            (7, 5, 59),
            (1, 9, 64),
            (4, 33, 128),
            (3, 11, 8),
            (12, 19, 256),
            (6, 21, 48),
            (3, 9, 32),
            (8, 6, 96),
            (16, 7, 128),
            (17, 5, 40),
            (64, 9, 64),
            (70, 6, 59),
        ] {
            let (dpad, np) = (pad_lanes(d), pad_lanes(rows));
            let stride = d + 3;
            let mut q = vec![0f32; rows * dpad];
            for r in 0..rows {
                (0..d).for_each(|x| q[r * dpad + x] = lcg(&mut seed));
            }
            let mut kv = vec![f32::NAN; 2 + cols * stride];
            for c in 0..cols {
                (0..d).for_each(|x| kv[2 + c * stride + x] = lcg(&mut seed));
            }
            let p: Vec<f32> = (0..cols * np).map(|_| lcg(&mut seed).abs()).collect();
            // Rows in reverse order, as pages of one key would lie in a shuffled paged
            // cache: the kernels must follow each key's own offset.
            let keys: Vec<usize> = (0..cols).map(|c| 2 + (cols - 1 - c) * stride).collect();
            let kr = KeyRows::new(&keys, 0, d);
            fn check<T: Element>(
                isa: Isa,
                (q, rows, dpad, np): (&[f32], usize, usize, usize),
                kv: &[f32],
                kr: KeyRows,
                p: &[f32],
            ) {
                let src: Vec<T> = kv.iter().map(|&x| T::from_f32(x)).collect();
                let kern = Kernels::for_isa(isa).unwrap();
                let val = |c: usize, x: usize| src[kr.at(c) + x].to_f64();
                let pairs: Vec<u32> = q
                    .chunks_exact(2)
                    .map(|x| {
                        bf16::from_f32(x[0]).to_bits() as u32
                            | (bf16::from_f32(x[1]).to_bits() as u32) << 16
                    })
                    .collect();
                // bf16: q rounded to bf16 for the dot-product path; the tolerance covers it.
                let bf = T::DTYPE == DType::BF16;
                // Scores with q as rows, and transposed (f32, and bf16 pairs where the dtype
                // has them): the outer-product kernels on AVX-512; other ISAs ignore it.
                let qt = QTrans::build(q, None, (1, rows, kr.d, dpad));
                let qtp = QTrans::build(q, bf.then_some(&pairs[..]), (1, rows, kr.d, dpad));
                // and in 4-row blocks of bf16 pairs (d a multiple of 16).
                let qtq = (bf && kr.d.is_multiple_of(16))
                    .then(|| QTrans::quads(&pairs, (1, rows, kr.d, dpad)));
                let quads = qtq.as_ref().map(|b| b.group(0));
                // and, for AVX2 with bf16 keys, in even-odd order (other ISAs ignore it;
                // AVX2 takes the portable kernel for bf16 keys without it).
                let qeo =
                    QTrans::for_item(DecodeKernels::Avx2, q, (None, bf), (1, rows, kr.d, dpad));
                let eo = qeo.as_ref().map(|b| b.group(0));
                for t in [None, Some(qt.group(0)), Some(qtp.group(0)), quads, eo] {
                    let qr = QRows {
                        f32: q,
                        bf16_pairs: bf.then_some(&pairs[..]),
                        rows,
                        dpad,
                        t,
                    };
                    let mut st = vec![f32::NAN; kr.cols() * np];
                    scores(kern.decode, qr, &src, kr, &mut st, np, &mut Ahead::none());
                    let what = format!(
                        "{isa:?} {} rows {rows} cols {} d {} q {}",
                        T::DTYPE,
                        kr.cols(),
                        kr.d,
                        match t {
                            None => "as rows",
                            Some(QTrans::F32 { .. }) => "transposed, f32",
                            Some(QTrans::Pairs { .. }) => "transposed, bf16 pairs",
                            Some(QTrans::Quads { .. }) => "bf16 pairs in blocks of 4 rows",
                            Some(QTrans::EvenOdd { .. }) => "even-odd order",
                        }
                    );
                    for c in 0..kr.cols() {
                        for r in 0..np {
                            let got = st[c * np + r] as f64;
                            if r >= rows {
                                // Lanes past `rows` belong to other kv heads: untouched.
                                assert!(got.is_nan(), "{what}: st[{c}][{r}] written");
                                continue;
                            }
                            let want: f64 =
                                (0..kr.d).map(|x| q[r * dpad + x] as f64 * val(c, x)).sum();
                            let tol = if bf {
                                1e-2 * (kr.d as f64).sqrt()
                            } else {
                                1e-5
                            };
                            assert!(
                                (got - want).abs() <= tol * (1.0 + want.abs()),
                                "{what}: st[{c}][{r}] = {got}, want {want}"
                            );
                        }
                    }
                }
                // bf16 on a CPU with the bf16 dot product: p as bf16 pairs, as the decode
                // loop passes them; the f64 sums below round p the same way.
                let dot = bf && isa.has_bf16_dot();
                let mut pairs = vec![0u32; kr.cols().div_ceil(2) * np];
                kern.pack_pairs_bf16(p, kr.cols(), np, &mut pairs);
                let pr = PRows {
                    f32: p,
                    bf16_pairs: dot.then_some(&pairs[..]),
                    rows,
                    np,
                };
                let mut acc = vec![0.5f32; rows * dpad];
                pv_acc(
                    kern.decode,
                    pr,
                    &src,
                    kr,
                    &mut acc,
                    dpad,
                    &mut Ahead::none(),
                );
                // The AVX2 kernels keep bf16 rows of acc in even-odd order, as the decode loop
                // puts them back at the end of an item.
                if acc_in_even_odd_order::<T>(kern.decode) {
                    for r in 0..rows {
                        acc_to_dim_order(&mut acc[r * dpad..r * dpad + kr.d]);
                    }
                }
                // p as the kernel multiplies it: rounded to bf16 on the pair path, except
                // an odd last key, which takes the f32 path.
                let p_used = |c: usize, r: usize| {
                    let x = p[c * np + r];
                    if dot && kr.d >= 32 && (c + 1 < kr.cols() || kr.cols().is_multiple_of(2)) {
                        bf16::from_f32(x).to_f64()
                    } else {
                        x as f64
                    }
                };
                let what = format!(
                    "{isa:?} {} rows {rows} cols {} d {}",
                    T::DTYPE,
                    kr.cols(),
                    kr.d
                );
                for r in 0..rows {
                    for x in 0..kr.d {
                        let want: f64 = 0.5
                            + (0..kr.cols())
                                .map(|c| {
                                    // dims past the last whole 32 take the f32 path
                                    let pc = if x < kr.d / 32 * 32 {
                                        p_used(c, r)
                                    } else {
                                        p[c * np + r] as f64
                                    };
                                    pc * val(c, x)
                                })
                                .sum::<f64>();
                        let got = acc[r * dpad + x] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{what}: acc[{r}][{x}] = {got}, want {want}"
                        );
                    }
                }
            }
            let ops = (&q[..], rows, dpad, np);
            check::<f32>(isa, ops, &kv, kr, &p);
            check::<f16>(isa, ops, &kv, kr, &p);
            check::<bf16>(isa, ops, &kv, kr, &p);
        }
    }
}

#[test]
fn merge_row_rules() {
    let d = 2;
    let mut dst = vec![f32::NAN; d];
    // All -inf: 0 and -inf, NaN in a skipped partial does not leak.
    let l = merge_row(&[f32::NEG_INFINITY; 2], &[f32::NAN; 4], d, &mut dst);
    assert_eq!((l, dst.clone()), (f32::NEG_INFINITY, vec![0.0, 0.0]));
    // One finite split is copied exactly.
    let l = merge_row(
        &[f32::NEG_INFINITY, 0.3],
        &[f32::NAN, f32::NAN, 0.7, -1.1],
        d,
        &mut dst,
    );
    assert_eq!((l, dst.clone()), (0.3, vec![0.7, -1.1]));
    // Two equal halves: lse + ln 2, the mean of the outs.
    let l = merge_row(&[1.0, 1.0], &[1.0, 2.0, 3.0, 4.0], d, &mut dst);
    assert!((l - (1.0 + 2f32.ln())).abs() < 1e-6);
    assert!((dst[0] - 2.0).abs() < 1e-6 && (dst[1] - 3.0).abs() < 1e-6);
}

/// The kernels' bound check covers every key's row, not only the first or last one.
#[test]
fn key_rows_check_every_row() {
    let rows = |keys: &'static [usize]| KeyRows::new(keys, 8, 16);
    rows(&[40, 0, 16]).check(64);
    let caught =
        |keys: &'static [usize]| std::panic::catch_unwind(|| rows(keys).check(64)).is_err();
    assert!(caught(&[0, 41, 16]));
    assert!(caught(&[41, 0, 16]));
    assert!(caught(&[0, 16, usize::MAX - 4]));
    // A sub-range is checked against its tile's bound (conservative, never laxer).
    let sub = |keys: &'static [usize]| rows(keys).sub(0, 1, 8);
    assert!(std::panic::catch_unwind(|| sub(&[0, 41]).check(64)).is_err());
    sub(&[0, 40]).check(64);
}

#[test]
fn sub_block_rule() {
    // f32, 8 kv heads: d = 128 -> 8 keys, d = 256 -> 4; bf16 at d = 128 -> the whole tile.
    assert_eq!(sub_block_keys(8 * 128 * 4), 8);
    assert_eq!(sub_block_keys(8 * 256 * 4), 4);
    assert_eq!(sub_block_keys(8 * 128 * 2), TILE_KEYS);
    assert_eq!(sub_block_keys(3 * 256 * 4), 8);
    assert_eq!(sub_block_keys(1), TILE_KEYS);
    assert_eq!(sub_block_keys(1 << 20), 4);
    for b in 1..20_000 {
        let s = sub_block_keys(b);
        assert!(s.is_power_of_two() && (4..=TILE_KEYS).contains(&s) && TILE_KEYS.is_multiple_of(s));
    }
}

#[test]
fn split_count_rule() {
    assert_eq!(choose_splits(1, 32768, 2), 8);
    assert_eq!(choose_splits(64, 32768, 2), 1);
    assert_eq!(choose_splits(1, 100, 2), 1);
    assert_eq!(choose_splits(1, 128, 2), 2);
    assert_eq!(choose_splits(1, 511, 2), 2);
    assert_eq!(choose_splits(1, 1024, 2), 2);
    assert_eq!(choose_splits(1, 512, 8), 8);
    assert_eq!(choose_splits(3, 512, 8), 3);
    assert_eq!(choose_splits(2, 4096, 2), 4);
    assert_eq!(choose_splits(1, 32768, 1), 1);
    assert_eq!(choose_splits(1, 1 << 20, 64), 128);
}

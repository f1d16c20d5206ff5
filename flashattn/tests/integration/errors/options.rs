//! The options: window, softcap, scale and ALiBi slopes.

use super::*;

#[test]
fn window() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    for (l, r) in [(-2i64, -1i64), (0, -2), (-5, 3), (i64::MIN, 0), (-2, -2)] {
        for causal in [false, true] {
            let opts = AttnOptions::default().window(l, r).causal(causal);
            let e = batched_err(&q, &k, &k, &opts);
            assert_eq!(e.kind(), &ErrorKind::Window { left: l, right: r });
            assert_names(&e, &format!("window ({l}, {r})"));
        }
    }
    let (q3, k3) = (
        TensorRef::contiguous(&data, &[SQ, H, D]),
        TensorRef::contiguous(&data, &[SK, HKV, D]),
    );
    let e = varlen_err(
        &q3,
        &k3,
        &k3,
        &[0, 5],
        &[0, 7],
        &AttnOptions::default().window(-3, 0),
    );
    assert_eq!(e.kind(), &ErrorKind::Window { left: -3, right: 0 });
}

#[test]
fn softcap() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    for cap in [
        0.0f32,
        -0.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::MIN_POSITIVE,
        // softcap · log2(e) overflows f32 (this one was accepted and gave NaN everywhere).
        f32::MAX,
        // softmax_scale / softcap (1/√8 / 1e38) is below f32's smallest normal number.
        1e38,
    ] {
        let e = batched_err(&q, &k, &k, &AttnOptions::default().softcap(cap));
        match e.kind() {
            ErrorKind::Softcap { softcap } => {
                assert!(
                    softcap.to_bits() == cap.to_bits(),
                    "carried {softcap}, passed {cap}"
                )
            }
            other => panic!("softcap {cap}: {other:?}"),
        }
        assert_names(&e, "softcap");
    }
    // The smallest positive softcap is valid, and so is one of 1e37 (no cap in effect), which
    // gives the uncapped result up to rounding (its scores take a few more roundings).
    for cap in [f32::MIN_POSITIVE, 1e37] {
        let o = flash_attn(&q, &k, &k, &AttnOptions::default().softcap(cap)).unwrap();
        assert!(
            o.out.to_f64_vec().iter().all(|x| x.is_finite()),
            "softcap {cap}"
        );
    }
    let plain = flash_attn(&q, &k, &k, &AttnOptions::default()).unwrap();
    let huge = flash_attn(&q, &k, &k, &AttnOptions::default().softcap(1e37)).unwrap();
    let (a, b) = (plain.out.to_f64_vec(), huge.out.to_f64_vec());
    assert!(
        a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-6),
        "softcap 1e37"
    );
}

#[test]
fn scale() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    // f32::MAX: softmax_scale · log2(e) overflows (it was accepted and gave NaN).
    for s in [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
    ] {
        let e = batched_err(&q, &k, &k, &AttnOptions::default().softmax_scale(s));
        match e.kind() {
            ErrorKind::Scale { scale } => assert!(
                scale.to_bits() == s.to_bits(),
                "carried {scale}, passed {s}"
            ),
            other => panic!("scale {s}: {other:?}"),
        }
        assert_names(&e, "softmax_scale");
        let (q3, k3) = (
            TensorRef::contiguous(&data, &[SQ, H, D]),
            TensorRef::contiguous(&data, &[SK, HKV, D]),
        );
        let e = varlen_err(
            &q3,
            &k3,
            &k3,
            &[0, 5],
            &[0, 7],
            &AttnOptions::default().softmax_scale(s),
        );
        assert!(matches!(e.kind(), ErrorKind::Scale { .. }));
    }
    // Zero and negative scales are finite, hence valid.
    for s in [0.0f32, -1.0] {
        assert!(flash_attn(&q, &k, &k, &AttnOptions::default().softmax_scale(s)).is_ok());
    }
}

#[test]
fn alibi_shape() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    let slopes = [0.25f32; 64];
    for shape in [
        vec![H + 1],
        vec![H - 1],
        vec![B + 1, H],
        vec![B, H + 1],
        vec![1, B, H],
        vec![],
        vec![H, B],
    ] {
        let n: usize = shape.iter().product();
        let opts = AttnOptions::default().alibi_slopes(TensorRef::contiguous(&slopes[..n], &shape));
        let e = batched_err(&q, &k, &k, &opts);
        assert_eq!(
            e.kind(),
            &ErrorKind::AlibiShape {
                got: shape.clone(),
                batch: B,
                heads: H
            }
        );
        assert_names(&e, "alibi_slopes");
        assert_names(&e, &format!("[{H}] or [{B}, {H}]"));
    }
    // Packed: batch is the number of sequences.
    let (q3, k3) = (
        TensorRef::contiguous(&data, &[SQ, H, D]),
        TensorRef::contiguous(&data, &[SK, HKV, D]),
    );
    let opts =
        AttnOptions::default().alibi_slopes(TensorRef::contiguous(&slopes[..2 * H], &[2, H]));
    let e = varlen_err(&q3, &k3, &k3, &[0, 1, 2, 5], &[0, 3, 3, 7], &opts);
    assert_eq!(
        e.kind(),
        &ErrorKind::AlibiShape {
            got: vec![2, H],
            batch: 3,
            heads: H
        }
    );
}

#[test]
fn alibi_dtype() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    let s16 = [f16::from_f32(0.25); H];
    let e = batched_err(
        &q,
        &k,
        &k,
        &AttnOptions::default().alibi_slopes(TensorRef::contiguous(&s16, &[H])),
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::DType {
            tensor: "alibi_slopes",
            expected: DType::F32,
            got: DType::F16
        }
    );
    assert_names(&e, "`alibi_slopes`");
    // f32 slopes are required even when q, k and v are bf16.
    let qb: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
    let (q, k) = (
        TensorRef::contiguous(&qb, &qshape()),
        TensorRef::contiguous(&qb, &kshape()),
    );
    let sb = [bf16::from_f32(0.25); H];
    let e = batched_err(
        &q,
        &k,
        &k,
        &AttnOptions::default().alibi_slopes(TensorRef::contiguous(&sb, &[H])),
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::DType {
            tensor: "alibi_slopes",
            expected: DType::F32,
            got: DType::BF16
        }
    );
}

/// A slope that is NaN or infinite (found by `properties::changed_calls_fail_cleanly`: a NaN slope
/// was accepted and made its head's output NaN).
#[test]
fn alibi_slope_value() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut s = [0.25f32; B * H];
        s[H + 2] = bad;
        let e = batched_err(
            &q,
            &k,
            &k,
            &AttnOptions::default().alibi_slopes(TensorRef::contiguous(&s, &[B, H])),
        );
        assert_eq!(
            format!("{:?}", e.kind()),
            format!(
                "{:?}",
                ErrorKind::AlibiSlope {
                    batch: 1,
                    head: 2,
                    slope: bad,
                    max_distance: SK - 1
                }
            )
        );
        assert_names(&e, "alibi_slopes");
    }
}

/// A finite slope whose bias overflows f32 at the farthest key (|i + SK - SQ - j| reaches SK - 1
/// = 6 here) is refused on both signs: a +inf bias made the softmax NaN, and a -inf one hides
/// keys. Slopes just inside the range are accepted, give no NaN, and match the f64 reference
/// (batched and packed): the farthest key (negative slopes) or the nearest (positive) takes all
/// the weight.
#[test]
fn alibi_bias_range() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    let (q3, k3) = (
        TensorRef::contiguous(&data, &[B * SQ, H, D]),
        TensorRef::contiguous(&data, &[B * SK, HKV, D]),
    );
    let (cq, ck) = ([0, SQ as i32, 2 * SQ as i32], [0, SK as i32, 2 * SK as i32]);
    // slope · log2(e) · 6 overflows from |slope| ≈ 3.93e37 on.
    for bad in [-1e38f32, -4e37, 4e37, 1e38, f32::MAX / 2.0] {
        let mut s = [0.25f32; B * H];
        s[3] = bad;
        let opts = AttnOptions::default().alibi_slopes(TensorRef::contiguous(&s, &[B, H]));
        let want = format!(
            "{:?}",
            ErrorKind::AlibiSlope {
                batch: 0,
                head: 3,
                slope: bad,
                max_distance: SK - 1
            }
        );
        let e = batched_err(&q, &k, &k, &opts);
        assert_eq!(format!("{:?}", e.kind()), want);
        assert_names(&e, "alibi_slopes");
        let e = flash_attn_varlen(&q3, &k3, &k3, &cq, &ck, &opts).unwrap_err();
        assert_eq!(format!("{:?}", e.kind()), want);
    }
    for good in [-3.9e37f32, -1e30, 1e30, 3.9e37] {
        let mut s = [0.25f32; B * H];
        s[3] = good;
        let opts = AttnOptions::default().alibi_slopes(TensorRef::contiguous(&s, &[B, H]));
        let got = flash_attn(&q, &k, &k, &opts).unwrap();
        let packed = flash_attn_varlen(&q3, &k3, &k3, &cq, &ck, &opts).unwrap();
        let want = reference::attention(&q, &k, &k, &opts).unwrap();
        for (name, o) in [("batched", &got), ("packed", &packed)] {
            let out = o.out.to_f64_vec();
            assert!(out.iter().all(|x| x.is_finite()), "{name}, slope {good}");
            assert!(o.lse.to_f64_vec().iter().all(|x| !x.is_nan()), "{name}");
            let err = out
                .iter()
                .zip(&want.out)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(err < 1e-5, "{name}, slope {good}: max error {err}");
        }
    }
}

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
        let e = flash_attn(&q3, &k3, &k3, &opts.clone().varlen(&cq, &ck)).unwrap_err();
        assert_eq!(format!("{:?}", e.kind()), want);
    }
    for good in [-3.9e37f32, -1e30, 1e30, 3.9e37] {
        let mut s = [0.25f32; B * H];
        s[3] = good;
        let opts = AttnOptions::default().alibi_slopes(TensorRef::contiguous(&s, &[B, H]));
        let got = flash_attn(&q, &k, &k, &opts).unwrap();
        let packed = flash_attn(&q3, &k3, &k3, &opts.clone().varlen(&cq, &ck)).unwrap();
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

/// FP8 descale factors on a call whose inputs are not FP8 (forward, its `_into` form, backward,
/// decode): `DescaleNotFp8`, before anything is written.
#[test]
fn descale_on_a_non_fp8_call_is_refused() {
    use flashattn::fp8::Descale;
    use flashattn::{
        flash_attn_backward, flash_attn_into, flash_attn_with_kvcache, KvCacheOptions, OutBuffers,
        SliceMut, TensorMut,
    };
    let (b, s, h, d) = (1, 4, 2, 8);
    let x: Vec<f32> = (0..b * s * h * d).map(|i| (i as f32 * 0.3).sin()).collect();
    let t = TensorRef::contiguous(&x, &[b, s, h, d]);
    let one = [1.0f32];
    let plain = AttnOptions::default();
    let opts = plain.clone().descale(Descale::default().k(&one));
    let fwd = flash_attn(&t, &t, &t, &plain).unwrap();
    let (o, l) = (fwd.out.view(), fwd.lse.view());
    let (mut out, mut lse) = (vec![7.0f32; x.len()], vec![7.0f32; b * h * s]);
    let dst = OutBuffers {
        out: SliceMut::F32(&mut out),
        lse: &mut lse,
    };
    let errs = [
        ("flash_attn", flash_attn(&t, &t, &t, &opts).map(drop)),
        ("flash_attn_into", flash_attn_into(&t, &t, &t, &opts, dst)),
        (
            "flash_attn_backward",
            flash_attn_backward(&t, &t, &t, &o, &l, &t, &opts).map(drop),
        ),
    ];
    for (call, r) in errs {
        let e = r.expect_err(call);
        assert_eq!(e.kind(), &ErrorKind::DescaleNotFp8, "{call}");
        assert!(e.to_string().contains("not FP8"), "{call}: {e}");
    }
    assert!(
        out.iter().chain(&lse).all(|&v| v == 7.0),
        "written on error"
    );

    // Decode with a key to append: refused, the caches untouched.
    let cap = 8;
    let kn = TensorRef::contiguous(&x[..h * d], &[b, 1, h, d]);
    let mut kc = vec![7.0f32; b * cap * h * d];
    let mut vc = kc.clone();
    let shape = [b, cap, h, d];
    let ko = KvCacheOptions::default()
        .attn(opts.clone())
        .new_kv(kn.clone(), kn.clone());
    let e = flash_attn_with_kvcache(
        &t,
        &mut TensorMut::contiguous(&mut kc[..], &shape),
        &mut TensorMut::contiguous(&mut vc[..], &shape),
        &[2],
        &ko,
    )
    .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::DescaleNotFp8);
    assert!(
        kc.iter().chain(&vc).all(|&v| v == 7.0),
        "cache written on error"
    );
}

/// The packed layout is one option: given to a decode call (whose packed queries are
/// `KvCacheOptions::cu_seqlens_q`, so the layout would be given twice) it is `VarlenInDecode`,
/// on f32 and FP8 caches alike; given with batched tensors, or packed tensors without it, the
/// tensors' rank names the mismatch.
#[test]
fn varlen_given_twice_or_against_the_tensors_is_refused() {
    use flashattn::fp8::{flash_attn_with_kvcache_fp8, Fp8TensorMut, F8E4M3};
    use flashattn::{flash_attn_with_kvcache, KvCacheOptions, TensorMut};
    let (b, s, h, d) = (1, 4, 2, 8);
    let x: Vec<f32> = (0..b * s * h * d).map(|i| (i as f32 * 0.3).cos()).collect();
    let cu = [0, s as i32];
    let cap = 8;
    let shape = [b, cap, h, d];
    let q3 = TensorRef::contiguous(&x, &[b * s, h, d]);
    for twice in [false, true] {
        let mut ko = KvCacheOptions::default().attn(AttnOptions::default().varlen(&cu, &cu));
        if twice {
            ko = ko.cu_seqlens_q(&cu);
        }
        let mut kc = vec![0.5f32; b * cap * h * d];
        let mut vc = kc.clone();
        let e = flash_attn_with_kvcache(
            &q3,
            &mut TensorMut::contiguous(&mut kc[..], &shape),
            &mut TensorMut::contiguous(&mut vc[..], &shape),
            &[3],
            &ko,
        )
        .unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::VarlenInDecode, "twice: {twice}");
        assert!(e.to_string().contains("cu_seqlens_q"), "{e}");
        let mut k8 = vec![F8E4M3::from_f32(0.5); b * cap * h * d];
        let mut v8 = k8.clone();
        let e = flash_attn_with_kvcache_fp8(
            &q3,
            &mut Fp8TensorMut::contiguous(&mut k8, &shape),
            &mut Fp8TensorMut::contiguous(&mut v8, &shape),
            &[3],
            &ko,
        )
        .unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::VarlenInDecode, "fp8, twice: {twice}");
    }
    // Batched tensors with the packed layout, and packed tensors without it.
    let q4 = TensorRef::contiguous(&x, &[b, s, h, d]);
    let e = flash_attn(&q4, &q4, &q4, &AttnOptions::default().varlen(&cu, &cu)).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Rank {
                tensor: "q",
                expected: 3,
                got: 4,
                ..
            }
        ),
        "{e}"
    );
    let e = flash_attn(&q3, &q3, &q3, &AttnOptions::default()).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Rank {
                tensor: "q",
                expected: 4,
                got: 3,
                ..
            }
        ),
        "{e}"
    );
}

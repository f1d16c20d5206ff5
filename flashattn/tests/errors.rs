//! Input validation: one test per `ErrorKind`, each asserting the exact variant and the values it
//! carries, that the message names the offending tensor (or option), that nothing panics, and that
//! `naive::` and `reference::` validate the same way as `flash_attn`.

mod common;

use flashattn::{
    flash_attn, flash_attn_varlen, merge_attn_partials, naive, reference, AttnOptions,
    CuSeqlensProblem, DType, Error, ErrorKind, TensorRef,
};
use half::{bf16, f16};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Calls every batched entry point; each must return `Err` (not panic, not `Ok`), all the same one.
fn batched_err(q: &TensorRef, k: &TensorRef, v: &TensorRef, opts: &AttnOptions) -> Error {
    let run = |name: &str, f: &dyn Fn() -> Result<(), Error>| -> Error {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Err(e)) => e,
            Ok(Ok(())) => panic!("{name} accepted an invalid input"),
            Err(_) => panic!("{name} panicked instead of returning an error"),
        }
    };
    let flash = run("flash_attn", &|| flash_attn(q, k, v, opts).map(drop));
    let nv = run("naive::attention", &|| {
        naive::attention(q, k, v, opts).map(drop)
    });
    let r = run("reference::attention", &|| {
        reference::attention(q, k, v, opts).map(drop)
    });
    let row = run("reference::attention_row", &|| {
        reference::attention_row(q, k, v, opts, 0, 0, 0).map(drop)
    });
    // Compared through Debug: NaN-carrying kinds (softcap, scale) are never `==`.
    let same = |a: &Error, b: &Error| format!("{a:?}") == format!("{b:?}");
    assert!(
        same(&flash, &nv),
        "naive validates differently: {nv:?} vs {flash:?}"
    );
    assert!(
        same(&flash, &r),
        "reference validates differently: {r:?} vs {flash:?}"
    );
    assert!(
        same(&flash, &row),
        "reference::attention_row validates differently: {row:?} vs {flash:?}"
    );
    flash
}

/// As [`batched_err`], for the packed entry points.
fn varlen_err(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cq: &[i32],
    ck: &[i32],
    opts: &AttnOptions,
) -> Error {
    let run = |name: &str, f: &dyn Fn() -> Result<(), Error>| -> Error {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Err(e)) => e,
            Ok(Ok(())) => panic!("{name} accepted an invalid input"),
            Err(_) => panic!("{name} panicked instead of returning an error"),
        }
    };
    let flash = run("flash_attn_varlen", &|| {
        flash_attn_varlen(q, k, v, cq, ck, opts).map(drop)
    });
    let nv = run("naive::attention_varlen", &|| {
        naive::attention_varlen(q, k, v, cq, ck, opts).map(drop)
    });
    let r = run("reference::attention_varlen", &|| {
        reference::attention_varlen(q, k, v, cq, ck, opts).map(drop)
    });
    let same = |a: &Error, b: &Error| format!("{a:?}") == format!("{b:?}");
    assert!(
        same(&flash, &nv),
        "naive validates differently: {nv:?} vs {flash:?}"
    );
    assert!(
        same(&flash, &r),
        "reference validates differently: {r:?} vs {flash:?}"
    );
    flash
}

/// The message contains `needle` (a tensor name in backticks, or an option name).
fn assert_names(e: &Error, needle: &str) {
    let msg = e.to_string();
    assert!(
        msg.contains(needle),
        "message {msg:?} does not name {needle:?}"
    );
    // Display of the error and of its kind agree, and the error is a std error.
    assert_eq!(msg, e.kind().to_string());
    let _: &dyn std::error::Error = e;
}

const B: usize = 2;
const SQ: usize = 5;
const SK: usize = 7;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const BATCHED: &str = "[batch, seqlen, heads, head_dim]";
const PACKED: &str = "[total_tokens, heads, head_dim]";

/// Buffers large enough for every valid shape used here.
fn buf() -> Vec<f32> {
    (0..4096).map(|i| (i as f32 * 0.37).sin()).collect()
}

fn qshape() -> [usize; 4] {
    [B, SQ, H, D]
}
fn kshape() -> [usize; 4] {
    [B, SK, HKV, D]
}

#[test]
fn valid_inputs_are_accepted() {
    // The baseline every other test perturbs.
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    assert!(flash_attn(&q, &k, &k, &AttnOptions::default()).is_ok());
    let q3 = TensorRef::contiguous(&data, &[SQ, H, D]);
    let k3 = TensorRef::contiguous(&data, &[SK, HKV, D]);
    assert!(flash_attn_varlen(
        &q3,
        &k3,
        &k3,
        &[0, 2, 5],
        &[0, 7, 7],
        &AttnOptions::default()
    )
    .is_ok());
}

#[test]
fn rank() {
    let data = buf();
    let k = TensorRef::contiguous(&data, &kshape());
    let q3 = TensorRef::contiguous(&data, &[B, SQ, H * D]);
    let e = batched_err(&q3, &k, &k, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::Rank {
            tensor: "q",
            expected: 4,
            got: 3,
            layout: BATCHED
        }
    );
    assert_names(&e, "`q`");

    let q = TensorRef::contiguous(&data, &qshape());
    let v5 = TensorRef::contiguous(&data, &[B, SK, HKV, D, 1]);
    let e = batched_err(&q, &k, &v5, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::Rank {
            tensor: "v",
            expected: 4,
            got: 5,
            layout: BATCHED
        }
    );
    assert_names(&e, "`v`");

    // Packed layout: rank 3 expected.
    let k3 = TensorRef::contiguous(&data, &[SK, HKV, D]);
    let e = varlen_err(
        &k3,
        &q,
        &k3,
        &[0, SK as i32],
        &[0, SK as i32],
        &AttnOptions::default(),
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::Rank {
            tensor: "k",
            expected: 3,
            got: 4,
            layout: PACKED
        }
    );
    assert_names(&e, "`k`");
}

#[test]
fn strides_rank() {
    let data = buf();
    let k = TensorRef::contiguous(&data, &kshape());
    let q = TensorRef::new(&data, &qshape(), &[SQ * H * D, H * D, 1]);
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::StridesRank {
            tensor: "q",
            dims: 4,
            strides: 3
        }
    );
    assert_names(&e, "`q`");

    let q = TensorRef::contiguous(&data, &qshape());
    let k5 = TensorRef::new(&data, &kshape(), &[0, 0, 0, 0, 1]);
    let e = batched_err(&q, &k5, &k, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::StridesRank {
            tensor: "k",
            dims: 4,
            strides: 5
        }
    );
    assert_names(&e, "`k`");
}

#[test]
fn shape() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    // v differs from k in seqlen.
    let v = TensorRef::contiguous(&data, &[B, SK + 1, HKV, D]);
    let e = batched_err(&q, &k, &v, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::Shape {
            tensor: "v",
            expected: kshape().to_vec(),
            got: vec![B, SK + 1, HKV, D]
        }
    );
    assert_names(&e, "`v`");
    // v differs from k in heads.
    let v = TensorRef::contiguous(&data, &[B, SK, HKV + 2, D]);
    let e = batched_err(&q, &k, &v, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::Shape {
            tensor: "v",
            expected: kshape().to_vec(),
            got: vec![B, SK, HKV + 2, D]
        }
    );
    // k's head_dim differs from q's.
    let k2 = TensorRef::contiguous(&data, &[B, SK, HKV, D + 1]);
    let e = batched_err(&q, &k2, &k2, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::Shape {
            tensor: "k",
            expected: kshape().to_vec(),
            got: vec![B, SK, HKV, D + 1]
        }
    );
    assert_names(&e, "`k`");
    // k's batch differs from q's.
    let k3 = TensorRef::contiguous(&data, &[B + 1, SK, HKV, D]);
    let e = batched_err(&q, &k3, &k3, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::Shape {
            tensor: "k",
            expected: kshape().to_vec(),
            got: vec![B + 1, SK, HKV, D]
        }
    );
    // Packed: v's token count differs from k's.
    let (q, k, v) = (
        TensorRef::contiguous(&data, &[SQ, H, D]),
        TensorRef::contiguous(&data, &[SK, HKV, D]),
        TensorRef::contiguous(&data, &[SK - 1, HKV, D]),
    );
    let e = varlen_err(&q, &k, &v, &[0, 5], &[0, 6], &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::Shape {
            tensor: "v",
            expected: vec![SK, HKV, D],
            got: vec![SK - 1, HKV, D]
        }
    );
}

#[test]
fn dtype() {
    let data = buf();
    let halves: Vec<f16> = data.iter().map(|&x| f16::from_f32(x)).collect();
    let bhalves: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    let k16 = TensorRef::contiguous(&halves, &kshape());
    let vb16 = TensorRef::contiguous(&bhalves, &kshape());
    let e = batched_err(&q, &k16, &k, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::DType {
            tensor: "k",
            expected: DType::F32,
            got: DType::F16
        }
    );
    assert_names(&e, "`k`");
    let e = batched_err(&q, &k, &vb16, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::DType {
            tensor: "v",
            expected: DType::F32,
            got: DType::BF16
        }
    );
    assert_names(&e, "`v`");
    let q16 = TensorRef::contiguous(&halves, &qshape());
    let e = batched_err(&q16, &k16, &vb16, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::DType {
            tensor: "v",
            expected: DType::F16,
            got: DType::BF16
        }
    );
    assert!(e.to_string().contains("bf16") && e.to_string().contains("f16"));
}

#[test]
fn head_dim() {
    let data = buf();
    for d in [0usize, 257, 512] {
        let q = TensorRef::contiguous(&data, &[1, 2, 1, d]);
        let k = TensorRef::contiguous(&data, &[1, 3, 1, d]);
        let e = batched_err(&q, &k, &k, &AttnOptions::default());
        assert_eq!(
            e.kind(),
            &ErrorKind::HeadDim {
                tensor: "q",
                head_dim: d
            }
        );
        assert_names(&e, "`q`");
        assert!(e.to_string().contains(&d.to_string()));
        let (q3, k3) = (
            TensorRef::contiguous(&data, &[2, 1, d]),
            TensorRef::contiguous(&data, &[3, 1, d]),
        );
        let e = varlen_err(&q3, &k3, &k3, &[0, 2], &[0, 3], &AttnOptions::default());
        assert_eq!(
            e.kind(),
            &ErrorKind::HeadDim {
                tensor: "q",
                head_dim: d
            }
        );
    }
    // 256 is the largest accepted.
    let q = TensorRef::contiguous(&data, &[1, 2, 1, 256]);
    assert!(flash_attn(&q, &q, &q, &AttnOptions::default()).is_ok());
}

#[test]
fn heads_not_multiple() {
    let data = buf();
    for (h, hkv) in [(6usize, 4usize), (3, 2), (4, 0), (0, 2), (2, 4)] {
        let q = TensorRef::contiguous(&data, &[1, 3, h, D]);
        let k = TensorRef::contiguous(&data, &[1, 5, hkv, D]);
        let e = batched_err(&q, &k, &k, &AttnOptions::default());
        assert_eq!(
            e.kind(),
            &ErrorKind::HeadsNotMultiple {
                heads: h,
                heads_kv: hkv
            },
            "{h}/{hkv}"
        );
        assert_names(&e, &format!("heads ({h})"));
        assert_names(&e, &format!("heads_kv ({hkv})"));
        let (q3, k3) = (
            TensorRef::contiguous(&data, &[3, h, D]),
            TensorRef::contiguous(&data, &[5, hkv, D]),
        );
        let e = varlen_err(&q3, &k3, &k3, &[0, 3], &[0, 5], &AttnOptions::default());
        assert_eq!(
            e.kind(),
            &ErrorKind::HeadsNotMultiple {
                heads: h,
                heads_kv: hkv
            }
        );
    }
}

#[test]
fn last_dim_not_contiguous() {
    let data = buf();
    let k = TensorRef::contiguous(&data, &kshape());
    let q = TensorRef::new(&data, &qshape(), &[SQ * H * D * 2, H * D * 2, D * 2, 2]);
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::LastDimNotContiguous {
            tensor: "q",
            stride: 2
        }
    );
    assert_names(&e, "`q`");
    let q = TensorRef::contiguous(&data, &qshape());
    let v = TensorRef::new(&data, &kshape(), &[SK * HKV * D, HKV * D, D, 0]);
    let e = batched_err(&q, &k, &v, &AttnOptions::default());
    assert_eq!(
        e.kind(),
        &ErrorKind::LastDimNotContiguous {
            tensor: "v",
            stride: 0
        }
    );
    assert_names(&e, "`v`");
    // Alibi slopes `[heads]` are checked too.
    let slopes = [0.5f32; 2 * H];
    let opts = AttnOptions::default().alibi_slopes(TensorRef::new(&slopes, &[H], &[2]));
    let e = batched_err(&q, &k, &k, &opts);
    assert_eq!(
        e.kind(),
        &ErrorKind::LastDimNotContiguous {
            tensor: "alibi_slopes",
            stride: 2
        }
    );
    assert_names(&e, "`alibi_slopes`");
}

#[test]
fn out_of_bounds() {
    let data = buf();
    let k = TensorRef::contiguous(&data, &kshape());
    let n = B * SQ * H * D;
    // One element short.
    let q = TensorRef::contiguous(&data[..n - 1], &qshape());
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    let strides = vec![SQ * H * D, H * D, D, 1];
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfBounds {
            tensor: "q",
            shape: qshape().to_vec(),
            strides: strides.clone(),
            needed: n as u128,
            len: n - 1
        }
    );
    assert_names(&e, "`q`");
    // Padding between rows makes the view longer than its buffer.
    let q = TensorRef::new(&data[..n], &qshape(), &[SQ * (H * D + 3), H * D + 3, D, 1]);
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    let needed = ((B - 1) * SQ * (H * D + 3) + (SQ - 1) * (H * D + 3) + (H - 1) * D + D) as u128;
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds { tensor: "q", needed: got, len, .. } if *got == needed && *len == n)
    );
    // Huge strides whose products overflow usize (but not the u128 the check uses).
    let q = TensorRef::contiguous(&data, &qshape());
    let v = TensorRef::new(&data, &kshape(), &[usize::MAX, 1, 1, 1]);
    let e = batched_err(&q, &k, &v, &AttnOptions::default());
    let needed = (B as u128 - 1) * usize::MAX as u128 + (SK + HKV + D - 3) as u128 + 1;
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfBounds {
            tensor: "v",
            shape: kshape().to_vec(),
            strides: vec![usize::MAX, 1, 1, 1],
            needed,
            len: data.len()
        }
    );
    assert_names(&e, "`v`");
    assert!(e.to_string().contains(&needed.to_string()));
    let k = TensorRef::new(&data, &kshape(), &[1, usize::MAX / 2, 1, 1]);
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds { tensor: "k", .. }),
        "{e}"
    );
    // Packed layout and alibi slopes.
    let k3 = TensorRef::contiguous(&data[..SK * HKV * D - 1], &[SK, HKV, D]);
    let q3 = TensorRef::contiguous(&data, &[SQ, H, D]);
    let e = varlen_err(&q3, &k3, &k3, &[0, 5], &[0, 7], &AttnOptions::default());
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds { tensor: "k", len, .. } if *len == SK * HKV * D - 1),
        "{e}"
    );
    let slopes = [0.5f32; H];
    let k = TensorRef::contiguous(&data, &kshape());
    let opts = AttnOptions::default().alibi_slopes(TensorRef::new(&slopes, &[B, H], &[H, 1]));
    let q = TensorRef::contiguous(&data, &qshape());
    let e = batched_err(&q, &k, &k, &opts);
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfBounds {
            tensor: "alibi_slopes",
            shape: vec![B, H],
            strides: vec![H, 1],
            needed: (B * H) as u128,
            len: H
        }
    );
    assert_names(&e, "`alibi_slopes`");
}

/// The bounds check sums `(n - 1) · stride` over dimensions in u128, and its comment says that
/// "cannot overflow: at most 4 products of two 64-bit numbers" — but one such product can reach
/// ~2^128, so two of them overflow u128. With overflow checks (dev/test profile) `check_view`
/// panics with "attempt to add with overflow"; without them (release) the sum wraps and the view
/// can be accepted although it points far past its buffer.
#[test]
fn out_of_bounds_u128_overflow() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    // (MAX - 1) · MAX twice: ~2^129.
    let k = TensorRef::new(
        &data,
        &[B, usize::MAX, usize::MAX, 1],
        &[1, usize::MAX, usize::MAX, 1],
    );
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    assert!(
        matches!(
            e.kind(),
            ErrorKind::OutOfBounds { tensor: "k", .. } | ErrorKind::Shape { .. }
        ),
        "{e}"
    );
    // Wraps to 2^128 + 2 (needed = 3 <= len) in release: seqlen_k = MAX (stride MAX) and
    // heads_kv = 7 (stride 2^63) sum to (2^128 - 3·2^64 + 2) + 3·2^64.
    let q = TensorRef::contiguous(&data, &[1, 1, 7, 1]);
    let k = TensorRef::new(
        &data[..3],
        &[1, usize::MAX, 7, 1],
        &[1, usize::MAX, 1 << 63, 1],
    );
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds { tensor: "k", .. }),
        "{e}"
    );
}

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

/// Every `CuSeqlensProblem`, on both arrays.
#[test]
fn cu_seqlens() {
    let data = buf();
    let q = TensorRef::contiguous(&data, &[SQ, H, D]);
    let k = TensorRef::contiguous(&data, &[SK, HKV, D]);
    let o = AttnOptions::default();
    let cu = |tensor, problem| ErrorKind::CuSeqlens { tensor, problem };
    let cases: Vec<(&[i32], &[i32], ErrorKind)> = vec![
        // Length: the arrays differ, or cu_seqlens_q is empty.
        (
            &[0, 2, 5],
            &[0, 7],
            cu(
                "cu_seqlens_k",
                CuSeqlensProblem::Length {
                    expected: 3,
                    got: 2,
                },
            ),
        ),
        (
            &[0, 5],
            &[0, 3, 7],
            cu(
                "cu_seqlens_k",
                CuSeqlensProblem::Length {
                    expected: 2,
                    got: 3,
                },
            ),
        ),
        (
            &[],
            &[0, 7],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::Length {
                    expected: 1,
                    got: 0,
                },
            ),
        ),
        (
            &[],
            &[],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::Length {
                    expected: 1,
                    got: 0,
                },
            ),
        ),
        (
            &[0],
            &[],
            cu(
                "cu_seqlens_k",
                CuSeqlensProblem::Length {
                    expected: 1,
                    got: 0,
                },
            ),
        ),
        // Not starting at 0.
        (
            &[1, 5],
            &[0, 7],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::NotStartingAtZero { first: 1 },
            ),
        ),
        (
            &[0, 5],
            &[-1, 7],
            cu(
                "cu_seqlens_k",
                CuSeqlensProblem::NotStartingAtZero { first: -1 },
            ),
        ),
        (
            &[3],
            &[0],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::NotStartingAtZero { first: 3 },
            ),
        ),
        // Decreasing.
        (
            &[0, 4, 2, 5],
            &[0, 1, 2, 3],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::Decreasing {
                    index: 2,
                    previous: 4,
                    value: 2,
                },
            ),
        ),
        (
            &[0, 1, 2, 3],
            &[0, 6, 7, 6],
            cu(
                "cu_seqlens_k",
                CuSeqlensProblem::Decreasing {
                    index: 3,
                    previous: 7,
                    value: 6,
                },
            ),
        ),
        (
            &[0, -1],
            &[0, 1],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::Decreasing {
                    index: 1,
                    previous: 0,
                    value: -1,
                },
            ),
        ),
        // Past the packed tensor.
        (
            &[0, 6],
            &[0, 7],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::PastTensor { last: 6, total: SQ },
            ),
        ),
        (
            &[0, 2, 5],
            &[0, 4, 8],
            cu(
                "cu_seqlens_k",
                CuSeqlensProblem::PastTensor { last: 8, total: SK },
            ),
        ),
        (
            &[0, i32::MAX],
            &[0, 7],
            cu(
                "cu_seqlens_q",
                CuSeqlensProblem::PastTensor {
                    last: i32::MAX,
                    total: SQ,
                },
            ),
        ),
    ];
    for (cq, ck, want) in cases {
        let e = varlen_err(&q, &k, &k, cq, ck, &o);
        assert_eq!(e.kind(), &want, "cu_seqlens_q {cq:?}, cu_seqlens_k {ck:?}");
        let ErrorKind::CuSeqlens { tensor, .. } = want else {
            unreachable!()
        };
        assert_names(&e, &format!("`{tensor}`"));
    }
    // A single entry [0] is a valid empty batch: every q row is "after the last sequence".
    let r = flash_attn_varlen(&q, &k, &k, &[0], &[0], &o).unwrap();
    assert!(r.out.to_f64_vec().iter().all(|&x| x == 0.0));
    assert!(r.lse.to_f64_vec().iter().all(|&x| x == f64::NEG_INFINITY));
}

/// The output's element count overflows usize (with stride-0 views, q itself fits in 1 element).
#[test]
fn too_large() {
    let one = [0.5f32];
    let big = 1usize << 40;
    let q = TensorRef::new(&one, &[big, big, 1, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[big, 1, 1, 1], &[0, 0, 0, 1]);
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    assert_eq!(e.kind(), &ErrorKind::TooLarge { tensor: "out" });
    assert_names(&e, "`out`");
    // Packed: total_q · heads · head_dim overflows.
    let q3 = TensorRef::new(&one, &[big, big, 1], &[0, 0, 1]);
    let k3 = TensorRef::new(&one, &[1, 1, 1], &[0, 0, 1]);
    let e = varlen_err(&q3, &k3, &k3, &[0, 0], &[0, 1], &AttnOptions::default());
    assert_eq!(e.kind(), &ErrorKind::TooLarge { tensor: "out" });
}

/// The first problem found is reported: q before k before v, tensors before options.
#[test]
fn validation_order() {
    let data = buf();
    let q_bad = TensorRef::contiguous(&data, &[B, SQ, H]);
    let k_bad = TensorRef::contiguous(&data, &[B, SK, HKV]);
    let e = batched_err(
        &q_bad,
        &k_bad,
        &k_bad,
        &AttnOptions::default().window(-7, 0),
    );
    assert!(matches!(e.kind(), ErrorKind::Rank { tensor: "q", .. }));
    let q = TensorRef::contiguous(&data, &qshape());
    let e = batched_err(&q, &k_bad, &k_bad, &AttnOptions::default().softcap(-1.0));
    assert!(matches!(e.kind(), ErrorKind::Rank { tensor: "k", .. }));
}

/// A batched call whose output is empty (seqlen_q = 0) allocates nothing for `out` or `lse`, but
/// its per-sequence table has one entry per batch entry, and stride-0 views of one element can
/// ask for any batch. Past the address space the table is `TooLarge`; 2^52 entries (2^58 bytes,
/// more than any machine maps) used to abort the process in `collect` and is now
/// `OutOfMemory`, forward and backward.
#[test]
fn huge_batch_with_empty_output_is_a_typed_error() {
    let one = [0.5f32];
    let big = usize::MAX / 2;
    let q = TensorRef::new(&one, &[big, 0, 1, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[big, 1, 1, 1], &[0, 0, 0, 1]);
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    assert!(matches!(e.kind(), ErrorKind::TooLarge { .. }), "{e}");
    let batch = 1usize << 52;
    let q = TensorRef::new(&one, &[batch, 0, 1, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[batch, 1, 1, 1], &[0, 0, 0, 1]);
    let e = batched_err(&q, &k, &k, &AttnOptions::default());
    let table = ErrorKind::OutOfMemory {
        what: "the per-sequence table",
        bytes: batch * 64,
    };
    assert_eq!(e.kind(), &table);
    assert_names(&e, "per-sequence table");
    let lse = TensorRef::new(&one, &[batch, 1, 0], &[0, 0, 1]);
    let r = catch_unwind(|| {
        flashattn::flash_attn_backward(&q, &k, &k, &q, &lse, &q, &Default::default())
    });
    match r {
        Ok(Err(e)) => assert_eq!(e.kind(), &table),
        Ok(Ok(_)) => panic!("accepted"),
        Err(_) => panic!("flash_attn_backward panicked"),
    }
}

/// Results larger than any machine maps (2^60 bytes, within `isize::MAX`, so not `TooLarge`)
/// from stride-0 views of one element: `OutOfMemory` naming the result, where `vec!` would abort
/// the process.
#[test]
fn results_too_large_to_allocate_are_a_typed_error() {
    let one = [0.5f32];
    let rows = 1usize << 58;
    let q = TensorRef::new(&one, &[1, rows, 1, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[1, 1, 1, 1], &[0, 0, 0, 1]);
    let o = AttnOptions::default();
    let e = flash_attn(&q, &k, &k, &o).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "`out`",
            bytes: rows * 4
        }
    );
    assert_names(&e, "`out`");
    assert!(e.to_string().contains("out of memory"), "{e}");
    // The yardsticks too (the f64 reference's `out` takes 8 bytes an element).
    let e = naive::attention(&q, &k, &k, &o).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "`out`",
            bytes: rows * 4
        }
    );
    let e = reference::attention(&q, &k, &k, &o).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "`out`",
            bytes: rows * 8
        }
    );
    // The backward: `rows` heads of one row (lse's last dimension must be contiguous), where
    // the first to fail is the gather of lse, as large as dq here.
    let qh = TensorRef::new(&one, &[1, 1, rows, 1], &[0, 0, 0, 1]);
    let lse = TensorRef::new(&one, &[1, rows, 1], &[0, 0, 1]);
    let e = flashattn::flash_attn_backward(&qh, &k, &k, &qh, &lse, &qh, &o).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "the gathered `lse`",
            bytes: rows * 4
        }
    );
    // dk and dv are k's size.
    let q1 = TensorRef::new(&one, &[1, 1, 1, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[1, rows, 1, 1], &[0, 0, 0, 1]);
    let lse1 = TensorRef::new(&one, &[1, 1, 1], &[0, 0, 1]);
    let e = flashattn::flash_attn_backward(&q1, &k, &k, &q1, &lse1, &q1, &o).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "`dk`",
            bytes: rows * 4
        }
    );
}

/// Working buffers that follow k's shape while the results stay small: 16 query heads over one
/// kv head and 2^58 keys (stride-0 views of one element), where the forward packs k and v once
/// for all heads. `OutOfMemory` naming them, where the tiles' allocation (or, before it, the list
/// of their key blocks) aborted the process. f32 packs f32 tiles; bf16 packs v in key pairs on
/// a CPU with AVX512_BF16, f32 tiles elsewhere.
#[test]
fn packed_key_tiles_too_large_to_allocate_are_a_typed_error() {
    let keys = 1usize << 58;
    let o = AttnOptions::default();
    let one = [0.5f32];
    let q = TensorRef::new(&one, &[1, 1, 16, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[1, keys, 1, 1], &[0, 0, 0, 1]);
    let e = flash_attn(&q, &k, &k, &o).unwrap_err();
    match e.kind() {
        ErrorKind::OutOfMemory { what, bytes } => {
            assert_eq!(*what, "the packed tiles of k", "{e}");
            assert!(*bytes >= keys * 4, "{e}");
        }
        _ => panic!("{e}"),
    }
    let oneb = [bf16::from_f32(0.5)];
    let q = TensorRef::new(&oneb, &[1, 1, 16, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&oneb, &[1, keys, 1, 1], &[0, 0, 0, 1]);
    let e = flash_attn(&q, &k, &k, &o).unwrap_err();
    match e.kind() {
        ErrorKind::OutOfMemory { what, bytes } => {
            assert!(
                ["the packed bf16 pairs of v", "the packed tiles of k"].contains(what),
                "{e}"
            );
            assert!(*bytes >= keys * 2, "{e}");
        }
        _ => panic!("{e}"),
    }
}

/// `merge_attn_partials` over two stride-0 partials of 2^58 heads: their gathered LSEs (2^61
/// bytes) are `OutOfMemory`, where the gather aborted the process (`tests/alloc_limit.rs` has
/// the merged result refused).
#[test]
fn merge_partials_too_large_to_gather_are_a_typed_error() {
    let one = [0.5f32];
    let heads = 1usize << 58;
    let out = TensorRef::new(&one, &[1, 1, heads, 1], &[0, 0, 0, 1]);
    let lse = TensorRef::new(&one, &[1, heads, 1], &[0, 0, 1]);
    let e = merge_attn_partials(&[out.clone(), out], &[lse.clone(), lse]).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "the gathered partial LSEs",
            bytes: 2 * heads * 4
        }
    );
}

/// Forcing an instruction set: the ones this CPU runs work and give the same result within
/// rounding; any other is `IsaUnavailable`, naming the best one there is.
#[test]
fn isa_unavailable() {
    use flashattn::simd::{available, detected, Isa};
    let q: Vec<f32> = (0..2 * 3 * 2 * 8).map(|i| (i as f32 * 0.7).sin()).collect();
    let t = TensorRef::contiguous(&q, &[2, 3, 2, 8]);
    let base = flash_attn(&t, &t, &t, &AttnOptions::default().isa(Isa::Scalar)).unwrap();
    for isa in Isa::ALL {
        let res = flash_attn(&t, &t, &t, &AttnOptions::default().isa(isa));
        if available().contains(&isa) {
            let out = res.unwrap().out.to_f32_vec();
            for (a, b) in out.iter().zip(base.out.to_f32_vec()) {
                assert!((a - b).abs() < 1e-5, "{isa}: {a} vs scalar {b}");
            }
        } else {
            assert_eq!(
                res.unwrap_err().kind(),
                &ErrorKind::IsaUnavailable {
                    requested: isa,
                    best: detected()
                }
            );
        }
    }
    assert!(available().contains(&Isa::Scalar) && available().contains(&detected()));
}

/// Fuzzing the boundary: valid calls with arbitrary changes (shapes, strides, ranks, buffer
/// lengths, dtypes, cu_seqlens, every option, ALiBi slopes, the backward's out/lse/dout), any
/// integer or float including the extremes. No entry point may panic; flash_attn, naive and
/// reference must refuse the same calls with the same error; an accepted call on finite inputs
/// gives no NaN.
mod properties {
    use super::*;
    use crate::common::props::extremes::{f32s as float, i32s, i64s, usizes};
    use crate::common::props::{assert_no_nan, config, scores_may_overflow, set_dim};
    use flashattn::{flash_attn_backward, flash_attn_varlen_backward, AttnOutput, Slice};
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Change {
        /// (tensor: q k v alibi out lse dout, dim, value).
        Shape(usize, usize, usize),
        Stride(usize, usize, usize),
        Rank(usize, usize),
        BufLen(usize, usize),
        DType(usize, usize),
        CuQ(Vec<i32>),
        CuK(Vec<i32>),
        Window(i64, i64),
        Softcap(f32),
        Scale(f32),
        Dropout(f32),
        Slope(usize, f32),
        /// Learnable sinks on, `[heads]` of them with sink `.0 % heads` set to `.1`.
        Sink(usize, f32),
        /// Learnable sinks on, of this many entries (a wrong shape unless `heads`).
        SinkLen(usize),
        Causal,
    }

    fn changes() -> impl Strategy<Value = Vec<Change>> {
        let one = prop_oneof![
            (0..7usize, 0..5usize, usizes(0..12)).prop_map(|(t, d, v)| Change::Shape(t, d, v)),
            (0..7usize, 0..5usize, usizes(0..12)).prop_map(|(t, d, v)| Change::Stride(t, d, v)),
            (0..7usize, 0..6usize).prop_map(|(t, r)| Change::Rank(t, r)),
            (0..7usize, 0..5000usize).prop_map(|(t, n)| Change::BufLen(t, n)),
            (0..7usize, 0..3usize).prop_map(|(t, d)| Change::DType(t, d)),
            prop::collection::vec(i32s(-2..12), 0..5).prop_map(Change::CuQ),
            prop::collection::vec(i32s(-2..12), 0..5).prop_map(Change::CuK),
            (i64s(-3..12), i64s(-3..12)).prop_map(|(l, r)| Change::Window(l, r)),
            float().prop_map(Change::Softcap),
            float().prop_map(Change::Scale),
            float().prop_map(Change::Dropout),
            (0..8usize, float()).prop_map(|(i, x)| Change::Slope(i, x)),
            (0..8usize, float()).prop_map(|(i, x)| Change::Sink(i, x)),
            (0..9usize).prop_map(Change::SinkLen),
            Just(Change::Causal),
        ];
        prop::collection::vec(one, 1..=3)
    }

    /// One tensor of a call: dtype (0 f32, 1 f16, 2 bf16), buffer length, shape, strides.
    #[derive(Clone, Debug)]
    struct T {
        dtype: usize,
        len: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
    }

    impl T {
        fn new(dtype: usize, shape: &[usize]) -> Self {
            T {
                dtype,
                len: shape.iter().product(),
                shape: shape.to_vec(),
                strides: flashattn::tensor::contiguous_strides(shape),
            }
        }
    }

    /// Buffers of every dtype, sized for every tensor's length.
    struct Bufs(Vec<f32>, Vec<f16>, Vec<bf16>);

    impl Bufs {
        fn new() -> Self {
            let x: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
            Bufs(
                x.clone(),
                x.iter().map(|&v| f16::from_f32(v)).collect(),
                x.iter().map(|&v| bf16::from_f32(v)).collect(),
            )
        }
        fn view(&self, t: &T) -> TensorRef<'_> {
            let data = match t.dtype {
                0 => Slice::F32(&self.0[..t.len]),
                1 => Slice::F16(&self.1[..t.len]),
                _ => Slice::BF16(&self.2[..t.len]),
            };
            TensorRef::from_slice(data, &t.shape, &t.strides)
        }
    }

    fn apply(ts: &mut [T], ch: &Change) {
        match ch {
            Change::Shape(t, d, x) => set_dim(&mut ts[*t].shape, *d, *x),
            Change::Stride(t, d, x) => set_dim(&mut ts[*t].strides, *d, *x),
            Change::Rank(t, r) => {
                let t = &mut ts[*t];
                t.shape.resize(*r, 2);
                t.strides.resize(*r, 1);
            }
            Change::BufLen(t, n) => ts[*t].len = *n,
            Change::DType(t, d) => ts[*t].dtype = *d,
            _ => {}
        }
    }

    /// Runs every entry point of one layout on a changed call and checks the property.
    fn check(packed: bool, dtype: usize, changes: &[Change]) {
        let (b, sq, sk, h, hk, d) = (2, 5, 7, 4, 2, 8);
        let (qs, ks, ls): (Vec<usize>, Vec<usize>, Vec<usize>) = if packed {
            (vec![sq, h, d], vec![sk, hk, d], vec![h, sq])
        } else {
            (vec![b, sq, h, d], vec![b, sk, hk, d], vec![b, h, sq])
        };
        // q k v alibi out lse dout.
        let mut ts = vec![
            T::new(dtype, &qs),
            T::new(dtype, &ks),
            T::new(dtype, &ks),
            T::new(0, &[h]),
            T::new(dtype, &qs),
            T::new(0, &ls),
            T::new(dtype, &qs),
        ];
        let (mut cq, mut ck) = (vec![0, 2, 5], vec![0, 7, 7]);
        let mut slopes = [0.25f32, 0.5, 0.125, 1.0, 0.3, 0.7, 0.9, 0.05];
        let mut opts_ch = Vec::new();
        let mut alibi = false;
        let mut sinks = [0.5f32, -1.0, 2.0, 0.25, 7.0, -3.0, 0.0, 1.5];
        let mut sink_len = None;
        for ch in changes {
            apply(&mut ts, ch);
            match ch {
                Change::CuQ(v) => cq = v.clone(),
                Change::CuK(v) => ck = v.clone(),
                Change::Slope(i, x) => {
                    alibi = true;
                    slopes[*i] = *x;
                }
                Change::Sink(i, x) => {
                    sinks[*i % h] = *x;
                    sink_len.get_or_insert(h);
                }
                Change::SinkLen(n) => sink_len = Some(*n),
                Change::Shape(3, ..) | Change::Stride(3, ..) | Change::Rank(3, _) => alibi = true,
                Change::BufLen(3, _) | Change::DType(3, _) => alibi = true,
                _ => opts_ch.push(ch.clone()),
            }
        }
        let bufs = Bufs::new();
        let slope_t = &mut ts[3];
        slope_t.len = slope_t.len.min(slopes.len());
        let slope_view = |t: &T| -> TensorRef<'_> {
            TensorRef::from_slice(Slice::F32(&slopes[..t.len]), &t.shape, &t.strides)
        };
        let mut opts = AttnOptions::default();
        if alibi {
            opts = opts.alibi_slopes(slope_view(&ts[3]));
        }
        if let Some(n) = sink_len {
            opts = opts.learnable_sink(TensorRef::contiguous(&sinks[..n], &[n]));
        }
        for ch in opts_ch {
            match ch {
                Change::Window(l, r) => opts.window = (l, r),
                Change::Softcap(x) => opts.softcap = Some(x),
                Change::Scale(x) => opts.softmax_scale = Some(x),
                Change::Dropout(x) => opts.dropout_p = x,
                Change::Causal => opts.causal = !opts.causal,
                _ => {}
            }
        }
        // Views whose buffers are shorter than asked for stay in bounds: the length is capped
        // by the buffer (a longer request just names more of it).
        for t in ts.iter_mut() {
            t.len = t.len.min(5000);
        }
        let [q, k, v, _, out, lse, dout] = [0, 1, 2, 3, 4, 5, 6].map(|i| bufs.view(&ts[i]));
        // The buffers hold values in [-1, 1]: NaN is allowed only where the scale makes the
        // scores themselves overflow f32 (data-dependent, so not refused; see docs/SEMANTICS.md).
        let may_overflow = scores_may_overflow(
            opts.softmax_scale,
            q.shape().last().map_or(0.0, |&d| d as f64),
        );
        let same = |a: &Result<AttnOutput, Error>, b: Result<(), Error>, what: &str| match (a, b) {
            (Err(x), Err(y)) => assert_eq!(format!("{x:?}"), format!("{y:?}"), "{what}"),
            (Ok(_), Ok(())) => {}
            (x, y) => panic!("{what}: flash {:?} but {y:?}", x.as_ref().map(drop)),
        };
        if packed {
            let f = flash_attn_varlen(&q, &k, &v, &cq, &ck, &opts);
            let n = naive::attention_varlen(&q, &k, &v, &cq, &ck, &opts).map(drop);
            let r = reference::attention_varlen(&q, &k, &v, &cq, &ck, &opts).map(drop);
            same(&f, n, "naive");
            same(&f, r, "reference");
            if let (Ok(o), false) = (&f, may_overflow) {
                assert_no_nan(o);
            }
            let _ = flash_attn_varlen_backward(&q, &k, &v, &out, &lse, &dout, &cq, &ck, &opts);
        } else {
            let f = flash_attn(&q, &k, &v, &opts);
            let n = naive::attention(&q, &k, &v, &opts).map(drop);
            let r = reference::attention(&q, &k, &v, &opts).map(drop);
            same(&f, n, "naive");
            same(&f, r, "reference");
            if let (Ok(o), false) = (&f, may_overflow) {
                assert_no_nan(o);
            }
            let _ = flash_attn_backward(&q, &k, &v, &out, &lse, &dout, &opts);
        }
    }

    proptest! {
        #![proptest_config(config(512))]

        #[test]
        fn changed_calls_fail_cleanly(
            packed in any::<bool>(),
            dtype in 0..3usize,
            changes in changes(),
        ) {
            check(packed, dtype, &changes);
        }
    }
}

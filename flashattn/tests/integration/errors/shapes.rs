//! The tensors: rank, strides, shapes, dtypes, head dims, head counts, contiguity, bounds, and
//! packed sequences' `cu_seqlens`.

use super::*;

#[test]
fn valid_inputs_are_accepted() {
    // The baseline every other test perturbs.
    let data = buf();
    let q = TensorRef::contiguous(&data, &qshape());
    let k = TensorRef::contiguous(&data, &kshape());
    assert!(flash_attn(&q, &k, &k, &AttnOptions::default()).is_ok());
    let q3 = TensorRef::contiguous(&data, &[SQ, H, D]);
    let k3 = TensorRef::contiguous(&data, &[SK, HKV, D]);
    assert!(flash_attn(
        &q3,
        &k3,
        &k3,
        &AttnOptions::default()
            .clone()
            .varlen(&[0, 2, 5], &[0, 7, 7])
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
    let r = flash_attn(&q, &k, &k, &o.clone().varlen(&[0], &[0])).unwrap();
    assert!(r.out.to_f64_vec().iter().all(|&x| x == 0.0));
    assert!(r.lse.to_f64_vec().iter().all(|&x| x == f64::NEG_INFINITY));
}

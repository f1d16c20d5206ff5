//! The `_into` calls (caller-provided destinations, as frameworks that allocate their own tensors
//! need): the same bits as the allocating calls, batched and packed, forward and backward, with
//! sinks; destinations of the wrong size or dtype are refused before anything is written.

use crate::common::{rng, to_buffer, values, Dist};
use flashattn::{
    flash_attn, flash_attn_backward, flash_attn_backward_into, flash_attn_into, flash_attn_varlen,
    flash_attn_varlen_backward, flash_attn_varlen_backward_into, flash_attn_varlen_into,
    AttnOptions, Buffer, DType, ErrorKind, GradBuffers, OutBuffers, SliceMut, Tensor,
};
use half::bf16;

fn tensor(seed: u64, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_buffer(
        to_buffer(&values(&mut rng(seed), n, Dist::Normal), dtype),
        shape,
    )
    .unwrap()
}

/// A destination of `n` elements of `dtype`, filled with a sentinel (so unwritten elements show).
fn dest(dtype: DType, n: usize) -> Buffer {
    match dtype {
        DType::F32 => Buffer::F32(vec![7.0; n]),
        DType::F16 => Buffer::F16(vec![half::f16::from_f32(7.0); n]),
        DType::BF16 => Buffer::BF16(vec![bf16::from_f32(7.0); n]),
    }
}

fn as_mut(b: &mut Buffer) -> SliceMut<'_> {
    match b {
        Buffer::F32(d) => SliceMut::F32(d),
        Buffer::F16(d) => SliceMut::F16(d),
        Buffer::BF16(d) => SliceMut::BF16(d),
    }
}

fn same_bits(a: &Buffer, b: &Buffer, what: &str) {
    let bits = |x: &Buffer| -> Vec<u32> {
        match x {
            Buffer::F32(d) => d.iter().map(|v| v.to_bits()).collect(),
            Buffer::F16(d) => d.iter().map(|v| v.to_bits() as u32).collect(),
            Buffer::BF16(d) => d.iter().map(|v| v.to_bits() as u32).collect(),
        }
    };
    assert_eq!(
        bits(a),
        bits(b),
        "{what}: bits differ from the allocating call"
    );
}

#[test]
fn into_calls_give_the_allocating_calls_bits() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (b, sq, sk, h, hk, d) = (2, 37, 51, 4, 2, 40);
        let q = tensor(1, &[b, sq, h, d], dtype);
        let k = tensor(2, &[b, sk, hk, d], dtype);
        let v = tensor(3, &[b, sk, hk, d], dtype);
        let dout = tensor(4, &[b, sq, h, d], dtype);
        let sink = Tensor::from_vec(vec![0.3f32, -1.0, 2.0, 0.0], &[h]).unwrap();
        let opts = AttnOptions::default()
            .causal(true)
            .dropout(0.2, 9)
            .learnable_sink(sink.view());
        let (qv, kv, vv) = (q.view(), k.view(), v.view());
        let want = flash_attn(&qv, &kv, &vv, &opts).unwrap();
        let (mut out, mut lse) = (dest(dtype, b * sq * h * d), vec![7.0f32; b * h * sq]);
        let dst = OutBuffers {
            out: as_mut(&mut out),
            lse: &mut lse,
        };
        flash_attn_into(&qv, &kv, &vv, &opts, dst).unwrap();
        same_bits(&out, want.out.buffer(), "out");
        same_bits(&Buffer::F32(lse.clone()), want.lse.buffer(), "lse");

        let grads = want.backward(&qv, &kv, &vv, &dout.view(), &opts).unwrap();
        let (mut dq, mut dk, mut dv) = (
            dest(dtype, b * sq * h * d),
            dest(dtype, b * sk * hk * d),
            dest(dtype, b * sk * hk * d),
        );
        let mut dsink = vec![7.0f32; h];
        let (o, l) = (want.out.view(), want.lse.view());
        let dst = GradBuffers {
            dq: as_mut(&mut dq),
            dk: as_mut(&mut dk),
            dv: as_mut(&mut dv),
            dsink: Some(&mut dsink),
        };
        flash_attn_backward_into(&qv, &kv, &vv, &o, &l, &dout.view(), &opts, dst).unwrap();
        same_bits(&dq, grads.dq.buffer(), "dq");
        same_bits(&dk, grads.dk.buffer(), "dk");
        same_bits(&dv, grads.dv.buffer(), "dv");
        same_bits(
            &Buffer::F32(dsink),
            grads.dsink.as_ref().unwrap().buffer(),
            "dsink",
        );
    }
}

#[test]
fn varlen_into_calls_give_the_allocating_calls_bits() {
    let dtype = DType::BF16;
    let (total_q, total_k, h, d) = (40, 50, 2, 64);
    let (cq, ck) = ([0, 7, 7, 31], [0, 20, 22, 45]); // spare rows after the last sequence
    let q = tensor(5, &[total_q, h, d], dtype);
    let k = tensor(6, &[total_k, h, d], dtype);
    let v = tensor(7, &[total_k, h, d], dtype);
    let dout = tensor(8, &[total_q, h, d], dtype);
    let opts = AttnOptions::default().window(5, 3);
    let (qv, kv, vv) = (q.view(), k.view(), v.view());
    let want = flash_attn_varlen(&qv, &kv, &vv, &cq, &ck, &opts).unwrap();
    let (mut out, mut lse) = (dest(dtype, total_q * h * d), vec![7.0f32; h * total_q]);
    let dst = OutBuffers {
        out: as_mut(&mut out),
        lse: &mut lse,
    };
    flash_attn_varlen_into(&qv, &kv, &vv, &cq, &ck, &opts, dst).unwrap();
    same_bits(&out, want.out.buffer(), "out");
    same_bits(&Buffer::F32(lse), want.lse.buffer(), "lse");

    let (o, l) = (want.out.view(), want.lse.view());
    let grads =
        flash_attn_varlen_backward(&qv, &kv, &vv, &o, &l, &dout.view(), &cq, &ck, &opts).unwrap();
    let (mut dq, mut dk, mut dv) = (
        dest(dtype, total_q * h * d),
        dest(dtype, total_k * h * d),
        dest(dtype, total_k * h * d),
    );
    let dst = GradBuffers {
        dq: as_mut(&mut dq),
        dk: as_mut(&mut dk),
        dv: as_mut(&mut dv),
        dsink: None,
    };
    flash_attn_varlen_backward_into(&qv, &kv, &vv, &o, &l, &dout.view(), &cq, &ck, &opts, dst)
        .unwrap();
    same_bits(&dq, grads.dq.buffer(), "dq");
    same_bits(&dk, grads.dk.buffer(), "dk");
    same_bits(&dv, grads.dv.buffer(), "dv");
}

#[test]
fn wrong_destinations_are_refused_and_left_unwritten() {
    let (b, s, h, d) = (1, 9, 2, 16);
    let q = tensor(9, &[b, s, h, d], DType::F32);
    let opts = AttnOptions::default();
    let qv = q.view();
    let n = b * s * h * d;

    // out one element short.
    let (mut out, mut lse) = (vec![7.0f32; n - 1], vec![7.0f32; b * h * s]);
    let dst = OutBuffers {
        out: SliceMut::F32(&mut out),
        lse: &mut lse,
    };
    let e = flash_attn_into(&qv, &qv, &qv, &opts, dst).unwrap_err();
    match e.kind() {
        ErrorKind::DestinationLength {
            tensor,
            expected,
            got,
            ..
        } => assert_eq!((*tensor, *expected, *got), ("out", n, n - 1)),
        other => panic!("expected DestinationLength for out, got {other:?}"),
    }
    assert!(
        out.iter().chain(&lse).all(|&x| x == 7.0),
        "written on error"
    );

    // lse of the wrong length.
    let (mut out, mut lse) = (vec![7.0f32; n], vec![7.0f32; b * h * s + 1]);
    let dst = OutBuffers {
        out: SliceMut::F32(&mut out),
        lse: &mut lse,
    };
    let e = flash_attn_into(&qv, &qv, &qv, &opts, dst).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::DestinationLength { tensor: "lse", .. }),
        "{e}"
    );
    assert!(
        out.iter().chain(&lse).all(|&x| x == 7.0),
        "written on error"
    );

    // out of another dtype than q.
    let mut out16 = vec![bf16::from_f32(7.0); n];
    let mut lse = vec![7.0f32; b * h * s];
    let dst = OutBuffers {
        out: SliceMut::BF16(&mut out16),
        lse: &mut lse,
    };
    let e = flash_attn_into(&qv, &qv, &qv, &opts, dst).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::DType { tensor: "out", .. }),
        "{e}"
    );

    // A backward with a sink but no dsink destination, and the reverse.
    let fwd = flash_attn(&qv, &qv, &qv, &opts).unwrap();
    let sink = Tensor::from_vec(vec![0.5f32; h], &[h]).unwrap();
    for (with_sink, give_dsink) in [(true, false), (false, true)] {
        let o = if with_sink {
            opts.clone().learnable_sink(sink.view())
        } else {
            opts.clone()
        };
        let (mut dq, mut dk, mut dv, mut ds) = (
            vec![7.0f32; n],
            vec![7.0f32; n],
            vec![7.0f32; n],
            vec![7.0f32; h],
        );
        let dst = GradBuffers {
            dq: SliceMut::F32(&mut dq),
            dk: SliceMut::F32(&mut dk),
            dv: SliceMut::F32(&mut dv),
            dsink: give_dsink.then_some(&mut ds[..]),
        };
        let (ov, lv) = (fwd.out.view(), fwd.lse.view());
        let e = flash_attn_backward_into(&qv, &qv, &qv, &ov, &lv, &qv, &o, dst).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::DestinationLength {
                    tensor: "dsink",
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            dq.iter()
                .chain(&dk)
                .chain(&dv)
                .chain(&ds)
                .all(|&x| x == 7.0),
            "written on error"
        );
    }
    // The allocating backward still agrees that the sink-less call is fine.
    let (ov, lv) = (fwd.out.view(), fwd.lse.view());
    flash_attn_backward(&qv, &qv, &qv, &ov, &lv, &qv, &opts).unwrap();
}

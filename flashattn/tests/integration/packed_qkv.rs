//! flash-attn's packed layouts (`flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func` and their
//! varlen forms) through `TensorRef::select`: q, k and v as strided views of one buffer give the
//! same bits as the same values in separate contiguous tensors, forward and backward, batched and
//! packed; and `select` refuses what does not fit.

use crate::common::{assert_bit_identical, bits, rng, to_buffer, values, Dist};
use flashattn::{
    flash_attn, flash_attn_backward, AttnGrads, AttnOptions, Buffer, DType, ErrorKind, Tensor,
    TensorRef,
};

/// Copies view `t` (any strides) into a contiguous f64 vector, row-major over its shape.
fn gather(t: &TensorRef) -> Vec<f64> {
    let all = Tensor::from_buffer(buffer_of(t), &[t.data().len()])
        .unwrap()
        .to_f64_vec();
    let (shape, strides) = (t.shape(), t.strides());
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut flat| {
            let mut at = 0;
            for (&dim, &st) in shape.iter().zip(strides).rev() {
                at += (flat % dim) * st;
                flat /= dim;
            }
            all[at]
        })
        .collect()
}

fn buffer_of(t: &TensorRef) -> Buffer {
    match t.data() {
        flashattn::Slice::F32(d) => Buffer::F32(d.to_vec()),
        flashattn::Slice::F16(d) => Buffer::F16(d.to_vec()),
        flashattn::Slice::BF16(d) => Buffer::BF16(d.to_vec()),
    }
}

fn assert_grads_identical(a: &AttnGrads, b: &AttnGrads, what: &str) {
    for (name, x, y) in [
        ("dq", &a.dq, &b.dq),
        ("dk", &a.dk, &b.dk),
        ("dv", &a.dv, &b.dv),
    ] {
        assert_eq!(x.shape(), y.shape(), "{what}: {name} shapes differ");
        assert!(bits(x) == bits(y), "{what}: {name} differs");
    }
}

/// One packed buffer and the same values as three contiguous tensors.
struct Packed {
    packed: Buffer,
    separate: [Buffer; 3],
}

/// `parts` tensors of shape `[rows.., parts, heads, d]` interleaved in one buffer (`lead` is the
/// product of the leading dims), and each part alone.
fn packed(dtype: DType, lead: usize, parts: usize, heads: usize, d: usize, seed: u64) -> Packed {
    let vals = values(&mut rng(seed), lead * parts * heads * d, Dist::Normal);
    let hd = heads * d;
    let part = |p: usize| -> Vec<f64> {
        (0..lead)
            .flat_map(|r| vals[(r * parts + p) * hd..(r * parts + p + 1) * hd].to_vec())
            .collect()
    };
    let empty = || to_buffer(&[], dtype);
    let mut separate = [empty(), empty(), empty()];
    for (p, s) in separate.iter_mut().enumerate().take(parts) {
        *s = to_buffer(&part(p), dtype);
    }
    Packed {
        packed: to_buffer(&vals, dtype),
        separate,
    }
}

#[test]
fn qkvpacked_matches_separate_tensors() {
    let (b, s, h, d) = (2, 67, 3, 40);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for causal in [false, true] {
            let opts = AttnOptions::default().causal(causal);
            let p = packed(dtype, b * s, 3, h, d, 7);
            let qkv = TensorRef::from_slice(
                p.packed.as_slice(),
                &[b, s, 3, h, d],
                &[s * 3 * h * d, 3 * h * d, h * d, d, 1],
            );
            let [q, k, v] = [0, 1, 2].map(|i| qkv.select(2, i).unwrap());
            assert_eq!(q.shape(), &[b, s, h, d]);
            assert_eq!(k.strides(), &[s * 3 * h * d, 3 * h * d, d, 1]);
            let sep = p.separate.each_ref().map(|x| {
                TensorRef::from_slice(x.as_slice(), &[b, s, h, d], &[s * h * d, h * d, d, 1])
            });
            for (view, alone) in [&q, &k, &v].into_iter().zip(&sep) {
                assert_eq!(gather(view), gather(alone), "the views select the parts");
            }
            let what = format!("{dtype} causal {causal}");
            let got = flash_attn(&q, &k, &v, &opts).unwrap();
            let want = flash_attn(&sep[0], &sep[1], &sep[2], &opts).unwrap();
            assert_bit_identical(&got, &want, &what);
            let dout_vals = values(&mut rng(11), b * s * h * d, Dist::Normal);
            let dout_buf = to_buffer(&dout_vals, dtype);
            let dout = TensorRef::from_slice(
                dout_buf.as_slice(),
                &[b, s, h, d],
                &[s * h * d, h * d, d, 1],
            );
            let (out, lse) = (got.out.view(), got.lse.view());
            let g = flash_attn_backward(&q, &k, &v, &out, &lse, &dout, &opts).unwrap();
            let w =
                flash_attn_backward(&sep[0], &sep[1], &sep[2], &out, &lse, &dout, &opts).unwrap();
            assert_grads_identical(&g, &w, &what);
        }
    }
}

/// kv packed `[batch, seqlen_k, 2, heads_kv, d]` beside a separate q, GQA, seqlen_q != seqlen_k
/// both ways, ALiBi and a window.
#[test]
fn kvpacked_matches_separate_tensors() {
    let (b, h, hkv, d) = (2, 6, 2, 59);
    let slopes = [0.3f32, 0.1, 0.7, 0.25, 0.05, 0.5];
    for (sq, sk) in [(13, 113), (113, 13), (1, 63)] {
        for dtype in [DType::F32, DType::BF16] {
            let opts = AttnOptions::default()
                .causal(true)
                .alibi_slopes(TensorRef::contiguous(&slopes, &[h]));
            let qb = to_buffer(&values(&mut rng(3), b * sq * h * d, Dist::Normal), dtype);
            let q =
                TensorRef::from_slice(qb.as_slice(), &[b, sq, h, d], &[sq * h * d, h * d, d, 1]);
            let p = packed(dtype, b * sk, 2, hkv, d, 5);
            let kv = TensorRef::from_slice(
                p.packed.as_slice(),
                &[b, sk, 2, hkv, d],
                &[sk * 2 * hkv * d, 2 * hkv * d, hkv * d, d, 1],
            );
            let (k, v) = (kv.select(2, 0).unwrap(), kv.select(2, 1).unwrap());
            let kshape = [b, sk, hkv, d];
            let kst = [sk * hkv * d, hkv * d, d, 1];
            let ks = TensorRef::from_slice(p.separate[0].as_slice(), &kshape, &kst);
            let vs = TensorRef::from_slice(p.separate[1].as_slice(), &kshape, &kst);
            let what = format!("{dtype} sq {sq} sk {sk}");
            let got = flash_attn(&q, &k, &v, &opts).unwrap();
            let want = flash_attn(&q, &ks, &vs, &opts).unwrap();
            assert_bit_identical(&got, &want, &what);
            let dout_buf = to_buffer(&values(&mut rng(9), b * sq * h * d, Dist::Normal), dtype);
            let dout = TensorRef::from_slice(dout_buf.as_slice(), &[b, sq, h, d], q.strides());
            let (out, lse) = (got.out.view(), got.lse.view());
            let g = flash_attn_backward(&q, &k, &v, &out, &lse, &dout, &opts).unwrap();
            let w = flash_attn_backward(&q, &ks, &vs, &out, &lse, &dout, &opts).unwrap();
            assert_grads_identical(&g, &w, &what);
        }
    }
}

/// Packed sequences: qkv `[total, 3, heads, d]` with cu_seqlens (`flash_attn_varlen_qkvpacked_func`).
#[test]
fn varlen_qkvpacked_matches_separate_tensors() {
    let (h, d) = (4, 111);
    let cu = [0, 1, 64, 64, 267];
    let total = *cu.last().unwrap() as usize;
    for dtype in [DType::F32, DType::F16] {
        let opts = AttnOptions::default().window(17, 3);
        let p = packed(dtype, total, 3, h, d, 21);
        let qkv = TensorRef::from_slice(
            p.packed.as_slice(),
            &[total, 3, h, d],
            &[3 * h * d, h * d, d, 1],
        );
        let [q, k, v] = [0, 1, 2].map(|i| qkv.select(1, i).unwrap());
        let sep = p
            .separate
            .each_ref()
            .map(|x| TensorRef::from_slice(x.as_slice(), &[total, h, d], &[h * d, d, 1]));
        let got = flash_attn(&q, &k, &v, &opts.clone().varlen(&cu, &cu)).unwrap();
        let want = flash_attn(&sep[0], &sep[1], &sep[2], &opts.clone().varlen(&cu, &cu)).unwrap();
        assert_bit_identical(&got, &want, &format!("{dtype}"));
        let dout_buf = to_buffer(&values(&mut rng(4), total * h * d, Dist::Normal), dtype);
        let dout = TensorRef::from_slice(dout_buf.as_slice(), &[total, h, d], &[h * d, d, 1]);
        let (out, lse) = (got.out.view(), got.lse.view());
        let g = flash_attn_backward(
            &q,
            &k,
            &v,
            &out,
            &lse,
            &dout,
            &opts.clone().varlen(&cu, &cu),
        )
        .unwrap();
        let w = flash_attn_backward(
            &sep[0],
            &sep[1],
            &sep[2],
            &out,
            &lse,
            &dout,
            &opts.clone().varlen(&cu, &cu),
        )
        .unwrap();
        assert_grads_identical(&g, &w, &format!("{dtype}"));
    }
}

#[test]
fn select_refuses_what_does_not_fit() {
    let data = vec![0.5f32; 60];
    let t = TensorRef::contiguous(&data, &[2, 3, 10]);
    let s = t.select(1, 2).unwrap();
    assert_eq!(
        (s.shape(), s.strides(), s.data().len()),
        (&[2, 10][..], &[30, 1][..], 40)
    );
    let s = t.select(0, 1).unwrap().select(0, 2).unwrap();
    assert_eq!((s.shape(), s.data().len()), (&[10][..], 10));
    let kind = |r: flashattn::Result<TensorRef>| r.unwrap_err().kind().clone();
    // Past the rank, past the dimension, past the buffer, an index whose offset overflows, and
    // strides shorter than the shape.
    assert!(matches!(
        kind(t.select(3, 0)),
        ErrorKind::Select {
            dim: 3,
            index: 0,
            ..
        }
    ));
    assert!(matches!(
        kind(t.select(1, 3)),
        ErrorKind::Select {
            dim: 1,
            index: 3,
            ..
        }
    ));
    let short = TensorRef::new(&data[..25], &[2, 3, 10], &[30, 10, 1]);
    assert!(matches!(
        kind(short.select(0, 1)),
        ErrorKind::Select { len: 25, .. }
    ));
    let wide = TensorRef::new(&data, &[usize::MAX, 1], &[usize::MAX, 1]);
    assert!(matches!(kind(wide.select(0, 2)), ErrorKind::Select { .. }));
    let ragged = TensorRef::new(&data, &[2, 3, 10], &[30, 10]);
    assert!(matches!(
        kind(ragged.select(2, 1)),
        ErrorKind::Select { .. }
    ));
    let e = t.select(1, 3).unwrap_err().to_string();
    assert!(
        e.contains("select(1, 3)") && e.contains("[2, 3, 10]"),
        "{e}"
    );
}

//! The `_into` calls (caller-provided destinations, as frameworks that allocate their own tensors
//! need): the same bits as the allocating calls, batched and packed, forward and backward, with
//! sinks, the FP8 forward and the decode calls (f32/bf16 and FP8 caches); destinations of the
//! wrong size or dtype are refused before anything is written.

use crate::common::{rng, to_buffer, values, Dist};
use flashattn::{
    flash_attn, flash_attn_backward, flash_attn_backward_into, flash_attn_into, AttnOptions,
    Buffer, DType, ErrorKind, GradBuffers, OutBuffers, SliceMut, Tensor,
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
    let want = flash_attn(&qv, &kv, &vv, &opts.clone().varlen(&cq, &ck)).unwrap();
    let (mut out, mut lse) = (dest(dtype, total_q * h * d), vec![7.0f32; h * total_q]);
    let dst = OutBuffers {
        out: as_mut(&mut out),
        lse: &mut lse,
    };
    flash_attn_into(&qv, &kv, &vv, &opts.clone().varlen(&cq, &ck), dst).unwrap();
    same_bits(&out, want.out.buffer(), "out");
    same_bits(&Buffer::F32(lse), want.lse.buffer(), "lse");

    let (o, l) = (want.out.view(), want.lse.view());
    let grads = flash_attn_backward(
        &qv,
        &kv,
        &vv,
        &o,
        &l,
        &dout.view(),
        &opts.clone().varlen(&cq, &ck),
    )
    .unwrap();
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
    flash_attn_backward_into(
        &qv,
        &kv,
        &vv,
        &o,
        &l,
        &dout.view(),
        &opts.clone().varlen(&cq, &ck),
        dst,
    )
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

// ---- the FP8 forward's and the decode's `_into` forms ------------------------------------------

use flashattn::fp8::{
    flash_attn_fp8, flash_attn_fp8_into, flash_attn_with_kvcache_fp8,
    flash_attn_with_kvcache_fp8_into, Descale, Fp8TensorMut, Fp8TensorRef, F8E4M3, F8E5M2,
};
use flashattn::{flash_attn_with_kvcache, flash_attn_with_kvcache_into, KvCacheOptions, TensorMut};

/// A destination of `n` NaNs of `dtype`: an element the call leaves unwritten stays NaN, and NaN
/// bits never equal a result's.
fn poisoned(dtype: DType, n: usize) -> Buffer {
    match dtype {
        DType::F32 => Buffer::F32(vec![f32::NAN; n]),
        DType::F16 => Buffer::F16(vec![half::f16::NAN; n]),
        DType::BF16 => Buffer::BF16(vec![bf16::NAN; n]),
    }
}

fn fp8_values<T: Copy>(seed: u64, n: usize, from: fn(f32) -> T) -> Vec<T> {
    values(&mut rng(seed), n, Dist::Normal)
        .iter()
        .map(|&x| from(x as f32 * 8.0))
        .collect()
}

#[test]
fn fp8_forward_into_gives_the_allocating_bits() {
    let (b, sq, sk, h, hk, d) = (2, 21, 35, 4, 2, 32);
    let (dq, dk, dv) = ([0.05f32], [0.04f32, 0.02, 0.03, 0.01], [0.5f32]);
    let descale = Descale::default().q(&dq).k(&dk).v(&dv);
    let q8 = fp8_values(11, b * sq * h * d, F8E4M3::from_f32);
    let k8 = fp8_values(12, b * sk * hk * d, F8E4M3::from_f32);
    let v8 = fp8_values(13, b * sk * hk * d, F8E4M3::from_f32);
    let (cq, ck) = ([0, 9, sq as i32 * 2], [0, 30, sk as i32 * 2]);
    for isa in flashattn::simd::available() {
        for packed in [false, true] {
            let (qs, ks) = if packed {
                (vec![b * sq, h, d], vec![b * sk, hk, d])
            } else {
                (vec![b, sq, h, d], vec![b, sk, hk, d])
            };
            let (q, k, v) = (
                Fp8TensorRef::contiguous(&q8, &qs),
                Fp8TensorRef::contiguous(&k8, &ks),
                Fp8TensorRef::contiguous(&v8, &ks),
            );
            let mut opts = AttnOptions::default()
                .causal(true)
                .isa(isa)
                .descale(descale);
            if packed {
                opts = opts.varlen(&cq, &ck);
            }
            let want = flash_attn_fp8(&q, &k, &v, &opts).unwrap();
            let ctx = format!("{isa:?}, packed {packed}");
            let mut out = poisoned(DType::BF16, b * sq * h * d);
            let mut lse = vec![f32::NAN; b * sq * h];
            let dst = OutBuffers {
                out: as_mut(&mut out),
                lse: &mut lse,
            };
            flash_attn_fp8_into(&q, &k, &v, &opts, dst).unwrap();
            same_bits(&out, want.out.buffer(), &format!("{ctx}: out"));
            same_bits(&Buffer::F32(lse), want.lse.buffer(), &format!("{ctx}: lse"));
        }
    }
}

/// Caches of `cap` keys per sequence, a few already filled; q of `sq` tokens; one new key per
/// sequence to append.
struct DecodeCase {
    b: usize,
    sq: usize,
    cap: usize,
    h: usize,
    hk: usize,
    d: usize,
    lens: Vec<i32>,
}

impl DecodeCase {
    fn new() -> Self {
        DecodeCase {
            b: 3,
            sq: 2,
            cap: 80,
            h: 4,
            hk: 2,
            d: 24,
            lens: vec![5, 77, 40],
        }
    }
    fn cache_shape(&self) -> [usize; 4] {
        [self.b, self.cap, self.hk, self.d]
    }
    fn cache_len(&self) -> usize {
        self.cache_shape().iter().product()
    }
    fn q_len(&self) -> usize {
        self.b * self.sq * self.h * self.d
    }
    fn lse_len(&self) -> usize {
        self.b * self.sq * self.h
    }
}

#[test]
fn decode_into_gives_the_allocating_bits() {
    let c = DecodeCase::new();
    for dtype in [DType::F32, DType::BF16] {
        for splits in [1, 3] {
            let q = tensor(21, &[c.b, c.sq, c.h, c.d], dtype);
            let kn = tensor(22, &[c.b, 1, c.hk, c.d], dtype);
            let vn = tensor(23, &[c.b, 1, c.hk, c.d], dtype);
            let caches = [24, 25].map(|s| tensor(s, &c.cache_shape(), dtype));
            let opts = KvCacheOptions::default()
                .attn(AttnOptions::default().causal(true))
                .new_kv(kn.view(), vn.view())
                .num_splits(splits);
            let ctx = format!("{dtype}, {splits} splits");
            // Allocating, then into, each on its own copy of the caches.
            let run = |into: bool| -> (Buffer, Buffer, Vec<Buffer>) {
                let mut kc = caches[0].buffer().clone();
                let mut vc = caches[1].buffer().clone();
                let shape = c.cache_shape();
                let mut kt = TensorMut::contiguous(as_mut(&mut kc), &shape);
                let mut vt = TensorMut::contiguous(as_mut(&mut vc), &shape);
                let (out, lse) = if into {
                    let mut out = poisoned(dtype, c.q_len());
                    let mut lse = vec![f32::NAN; c.lse_len()];
                    let dst = OutBuffers {
                        out: as_mut(&mut out),
                        lse: &mut lse,
                    };
                    flash_attn_with_kvcache_into(&q.view(), &mut kt, &mut vt, &c.lens, &opts, dst)
                        .unwrap();
                    (out, Buffer::F32(lse))
                } else {
                    let r = flash_attn_with_kvcache(&q.view(), &mut kt, &mut vt, &c.lens, &opts)
                        .unwrap();
                    (r.out.into_buffer(), r.lse.into_buffer())
                };
                (out, lse, vec![kc, vc])
            };
            let (want_out, want_lse, want_caches) = run(false);
            let (out, lse, caches_after) = run(true);
            same_bits(&out, &want_out, &format!("{ctx}: out"));
            same_bits(&lse, &want_lse, &format!("{ctx}: lse"));
            for (got, want) in caches_after.iter().zip(&want_caches) {
                same_bits(got, want, &format!("{ctx}: caches"));
            }
        }
    }
}

#[test]
fn fp8_decode_into_gives_the_allocating_bits() {
    let c = DecodeCase::new();
    let (dk, dv) = ([0.02f32], [0.03f32, 0.01, 0.02, 0.05, 0.04, 0.01]);
    for splits in [1, 3] {
        let q = tensor(31, &[c.b, c.sq, c.h, c.d], DType::F32);
        let kn = tensor(32, &[c.b, 1, c.hk, c.d], DType::F32);
        let vn = tensor(33, &[c.b, 1, c.hk, c.d], DType::F32);
        let k8 = fp8_values(34, c.cache_len(), F8E5M2::from_f32);
        let v8 = fp8_values(35, c.cache_len(), F8E5M2::from_f32);
        let opts = KvCacheOptions::default()
            .new_kv(kn.view(), vn.view())
            .descale(Descale::default().k(&dk).v(&dv))
            .num_splits(splits);
        let run = |into: bool| -> (Buffer, Vec<f32>, Vec<F8E5M2>, Vec<F8E5M2>) {
            let (mut kc, mut vc) = (k8.clone(), v8.clone());
            let shape = c.cache_shape();
            let mut kt = Fp8TensorMut::contiguous(&mut kc, &shape);
            let mut vt = Fp8TensorMut::contiguous(&mut vc, &shape);
            let qv = q.view();
            let (out, lse) = if into {
                let mut out = poisoned(DType::F32, c.q_len());
                let mut lse = vec![f32::NAN; c.lse_len()];
                let dst = OutBuffers {
                    out: as_mut(&mut out),
                    lse: &mut lse,
                };
                flash_attn_with_kvcache_fp8_into(&qv, &mut kt, &mut vt, &c.lens, &opts, dst)
                    .unwrap();
                (out, lse)
            } else {
                let r = flash_attn_with_kvcache_fp8(&qv, &mut kt, &mut vt, &c.lens, &opts).unwrap();
                let lse = r.lse.as_slice::<f32>().unwrap().to_vec();
                (r.out.into_buffer(), lse)
            };
            (out, lse, kc, vc)
        };
        let (want_out, want_lse, want_k, want_v) = run(false);
        let (out, lse, k, v) = run(true);
        let ctx = format!("fp8 decode, {splits} splits");
        same_bits(&out, &want_out, &format!("{ctx}: out"));
        same_bits(
            &Buffer::F32(lse),
            &Buffer::F32(want_lse),
            &format!("{ctx}: lse"),
        );
        let bits = |x: &[F8E5M2]| x.iter().map(|b| b.to_bits()).collect::<Vec<u8>>();
        assert_eq!(bits(&k), bits(&want_k), "{ctx}: k_cache");
        assert_eq!(bits(&v), bits(&want_v), "{ctx}: v_cache");
    }
}

/// Every way a destination can be wrong for the FP8 forward and the two decode calls: one
/// element short, lse one too long, out of another dtype than the call writes. Each is refused
/// with the error the other `_into` calls give, before anything is written (the destinations keep
/// their sentinel, the caches their bits).
#[test]
fn fp8_and_decode_into_refuse_bad_destinations() {
    let (b, s, h, d) = (1, 9, 2, 16);
    let n = b * s * h * d;
    let q8 = fp8_values(41, n, F8E4M3::from_f32);
    let qf = Fp8TensorRef::contiguous(&q8, &[b, s, h, d]);
    let opts = AttnOptions::default();
    // (out, lse, the error's tensor, whether it is a dtype error)
    let bad = |dtype: DType, rows: usize| {
        [
            (dest(dtype, n - 1), rows, "out", false),
            (dest(dtype, n), rows + 1, "lse", false),
            (
                dest(
                    if dtype == DType::F32 {
                        DType::BF16
                    } else {
                        DType::F32
                    },
                    n,
                ),
                rows,
                "out",
                true,
            ),
        ]
    };
    let check = |e: flashattn::Error, tensor: &str, dtype_err: bool, ctx: &str| match e.kind() {
        ErrorKind::DType { tensor: t, .. } if dtype_err => assert_eq!(*t, tensor, "{ctx}"),
        ErrorKind::DestinationLength { tensor: t, .. } if !dtype_err => {
            assert_eq!(*t, tensor, "{ctx}")
        }
        other => panic!("{ctx}: unexpected {other:?}"),
    };
    let unwritten = |out: &Buffer, lse: &[f32], ctx: &str| {
        assert!(
            f32s(out).iter().chain(lse).all(|&x| x == 7.0),
            "{ctx}: written on error"
        );
    };
    for (mut out, rows, tensor, dtype_err) in bad(DType::BF16, b * h * s) {
        let mut lse = vec![7.0f32; rows];
        let dst = OutBuffers {
            out: as_mut(&mut out),
            lse: &mut lse,
        };
        let e = flash_attn_fp8_into(&qf, &qf, &qf, &opts, dst).unwrap_err();
        let ctx = format!("fp8 forward, bad {tensor}");
        check(e, tensor, dtype_err, &ctx);
        unwritten(&out, &lse, &ctx);
    }

    // Decode, f32 and FP8 caches, with a key to append: the caches keep their bits too.
    let cap = 16;
    let qd = tensor(42, &[b, s, h, d], DType::F32);
    let kn = tensor(43, &[b, 1, h, d], DType::F32);
    let cache = tensor(44, &[b, cap, h, d], DType::F32);
    let c8 = fp8_values(45, b * cap * h * d, F8E4M3::from_f32);
    let ko = KvCacheOptions::default().new_kv(kn.view(), kn.view());
    for (mut out, rows, tensor, dtype_err) in bad(DType::F32, b * h * s) {
        let mut lse = vec![7.0f32; rows];
        let (mut kc, mut vc) = (cache.buffer().clone(), cache.buffer().clone());
        let shape = [b, cap, h, d];
        let dst = OutBuffers {
            out: as_mut(&mut out),
            lse: &mut lse,
        };
        let e = flash_attn_with_kvcache_into(
            &qd.view(),
            &mut TensorMut::contiguous(as_mut(&mut kc), &shape),
            &mut TensorMut::contiguous(as_mut(&mut vc), &shape),
            &[3],
            &ko,
            dst,
        )
        .unwrap_err();
        let ctx = format!("decode, bad {tensor}");
        check(e, tensor, dtype_err, &ctx);
        unwritten(&out, &lse, &ctx);
        same_bits(&kc, cache.buffer(), &format!("{ctx}: k_cache"));
        same_bits(&vc, cache.buffer(), &format!("{ctx}: v_cache"));

        let mut lse = vec![7.0f32; rows];
        let (mut kc, mut vc) = (c8.clone(), c8.clone());
        let dst = OutBuffers {
            out: as_mut(&mut out),
            lse: &mut lse,
        };
        let e = flash_attn_with_kvcache_fp8_into(
            &qd.view(),
            &mut Fp8TensorMut::contiguous(&mut kc, &shape),
            &mut Fp8TensorMut::contiguous(&mut vc, &shape),
            &[3],
            &ko,
            dst,
        )
        .unwrap_err();
        let ctx = format!("fp8 decode, bad {tensor}");
        check(e, tensor, dtype_err, &ctx);
        unwritten(&out, &lse, &ctx);
        let bits = |x: &[F8E4M3]| x.iter().map(|b| b.to_bits()).collect::<Vec<u8>>();
        assert_eq!(bits(&kc), bits(&c8), "{ctx}: k_cache");
        assert_eq!(bits(&vc), bits(&c8), "{ctx}: v_cache");
    }
}

fn f32s(b: &Buffer) -> Vec<f32> {
    match b {
        Buffer::F32(d) => d.clone(),
        Buffer::F16(d) => d.iter().map(|x| x.to_f32()).collect(),
        Buffer::BF16(d) => d.iter().map(|x| x.to_f32()).collect(),
    }
}

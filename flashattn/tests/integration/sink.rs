//! Learnable attention sinks (`AttnOptions::learnable_sink`, gpt-oss's): one logit per head in
//! every row's softmax normaliser, with no value. Forward, backward (dq, dk, dv and the sinks'
//! own gradient) and decoding, on every instruction set and dtype, against the f64 reference
//! (itself checked by finite differences in `reference.rs`), with the bounds of the forward and
//! gradient grids (naive attention in the same precision as the yardstick); and what the CUDA
//! backend's launches carry (the kernels run them in `cuda::emulated` and `decode::emulated`).

use crate::common::backward::{GradCase, GradData};
use crate::common::{check_bound, rng, to_buffer, values, Dist};
use flashattn::decode::{flash_attn_with_kvcache, BlockTable, KvCacheOptions};
use flashattn::{flash_attn, naive, reference, AttnOptions, DType, Element, ErrorKind, TensorRef};
use half::{bf16, f16};

/// Sinks of 4 heads: small, negative, and large enough (8) to take most of a row's weight.
static SINKS: [f32; 4] = [0.5, -2.0, 3.0, 8.0];
static SLOPES: [f32; 4] = [0.25, 0.5, 0.125, 1.0];

fn sinks() -> TensorRef<'static> {
    TensorRef::contiguous(&SINKS, &[4])
}

/// Awkward shapes with the sinks: causal with seqlen_q > seqlen_k (rows that see no key: out 0,
/// lse = the sink), a window with softcap, ALiBi, GQA and MQA, dropout, one key, d = 59 and 111.
fn cases() -> Vec<GradCase> {
    let case = |seed, shape, opts: AttnOptions<'static>| GradCase {
        seed,
        shape,
        opts: opts.learnable_sink(sinks()),
        logit_scale: 1.0,
    };
    vec![
        case(
            1,
            (2, 63, 40, 4, 2, 59),
            AttnOptions::default().causal(true),
        ),
        case(
            2,
            (1, 113, 203, 4, 1, 40),
            AttnOptions::default().window(7, 3).softcap(2.5),
        ),
        case(
            3,
            (2, 17, 1, 4, 4, 8),
            AttnOptions::default().alibi_slopes(TensorRef::contiguous(&SLOPES, &[4])),
        ),
        case(
            4,
            (1, 70, 64, 4, 2, 111),
            AttnOptions::default().dropout(0.2, 77).causal(true),
        ),
        case(5, (1, 1, 1, 4, 4, 16), AttnOptions::default()),
    ]
}

fn run<T: Element>() {
    for c in cases() {
        for isa in flashattn::simd::available() {
            let opts = c.opts.clone().isa(isa);
            let data = GradData::<T>::new(&c);
            let [q, k, v, dout] = data.views();
            let ctx = format!("seed {} {isa:?}", c.seed);
            let fwd = flash_attn(&q, &k, &v, &opts).unwrap();
            let r = data.check_forward(&fwd, &opts, &ctx);
            // The sinks change the result (a test that passes without them tests nothing).
            let plain = reference::attention(&q, &k, &v, &c.opts.clone().isa(isa)).unwrap();
            let mut plain_opts = opts.clone();
            plain_opts.learnable_sink = None;
            let plain0 = reference::attention(&q, &k, &v, &plain_opts).unwrap();
            assert!(plain.lse != plain0.lse, "{ctx}: the sinks changed no lse");
            let g = fwd.backward(&q, &k, &v, &dout, &opts).unwrap();
            let expected = data.expected(&opts);
            data.check_cancel([&g.dq, &g.dk, &g.dv], &expected, (&opts, &r), &ctx);
            let got = g.dsink.as_ref().expect("a sink gradient");
            assert_eq!((got.shape(), got.dtype()), (&[4][..], DType::F32));
            let want = expected.0.dsink.as_ref().expect("the reference's");
            assert!(
                want.iter().any(|&x| x != 0.0),
                "{ctx}: a zero sink gradient"
            );
            data.check_dsink(got, &expected, &r, &ctx);
        }
    }
}

#[test]
fn sinks_match_the_reference_f32() {
    run::<f32>();
}

#[test]
fn sinks_match_the_reference_f16() {
    run::<f16>();
}

#[test]
fn sinks_match_the_reference_bf16() {
    run::<bf16>();
}

/// Packed sequences (one with no query rows, one whose rows see no key under the causal mask)
/// give the batched results of each sequence alone.
#[test]
fn packed_sequences_with_sinks() {
    let (h, hk, d) = (4, 2, 24);
    let cu_q = [0, 5, 5, 17];
    let cu_k = [0, 3, 9, 21];
    let mut g = rng(8);
    let q = to_buffer(&values(&mut g, 17 * h * d, Dist::Normal), DType::F32);
    let k = to_buffer(&values(&mut g, 21 * hk * d, Dist::Normal), DType::F32);
    let v = to_buffer(&values(&mut g, 21 * hk * d, Dist::Normal), DType::F32);
    fn view(b: &flashattn::Buffer, n: usize, hh: usize, d: usize) -> TensorRef<'_> {
        TensorRef::from_slice(b.as_slice(), &[n, hh, d], &[hh * d, d, 1])
    }
    let (qv, kv, vv) = (view(&q, 17, h, d), view(&k, 21, hk, d), view(&v, 21, hk, d));
    let opts = AttnOptions::default().causal(true).learnable_sink(sinks());
    let got = flash_attn(&qv, &kv, &vv, &opts.clone().varlen(&cu_q, &cu_k)).unwrap();
    let want = reference::attention_varlen(&qv, &kv, &vv, &cu_q, &cu_k, &opts).unwrap();
    let nv = naive::attention_varlen(&qv, &kv, &vv, &cu_q, &cu_k, &opts).unwrap();
    check_bound("packed", DType::F32, &got, &[nv], &want, 4.0, 12);
    // Sequence 0: 5 queries over 3 keys, causal: rows 0 and 1 see no key; their lse is the sink.
    let lse = got.lse.as_slice::<f32>().unwrap();
    for hh in 0..h {
        assert_eq!(lse[hh * 17], SINKS[hh], "head {hh}");
    }
}

/// Decoding with sinks, against the f64 reference over the whole cache: 1 and 3 splits and the
/// automatic count (the sink joins after the merge of the splits), contiguous and paged caches.
#[test]
fn decoding_with_sinks() {
    let (b, sq, cap, h, hk, d) = (2, 2, 150, 4, 2, 64);
    for dtype in [DType::F32, DType::BF16] {
        let mut g = rng(9);
        let q = to_buffer(&values(&mut g, b * sq * h * d, Dist::Normal), dtype);
        let kc = to_buffer(&values(&mut g, b * cap * hk * d, Dist::Normal), dtype);
        let vc = to_buffer(&values(&mut g, b * cap * hk * d, Dist::Normal), dtype);
        let cs = [b, cap, hk, d];
        let strides = flashattn::tensor::contiguous_strides(&cs);
        let qv = TensorRef::from_slice(q.as_slice(), &[b, sq, h, d], &[sq * h * d, h * d, d, 1]);
        let attn = AttnOptions::default().causal(true).learnable_sink(sinks());
        let kr = TensorRef::from_slice(kc.as_slice(), &cs, &strides);
        let vr = TensorRef::from_slice(vc.as_slice(), &cs, &strides);
        let want = reference::attention(&qv, &kr, &vr, &attn).unwrap();
        let nv = naive::attention(&qv, &kr, &vr, &attn).unwrap();
        let lens = [cap as i32; 2];
        // Paged: pages of 16 rows, the identity table (pages in order).
        let table: Vec<i32> = (0..(b * cap / 10) as i32).collect();
        for (splits, paged) in [
            (Some(1), false),
            (Some(3), false),
            (None, false),
            (Some(3), true),
        ] {
            let (mut k2, mut v2) = (kc.clone(), vc.clone());
            let mut opts = KvCacheOptions::default().attn(attn.clone());
            opts.num_splits = splits;
            let shape = if paged { [b * cap / 10, 10, hk, d] } else { cs };
            if paged {
                opts = opts.block_table(BlockTable::new(&table, b, cap / 10));
            }
            let st = flashattn::tensor::contiguous_strides(&shape);
            let got = {
                let mut k = flashattn::decode::TensorMut::new(slice_mut(&mut k2), &shape, &st);
                let mut v = flashattn::decode::TensorMut::new(slice_mut(&mut v2), &shape, &st);
                flash_attn_with_kvcache(&qv, &mut k, &mut v, &lens, &opts).unwrap()
            };
            let what = format!("{dtype} splits {splits:?} paged {paged}");
            check_bound(
                &what,
                dtype,
                &got,
                std::slice::from_ref(&nv),
                &want,
                4.0,
                cap,
            );
        }
    }
}

fn slice_mut(b: &mut flashattn::Buffer) -> flashattn::decode::SliceMut<'_> {
    match b {
        flashattn::Buffer::F32(v) => flashattn::decode::SliceMut::F32(v),
        flashattn::Buffer::F16(v) => flashattn::decode::SliceMut::F16(v),
        flashattn::Buffer::BF16(v) => flashattn::decode::SliceMut::BF16(v),
    }
}

#[test]
fn bad_sinks_are_typed_errors() {
    let data = vec![0.25f32; 2 * 3 * 4 * 8];
    let q = TensorRef::contiguous(&data, &[2, 3, 4, 8]);
    let k = TensorRef::contiguous(&data[..2 * 3 * 2 * 8], &[2, 3, 2, 8]);
    let err = |s: TensorRef| {
        flash_attn(&q, &k, &k, &AttnOptions::default().learnable_sink(s))
            .unwrap_err()
            .kind()
            .clone()
    };
    let three = [0.5f32; 3];
    assert_eq!(
        err(TensorRef::contiguous(&three, &[3])),
        ErrorKind::SinkShape {
            got: vec![3],
            heads: 4
        }
    );
    let per_kv = [0.5f32; 8];
    assert!(matches!(
        err(TensorRef::contiguous(&per_kv, &[2, 4])),
        ErrorKind::SinkShape { heads: 4, .. }
    ));
    for bad in [f32::NAN, f32::INFINITY, f32::MAX] {
        let s = [0.5, 0.5, bad, 0.5];
        assert_eq!(
            format!("{:?}", err(TensorRef::contiguous(&s, &[4]))),
            format!(
                "{:?}",
                ErrorKind::SinkValue {
                    head: 2,
                    value: bad
                }
            )
        );
    }
    let h16 = [half::f16::ONE; 4];
    assert!(matches!(
        err(TensorRef::contiguous(&h16, &[4])),
        ErrorKind::DType {
            tensor: "learnable_sink",
            ..
        }
    ));
    let e = err(TensorRef::contiguous(&three, &[3])).to_string();
    assert!(e.contains("learnable_sink") && e.contains("[4]"), "{e}");
    // The CUDA launch descriptions exist with the `cuda` feature only.
    #[cfg(feature = "cuda")]
    {
        // The CUDA forward takes them (a logit per launched sequence and head), its backward the
        // sinks and the rows whose sum makes their gradient.
        let opts = AttnOptions::default().learnable_sink(sinks());
        let d = flashattn::cuda::launch_description(&q, &k, &k, &opts).unwrap();
        let want: Vec<f32> = [SINKS, SINKS].concat();
        assert_eq!(d.sink.as_deref(), Some(&want[..]));
        // Packed, with rows after the last sequence: their launched tail sequence gets -inf (no sink).
        let q3 = TensorRef::contiguous(&data[..6 * 4 * 8], &[6, 4, 8]);
        let k3 = TensorRef::contiguous(&data[..6 * 2 * 8], &[6, 2, 8]);
        let d = flashattn::cuda::launch_description(
            &q3,
            &k3,
            &k3,
            &opts.clone().varlen(&[0, 2, 5], &[0, 3, 6]),
        )
        .unwrap();
        let mut want = [SINKS, SINKS].concat();
        want.extend([f32::NEG_INFINITY; 4]);
        assert_eq!(d.sink.as_deref(), Some(&want[..]));
        let lse_data = vec![0f32; 2 * 4 * 3];
        let lse = TensorRef::contiguous(&lse_data, &[2, 4, 3]);
        let d =
            flashattn::cuda::backward_launch_description(&q, &k, &k, &q, &lse, &q, &opts).unwrap();
        assert_eq!(d.sink.as_deref(), Some(&SINKS[..]));
        assert_eq!(d.sink_rows, [(0, 3), (12, 3)]);
    }
}

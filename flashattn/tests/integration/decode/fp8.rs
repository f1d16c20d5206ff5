//! FP8 caches through the same checks as the other dtypes.

use super::*;

// ---------------------------------------------------------------------------------------------
// FP8 caches
// ---------------------------------------------------------------------------------------------

/// FP8 caches (`flash_attn_with_kvcache_fp8`), both formats, q in every dtype, on every ISA of
/// this CPU: every store, masks, softcap, ALiBi, rotary appends, GQA/MQA, leftpad, several tokens
/// per step, split counts, awkward head dims; the appended bytes and out/lse checked as above on
/// the dequantised caches.
#[test]
fn fp8_caches_against_reference() {
    let mut n = 0;
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for isa in flashattn::simd::available() {
            for dtype in DTYPES {
                n += 1;
                let seed = 9000 + n;
                let base = DCase {
                    dtype,
                    isa: Some(isa),
                    fp8: Some(format),
                    seed,
                    ..DCase::default()
                };
                let cases = [
                    // The decode benchmark shape, small: one token, GQA 4, d = 128.
                    DCase {
                        heads: 32,
                        heads_kv: 8,
                        d: 128,
                        lens: vec![300],
                        cap: 320,
                        ..base.clone()
                    },
                    DCase {
                        d: 59,
                        heads: 12,
                        heads_kv: 3,
                        lens: vec![203, 64],
                        new: Some(2),
                        seqlen_q: 2,
                        cap: 210,
                        alibi: true,
                        softcap: Some(5.0),
                        splits: Some(3),
                        store: Store::Paged(16),
                        ..base.clone()
                    },
                    DCase {
                        d: 40,
                        heads: 6,
                        heads_kv: 1,
                        lens: vec![113, 1, 63],
                        cap: 130,
                        rotary: Some((40, false)),
                        store: Store::Gaps,
                        window: (17, -1),
                        causal: false,
                        ..base.clone()
                    },
                    DCase {
                        d: 111,
                        heads: 4,
                        heads_kv: 4,
                        lens: vec![97, 40],
                        leftpad: Some(vec![9, 0]),
                        new: Some(3),
                        seqlen_q: 3,
                        cap: 101,
                        rotary: Some((64, true)),
                        store: Store::BatchIdx,
                        ..base.clone()
                    },
                    DCase {
                        d: 256,
                        heads: 8,
                        heads_kv: 2,
                        lens: vec![61],
                        new: None,
                        cap: 70,
                        store: Store::Paged(5),
                        splits: Some(2),
                        dist: Dist::Huge(30.0),
                        ..base.clone()
                    },
                    // Gaps between kv heads: each key's heads widened one by one.
                    DCase {
                        d: 33,
                        heads: 6,
                        heads_kv: 3,
                        lens: vec![45, 70],
                        new: Some(2),
                        cap: 80,
                        store: Store::Gaps,
                        ..base.clone()
                    },
                    // Many rows per kv head (MQA, 4 tokens): the outer-product score kernels.
                    DCase {
                        d: 64,
                        heads: 16,
                        heads_kv: 1,
                        lens: vec![150],
                        new: Some(4),
                        seqlen_q: 4,
                        cap: 160,
                        ..base.clone()
                    },
                ];
                for c in &cases {
                    check_case(c);
                }
            }
        }
    }
    assert!(n >= 6, "{n} combinations");
}

/// FP8 calls split over 1, 2, 5 and 16 key ranges agree up to rounding, and paged FP8 caches
/// give what contiguous ones give.
#[test]
fn fp8_splits_and_pages_agree() {
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let base = DCase {
            dtype: DType::BF16,
            heads: 8,
            heads_kv: 2,
            d: 64,
            lens: vec![700, 333],
            cap: 720,
            fp8: Some(format),
            seed: 77,
            ..DCase::default()
        };
        let one = check_case(&DCase {
            splits: Some(1),
            ..base.clone()
        });
        for splits in [2, 5, 16] {
            let r = check_case(&DCase {
                splits: Some(splits),
                ..base.clone()
            });
            close(&one, &r, DType::BF16, &format!("{format} splits {splits}"));
        }
        for ps in [16, 7] {
            let r = check_case(&DCase {
                store: Store::Paged(ps),
                splits: Some(1),
                ..base.clone()
            });
            close(&one, &r, DType::BF16, &format!("{format} page size {ps}"));
        }
    }
}

/// FP8-specific bad input: mismatched cache formats, a q descale, bad factor lists, new keys
/// not in q's dtype; each a typed error, and the caches untouched.
#[test]
fn fp8_bad_input_is_a_typed_error_and_writes_nothing() {
    let c = DCase {
        dtype: DType::BF16,
        fp8: Some(Fp8Format::E4M3),
        ..DCase::default()
    };
    let bl = build(&c);
    let f = bl.fp8.as_ref().unwrap();
    let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
    let q = bl.q_view(&c);
    let opts = bl.opts(&c);
    let good = Descale::default().k(&f.k_descale).v(&f.v_descale);
    let run = |descale: &Descale, opts: &KvCacheOptions| {
        let (mut k, mut v) = (f.k.clone(), f.v.clone());
        let r = call_fp8(
            &q,
            (&mut k, &mut v),
            (f.format, &bl.map),
            &lens,
            descale,
            opts,
        );
        let kind = r.expect_err("bad input accepted").kind().clone();
        assert!(
            k == f.k && v == f.v,
            "a rejected call wrote the caches: {kind:?}"
        );
        kind
    };
    assert_kind!(
        run(&good.q(&[1.0]), &opts),
        ErrorKind::DescaleUnused {
            tensor: "q_descale"
        }
    );
    assert_kind!(
        run(&Descale::default().k(&[1.0, 2.0, 3.0]), &opts),
        ErrorKind::DescaleLength {
            tensor: "k_descale",
            got: 3,
            batch: 1,
            heads_kv: 2
        }
    );
    assert_kind!(
        run(&Descale::default().v(&[1.0, f32::NAN]), &opts),
        ErrorKind::DescaleValue {
            tensor: "v_descale",
            index: 1,
            ..
        }
    );
    assert_kind!(
        run(&Descale::default().k(&[0.0]), &opts),
        ErrorKind::DescaleValue {
            tensor: "k_descale",
            index: 0,
            ..
        }
    );
    // softmax_scale · k_descale overflows f32.
    let big = bl.opts(&c).attn(bl.attn_opts(&c).softmax_scale(4.0));
    assert_kind!(
        run(&Descale::default().k(&[f32::MAX]), &big),
        ErrorKind::Scale { .. }
    );
    // v_descale times the format's largest value leaves f32; so does a score of a unit q
    // against the largest key.
    assert_kind!(
        run(&Descale::default().v(&[1e36]), &opts),
        ErrorKind::DescaleRange { .. }
    );
    assert_kind!(
        run(&Descale::default().k(&[1e36]), &opts),
        ErrorKind::DescaleRange { .. }
    );
    // New keys in another dtype than q.
    let kn: Vec<f32> = vec![0.5; c.heads_kv * c.d];
    let shape = [1, 1, c.heads_kv, c.d];
    let other = bl.opts(&c).new_kv(
        TensorRef::contiguous(&kn, &shape),
        TensorRef::contiguous(&kn, &shape),
    );
    assert_kind!(
        run(&good, &other),
        ErrorKind::DType {
            tensor: "k_new",
            ..
        }
    );
    // An append past the capacity.
    let (mut k, mut v) = (f.k.clone(), f.v.clone());
    let full = [c.cap as i32];
    let r = call_fp8(
        &q,
        (&mut k, &mut v),
        (f.format, &bl.map),
        &full,
        &good,
        &opts,
    );
    assert!(r.is_err() && k == f.k && v == f.v);
    // Caches of two formats.
    let mut k8: Vec<F8E4M3> = f.k.iter().map(|&b| F8E4M3::from_bits(b)).collect();
    let mut v8: Vec<F8E5M2> = f.v.iter().map(|&b| F8E5M2::from_bits(b)).collect();
    let e = flash_attn_with_kvcache_fp8(
        &q,
        &mut Fp8TensorMut::new(&mut k8, &bl.map.shape, &bl.map.strides),
        &mut Fp8TensorMut::new(&mut v8, &bl.map.shape, &bl.map.strides),
        &lens,
        &opts.clone().descale(good),
    )
    .unwrap_err();
    assert_kind!(
        e.kind().clone(),
        ErrorKind::Fp8CacheFormat {
            expected: Fp8Format::E4M3,
            got: Fp8Format::E5M2
        }
    );
    assert!(e.to_string().contains("v_cache"), "{e}");
}

/// Packed queries over FP8 caches (each sequence's descale factors indexed by its batch row):
/// the rows of the packed call are those of one call per sequence with its own factors, bit for
/// bit.
#[test]
fn fp8_packed_queries_match_per_sequence_calls() {
    let q_lens = [3usize, 0, 1, 6, 2, 4];
    let total = q_lens.iter().sum::<usize>() + 2;
    let cu = cumulative(&q_lens);
    for (mi, format) in [
        (0, Fp8Format::E4M3),
        (1, Fp8Format::E5M2),
        (3, Fp8Format::E4M3),
    ] {
        let c = DCase {
            fp8: Some(format),
            ..packed_case(DType::BF16, mi, mi + 1, 950 + mi as u64)
        };
        let bl = build(&c);
        let f = bl.fp8.as_ref().unwrap();
        let (h, hkv, d) = (c.heads, c.heads_kv, c.d);
        let mut rng = common::rng(c.seed ^ 0xc0ffee);
        let qv = values(&mut rng, total * h * d, Dist::Normal);
        let qb = to_buffer(&qv, c.dtype);
        let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
        let call = |q: TensorRef, lens: &[i32], descale: &Descale, opts: &KvCacheOptions| {
            let (mut k, mut v) = (f.k.clone(), f.v.clone());
            call_fp8(&q, (&mut k, &mut v), (format, &bl.map), lens, descale, opts)
                .unwrap_or_else(|e| panic!("{c:?}: {e}"))
        };
        let all = Descale::default().k(&f.k_descale).v(&f.v_descale);
        let packed = call(
            view_of(&qb, &[total, h, d]),
            &lens,
            &all,
            &bl.opts(&c).cu_seqlens_q(&cu),
        );
        let lse = packed.lse.to_f64_vec();
        for (b, &sq) in q_lens.iter().enumerate().filter(|x| *x.1 > 0) {
            let r0 = cu[b] as usize;
            let qs = to_buffer(&qv[r0 * h * d..(r0 + sq) * h * d], c.dtype);
            let own = Alone::new(&c, &bl, b);
            let rows = b * hkv..(b + 1) * hkv;
            let mine = Descale::default()
                .k(&f.k_descale[rows.clone()])
                .v(&f.v_descale[rows]);
            let alone = call(
                view_of(&qs, &[1, sq, h, d]),
                &lens[b..b + 1],
                &mine,
                &own.opts(&c, &bl, b),
            );
            let lse_at = |hh: usize, i: usize| lse[hh * total + r0 + i];
            let what = format!("{c:?}: sequence {b}");
            assert_rows_match(&what, (&packed, r0, &lse_at), &alone, (sq, h, d));
        }
    }
}

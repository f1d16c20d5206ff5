//! Packed queries and packed new keys give what one call per sequence gives.

use super::*;

#[test]
fn packed_queries_match_per_sequence_calls() {
    let q_lens = [3usize, 0, 1, 6, 2, 4];
    let total = q_lens.iter().sum::<usize>() + 2;
    let cu = cumulative(&q_lens);
    let mut n = 0;
    for dtype in DTYPES {
        for mi in 0..4 {
            n += 1;
            let c = packed_case(dtype, mi, n, 900 + n as u64);
            let bl = build(&c);
            let (h, d) = (c.heads, c.d);
            let mut rng = common::rng(c.seed ^ 0xc0ffee);
            let qv = values(&mut rng, total * h * d, Dist::Normal);
            let qb = to_buffer(&qv, dtype);
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            let call = |q: TensorRef, lens: &[i32], opts: &KvCacheOptions| {
                let (mut kc, mut vc) = (bl.k_cache.clone(), bl.v_cache.clone());
                let mut k = TensorMut::new(slice_mut(&mut kc), &bl.map.shape, &bl.map.strides);
                let mut v = TensorMut::new(slice_mut(&mut vc), &bl.map.shape, &bl.map.strides);
                flash_attn_with_kvcache(&q, &mut k, &mut v, lens, opts)
                    .unwrap_or_else(|e| panic!("{c:?}: {e}"))
            };
            let packed = call(
                view_of(&qb, &[total, h, d]),
                &lens,
                &bl.opts(&c).cu_seqlens_q(&cu),
            );
            assert_eq!(packed.out.shape(), &[total, h, d]);
            assert_eq!(packed.lse.shape(), &[h, total]);
            let (out, lse) = (packed.out.to_f64_vec(), packed.lse.to_f64_vec());
            for r in cu[q_lens.len()] as usize..total {
                assert!(out[r * h * d..(r + 1) * h * d].iter().all(|&x| x == 0.0));
                assert!((0..h).all(|hh| lse[hh * total + r] == f64::NEG_INFINITY));
            }
            for (b, &sq) in q_lens.iter().enumerate().filter(|x| *x.1 > 0) {
                let r0 = cu[b] as usize;
                let qs = to_buffer(&qv[r0 * h * d..(r0 + sq) * h * d], dtype);
                let own = Alone::new(&c, &bl, b);
                let alone = call(
                    view_of(&qs, &[1, sq, h, d]),
                    &lens[b..b + 1],
                    &own.opts(&c, &bl, b),
                );
                let what = format!("{c:?}: sequence {b}");
                let lse_at = |hh: usize, i: usize| lse[hh * total + r0 + i];
                assert_rows_match(&what, (&packed, r0, &lse_at), &alone, (sq, h, d));
                if dtype == DType::F32 {
                    // The oracle on the keys this sequence sees.
                    let (lp, sk) = (c.first_key(b), c.seqlen_k(b) - c.first_key(b));
                    let (mut kb, mut vb) = (Vec::new(), Vec::new());
                    let (kc, vc) = (buf_f64(&bl.k_cache), buf_f64(&bl.v_cache));
                    for j in lp..lp + sk {
                        for hk in 0..c.heads_kv {
                            let o = bl.map.offset(b, j, hk);
                            kb.extend(kc[o..o + d].iter().map(|&x| x as f32));
                            vb.extend(vc[o..o + d].iter().map(|&x| x as f32));
                        }
                    }
                    let q32: Vec<f32> = qv[r0 * h * d..(r0 + sq) * h * d]
                        .iter()
                        .map(|&x| x as f32)
                        .collect();
                    let mut ro = AttnOptions::default()
                        .causal(c.causal)
                        .window(c.window.0, c.window.1);
                    if c.alibi {
                        let slopes = &bl.alibi[b * h..(b + 1) * h];
                        ro = ro.alibi_slopes(TensorRef::contiguous(slopes, &[h]));
                    }
                    if c.sink {
                        ro = ro.learnable_sink(TensorRef::contiguous(&bl.sinks, &[h]));
                    }
                    let ks = [1, sk, c.heads_kv, d];
                    let r = reference::attention(
                        &TensorRef::contiguous(&q32, &[1, sq, h, d]),
                        &TensorRef::contiguous(&kb, &ks),
                        &TensorRef::contiguous(&vb, &ks),
                        &ro,
                    )
                    .unwrap();
                    for (x, y) in alone.out.to_f64_vec().iter().zip(&r.out) {
                        assert!((x - y).abs() <= 1e-5, "{what}: out {x} against {y}");
                    }
                }
            }
        }
    }
}

/// New keys of different lengths per sequence (`cu_seqlens_k_new`), with packed or batched
/// queries, and batched new keys with packed queries: the output, the LSEs and the caches
/// afterwards are those of one call per sequence with its own batched new keys, bit for bit.
#[test]
fn packed_new_keys_match_per_sequence_calls() {
    let new_lens = [3usize, 0, 1, 6, 2, 4];
    let cu_new = cumulative(&new_lens);
    let total_new = new_lens.iter().sum::<usize>() + 1;
    let batched_new = 2;
    let mut n = 0;
    // (queries packed, new keys packed).
    for (q_packed, new_packed) in [(true, true), (false, true), (true, false)] {
        for dtype in DTYPES {
            n += 1;
            let mi = n % 4;
            // Packed queries: a chunk per sequence as long as its new keys (chunked prefill), one
            // sequence with more; batched: 2 tokens per sequence.
            let q_lens: Vec<usize> = match (q_packed, new_packed) {
                (true, true) => new_lens
                    .iter()
                    .enumerate()
                    .map(|(b, &l)| l + (b == 2) as usize)
                    .collect(),
                (true, false) => vec![1, 0, 2, 1, 3, 1],
                _ => vec![2; new_lens.len()],
            };
            let seq_new: Vec<usize> = if new_packed {
                new_lens.to_vec()
            } else {
                vec![batched_new; new_lens.len()]
            };
            let c = DCase {
                // The most any sequence appends, so a paged store maps its pages.
                new: Some(6),
                rotary: (n % 3 != 1).then_some((if mi == 3 { 18 } else { 8 }, n % 2 == 0)),
                ..packed_case(dtype, mi, n, 1300 + n as u64)
            };
            let bl = build(&c);
            let (h, hkv, d, batch) = (c.heads, c.heads_kv, c.d, c.batch());
            let mut rng = common::rng(c.seed ^ 0xfeed);
            let total_q = q_lens.iter().sum::<usize>() + 2;
            let sq = q_lens[0];
            let q_rows = if q_packed { total_q } else { batch * sq };
            let qv = values(&mut rng, q_rows * h * d, Dist::Normal);
            let qb = to_buffer(&qv, dtype);
            let new_rows = if new_packed {
                total_new
            } else {
                batch * batched_new
            };
            let kn = buf_f64(&to_buffer(
                &values(&mut rng, new_rows * hkv * d, Dist::Normal),
                dtype,
            ));
            let vn = buf_f64(&to_buffer(
                &values(&mut rng, new_rows * hkv * d, Dist::Uniform),
                dtype,
            ));
            let (knb, vnb) = (to_buffer(&kn, dtype), to_buffer(&vn, dtype));
            let cu_q = cumulative(&q_lens);
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            let call = |q: TensorRef,
                        lens: &[i32],
                        opts: &KvCacheOptions,
                        kv: &mut (Buffer, Buffer)| {
                let mut k = TensorMut::new(slice_mut(&mut kv.0), &bl.map.shape, &bl.map.strides);
                let mut v = TensorMut::new(slice_mut(&mut kv.1), &bl.map.shape, &bl.map.strides);
                flash_attn_with_kvcache(&q, &mut k, &mut v, lens, opts)
                    .unwrap_or_else(|e| panic!("{c:?}: {e}"))
            };
            let q_view = if q_packed {
                view_of(&qb, &[total_q, h, d])
            } else {
                view_of(&qb, &[batch, sq, h, d])
            };
            let new_shape = if new_packed {
                vec![new_rows, hkv, d]
            } else {
                vec![batch, batched_new, hkv, d]
            };
            let mut o = bl
                .opts(&c)
                .new_kv(view_of(&knb, &new_shape), view_of(&vnb, &new_shape));
            if q_packed {
                o = o.cu_seqlens_q(&cu_q);
            }
            if new_packed {
                o = o.cu_seqlens_k_new(&cu_new);
            }
            let mut caches = (bl.k_cache.clone(), bl.v_cache.clone());
            let all = call(q_view, &lens, &o, &mut caches);
            let lse = all.lse.to_f64_vec();
            if q_packed {
                let out = all.out.to_f64_vec();
                for r in cu_q[batch] as usize..total_q {
                    assert!(out[r * h * d..(r + 1) * h * d].iter().all(|&x| x == 0.0));
                    assert!((0..h).all(|hh| lse[hh * total_q + r] == f64::NEG_INFINITY));
                }
            }
            // One call per sequence, on caches that take each call's appends in turn.
            let mut one_by_one = (bl.k_cache.clone(), bl.v_cache.clone());
            for b in 0..batch {
                let (nq, nn) = (q_lens[b], seq_new[b]);
                let r0 = if q_packed { cu_q[b] as usize } else { b * sq };
                let qs = to_buffer(&qv[r0 * h * d..(r0 + nq) * h * d], dtype);
                let n0 = if new_packed {
                    cu_new[b] as usize
                } else {
                    b * batched_new
                };
                let rows = n0 * hkv * d..(n0 + nn) * hkv * d;
                let (kn_b, vn_b) = (
                    to_buffer(&kn[rows.clone()], dtype),
                    to_buffer(&vn[rows], dtype),
                );
                let own = Alone::new(&c, &bl, b);
                let mut ob = own.opts(&c, &bl, b).new_kv(
                    view_of(&kn_b, &[1, nn, hkv, d]),
                    view_of(&vn_b, &[1, nn, hkv, d]),
                );
                ob.rotary = o.rotary.clone();
                let q1 = view_of(&qs, &[1, nq, h, d]);
                let alone = call(q1, &lens[b..b + 1], &ob, &mut one_by_one);
                let what = format!("{c:?}: q packed {q_packed}, new packed {new_packed}, seq {b}");
                let lse_at = |hh: usize, i: usize| {
                    if q_packed {
                        lse[hh * total_q + r0 + i]
                    } else {
                        lse[(b * h + hh) * sq + i]
                    }
                };
                assert_rows_match(&what, (&all, r0, &lse_at), &alone, (nq, h, d));
            }
            let what = format!("{c:?}: q packed {q_packed}, new packed {new_packed}");
            assert_eq!(
                buf_bits(&caches.0),
                buf_bits(&one_by_one.0),
                "{what}: k_cache"
            );
            assert_eq!(
                buf_bits(&caches.1),
                buf_bits(&one_by_one.1),
                "{what}: v_cache"
            );
            assert_ne!(
                buf_bits(&caches.0),
                buf_bits(&bl.k_cache),
                "{what}: nothing appended"
            );
        }
    }
}

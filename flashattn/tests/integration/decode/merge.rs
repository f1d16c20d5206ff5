//! `merge_attn_partials`: attention over shards, bad and empty partials.

use super::*;

/// Attention over keys sharded in 3 (one shard empty: lse -inf), each shard a plain `flash_attn`,
/// merged: equals attention over all keys within rounding and
/// passes the reference bound. Batched and packed layouts.
#[test]
fn merge_reproduces_attention_over_shards() {
    let mut rng = rng(900);
    let (b, sq, h, hkv, d) = (2, 5, 4, 2, 24);
    let shards = [0usize, 70, 130];
    let sk: usize = shards.iter().sum();
    let q: Vec<f32> = (0..b * sq * h * d)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let k: Vec<f32> = (0..b * sk * hkv * d)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let v: Vec<f32> = (0..b * sk * hkv * d)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let qs = [b, sq, h, d];
    let qv = TensorRef::contiguous(&q, &qs);
    let opts = AttnOptions::default();
    let full_k = TensorRef::contiguous(&k, &[b, sk, hkv, d]);
    let full_v = TensorRef::contiguous(&v, &[b, sk, hkv, d]);
    let full = flash_attn(&qv, &full_k, &full_v, &opts).unwrap();
    let mut parts = Vec::new();
    let mut start = 0;
    for &n in &shards {
        // A view of keys start..start + n of every batch row: same strides, offset start.
        let strides = [sk * hkv * d, hkv * d, d, 1];
        let (ks, vs) = (&k[start * hkv * d..], &v[start * hkv * d..]);
        let kv = TensorRef::new(ks, &[b, n, hkv, d], &strides);
        let vv = TensorRef::new(vs, &[b, n, hkv, d], &strides);
        parts.push(flash_attn(&qv, &kv, &vv, &opts).unwrap());
        start += n;
    }
    let outs: Vec<TensorRef> = parts.iter().map(|p| p.out.view()).collect();
    let lses: Vec<TensorRef> = parts.iter().map(|p| p.lse.view()).collect();
    let merged = merge_attn_partials(&outs, &lses).unwrap();
    close(&full, &merged, DType::F32, "merged shards vs full");
    let r = reference::attention(&qv, &full_k, &full_v, &opts).unwrap();
    let nv = naive::attention(&qv, &full_k, &full_v, &opts).unwrap();
    check_bound("merged shards", DType::F32, &merged, &[nv], &r, 1.0, sk);
    // One partial: returned as is.
    let one = merge_attn_partials(&[full.out.view()], &[full.lse.view()]).unwrap();
    assert_bit_identical(&full, &one, "merge of one partial");

    // Packed layout: out [total, h, d], lse [h, total].
    let total = b * sq;
    let packed: Vec<(Vec<f32>, Vec<f32>)> = parts
        .iter()
        .map(|p| {
            let o = p.out.to_f32_vec();
            let l = p.lse.to_f32_vec();
            let mut lp = vec![0f32; h * total];
            for bb in 0..b {
                for hh in 0..h {
                    for i in 0..sq {
                        lp[hh * total + bb * sq + i] = l[(bb * h + hh) * sq + i];
                    }
                }
            }
            (o, lp)
        })
        .collect();
    let outs: Vec<TensorRef> = packed
        .iter()
        .map(|(o, _)| TensorRef::contiguous(o, &[total, h, d]))
        .collect();
    let lses: Vec<TensorRef> = packed
        .iter()
        .map(|(_, l)| TensorRef::contiguous(l, &[h, total]))
        .collect();
    let mp = merge_attn_partials(&outs, &lses).unwrap();
    assert_eq!(mp.out.shape(), &[total, h, d]);
    assert_eq!(mp.lse.shape(), &[h, total]);
    assert_eq!(
        bits(&mp.out),
        bits(&merged.out),
        "packed and batched merges agree"
    );
}

#[test]
fn merge_rejects_bad_partials() {
    let out = vec![0.5f32; 2 * 3 * 4];
    let lse = vec![0.1f32; 3 * 2];
    let o = TensorRef::contiguous(&out, &[1, 2, 3, 4]);
    let l = TensorRef::contiguous(&lse, &[1, 3, 2]);
    let err = |outs: &[TensorRef], lses: &[TensorRef]| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            merge_attn_partials(outs, lses)
        }))
        .expect("no panic")
        .expect_err("rejected")
        .kind()
        .clone()
    };
    assert_eq!(err(&[], &[]), ErrorKind::NoPartials);
    assert_eq!(
        err(std::slice::from_ref(&o), &[]),
        ErrorKind::PartialsCount { outs: 1, lses: 0 }
    );
    let o2 = TensorRef::contiguous(&out, &[1, 2, 4, 3]);
    assert!(matches!(
        err(&[o.clone(), o2], &[l.clone(), l.clone()]),
        ErrorKind::PartialMismatch {
            part: 1,
            tensor: "out_partials",
            ..
        }
    ));
    let l2 = TensorRef::contiguous(&lse, &[1, 2, 3]);
    assert!(matches!(
        err(std::slice::from_ref(&o), &[l2]),
        ErrorKind::PartialMismatch {
            part: 0,
            tensor: "lse_partials",
            ..
        }
    ));
    let mut bad = lse.clone();
    bad[4] = f32::NAN;
    let lb = TensorRef::contiguous(&bad, &[1, 3, 2]);
    assert!(matches!(
        err(&[o.clone(), o.clone()], &[l.clone(), lb]),
        ErrorKind::PartialLse {
            part: 1,
            index: 4,
            ..
        }
    ));
    let mut bad = lse.clone();
    bad[0] = f32::INFINITY;
    let lb = TensorRef::contiguous(&bad, &[1, 3, 2]);
    assert!(matches!(
        err(std::slice::from_ref(&o), &[lb]),
        ErrorKind::PartialLse {
            part: 0,
            index: 0,
            ..
        }
    ));
    let o16 = vec![half::f16::ONE; 24];
    assert!(matches!(
        err(
            &[o.clone(), TensorRef::contiguous(&o16, &[1, 2, 3, 4])],
            &[l.clone(), l.clone()]
        ),
        ErrorKind::PartialMismatch { part: 1, .. }
    ));
    let short = &out[..20];
    assert!(matches!(
        err(
            &[TensorRef::contiguous(short, &[1, 2, 3, 4])],
            std::slice::from_ref(&l)
        ),
        ErrorKind::OutOfBounds {
            tensor: "out_partials",
            ..
        }
    ));
}

/// A split that saw no key (lse -inf) contributes nothing, even if its out holds garbage.
#[test]
fn merge_ignores_empty_partials() {
    let a = vec![0.25f32, -0.5];
    let junk = vec![f32::NAN, 1e30];
    let (la, lj) = (vec![0.7f32], vec![f32::NEG_INFINITY]);
    let m = merge_attn_partials(
        &[
            TensorRef::contiguous(&junk, &[1, 1, 1, 2]),
            TensorRef::contiguous(&a, &[1, 1, 1, 2]),
        ],
        &[
            TensorRef::contiguous(&lj, &[1, 1, 1]),
            TensorRef::contiguous(&la, &[1, 1, 1]),
        ],
    )
    .unwrap();
    assert_eq!(m.out.to_f32_vec(), a);
    assert_eq!(m.lse.to_f32_vec(), la);
    let none = merge_attn_partials(
        &[TensorRef::contiguous(&junk, &[1, 1, 1, 2])],
        &[TensorRef::contiguous(&lj, &[1, 1, 1])],
    )
    .unwrap();
    assert_eq!(none.out.to_f32_vec(), vec![0.0, 0.0]);
    assert_eq!(none.lse.to_f32_vec(), vec![f32::NEG_INFINITY]);
}

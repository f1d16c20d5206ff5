//! Sizes too large to index or allocate, the order of the checks, and an unavailable instruction
//! set.

use super::*;

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

//! The seeded covering grid in every dtype, large and packed-tile shapes, huge logits, and the
//! checker itself.

use super::*;

fn run_grid(dtype: DType) {
    for case in grid(dtype) {
        case.build().check();
    }
}

#[test]
fn grid_f32() {
    run_grid(DType::F32);
}

#[test]
fn grid_f16() {
    run_grid(DType::F16);
}

#[test]
fn grid_bf16() {
    run_grid(DType::BF16);
}

/// The grid covers what it claims: each value of each dimension with each dtype.
#[test]
fn grid_is_covering_and_seeded() {
    for dtype in DTYPES {
        let g = grid(dtype);
        assert_eq!(
            g.len(),
            Axis::ALL.iter().map(|d| d.len()).sum::<usize>() + RANDOM_CASES
        );
        for &hd in &HEAD_DIMS {
            assert!(g.iter().any(|c| c.head_dim == hd));
        }
        for &(sq, sk) in &SEQLENS {
            assert!(g.iter().any(|c| (c.seqlen_q, c.seqlen_k) == (sq, sk)));
        }
        assert!(g.iter().any(|c| matches!(c.dist, Dist::Huge(_))));
        // Same seed, same cases.
        assert_eq!(format!("{:?}", grid(dtype)), format!("{g:?}"));
    }
}

/// Large shapes the grid's budget only reaches with tiny head_dim: seqlen 1023 with d = 64 (16
/// query tiles x 16 key tiles, ragged last tile), causal and not.
#[test]
fn large_square_d64() {
    for (dtype, causal) in [(DType::F32, false), (DType::BF16, true), (DType::F16, true)] {
        let case = Case {
            dtype,
            seqlen_q: 1023,
            seqlen_k: 1023,
            heads: 2,
            heads_kv: 1,
            head_dim: 64,
            causal,
            layout: Layout::Packed,
            seed: 77,
            ..Case::default()
        };
        case.build().check();
    }
}

/// Shapes whose key blocks are visited often enough (GQA group 4, several query blocks) that the
/// forward packs k and v once per call instead of copying tiles at every visit: every dtype,
/// batches of 3 (each sequence's tiles found by its own offset), contiguous and strided views,
/// with softcap and ALiBi.
#[test]
fn packed_key_tiles() {
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        for (layout, softcap, alibi) in [
            (Layout::Contiguous, None, Alibi::None),
            (Layout::Padded, Some(30.0), Alibi::PerBatchHead),
        ] {
            let case = Case {
                dtype,
                batch: 3,
                seqlen_q: 700,
                seqlen_k: 90,
                heads: 8,
                heads_kv: 2,
                head_dim: 59,
                softcap,
                alibi,
                layout,
                seed: 900 + i as u64,
                ..Case::default()
            };
            case.build().check();
        }
    }
}

/// Scores of ~1e3-1e4 in every dtype, with each mask kind: softmax nearly one-hot.
#[test]
fn huge_logits() {
    for dtype in DTYPES {
        for (i, &(causal, window)) in MASKS.iter().enumerate().step_by(3) {
            let mut case = Case {
                dtype,
                seqlen_q: 113,
                seqlen_k: 203,
                heads: 2,
                heads_kv: 2,
                head_dim: 40,
                causal,
                window,
                seed: 500 + i as u64,
                ..Case::default()
            };
            case.dist = huge(dtype, case.effective_scale());
            case.build().check();
        }
    }
}

/// The checker itself: it must reject a result that is slightly off, has a NaN (an unwritten
/// element), or has a wrong -inf pattern, and accept the real one.
#[test]
fn checker_rejects_bad_results() {
    let case = Case {
        seqlen_q: 70,
        seqlen_k: 30,
        heads: 2,
        heads_kv: 1,
        causal: true,
        seed: 2,
        ..Case::default()
    };
    let inp = case.build();
    let (flash, nv, r) = (inp.flash(), inp.naive(), inp.reference());
    let e = check_bound(
        "real",
        DType::F32,
        &flash,
        std::slice::from_ref(&nv),
        &r,
        1.0,
        30,
    );
    let bound = NAIVE_FACTOR * e.out_naive + e.out_floor;
    let rejects = |out: Vec<f32>, lse: Vec<f32>| {
        let bad = AttnOutput {
            out: flashattn::Tensor::from_vec(out, flash.out.shape()).unwrap(),
            lse: flashattn::Tensor::from_vec(lse, flash.lse.shape()).unwrap(),
        };
        std::panic::catch_unwind(|| {
            check_bound(
                "bad",
                DType::F32,
                &bad,
                std::slice::from_ref(&nv),
                &r,
                1.0,
                30,
            )
        })
        .is_err()
    };
    let (out, lse) = (flash.out.to_f32_vec(), flash.lse.to_f32_vec());
    let last = out.len() - 1;
    let mut o = out.clone();
    o[last] += 3.0 * bound as f32;
    assert!(rejects(o, lse.clone()), "perturbed out accepted");
    let mut o = out.clone();
    o[last] = f32::NAN;
    assert!(rejects(o, lse.clone()), "NaN out accepted");
    let mut l = lse.clone();
    l[69] = f32::NEG_INFINITY; // row 69 of head 0 sees keys
    assert!(rejects(out.clone(), l), "wrong -inf accepted");
    let mut l = lse.clone();
    l[0] = 0.0; // row 0 sees no key (offset -40)
    assert!(rejects(out.clone(), l), "missing -inf accepted");
    let mut o = out.clone();
    o[0] = 1e-3; // row 0 must be exactly 0
    assert!(rejects(o, lse.clone()), "nonzero masked row accepted");
    assert!(!rejects(out, lse), "the real result rejected");
}

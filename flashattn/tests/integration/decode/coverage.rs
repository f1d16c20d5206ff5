//! Every option against the reference: masks, softcap, ALiBi, GQA, left pads, awkward shapes,
//! rotary, paged and strided caches.

use super::*;

/// Every dtype × masks, softcap, ALiBi, GQA ratios, seqlen_q 1 and > 1, appends or none.
#[test]
fn options_against_reference() {
    let masks = MASKS;
    let heads = [(1, 1), (4, 1), (6, 2), (8, 8), (32, 8)];
    let mut n = 0;
    for dtype in DTYPES {
        for (mi, &(causal, window)) in masks.iter().enumerate() {
            for (hi, &(h, hkv)) in heads.iter().enumerate() {
                n += 1;
                let c = DCase {
                    dtype,
                    seqlen_q: [1, 1, 3, 2, 4][(mi + hi) % 5],
                    heads: h,
                    heads_kv: hkv,
                    d: [16, 40, 64, 59, 128][(mi + 2 * hi) % 5],
                    cap: 240,
                    lens: [vec![203], vec![63, 113], vec![1, 0, 150]][(mi + hi) % 3].clone(),
                    new: [Some(4), None, Some(1), Some(2)][(mi + hi) % 4],
                    causal,
                    window,
                    softcap: [None, Some(30.0), Some(2.5)][(n) % 3],
                    alibi: n % 2 == 0,
                    seed: n as u64,
                    ..DCase::default()
                };
                let c = DCase {
                    seqlen_q: if c.new.is_some() {
                        c.seqlen_q.min(c.seqlen_new())
                    } else {
                        c.seqlen_q
                    },
                    ..c
                };
                check_case(&c);
            }
        }
    }
}

/// `cache_leftpad` (flash-attn's): keys before `cache_leftpad[b]` are hidden and the masks and
/// ALiBi count from there; against the oracle over the remaining keys in every dtype, with the
/// masks, ALiBi, softcap, rotary, GQA, contiguous, mapped and paged caches, 1 and 3 splits, and
/// pads of 0, inside the cache, at its end (only the appended keys remain) and, with nothing
/// appended, over the whole cache (no key: out 0, lse -inf).
#[test]
fn leftpad_hides_the_first_keys() {
    let masks = [MASKS[0], MASKS[1], MASKS[2], MASKS[4]];
    let stores = [
        Store::Contiguous,
        Store::Paged(7),
        Store::BatchIdx,
        Store::Gaps,
    ];
    let mut n = 0;
    for dtype in DTYPES {
        for (mi, &(causal, window)) in masks.iter().enumerate() {
            n += 1;
            let new = [Some(2), None, Some(3), Some(1)][mi];
            let c = DCase {
                dtype,
                seqlen_q: new.unwrap_or(2),
                heads: 8,
                heads_kv: 2,
                d: [16, 40, 64, 59][mi],
                cap: 96,
                lens: vec![63, 40, 1, 0, 31],
                leftpad: Some(if new.is_some() {
                    vec![0, 13, 1, 0, 30]
                } else {
                    vec![0, 13, 1, 0, 31]
                }),
                new,
                causal,
                window,
                softcap: [None, Some(5.0)][n % 2],
                alibi: n % 2 == 1,
                rotary: (mi == 2).then_some((8, n % 2 == 0)),
                store: stores[(mi + n) % 4],
                splits: [Some(1), Some(3), None][n % 3],
                seed: 700 + n as u64,
                ..DCase::default()
            };
            check_case(&c);
        }
    }
}

/// Odd head dims and cache lengths, rows with an empty cache, seqlen_q > seqlen_new, large scores.
#[test]
fn awkward_shapes() {
    let mut seed = 100;
    for dtype in DTYPES {
        for &(d, lens, new, sq) in &[
            (40usize, &[1usize, 63][..], Some(1usize), 1usize),
            (59, &[113, 0, 203], Some(3), 3),
            (111, &[203], None, 2),
            (1, &[0, 0], Some(2), 1),
            (256, &[63], Some(1), 1),
            (59, &[0], None, 1),    // no key at all: out 0, lse -inf
            (40, &[5], Some(2), 6), // seqlen_q > seqlen_new: first queries see only the cache
        ] {
            for dist in [Dist::Normal, Dist::Huge(300.0)] {
                seed += 1;
                check_case(&DCase {
                    dtype,
                    d,
                    lens: lens.to_vec(),
                    new,
                    seqlen_q: sq,
                    cap: 210,
                    heads: 6,
                    heads_kv: 3,
                    dist,
                    seed,
                    ..DCase::default()
                });
            }
        }
    }
}

/// Two property-test draws (seeds 23 and 26, 10000 cases) with rotary, ALiBi, causal masks and
/// logits of ~30 in bf16, on every instruction set: the AVX-512 kernels multiplied q rounded to
/// bf16 while the others kept the rotated q in f32, and their outputs differed by 0.05, past
/// the bound. Now every kernel rounds the rotated q to q's dtype (flash-attn's contract), and so
/// does the test's oracle.
#[test]
fn rotary_with_huge_logits_on_every_isa() {
    let base = DCase {
        dtype: DType::BF16,
        seqlen_q: 5,
        heads: 4,
        heads_kv: 1,
        d: 16,
        cap: 115,
        lens: vec![4],
        leftpad: None,
        new: Some(3),
        causal: true,
        window: (-1, -1),
        softcap: None,
        alibi: true,
        sink: false,
        rotary: Some((16, true)),
        store: Store::Gaps,
        splits: Some(1),
        isa: None,
        dist: Dist::Huge(30.0),
        seed: 16769291133991644983,
        fp8: None,
    };
    let fp8 = DCase {
        seqlen_q: 2,
        heads: 6,
        heads_kv: 2,
        d: 111,
        cap: 89,
        lens: vec![43, 21],
        window: (2, 5),
        sink: true,
        rotary: Some((90, true)),
        store: Store::Paged(6),
        splits: Some(4),
        seed: 4123520806240085775,
        fp8: Some(Fp8Format::E4M3),
        ..base.clone()
    };
    for c in [base, fp8] {
        let outs: Vec<Vec<f64>> = flashattn::simd::available()
            .into_iter()
            .map(|isa| {
                check_case(&DCase {
                    isa: Some(isa),
                    ..c.clone()
                })
                .out
                .to_f64_vec()
            })
            .collect();
        // The instruction sets agree to bf16's rounding of P (the AVX-512 bf16 P·V), not 0.05.
        for o in &outs[1..] {
            let diff = o
                .iter()
                .zip(&outs[0])
                .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff < 1e-2, "{c:?}: instruction sets differ by {diff}");
        }
    }
}

/// Rotary: interleaved and not, rotary_dim < d, GQA, every dtype; k_new at positions
/// cache_seqlens[b] + i, q there too when causal and at cache_seqlens[b] when not (flash-attn).
#[test]
fn rotary_against_own_rotation() {
    let mut seed = 200;
    for dtype in DTYPES {
        for &(d, rot) in &[(64usize, 64usize), (64, 32), (40, 16), (59, 58), (128, 2)] {
            for inter in [false, true] {
                for causal in [true, false] {
                    seed += 1;
                    check_case(&DCase {
                        dtype,
                        d,
                        rotary: Some((rot, inter)),
                        causal,
                        lens: vec![37, 0, 90],
                        new: Some(2),
                        seqlen_q: 2,
                        heads: 8,
                        heads_kv: 2,
                        cap: 100,
                        seed,
                        ..DCase::default()
                    });
                }
            }
        }
    }
}

/// Paged caches of several page sizes, shuffled pages: each against the reference, and bit for
/// bit the contiguous result (tiles span pages, so both layouts run the same tiles over the same
/// values; only the addresses differ).
#[test]
fn paged_matches_contiguous() {
    let mut seed = 300;
    for dtype in DTYPES {
        for rotary in [None, Some((32, false))] {
            seed += 1;
            let base = DCase {
                dtype,
                d: 64,
                heads: 8,
                heads_kv: 2,
                lens: vec![203, 1, 0, 77],
                new: Some(3),
                seqlen_q: 3,
                cap: 256,
                alibi: true,
                softcap: Some(20.0),
                rotary,
                splits: Some(1),
                seed,
                ..DCase::default()
            };
            let contiguous = check_case(&base);
            for ps in [1, 3, 16, 256] {
                let paged = check_case(&DCase {
                    store: Store::Paged(ps),
                    ..base.clone()
                });
                assert_bit_identical(&contiguous, &paged, &format!("{dtype} page {ps}"));
            }
        }
    }
}

/// Caches behind cache_batch_idx and with gaps between heads/rows/batches (gaps hold NaN).
#[test]
fn batch_idx_and_strided_caches() {
    let mut seed = 400;
    for dtype in DTYPES {
        for store in [Store::BatchIdx, Store::Gaps] {
            seed += 1;
            check_case(&DCase {
                dtype,
                store,
                lens: vec![30, 0, 61],
                new: Some(2),
                seqlen_q: 2,
                d: 40,
                heads: 6,
                heads_kv: 2,
                cap: 64,
                rotary: Some((40, true)),
                seed,
                ..DCase::default()
            });
        }
    }
}

//! Split counts, instruction sets, thread counts and blocks of keys or queries: each gives the
//! same result.

use super::*;

/// Split counts 1, 2, 3, 7 and automatic: each against the reference, and within rounding of each
/// other; with one split the merge is exact, so automatic on one thread equals 1 split bit for bit.
#[test]
fn split_counts_agree() {
    let mut seed = 500;
    for dtype in DTYPES {
        for (causal, window) in [(false, (-1, -1)), (true, (-1, -1)), (true, (100, -1))] {
            seed += 1;
            let base = DCase {
                dtype,
                d: 128,
                heads: 32,
                heads_kv: 8,
                lens: vec![1500, 3, 700],
                new: Some(1),
                cap: 1600,
                causal,
                window,
                seed,
                ..DCase::default()
            };
            let one = check_case(&DCase {
                splits: Some(1),
                ..base.clone()
            });
            for n in [2, 3, 7, 64] {
                let r = check_case(&DCase {
                    splits: Some(n),
                    ..base.clone()
                });
                close(&one, &r, dtype, &format!("{dtype} splits {n}"));
            }
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let auto_one_thread = pool.install(|| check_case(&base));
            assert_bit_identical(&one, &auto_one_thread, "auto split count on one thread");
        }
    }
}

/// A split with no keys that starts at the end of a full cache (more splits than keys). Found by
/// the property test below: the page of its first key was looked up although it reads none, which
/// indexed past the block table (or a contiguous cache's one page) and panicked.
#[test]
fn empty_split_at_a_full_cache() {
    for dtype in DTYPES {
        for c in empty_split_cases(dtype) {
            check_case(&c);
        }
    }
}

/// The portable scalar kernels (the twin of the AVX-512 ones) on the same cases.
#[test]
fn every_isa_matches_reference() {
    let mut seed = 600;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            seed += 1;
            check_case(&DCase {
                dtype,
                isa: Some(isa),
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
                seed,
                ..DCase::default()
            });
        }
    }
}

/// A fixed split count gives bit-identical results on 1 and 2 threads.
#[test]
fn thread_count_does_not_change_results() {
    let c = DCase {
        d: 64,
        heads: 8,
        heads_kv: 2,
        lens: vec![900, 400],
        cap: 1000,
        splits: Some(4),
        seed: 700,
        ..DCase::default()
    };
    let bl = build(&c);
    let runs: Vec<AttnOutput> = [1, 2]
        .iter()
        .map(|&t| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap();
            pool.install(|| bl.call(&c).0.unwrap())
        })
        .collect();
    assert_bit_identical(&runs[0], &runs[1], "1 vs 2 threads");
}

/// Shapes whose products run in sub-blocks of 4 or 8 keys (a key's rows of all kv heads over 4
/// KiB): f32 at d = 256 (4 keys), bf16 and f16 at d = 256 (8 keys, bf16 through its key-pair
/// path); contiguous and paged caches (pages of 5 and 16 tokens, so sub-blocks straddle pages),
/// cache lengths that leave partial sub-blocks, masks, several query rows, every ISA.
#[test]
fn sub_blocks_of_keys() {
    let mut seed = 900;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            for store in [Store::Contiguous, Store::Paged(5), Store::Paged(16)] {
                for (causal, window) in [(false, (-1, -1)), (true, (37, -1))] {
                    seed += 1;
                    check_case(&DCase {
                        dtype,
                        isa: Some(isa),
                        d: 256,
                        heads: 16,
                        heads_kv: 8,
                        lens: vec![203, 37],
                        new: Some(2),
                        seqlen_q: 2,
                        cap: 240,
                        causal,
                        window,
                        splits: Some(2),
                        store,
                        seed,
                        ..DCase::default()
                    });
                }
            }
        }
    }
}

/// Many query rows per kv head, where AVX-512 takes q transposed for the score product (16 or
/// more rows: MQA, several tokens per step): 16, 17 (a partial vector of rows), 32 and 96 rows
/// (6 vectors: a 4- and a 2-vector tile); even and odd head dims (bf16 with an odd d runs the
/// widening form); contiguous and paged caches; masks that differ from row to row; every ISA.
#[test]
fn many_rows_per_kv_head() {
    let mut seed = 1000;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            for (i, &shape) in [
                (32, 1, 1, 128),
                (16, 2, 2, 64),
                (17, 1, 1, 111),
                (32, 1, 3, 40),
            ]
            .iter()
            .enumerate()
            {
                seed += 1;
                check_case(&DCase {
                    causal: i % 2 == 1,
                    window: if i == 2 { (50, -1) } else { (-1, -1) },
                    softcap: (i == 3).then_some(20.0),
                    store: if i % 2 == 0 {
                        Store::Paged(7)
                    } else {
                        Store::Contiguous
                    },
                    splits: Some(3),
                    ..DCase::steps((dtype, isa), shape, (&[203, 61], 240), seed)
                });
            }
        }
    }
}

/// The decode benchmark shape, smaller cache: q [1, 1, 32, 128], kv heads 8, 4096 cached tokens.
#[test]
fn benchmark_shape_small_cache() {
    for dtype in [DType::F32, DType::BF16] {
        check_case(&DCase {
            dtype,
            d: 128,
            heads: 32,
            heads_kv: 8,
            lens: vec![4095],
            new: Some(1),
            cap: 4096,
            seed: 800,
            ..DCase::default()
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: typed errors, caches untouched
// ---------------------------------------------------------------------------------------------

/// More query rows than one work item holds (256 rows: positions × heads, at d <= 128), so a
/// sequence's queries are cut into blocks of unequal size (32 heads × 9 positions: blocks of 8
/// and 1 positions; 48 heads × 7: 5 and 2), each with its own key range under a causal or
/// windowed mask, merged over several splits; every ISA and dtype.
#[test]
fn query_blocks_of_unequal_size() {
    let mut seed = 2000;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            for (i, &shape) in [(32, 8, 9, 64), (48, 6, 7, 40)].iter().enumerate() {
                for splits in [None, Some(3)] {
                    seed += 1;
                    check_case(&DCase {
                        causal: i == 0,
                        window: if i == 1 { (30, 0) } else { (-1, -1) },
                        splits,
                        ..DCase::steps((dtype, isa), shape, (&[150, 61], 200), seed)
                    });
                }
            }
        }
    }
}

//! The same bits whatever the thread count, and on repeated calls.

use super::*;

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// Same call in pools of 1, 2 and 3 threads: bit-identical out and lse, batched and varlen, causal
/// and not, all dtypes.
#[test]
fn thread_count_determinism() {
    for dtype in DTYPES {
        // Batched, causal, GQA, several query tiles per head.
        let case = Case {
            dtype,
            batch: 2,
            seqlen_q: 203,
            seqlen_k: 300,
            heads: 6,
            heads_kv: 2,
            head_dim: 64,
            causal: true,
            alibi: Alibi::PerHead,
            softcap: Some(20.0),
            seed: 8,
            ..Case::default()
        };
        let inp = case.build();
        let runs: Vec<AttnOutput> = [1, 2, 3]
            .iter()
            .map(|&t| in_pool(t, || inp.flash()))
            .collect();
        assert_bit_identical(&runs[0], &runs[1], &format!("{case}: 1 vs 2 threads"));
        assert_bit_identical(&runs[0], &runs[2], &format!("{case}: 1 vs 3 threads"));

        // Varlen, causal and windowed.
        let (lq, lk) = ([70usize, 0, 150, 3], [90usize, 5, 129, 0]);
        let p = Packed::new(&lq, &lk, 2, 0, 4, 1, 32, 99);
        let (tq, tk) = (p.total_q(), p.total_k());
        let (qb, kb, vb) = (
            to_buffer(&p.q, dtype),
            to_buffer(&p.k, dtype),
            to_buffer(&p.v, dtype),
        );
        let q = TensorRef::from_slice(qb.as_slice(), &[tq, 4, 32], &[128, 32, 1]);
        let k = TensorRef::from_slice(kb.as_slice(), &[tk, 1, 32], &[32, 32, 1]);
        let v = TensorRef::from_slice(vb.as_slice(), &[tk, 1, 32], &[32, 32, 1]);
        let (cq, ck) = (Packed::cu(&lq), Packed::cu(&lk));
        for opts in [
            AttnOptions::default().causal(true),
            AttnOptions::default().window(30, 2),
        ] {
            let runs: Vec<AttnOutput> = [1, 2, 3]
                .iter()
                .map(|&t| {
                    in_pool(t, || {
                        flash_attn(&q, &k, &v, &opts.clone().varlen(&cq, &ck)).unwrap()
                    })
                })
                .collect();
            assert_bit_identical(
                &runs[0],
                &runs[1],
                &format!("{dtype} varlen {opts:?}: 1 vs 2 threads"),
            );
            assert_bit_identical(
                &runs[0],
                &runs[2],
                &format!("{dtype} varlen {opts:?}: 1 vs 3 threads"),
            );
        }
    }
}

/// Repeating a call gives the same bits (no state carried between calls, e.g. in thread scratch).
#[test]
fn repeated_calls_are_identical() {
    let mut r = rng(4);
    let mut cases: Vec<Case> = (0..3)
        .map(|i| Case {
            dtype: DTYPES[i],
            seqlen_q: 65,
            seqlen_k: 129,
            heads: 2,
            heads_kv: 2,
            head_dim: *[8usize, 64, 111].choose(&mut r).unwrap(),
            seed: i as u64,
            ..Case::default()
        })
        .collect();
    cases.shuffle(&mut r);
    for case in cases {
        let inp = case.build();
        let a = inp.flash();
        // A different problem in between, on the same threads' scratch.
        let _ = Case {
            head_dim: 256,
            seqlen_q: 200,
            seed: 1,
            ..case.clone()
        }
        .build()
        .flash();
        assert_bit_identical(&a, &inp.flash(), &format!("{case}: repeated"));
    }
}

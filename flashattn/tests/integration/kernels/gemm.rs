//! The products `gemm`, `gemm_scores` and `gemm_bf16` against f64 and the scalar twin.

use super::*;

/// Every size of the grid, both accumulate modes, every chunk length, on every SIMD table, against
/// f64 within the derived bound; C outside the block untouched.
#[test]
fn gemm_matches_f64_within_the_chunked_summation_bound() {
    let kernels = simd_kernels();
    if kernels.is_empty() {
        return;
    }
    for (shape, lay, seed) in grid() {
        let mut rng = common::rng(0x6e33_0000 + seed);
        let ops = Operands::new(shape, lay, || uniform(&mut rng));
        let c0: Vec<f32> = (0..ops.m * ops.n).map(|_| uniform(&mut rng)).collect();
        let (sum, abs) = ops.reference(f32_dot);
        for kern in &kernels {
            for accumulate in [false, true] {
                for kc in KCS {
                    let mut c = ops.c_initial(accumulate, &c0);
                    kern.gemm(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                    let run = Run {
                        what: "gemm",
                        isa: kern.isa,
                        accumulate,
                        kc,
                        lay,
                    };
                    let terms = if ops.k == 0 {
                        0.0
                    } else {
                        f32_bound_terms(ops.k, kc)
                    };
                    check_c(&ops, &run, &c, &c0, (&sum, &abs), terms);
                }
            }
        }
    }
}

/// With small integers every sum is exact: the SIMD kernels must equal the scalar twin exactly,
/// on every layout, both modes and every chunk length.
#[test]
fn gemm_equals_the_scalar_twin_on_exact_sums() {
    let kernels = simd_kernels();
    let scalar = scalar();
    for &m in &[0, 1, 3, 4, 5, 64, 113] {
        for &n in &[16, 48, 80, 256] {
            for &k in &[0, 1, 9, 33, 256] {
                for (li, lay) in LAYOUTS.into_iter().enumerate() {
                    let mut rng = common::rng(0x1e7 + (m * 1_000_000 + n * 1000 + k) as u64);
                    let ops = Operands::new((m, n, k), lay, || small_int(&mut rng));
                    let c0: Vec<f32> = (0..m * n).map(|_| small_int(&mut rng)).collect();
                    for accumulate in [false, true] {
                        let mut want = ops.c_initial(accumulate, &c0);
                        scalar.gemm(&ops.gemm(accumulate, 32), &mut want, ops.c_rs);
                        for kern in &kernels {
                            for kc in KCS {
                                let mut c = ops.c_initial(accumulate, &c0);
                                kern.gemm(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                                let same = c
                                    .iter()
                                    .zip(&want)
                                    .all(|(x, y)| x == y || x.to_bits() == y.to_bits());
                                assert!(
                                    same,
                                    "gemm on {}: m={m} n={n} k={k} layout {li} accumulate={accumulate} kc={kc} differs from scalar",
                                    kern.isa
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `gemm_rescaled` (C multiplied per lane as the product adds to it) gives the bits of the same
/// table's `rescale_o` (row by row) then `gemm`, on every table, size of the grid with C's rows
/// `c_rs >= n` apart (the forward computes lane ranges of its tiles) and chunk length; scale
/// factors random, 1, 0 and below 1; C's padding lanes and rows after the block untouched.
#[test]
fn gemm_rescaled_is_rescale_o_then_gemm() {
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        for (shape, lay, seed) in grid() {
            let mut rng = common::rng(0x5ca1_0000 + seed);
            let ops = Operands::new(shape, lay, || uniform(&mut rng));
            let (m, n, c_rs) = (ops.m, ops.n, ops.c_rs);
            let c0: Vec<f32> = (0..(m + 2) * c_rs).map(|_| uniform(&mut rng)).collect();
            let alpha: Vec<f32> = (0..n)
                .map(|j| match j % 4 {
                    0 => 1.0,
                    1 => 0.0,
                    _ => uniform(&mut rng).abs().min(1.0),
                })
                .collect();
            for kc in KCS {
                let g = ops.gemm(true, kc);
                let mut want = c0.clone();
                for i in 0..m {
                    kern.rescale_o(&mut want[i * c_rs..i * c_rs + n], 1, n, &alpha);
                }
                kern.gemm(&g, &mut want, c_rs);
                let mut c = c0.clone();
                kern.gemm_rescaled(&g, &mut c, c_rs, &alpha);
                let at = c
                    .iter()
                    .zip(&want)
                    .position(|(x, y)| x.to_bits() != y.to_bits());
                assert!(
                    at.is_none(),
                    "{}: gemm_rescaled differs at C[{at:?}]: m={m} n={n} c_rs={c_rs} k={} kc={kc}",
                    kern.isa,
                    ops.k
                );
            }
        }
    }
}

/// `gemm_scores` (k split in two halves, chunks of KC_SCORES, overwrite) on every SIMD table and
/// the scalar one, against f64. C's rows are not padded here (c_rs = n, as the forward pass calls
/// it); the rows after the block must be untouched.
#[test]
fn gemm_scores_matches_f64_within_its_bound() {
    let mut kernels = simd_kernels();
    kernels.push(scalar());
    for (lay, ops) in score_cases(0x5c0_0000) {
        let (sum, abs) = ops.reference(f32_dot);
        for kern in &kernels {
            // `accumulate` is ignored: scores are always overwritten.
            for accumulate in [false, true] {
                let mut c = ops.c_initial(false, &[]);
                let mut tmp = vec![f32::from_bits(POISON); ops.c_len()];
                kern.gemm_scores(&ops.gemm(accumulate, KC), &mut c, ops.c_rs, &mut tmp);
                let run = Run {
                    what: "gemm_scores",
                    isa: kern.isa,
                    accumulate: false,
                    kc: KC_SCORES,
                    lay,
                };
                let terms = if ops.k == 0 {
                    0.0
                } else {
                    f32_bound_terms(ops.k, KC_SCORES) + 1.0
                };
                check_c(&ops, &run, &c, &[], (&sum, &abs), terms);
            }
        }
    }
}

/// A dedicated `gemm_scores` kernel (AVX-512) adds in the same order as the portable split (two
/// chunked `gemm` calls and an add pass), so every SIMD table gives the same scores (up to the sign
/// of a zero).
#[test]
fn gemm_scores_gives_the_same_bits_on_every_simd_table() {
    let kernels = simd_kernels();
    if kernels.len() < 2 {
        return;
    }
    for (lay, ops) in score_cases(0x5b17_0000) {
        let run = |kern: &Kernels| {
            let mut c = ops.c_initial(false, &[]);
            let mut tmp = vec![0f32; ops.c_len()];
            kern.gemm_scores(&ops.gemm(false, KC), &mut c, ops.c_rs, &mut tmp);
            c
        };
        let first = run(kernels[0]);
        for kern in &kernels[1..] {
            let c = run(kern);
            let at = c.iter().zip(&first).position(|(x, y)| x != y);
            assert!(
                at.is_none(),
                "gemm_scores: {} and {} differ at C[{}] ({:e} vs {:e}): m={} n={} k={} {lay:?}",
                kernels[0].isa,
                kern.isa,
                at.unwrap(),
                c[at.unwrap()],
                first[at.unwrap()],
                ops.m,
                ops.n,
                ops.k
            );
        }
    }
}

/// Every table's `gemm_scores` (the dedicated AVX-512 kernel, the fallback elsewhere)
/// gives the bits of its contract computed with the same table's `gemm`: k split in two halves
/// (one when a half is shorter than `KC_SCORES`), each summed in chunks of `KC_SCORES` from its
/// start, the second half added to the first.
#[test]
fn gemm_scores_is_two_chunked_halves_of_gemm() {
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        for (lay, ops) in score_cases(0x2a17_0000) {
            if ops.m == 0 {
                // A is then empty and the halves below cannot slice it; gemm_scores itself
                // handles no rows (gemm_scores_with_no_rows_touches_nothing).
                continue;
            }
            let mut c = ops.c_initial(false, &[]);
            let mut tmp = vec![0f32; ops.c_len()];
            kern.gemm_scores(&ops.gemm(false, KC), &mut c, ops.c_rs, &mut tmp);
            // The contract, by hand.
            let g = ops.gemm(false, KC_SCORES);
            let half = if ops.k / 2 < KC_SCORES {
                ops.k
            } else {
                ops.k / 2
            };
            let mut want = ops.c_initial(false, &[]);
            kern.gemm(&Gemm { k: half, ..g }, &mut want, ops.c_rs);
            if half < ops.k {
                let hi = Gemm {
                    k: ops.k - half,
                    a: &ops.a[half * ops.a_cs..],
                    b: &ops.b[half * ops.b_rs..],
                    ..g
                };
                let mut t = ops.c_initial(false, &[]);
                kern.gemm(&hi, &mut t, ops.c_rs);
                for i in 0..ops.m {
                    for j in 0..ops.n {
                        want[i * ops.c_rs + j] += t[i * ops.c_rs + j];
                    }
                }
            }
            let at = c
                .iter()
                .zip(&want)
                .position(|(x, y)| x.to_bits() != y.to_bits() && x != y);
            assert!(
                at.is_none(),
                "{}: gemm_scores differs from its two halves at C[{}] ({:e} vs {:e}): m={} n={} k={} {lay:?}",
                kern.isa,
                at.unwrap(),
                c[at.unwrap()],
                want[at.unwrap()],
                ops.m,
                ops.n,
                ops.k
            );
        }
    }
}

/// `Kernels::scores`, the attention calls' score product: with softcap, `gemm_scores`'s bits on
/// every table; without, `gemm_scores`'s on a table with its own kernel (AVX-512) and elsewhere
/// one `gemm` overwrite in chunks of `KC`, within that order's f64 bound. C's block and the scratch
/// start poisoned, C's other elements as sentinels that must stay.
#[test]
fn scores_take_the_split_only_with_softcap_or_for_free() {
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        for (lay, ops) in score_cases(0x5c07_0000) {
            let (sum, abs) = ops.reference(f32_dot);
            let run = |f: &dyn Fn(&mut [f32], &mut [f32])| {
                let mut c = ops.c_initial(false, &[]);
                let mut tmp = vec![f32::from_bits(POISON); ops.c_len()];
                f(&mut c, &mut tmp);
                c
            };
            let g = ops.gemm(true, KC);
            let split = run(&|c, t| kern.gemm_scores(&g, c, ops.c_rs, t));
            let one_pass = run(&|c, _| kern.gemm(&ops.gemm(false, KC), c, ops.c_rs));
            for softcap in [true, false] {
                let got = run(&|c, t| kern.scores(&g, c, ops.c_rs, t, softcap));
                let split_expected = softcap || kern.isa == Isa::Avx512;
                let want = if split_expected { &split } else { &one_pass };
                let at = got
                    .iter()
                    .zip(want)
                    .position(|(x, y)| x.to_bits() != y.to_bits() && x != y);
                assert!(
                    at.is_none(),
                    "{}: scores (softcap {softcap}) differ from {} at C[{}]: m={} n={} k={} {lay:?}",
                    kern.isa,
                    if split_expected { "gemm_scores" } else { "gemm" },
                    at.unwrap(),
                    ops.m,
                    ops.n,
                    ops.k
                );
                let (kc, terms) = match (split_expected, ops.k) {
                    (_, 0) => (KC, 0.0),
                    (true, k) => (KC_SCORES, f32_bound_terms(k, KC_SCORES) + 1.0),
                    (false, k) => (KC, f32_bound_terms(k, KC)),
                };
                let what = Run {
                    what: "scores",
                    isa: kern.isa,
                    accumulate: false,
                    kc,
                    lay,
                };
                check_c(&ops, &what, &got, &[], (&sum, &abs), terms);
            }
        }
    }
}

/// `gemm_scores` with padded C rows (c_rs > n) and a scratch buffer holding stale data: the
/// padding columns of C must stay as they were, as they do with `gemm`.
#[test]
fn gemm_scores_leaves_padding_columns_of_c_untouched() {
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        let lay = Layout {
            a_transposed: false,
            a_spread: false,
            a_pad: 0,
            b_pad: 0,
            c_pad: 16,
        };
        let mut rng = common::rng(77);
        let ops = Operands::new((4, 16, 64), lay, || uniform(&mut rng));
        let (sum, abs) = ops.reference(f32_dot);
        let mut c = ops.c_initial(false, &[]);
        let mut tmp = vec![1.0f32; ops.c_len()];
        kern.gemm_scores(&ops.gemm(false, KC), &mut c, ops.c_rs, &mut tmp);
        let run = Run {
            what: "gemm_scores",
            isa: kern.isa,
            accumulate: false,
            kc: KC_SCORES,
            lay,
        };
        check_c(
            &ops,
            &run,
            &c,
            &[],
            (&sum, &abs),
            f32_bound_terms(64, KC_SCORES) + 1.0,
        );
    }
}

/// `gemm_scores` with m = 0 has nothing to read or write, like `gemm` (whose check accepts any A
/// and C when m = 0): it must neither touch C nor panic on an empty A or C.
#[test]
fn gemm_scores_with_no_rows_touches_nothing() {
    let mut failures = Vec::new();
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        let isa = kern.isa;
        let b = vec![0.5f32; 32 * 16];
        let a = vec![0.5f32; 32];
        let g = Gemm {
            m: 0,
            n: 16,
            k: 32,
            a: &a,
            a_rs: 32,
            a_cs: 1,
            b: &b,
            b_rs: 16,
            accumulate: false,
            kc: KC,
        };
        let mut c = vec![SENTINEL; 16];
        let mut tmp = vec![1.0f32; 16];
        kern.gemm_scores(&g, &mut c, 16, &mut tmp);
        if c.iter().any(|x| x.to_bits() != SENTINEL.to_bits()) {
            failures.push(format!("{isa}: C was written: {c:?}"));
        }
        let no_a = Gemm { a: &[], ..g };
        if catch_unwind(AssertUnwindSafe(|| {
            kern.gemm_scores(&no_a, &mut [0.0; 16], 16, &mut [0.0; 16])
        }))
        .is_err()
        {
            failures.push(format!("{isa}: panicked on an empty A"));
        }
        if catch_unwind(AssertUnwindSafe(|| {
            kern.gemm_scores(&g, &mut [], 16, &mut [0.0; 16])
        }))
        .is_err()
        {
            failures.push(format!("{isa}: panicked on an empty C"));
        }
        // gemm itself, for comparison, accepts all three.
        kern.gemm(&no_a, &mut [], 16);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------------------------
// bf16 products
// ---------------------------------------------------------------------------------------------

fn bf16_kernels() -> Vec<&'static Kernels> {
    let ks: Vec<_> = simd_kernels()
        .into_iter()
        .filter(|k| k.has_bf16_dot())
        .collect();
    if ks.is_empty() {
        eprintln!("no bf16 dot product on this CPU: gemm_bf16 not tested");
    }
    ks
}

/// `gemm_bf16` over the same grid (k counts pairs) against f64 of the unpacked bf16 values.
#[test]
fn gemm_bf16_matches_f64_within_the_chunked_summation_bound() {
    let kernels = bf16_kernels();
    if kernels.is_empty() {
        return;
    }
    for (shape, lay, seed) in grid() {
        let mut rng = common::rng(0xbf16_0000 + seed);
        let ops = Operands::new(shape, lay, || bf16_pair(|| uniform(&mut rng)));
        let c0: Vec<f32> = (0..ops.m * ops.n).map(|_| uniform(&mut rng)).collect();
        let (sum, abs) = ops.reference(bf16_dot);
        for kern in &kernels {
            for accumulate in [false, true] {
                for kc in KCS {
                    let mut c = ops.c_initial(accumulate, &c0);
                    kern.gemm_bf16(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                    let run = Run {
                        what: "gemm_bf16",
                        isa: kern.isa,
                        accumulate,
                        kc,
                        lay,
                    };
                    let terms = if ops.k == 0 {
                        0.0
                    } else {
                        bf16_bound_terms(ops.k, kc)
                    };
                    check_c(&ops, &run, &c, &c0, (&sum, &abs), terms);
                }
            }
        }
    }
}

/// `gemm_bf16_rescaled` (the forward's bf16 P·V with acc_o's rescale folded in) gives the bits
/// of `rescale_o` then `gemm_bf16`, on every table with a bf16 dot product, over the grid's
/// sizes (C's rows further apart than n), every chunk length, factors 1, 0 and random.
#[test]
fn gemm_bf16_rescaled_is_rescale_o_then_gemm_bf16() {
    for kern in bf16_kernels() {
        for (shape, lay, seed) in grid() {
            let mut rng = common::rng(0xbf5c_0000 + seed);
            let ops = Operands::new(shape, lay, || bf16_pair(|| uniform(&mut rng)));
            let (m, n, c_rs) = (ops.m, ops.n, ops.c_rs);
            let c0: Vec<f32> = (0..(m + 2) * c_rs).map(|_| uniform(&mut rng)).collect();
            let alpha: Vec<f32> = (0..n)
                .map(|j| match j % 4 {
                    0 => 1.0,
                    1 => 0.0,
                    _ => uniform(&mut rng).abs().min(1.0),
                })
                .collect();
            for kc in KCS {
                let g = ops.gemm(true, kc);
                let mut want = c0.clone();
                for i in 0..m {
                    kern.rescale_o(&mut want[i * c_rs..i * c_rs + n], 1, n, &alpha);
                }
                kern.gemm_bf16(&g, &mut want, c_rs);
                let mut c = c0.clone();
                kern.gemm_bf16_rescaled(&g, &mut c, c_rs, &alpha);
                let at = c
                    .iter()
                    .zip(&want)
                    .position(|(x, y)| x.to_bits() != y.to_bits());
                assert!(
                    at.is_none(),
                    "{}: gemm_bf16_rescaled differs at C[{at:?}]: m={m} n={n} c_rs={c_rs} k={} kc={kc}",
                    kern.isa,
                    ops.k
                );
            }
        }
    }
}

/// With small integers the bf16 products and their sums are exact: results equal f64 exactly.
#[test]
fn gemm_bf16_is_exact_on_exact_sums() {
    for kern in bf16_kernels() {
        for &m in &[1, 3, 4, 5, 64, 113] {
            for &n in &[16, 48, 80, 256] {
                for &k in &[1, 9, 33, 128] {
                    for lay in LAYOUTS {
                        let mut rng = common::rng(0xe8 + (m * 1_000_000 + n * 1000 + k) as u64);
                        let ops =
                            Operands::new((m, n, k), lay, || bf16_pair(|| small_int(&mut rng)));
                        let c0: Vec<f32> = (0..m * n).map(|_| small_int(&mut rng)).collect();
                        let (sum, abs) = ops.reference(bf16_dot);
                        for accumulate in [false, true] {
                            for kc in KCS {
                                let mut c = ops.c_initial(accumulate, &c0);
                                kern.gemm_bf16(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                                let run = Run {
                                    what: "gemm_bf16 (exact)",
                                    isa: kern.isa,
                                    accumulate,
                                    kc,
                                    lay,
                                };
                                check_c(&ops, &run, &c, &c0, (&sum, &abs), 0.0);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "gemm_bf16 on an ISA without it")]
fn gemm_bf16_panics_on_a_table_without_it() {
    let p = [0u32; 16];
    let g = Gemm {
        m: 1,
        n: 16,
        k: 1,
        a: &p,
        a_rs: 1,
        a_cs: 1,
        b: &p,
        b_rs: 16,
        accumulate: false,
        kc: KC,
    };
    scalar().gemm_bf16(&g, &mut [0.0; 16], 16);
}

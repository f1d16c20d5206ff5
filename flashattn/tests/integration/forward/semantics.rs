//! The documented semantics by hand, masking identities, fully masked rows, empty sequences, GQA.

use super::*;

// ---------------------------------------------------------------------------------------------
// Documented semantics, by hand
// ---------------------------------------------------------------------------------------------

/// sq = 2, sk = 3, causal (bottom-right: row 0 sees keys 0..=1, row 1 sees 0..=2), d = 2, scale 1.
#[test]
fn hand_computed_causal_2x3() {
    let ln2 = std::f32::consts::LN_2;
    let ln3 = 3f32.ln();
    let q = [1.0f32, 0.0, /* row 1 */ 0.0, 1.0];
    // Scores row 0: [0, ln2, (masked)]; row 1: [0, 0, ln3]. A masked key with a large score.
    let k = [0.0f32, 0.0, /* */ ln2, 0.0, /* */ 100.0, ln3];
    let v = [1.0f32, 0.0, /* */ 0.0, 1.0, /* */ 5.0, 5.0];
    let (qt, kt, vt) = (
        TensorRef::contiguous(&q, &[1, 2, 1, 2]),
        TensorRef::contiguous(&k, &[1, 3, 1, 2]),
        TensorRef::contiguous(&v, &[1, 3, 1, 2]),
    );
    let res = flash_attn(
        &qt,
        &kt,
        &vt,
        &AttnOptions::default().causal(true).softmax_scale(1.0),
    )
    .unwrap();
    // Row 0: weights [1, 2] / 3 -> out [1/3, 2/3], lse ln 3.
    // Row 1: weights [1, 1, 3] / 5 -> out 0.2·[1,0] + 0.2·[0,1] + 0.6·[5,5] = [3.2, 3.2], lse ln 5.
    let want_out = [1.0 / 3.0, 2.0 / 3.0, 3.2, 3.2];
    let want_lse = [3f64.ln(), 5f64.ln()];
    let out = res.out.to_f64_vec();
    let lse = res.lse.to_f64_vec();
    assert_eq!(res.out.shape(), &[1, 2, 1, 2]);
    assert_eq!(res.lse.shape(), &[1, 1, 2]);
    for (g, w) in out.iter().zip(want_out) {
        assert!((g - w).abs() < 2e-6, "out {out:?}, want {want_out:?}");
    }
    for (g, w) in lse.iter().zip(want_lse) {
        assert!((g - w).abs() < 2e-6, "lse {lse:?}, want {want_lse:?}");
    }
}

/// Softcap and ALiBi by hand: sq = 1, sk = 2, d = 1, not causal (offset 1: the query's diagonal is
/// key 1). Score j = softcap·tanh(scale·q·k_j / softcap) - slope·|1 - j|.
#[test]
fn hand_computed_softcap_alibi() {
    let (q, k, v) = ([2.0f32], [1.0f32, 3.0], [10.0f32, -10.0]);
    let slopes = [0.25f32];
    let (qt, kt, vt) = (
        TensorRef::contiguous(&q, &[1, 1, 1, 1]),
        TensorRef::contiguous(&k, &[1, 2, 1, 1]),
        TensorRef::contiguous(&v, &[1, 2, 1, 1]),
    );
    let opts = AttnOptions::default()
        .softmax_scale(0.5)
        .softcap(2.0)
        .alibi_slopes(TensorRef::contiguous(&slopes, &[1]));
    let res = flash_attn(&qt, &kt, &vt, &opts).unwrap();
    let s0 = 2.0 * (0.5f64 * 2.0 * 1.0 / 2.0).tanh() - 0.25; // key 0: distance 1
    let s1 = 2.0 * (0.5f64 * 2.0 * 3.0 / 2.0).tanh(); // key 1: on the diagonal
    let (e0, e1) = (s0.exp(), s1.exp());
    let want_out = (10.0 * e0 - 10.0 * e1) / (e0 + e1);
    let want_lse = (e0 + e1).ln();
    let (out, lse) = (res.out.to_f64_vec()[0], res.lse.to_f64_vec()[0]);
    assert!((out - want_out).abs() < 1e-5, "out {out}, want {want_out}");
    assert!((lse - want_lse).abs() < 1e-6, "lse {lse}, want {want_lse}");
}

// ---------------------------------------------------------------------------------------------
// Masking identities and fully masked rows
// ---------------------------------------------------------------------------------------------

fn flash_with(inputs: &Inputs, opts: &AttnOptions) -> AttnOutput {
    let (q, k, v) = inputs.views();
    flash_attn(&q, &k, &v, opts).unwrap()
}

/// causal == window(-1, 0); causal with a window keeps left and sets right to 0; window(-1, -1) ==
/// no window. Same parameters reach the same kernels, so bit for bit.
#[test]
fn mask_identities() {
    for dtype in DTYPES {
        for (sq, sk) in [(113, 203), (203, 113), (64, 65)] {
            let case = Case {
                dtype,
                seqlen_q: sq,
                seqlen_k: sk,
                heads: 2,
                heads_kv: 1,
                head_dim: 40,
                seed: 9,
                ..Case::default()
            };
            let inp = case.build();
            let d = AttnOptions::default;
            let what = format!("{dtype} {sq}x{sk}");
            assert_bit_identical(
                &flash_with(&inp, &d().causal(true)),
                &flash_with(&inp, &d().window(-1, 0)),
                &what,
            );
            assert_bit_identical(
                &flash_with(&inp, &d().window(-1, -1)),
                &flash_with(&inp, &d()),
                &what,
            );
            assert_bit_identical(
                &flash_with(&inp, &d().causal(true).window(17, 9)),
                &flash_with(&inp, &d().window(17, 0)),
                &what,
            );
            assert_bit_identical(
                &flash_with(&inp, &d().causal(true).window(-1, 30)),
                &flash_with(&inp, &d().causal(true)),
                &what,
            );
            // A window wider than both sequences is no window at all (up to huge widths).
            assert_bit_identical(
                &flash_with(&inp, &d().window(5000, 5000)),
                &flash_with(&inp, &d()),
                &what,
            );
            assert_bit_identical(
                &flash_with(&inp, &d().window(1 << 40, 1 << 40)),
                &flash_with(&inp, &d()),
                &what,
            );
        }
    }
}

/// Rows that see no key: out exactly 0, lse exactly -inf, the others as the reference.
#[test]
fn fully_masked_rows() {
    // (sq, sk, causal, window, rows that must be fully masked)
    #[allow(clippy::type_complexity)]
    let cases: [(usize, usize, bool, (i64, i64), Vec<usize>); 6] = [
        // causal, sq > sk: offset -3, rows 0..=2 see nothing.
        (5, 2, true, (-1, -1), (0..3).collect()),
        // Whole query tiles masked: offset -150, rows 0..150 see nothing.
        (203, 53, true, (-1, -1), (0..150).collect()),
        // window (2, 3), offset -90: row i sees [i - 92, i - 87] ∩ [0, 40): rows 0..87 empty.
        (130, 40, false, (2, 3), (0..87).collect()),
        // window (2, 3), offset +10 (sq < sk): every row sees its diagonal: none empty.
        (40, 50, false, (2, 3), Vec::new()),
        // window (0, 0), offset -190: only rows 190..=199 see their diagonal key.
        (200, 10, false, (0, 0), (0..190).collect()),
        // window (-1, 2), offset -110: row i sees j <= i - 108: rows 0..108 empty.
        (140, 30, false, (-1, 2), (0..108).collect()),
    ];
    for dtype in DTYPES {
        for (sq, sk, causal, window, masked) in &cases {
            let case = Case {
                dtype,
                batch: 2,
                seqlen_q: *sq,
                seqlen_k: *sk,
                heads: 3,
                heads_kv: 1,
                head_dim: 24,
                causal: *causal,
                window: *window,
                alibi: Alibi::PerHead,
                seed: 31,
                ..Case::default()
            };
            let inp = case.build();
            let res = inp.flash();
            let (out, lse) = (res.out.to_f64_vec(), res.lse.to_f64_vec());
            let (b, h, d) = (2, 3, 24);
            for bi in 0..b {
                for hi in 0..h {
                    for i in 0..*sq {
                        let l = lse[(bi * h + hi) * sq + i];
                        let o = &out[((bi * sq + i) * h + hi) * d..][..d];
                        if masked.contains(&i) {
                            assert_eq!(l, f64::NEG_INFINITY, "{case}: row {i} lse");
                            assert!(o.iter().all(|&x| x == 0.0), "{case}: row {i} out {o:?}");
                        } else {
                            assert!(l.is_finite(), "{case}: row {i} should see keys, lse {l}");
                        }
                    }
                }
            }
            inp.check();
        }
    }
}

/// seqlen_k = 0: every row sees nothing; seqlen_q = 0: empty outputs.
#[test]
fn empty_sequences() {
    for dtype in DTYPES {
        for (sq, sk) in [(5, 0), (0, 7), (0, 0)] {
            let case = Case {
                dtype,
                batch: 2,
                seqlen_q: sq,
                seqlen_k: sk,
                heads: 2,
                heads_kv: 2,
                seed: 3,
                ..Case::default()
            };
            let inp = case.build();
            let res = inp.flash();
            assert_eq!(res.out.shape(), &[2, sq, 2, 8]);
            assert_eq!(res.lse.shape(), &[2, 2, sq]);
            assert!(res.out.to_f64_vec().iter().all(|&x| x == 0.0));
            assert!(res.lse.to_f64_vec().iter().all(|&x| x == f64::NEG_INFINITY));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GQA / MQA
// ---------------------------------------------------------------------------------------------

/// heads_kv < heads gives the same result as the kv heads repeated explicitly (bit for bit: each
/// query head runs the same arithmetic on the same kv values either way).
#[test]
fn gqa_equals_repeated_kv() {
    for dtype in DTYPES {
        for (h, hkv, causal) in [(6, 2, false), (8, 2, true), (4, 1, true), (4, 1, false)] {
            let case = Case {
                dtype,
                batch: 2,
                seqlen_q: 70,
                seqlen_k: 130,
                heads: h,
                heads_kv: hkv,
                head_dim: 40,
                causal,
                alibi: Alibi::PerBatchHead,
                layout: Layout::Padded,
                seed: 12,
                ..Case::default()
            };
            let inp = case.build();
            let (q, k, v) = inp.views();
            let opts = inp.opts();
            let gqa = flash_attn(&q, &k, &v, &opts).unwrap();
            // Repeat k/v heads: head hh of the repeated tensors is kv head hh / (h / hkv).
            let (b, sk, d) = (2, 130, 40);
            let repeat = |p: &Placement| {
                let vals = reference_values(&inp, p);
                let mut rep = Vec::with_capacity(b * sk * h * d);
                for bi in 0..b {
                    for j in 0..sk {
                        for hh in 0..h {
                            let src = ((bi * sk + j) * hkv + hh / (h / hkv)) * d;
                            rep.extend_from_slice(&vals[src..src + d]);
                        }
                    }
                }
                to_buffer(&rep, dtype)
            };
            let (kr, vr) = (repeat(&inp.k), repeat(&inp.v));
            let shape = [b, sk, h, d];
            let (kt, vt) = (
                TensorRef::from_slice(kr.as_slice(), &shape, &[sk * h * d, h * d, d, 1]),
                { TensorRef::from_slice(vr.as_slice(), &shape, &[sk * h * d, h * d, d, 1]) },
            );
            let mha = flash_attn(&q, &kt, &vt, &opts).unwrap();
            assert_bit_identical(&gqa, &mha, &format!("{case}: GQA vs repeated kv"));
            // The naive path, too.
            let gqa_n = naive::attention(&q, &k, &v, &opts).unwrap();
            let mha_n = naive::attention(&q, &kt, &vt, &opts).unwrap();
            assert_bit_identical(&gqa_n, &mha_n, &format!("{case}: naive GQA vs repeated kv"));
        }
    }
}

/// Library bug: window sides close to `i64::MAX` pass validation (only values below -1 are
/// rejected) but overflow the i64 mask arithmetic: `blocks::Mask::lo` computes
/// `i + offset - left` and `Mask::hi` computes `i + offset + right + 1` in i64 (blocks.rs), as do
/// `reference::visible` and the naive path. With overflow checks (tests) they panic ("attempt to
/// add/subtract with overflow"); in release they wrap, and the rows see no key at all (out 0,
/// lse -inf) instead of every key. Expected: same as no window.
#[test]
fn window_near_i64_max_is_unbounded() {
    // sq > sk, so offset = sk - sq < 0 and `i + offset - left` underflows for left = i64::MAX.
    let inp = Case {
        seqlen_q: 70,
        seqlen_k: 30,
        ..Case::default()
    }
    .build();
    let d = AttnOptions::default;
    let unbounded = flash_with(&inp, &d());
    for (l, r) in [
        (i64::MAX, -1),
        (-1, i64::MAX),
        (i64::MAX, i64::MAX),
        (i64::MAX - 50, i64::MAX - 50),
    ] {
        assert_bit_identical(
            &flash_with(&inp, &d().window(l, r)),
            &unbounded,
            &format!("window ({l}, {r})"),
        );
        let (q, k, v) = inp.views();
        let rf = reference::attention(&q, &k, &v, &d().window(l, r)).unwrap();
        assert!(
            rf.lse.iter().all(|x| x.is_finite()),
            "reference, window ({l}, {r})"
        );
    }
}

/// The built-in masks compute the blocks they cut in parts (only the lanes whose rows see the
/// block, each strip with the keys up to its last row's); a function that hides the same pairs
/// takes each such block whole. The skipped lanes and keys would only have added zeros, so both
/// give the same bits: causal and windows, seqlen_q != seqlen_k both ways, GQA, with softcap,
/// ALiBi and dropout, f32 and bf16, on every instruction set.
#[test]
fn masked_blocks_in_parts_give_the_whole_blocks_bits() {
    use crate::common::backward::{GradCase, GradData, Shape};
    use flashattn::Tensor;
    use half::bf16;
    fn bits(t: &Tensor) -> Vec<u64> {
        t.to_f64_vec().iter().map(|x| x.to_bits()).collect()
    }
    fn run<T: flashattn::Element>() {
        static SLOPES: [f32; 4] = [0.25, 0.5, 0.125, 1.0];
        let shapes: [Shape; 4] = [
            (1, 300, 300, 4, 2, 40),
            (2, 257, 190, 4, 1, 64),
            (1, 190, 257, 4, 4, 24),
            (1, 97, 400, 4, 2, 16),
        ];
        // (left, right) windows; -1 is unbounded.
        let windows: [(i64, i64); 5] = [(-1, 0), (70, 0), (16, 3), (-1, 40), (100, -1)];
        for (n, &shape) in shapes.iter().enumerate() {
            let (sq, sk) = (shape.1 as i64, shape.2 as i64);
            let case = GradCase {
                seed: 40 + n as u64,
                shape,
                opts: AttnOptions::default(),
                logit_scale: 2.0,
            };
            let data = GradData::<T>::new(&case);
            let [q, k, v, _] = data.views();
            for (wi, &(left, right)) in windows.iter().enumerate() {
                let what = ["plain", "softcap", "ALiBi", "dropout"][(n + wi) % 4];
                let extra = match (n + wi) % 4 {
                    0 => AttnOptions::default(),
                    1 => AttnOptions::default().softcap(5.0),
                    2 => AttnOptions::default().alibi_slopes(TensorRef::contiguous(&SLOPES, &[4])),
                    _ => AttnOptions::default().dropout(0.3, 77),
                };
                for isa in flashattn::simd::available() {
                    let built_in = extra.clone().window(left, right).isa(isa);
                    let by_fn = extra.clone().isa(isa).mask_mod(move |x| {
                        let at = x.q as i64 + sk - sq;
                        let k = x.k as i64;
                        (left < 0 || k >= at - left) && (right < 0 || k <= at + right)
                    });
                    let a = flash_attn(&q, &k, &v, &built_in).unwrap();
                    let b = flash_attn(&q, &k, &v, &by_fn).unwrap();
                    let ctx = format!("{shape:?} window ({left}, {right}) {what} {isa:?}");
                    assert_eq!(bits(&a.out), bits(&b.out), "out, {ctx}");
                    assert_eq!(bits(&a.lse), bits(&b.lse), "lse, {ctx}");
                }
            }
        }
    }
    run::<f32>();
    run::<bf16>();
}

//! Forward-pass correctness: a seeded covering grid checked against the f64 reference with the naive
//! algorithm as the yardstick (see `common::check_bound`), plus targeted tests of varlen, masking,
//! determinism, GQA and the documented semantics.

mod common;

use common::grid::*;
use common::*;
use flashattn::{
    flash_attn, flash_attn_varlen, naive, reference, AttnOptions, AttnOutput, DType, TensorRef,
};
use rand::seq::SliceRandom;
use rand::Rng;

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

/// The logical values (row-major) of a placed tensor, read back from its buffer.
fn reference_values(inp: &Inputs, p: &Placement) -> Vec<f64> {
    let t = view(&inp.bufs, p);
    let all = match t.data() {
        flashattn::Slice::F32(d) => d.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        flashattn::Slice::F16(d) => d.iter().map(|x| x.to_f64()).collect(),
        flashattn::Slice::BF16(d) => d.iter().map(|x| x.to_f64()).collect(),
    };
    let (s, st) = (&p.shape, &p.strides);
    let mut out = Vec::new();
    for a in 0..s[0] {
        for b in 0..s[1] {
            for c in 0..s[2] {
                for x in 0..s[3] {
                    out.push(all[a * st[0] + b * st[1] + c * st[2] + x * st[3]]);
                }
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Varlen
// ---------------------------------------------------------------------------------------------

/// A packed problem: per-sequence lengths, plus `extra_q` tokens after the last sequence.
struct Packed {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    extra_q: usize,
    extra_k: usize,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    slopes: Vec<f32>,
}

impl Packed {
    #[allow(clippy::too_many_arguments)]
    fn new(
        lens_q: &[usize],
        lens_k: &[usize],
        extra_q: usize,
        extra_k: usize,
        heads: usize,
        heads_kv: usize,
        head_dim: usize,
        seed: u64,
    ) -> Packed {
        let mut r = rng(seed);
        let tq = lens_q.iter().sum::<usize>() + extra_q;
        let tk = lens_k.iter().sum::<usize>() + extra_k;
        let q = values(&mut r, tq * heads * head_dim, Dist::Normal);
        let k = values(&mut r, tk * heads_kv * head_dim, Dist::Normal);
        let v = values(&mut r, tk * heads_kv * head_dim, Dist::Uniform);
        let slopes = (0..lens_q.len() * heads)
            .map(|_| r.gen_range(0.01f32..0.3))
            .collect();
        Packed {
            lens_q: lens_q.to_vec(),
            lens_k: lens_k.to_vec(),
            extra_q,
            extra_k,
            q,
            k,
            v,
            slopes,
        }
    }
    fn cu(lens: &[usize]) -> Vec<i32> {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, &l| {
                *acc += l as i32;
                Some(*acc)
            }))
            .collect()
    }
    fn total_q(&self) -> usize {
        self.lens_q.iter().sum::<usize>() + self.extra_q
    }
    fn total_k(&self) -> usize {
        self.lens_k.iter().sum::<usize>() + self.extra_k
    }
}

/// Options for a varlen test: `alibi` picks per-(sequence, head) slopes `[batch, heads]`.
fn varlen_opts<'a>(
    slopes: Option<TensorRef<'a>>,
    causal: bool,
    window: (i64, i64),
    softcap: Option<f32>,
) -> AttnOptions<'a> {
    let mut o = AttnOptions::default()
        .causal(causal)
        .window(window.0, window.1);
    o.softcap = softcap;
    o.alibi_slopes = slopes;
    o
}

/// Varlen against (1) the f64 `reference::attention_varlen` with the naive yardstick, and (2) one
/// batched `flash_attn` call per sequence on the sliced data. (2) is asserted **bit for bit**: work
/// items are (sequence, head, query tile) with tiles counted from each sequence's start, and all
/// sums run in a fixed order, so a sequence's arithmetic does not depend on its neighbours or on its
/// position in the packed tensor. Rows after the last sequence: out exactly 0, lse exactly -inf.
#[test]
fn varlen_matches_reference_and_per_sequence_calls() {
    #[allow(clippy::type_complexity)]
    let configs: [(
        &[usize],
        &[usize],
        usize,
        usize,
        bool,
        (i64, i64),
        Option<f32>,
        bool,
    ); 6] = [
        (
            &[5, 0, 130, 64, 1],
            &[7, 9, 0, 65, 200],
            3,
            2,
            false,
            (-1, -1),
            None,
            false,
        ),
        (
            &[5, 0, 130, 64, 1],
            &[7, 9, 0, 65, 200],
            0,
            0,
            true,
            (-1, -1),
            None,
            true,
        ),
        (
            &[113, 203, 0],
            &[203, 113, 0],
            10,
            0,
            false,
            (20, 5),
            Some(5.0),
            true,
        ),
        (
            &[1, 63, 64, 65],
            &[1, 63, 64, 65],
            1,
            5,
            true,
            (9, -1),
            None,
            false,
        ),
        (&[0, 0], &[0, 4], 4, 1, false, (-1, -1), None, false),
        (&[100], &[40], 0, 0, false, (2, 3), None, true),
    ];
    let mut seed = 40;
    for dtype in DTYPES {
        for &(lq, lk, extra_q, extra_k, causal, window, softcap, alibi) in &configs {
            seed += 1;
            let (h, hkv, d) = (4, 2, 40);
            let p = Packed::new(lq, lk, extra_q, extra_k, h, hkv, d, seed);
            let (tq, tk) = (p.total_q(), p.total_k());
            let (cq, ck) = (Packed::cu(lq), Packed::cu(lk));
            let (qb, kb, vb) = (
                to_buffer(&p.q, dtype),
                to_buffer(&p.k, dtype),
                to_buffer(&p.v, dtype),
            );
            let q = TensorRef::from_slice(qb.as_slice(), &[tq, h, d], &[h * d, d, 1]);
            let k = TensorRef::from_slice(kb.as_slice(), &[tk, hkv, d], &[hkv * d, d, 1]);
            let v = TensorRef::from_slice(vb.as_slice(), &[tk, hkv, d], &[hkv * d, d, 1]);
            let batch = lq.len();
            let slopes = alibi.then(|| TensorRef::contiguous(&p.slopes, &[batch, h]));
            let opts = varlen_opts(slopes, causal, window, softcap);
            let what = format!("{dtype} varlen q {lq:?}+{extra_q} k {lk:?}+{extra_k} causal={causal} window={window:?} softcap={softcap:?} alibi={alibi}");

            let flash = flash_attn_varlen(&q, &k, &v, &cq, &ck, &opts).unwrap();
            let nv = naive::attention_varlen(&q, &k, &v, &cq, &ck, &opts).unwrap();
            let mut r = reference::attention_varlen(&q, &k, &v, &cq, &ck, &opts).unwrap();
            // Workaround for a bug of the oracle (see `reference_varlen_lse_of_rows_after_last_sequence`):
            // it leaves lse 0.0 instead of -inf on rows after the last sequence.
            let used = cq[batch] as usize;
            for hh in 0..h {
                r.lse[hh * tq + used..(hh + 1) * tq].fill(f64::NEG_INFINITY);
            }
            assert_eq!(flash.out.shape(), &[tq, h, d]);
            assert_eq!(flash.lse.shape(), &[h, tq]);
            let v_max = p.v.iter().fold(0f64, |m, x| m.max(x.abs()));
            let max_keys = lk.iter().copied().max().unwrap_or(0);
            check_bound(
                &what,
                dtype,
                &flash,
                std::slice::from_ref(&nv),
                &r,
                v_max,
                max_keys,
            );

            let out = flash.out.to_f64_vec();
            let lse = flash.lse.to_f64_vec();
            assert!(
                out[used * h * d..].iter().all(|&x| x == 0.0),
                "{what}: rows after the last sequence"
            );
            for hh in 0..h {
                assert!(
                    lse[hh * tq + used..(hh + 1) * tq]
                        .iter()
                        .all(|&x| x == f64::NEG_INFINITY),
                    "{what}: lse after the last sequence"
                );
            }

            // Per-sequence batched calls on the sliced data.
            let (out_bits, lse_bits) = (bits(&flash.out), bits(&flash.lse));
            for b in 0..batch {
                let (q0, q1, k0, k1) = (
                    cq[b] as usize,
                    cq[b + 1] as usize,
                    ck[b] as usize,
                    ck[b + 1] as usize,
                );
                let (sq, sk) = (q1 - q0, k1 - k0);
                let qs = TensorRef::from_slice(
                    slice_from(qb.as_slice(), q0 * h * d),
                    &[1, sq, h, d],
                    &[sq * h * d, h * d, d, 1],
                );
                let ks = TensorRef::from_slice(
                    slice_from(kb.as_slice(), k0 * hkv * d),
                    &[1, sk, hkv, d],
                    &[sk * hkv * d, hkv * d, d, 1],
                );
                let vs = TensorRef::from_slice(
                    slice_from(vb.as_slice(), k0 * hkv * d),
                    &[1, sk, hkv, d],
                    &[sk * hkv * d, hkv * d, d, 1],
                );
                let seq_slopes =
                    alibi.then(|| TensorRef::contiguous(&p.slopes[b * h..(b + 1) * h], &[h]));
                let one = flash_attn(
                    &qs,
                    &ks,
                    &vs,
                    &varlen_opts(seq_slopes, causal, window, softcap),
                )
                .unwrap();
                let (ob, lb) = (bits(&one.out), bits(&one.lse));
                assert_eq!(
                    &ob[..],
                    &out_bits[q0 * h * d..q1 * h * d],
                    "{what}: sequence {b} out differs from its own batched call"
                );
                for hh in 0..h {
                    assert_eq!(
                        &lb[hh * sq..(hh + 1) * sq],
                        &lse_bits[hh * tq + q0..hh * tq + q1],
                        "{what}: sequence {b} head {hh} lse differs"
                    );
                }
            }
        }
    }
}

/// A varlen call with a single sequence equals the batched call with batch 1 (bit for bit).
#[test]
fn varlen_single_sequence_equals_batched() {
    for dtype in DTYPES {
        let case = Case {
            dtype,
            seqlen_q: 113,
            seqlen_k: 203,
            heads: 6,
            heads_kv: 2,
            head_dim: 59,
            causal: true,
            seed: 5,
            ..Case::default()
        };
        let inp = case.build();
        let (q, k, v) = inp.views();
        let batched = flash_attn(&q, &k, &v, &inp.opts()).unwrap();
        fn strip<'a>(t: &TensorRef<'a>) -> TensorRef<'a> {
            TensorRef::from_slice(t.data(), &t.shape()[1..], &t.strides()[1..])
        }
        let (q3, k3, v3) = (strip(&q), strip(&k), strip(&v));
        let packed = flash_attn_varlen(&q3, &k3, &v3, &[0, 113], &[0, 203], &inp.opts()).unwrap();
        assert_eq!(bits(&batched.out), bits(&packed.out), "{case}");
        assert_eq!(bits(&batched.lse), bits(&packed.lse), "{case}");
    }
}

// ---------------------------------------------------------------------------------------------
// Determinism across thread counts
// ---------------------------------------------------------------------------------------------

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
                        flash_attn_varlen(&q, &k, &v, &cq, &ck, &opts).unwrap()
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

/// Library bug (oracle): `reference::attention_varlen` leaves lse = 0.0 (not -inf) on packed rows
/// after the last `cu_seqlens_q` entry, unlike `flash_attn_varlen` and `naive::attention_varlen`
/// (and the documented contract). `reference::run` allocates `lse` as `vec![0.0; ..]` and only
/// writes rows that belong to a sequence.
#[test]
fn reference_varlen_lse_of_rows_after_last_sequence() {
    let q = [0.5f32; 3 * 2];
    let k = [0.25f32; 2 * 2];
    let (qt, kt) = (
        TensorRef::contiguous(&q, &[3, 1, 2]),
        TensorRef::contiguous(&k, &[2, 1, 2]),
    );
    let opts = AttnOptions::default();
    // One sequence of 1 query token; tokens 1 and 2 of q belong to no sequence.
    let r = reference::attention_varlen(&qt, &kt, &kt, &[0, 1], &[0, 2], &opts).unwrap();
    let f = flash_attn_varlen(&qt, &kt, &kt, &[0, 1], &[0, 2], &opts).unwrap();
    assert_eq!(f.lse.to_f64_vec()[1..], [f64::NEG_INFINITY; 2]);
    assert_eq!(r.out[2..], [0.0; 4]);
    assert_eq!(
        r.lse[1..],
        [f64::NEG_INFINITY; 2],
        "reference lse {:?}",
        r.lse
    );
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

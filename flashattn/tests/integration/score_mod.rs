//! Custom score functions (`AttnOptions::score_mod`, FlexAttention's `score_mod`): a relative
//! position bias table per head, ALiBi and soft-capping written as functions, a selection on
//! the indices, and an expression program ([`flashattn::score_expr::ScoreExpr`]), each alone,
//! with causal, a window, causal with softcap and dropout, and with a mask function; GQA,
//! seqlen_q != seqlen_k both ways, awkward shapes; f32 and bf16 on every instruction set.
//! Forward (out, lse) and backward (dq, dk, dv) against the f64 reference with the forward and
//! gradient bounds (naive attention in the same precision as the yardstick). Functions equal to
//! the built-in ALiBi and softcap give their results; -inf, +inf and NaN from a function; the
//! calls that do not implement functions refuse them.

use crate::common::backward::{GradCase, GradData};
use crate::mask_mod::{builtins, SHAPES};
use flashattn::decode::{flash_attn_with_kvcache, KvCacheOptions};
use flashattn::fp8::{flash_attn_fp8, Descale, Fp8TensorRef, F8E4M3};
use flashattn::score_expr::{Binary, Node, ScoreExpr, Table, Unary};
use flashattn::{
    flash_attn, AttnOptions, Element, ErrorKind, MaskIndex, ScoreFn, TensorMut, TensorRef,
};
use half::bf16;

/// The functions under test, by name.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `s + bias[h][q - k + sk - 1]` (T5-like relative positions, one table per head).
    RelBias,
    /// `s - slope[h] · |q + sk - sq - k|`.
    Alibi,
    /// `3 · tanh(s / 3)`.
    Softcap,
    /// `s / 2` where `(q + k + h) % 3 == 0`, else `s + 0.25`.
    Select,
    /// [`Kind::RelBias`] as an expression program with a lookup into a table.
    Expr,
}

const KINDS: [Kind; 5] = [
    Kind::RelBias,
    Kind::Alibi,
    Kind::Softcap,
    Kind::Select,
    Kind::Expr,
];

const SLOPES: [f32; 4] = [0.25, 0.5, 0.125, 1.0];

/// The relative-bias table: `[heads][sq + sk - 1]`, entry `q - k + sk - 1`.
fn bias_table(heads: usize, (sq, sk): (usize, usize)) -> Vec<f32> {
    let n = sq + sk - 1;
    (0..heads * n)
        .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 2.0)
        .collect()
}

fn score_fn(kind: Kind, heads: usize, (sq, sk): (usize, usize)) -> ScoreFn {
    let n = sq + sk - 1;
    match kind {
        Kind::RelBias => {
            let t = bias_table(heads, (sq, sk));
            ScoreFn::from_fns(
                move |s, x| s + t[x.head * n + x.q + sk - 1 - x.k],
                |_, _| 1.0,
            )
        }
        Kind::Alibi => {
            let dist = move |x: MaskIndex| (x.q as i64 + sk as i64 - sq as i64 - x.k as i64).abs();
            ScoreFn::from_fns(
                move |s, x| s - SLOPES[x.head % 4] * dist(x) as f32,
                |_, _| 1.0,
            )
        }
        Kind::Softcap => ScoreFn::from_fns(
            |s, _| 3.0 * (s / 3.0).tanh(),
            |s, _| {
                let t = (s / 3.0).tanh();
                1.0 - t * t
            },
        ),
        Kind::Select => {
            let hit = |x: MaskIndex| (x.q + x.k + x.head).is_multiple_of(3);
            ScoreFn::from_fns(
                move |s, x| if hit(x) { s * 0.5 } else { s + 0.25 },
                move |_, x| if hit(x) { 0.5 } else { 1.0 },
            )
        }
        Kind::Expr => {
            let t = bias_table(heads, (sq, sk));
            let table = Table {
                data: t.iter().map(|&x| x as f64).collect(),
                shape: vec![heads, n],
            };
            let nodes = vec![
                Node::Score,
                Node::Head,
                Node::Q,
                Node::K,
                Node::Const((sk - 1) as f64),
                Node::Binary(Binary::Sub, 2, 3),
                Node::Binary(Binary::Add, 5, 4),
                Node::Lookup {
                    table: 0,
                    index: vec![1, 6],
                },
                Node::Binary(Binary::Add, 0, 7),
            ];
            ScoreFn::new(ScoreExpr::new(nodes, vec![table], 8).unwrap())
        }
    }
}

/// Forward and backward of every function, built-in mask and shape against the reference, on
/// every instruction set; and each function under a mask function.
fn run<T: Element>() {
    for (n, &shape) in SHAPES.iter().enumerate() {
        let (lens, heads) = ((shape.1, shape.2), shape.3);
        let mask = |x: MaskIndex| !(x.q + 2 * x.k).is_multiple_of(5);
        for (kk, &kind) in KINDS.iter().enumerate() {
            let mut bases = builtins().to_vec();
            bases.push(AttnOptions::default().causal(true).mask_mod(mask));
            for (bi, base) in bases.into_iter().enumerate() {
                let case = GradCase {
                    seed: (100 * n + 10 * kk + bi) as u64,
                    shape,
                    opts: base.clone().score_mod(score_fn(kind, heads, lens)),
                    logit_scale: 1.0,
                };
                let data = GradData::<T>::new(&case);
                let [q, k, v, dout] = data.views();
                let expected = data.expected(&case.opts);
                let plain = flashattn::reference::attention(&q, &k, &v, &base).unwrap();
                for isa in flashattn::simd::available() {
                    let opts = case.opts.clone().isa(isa);
                    let ctx = format!("{kind:?} builtin {bi} {isa:?}");
                    let fwd = flash_attn(&q, &k, &v, &opts).unwrap();
                    let r = data.check_forward(&fwd, &opts, &ctx);
                    if shape.2 > 1 {
                        assert!(r.out != plain.out, "{ctx}: the function changed nothing");
                    }
                    let g = fwd.backward(&q, &k, &v, &dout, &opts).unwrap();
                    data.check_cancel([&g.dq, &g.dk, &g.dv], &expected, (&opts, &r), &ctx);
                }
            }
        }
    }
}

#[test]
fn score_functions_match_the_reference_f32() {
    run::<f32>();
}

#[test]
fn score_functions_match_the_reference_bf16() {
    run::<bf16>();
}

/// Largest |a - b| over two tensors' values.
fn max_diff(a: &flashattn::Tensor, b: &flashattn::Tensor) -> f64 {
    let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
    a.iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()))
}

/// Functions equal to the built-in ALiBi and softcap give their results, forward and backward,
/// to a few f32 roundings: the built-ins fold their constants for the log2 domain (slope ·
/// log2(e), softcap · log2(e)), the function runs in the natural domain and scales by log2(e)
/// after, so the bits differ.
#[test]
fn functions_equal_to_the_builtins_give_their_results() {
    for (n, &shape) in SHAPES.iter().enumerate() {
        let (b, sq, sk, h, _, _) = shape;
        let case = GradCase {
            seed: 50 + n as u64,
            shape,
            opts: AttnOptions::default(),
            logit_scale: 1.0,
        };
        let data = GradData::<f32>::new(&case);
        let [q, k, v, dout] = data.views();
        let slopes: Vec<f32> = (0..h).map(|i| SLOPES[i % 4]).collect();
        let _ = b;
        let pairs = [
            (
                AttnOptions::default()
                    .causal(true)
                    .alibi_slopes(TensorRef::contiguous(&slopes, &[h])),
                AttnOptions::default()
                    .causal(true)
                    .score_mod(score_fn(Kind::Alibi, h, (sq, sk))),
            ),
            (
                AttnOptions::default().window(30, 7).softcap(3.0),
                AttnOptions::default().window(30, 7).score_mod(score_fn(
                    Kind::Softcap,
                    h,
                    (sq, sk),
                )),
            ),
        ];
        for (which, (builtin, by_fn)) in pairs.into_iter().enumerate() {
            for isa in flashattn::simd::available() {
                let (builtin, by_fn) = (builtin.clone().isa(isa), by_fn.clone().isa(isa));
                let a = flash_attn(&q, &k, &v, &builtin).unwrap();
                let f = flash_attn(&q, &k, &v, &by_fn).unwrap();
                let ctx = format!("{shape:?} {isa:?} pair {which}");
                assert!(max_diff(&a.out, &f.out) <= 2e-6, "out {ctx}");
                assert!(max_diff(&a.lse, &f.lse) <= 1e-5, "lse {ctx}");
                let ga = a.backward(&q, &k, &v, &dout, &builtin).unwrap();
                let gf = f.backward(&q, &k, &v, &dout, &by_fn).unwrap();
                for (name, x, y) in [
                    ("dq", &ga.dq, &gf.dq),
                    ("dk", &ga.dk, &gf.dk),
                    ("dv", &ga.dv, &gf.dv),
                ] {
                    assert!(max_diff(x, y) <= 1e-5, "{name} {ctx}");
                }
            }
        }
    }
}

/// -inf from the function hides a pair; a row whose pairs it all hides is a fully masked row
/// (out 0, lse -inf, zero gradients). +inf or NaN at a visible pair makes that row's out NaN;
/// the other rows are unaffected.
#[test]
fn non_finite_scores_from_a_function() {
    let shape = (1, 113, 203, 4, 2, 40);
    let case = GradCase {
        seed: 9,
        shape,
        opts: AttnOptions::default(),
        logit_scale: 1.0,
    };
    let data = GradData::<f32>::new(&case);
    let [q, k, v, dout] = data.views();
    // Rows q % 7 == 3 lose every key; the others lose the keys k % 4 == 1.
    let hide = ScoreFn::from_fns(
        |s, x| {
            if x.q % 7 == 3 || x.k % 4 == 1 {
                f32::NEG_INFINITY
            } else {
                s
            }
        },
        // A derivative that is NaN where the value is -inf: it must not reach the gradients.
        |_, x| {
            if x.q % 7 == 3 || x.k % 4 == 1 {
                f32::NAN
            } else {
                1.0
            }
        },
    );
    let as_mask = AttnOptions::default().mask_mod(|x| !(x.q % 7 == 3 || x.k % 4 == 1));
    for isa in flashattn::simd::available() {
        let opts = AttnOptions::default().score_mod(hide.clone()).isa(isa);
        let fwd = flash_attn(&q, &k, &v, &opts).unwrap();
        let masked = flash_attn(&q, &k, &v, &as_mask.clone().isa(isa)).unwrap();
        let r = data.check_forward(&fwd, &opts, &format!("{isa:?}"));
        let lse = fwd.lse.to_f64_vec();
        let (heads, sq) = (shape.3, shape.1);
        for hh in 0..heads {
            for i in 0..sq {
                let x = lse[hh * sq + i];
                assert_eq!(x == f64::NEG_INFINITY, i % 7 == 3, "lse row {i}");
                assert_eq!(r.lse[hh * sq + i] == f64::NEG_INFINITY, i % 7 == 3);
            }
        }
        assert!(max_diff(&fwd.out, &masked.out) <= 2e-6);
        let g = fwd.backward(&q, &k, &v, &dout, &opts).unwrap();
        let gm = masked
            .backward(&q, &k, &v, &dout, &as_mask.clone().isa(isa))
            .unwrap();
        for (x, y) in [(&g.dq, &gm.dq), (&g.dk, &gm.dk), (&g.dv, &gm.dv)] {
            assert!(x.to_f64_vec().iter().all(|v| v.is_finite()));
            assert!(max_diff(x, y) <= 1e-5);
        }
        let dq = g.dq.to_f64_vec();
        let d = shape.5;
        for i in (3..sq).step_by(7) {
            for hh in 0..heads {
                let at = (i * heads + hh) * d;
                assert!(dq[at..at + d].iter().all(|&x| x == 0.0), "dq row {i}");
            }
        }
    }
    for bad in [f32::INFINITY, f32::NAN] {
        let f = ScoreFn::from_fns(
            move |s, x| if x.q == 5 && x.k == 9 { bad } else { s },
            |_, _| 1.0,
        );
        let fwd = flash_attn(&q, &k, &v, &AttnOptions::default().score_mod(f)).unwrap();
        let out = fwd.out.to_f64_vec();
        let (heads, d) = (shape.3, shape.5);
        for i in 0..shape.1 {
            let row = &out[i * heads * d..(i + 1) * heads * d];
            assert_eq!(row.iter().any(|x| x.is_nan()), i == 5, "{bad} row {i}");
        }
    }
}

/// The function gets the query head (not the kv head), the sequence index of a packed call and
/// coordinates within each sequence: a packed call gives each sequence's batched result.
#[test]
fn packed_sequences_see_their_own_coordinates() {
    let (h, hk, d) = (4, 2, 40);
    let cu_q = [0i32, 70, 70, 183];
    let cu_k = [0i32, 90, 95, 298];
    let f = |s: f32, x: MaskIndex| s + 0.1 * (x.head + 3 * x.batch) as f32 - 0.01 * x.k as f32;
    let case = GradCase {
        seed: 3,
        shape: (1, 183, 298, h, hk, d),
        opts: AttnOptions::default(),
        logit_scale: 1.0,
    };
    let data = GradData::<f32>::new(&case);
    let q = TensorRef::contiguous(&data.q, &[183, h, d]);
    let k = TensorRef::contiguous(&data.k, &[298, hk, d]);
    let v = TensorRef::contiguous(&data.v, &[298, hk, d]);
    let opts = AttnOptions::default()
        .window(30, 50)
        .score_mod(ScoreFn::from_fns(f, |_, _| 1.0));
    let got = flash_attn(&q, &k, &v, &opts.clone().varlen(&cu_q, &cu_k)).unwrap();
    let want = flashattn::reference::attention_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
    let nv = flashattn::naive::attention_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
    crate::common::check_bound(
        "packed",
        flashattn::DType::F32,
        &got,
        &[nv],
        &want,
        1.0,
        203,
    );
    // Sequence 2 alone, batched: its function sees batch 0 there, so shift it by 2.
    let (q2, k2) = (&data.q[70 * h * d..], &data.k[95 * hk * d..]);
    let v2 = &data.v[95 * hk * d..];
    let one = AttnOptions::default()
        .window(30, 50)
        .score_mod(ScoreFn::from_fns(
            move |s, x| f(s, MaskIndex { batch: 2, ..x }),
            |_, _| 1.0,
        ));
    let alone = flash_attn(
        &TensorRef::contiguous(q2, &[1, 113, h, d]),
        &TensorRef::contiguous(k2, &[1, 203, hk, d]),
        &TensorRef::contiguous(v2, &[1, 203, hk, d]),
        &one,
    )
    .unwrap();
    let packed = got.out.as_slice::<f32>().unwrap();
    assert_eq!(&packed[70 * h * d..], alone.out.as_slice::<f32>().unwrap());
}

/// The CUDA backend, FP8 and decoding refuse a score function, naming it.
#[test]
fn calls_without_score_functions_refuse_them() {
    let opts = AttnOptions::default().score_mod(ScoreFn::from_fns(|s, _| s, |_, _| 1.0));
    let (b, s, h, d) = (1, 4, 2, 8);
    let f8: Vec<F8E4M3> = (0..b * s * h * d)
        .map(|i| F8E4M3::from_f32((i % 5) as f32))
        .collect();
    let t8 = Fp8TensorRef::contiguous(&f8, &[b, s, h, d]);
    let e = flash_attn_fp8(&t8, &t8, &t8, &opts.clone().descale(Descale::default())).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::ScoreModUnsupported {
            call: "the FP8 calls"
        }
    );
    assert!(e.to_string().contains("score_mod"), "{e}");
    let x: Vec<f32> = (0..b * s * h * d).map(|i| (i as f32 * 0.3).cos()).collect();
    let q = TensorRef::contiguous(&x, &[b, s, h, d]);
    let cap = 8;
    let mut kc = vec![7.0f32; b * cap * h * d];
    let mut vc = kc.clone();
    let shape = [b, cap, h, d];
    let e = flash_attn_with_kvcache(
        &q,
        &mut TensorMut::contiguous(&mut kc[..], &shape),
        &mut TensorMut::contiguous(&mut vc[..], &shape),
        &[4],
        &KvCacheOptions::default().attn(opts.clone()),
    )
    .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ScoreModUnsupported { .. }),
        "{e}"
    );
    #[cfg(feature = "cuda")]
    {
        let e = flashattn::cuda::launch_description(&q, &q, &q, &opts).unwrap_err();
        assert_eq!(
            e.kind(),
            &ErrorKind::ScoreModUnsupported {
                call: "the CUDA backend"
            }
        );
    }
}

/// Malformed programs are refused with `ScoreExpr`, naming the problem.
#[test]
fn malformed_expressions_are_refused() {
    let table = || Table {
        data: vec![0.0; 6],
        shape: vec![2, 3],
    };
    let cases: Vec<(Vec<Node>, Vec<Table>, usize, &str)> = vec![
        (vec![Node::Score], vec![], 1, "output node"),
        (
            vec![Node::Score, Node::Unary(Unary::Exp, 1)],
            vec![],
            1,
            "not an earlier one",
        ),
        (
            vec![
                Node::Q,
                Node::Lookup {
                    table: 0,
                    index: vec![0],
                },
            ],
            vec![table()],
            1,
            "with 1 indices",
        ),
        (
            vec![
                Node::Q,
                Node::Lookup {
                    table: 1,
                    index: vec![0, 0],
                },
            ],
            vec![table()],
            1,
            "reads table 1",
        ),
        (
            vec![Node::Score],
            vec![Table {
                data: vec![0.0; 5],
                shape: vec![2, 3],
            }],
            0,
            "5 values",
        ),
    ];
    for (nodes, tables, out, want) in cases {
        let e = ScoreExpr::new(nodes, tables, out).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::ScoreExpr { .. }), "{e}");
        assert!(e.to_string().contains(want), "{e} (want {want})");
    }
}

//! The online softmax step against the scalar twin and f64, and its exp2.

use super::*;

/// Softmax state of `n` lanes, with a sentinel tail after lane n in every buffer.
#[derive(Clone)]
struct State {
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    alpha: Vec<f32>,
    m_sub: Vec<f32>,
}

fn with_tail(mut v: Vec<f32>) -> Vec<f32> {
    v.extend(std::iter::repeat_n(SENTINEL, TAIL));
    v
}

fn tail_untouched(v: &[f32], from: usize) -> bool {
    v[from..].iter().all(|x| x.to_bits() == SENTINEL.to_bits())
}

impl State {
    fn new(n: usize) -> State {
        State {
            row_max: with_tail(vec![f32::NEG_INFINITY; n]),
            row_sum: with_tail(vec![0.0; n]),
            alpha: with_tail(vec![f32::from_bits(POISON); n]),
            m_sub: with_tail(vec![f32::from_bits(POISON); n]),
        }
    }
}

/// `2^x` in f64 for an f32 argument, with the kernels' documented cut: exactly 0 below -126.
fn exp2_want(x: f32) -> f64 {
    if x < -126.0 {
        0.0
    } else {
        (x as f64).exp2()
    }
}

/// `got` is `2^x` within 3e-7 relative (exactly 0 where the contract says so); no NaN.
fn check_exp2(got: f32, x: f32, ctx: &dyn Fn() -> String) {
    let want = exp2_want(x);
    if want == 0.0 {
        assert!(got == 0.0, "{}: 2^{x:e} = {got:e}, want exactly 0", ctx());
    } else {
        let rel = (got as f64 - want).abs() / want;
        assert!(
            rel <= 3e-7,
            "{}: 2^{x:e} = {got:e}, f64 {want:e}, relative error {rel:e}",
            ctx()
        );
    }
}

/// Floats equal, -0 == +0, and no NaN where the other has none.
fn same(x: f32, y: f32) -> bool {
    x == y || (x.is_nan() && y.is_nan())
}

/// One softmax block through `kern` (max_get_scale, online_softmax, rescale_o), checked against
/// the scalar twin and f64. Advances `state` and `ot` with the kernel's results.
#[allow(clippy::too_many_arguments)]
fn softmax_step(
    kern: &Kernels,
    st_in: &[f32],
    cols: usize,
    n: usize,
    scale: f32,
    state: &mut State,
    ot: &mut [f32],
    ctx: &dyn Fn() -> String,
) {
    let scalar = scalar();
    let d = ot.len() / n;
    // --- max_get_scale: st *= scale, running max, alpha, m_sub.
    let before = state.clone();
    let mut st = with_tail(st_in.to_vec());
    let mut st_ref = st.clone();
    let mut sref = state.clone();
    kern.max_get_scale(
        &mut st,
        cols,
        n,
        scale,
        &mut state.row_max,
        &mut state.alpha,
        &mut state.m_sub,
    );
    scalar.max_get_scale(
        &mut st_ref,
        cols,
        n,
        scale,
        &mut sref.row_max,
        &mut sref.alpha,
        &mut sref.m_sub,
    );
    let c = || {
        format!(
            "{} max_get_scale(cols={cols}, n={n}, scale={scale:e})",
            ctx()
        )
    };
    for (i, (x, y)) in st.iter().zip(&st_ref).enumerate() {
        assert_eq!(
            x.to_bits(),
            y.to_bits(),
            "{}: scaled st[{i}] = {x:e}, scalar {y:e}",
            c()
        );
    }
    for name in ["row_max", "m_sub", "alpha"] {
        let (v, t) = match name {
            "row_max" => (&state.row_max, &sref.row_max),
            "m_sub" => (&state.m_sub, &sref.m_sub),
            _ => (&state.alpha, &sref.alpha),
        };
        assert!(tail_untouched(v, n), "{}: {name} written after lane n", c());
        if name != "alpha" {
            for j in 0..n {
                assert!(
                    same(v[j], t[j]),
                    "{}: {name}[{j}] = {:e}, scalar {:e}",
                    c(),
                    v[j],
                    t[j]
                );
            }
        }
    }
    for j in 0..n {
        let (old, new) = (before.row_max[j], state.row_max[j]);
        let block_max = (0..cols)
            .map(|c| st_ref[c * n + j])
            .fold(f32::NEG_INFINITY, f32::max);
        assert!(
            same(new, old.max(block_max)),
            "{}: row_max[{j}] = {new:e}",
            c()
        );
        let cl = || format!("{} lane {j} (old max {old:e}, new {new:e})", c());
        assert!(
            !state.alpha[j].is_nan() && !state.m_sub[j].is_nan(),
            "{}: NaN",
            cl()
        );
        if new == f32::NEG_INFINITY {
            // A lane that has seen only masked keys.
            assert_eq!(
                state.alpha[j],
                1.0,
                "{}: alpha of a fully masked lane",
                cl()
            );
            assert_eq!(
                state.m_sub[j].to_bits(),
                0f32.to_bits(),
                "{}: m_sub of a fully masked lane",
                cl()
            );
        } else {
            check_exp2(state.alpha[j], old - new, &cl);
            check_exp2(sref.alpha[j], old - new, &|| {
                format!("{} (scalar twin)", cl())
            });
        }
    }
    // --- online_softmax: st = exp2(st - m_sub), row_sum = row_sum·alpha + Σ st.
    let scaled = st.clone();
    let mut st_ref = st.clone();
    let mut sum_ref = state.row_sum.clone();
    let sum_before = state.row_sum.clone();
    kern.online_softmax(
        &mut st,
        cols,
        n,
        &state.m_sub,
        &mut state.row_sum,
        &state.alpha,
    );
    scalar.online_softmax(
        &mut st_ref,
        cols,
        n,
        &state.m_sub,
        &mut sum_ref,
        &state.alpha,
    );
    let c = || format!("{} online_softmax(cols={cols}, n={n})", ctx());
    assert!(
        tail_untouched(&st, cols * n),
        "{}: st written after cols·n",
        c()
    );
    assert!(
        tail_untouched(&state.row_sum, n),
        "{}: row_sum written after lane n",
        c()
    );
    for j in 0..n {
        let mut want = sum_before[j] as f64 * state.alpha[j] as f64;
        let mut mag = want.abs();
        for col in 0..cols {
            let x = scaled[col * n + j] - state.m_sub[j];
            let cl = || format!("{} st[{col}][{j}]", c());
            check_exp2(st[col * n + j], x, &cl);
            check_exp2(st_ref[col * n + j], x, &|| {
                format!("{} (scalar twin)", cl())
            });
            if state.row_max[j] == f32::NEG_INFINITY {
                assert_eq!(
                    st[col * n + j].to_bits(),
                    0,
                    "{}: probability of a fully masked lane",
                    cl()
                );
            }
            want += exp2_want(x);
            mag += exp2_want(x);
        }
        let tol = ((cols + 2) as f64 * EPS + 3e-7) * mag;
        for (who, got) in [("kernel", state.row_sum[j]), ("scalar twin", sum_ref[j])] {
            let err = (got as f64 - want).abs();
            assert!(
                got.is_finite() && err <= tol,
                "{}: {who} row_sum[{j}] = {got:e}, f64 {want:e}, error {err:e} > {tol:e}",
                c()
            );
        }
        if state.row_max[j] == f32::NEG_INFINITY {
            assert_eq!(
                state.row_sum[j],
                0.0,
                "{}: row_sum of a fully masked lane",
                c()
            );
        }
    }
    // --- rescale_o: ot *= alpha, a single multiply: bit-identical to the twin.
    let mut o = with_tail(ot.to_vec());
    let mut o_ref = o.clone();
    kern.rescale_o(&mut o, d, n, &state.alpha);
    scalar.rescale_o(&mut o_ref, d, n, &state.alpha);
    for (i, (x, y)) in o.iter().zip(&o_ref).enumerate() {
        assert_eq!(
            x.to_bits(),
            y.to_bits(),
            "{} rescale_o(rows={d}, n={n}): ot[{i}]",
            ctx()
        );
    }
    ot.copy_from_slice(&o[..ot.len()]);
}

/// How one block's scores are drawn.
#[derive(Clone, Copy, Debug)]
enum Scores {
    /// N(0, 1)·8 (in the log2 domain, after scale ~1).
    Normal,
    /// Some entries -inf (masked), lanes `j % 7 == 3` and the lane group 16..32 -inf throughout.
    Masked,
    /// As `Masked`, and every lane fully masked (all -inf): the first blocks of a causal row.
    AllMasked,
    /// Entries of ±1e30 (after the scale) among normal ones.
    Huge,
}

fn draw_scores(rng: &mut ChaCha8Rng, kind: Scores, cols: usize, n: usize, scale: f32) -> Vec<f32> {
    let mut st = vec![0f32; cols * n];
    for c in 0..cols {
        for j in 0..n {
            let normal = rng.gen_range(-8.0f32..8.0);
            let masked = j % 7 == 3 || (16..32).contains(&j);
            st[c * n + j] = match kind {
                Scores::Normal => normal,
                Scores::AllMasked => f32::NEG_INFINITY,
                Scores::Masked if masked || rng.gen_bool(0.3) => f32::NEG_INFINITY,
                Scores::Masked => normal,
                Scores::Huge => match rng.gen_range(0..4) {
                    0 => 1e30 / scale,
                    1 => -1e30 / scale,
                    _ => normal,
                },
            };
        }
    }
    st
}

/// Blocks of several widths through the three softmax steps on every SIMD table, running state
/// carried between blocks, for every lane count; scores normal, masked, fully masked and huge,
/// with positive, zero and negative scales.
#[test]
fn softmax_steps_match_the_scalar_twin_and_f64() {
    let kernels = simd_kernels();
    // (scores of each block, scale). -inf entries only with positive scales: -inf·0 is NaN and
    // -inf·(negative) is +inf, which the forward pass never produces (it scales before masking).
    let scenarios: [(&[Scores], f32); 9] = [
        (&[Scores::Normal, Scores::Normal, Scores::Normal], 1.0),
        (&[Scores::Normal, Scores::Normal], 0.180_336_88), // log2(e)/8
        (&[Scores::Masked, Scores::Normal, Scores::Masked], 1.0),
        (
            &[
                Scores::AllMasked,
                Scores::AllMasked,
                Scores::Masked,
                Scores::Masked,
            ],
            1.0,
        ),
        (&[Scores::AllMasked, Scores::Normal], 0.5),
        (&[Scores::Huge, Scores::Normal, Scores::Huge], 1.0),
        (&[Scores::Normal, Scores::Huge], 2.0),
        (&[Scores::Normal, Scores::Normal], 0.0),
        (&[Scores::Normal, Scores::Huge, Scores::Normal], -0.75),
    ];
    let col_sets: [&[usize]; 3] = [&[1, 2, 7, 0], &[64, 65, 3], &[113, 5]];
    let d = 3;
    for kern in &kernels {
        for &n in &NS {
            for (si, &(blocks, scale)) in scenarios.iter().enumerate() {
                for (ci, cols_set) in col_sets.iter().enumerate() {
                    let mut rng = common::rng((si * 1000 + ci * 10_000 + n) as u64);
                    let mut state = State::new(n);
                    let mut ot: Vec<f32> = (0..d * n).map(|_| uniform(&mut rng)).collect();
                    for (b, &kind) in blocks.iter().enumerate() {
                        let cols = cols_set[b % cols_set.len()];
                        let st = draw_scores(&mut rng, kind, cols, n, scale);
                        let ctx =
                            || format!("{}: n={n} scenario {si} ({kind:?}, block {b})", kern.isa);
                        softmax_step(kern, &st, cols, n, scale, &mut state, &mut ot, &ctx);
                    }
                    // A lane masked throughout keeps the initial state exactly.
                    if blocks
                        .iter()
                        .all(|s| matches!(s, Scores::Masked | Scores::AllMasked))
                    {
                        for j in (0..n).filter(|j| j % 7 == 3 || (16..32).contains(j)) {
                            assert_eq!(state.row_max[j], f32::NEG_INFINITY);
                            assert_eq!(state.row_sum[j], 0.0);
                        }
                    }
                }
            }
        }
    }
}

/// exp2 across its whole range through `online_softmax` (m_sub = 0, alpha = 1): within 3e-7 of
/// f64 `2^x`, exactly 0 below -126 and for -inf, exactly 1 at 0.
#[test]
fn online_softmax_exp2_is_accurate_over_its_range() {
    let n = 64;
    let mut xs: Vec<f32> = vec![
        0.0,
        -0.0,
        -1e-45,
        -1e-30,
        -1.0,
        -0.5,
        -125.99999,
        -126.0,
        -126.00001,
        -127.0,
        -149.5,
        -1e30,
        f32::NEG_INFINITY,
        -f32::MAX,
    ];
    let mut x = -130.0f32;
    while x <= 0.0 {
        xs.push(x);
        x += 0.000_731;
    }
    xs.resize(xs.len().next_multiple_of(n), -3.25);
    let cols = xs.len() / n;
    let m_sub = vec![0f32; n];
    let alpha = vec![1f32; n];
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        let mut st = xs.clone();
        let mut row_sum = vec![0f32; n];
        kern.online_softmax(&mut st, cols, n, &m_sub, &mut row_sum, &alpha);
        for (&got, &x) in st.iter().zip(&xs) {
            check_exp2(got, x, &|| format!("{} exp2", kern.isa));
        }
        assert_eq!(st[0], 1.0);
        assert_eq!(st[1], 1.0);
        assert_eq!(st[12].to_bits(), 0);
    }
}

/// `softmax_step` (fused on AVX-512, the two steps elsewhere and for scales that are not finite
/// and positive) gives the bits of `max_get_scale` then `online_softmax`, on every table, state
/// carried between blocks; scores normal, masked, fully masked and huge.
#[test]
fn softmax_step_matches_the_two_steps_bit_for_bit() {
    let mut kernels = simd_kernels();
    kernels.push(scalar());
    let scenarios: [(&[Scores], f32); 6] = [
        (&[Scores::Normal, Scores::Normal, Scores::Normal], 1.0),
        (&[Scores::Normal, Scores::Masked], 0.180_336_88),
        (&[Scores::AllMasked, Scores::Masked, Scores::Normal], 0.5),
        (&[Scores::Huge, Scores::Normal, Scores::Huge], 1.0),
        (&[Scores::Normal, Scores::Normal], 0.0),
        (&[Scores::Normal, Scores::Huge], -0.75),
    ];
    let bits = |v: &[f32]| -> Vec<u32> {
        v.iter()
            .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
            .collect()
    };
    for kern in &kernels {
        for &n in &NS {
            for (si, &(blocks, scale)) in scenarios.iter().enumerate() {
                for cols in [1, 7, 64, 65] {
                    let mut rng = common::rng((si * 1000 + cols * 10 + n) as u64);
                    let mut two = State::new(n);
                    for (b, &kind) in blocks.iter().enumerate() {
                        let st = draw_scores(&mut rng, kind, cols, n, scale);
                        let mut fused = two.clone();
                        let (mut st_two, mut st_fused) = (st.clone(), st);
                        kern.max_get_scale(
                            &mut st_two,
                            cols,
                            n,
                            scale,
                            &mut two.row_max,
                            &mut two.alpha,
                            &mut two.m_sub,
                        );
                        kern.online_softmax(
                            &mut st_two,
                            cols,
                            n,
                            &two.m_sub,
                            &mut two.row_sum,
                            &two.alpha,
                        );
                        kern.softmax_step(
                            &mut st_fused,
                            cols,
                            n,
                            scale,
                            &mut fused.row_max,
                            &mut fused.alpha,
                            &mut fused.m_sub,
                            &mut fused.row_sum,
                        );
                        let ctx =
                            format!("{}: n={n} cols={cols} scenario {si} block {b}", kern.isa);
                        assert_eq!(bits(&st_two), bits(&st_fused), "{ctx}: probabilities");
                        assert_eq!(
                            bits(&two.row_max[..n]),
                            bits(&fused.row_max[..n]),
                            "{ctx}: row_max"
                        );
                        assert_eq!(
                            bits(&two.alpha[..n]),
                            bits(&fused.alpha[..n]),
                            "{ctx}: alpha"
                        );
                        assert_eq!(
                            bits(&two.m_sub[..n]),
                            bits(&fused.m_sub[..n]),
                            "{ctx}: m_sub"
                        );
                        assert_eq!(
                            bits(&two.row_sum[..n]),
                            bits(&fused.row_sum[..n]),
                            "{ctx}: row_sum"
                        );
                    }
                }
            }
        }
    }
}

//! The backward's gradient grid, shared by `tests/backward.rs` (the dQ strategy this machine
//! picks) and `tests/backward_dq.rs` (each strategy forced).
//!
//! Bound: `max|grad - ref| <= 3 · max|naive - ref| + 4 · eps · max|ref| + 16 · eps`, where `naive`
//! is the standard unfused backward in the same precision ([`flashattn::naive`]); the floor covers
//! one rounding of the result and inputs of unit scale (gradients that cancel to 0 keep O(eps)).

use flashattn::{
    flash_attn, flash_attn_varlen, flash_attn_varlen_backward, reference, AttnOptions, DType,
    Element, Tensor, TensorRef,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn data<T: Element>(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0) * scale))
        .collect()
}

pub fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0, |m, v| m.max(v.abs()))
}

/// `max|got - ref| <= 3 · max|naive - ref| + 4 · eps · max|ref| + 16 · eps`.
pub fn check(name: &str, got: &Tensor, naive: &Tensor, want: &[f64], dtype: DType, ctx: &str) {
    let g = got.to_f64_vec();
    assert_eq!(g.len(), want.len(), "{name} length, {ctx}");
    assert!(g.iter().all(|x| x.is_finite()), "{name} has NaN/inf, {ctx}");
    let err = |x: &[f64]| {
        x.iter()
            .zip(want)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()))
    };
    let (err_flash, err_naive) = (err(&g), err(&naive.to_f64_vec()));
    let scale = max_abs(want);
    let bound = 3.0 * err_naive + 4.0 * dtype.epsilon() * scale + 16.0 * dtype.epsilon();
    assert!(
        err_flash <= bound,
        "{name}: max abs err {err_flash:e} > bound {bound:e} (naive {err_naive:e}, max|ref| {scale:e}, normalised {:e}), {ctx}",
        err_flash / scale.max(f64::MIN_POSITIVE)
    );
}

#[allow(clippy::too_many_arguments)]
pub fn case<T: Element>(
    seed: u64,
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    opts: &AttnOptions,
    logit_scale: f32,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let q: Vec<T> = data(&mut rng, b * sq * h * d, logit_scale);
    let k: Vec<T> = data(&mut rng, b * sk * hk * d, logit_scale);
    let v: Vec<T> = data(&mut rng, b * sk * hk * d, 1.0);
    let dout: Vec<T> = data(&mut rng, b * sq * h * d, 1.0);
    let (qt, kt, vt, dt) = (
        TensorRef::contiguous(&q, &[b, sq, h, d]),
        TensorRef::contiguous(&k, &[b, sk, hk, d]),
        TensorRef::contiguous(&v, &[b, sk, hk, d]),
        TensorRef::contiguous(&dout, &[b, sq, h, d]),
    );
    let want = reference::attention_backward(&qt, &kt, &vt, &dt, opts).unwrap();
    let naive = flashattn::naive::attention_backward(&qt, &kt, &vt, &dt, opts).unwrap();
    // Every instruction set this CPU runs (the scalar twin included) must meet the bound.
    for isa in flashattn::simd::available() {
        let opts = opts.clone().isa(isa);
        let fwd = flash_attn(&qt, &kt, &vt, &opts).unwrap();
        let grads = fwd.backward(&qt, &kt, &vt, &dt, &opts).unwrap();
        let ctx = format!(
            "{} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} seed={seed} isa={isa} opts={opts:?}",
            T::DTYPE
        );
        check("dq", &grads.dq, &naive.dq, &want.dq, T::DTYPE, &ctx);
        check("dk", &grads.dk, &naive.dk, &want.dk, T::DTYPE, &ctx);
        check("dv", &grads.dv, &naive.dv, &want.dv, T::DTYPE, &ctx);
        assert_eq!(grads.dq.shape(), &[b, sq, h, d]);
        assert_eq!(grads.dk.shape(), &[b, sk, hk, d]);
    }
}

pub fn grid<T: Element>() {
    let slopes_h4 = [0.25f32, 0.5, 0.125, 1.0];
    let shapes = [
        (1usize, 1usize, 1usize, 1usize, 1usize, 8usize),
        (2, 113, 203, 4, 2, 59),
        (1, 203, 113, 4, 1, 40),
        (1, 63, 65, 4, 4, 111),
        (1, 64, 64, 2, 1, 256),
        (2, 17, 1, 4, 2, 3),
        // 16 (sequence, kv head) pairs and 5 key blocks: the one-pass backward with one or more
        // copies of dQ split unevenly, causal work skewed between them.
        (2, 150, 300, 8, 8, 24),
    ];
    for (n, &(b, sq, sk, h, hk, d)) in shapes.iter().enumerate() {
        for variant in 0..5 {
            let mut opts = AttnOptions::default();
            match variant {
                0 => {}
                1 => opts = opts.causal(true),
                2 => opts = opts.window(7, 3).softcap(2.5),
                3 if h == 4 => {
                    opts = opts
                        .causal(true)
                        .alibi_slopes(TensorRef::contiguous(&slopes_h4, &[4]))
                }
                3 => opts = opts.window(-1, 5),
                _ => opts = opts.dropout(0.2, 1234).causal(n % 2 == 0),
            }
            case::<T>(100 * n as u64 + variant, b, sq, sk, h, hk, d, &opts, 1.0);
        }
    }
    // Huge logits: scores of order 1e3.
    case::<T>(
        9,
        1,
        70,
        90,
        2,
        1,
        32,
        &AttnOptions::default().causal(true),
        6.0,
    );
}

/// Packed sequences (one without keys, one without queries, spare rows after the last of both),
/// on every instruction set (bf16 with a bf16 dot product takes its own path).
pub fn varlen_case<T: Element>() {
    let (h, hk, d) = (4usize, 2usize, 24usize);
    let cu_q = [0, 5, 75, 75, 140];
    let cu_k = [0, 0, 90, 120, 200];
    let (tq, tk) = (150usize, 210usize);
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let q: Vec<T> = data(&mut rng, tq * h * d, 1.0);
    let k: Vec<T> = data(&mut rng, tk * hk * d, 1.0);
    let v: Vec<T> = data(&mut rng, tk * hk * d, 1.0);
    let dout: Vec<T> = data(&mut rng, tq * h * d, 1.0);
    let (qt, kt, vt, dt) = (
        TensorRef::contiguous(&q, &[tq, h, d]),
        TensorRef::contiguous(&k, &[tk, hk, d]),
        TensorRef::contiguous(&v, &[tk, hk, d]),
        TensorRef::contiguous(&dout, &[tq, h, d]),
    );
    for opts in [
        AttnOptions::default(),
        AttnOptions::default().causal(true).dropout(0.25, 3),
    ] {
        let want =
            reference::attention_varlen_backward(&qt, &kt, &vt, &dt, &cu_q, &cu_k, &opts).unwrap();
        let naive =
            flashattn::naive::attention_varlen_backward(&qt, &kt, &vt, &dt, &cu_q, &cu_k, &opts)
                .unwrap();
        for isa in flashattn::simd::available() {
            let opts = opts.clone().isa(isa);
            let fwd = flash_attn_varlen(&qt, &kt, &vt, &cu_q, &cu_k, &opts).unwrap();
            let g = flash_attn_varlen_backward(
                &qt,
                &kt,
                &vt,
                &fwd.out.view(),
                &fwd.lse.view(),
                &dt,
                &cu_q,
                &cu_k,
                &opts,
            )
            .unwrap();
            let ctx = format!("varlen {} isa={isa} {opts:?}", T::DTYPE);
            check("dq", &g.dq, &naive.dq, &want.dq, T::DTYPE, &ctx);
            check("dk", &g.dk, &naive.dk, &want.dk, T::DTYPE, &ctx);
            check("dv", &g.dv, &naive.dv, &want.dv, T::DTYPE, &ctx);
        }
    }
}

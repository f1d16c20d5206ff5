//! Backward pass: gradients against the f64 reference over a seeded grid, thread-count
//! determinism bit for bit, dropout (same mask forward and backward), varlen and fully masked rows.
//!
//! Bound: `max|grad - ref| <= 3 · max|naive - ref| + 4 · eps · max|ref| + 16 · eps`, where `naive`
//! is the standard unfused backward in the same precision ([`flashattn::naive`]); the floor covers
//! one rounding of the result and inputs of unit scale (gradients that cancel to 0 keep O(eps)).

use flashattn::{
    flash_attn, flash_attn_varlen, flash_attn_varlen_backward, reference, AttnOptions, DType,
    Element, Tensor, TensorRef,
};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn data<T: Element>(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0) * scale))
        .collect()
}

fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0, |m, v| m.max(v.abs()))
}

/// `max|got - ref| <= 3 · max|naive - ref| + 4 · eps · max|ref| + 16 · eps`.
fn check(name: &str, got: &Tensor, naive: &Tensor, want: &[f64], dtype: DType, ctx: &str) {
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
fn case<T: Element>(
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

fn grid<T: Element>() {
    let slopes_h4 = [0.25f32, 0.5, 0.125, 1.0];
    let shapes = [
        (1usize, 1usize, 1usize, 1usize, 1usize, 8usize),
        (2, 113, 203, 4, 2, 59),
        (1, 203, 113, 4, 1, 40),
        (1, 63, 65, 4, 4, 111),
        (1, 64, 64, 2, 1, 256),
        (2, 17, 1, 4, 2, 3),
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

#[test]
fn gradients_match_reference_f32() {
    grid::<f32>();
}

#[test]
fn gradients_match_reference_f16() {
    grid::<f16>();
}

#[test]
fn gradients_match_reference_bf16() {
    grid::<bf16>();
}

/// Packed sequences (one with no keys, one with no queries, spare tokens at the end).
#[test]
fn varlen_gradients_match_reference() {
    varlen_case::<f32>();
    varlen_case::<half::f16>();
    varlen_case::<half::bf16>();
}

/// Packed sequences (one without keys, one without queries, spare rows after the last of both),
/// on every instruction set (bf16 with a bf16 dot product takes its own path).
fn varlen_case<T: Element>() {
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

/// Rows that see no key (causal, seqlen_q > seqlen_k) get exactly zero dq.
#[test]
fn fully_masked_rows_have_zero_gradients() {
    let (sq, sk, h, d) = (9usize, 4usize, 2usize, 8usize);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let q: Vec<f32> = data(&mut rng, sq * h * d, 1.0);
    let k: Vec<f32> = data(&mut rng, sk * h * d, 1.0);
    let dout: Vec<f32> = data(&mut rng, sq * h * d, 1.0);
    let (qt, kt, dt) = (
        TensorRef::contiguous(&q, &[1, sq, h, d]),
        TensorRef::contiguous(&k, &[1, sk, h, d]),
        TensorRef::contiguous(&dout, &[1, sq, h, d]),
    );
    let opts = AttnOptions::default().causal(true);
    let fwd = flash_attn(&qt, &kt, &kt, &opts).unwrap();
    let g = fwd.backward(&qt, &kt, &kt, &dt, &opts).unwrap();
    let dq = g.dq.as_slice::<f32>().unwrap();
    // Rows 0..5 see nothing (row i sees keys j <= i - 5).
    assert!(dq[..5 * h * d].iter().all(|&x| x == 0.0));
    assert!(dq[5 * h * d..].iter().any(|&x| x != 0.0));
}

/// Bit-identical gradients on 1, 2 and 3 threads.
#[test]
fn backward_is_deterministic_across_thread_counts() {
    let (b, sq, sk, h, hk, d) = (2usize, 150usize, 190usize, 4usize, 2usize, 40usize);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let q: Vec<bf16> = data(&mut rng, b * sq * h * d, 1.0);
    let k: Vec<bf16> = data(&mut rng, b * sk * hk * d, 1.0);
    let v: Vec<bf16> = data(&mut rng, b * sk * hk * d, 1.0);
    let dout: Vec<bf16> = data(&mut rng, b * sq * h * d, 1.0);
    let (qt, kt, vt, dt) = (
        TensorRef::contiguous(&q, &[b, sq, h, d]),
        TensorRef::contiguous(&k, &[b, sk, hk, d]),
        TensorRef::contiguous(&v, &[b, sk, hk, d]),
        TensorRef::contiguous(&dout, &[b, sq, h, d]),
    );
    let opts = AttnOptions::default().causal(true).dropout(0.1, 99);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let fwd = flash_attn(&qt, &kt, &vt, &opts).unwrap();
            let g = fwd.backward(&qt, &kt, &vt, &dt, &opts).unwrap();
            (fwd, g)
        })
    };
    let bits = |t: &Tensor| {
        t.as_slice::<bf16>()
            .map(|s| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            .unwrap()
    };
    let (f1, g1) = run(1);
    for threads in [2, 3] {
        let (f, g) = run(threads);
        assert_eq!(bits(&f.out), bits(&f1.out), "out, {threads} threads");
        assert_eq!(
            f.lse
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
            f1.lse
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        );
        assert_eq!(bits(&g.dq), bits(&g1.dq), "dq, {threads} threads");
        assert_eq!(bits(&g.dk), bits(&g1.dk), "dk, {threads} threads");
        assert_eq!(bits(&g.dv), bits(&g1.dv), "dv, {threads} threads");
    }
}

/// The forward with dropout equals the reference given the same mask, and the mask that
/// `keep_mask` returns is the one the forward used: with v = identity-like one-hot rows, the output
/// of a dropped key is absent.
#[test]
fn dropout_forward_uses_the_published_mask() {
    let (sq, sk, d) = (6usize, 16usize, 16usize);
    let q = vec![0.0f32; sq * d]; // uniform attention: P = 1/sk everywhere
    let mut v = vec![0.0f32; sk * d];
    for j in 0..sk {
        v[j * d + j] = 1.0; // key j writes only coordinate j
    }
    let (qt, vt) = (
        TensorRef::contiguous(&q, &[1, sq, 1, d]),
        TensorRef::contiguous(&v, &[1, sk, 1, d]),
    );
    let p = 0.4f32;
    let opts = AttnOptions::default().dropout(p, 2024);
    let out = flash_attn(&qt, &vt, &vt, &opts).unwrap().out.to_f32_vec();
    let keep = flashattn::dropout::keep_mask(2024, p, 0, 0, sq, sk);
    for i in 0..sq {
        for j in 0..sk {
            let want = if keep[i * sk + j] {
                1.0 / sk as f32 / (1.0 - p)
            } else {
                0.0
            };
            assert!(
                (out[i * d + j] - want).abs() < 1e-6,
                "row {i} key {j}: {} vs {want}",
                out[i * d + j]
            );
        }
    }
    assert!(keep.iter().any(|&k| !k) && keep.iter().any(|&k| k));
}

#[test]
fn dropout_rejects_bad_probability() {
    let x = vec![0.5f32; 8];
    let t = TensorRef::contiguous(&x, &[1, 2, 1, 4]);
    for p in [1.0f32, -0.1, f32::NAN, 1.5] {
        let err = flash_attn(&t, &t, &t, &AttnOptions::default().dropout(p, 0)).unwrap_err();
        assert!(
            matches!(err.kind(), flashattn::ErrorKind::Dropout { .. }),
            "{p}: {err}"
        );
    }
    let _ = Rng::gen::<u8>(&mut ChaCha8Rng::seed_from_u64(0));
}

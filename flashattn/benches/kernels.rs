//! Microkernel throughput, one core, for every instruction set this CPU has, at the shapes of the
//! forward pass's inner loop (block of 64 keys × 64 query lanes):
//!
//! - `gemm/<isa>/scores/d`: S = K·Qᵀ, m = 64 keys, n = 64 lanes, k = d (overwrite, chunk `KC`);
//! - `gemm/<isa>/scores_kc8/d`: the same in chunks of `KC_SCORES` (each half of `gemm_scores`'
//!   fallback);
//! - `gemm_scores/<isa>/d`: the same product through `gemm_scores` (what the forward pass calls);
//! - `gemm/<isa>/pv/d`: O += V·P, m = d, n = 64 lanes, k = 64 keys (accumulate);
//! - `gemm_bf16/<isa>/{scores,pv}/d`: the same two products over bf16 pairs (k/2 pairs), where the
//!   CPU has a bf16 dot product;
//! - `softmax/<isa>/…`: `max_get_scale` and `online_softmax` over a 64 × 64 score block.
//!
//! Throughput of the products is `Throughput::Elements(2·m·n·k)`: criterion's "elements" are
//! FLOPs here (one multiply and one add per term), so `Gelem/s` reads as GFLOP/s. For the softmax
//! steps, elements are scores (64 · 64 per call).
//!
//! `cargo bench -p flashattn --bench kernels` (about a minute and a half); a filter selects a
//! subset, e.g. `cargo bench -p flashattn --bench kernels -- avx512`.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flashattn::simd::{self, Gemm, Kernels, KC, KC_SCORES};
use std::time::Duration;

/// Keys per block and query lanes per block of the forward pass.
const BLOCK: usize = 64;
const HEAD_DIMS: [usize; 2] = [64, 128];

/// Deterministic values in [-1, 1) (a fixed LCG: no allocation of randomness in the timed loop).
fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// Values rounded to bf16 and packed in pairs (element 2k in the low half).
fn pairs(len: usize, seed: u32) -> Vec<u32> {
    let v = values(2 * len, seed);
    v.chunks_exact(2)
        .map(|p| {
            let lo = half::bf16::from_f32(p[0]).to_bits() as u32;
            let hi = half::bf16::from_f32(p[1]).to_bits() as u32;
            lo | hi << 16
        })
        .collect()
}

fn flops(m: usize, n: usize, k: usize) -> Throughput {
    // Elements = FLOPs: 2 per multiply-add.
    Throughput::Elements((2 * m * n * k) as u64)
}

fn gemm(c: &mut Criterion, kern: &Kernels) {
    let isa = kern.isa.name();
    let n = BLOCK;
    let mut group = c.benchmark_group(format!("gemm/{isa}"));
    for d in HEAD_DIMS {
        // Scores: st[c][r] = Σ_x k[c][x] · qt[x][r]; A = K (keys by rows), B = Qᵀ (lanes).
        let (m, k) = (BLOCK, d);
        let a = values(m * k, 1);
        let b = values(k * n, 2);
        let mut out = vec![0f32; m * n];
        let g = Gemm {
            m,
            n,
            k,
            a: &a,
            a_rs: k,
            a_cs: 1,
            b: &b,
            b_rs: n,
            accumulate: false,
            kc: KC,
        };
        group.throughput(flops(m, n, k));
        group.bench_function(BenchmarkId::new("scores", d), |bch| {
            bch.iter(|| kern.gemm(black_box(&g), black_box(&mut out), n))
        });
        // The same in chunks of KC_SCORES (what each half of gemm_scores' fallback runs).
        let g8 = Gemm { kc: KC_SCORES, ..g };
        group.bench_function(BenchmarkId::new("scores_kc8", d), |bch| {
            bch.iter(|| kern.gemm(black_box(&g8), black_box(&mut out), n))
        });

        // P·V: ot[x][r] += Σ_c v[c][x] · p[c][r]; A = V read transposed (a_rs = 1, a_cs = d).
        let (m, k) = (d, BLOCK);
        let a = values(k * m, 3);
        let b = values(k * n, 4)
            .iter()
            .map(|x| x.abs() / 64.0)
            .collect::<Vec<_>>();
        let mut out = vec![0f32; m * n];
        let g = Gemm {
            m,
            n,
            k,
            a: &a,
            a_rs: 1,
            a_cs: m,
            b: &b,
            b_rs: n,
            accumulate: true,
            kc: KC,
        };
        group.throughput(flops(m, n, k));
        group.bench_function(BenchmarkId::new("pv", d), |bch| {
            bch.iter(|| kern.gemm(black_box(&g), black_box(&mut out), n))
        });
    }
    group.finish();

    let mut group = c.benchmark_group(format!("gemm_scores/{isa}"));
    for d in HEAD_DIMS {
        let (m, k) = (BLOCK, d);
        let a = values(m * k, 5);
        let b = values(k * n, 6);
        let mut out = vec![0f32; m * n];
        let mut tmp = vec![0f32; m * n];
        let g = Gemm {
            m,
            n,
            k,
            a: &a,
            a_rs: k,
            a_cs: 1,
            b: &b,
            b_rs: n,
            accumulate: false,
            kc: KC,
        };
        group.throughput(flops(m, n, k));
        group.bench_function(BenchmarkId::from_parameter(d), |bch| {
            bch.iter(|| kern.gemm_scores(black_box(&g), black_box(&mut out), n, &mut tmp))
        });
    }
    group.finish();
}

fn gemm_bf16(c: &mut Criterion, kern: &Kernels) {
    if !kern.has_bf16_dot() {
        return;
    }
    let isa = kern.isa.name();
    let n = BLOCK;
    let mut group = c.benchmark_group(format!("gemm_bf16/{isa}"));
    for d in HEAD_DIMS {
        // k counts pairs: d / 2 pairs of head dims for the scores, 32 pairs of keys for P·V.
        let (m, k) = (BLOCK, d / 2);
        let a = pairs(m * k, 7);
        let b = pairs(k * n, 8);
        let mut out = vec![0f32; m * n];
        let g = Gemm {
            m,
            n,
            k,
            a: &a,
            a_rs: k,
            a_cs: 1,
            b: &b,
            b_rs: n,
            accumulate: false,
            kc: KC,
        };
        group.throughput(flops(m, n, 2 * k));
        group.bench_function(BenchmarkId::new("scores", d), |bch| {
            bch.iter(|| kern.gemm_bf16(black_box(&g), black_box(&mut out), n))
        });

        let (m, k) = (d, BLOCK / 2);
        let a = pairs(m * k, 9);
        let b = pairs(k * n, 10);
        let mut out = vec![0f32; m * n];
        let g = Gemm {
            m,
            n,
            k,
            a: &a,
            a_rs: k,
            a_cs: 1,
            b: &b,
            b_rs: n,
            accumulate: true,
            kc: KC,
        };
        group.throughput(flops(m, n, 2 * k));
        group.bench_function(BenchmarkId::new("pv", d), |bch| {
            bch.iter(|| kern.gemm_bf16(black_box(&g), black_box(&mut out), n))
        });
    }
    group.finish();
}

fn softmax(c: &mut Criterion, kern: &Kernels) {
    let isa = kern.isa.name();
    let (cols, n) = (BLOCK, BLOCK);
    let mut group = c.benchmark_group(format!("softmax/{isa}"));
    group.throughput(Throughput::Elements((cols * n) as u64));
    // Scores in the log2 domain; scale 1 keeps them (and so the timed work) the same every call.
    let mut st: Vec<f32> = values(cols * n, 11).iter().map(|x| 8.0 * x).collect();
    let mut row_max = vec![f32::NEG_INFINITY; n];
    let mut alpha = vec![1f32; n];
    let mut m_sub = vec![0f32; n];
    group.bench_function("max_get_scale/64x64", |bch| {
        bch.iter(|| {
            kern.max_get_scale(
                black_box(&mut st),
                cols,
                n,
                1.0,
                &mut row_max,
                &mut alpha,
                &mut m_sub,
            )
        })
    });
    // st is not restored between calls (the copy would cost about as much as the kernel): after
    // the first call the kernel runs on its own output, probabilities in (0, 1], so its arguments
    // stay in [-8, -7]; exp2 is branch-free, so the work per score is the same.
    let m_sub = vec![8f32; n];
    let mut row_sum = vec![0f32; n];
    let alpha = vec![1f32; n];
    group.bench_function("online_softmax/64x64", |bch| {
        bch.iter(|| kern.online_softmax(black_box(&mut st), cols, n, &m_sub, &mut row_sum, &alpha))
    });
    group.finish();
}

fn kernels(c: &mut Criterion) {
    for isa in simd::available() {
        let kern = Kernels::for_isa(isa).expect("available ISA");
        gemm(c, kern);
        gemm_bf16(c, kern);
        softmax(c, kern);
    }
}

criterion_group! {
    name = benches;
    // Short runs: the whole file takes about a minute and a half.
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_millis(1500))
        .sample_size(30);
    targets = kernels
}
criterion_main!(benches);

//! The product microkernels' share of the FMA peak on one core, at the shapes the CPU forward and
//! backward call them with (96 query lanes on AVX2, 128 on AVX-512; 64 keys per block).
//!
//! `FLASHATTN_ISA=avx2 cargo run --release -p flashattn --example gemm_fma [-- ROUNDS [PREFIX]]`
//! (PREFIX: only the products whose name starts with it, e.g. `fwd`).
//!
//! Each round measures the instruction set's FMA peak on this thread (12 independent
//! `vfmadd231ps` chains), then every product for ~0.2 s; a product's fraction is its rate over the
//! peak of the same round, and the best round is printed (on a shared host the best is the
//! least disturbed). Rates are per second of this thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`), so time other processes hold the core is not counted.

use flashattn::simd::{self, Gemm, Isa, Kernels, KC};
use std::hint::black_box;
use std::time::Duration;

#[path = "common/timing.rs"]
mod timing;
use timing::values;

fn cpu_secs() -> f64 {
    timing::cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// FLOP/s of 12 chains of `vfmadd231ps` (8 or 16 lanes) on this thread for `dur`.
#[cfg(target_arch = "x86_64")]
fn peak(isa: Isa, dur: Duration) -> f64 {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx2,fma")]
    unsafe fn ymm(iters: u64) -> f32 {
        let a = _mm256_set1_ps(0.999_999);
        let b = _mm256_set1_ps(1e-7);
        let mut acc = [_mm256_set1_ps(1.0); 12];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut s = acc[0];
        for x in &acc[1..] {
            s = _mm256_add_ps(s, *x);
        }
        _mm256_cvtss_f32(s)
    }
    #[target_feature(enable = "avx512f")]
    unsafe fn zmm(iters: u64) -> f32 {
        let a = _mm512_set1_ps(0.999_999);
        let b = _mm512_set1_ps(1e-7);
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let mut s = acc[0];
        for x in &acc[1..] {
            s = _mm512_add_ps(s, *x);
        }
        _mm512_reduce_add_ps(s)
    }
    const ITERS: u64 = 4096;
    let (lanes, f): (f64, unsafe fn(u64) -> f32) = match isa {
        Isa::Avx512 => (16.0, zmm),
        _ => (8.0, ymm),
    };
    let start = cpu_secs();
    let mut blocks = 0u64;
    while cpu_secs() - start < dur.as_secs_f64() {
        // SAFETY: `isa` is available (checked by `Kernels::for_isa` in main).
        black_box(unsafe { f(black_box(ITERS)) });
        blocks += 1;
    }
    (blocks * ITERS * 12) as f64 * 2.0 * lanes / (cpu_secs() - start)
}

struct Case {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    a_rs: usize,
    a_cs: usize,
    accumulate: bool,
}

/// Which operands come from L3 or memory: `cold_a`, each call reads the next of many A tiles (16
/// MiB in all, as the forward's packed k/v tiles of a long sequence); `cold_bc`, also B and C
/// (as the backward's query tiles and dQ copies); else the same operands every call.
fn rate(kern: &Kernels, c: &Case, dur: Duration, cold_a: bool, cold_bc: bool) -> f64 {
    let a_len = (c.m - 1) * c.a_rs + (c.k - 1) * c.a_cs + 1;
    let (b_len, c_len) = (c.k * c.n, c.m * c.n);
    let tiles = if cold_a {
        (4 << 20) / (a_len + b_len + c_len)
    } else {
        1
    };
    let a_all = values(a_len * tiles, 1);
    let bc_tiles = if cold_bc { tiles } else { 1 };
    let b_all = values(b_len * bc_tiles, 2);
    let mut out_all = values(c_len * bc_tiles, 3);
    let mut tmp = values(c_len, 4);
    let start = cpu_secs();
    let mut calls = 0usize;
    while cpu_secs() - start < dur.as_secs_f64() {
        for _ in 0..16 {
            let (t, u) = (calls % tiles, calls % bc_tiles);
            let g = Gemm {
                m: c.m,
                n: c.n,
                k: c.k,
                a: &a_all[t * a_len..(t + 1) * a_len],
                a_rs: c.a_rs,
                a_cs: c.a_cs,
                b: &b_all[u * b_len..(u + 1) * b_len],
                b_rs: c.n,
                accumulate: c.accumulate,
                kc: KC,
            };
            let out = &mut out_all[u * c_len..(u + 1) * c_len];
            if c.name == "fwd scores" {
                // As the forward calls it: the ISA's score product (AVX-512: `gemm_scores`).
                kern.scores(black_box(&g), black_box(out), c.n, &mut tmp, false);
            } else {
                kern.gemm(black_box(&g), black_box(out), c.n);
            }
            calls += 1;
        }
    }
    black_box(&out_all);
    (calls as u64 * 2 * (c.m * c.n * c.k) as u64) as f64 / (cpu_secs() - start)
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let isa = simd::active().expect("FLASHATTN_ISA");
    let kern = Kernels::for_isa(isa).expect("ISA");
    let np = if isa == Isa::Avx512 { 128 } else { 96 };
    let mut cases = Vec::new();
    for d in [64, 128] {
        // Forward: S = K·Qᵀ (rows of K contiguous), O += V·P (V's columns adjacent).
        cases.push(Case {
            name: "fwd scores",
            m: 64,
            n: np,
            k: d,
            a_rs: d,
            a_cs: 1,
            accumulate: false,
        });
        cases.push(Case {
            name: "fwd pv",
            m: d,
            n: np,
            k: 64,
            a_rs: 1,
            a_cs: d,
            accumulate: true,
        });
        // Backward: dV += P̃ᵀ·dO, dK += dSᵀ·Q (64 keys × d lanes, 64 query rows), dQᵀ += Kᵀ·dSᵀ.
        cases.push(Case {
            name: "bwd dkdv",
            m: 64,
            n: d,
            k: 64,
            a_rs: 64,
            a_cs: 1,
            accumulate: true,
        });
        cases.push(Case {
            name: "bwd dq",
            m: d,
            n: 64,
            k: 64,
            a_rs: 1,
            a_cs: d,
            accumulate: true,
        });
    }
    if let Some(prefix) = std::env::args().nth(2) {
        cases.retain(|c| c.name.starts_with(&prefix));
    }
    let dims = |c: &Case| {
        if c.name.starts_with("fwd scores") || c.name.starts_with("bwd dkdv") {
            if c.name.starts_with("fwd") {
                c.k
            } else {
                c.n
            }
        } else {
            c.m
        }
    };
    let dur = Duration::from_millis(200);
    const MODES: [&str; 3] = ["hot", "A", "ABC"];
    let mut best = vec![(0.0f64, 0.0f64); MODES.len() * cases.len()];
    let mut peaks = Vec::new();
    for _ in 0..rounds {
        let pk = peak(isa, dur);
        peaks.push(pk);
        for (i, b) in best.iter_mut().enumerate() {
            let mode = i % MODES.len();
            let r = rate(kern, &cases[i / MODES.len()], dur, mode >= 1, mode == 2);
            if r / pk > b.1 {
                *b = (r, r / pk);
            }
        }
    }
    let max_peak = peaks.iter().cloned().fold(0.0, f64::max);
    println!(
        "{isa}: one-core FMA peak {:.1} GFLOP/s (best of {rounds}; rounds {:?})",
        max_peak / 1e9,
        peaks
            .iter()
            .map(|p| (p / 1e8).round() / 10.0)
            .collect::<Vec<_>>()
    );
    println!("product        d    m    n    k  cold   GFLOP/s  of round's peak");
    for (i, (r, f)) in best.iter().enumerate() {
        let c = &cases[i / MODES.len()];
        println!(
            "{:<12} {:>3} {:>4} {:>4} {:>4}  {:<4} {:>9.1} {:>8.1}%",
            c.name,
            dims(c),
            c.m,
            c.n,
            c.k,
            MODES[i % MODES.len()],
            r / 1e9,
            100.0 * f
        );
    }
}

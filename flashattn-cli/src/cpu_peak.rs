//! The CPU's instruction-level peak: f32 FMA and bf16 dot-product rates, measured on every thread
//! of the current rayon pool at once (wrap the call in [`crate::threads::with_threads`] to choose
//! the count). `bench` divides its GFLOP/s by these to report "% of peak".
//!
//! Each thread runs [`CHAINS`] independent accumulator chains of one instruction (enough to cover
//! its latency times the number of pipes, 4 cycles × 2 on Zen 4) for a fixed time; the rate of a
//! run is the sum over threads of each thread's FLOPs over its own elapsed time, and a measurement
//! is the best of [`RUNS`] runs: a peak is the most the machine shows, and on a shared host a
//! median taken while other work runs understates it (the demo once reported 150% "of peak").
//! The accumulators are summed and passed through `black_box`, so the loop cannot be removed.
//!
//! FLOPs per instruction: `vfmadd` on 16 (AVX-512) or 8 (AVX2) f32 lanes = 2 · lanes; `vdpbf16ps`
//! = 16 lanes × 2 bf16 pairs × 2 = 64. Without AVX2+FMA (or off x86-64) the f32 rate is
//! "unavailable" rather than a guess.

use serde::Serialize;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Independent accumulator chains per thread.
const CHAINS: usize = 12;
/// Instructions per chain between two clock reads (12 · 4096 instructions: tens of microseconds).
const INNER: u64 = 4096;
/// Runs per measurement; the best is reported.
pub const RUNS: usize = 3;
/// Default seconds per run (all threads concurrently).
pub const DEFAULT_SECS: f64 = 0.25;

/// Which instruction a rate was measured with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
// Only x86-64 has these instructions; elsewhere `peak` reports no rate and the variants go unused.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub enum Method {
    #[serde(rename = "avx512 vfmadd231ps zmm")]
    Avx512Fma,
    #[serde(rename = "avx2 vfmadd231ps ymm")]
    Avx2Fma,
    #[serde(rename = "avx512bf16 vdpbf16ps zmm")]
    Avx512Bf16Dot,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Avx512Fma => "avx512 fma",
            Method::Avx2Fma => "avx2 fma",
            Method::Avx512Bf16Dot => "vdpbf16ps",
        }
    }
}

/// One measured rate.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Rate {
    pub gflops: f64,
    pub method: Method,
}

/// The machine's measured peaks on `threads` threads; `None` where the instruction is missing.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Peak {
    pub threads: usize,
    pub f32: Option<Rate>,
    pub bf16: Option<Rate>,
}

/// Measures both peaks of the kernels' instruction set on every thread of the current rayon pool,
/// `secs` seconds per run.
pub fn measure(secs: f64) -> Peak {
    let dur = Duration::from_secs_f64(secs.max(0.0));
    Peak {
        threads: rayon::current_num_threads(),
        f32: f32_method().map(|m| Rate {
            gflops: best_rate(m, dur),
            method: m,
        }),
        bf16: bf16_method().map(|m| Rate {
            gflops: best_rate(m, dur),
            method: m,
        }),
    }
}

/// The widest f32 FMA of the instruction set the kernels run (`flashattn::simd::active()`:
/// `FLASHATTN_ISA` when set, else the best this CPU has), so that `% of peak` compares like with
/// like when the AVX2 kernels are forced on an AVX-512 CPU.
fn f32_method() -> Option<Method> {
    #[cfg(target_arch = "x86_64")]
    {
        use flashattn::isa::Isa;
        let isa = flashattn::simd::active().ok()?;
        if isa == Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512f") {
            return Some(Method::Avx512Fma);
        }
        if matches!(isa, Isa::Avx512 | Isa::Avx2)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Some(Method::Avx2Fma);
        }
    }
    None
}

/// The bf16 dot product, where the kernels run it (AVX-512 with AVX512_BF16).
fn bf16_method() -> Option<Method> {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = flashattn::simd::active().ok()?;
        if isa.has_bf16_dot()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            return Some(Method::Avx512Bf16Dot);
        }
    }
    None
}

/// Best over [`RUNS`] runs of the summed per-thread rate, in GFLOP/s.
fn best_rate(method: Method, dur: Duration) -> f64 {
    (0..RUNS)
        .map(|_| {
            // Every thread of the pool at once; each returns (FLOPs, seconds).
            rayon::broadcast(|_| run_for(method, dur))
                .into_iter()
                .map(|(flops, secs)| if secs > 0.0 { flops / secs } else { 0.0 })
                .sum::<f64>()
                / 1e9
        })
        .fold(0.0, f64::max)
}

/// Runs `method`'s chains on this thread until `dur` has passed (at least one inner block);
/// returns the FLOPs done and the seconds taken.
fn run_for(method: Method, dur: Duration) -> (f64, f64) {
    let start = Instant::now();
    let mut blocks = 0u64;
    let mut sink = 0.0f32;
    loop {
        sink += block(method);
        blocks += 1;
        if start.elapsed() >= dur {
            break;
        }
    }
    black_box(sink);
    let flops_per_insn = match method {
        Method::Avx512Fma => 32.0,
        Method::Avx2Fma => 16.0,
        Method::Avx512Bf16Dot => 64.0,
    };
    let insns = (blocks * INNER * CHAINS as u64) as f64;
    (insns * flops_per_insn, start.elapsed().as_secs_f64())
}

/// One block of `INNER` steps of every chain; returns the sum of the accumulators.
fn block(method: Method) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match method {
        // SAFETY: `Avx512Fma` is only chosen by `f32_method` after `is_x86_feature_detected!`
        // confirmed avx512f, the only feature `x86::fma512` is compiled for; it touches no memory.
        Method::Avx512Fma => unsafe { x86::fma512(INNER) },
        // SAFETY: chosen only after avx2 and fma were detected, the features of `x86::fma256`.
        Method::Avx2Fma => unsafe { x86::fma256(INNER) },
        // SAFETY: chosen only after avx512f and avx512bf16 were detected, the features of
        // `x86::dpbf16`.
        Method::Avx512Bf16Dot => unsafe { x86::dpbf16(INNER) },
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = method;
        unreachable!("no peak method exists off x86-64")
    }
}

// The AVX-512 intrinsics are stable since Rust 1.89, the workspace's minimum.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// `acc = acc · a + b` on 12 zmm chains; with a < 1 every chain converges to b / (1 - a)
    /// (no overflow, no denormals whatever the run length).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma512(steps: u64) -> f32 {
        let a = _mm512_set1_ps(black_box(0.999_9));
        let b = _mm512_set1_ps(black_box(1e-4));
        let mut acc = [_mm512_set1_ps(black_box(1.0)); CHAINS];
        for _ in 0..steps {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let mut sum = _mm512_setzero_ps();
        for x in acc {
            sum = _mm512_add_ps(sum, x);
        }
        _mm512_reduce_add_ps(sum)
    }

    /// The same with 8-lane ymm FMAs.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma256(steps: u64) -> f32 {
        let a = _mm256_set1_ps(black_box(0.999_9));
        let b = _mm256_set1_ps(black_box(1e-4));
        let mut acc = [_mm256_set1_ps(black_box(1.0)); CHAINS];
        for _ in 0..steps {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut sum = _mm256_setzero_ps();
        for x in acc {
            sum = _mm256_add_ps(sum, x);
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY (within this unsafe fn): `lanes` is 8 f32 = 32 bytes, what an unaligned
        // 256-bit store writes.
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        lanes.iter().sum()
    }

    /// `acc += Σ pairs a·b` on 12 zmm chains of `vdpbf16ps`. Each step adds 2 · 2^-14 per lane,
    /// so even minutes of steps stay far from overflow.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dpbf16(steps: u64) -> f32 {
        let x = _mm512_set1_ps(black_box(2f32.powi(-7)));
        let a = _mm512_cvtne2ps_pbh(x, x);
        let b = _mm512_cvtne2ps_pbh(x, x);
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..steps {
            for s in acc.iter_mut() {
                *s = _mm512_dpbf16_ps(*s, a, b);
            }
        }
        let mut sum = _mm512_setzero_ps();
        for s in acc {
            sum = _mm512_add_ps(sum, s);
        }
        _mm512_reduce_add_ps(sum)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_are_positive_where_measured() {
        let p = super::measure(0.01);
        assert!(p.threads >= 1);
        for r in [p.f32, p.bf16].into_iter().flatten() {
            assert!(r.gflops > 0.0 && r.gflops.is_finite(), "{r:?}");
        }
    }
}

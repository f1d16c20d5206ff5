//! The CPU backward alone (the forward runs once, before the timed calls), per second of CPU time,
//! for A/B comparisons on a shared host: `CLOCK_PROCESS_CPUTIME_ID` counts only the time this
//! process ran, so other processes' load changes it much less than wall-clock rates.
//!
//! `FLASHATTN_ISA=avx2 cargo run --release -p flashattn --example bwd_cpu_time -- N D [causal]
//! [bf16] [THREADS] [REPS]` prints GFLOP per CPU-second of the median call (REPS calls, default 5,
//! after one warm-up), the least CPU time of a call, and the wall-clock median. With `PERF_LOOP=S`
//! it repeats calls for about S seconds of wall-clock time (for `perf record`).

use flashattn::{flash_attn, flops, AttnOptions, Element, TensorRef};
use half::bf16;
use std::time::Instant;

#[path = "common/timing.rs"]
mod timing;
use timing::{median, values, ShapeArgs};

fn cpu_secs() -> f64 {
    timing::cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn main() {
    let args = ShapeArgs::from_env();
    let (n, d, threads, reps) = (args.n, args.d, args.threads, args.reps);
    let causal = args.has("causal");
    if args.has("bf16") {
        run::<bf16>(n, d, causal, threads, reps, bf16::from_f32, "bf16");
    } else {
        run::<f32>(n, d, causal, threads, reps, |x| x, "f32");
    }
}

fn run<T: Element>(
    n: usize,
    d: usize,
    causal: bool,
    threads: usize,
    reps: usize,
    conv: fn(f32) -> T,
    name: &str,
) {
    let heads = 16;
    let shape = [1, n, heads, d];
    let strides = [n * heads * d, heads * d, d, 1];
    let input = |seed| -> Vec<T> { values(n * heads * d, seed).into_iter().map(conv).collect() };
    let (qv, kv, vv, dov) = (input(1), input(2), input(3), input(4));
    let (q, k, v, dout) = (
        TensorRef::new(&qv, &shape, &strides),
        TensorRef::new(&kv, &shape, &strides),
        TensorRef::new(&vv, &shape, &strides),
        TensorRef::new(&dov, &shape, &strides),
    );
    let opts = AttnOptions::default().causal(causal);
    let flop = flops::backward(flops::forward(1, heads, n, n, d, causal, opts.window));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let perf_loop: Option<f64> = std::env::var("PERF_LOOP").ok().and_then(|s| s.parse().ok());
    let (mut cpu, mut wall) = (Vec::new(), Vec::new());
    pool.install(|| {
        let res = flash_attn(&q, &k, &v, &opts).expect("forward");
        let start = Instant::now();
        let mut rep = 0;
        loop {
            let (c0, w0) = (cpu_secs(), Instant::now());
            drop(res.backward(&q, &k, &v, &dout, &opts).expect("backward"));
            if rep > 0 {
                cpu.push(cpu_secs() - c0);
                wall.push(w0.elapsed().as_secs_f64());
            }
            rep += 1;
            let more = match perf_loop {
                Some(s) => start.elapsed().as_secs_f64() < s,
                None => rep <= reps,
            };
            if !more {
                break;
            }
        }
    });
    let least = cpu.iter().copied().fold(f64::INFINITY, f64::min);
    let (c, w) = (median(cpu), median(wall));
    println!(
        "{name} N {n} d {d} {} bwd threads {threads}: {:.1} GFLOP per CPU-s (median {:.1} ms CPU, min {:.1} ms CPU), wall {:.1} ms = {:.1} GFLOP/s",
        if causal { "causal" } else { "full" },
        flop / c / 1e9,
        c * 1e3,
        least * 1e3,
        w * 1e3,
        flop / w / 1e9
    );
}

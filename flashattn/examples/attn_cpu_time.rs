//! The CPU forward (and backward) rate per second of CPU time, for A/B comparisons on a shared
//! host: `flops / CLOCK_PROCESS_CPUTIME_ID` counts only the time this process ran, so other
//! processes' load changes it much less than wall-clock rates (caches and the core's sibling
//! still interfere).
//!
//! `FLASHATTN_ISA=avx2 cargo run --release -p flashattn --example attn_cpu_time -- N D [causal]
//! [bwd] [bf16] [THREADS] [REPS]` prints GFLOP per CPU-second, the median over REPS calls (default
//! 5, after one warm-up), the least CPU time of a call, and the wall-clock median; `bf16` runs the
//! same values rounded to bf16.

use flashattn::{flash_attn, flops, AttnOptions, TensorRef};
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
    let (causal, bwd) = (args.has("causal"), args.has("bwd"));
    let heads = 16;
    let shape = [1, n, heads, d];
    let strides = [n * heads * d, heads * d, d, 1];
    let (qv, kv, vv, dov) = (
        values(n * heads * d, 1),
        values(n * heads * d, 2),
        values(n * heads * d, 3),
        values(n * heads * d, 4),
    );
    let in_bf16 = args.has("bf16");
    let to_bf16 = |x: &[f32]| -> Vec<bf16> {
        if in_bf16 {
            x.iter().copied().map(bf16::from_f32).collect()
        } else {
            Vec::new()
        }
    };
    let (qb, kb, vb, db) = (to_bf16(&qv), to_bf16(&kv), to_bf16(&vv), to_bf16(&dov));
    let (q, k, v, dout) = if in_bf16 {
        (
            TensorRef::new(&qb, &shape, &strides),
            TensorRef::new(&kb, &shape, &strides),
            TensorRef::new(&vb, &shape, &strides),
            TensorRef::new(&db, &shape, &strides),
        )
    } else {
        (
            TensorRef::new(&qv, &shape, &strides),
            TensorRef::new(&kv, &shape, &strides),
            TensorRef::new(&vv, &shape, &strides),
            TensorRef::new(&dov, &shape, &strides),
        )
    };
    let opts = AttnOptions::default().causal(causal);
    let fwd_flop = flops::forward(1, heads, n, n, d, causal, opts.window);
    let flop = if bwd {
        fwd_flop + flops::backward(fwd_flop)
    } else {
        fwd_flop
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let (mut cpu, mut wall) = (Vec::new(), Vec::new());
    pool.install(|| {
        for rep in 0..=reps {
            let (c0, w0) = (cpu_secs(), Instant::now());
            let res = flash_attn(&q, &k, &v, &opts).expect("forward");
            if bwd {
                drop(res.backward(&q, &k, &v, &dout, &opts).expect("backward"));
            }
            drop(res);
            if rep > 0 {
                cpu.push(cpu_secs() - c0);
                wall.push(w0.elapsed().as_secs_f64());
            }
        }
    });
    // The least CPU time too: on a loaded host it is the run the neighbours disturbed least.
    let least = cpu.iter().copied().fold(f64::INFINITY, f64::min);
    let (c, w) = (median(cpu), median(wall));
    println!(
        "N {n} d {d} {}{} {} threads {threads}: {:.1} GFLOP per CPU-s (median {:.1} ms CPU, min {:.1} ms CPU), wall {:.1} ms = {:.1} GFLOP/s",
        if causal { "causal" } else { "full" },
        if in_bf16 { " bf16" } else { "" },
        if bwd { "fwd+bwd" } else { "fwd" },
        flop / c / 1e9,
        c * 1e3,
        least * 1e3,
        w * 1e3,
        flop / w / 1e9
    );
}

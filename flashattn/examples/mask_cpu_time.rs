//! CPU time of a call with a custom mask given three ways: as a function (`mask_mod`), as the
//! block mask built once from it (`block_mask`), and, for reference, the causal option alone.
//! The mask is causal within documents of 512 tokens: the function and the block mask skip the
//! same key blocks and give the same bits, and differ only in how the kernels ask the mask; the
//! causal option computes the whole causal triangle.
//!
//! `cargo run --release -p flashattn --example mask_cpu_time -- N D [fn|blocks|causal] [bwd]
//! [THREADS] [REPS]` prints the median and least CPU ms per call over REPS calls (default 5,
//! after one warm-up), and for `blocks` the time to build the mask once.

use flashattn::{flash_attn, AttnOptions, BlockMask, MaskIndex, MaskShape, TensorRef};

#[path = "common/timing.rs"]
mod timing;
use timing::{median, values, ShapeArgs};

fn cpu_secs() -> f64 {
    timing::cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// Causal within documents of 512 tokens.
fn document_causal(x: MaskIndex) -> bool {
    x.k <= x.q && x.k / 512 == x.q / 512
}

fn main() {
    let args = ShapeArgs::from_env();
    let (n, d, threads, reps) = (args.n, args.d, args.threads, args.reps);
    let heads = 16;
    let shape = [1, n, heads, d];
    let (qv, kv, vv, dov) = (
        values(n * heads * d, 1),
        values(n * heads * d, 2),
        values(n * heads * d, 3),
        values(n * heads * d, 4),
    );
    let (q, k, v, dout) = (
        TensorRef::contiguous(&qv, &shape),
        TensorRef::contiguous(&kv, &shape),
        TensorRef::contiguous(&vv, &shape),
        TensorRef::contiguous(&dov, &shape),
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let (form, opts) = if args.has("blocks") {
        let mshape = MaskShape {
            batch: 1,
            heads: 1,
            seqlen_q: n,
            seqlen_k: n,
        };
        let c0 = cpu_secs();
        let bm = pool.install(|| BlockMask::from_fn(mshape, document_causal).expect("mask"));
        println!(
            "built once in {:.1} ms CPU: {bm:?}",
            (cpu_secs() - c0) * 1e3
        );
        ("block_mask", AttnOptions::default().block_mask(bm))
    } else if args.has("causal") {
        ("causal option", AttnOptions::default().causal(true))
    } else {
        ("mask_mod", AttnOptions::default().mask_mod(document_causal))
    };
    let bwd = args.has("bwd");
    let mut cpu = Vec::new();
    pool.install(|| {
        for rep in 0..=reps {
            let c0 = cpu_secs();
            let res = flash_attn(&q, &k, &v, &opts).expect("forward");
            if bwd {
                drop(res.backward(&q, &k, &v, &dout, &opts).expect("backward"));
            }
            if rep > 0 {
                cpu.push(cpu_secs() - c0);
            }
        }
    });
    let least = cpu.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "N {n} d {d} {form} {} threads {threads}: median {:.1} ms CPU, min {:.1} ms CPU",
        if bwd { "fwd+bwd" } else { "fwd" },
        median(cpu) * 1e3,
        least * 1e3
    );
}

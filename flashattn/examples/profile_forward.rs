//! Runs one forward shape in a loop, for profilers (`perf record`): nothing else in the process.
//!
//! `cargo run --release --example profile_forward -- [seqlen] [heads] [head_dim] [f32|bf16|f16] [causal] [reps] [bwd]`
//!
//! With `bwd`, each repeat also runs the backward pass and the GFLOP/s count 3.5× the forward.

use flashattn::{flash_attn, AttnOptions, Buffer, DType, TensorRef};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let n: usize = arg(1, "2048").parse().expect("seqlen");
    let h: usize = arg(2, "16").parse().expect("heads");
    let d: usize = arg(3, "128").parse().expect("head_dim");
    let dtype = match arg(4, "f32").as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    };
    let causal = arg(5, "noncausal") == "causal";
    let reps: usize = arg(6, "5").parse().expect("reps");
    let len = n * h * d;
    let vals: Vec<f32> = (0..len)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0) - 0.5)
        .collect();
    let buf = match dtype {
        DType::BF16 => Buffer::BF16(vals.iter().map(|&x| half::bf16::from_f32(x)).collect()),
        DType::F16 => Buffer::F16(vals.iter().map(|&x| half::f16::from_f32(x)).collect()),
        _ => Buffer::F32(vals),
    };
    let shape = [1, n, h, d];
    let strides = flashattn::tensor::contiguous_strides(&shape);
    let t = TensorRef::from_slice(buf.as_slice(), &shape, &strides);
    let opts = AttnOptions::default().causal(causal);
    let pairs = if causal { n * (n + 1) / 2 } else { n * n } as f64;
    let flop = 4.0 * (h * d) as f64 * pairs;
    let bwd = arg(7, "") == "bwd";
    for _ in 0..reps {
        let t0 = Instant::now();
        let out = flash_attn(&t, &t, &t, &opts).expect("valid input");
        let t1 = Instant::now();
        if bwd {
            let g = out.backward(&t, &t, &t, &t, &opts).expect("valid input");
            std::hint::black_box(g);
            let (f, b) = ((t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64());
            println!(
                "fwd {:.1} ms, bwd {:.1} ms: fwd+bwd {:.1} GFLOP/s",
                f * 1e3,
                b * 1e3,
                3.5 * flop / (f + b) / 1e9
            );
        } else {
            let s = (t1 - t0).as_secs_f64();
            println!("{:.1} ms  {:.1} GFLOP/s", s * 1e3, flop / s / 1e9);
        }
        std::hint::black_box(out);
    }
}

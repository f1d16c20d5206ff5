//! Runs one forward shape in a loop, for profilers (`perf record`): nothing else in the process.
//!
//! `cargo run --release --example profile_forward -- [seqlen] [heads] [head_dim] [f32|bf16|f16] [causal] [reps]`

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
    let vals: Vec<f32> = (0..len).map(|i| ((i * 7919 % 1013) as f32 / 1013.0) - 0.5).collect();
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
    for _ in 0..reps {
        let t0 = Instant::now();
        let out = flash_attn(&t, &t, &t, &opts).expect("valid input");
        let s = t0.elapsed().as_secs_f64();
        std::hint::black_box(out);
        println!("{:.1} ms  {:.1} GFLOP/s", s * 1e3, flop / s / 1e9);
    }
}

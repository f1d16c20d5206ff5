//! A hash of the f32 forward's output and LSE bits at a few shapes (B = 1, H = 16; causal, not,
//! a sliding window), to check that a change leaves the results bit for bit: run it on both
//! builds (any `FLASHATTN_ISA`) and compare the lines.
//!
//! `FLASHATTN_ISA=avx2 cargo run --release -p flashattn --example fwd_bits`

use flashattn::{flash_attn, AttnOptions, TensorRef};

#[path = "common/timing.rs"]
mod timing;
use timing::values;

/// FNV-1a over the values' bits.
fn fnv(vals: &[f32]) -> u64 {
    vals.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ x.to_bits() as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn main() {
    let heads = 16;
    for (n, d) in [(512, 128), (1024, 64), (1024, 128), (1000, 64)] {
        let shape = [1, n, heads, d];
        let strides = [n * heads * d, heads * d, d, 1];
        let (qv, kv, vv) = (
            values(n * heads * d, 1),
            values(n * heads * d, 2),
            values(n * heads * d, 3),
        );
        let q = TensorRef::new(&qv, &shape, &strides);
        let k = TensorRef::new(&kv, &shape, &strides);
        let v = TensorRef::new(&vv, &shape, &strides);
        for (what, opts) in [
            ("full", AttnOptions::default()),
            ("causal", AttnOptions::default().causal(true)),
            ("window", AttnOptions::default().window(100, 20)),
        ] {
            let res = flash_attn(&q, &k, &v, &opts).expect("forward");
            println!(
                "N {n} d {d} {what}: out {:016x} lse {:016x}",
                fnv(&res.out.to_f32_vec()),
                fnv(&res.lse.to_f32_vec())
            );
        }
    }
}

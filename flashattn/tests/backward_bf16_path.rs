//! The backward's two paths for bf16 inputs on a CPU with a bf16 dot product, each forced through
//! `FLASHATTN_BWD_BF16`: `dot` (`vdpbf16ps` products, P̃ and dS rounded to bf16) and `f32` (the
//! inputs widened to f32 tiles), over the whole gradient grid and packed sequences. The variable
//! is read once per process, when the kernel table is made, so the test runs itself again as a
//! child process for each setting (the child sees [`CHILD`] and runs the checks). Where the CPU
//! has no bf16 dot product both settings run the f32 products: the children also print the bits
//! of one case's gradients, which must differ between the settings exactly when the active
//! instruction set has the dot product (the setting took effect).

#[path = "integration/common/mod.rs"]
mod common;

use common::backward::{grid, varlen_case};
use flashattn::{flash_attn, AttnOptions, TensorRef};
use half::bf16;
use std::process::Command;

/// Set in the child processes: the path whose checks they run.
const CHILD: &str = "FLASHATTN_TEST_BWD_BF16_CHILD";
const NAME: &str = "both_bf16_backward_paths_match_the_reference";

#[test]
fn both_bf16_backward_paths_match_the_reference() {
    if let Ok(path) = std::env::var(CHILD) {
        assert_eq!(
            std::env::var("FLASHATTN_BWD_BF16").as_deref(),
            Ok(path.as_str()),
            "child without its setting"
        );
        grid::<bf16>();
        varlen_case::<bf16>();
        println!("gradient bits: {:016x}", gradient_bits());
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let mut bits = Vec::new();
    for path in ["dot", "f32"] {
        let out = Command::new(&exe)
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env("FLASHATTN_BWD_BF16", path)
            .env(CHILD, path)
            .output()
            .expect("the test binary runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "FLASHATTN_BWD_BF16={path}: {}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // (The harness may print its own words before it on the same line.)
        let line = text
            .lines()
            .find_map(|l| Some(l.split_once("gradient bits: ")?.1.trim()));
        bits.push(
            line.expect("the child prints its gradient bits")
                .to_string(),
        );
    }
    let dot = flashattn::simd::active().is_ok_and(|isa| isa.has_bf16_dot());
    assert_eq!(
        bits[0] != bits[1],
        dot,
        "gradient bits {bits:?}: the settings should differ exactly when the ISA has the bf16 dot"
    );
}

/// A hash (FNV-1a) of the bits of dq, dk and dv of one bf16 case.
fn gradient_bits() -> u64 {
    let (s, h, d) = (70usize, 2usize, 32usize);
    let vals = |seed: u32| -> Vec<bf16> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..s * h * d)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                bf16::from_f32((x >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
            })
            .collect()
    };
    let (q, k, v, dout) = (vals(1), vals(2), vals(3), vals(4));
    fn t(x: &[bf16], shape: [usize; 4]) -> TensorRef<'_> {
        TensorRef::contiguous(x, &shape)
    }
    let shape = [1, s, h, d];
    let opts = AttnOptions::default();
    let fwd = flash_attn(&t(&q, shape), &t(&k, shape), &t(&v, shape), &opts).expect("forward");
    let g = fwd
        .backward(
            &t(&q, shape),
            &t(&k, shape),
            &t(&v, shape),
            &t(&dout, shape),
            &opts,
        )
        .expect("backward");
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for grad in [g.dq, g.dk, g.dv] {
        for x in grad.as_slice::<bf16>().expect("bf16 gradients") {
            hash = (hash ^ x.to_bits() as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    hash
}

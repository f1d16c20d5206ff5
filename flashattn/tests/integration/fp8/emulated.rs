//! The CUDA FP8 forward kernel (fwd.cu with FA_FP8_INPUT) run on the CPU through the host
//! emulation (see `cuda::emulated`), on the launches `cuda::flash_attn_fp8` would make,
//! against the same reference and bound as the CPU path.

use super::*;
use crate::common;
use crate::common::emu::{forward_builds, have_compiler, run_forward};
use flashattn::cuda::launch_description_fp8;

/// The CUDA path refuses what the CPU path refuses, with the same errors, before any launch.
#[test]
fn launch_description_refuses_bad_input_by_name() {
    rejects_bad_input_with(&|q, k, v, cu, d, o| {
        launch_description_fp8(q, k, v, cu, d, o).map(|_| ())
    });
}

#[test]
fn fp8_forward_kernel_under_emulation() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    let mut ran = Vec::new();
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        // The kernels refuse learnable sinks (`sink`).
        for (i, c) in cases(format).into_iter().filter(|c| !c.sink).enumerate() {
            // Score products per case: 6e6 lets all 28 cases run (~60 s).
            if c.cost() > common::emu::budget(6_000_000) {
                continue;
            }
            let built = c.build();
            let opts = built.opts();
            let [q, k, v] =
                [0, 1, 2].map(|t| built.raw[t].view(&built.layouts[t].0, &built.layouts[t].1));
            let cu = c.packed.then_some((&built.cu_q[..], &built.cu_k[..]));
            let d = launch_description_fp8(&q, &k, &v, cu, &built.descale(), &opts)
                .unwrap_or_else(|e| panic!("{c:?}: {e}"));
            assert!(d.key.fp8 && d.descale.is_some());
            let [qb, kb, vb] = built.raw_bytes();
            let tag = format!("fp8_{}_{i}", format.name());
            let out = run_forward(&mut builds, &d, [&qb, &kb, &vb], DType::BF16, &tag);
            let what = format!("{c:?} emulated {}", d.key.name());
            built.check_output(&out, &built.expected(&opts), &what);
            ran.push(d.key.name());
        }
    }
    eprintln!("{} FP8 cases emulated: {ran:?}", ran.len());
    let vec = ran.iter().filter(|n| n.contains("_vec")).count();
    assert!(
        ran.len() >= 16 && vec >= 4 && ran.len() - vec >= 4,
        "too few cases fit the emulation budget: {ran:?}"
    );
}

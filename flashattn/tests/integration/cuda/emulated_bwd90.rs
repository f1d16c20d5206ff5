//! The sm_90a backward (kernels/bwd_sm90.cu: dQ and dK/dV on wgmma) under host emulation: the
//! emulated gradient grid's cases that it serves (f16/bf16, head_dim a multiple of 8 up to 128),
//! a few more at head dims 64, 96 and 128 (the grid has none there), and packed sequences with
//! strided views, each through the emulated forward (fwd.cu), bwd.cu's prep kernel and the two
//! bwd_sm90.cu kernels, launched as `BackwardLaunch::on_sm90` plans them, against the f64
//! reference with the CPU backward's bound (`common::backward::check`). And a deliberately wrong
//! kernel (dO read through the wrong operand layout) must fail that check.
//!
//! By default f16 takes the even grid cases and bf16 the odd ones (both take the last two, and
//! the extra cases alternate); `FLASHATTN_EMU_ALL=1` runs every case in both types.
#![cfg(feature = "cuda")]

use super::emulated::backward::{case_with, sm90_builds, varlen};
use crate::common::backward::{cases, GradCase};
use crate::common::emu::{self, forward_builds, have_compiler};
use flashattn::{AttnOptions, Element, TensorRef};

static SLOPES: [f32; 4] = [0.5, 0.25, 0.125, 0.0625];

/// Whether bwd_sm90.cu serves a case (16-byte loads of contiguous rows, head_dim up to 128);
/// `case_with` checks it against the library's choice.
fn served(c: &GradCase) -> bool {
    let d = c.shape.5;
    d.is_multiple_of(8) && d <= 128
}

/// Cases at the head dims the kernel's variants are compiled for (64, and 96 and 128 padded to
/// 128, whose dkdv takes 32 query rows a step): GQA with causal and ALiBi; MQA with a window,
/// softcap and dropout over two key CTAs; dropout with causal and zero-filled columns past
/// head_dim 96 over two query CTAs. The GPU gradient grid (`cuda::device::backward`) runs them
/// too.
pub(crate) fn extra_cases() -> Vec<GradCase> {
    vec![
        GradCase {
            seed: 501,
            shape: (1, 70, 90, 4, 2, 128),
            opts: AttnOptions::default()
                .causal(true)
                .alibi_slopes(TensorRef::contiguous(&SLOPES, &[4])),
            logit_scale: 1.0,
        },
        GradCase {
            seed: 502,
            shape: (2, 65, 150, 2, 1, 64),
            opts: AttnOptions::default()
                .window(7, 3)
                .softcap(2.5)
                .dropout(0.2, 1234),
            logit_scale: 1.0,
        },
        GradCase {
            seed: 503,
            shape: (1, 140, 67, 2, 2, 96),
            opts: AttnOptions::default().causal(true).dropout(0.2, 99),
            logit_scale: 1.0,
        },
    ]
}

/// The grid on bwd_sm90.cu in `T`; `parity` picks the default share (see the module doc).
fn grid<T: Element>(parity: usize) {
    if !have_compiler() {
        return;
    }
    let all = emu::all();
    let mut builds = [forward_builds(), sm90_builds()];
    let grid = cases(true);
    let shaped = grid.len() - 2; // the shapes times their option sets, then two more
    let mut ran = 0;
    for (i, c) in grid.iter().enumerate() {
        if !served(c) || c.cost() > 12_000_000 || !(all || i % 2 == parity || i >= shaped) {
            continue;
        }
        case_with::<T>(&mut builds, c, &c.opts, false, true);
        ran += 1;
    }
    for (i, c) in extra_cases().iter().enumerate() {
        if all || i % 2 == parity {
            case_with::<T>(&mut builds, c, &c.opts, false, true);
            ran += 1;
        }
    }
    eprintln!("{}: {ran} gradient cases emulated on bwd_sm90.cu", T::DTYPE);
    let want = match (all, parity) {
        (true, _) => 15,
        (false, 0) => 10,
        _ => 7,
    };
    assert_eq!(ran, want, "the emulated sm_90a gradient grid lost cases");
}

#[test]
fn gradients_sm90_f16() {
    grid::<half::f16>(0);
}

#[test]
fn gradients_sm90_bf16() {
    grid::<half::bf16>(1);
}

/// Packed sequences (one without keys, one without queries, spare rows after the last sequence)
/// with out, dout and lse as strided views, on bwd_sm90.cu.
#[test]
fn varlen_and_strided_views_sm90() {
    if !have_compiler() {
        return;
    }
    let mut builds = sm90_builds();
    varlen::<half::bf16>(&mut builds, true);
    if emu::all() {
        varlen::<half::f16>(&mut builds, true);
    }
}

/// The emulation catches a wrong operand layout: bwd_sm90.cu with dV's B operand (dO) read
/// K-major instead of MN-major (transposed) must fail the gradient check on a case the kernel as
/// it is passes (the grid's).
#[test]
fn sm90_transposed_operand_mistake_fails() {
    if !have_compiler() {
        return;
    }
    let broken = emu::BrokenKernel::new(
        "bwd_sm90",
        "bwd_sm90.cu",
        "desc_mnmajor(do_addr, KV_BLOCK_M, j)",
        "desc_kmajor(do_addr, KV_BLOCK_M, 0, j)",
    );
    // A seed of its own: its work folders (left by the failed run) are removed below by name.
    let c = &GradCase {
        seed: 902,
        ..extra_cases().swap_remove(1)
    };
    let mut builds = [forward_builds(), sm90_builds()];
    // The broken source is built first under the launch's key, so the case runs it.
    let key = {
        let k = flashattn::cuda::KernelKey {
            kind: flashattn::cuda::KernelKind::BackwardDq,
            dtype: flashattn::DType::BF16,
            head_dim: 64,
            masked: true,
            softcap: true,
            alibi: false,
            dropout: true,
            vec_load: true,
            fp8: false,
        };
        k.sm90_backward().unwrap()
    };
    builds[1].get(&key, &[broken.define()]);
    let prefix = format!("bwd_{}_bf16_902_", std::process::id());
    assert!(
        broken.fails(&prefix, || {
            case_with::<half::bf16>(&mut builds, c, &c.opts, false, true);
        }),
        "the emulation missed dO read through the wrong operand layout"
    );
}

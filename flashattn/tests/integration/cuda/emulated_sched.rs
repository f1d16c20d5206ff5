//! The dynamic tile scheduler of the warp-specialised sm_90a forward (fwd_sm90_ws.cu's
//! TileSource, `FLASHATTN_SM90_SCHEDULER=dynamic`) under host emulation: causal, GQA and packed
//! (varlen) cases launched persistent with a few CTAs, each CTA's producer taking its tiles from
//! the launch's counter and handing them to the consumers through shared memory, against the f64
//! reference; and a broken hand-off (the consumers reading the tile before its barrier) that must
//! fail.
//!
//! Under emulation the blocks of a launch run one after another (host_emulation.h), so the first
//! block takes every tile after the other blocks' first ones: the counter, the skipped empty
//! tiles, the hand-off ring over many tiles and the common stop are exercised, not a split that
//! depends on timing.
#![cfg(feature = "cuda")]

use super::emulated::run;
use crate::common;
use crate::common::emu::{forward_builds, have_compiler};
use crate::common::*;
use flashattn::cuda::{launch_description, Arch, ForwardKernel, KernelKind, LaunchDescription};
use flashattn::{AttnOptions, DType, TensorRef};

/// CTAs of the emulated launches: few, so that tiles outnumber them.
const CTAS: usize = 3;

/// The launch of `opts` over q, k, v on the warp-specialised kernel, persistent with `CTAS` CTAs
/// under the dynamic scheduler.
fn dynamic_launch(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &AttnOptions,
) -> LaunchDescription {
    let d = launch_description(q, k, v, opts)
        .unwrap()
        .for_arch(Arch::SM90, ForwardKernel::Sm90Ws)
        .persistent(CTAS)
        .dynamic_tiles(true);
    assert!(
        d.key.kind == KernelKind::ForwardSm90Ws && d.tile_counter && d.grid.0 as usize <= CTAS,
        "{} grid {:?}",
        d.key.name(),
        d.grid
    );
    d
}

/// Causal (query blocks seeing 1 to 3 key blocks), causal GQA and a window with softcap, in
/// bf16 and f16; then packed sequences (sequences of no rows give tiles the producer skips).
#[test]
fn dynamic_scheduler_under_emulation() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    let mut ran = Vec::new();
    for dtype in [DType::BF16, DType::F16] {
        let cases = [
            Case {
                dtype,
                seqlen_q: 384,
                seqlen_k: 320,
                heads: 2,
                heads_kv: 2,
                head_dim: 64,
                causal: true,
                seed: 71,
                ..Case::default()
            },
            Case {
                dtype,
                batch: 2,
                seqlen_q: 200,
                seqlen_k: 260,
                heads: 4,
                heads_kv: 2,
                head_dim: 128,
                causal: true,
                seed: 72,
                ..Case::default()
            },
            Case {
                dtype,
                seqlen_q: 300,
                seqlen_k: 300,
                heads: 2,
                heads_kv: 1,
                head_dim: 64,
                window: (100, 20),
                softcap: Some(30.0),
                seed: 73,
                ..Case::default()
            },
        ];
        for (i, case) in cases.into_iter().enumerate() {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let d = dynamic_launch(&q, &k, &v, &inputs.opts());
            let out = run(&mut builds, &d, &q, &k, &v, &format!("dyn_{dtype}_{i}"));
            inputs.check_with(
                &out,
                &format!("{case} dynamic {}", d.key.name()),
                &inputs.opts(),
            );
            ran.push(format!("{} grid {:?}", d.key.name(), d.grid));
        }
        for (n, case) in varlen_cases(dtype, 4, 2, 64).into_iter().enumerate() {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let opts = AttnOptions {
                cu_seqlens: Some((&inputs.cu_q[..], &inputs.cu_k[..])),
                ..inputs.opts().clone()
            };
            let d = dynamic_launch(&q, &k, &v, &opts);
            let out = run(
                &mut builds,
                &d,
                &q,
                &k,
                &v,
                &format!("dyn_varlen_{dtype}_{n}"),
            );
            inputs.check(&out, &format!("dynamic {}", d.key.name()));
            ran.push(format!("{} varlen grid {:?}", d.key.name(), d.grid));
        }
    }
    eprintln!(
        "{} cases emulated under the dynamic scheduler: {ran:?}",
        ran.len()
    );
    // The static rounds stay the default: a description says dynamic only when asked.
    let inputs = Case {
        dtype: DType::BF16,
        head_dim: 64,
        ..Case::default()
    }
    .build();
    let (q, k, v) = inputs.views();
    let d = launch_description(&q, &k, &v, &inputs.opts())
        .unwrap()
        .for_arch(Arch::SM90, ForwardKernel::Sm90Ws);
    assert!(!d.tile_counter);
    // Other kernels take no counter.
    let d = launch_description(&q, &k, &v, &inputs.opts())
        .unwrap()
        .for_arch(Arch::SM90, ForwardKernel::Sm90)
        .dynamic_tiles(true);
    assert!(!d.tile_counter);
}

/// The emulation catches a broken hand-off: consumers that load the tile from its slot before
/// waiting on the slot's tile_full must fail (reading the slot's old contents: poison, or the tile
/// two before), on a causal case of more tiles than CTAs; the kernel as it is passes it.
#[test]
fn dynamic_handoff_mistake_fails() {
    if !have_compiler() {
        return;
    }
    let broken = common::emu::BrokenKernel::new(
        "ws_handoff",
        "fwd_sm90_ws.cu",
        "    mbar_wait(sm.tile_full(slot), (src.n / 2) & 1);\n    ++src.n;\n    const int tile = ld_shared_s32(sm.tile_slot(slot));\n",
        "    const int tile = ld_shared_s32(sm.tile_slot(slot));\n    mbar_wait(sm.tile_full(slot), (src.n / 2) & 1);\n    ++src.n;\n",
    );

    let inputs = super::emulated::six_causal_tiles(74).build();
    let (q, k, v) = inputs.views();
    let d = dynamic_launch(&q, &k, &v, &inputs.opts());
    super::emulated::assert_mistake_caught(
        broken,
        &d,
        &inputs,
        "ws_handoff",
        "the emulation missed consumers reading the tile before its barrier",
    );
}

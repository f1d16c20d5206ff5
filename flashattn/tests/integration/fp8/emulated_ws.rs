//! fwd_sm90_ws.cu's FP8 mode (`FLASHATTN_CUDA_FWD=sm90fp8ws`: TMA loads of e4m3 tiles, V
//! transposed in shared memory by the producer warpgroup, wgmma with e4m3 operands for both
//! products) under emulation, on the e4m3 cases fwd_sm90_fp8.cu runs there (16-byte aligned
//! rows, no dropout, no sinks) plus multi-block ones, one CTA per tile and persistent with a few
//! CTAs, against the f64 reference with the bound of P rounded to e4m3
//! (`emulated::check_p_e4m3`); and a broken transpose that must fail.

use super::emulated::{check_p_e4m3, fp8_launch};
use super::*;
use crate::common;
use crate::common::emu::{forward_builds, have_compiler, run_forward, Builds};
use flashattn::cuda::{launch_description_fp8, Arch, ForwardKernel, KernelKind, LaunchDescription};

/// CTAs of the persistent launches: few, so that every CTA takes several tiles (and its K, V and
/// Vᵀ rings run on across them).
const PERSISTENT_CTAS: usize = 3;

/// The launch of case `c` on the FP8 mode of the warp-specialised kernel, persistent with
/// `persistent` CTAs if given; `None` where the kernel does not serve it (unaligned rows).
fn ws_launch(c: &Case, built: &Built, persistent: Option<usize>) -> Option<LaunchDescription> {
    let mut d = fp8_launch(c, built, Some(ForwardKernel::Sm90Fp8Ws));
    if !d.key.is_sm90() {
        return None;
    }
    assert!(
        d.key.fp8 && d.key.kind == KernelKind::ForwardSm90Ws && d.tma.is_some(),
        "{}",
        d.key.name()
    );
    assert!(d.tma.unwrap().iter().all(|m| m.elem_bytes == 1));
    if let Some(n) = persistent {
        d = d.persistent(n);
    }
    Some(d)
}

fn run_case(builds: &mut Builds, c: &Case, d: &LaunchDescription, tag: &str) {
    let built = c.build();
    let [qb, kb, vb] = built.raw_bytes();
    let out = run_forward(builds, d, [&qb, &kb, &vb], DType::BF16, tag);
    let what = format!("{c:?} emulated {} grid {:?}", d.key.name(), d.grid);
    check_p_e4m3(&built, &out, &built.expected(&built.opts()).0, &what);
}

/// Runs the cases of `list` that fit the emulation budget and the kernel serves (aligned rows),
/// one CTA per tile for the even ones and persistent for the odd ones, each checked; a launch
/// carries per-block factors exactly when its case has them. Returns what ran (kernel and grid)
/// and how many of them were persistent.
fn run_list(builds: &mut Builds, list: Vec<Case>, tag: &str) -> (Vec<String>, usize) {
    let (mut ran, mut persistent) = (Vec::new(), 0);
    for (i, c) in list.into_iter().enumerate() {
        if c.cost() > common::emu::budget(20_000_000) {
            continue;
        }
        let built = c.build();
        let pers = (i % 2 == 1).then_some(PERSISTENT_CTAS);
        let Some(d) = ws_launch(&c, &built, pers) else {
            continue; // unaligned rows: fwd.cu
        };
        assert_eq!(d.params.block_q > 0, c.per_block, "{c:?}");
        run_case(builds, &c, &d, &format!("{tag}_{i}"));
        persistent += pers.is_some() as usize;
        ran.push(format!("{} grid {:?}", d.key.name(), d.grid));
    }
    (ran, persistent)
}

/// The e4m3 cases (one CTA per tile for the even ones, persistent for the odd ones) and
/// multi-block ones: causal with several query blocks of odd key-block counts (GQA), head_dim 256
/// with a window and ALiBi (64-key blocks), softcap, and packed sequences.
#[test]
fn fp8_sm90_ws_kernel_under_emulation() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    let mut list: Vec<Case> = cases(Fp8Format::E4M3)
        .into_iter()
        // Per-block factors: fp8_ws_per_block_under_emulation.
        .filter(|c| !c.sink && c.dropout == 0.0 && !c.per_block)
        .collect();
    let mut c = Case::new(Fp8Format::E4M3, 1, 300, 330, (4, 2), 128);
    (c.huge, c.causal, c.seed) = (true, true, 41);
    list.push(c);
    let mut c = Case::new(Fp8Format::E4M3, 2, 90, 200, (2, 1), 256);
    (c.huge, c.window, c.alibi, c.seed) = (true, (120, 30), true, 42);
    list.push(c);
    let mut c = Case::new(Fp8Format::E4M3, 1, 140, 270, (2, 2), 64);
    (c.softcap, c.seed) = (Some(25.0), 43);
    list.push(c);
    let mut c = Case::new(Fp8Format::E4M3, 1, 1, 1, (4, 2), 128);
    c.lens_q = vec![130, 0, 20, 70];
    c.lens_k = vec![150, 40, 3, 260];
    (c.packed, c.causal, c.huge, c.seed) = (true, true, true, 44);
    list.push(c);
    let (ran, persistent) = run_list(&mut builds, list, "fp8_ws");
    eprintln!(
        "{} FP8 cases emulated on fwd_sm90_ws.cu ({persistent} persistent): {ran:?}",
        ran.len()
    );
    assert!(
        ran.len() >= 9 && persistent >= 3,
        "too few cases fit the emulation budget: {ran:?}"
    );
    // e5m2 stays on fwd.cu (the instruction names the format); 16-bit inputs keep fwd_sm90.cu.
    let c = Case::new(Fp8Format::E5M2, 1, 16, 16, (2, 2), 64).build();
    let [q, k, v] = [0, 1, 2].map(|t| c.raw[t].view(&c.layouts[t].0, &c.layouts[t].1));
    let d = launch_description_fp8(&q, &k, &v, &c.opts().clone().descale(c.descale()))
        .unwrap()
        .for_arch(Arch::SM90, ForwardKernel::Sm90Fp8Ws);
    assert!(!d.key.is_sm90(), "{}", d.key.name());
}

/// Per-block factors (`Descale::per_block`) on fwd_sm90_ws.cu's FP8 mode: a call asking for it
/// runs there (no longer routed to fwd_sm90_fp8.cu), on the per-block e4m3 cases of `cases` and
/// `block_cases` at head_dim 128 and 256, one CTA per tile and persistent with a few CTAs (so a
/// CTA's next tile starts with its own factors), against the bound of P rounded to e4m3. A score
/// or P·V product scaled by another block's factor fails them (checked by breaking each index).
#[test]
fn fp8_ws_per_block_under_emulation() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    let mut list: Vec<Case> = cases(Fp8Format::E4M3)
        .into_iter()
        .filter(|c| c.per_block && !c.sink && c.dropout == 0.0)
        .collect();
    list.extend(block_cases(Fp8Format::E4M3, 128));
    list.extend(block_cases(Fp8Format::E4M3, 256));
    assert!(list.iter().all(|c| c.per_block));
    let (ran, _) = run_list(&mut builds, list, "fp8_ws_block");
    eprintln!(
        "{} per-block FP8 cases emulated on fwd_sm90_ws.cu: {ran:?}",
        ran.len()
    );
    assert!(
        ran.len() >= 4,
        "too few cases fit the emulation budget: {ran:?}"
    );
}

/// The dynamic tile scheduler (cuda/schedule.rs) on the FP8 mode, whose transposer warps take
/// their tiles from the producer too: a causal GQA case of odd key-block counts, packed sequences
/// (one of no rows) and a per-block case, persistent with a few CTAs.
#[test]
fn fp8_ws_dynamic_scheduler_under_emulation() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    let mut list = Vec::new();
    let mut c = Case::new(Fp8Format::E4M3, 1, 300, 330, (4, 2), 128);
    (c.huge, c.causal, c.seed) = (true, true, 46);
    list.push(c);
    let mut c = Case::new(Fp8Format::E4M3, 1, 1, 1, (4, 2), 128);
    c.lens_q = vec![130, 0, 20, 70];
    c.lens_k = vec![150, 40, 3, 260];
    (c.packed, c.causal, c.huge, c.seed) = (true, true, true, 47);
    list.push(c);
    list.push(block_cases(Fp8Format::E4M3, 128).remove(1));
    for (i, c) in list.into_iter().enumerate() {
        let built = c.build();
        let d = ws_launch(&c, &built, Some(PERSISTENT_CTAS))
            .expect("aligned rows")
            .dynamic_tiles(true);
        assert!(d.tile_counter);
        run_case(&mut builds, &c, &d, &format!("fp8_ws_dyn_{i}"));
    }
}

/// The emulation catches a wrong transpose: fwd_sm90_ws.cu's FP8 mode with Vᵀ's keys out of the
/// P fragment's order (kpos: the two matrices of a half swapped in the even lines' byte permute)
/// must fail on a case whose softmax is not flat; the kernel as it is passes the same case.
#[test]
fn fp8_ws_transpose_mistake_fails() {
    if !have_compiler() {
        return;
    }
    // Keys 8 + 2t and 9 + 2t of each 32 where 2t and 2t + 1 belong (and back) in the even lines.
    let broken = common::emu::BrokenKernel::new(
        "fp8_ws_vt",
        "fwd_sm90_ws.cu",
        "(int)bytes_even(x, y)",
        "(int)bytes_even(y, x)",
    );

    let mut c = Case::new(Fp8Format::E4M3, 1, 130, 200, (2, 1), 128);
    (c.huge, c.causal, c.seed) = (true, true, 45);
    let built = c.build();
    let d = ws_launch(&c, &built, Some(1)).expect("aligned rows");
    run_case(&mut forward_builds(), &c, &d, "fp8_ws_vt_good");

    let mut builds = forward_builds();
    builds.get(&d.key, &[broken.define()]);
    let prefix = format!("case_{}_fp8_ws_vt_broken_", std::process::id());
    assert!(
        broken.fails(&prefix, || run_case(
            &mut builds,
            &c,
            &d,
            "fp8_ws_vt_broken"
        )),
        "the emulation missed Vᵀ's keys in the wrong order"
    );
}

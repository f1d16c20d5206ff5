//! The CUDA kernels' own source, run on the CPU: `kernels/host_emulation.h` stands in for the CUDA
//! primitives (threads, barriers, ldmatrix, mma.sync, shuffles, cp.async) and g++ compiles
//! fwd.cu / fwd_f32.cu with it. Each case takes the launch the GPU path would make
//! (`flashattn::cuda::launch_description`: kernel variant, grid, sequence table, strides, window
//! clamping) and checks the result against the f64 reference with the same bound as the CPU and GPU
//! tests. This checks the kernels' indexing, fragment layouts, swizzle, masking, pipelining and
//! online softmax on a machine without a GPU; it cannot check timing or true hardware races.
//!
//! Needs g++ (C++20). Without it the test says why it skips; CI sets FLASHATTN_REQUIRE_EMULATION=1,
//! which makes a missing compiler a failure.
#![cfg(feature = "cuda")]

mod common;

use common::emu::{bytes, from_bytes, have_compiler, work_dir, Builds, KERNELS};
use common::grid::grid;
use common::*;
use flashattn::cuda::{launch_description, KernelKey, LaunchDescription};
use flashattn::{AttnOutput, DType, Tensor, TensorRef};
use std::process::Command;

const DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cuda_emu/driver.cpp");

/// The forward drivers' builds: fwd.cu or fwd_f32.cu, named to the driver by FA_KERNEL.
fn forward_builds() -> Builds {
    Builds::new(DRIVER, &[])
}

fn exe(builds: &mut Builds, key: &KernelKey) -> std::path::PathBuf {
    let file = if key.dtype == DType::F32 {
        "fwd_f32.cu"
    } else {
        "fwd.cu"
    };
    builds.get(key, &[format!("-DFA_KERNEL=\"{KERNELS}/{file}\"")])
}

/// Runs the emulated kernel of `d` on the buffers behind q, k, v.
fn run(
    builds: &mut Builds,
    d: &LaunchDescription,
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    tag: &str,
) -> AttnOutput {
    let dir = work_dir().join(format!("case_{}_{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let nums: Vec<String> = [
        d.grid.0 as i64,
        d.grid.1 as i64,
        d.grid.2 as i64,
        d.threads as i64,
        d.smem_bytes as i64,
        d.table.is_some() as i64,
        d.slopes.is_some() as i64,
        d.heads as i64,
        d.heads_kv as i64,
        d.head_dim as i64,
    ]
    .iter()
    .map(|x| x.to_string())
    .chain(d.strides.iter().map(|x| x.to_string()))
    .chain([format!("{:e}", d.softmax_scale), format!("{:e}", d.softcap)])
    .chain(
        [
            d.window.0 as i64,
            d.window.1 as i64,
            d.batch_seqlens.0 as i64,
            d.batch_seqlens.1 as i64,
        ]
        .iter()
        .map(|x| x.to_string()),
    )
    .chain(d.batch_strides.iter().map(|x| x.to_string()))
    .chain([d.out_len.to_string(), d.lse_len.to_string()])
    .collect();
    std::fs::write(dir.join("params.txt"), nums.join("\n")).unwrap();
    std::fs::write(dir.join("q.bin"), bytes(q.data())).unwrap();
    std::fs::write(dir.join("k.bin"), bytes(k.data())).unwrap();
    std::fs::write(dir.join("v.bin"), bytes(v.data())).unwrap();
    if let Some(t) = &d.table {
        std::fs::write(
            dir.join("table.bin"),
            t.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        )
        .unwrap();
    }
    if let Some(s) = &d.slopes {
        std::fs::write(
            dir.join("slopes.bin"),
            s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        )
        .unwrap();
    }
    if !d.is_empty() {
        let exe = exe(builds, &d.key);
        let o = Command::new(&exe)
            .arg(&dir)
            .output()
            .expect("run the emulation");
        assert!(
            o.status.success(),
            "emulation of {} failed: {:?}",
            d.key.name(),
            o
        );
    }
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap_or_default();
    let (ob, lb) = (read("out.bin"), read("lse.bin"));
    let lse: Vec<f32> = lb
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let out = from_bytes(&ob, q.dtype());
    let _ = std::fs::remove_dir_all(&dir);
    // An empty description launched nothing and wrote no file: its shapes hold no element.
    AttnOutput {
        out: Tensor::from_buffer(out, &d.out_shape).expect("out length"),
        lse: Tensor::from_vec(lse, &d.lse_shape).expect("lse length"),
    }
}

/// Reference work allowed per emulated case (the emulation runs ~1e3x slower than the CPU path);
/// `FLASHATTN_EMU_BUDGET` overrides it.
fn budget() -> usize {
    std::env::var("FLASHATTN_EMU_BUDGET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

fn run_grid(dtype: DType) {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    let mut ran = 0;
    for (i, case) in grid(dtype).into_iter().enumerate() {
        if case.cost() > budget() {
            continue;
        }
        let inputs = case.build();
        let (q, k, v) = inputs.views();
        let d = launch_description(&q, &k, &v, None, &inputs.opts()).unwrap();
        let flash = run(&mut builds, &d, &q, &k, &v, &format!("{dtype}_{i}"));
        let naive = [inputs.naive(), inputs.naive_sequential()];
        let r = inputs.reference();
        let v_max = inputs.v_values().iter().fold(0f64, |m, x| m.max(x.abs()));
        check_bound(
            &format!("{case} emulated {}", d.key.name()),
            dtype,
            &flash,
            &naive,
            &r,
            v_max,
            case.seqlen_k,
        );
        ran += 1;
    }
    eprintln!("{dtype}: {ran} grid cases emulated");
    assert!(
        ran >= 10.min(budget()),
        "too few cases fit the emulation budget: {ran}"
    );
}

#[test]
fn grid_f16() {
    run_grid(DType::F16);
}

#[test]
fn grid_bf16() {
    run_grid(DType::BF16);
}

#[test]
fn grid_f32() {
    run_grid(DType::F32);
}

/// Packed sequences, including empty ones and rows after the last sequence (launched as a tail
/// sequence that sees no key: out 0, lse -inf).
#[test]
fn varlen() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (n, case) in varlen_cases(dtype, 2, 1, 40).into_iter().enumerate() {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let cu = Some((&inputs.cu_q[..], &inputs.cu_k[..]));
            let desc = launch_description(&q, &k, &v, cu, &inputs.opts()).unwrap();
            let flash = run(
                &mut builds,
                &desc,
                &q,
                &k,
                &v,
                &format!("varlen_{dtype}_{n}"),
            );
            inputs.check(&flash, "emulated");
        }
    }
}

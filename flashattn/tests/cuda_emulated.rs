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

use common::grid::grid;
use common::*;
use flashattn::cuda::{launch_description, KernelKey, LaunchDescription};
use flashattn::{AttnOutput, Buffer, DType, Slice, Tensor, TensorRef};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda/kernels");
const DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cuda_emu/driver.cpp");

fn work_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda_emu");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Whether g++ can be used, printing why not (or failing when CI requires the test).
fn have_compiler() -> bool {
    let ok = Command::new("g++")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let required = std::env::var("FLASHATTN_REQUIRE_EMULATION").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "FLASHATTN_REQUIRE_EMULATION=1 but g++ is missing"
        );
        eprintln!("skipping the emulated CUDA kernels: no g++");
    }
    ok
}

/// Builds (once per test process) the emulation binary of a kernel variant.
struct Builds(HashMap<KernelKey, PathBuf>);

impl Builds {
    fn get(&mut self, key: &KernelKey) -> PathBuf {
        if let Some(p) = self.0.get(key) {
            return p.clone();
        }
        let exe = work_dir().join(format!("{}_{}", key.name(), std::process::id()));
        let file = if key.dtype == DType::F32 {
            "fwd_f32.cu"
        } else {
            "fwd.cu"
        };
        let mut cmd = Command::new("g++");
        cmd.args(["-std=c++20", "-O1", "-pthread", "-DFA_HOST_EMULATION"])
            .arg(format!("-DFA_KERNEL=\"{KERNELS}/{file}\""))
            .arg(format!("-I{KERNELS}"));
        for (k, v) in key.defines() {
            cmd.arg(format!("-D{k}={v}"));
        }
        let out = cmd
            .arg(DRIVER)
            .arg("-o")
            .arg(&exe)
            .output()
            .expect("run g++");
        assert!(
            out.status.success(),
            "g++ failed for {}:\n{}",
            key.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        self.0.insert(*key, exe.clone());
        exe
    }
}

impl Drop for Builds {
    fn drop(&mut self) {
        for p in self.0.values() {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn bytes(s: Slice<'_>) -> Vec<u8> {
    match s {
        Slice::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Slice::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Slice::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
    }
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
        let exe = builds.get(&d.key);
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
    let out = match q.dtype() {
        DType::F32 => Buffer::F32(
            ob.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        DType::F16 => Buffer::F16(
            ob.chunks(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
        DType::BF16 => Buffer::BF16(
            ob.chunks(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
    };
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
    let mut builds = Builds(HashMap::new());
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
    let mut builds = Builds(HashMap::new());
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

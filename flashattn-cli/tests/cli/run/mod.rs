//! `run` on safetensors files: the helpers its tests share.

use crate::common::*;
use flashattn::{reference, AttnOptions, TensorRef};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};
use std::process::Output;

mod against_reference;
mod errors;
mod packed;

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.5f32..1.5)).collect()
}

#[derive(Clone, Copy, Debug)]
enum Ty {
    F32,
    F16,
    BF16,
}

/// Values rounded to `ty` (so the reference sees exactly what the CLI reads), with their bytes.
fn encode(ty: Ty, v: &[f32]) -> (&'static str, Vec<f32>, Vec<u8>) {
    match ty {
        Ty::F32 => ("F32", v.to_vec(), f32_bytes(v)),
        Ty::F16 => {
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            (
                "F16",
                h.iter().map(|x| x.to_f32()).collect(),
                h.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            )
        }
        Ty::BF16 => {
            let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            (
                "BF16",
                h.iter().map(|x| x.to_f32()).collect(),
                h.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            )
        }
    }
}

fn run_files(input: &Path, output: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["run", input.to_str().unwrap(), output.to_str().unwrap()];
    args.extend_from_slice(extra);
    flashattn(&args)
}

/// Reads a tensor of the output file as f64.
fn read_out(path: &Path, name: &str) -> (Dtype, Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    let d = t.data();
    let vals: Vec<f64> = match t.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    };
    (t.dtype(), t.shape().to_vec(), vals)
}

fn assert_close(name: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tol * (1.0 + w.abs())
        };
        assert!(ok, "{name}[{i}]: got {g}, want {w} (tol {tol})");
    }
}

fn tolerance(ty: Ty) -> f64 {
    // Output rounding to the format dominates; f32 accumulation adds a little on top.
    match ty {
        Ty::F32 => 1e-5,
        Ty::F16 => 4e-3,
        Ty::BF16 => 3e-2,
    }
}

struct Case {
    ty: Ty,
    /// Batched `[batch, seqlen_q, seqlen_k]`, or packed `cu_seqlens_q`/`cu_seqlens_k`.
    batched: Option<(usize, usize, usize)>,
    cu: Option<(Vec<i32>, Vec<i32>)>,
    heads: usize,
    heads_kv: usize,
    d: usize,
    alibi: Option<Vec<usize>>,
    flags: Vec<&'static str>,
    opts: AttnOptions<'static>,
}

/// Writes the case's input, runs the CLI, compares `out` and `lse` with `reference`.
fn check_against_reference(case: Case) {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("in.safetensors"),
        dir.path().join("out.safetensors"),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (q_shape, kv_shape) = match (&case.batched, &case.cu) {
        (Some((b, sq, sk)), None) => (
            vec![*b, *sq, case.heads, case.d],
            vec![*b, *sk, case.heads_kv, case.d],
        ),
        (None, Some((cq, ck))) => (
            vec![*cq.last().unwrap() as usize, case.heads, case.d],
            vec![*ck.last().unwrap() as usize, case.heads_kv, case.d],
        ),
        _ => unreachable!(),
    };
    let n = |s: &[usize]| s.iter().product::<usize>();
    let (dt, q, qb) = encode(case.ty, &random(&mut rng, n(&q_shape)));
    let (_, k, kb) = encode(case.ty, &random(&mut rng, n(&kv_shape)));
    let (_, v, vb) = encode(case.ty, &random(&mut rng, n(&kv_shape)));
    let mut tensors = vec![
        raw("q", dt, &q_shape, qb),
        raw("k", dt, &kv_shape, kb),
        raw("v", dt, &kv_shape, vb),
    ];
    let slopes: Option<Vec<f32>> = case
        .alibi
        .as_ref()
        .map(|s| (0..n(s)).map(|i| 0.05 + 0.1 * i as f32).collect());
    if let (Some(shape), Some(sl)) = (&case.alibi, &slopes) {
        tensors.push(raw("alibi_slopes", "F32", shape, f32_bytes(sl)));
    }
    if let Some((cq, ck)) = &case.cu {
        tensors.push(raw("cu_seqlens_q", "I32", &[cq.len()], i32_bytes(cq)));
        tensors.push(raw("cu_seqlens_k", "I32", &[ck.len()], i32_bytes(ck)));
    }
    write_st(&input, &tensors);

    let res = run_files(&input, &output, &case.flags);
    assert!(
        res.status.success(),
        "run failed: {}",
        String::from_utf8_lossy(&res.stderr)
    );

    let wrap = |v: &'static [f32], shape: &[usize]| -> TensorRef<'static> {
        match case.ty {
            Ty::F32 => TensorRef::contiguous(v, shape),
            Ty::F16 => TensorRef::contiguous(
                Vec::leak(v.iter().map(|&x| f16::from_f32(x)).collect()),
                shape,
            ),
            Ty::BF16 => TensorRef::contiguous(
                Vec::leak(v.iter().map(|&x| bf16::from_f32(x)).collect()),
                shape,
            ),
        }
    };
    let (qt, kt, vt) = (
        wrap(q.leak(), &q_shape),
        wrap(k.leak(), &kv_shape),
        wrap(v.leak(), &kv_shape),
    );
    let mut opts = case.opts.clone();
    if let (Some(shape), Some(sl)) = (&case.alibi, slopes) {
        opts.alibi_slopes = Some(TensorRef::contiguous(sl.leak(), shape));
    }
    let want = match &case.cu {
        Some((cq, ck)) => reference::attention_varlen(&qt, &kt, &vt, cq, ck, &opts).unwrap(),
        None => reference::attention(&qt, &kt, &vt, &opts).unwrap(),
    };
    let (out_dt, out_shape, out) = read_out(&output, "out");
    let (lse_dt, lse_shape, lse) = read_out(&output, "lse");
    assert_eq!(format!("{out_dt:?}"), dt, "out keeps q's dtype");
    assert_eq!(lse_dt, Dtype::F32);
    assert_eq!(out_shape, want.out_shape);
    assert_eq!(lse_shape, want.lse_shape);
    assert_close("out", &out, &want.out, tolerance(case.ty));
    assert_close(
        "lse",
        &lse,
        &want.lse,
        if matches!(case.ty, Ty::F32) {
            1e-5
        } else {
            1e-3
        },
    );
}

/// A valid batched f32 input: q [1, 4, 2, 8], k/v [1, 6, 2, 8].
fn good_tensors() -> Vec<Raw> {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let q = random(&mut rng, 4 * 2 * 8);
    let kv = random(&mut rng, 6 * 2 * 8);
    vec![
        raw("q", "F32", &[1, 4, 2, 8], f32_bytes(&q)),
        raw("k", "F32", &[1, 6, 2, 8], f32_bytes(&kv)),
        raw("v", "F32", &[1, 6, 2, 8], f32_bytes(&kv)),
    ]
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

/// Runs with the input `write` produces and expects failure: a one-line `error:` message that
/// contains every `needles` string, no OUT, no leftover temporary file; then again with an OUT
/// that already exists, which must be left byte-for-byte as it was.
fn expect_failure(write: impl Fn(&Path), flags: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("in.safetensors"),
        dir.path().join("out.safetensors"),
    );
    write(&input);
    let before = files_in(dir.path());
    for existing in [false, true] {
        if existing {
            std::fs::write(&output, b"previous result").unwrap();
        }
        let res = run_files(&input, &output, flags);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert!(!res.status.success(), "expected failure for {needles:?}");
        assert_eq!(
            res.status.code(),
            Some(1),
            "a clean error exit, not a panic: {stderr}"
        );
        assert!(stderr.starts_with("error: "), "stderr: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        for n in needles {
            assert!(stderr.contains(n), "stderr should mention {n:?}: {stderr}");
        }
        if existing {
            assert_eq!(
                std::fs::read(&output).unwrap(),
                b"previous result",
                "existing OUT changed"
            );
            std::fs::remove_file(&output).unwrap();
        }
        assert_eq!(
            files_in(dir.path()),
            before,
            "no OUT and no temporary file may remain"
        );
    }
}

fn with_tensors(tensors: Vec<Raw>) -> impl Fn(&Path) {
    move |p| write_st(p, &tensors)
}

//! `flashattn run` on FP8 files: the output equals the library's FP8 forward bit for bit and the
//! f64 reference on the dequantised inputs within bf16 rounding; bad FP8 files fail by name.

use crate::common::*;
use flashattn::fp8::{
    flash_attn_fp8, flash_attn_with_kvcache_fp8, Descale, Fp8TensorMut, Fp8TensorRef, F8E4M3,
    F8E5M2,
};
use flashattn::{reference, AttnOptions, KvCacheOptions, TensorRef};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

fn read_out(path: &Path, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    (t.dtype(), t.shape().to_vec(), t.data().to_vec())
}

fn e4m3(rng: &mut ChaCha8Rng, n: usize) -> Vec<F8E4M3> {
    (0..n)
        .map(|_| F8E4M3::from_f32(rng.gen_range(-448.0f32..448.0)))
        .collect()
}

fn fp8_bytes(v: &[F8E4M3]) -> Vec<u8> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bf16_values(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(2)
        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
        .collect()
}

/// q [2, 9, 4, 24], k/v [2, 13, 2, 24], per-(batch, kv head) descale factors, causal: the CLI's
/// out and lse equal the library's, and out is within bf16 rounding of the f64 reference.
#[test]
fn batched_fp8_matches_library_and_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (b, sq, sk, h, hk, d) = (2, 9, 13, 4, 2, 24);
    let q = e4m3(&mut rng, b * sq * h * d);
    let k = e4m3(&mut rng, b * sk * hk * d);
    let v = e4m3(&mut rng, b * sk * hk * d);
    let dq: Vec<f32> = (0..b * hk)
        .map(|_| rng.gen_range(1.0f32..3.0) / 448.0)
        .collect();
    let dk: Vec<f32> = (0..b * hk)
        .map(|_| rng.gen_range(1.0f32..3.0) / 448.0)
        .collect();
    let dv: Vec<f32> = vec![0.7 / 448.0];
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    write_st(
        &input,
        &[
            raw("q", "F8_E4M3", &[b, sq, h, d], fp8_bytes(&q)),
            raw("k", "F8_E4M3", &[b, sk, hk, d], fp8_bytes(&k)),
            raw("v", "F8_E4M3", &[b, sk, hk, d], fp8_bytes(&v)),
            f32_raw("q_descale", &[b, hk], &dq),
            f32_raw("k_descale", &[b, hk], &dk),
            f32_raw("v_descale", &[1], &dv),
        ],
    );
    let res = flashattn(&[
        "run",
        input.to_str().unwrap(),
        output.to_str().unwrap(),
        "--causal",
    ]);
    assert_ok(&res);
    let opts = AttnOptions::default().causal(true);
    let (qv, kv, vv) = (
        Fp8TensorRef::contiguous(&q, &[b, sq, h, d]),
        Fp8TensorRef::contiguous(&k, &[b, sk, hk, d]),
        Fp8TensorRef::contiguous(&v, &[b, sk, hk, d]),
    );
    let lib = flash_attn_fp8(
        &qv,
        &kv,
        &vv,
        &opts
            .clone()
            .descale(Descale::default().q(&dq).k(&dk).v(&dv)),
    )
    .unwrap();
    let (dtype, shape, out) = read_out(&output, "out");
    assert_eq!((dtype, shape.as_slice()), (Dtype::BF16, &[b, sq, h, d][..]));
    let lib_out: Vec<u8> = lib
        .out
        .as_slice::<half::bf16>()
        .unwrap()
        .iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .collect();
    assert_eq!(out, lib_out, "out differs from the library's");
    let (dtype, _, lse) = read_out(&output, "lse");
    assert_eq!(dtype, Dtype::F32);
    let lib_lse: Vec<u8> = lib
        .lse
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(lse, lib_lse, "lse differs from the library's");
    // Against the f64 reference on the dequantised inputs.
    let deq = |x: &[F8E4M3], s: &[f32], nh: usize| -> Vec<f32> {
        x.iter()
            .enumerate()
            .map(|(i, v)| {
                let (tok, head) = (i / (nh * d), i / d % nh);
                let seq = tok / (x.len() / (b * nh * d));
                let f = if s.len() == 1 {
                    s[0]
                } else {
                    s[seq * hk + head * hk / nh]
                };
                v.to_f32() * f
            })
            .collect()
    };
    let (qf, kf, vf) = (deq(&q, &dq, h), deq(&k, &dk, hk), deq(&v, &dv, hk));
    let r = reference::attention(
        &TensorRef::contiguous(&qf, &[b, sq, h, d]),
        &TensorRef::contiguous(&kf, &[b, sk, hk, d]),
        &TensorRef::contiguous(&vf, &[b, sk, hk, d]),
        &opts,
    )
    .unwrap();
    // A sanity bound (the library's tests hold the exact one): a few bf16 units of the largest
    // output.
    let (got, scale) = (
        bf16_values(&out),
        r.out.iter().fold(0f64, |m, x| m.max(x.abs())),
    );
    for (i, (g, w)) in got.iter().zip(&r.out).enumerate() {
        assert!(
            (g - w).abs() <= 4.0 * 2f64.powi(-8) * scale,
            "out[{i}]: {g} vs {w}"
        );
    }
    // The same file on the GPU: out within bf16 rounding of the CPU's (the library's GPU tests
    // hold the exact bound).
    if let Some(gpu_output) = run_on_gpu(&input, dir.path(), "FP8 inputs") {
        let gpu = bf16_values(&read_out(&gpu_output, "out").2);
        assert_eq!(gpu.len(), got.len());
        for (x, y) in got.iter().zip(&gpu) {
            assert!(
                (x - y).abs() <= 2.0 * 2f64.powi(-8) * scale,
                "out: cpu {x} gpu {y}"
            );
        }
    }
}

/// `run INPUT DIR/gpu.st --causal --device cuda`: the output's path when it succeeded; without a
/// GPU, asserts a clean failure that wrote nothing, and gives `None`.
fn run_on_gpu(input: &Path, dir: &Path, what: &str) -> Option<std::path::PathBuf> {
    let gpu_output = dir.join("gpu.st");
    let o = flashattn(&[
        "run",
        input.to_str().unwrap(),
        gpu_output.to_str().unwrap(),
        "--causal",
        "--device",
        "cuda",
    ]);
    if o.status.success() {
        return Some(gpu_output);
    }
    assert_clean_cuda_failure(&o, &format!("run --device cuda on {what}"));
    assert!(!gpu_output.exists(), "a failed run wrote its output");
    None
}

#[test]
fn packed_e5m2_matches_library() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (h, d, tq, tk) = (2, 16, 11, 17);
    let mut draw = |n: usize| -> Vec<F8E5M2> {
        (0..n)
            .map(|_| F8E5M2::from_f32(rng.gen_range(-4.0f32..4.0)))
            .collect()
    };
    let (q, k, v) = (draw(tq * h * d), draw(tk * h * d), draw(tk * h * d));
    let (cq, ck) = ([0i32, 4, 11], [0i32, 10, 17]);
    let bytes = |x: &[F8E5M2]| -> Vec<u8> { x.iter().map(|v| v.to_bits()).collect() };
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    write_st(
        &input,
        &[
            raw("q", "F8_E5M2", &[tq, h, d], bytes(&q)),
            raw("k", "F8_E5M2", &[tk, h, d], bytes(&k)),
            raw("v", "F8_E5M2", &[tk, h, d], bytes(&v)),
            i32_raw("cu_seqlens_q", &[3], &cq),
            i32_raw("cu_seqlens_k", &[3], &ck),
            f32_raw("k_descale", &[], &[0.25]),
        ],
    );
    assert_ok(&flashattn(&[
        "run",
        input.to_str().unwrap(),
        output.to_str().unwrap(),
        "--window-left",
        "3",
        "--threads",
        "1",
    ]));
    let lib = flash_attn_fp8(
        &Fp8TensorRef::contiguous(&q, &[tq, h, d]),
        &Fp8TensorRef::contiguous(&k, &[tk, h, d]),
        &Fp8TensorRef::contiguous(&v, &[tk, h, d]),
        &AttnOptions::default()
            .window(3, -1)
            .varlen(&cq, &ck)
            .descale(Descale::default().k(&[0.25])),
    )
    .unwrap();
    let (_, shape, out) = read_out(&output, "out");
    assert_eq!(shape, [tq, h, d]);
    let want: Vec<f64> = lib.out.to_f64_vec();
    assert_eq!(bf16_values(&out), want);
}

fn fp8_tensors() -> Vec<Raw> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    vec![
        raw(
            "q",
            "F8_E4M3",
            &[1, 4, 2, 8],
            fp8_bytes(&e4m3(&mut rng, 64)),
        ),
        raw(
            "k",
            "F8_E4M3",
            &[1, 6, 2, 8],
            fp8_bytes(&e4m3(&mut rng, 96)),
        ),
        raw(
            "v",
            "F8_E4M3",
            &[1, 6, 2, 8],
            fp8_bytes(&e4m3(&mut rng, 96)),
        ),
    ]
}

/// Each bad FP8 file fails with a one-line error naming the problem (see `expect_clean_failure`).
#[test]
fn bad_fp8_files_are_named() {
    let cases: Vec<(Vec<Raw>, Vec<&str>, Vec<&str>)> = vec![
        (
            replace(
                fp8_tensors(),
                raw("dout", "F8_E4M3", &[1, 4, 2, 8], vec![0; 64]),
            ),
            vec![],
            vec!["`dout`", "forward pass only"],
        ),
        (
            replace(fp8_tensors(), f32_raw("k", &[1, 6, 2, 8], &[0.5; 96])),
            vec![],
            vec!["`k`", "F32", "F8_E4M3"],
        ),
        (
            replace(
                fp8_tensors(),
                raw("v", "F8_E5M2", &[1, 6, 2, 8], vec![0x3c; 96]),
            ),
            vec![],
            vec!["`v`", "e5m2", "e4m3"],
        ),
        (
            replace(fp8_tensors(), f32_raw("k_descale", &[3], &[1.0; 3])),
            vec![],
            vec!["`k_descale`", "3 values"],
        ),
        (
            replace(fp8_tensors(), f32_raw("v_descale", &[1], &[-2.0])),
            vec![],
            vec!["`v_descale`", "-2", "> 0"],
        ),
        (
            replace(fp8_tensors(), raw("q_descale", "F16", &[1], vec![0, 0x3c])),
            vec![],
            vec!["`q_descale`", "F16", "F32"],
        ),
        (
            replace(fp8_tensors(), i32_raw("cu_seqlens_q", &[2], &[0, 4])),
            vec![],
            vec!["cu_seqlens_q", "cu_seqlens_k"],
        ),
    ];
    for (tensors, flags, needles) in cases {
        expect_clean_failure(&tensors, &flags, &needles);
    }
}

/// A non-zero exit with one `error:` line holding every needle, and no OUT written.
fn expect_clean_failure(tensors: &[Raw], flags: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    write_st(&input, tensors);
    std::fs::write(&output, b"previous").unwrap();
    let mut args = vec!["run", input.to_str().unwrap(), output.to_str().unwrap()];
    args.extend_from_slice(flags);
    let res = flashattn(&args);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{needles:?}: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr should mention {n:?}: {stderr}");
    }
    assert_eq!(std::fs::read(&output).unwrap(), b"previous", "OUT changed");
}

/// `bench --dtype e4m3|e5m2`: the FP8 forward next to naive bf16 attention on the dequantised
/// inputs, with its error against the f64 reference; FP8 refuses the modes it does not have.
#[test]
fn bench_fp8_reports_and_refuses_other_modes() {
    for format in ["e4m3", "e5m2"] {
        let res = flashattn(&[
            "bench",
            "--json",
            "--dtype",
            format,
            "--seqlen",
            "48",
            "--heads",
            "2",
            "--min-time",
            "0",
            "--no-peak",
        ]);
        assert_ok(&res);
        let stdout = String::from_utf8(res.stdout).unwrap();
        let lines: Vec<serde_json::Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let flash = lines
            .iter()
            .find(|l| l["impl"] == "flashattn")
            .expect("a flashattn line");
        assert_eq!(flash["dtype"], format, "{flash}");
        let err = flash["max_abs_err"].as_f64().unwrap();
        // Outputs lie within (-1.75, 1.75): a few bf16 units.
        assert!(err > 0.0 && err < 2e-2, "{flash}");
        // Naive runs in bf16 on the dequantised inputs, and says so.
        assert!(lines
            .iter()
            .any(|l| l["impl"] == "naive" && l["dtype"] == "bf16"));
    }
    for flags in [&["--backward"][..], &["--backward", "--device", "cuda"][..]] {
        let mut args = vec!["bench", "--dtype", "e4m3", "--seqlen", "16", "--no-peak"];
        args.extend_from_slice(flags);
        let res = flashattn(&args);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains("no --backward"), "{stderr}");
    }
}

/// `bench --dtype e4m3 --fp8-per-block`: per-block descale tables (every block the tensor's
/// factor), said in the header, with the same bf16-sized error; refused without an FP8 dtype and
/// with --decode.
#[test]
fn bench_fp8_per_block_factors() {
    let res = flashattn(&[
        "bench",
        "--dtype",
        "e4m3",
        "--fp8-per-block",
        "--seqlen",
        "200",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--causal",
        "--min-time",
        "0",
        "--no-peak",
        "--no-naive",
    ]);
    assert_ok(&res);
    let stdout = String::from_utf8(res.stdout).unwrap();
    assert!(stdout.contains("e4m3 (per-block factors)"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("flashattn ") && !l.starts_with("flashattn bench:"))
        .expect("a flashattn row");
    let err: f64 = row.split_whitespace().nth(7).unwrap().parse().unwrap();
    assert!(err > 0.0 && err < 2e-2, "{row}");
    for flags in [
        &["--dtype", "bf16"][..],
        &["--dtype", "e4m3", "--decode"][..],
        &[][..],
    ] {
        let mut args = vec!["bench", "--fp8-per-block", "--seqlen", "16", "--no-peak"];
        args.extend_from_slice(flags);
        let res = flashattn(&args);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains("--fp8-per-block"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// `bench --device cuda --dtype e4m3|e5m2` (the FP8 forward on the GPU): with a GPU, one
/// measurement per length with the format's name and a bf16-sized error; without one, a clean
/// failure.
#[test]
fn bench_fp8_forward_on_cuda_or_fails_cleanly() {
    for format in ["e4m3", "e5m2"] {
        let o = flashattn(&[
            "bench",
            "--device",
            "cuda",
            "--dtype",
            format,
            "--json",
            "--seqlen",
            "200",
            "--heads",
            "4",
            "--head-dim",
            "64",
            "--causal",
            "--min-time",
            "0",
        ]);
        if !o.status.success() {
            assert_clean_cuda_failure(&o, "bench --device cuda --dtype");
            continue;
        }
        let stdout = String::from_utf8(o.stdout).unwrap();
        let rows: Vec<serde_json::Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|l: &serde_json::Value| l["kind"] == "measurement")
            .collect();
        assert_eq!(rows.len(), 1, "{stdout}");
        let row = &rows[0];
        assert_eq!(row["dtype"], format, "{row}");
        assert!(row["kernel"].as_str().unwrap().ends_with("_fp8"), "{row}");
        // Outputs lie within (-1.75, 1.75): a few bf16 units.
        let err = row["max_abs_err"].as_f64().unwrap();
        assert!(err > 0.0 && err < 2e-2, "{row}");
    }
}

/// Without a GPU, one `error:` line naming CUDA (or NVRTC), nothing else on stderr, no panic.
fn assert_clean_cuda_failure(o: &std::process::Output, what: &str) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!stderr.contains("panicked"), "{what}: panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{what}: expected one line, got {stderr:?}");
    assert!(
        lines[0].starts_with("error: ")
            && (lines[0].contains("CUDA") || lines[0].contains("NVRTC")),
        "{what}: {stderr}"
    );
}

/// `bench --decode --device cuda --dtype e4m3|e5m2`: with a GPU, one measurement per cache length
/// with the format's name and a bf16-sized error; without one, a clean failure.
#[test]
fn bench_decode_fp8_caches_on_cuda_or_fails_cleanly() {
    for format in ["e4m3", "e5m2"] {
        let o = flashattn(&[
            "bench",
            "--decode",
            "--device",
            "cuda",
            "--dtype",
            format,
            "--cache-len",
            "1000",
            "--heads",
            "8",
            "--heads-kv",
            "2",
            "--min-time",
            "0",
            "--json",
        ]);
        if !o.status.success() {
            assert_clean_cuda_failure(&o, "bench --decode --device cuda --dtype");
            continue;
        }
        let stdout = String::from_utf8_lossy(&o.stdout);
        let rows: Vec<serde_json::Value> = stdout
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|r: &serde_json::Value| r["kind"] == "measurement")
            .collect();
        assert_eq!(rows.len(), 1, "{stdout}");
        assert_eq!(rows[0]["dtype"], format, "{stdout}");
        let err = rows[0]["max_abs_err"].as_f64().unwrap();
        assert!(err.is_finite() && err < 2e-2, "{stdout}");
        assert!(
            rows[0]["kernel"].as_str().unwrap().contains("_fp8"),
            "{stdout}"
        );
    }
}

/// `run` on a KV-cache file with FP8 caches: the new bf16 keys/values are appended quantised,
/// out/lse and the caches written back equal the library's call bit for bit.
#[test]
fn run_fp8_kv_cache_matches_library() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (b, cap, h, hk, d, sq) = (2, 40, 8, 2, 32, 1);
    let (kc, vc) = (
        e4m3(&mut rng, b * cap * hk * d),
        e4m3(&mut rng, b * cap * hk * d),
    );
    let mut bf = |n: usize| -> Vec<half::bf16> {
        (0..n)
            .map(|_| half::bf16::from_f32(rng.gen_range(-1.0f32..1.0)))
            .collect()
    };
    let (q, kn, vn) = (bf(b * sq * h * d), bf(b * sq * hk * d), bf(b * sq * hk * d));
    let lens = [17i32, 39];
    let (dk, dv) = ([0.004f32, 0.003, 0.005, 0.002], [0.0031f32]);
    let bf_bytes = |x: &[half::bf16]| -> Vec<u8> {
        x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    let (cs, ns) = ([b, cap, hk, d], [b, sq, hk, d]);
    write_st(
        &input,
        &[
            raw("q", "BF16", &[b, sq, h, d], bf_bytes(&q)),
            raw("k_cache", "F8_E4M3", &cs, fp8_bytes(&kc)),
            raw("v_cache", "F8_E4M3", &cs, fp8_bytes(&vc)),
            raw("k_new", "BF16", &ns, bf_bytes(&kn)),
            raw("v_new", "BF16", &ns, bf_bytes(&vn)),
            i32_raw("cache_seqlens", &[b], &lens),
            f32_raw("k_descale", &[b, hk], &dk),
            f32_raw("v_descale", &[1], &dv),
        ],
    );
    assert_ok(&flashattn(&[
        "run",
        input.to_str().unwrap(),
        output.to_str().unwrap(),
        "--causal",
    ]));
    let (mut k_lib, mut v_lib) = (kc.clone(), vc.clone());
    let opts = KvCacheOptions::default()
        .attn(AttnOptions::default().causal(true))
        .new_kv(
            TensorRef::contiguous(&kn, &ns),
            TensorRef::contiguous(&vn, &ns),
        );
    let lib = flash_attn_with_kvcache_fp8(
        &TensorRef::contiguous(&q, &[b, sq, h, d]),
        &mut Fp8TensorMut::contiguous(&mut k_lib, &cs),
        &mut Fp8TensorMut::contiguous(&mut v_lib, &cs),
        &lens,
        &opts.clone().descale(Descale::default().k(&dk).v(&dv)),
    )
    .unwrap();
    let (dtype, shape, out) = read_out(&output, "out");
    assert_eq!((dtype, shape.as_slice()), (Dtype::BF16, &[b, sq, h, d][..]));
    assert_eq!(out, bf_bytes(lib.out.as_slice::<half::bf16>().unwrap()));
    let (_, _, lse) = read_out(&output, "lse");
    let lib_lse: Vec<u8> = (lib.lse.as_slice::<f32>().unwrap().iter())
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(lse, lib_lse);
    for (name, want, before) in [("k_cache", &k_lib, &kc), ("v_cache", &v_lib, &vc)] {
        let (dtype, shape, bytes) = read_out(&output, name);
        assert_eq!((dtype, shape.as_slice()), (Dtype::F8_E4M3, &cs[..]));
        assert_eq!(bytes, fp8_bytes(want), "{name} written back");
        assert_ne!(bytes, fp8_bytes(before), "{name}: the append is missing");
    }
    // The same file on the GPU: the appended bytes equal the CPU's (no rotary: both divide the
    // same bf16 value by the same factor in f64 and round once), out within bf16 rounding; without
    // a GPU, a clean failure and no output file.
    if let Some(gpu_output) = run_on_gpu(&input, dir.path(), "FP8 caches") {
        for (name, want) in [("k_cache", &k_lib), ("v_cache", &v_lib)] {
            assert_eq!(
                read_out(&gpu_output, name).2,
                fp8_bytes(want),
                "{name} on the GPU"
            );
        }
        let (cpu, gpu) = (
            bf16_values(&out),
            bf16_values(&read_out(&gpu_output, "out").2),
        );
        for (x, y) in cpu.iter().zip(&gpu) {
            assert!(
                (x - y).abs() <= 2.0 * 2f64.powi(-8) * (1.0 + x.abs()),
                "out: cpu {x} gpu {y}"
            );
        }
    }
    // Descale tensors with caches that are not FP8, and caches of two FP8 formats, fail by name.
    let f32_cache: Vec<f32> = vec![0.5; b * cap * hk * d];
    let base = vec![
        raw(
            "q",
            "F32",
            &[b, sq, h, d],
            f32_bytes(&vec![0.1; b * sq * h * d]),
        ),
        f32_raw("k_cache", &cs, &f32_cache),
        f32_raw("v_cache", &cs, &f32_cache),
        i32_raw("cache_seqlens", &[b], &lens),
    ];
    let mut with_descale = base.clone();
    with_descale.push(f32_raw("k_descale", &[1], &[0.5]));
    expect_clean_failure(&with_descale, &[], &["k_descale", "FP8 caches only"]);
    let mut mixed = base;
    mixed[1] = raw("k_cache", "F8_E4M3", &cs, fp8_bytes(&kc));
    expect_clean_failure(&mixed, &[], &["v_cache", "F8_E4M3 or F8_E5M2"]);
    let e5 = vec![0x3cu8; b * cap * hk * d];
    mixed[2] = raw("v_cache", "F8_E5M2", &cs, e5);
    expect_clean_failure(&mixed, &[], &["v_cache", "e5m2", "e4m3"]);
}

/// `bench --decode --dtype e4m3|e5m2`: FP8 caches counted at one byte per value, error small.
#[test]
fn bench_decode_fp8_caches() {
    for format in ["e4m3", "e5m2"] {
        let res = flashattn(&[
            "bench",
            "--decode",
            "--json",
            "--no-bandwidth",
            "--dtype",
            format,
            "--cache-len",
            "200",
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--head-dim",
            "32",
            "--min-time",
            "0.01",
        ]);
        assert_ok(&res);
        let stdout = String::from_utf8(res.stdout).unwrap();
        let m: serde_json::Value = serde_json::from_str(stdout.lines().nth(1).unwrap()).unwrap();
        assert_eq!(m["dtype"], format, "{m}");
        assert_eq!(m["kv_bytes"].as_f64().unwrap(), (200 * 2 * 32 * 2) as f64);
        let err = m["max_abs_err"].as_f64().unwrap();
        assert!(err > 0.0 && err < 2e-2, "{m}");
    }
}

//! `--device cuda` end to end. With a GPU: `run` on the GPU (forward and backward) agrees with
//! `run` on the CPU, and `bench` (forward, and forward + backward) reports finite times and small
//! errors. Without one (CI): both exit non-zero with one
//! `error:` line naming what is missing, never a panic, and `run` leaves no output file.

use safetensors::tensor::{Dtype, TensorView};
use std::process::{Command, Output};

/// The binary under test: cargo's build, or `FLASHATTN_BIN` (bench/gpu/run.sh points it at the
/// binary carried to a GPU machine, where cargo's build path does not exist).
fn bin() -> String {
    std::env::var("FLASHATTN_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_flashattn").into())
}

fn flashattn(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("run flashattn")
}

/// A clean failure: exit code non-zero, one line on stderr starting `error:`, about CUDA.
fn assert_clean_failure(o: &Output, what: &str) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{what}: should have failed");
    assert!(!stderr.contains("panicked"), "{what}: panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{what}: expected one line, got {stderr:?}");
    assert!(lines[0].starts_with("error: "), "{what}: {stderr}");
    assert!(
        lines[0].contains("CUDA") || lines[0].contains("NVRTC"),
        "{what}: the error should name CUDA or NVRTC: {stderr}"
    );
}

fn f32_tensor(name: &str, shape: &[usize], seed: u32) -> (String, Vec<u8>, Vec<usize>) {
    let n: usize = shape.iter().product();
    let bytes = (0..n)
        .flat_map(|i| {
            (((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
                .to_le_bytes()
        })
        .collect();
    (name.to_string(), bytes, shape.to_vec())
}

#[test]
fn run_on_cuda_matches_cpu_or_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    let tensors = [
        f32_tensor("q", &[2, 37, 4, 40], 1),
        f32_tensor("k", &[2, 53, 2, 40], 2),
        f32_tensor("v", &[2, 53, 2, 40], 3),
        f32_tensor("dout", &[2, 37, 4, 40], 4),
    ];
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, b, s)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &input).unwrap();
    let (gpu, cpu) = (dir.path().join("gpu.st"), dir.path().join("cpu.st"));
    let args = |out: &std::path::Path, device: &'static str| {
        vec![
            "run".to_string(),
            input.display().to_string(),
            out.display().to_string(),
            "--causal".into(),
            "--device".into(),
            device.into(),
        ]
    };
    let to_str = |v: &[String]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let o = Command::new(bin())
        .args(to_str(&args(&gpu, "cuda")))
        .output()
        .unwrap();
    if !o.status.success() {
        assert_clean_failure(&o, "run --device cuda");
        assert!(!gpu.exists(), "a failed run wrote its output");
        eprintln!("no GPU: {}", String::from_utf8_lossy(&o.stderr).trim());
        return;
    }
    let o = Command::new(bin())
        .args(to_str(&args(&cpu, "cpu")))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (gb, cb) = (std::fs::read(&gpu).unwrap(), std::fs::read(&cpu).unwrap());
    let (g, c) = (
        safetensors::SafeTensors::deserialize(&gb).unwrap(),
        safetensors::SafeTensors::deserialize(&cb).unwrap(),
    );
    for name in ["out", "lse", "dq", "dk", "dv"] {
        // The gradients sum longer chains in another order than the CPU's.
        let tol = if name.starts_with('d') { 1e-4 } else { 1e-5 };
        let floats = |st: &safetensors::SafeTensors| -> Vec<f32> {
            st.tensor(name)
                .unwrap()
                .data()
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let (a, b) = (floats(&g), floats(&c));
        assert_eq!(a.len(), b.len(), "{name}");
        for (x, y) in a.iter().zip(&b) {
            assert!(
                x == y || (x - y).abs() <= tol * (1.0 + y.abs()),
                "{name}: gpu {x} vs cpu {y}"
            );
        }
    }
}

/// stdout of a `--json` run, and its measurement lines.
fn measurements(o: &Output) -> (String, Vec<serde_json::Value>) {
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let rows = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "measurement")
        .collect();
    (stdout, rows)
}

#[test]
fn bench_on_cuda_reports_or_fails_cleanly() {
    let args = [
        "bench",
        "--device",
        "cuda",
        "--seqlen",
        "256,1000",
        "--heads",
        "4",
        "--dtype",
        "bf16",
        "--causal",
        "--min-time",
        "0",
        "--json",
    ];
    let o = flashattn(&args);
    if !o.status.success() {
        assert_clean_failure(&o, "bench --device cuda");
        return;
    }
    let (stdout, rows) = measurements(&o);
    assert_eq!(rows.len(), 2, "{stdout}");
    let mut args = args.to_vec();
    args.push("--backward");
    let o = flashattn(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (stdout_bwd, rows_bwd) = measurements(&o);
    assert_eq!(rows_bwd.len(), 2, "{stdout_bwd}");
    for r in rows.into_iter().chain(rows_bwd) {
        let (ms, err) = (r["median_ms"].as_f64().unwrap(), r["max_abs_err"].as_f64());
        assert!(ms > 0.0 && ms.is_finite(), "{r}");
        assert!(
            err.is_some_and(|e| e < 2e-2),
            "bf16 error too large or NaN: {r}"
        );
    }
}

#[test]
fn bench_decode_on_cuda_reports_or_fails_cleanly() {
    let o = flashattn(&[
        "bench",
        "--decode",
        "--device",
        "cuda",
        "--cache-len",
        "1000,4096",
        "--heads",
        "8",
        "--heads-kv",
        "2",
        "--min-time",
        "0",
        "--json",
    ]);
    if !o.status.success() {
        assert_clean_failure(&o, "bench --decode --device cuda");
        return;
    }
    let (stdout, rows) = measurements(&o);
    // f32 and bf16 at two cache lengths.
    assert_eq!(rows.len(), 4, "{stdout}");
    for r in rows {
        let (ms, err) = (r["median_ms"].as_f64().unwrap(), r["max_abs_err"].as_f64());
        assert!(ms > 0.0 && ms.is_finite(), "{r}");
        let bound = if r["dtype"] == "f32" { 1e-5 } else { 2e-2 };
        assert!(
            err.is_some_and(|e| e < bound),
            "error too large or NaN: {r}"
        );
    }
}

/// `flashattn compile` fills a kernel cache directory with one cubin per variant, and a second run
/// finds them all there. Needs NVRTC only (CI has it and sets FLASHATTN_REQUIRE_NVRTC=1); without
/// NVRTC it fails cleanly, naming it.
#[test]
fn compile_fills_the_disk_cache_or_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let run = || {
        Command::new(bin())
            .args(["compile", "--arch", "sm_80", "--filter", "decode_combine"])
            .env("FLASHATTN_CACHE_DIR", dir.path())
            .output()
            .expect("run flashattn")
    };
    let first = run();
    if !first.status.success() {
        let required = std::env::var("FLASHATTN_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        let stderr = String::from_utf8_lossy(&first.stderr);
        assert!(!required, "FLASHATTN_REQUIRE_NVRTC=1 but: {stderr}");
        assert!(!stderr.contains("panicked"), "panicked: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains("NVRTC"),
            "{stderr}"
        );
        return;
    }
    // One decode_combine variant per dtype.
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert!(
        stdout.contains("3 variants for sm_80: 3 compiled, 0 already cached, 0 failed"),
        "{stdout}"
    );
    let cubins = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            let name = name.to_string_lossy();
            name.starts_with("decode_combine_") && name.ends_with(".cubin")
        })
        .count();
    assert_eq!(cubins, 3, "{stdout}");
    let second = run();
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    assert!(stdout.contains("0 compiled, 3 already cached"), "{stdout}");
}

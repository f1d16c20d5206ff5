//! `bench` (JSON lines and the table), `peak` and `plot`.

use crate::common::*;

fn bench_json(extra: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec![
        "bench",
        "--json",
        "--seqlen",
        "64,128",
        "--heads",
        "2",
        "--min-time",
        "0.02",
    ];
    args.extend_from_slice(extra);
    let lines = bench_json_all(&args);
    assert_eq!(lines[0]["kind"], "machine", "{}", lines[0]);
    // The measurements, without the leading "machine" line.
    lines[1..].to_vec()
}

/// Every JSON line of a `bench --json` run, the "machine" line first.
fn bench_json_all(args: &[&str]) -> Vec<serde_json::Value> {
    let res = flashattn(args);
    assert_ok(&res);
    let stdout = String::from_utf8(res.stdout).unwrap();
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

#[test]
fn bench_json_lines_have_the_fields() {
    let lines = bench_json(&["--threads", "2"]);
    assert_eq!(lines.len(), 4, "flashattn and naive at two lengths");
    for l in &lines {
        for field in [
            "impl",
            "dtype",
            "batch",
            "heads",
            "heads_kv",
            "seqlen_q",
            "seqlen_k",
            "head_dim",
            "causal",
            "pass",
            "median_ms",
            "gflops",
            "peak_extra_bytes",
            "max_abs_err",
            "threads",
            "reps",
        ] {
            assert!(l.get(field).is_some(), "missing {field} in {l}");
        }
        assert!(["flashattn", "naive"].contains(&l["impl"].as_str().unwrap()));
        assert_eq!(l["pass"], "fwd");
        assert_eq!(l["dtype"], "f32");
        assert_eq!(l["heads"], 2);
        assert_eq!(l["threads"], 2);
        assert_eq!(l["skipped"], false);
        assert!(l["median_ms"].as_f64().unwrap() > 0.0);
        assert!(l["gflops"].as_f64().unwrap() > 0.0);
        assert!(l["reps"].as_u64().unwrap() >= 3);
        assert!(l["max_abs_err"].as_f64().unwrap() < 1e-4, "{l}");
    }
    let seqlens: Vec<u64> = lines
        .iter()
        .map(|l| l["seqlen_q"].as_u64().unwrap())
        .collect();
    assert_eq!(seqlens, vec![64, 64, 128, 128]);
    // Naive holds S and P (2 · heads · N² f32) at its peak; flashattn far less at 128.
    let naive_128 = lines
        .iter()
        .find(|l| l["impl"] == "naive" && l["seqlen_q"] == 128)
        .unwrap();
    assert!(naive_128["peak_extra_bytes"].as_u64().unwrap() >= 8 * 2 * 128 * 128);
}

#[test]
fn bench_skips_naive_over_the_memory_limit() {
    let lines = bench_json(&["--naive-max-gib", "0.0001", "--dtype", "bf16", "--causal"]);
    assert_eq!(lines.len(), 4);
    // At 128, naive needs 2 · 2 heads · 128² f32 = 256 KiB > 0.0001 GiB; at 64, 64 KiB, so it runs.
    let naive: Vec<_> = lines.iter().filter(|l| l["impl"] == "naive").collect();
    assert_eq!(naive.len(), 2);
    assert_eq!(
        (naive[0]["seqlen_q"].as_u64(), naive[0]["skipped"].as_bool()),
        (Some(64), Some(false))
    );
    assert_eq!(
        (naive[1]["seqlen_q"].as_u64(), naive[1]["skipped"].as_bool()),
        (Some(128), Some(true))
    );
    assert!(
        naive[1]["reason"].as_str().unwrap().contains("GiB"),
        "{}",
        naive[1]
    );
    let flash = lines
        .iter()
        .find(|l| l["impl"] == "flashattn" && l["seqlen_q"] == 128)
        .unwrap();
    assert_eq!(flash["dtype"], "bf16");
    assert_eq!(flash["causal"], true);
}

#[test]
fn bench_table_and_bad_options() {
    let res = flashattn(&[
        "bench",
        "--seqlen",
        "32",
        "--heads",
        "1",
        "--min-time",
        "0",
        "--no-naive",
    ]);
    assert!(res.status.success());
    let stdout = String::from_utf8(res.stdout).unwrap();
    assert!(
        stdout.contains("median ms") && stdout.contains("flashattn"),
        "{stdout}"
    );
    assert!(!stdout.contains("naive "), "{stdout}");
    let res = flashattn(&["bench", "--heads", "3", "--heads-kv", "2"]);
    assert_eq!(res.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&res.stderr).contains("--heads-kv"));
}

/// The machine line (ISA, threads, measured peaks) and the "% of peak" column / `peak_fraction`.
#[test]
fn bench_reports_the_peak_and_the_fraction_of_it() {
    let res = flashattn(&[
        "bench",
        "--seqlen",
        "32",
        "--heads",
        "1",
        "--min-time",
        "0",
        "--threads",
        "1",
    ]);
    assert_ok(&res);
    let stdout = String::from_utf8(res.stdout).unwrap();
    let first = stdout.lines().next().unwrap();
    let isa = flashattn::simd::active().unwrap().to_string();
    assert!(first.starts_with("machine: ISA "), "{stdout}");
    assert!(
        first.contains(&isa) && first.contains("1 threads"),
        "{first}"
    );
    assert!(first.contains("measured peak f32"), "{first}");
    assert!(stdout.contains("% of peak"), "{stdout}");
    // Every measured row has a percentage (or n/a where this CPU has no FMA to measure).
    let row = stdout
        .lines()
        .find(|l| l.starts_with("flashattn ") && !l.starts_with("flashattn bench"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(row.contains('%') || row.contains("n/a"), "{row}");

    let lines = bench_json_all(&[
        "bench",
        "--json",
        "--seqlen",
        "32",
        "--heads",
        "1",
        "--min-time",
        "0",
        "--dtype",
        "bf16",
    ]);
    let m = &lines[0];
    assert_eq!(m["kind"], "machine");
    assert_eq!(m["isa"], isa.as_str());
    assert!(m["threads"].as_u64().unwrap() >= 1);
    for l in &lines[1..] {
        assert_eq!(l["kind"], "measurement");
    }
    let flash = lines.iter().find(|l| l["impl"] == "flashattn").unwrap();
    #[cfg(target_arch = "x86_64")]
    let has_fma = std::arch::is_x86_feature_detected!("avx512f")
        || (std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma"));
    #[cfg(not(target_arch = "x86_64"))]
    let has_fma = false;
    if has_fma {
        let p32 = m["peak_f32_gflops"].as_f64().unwrap();
        assert!(p32 > 0.0, "{m}");
        // bf16 divides by the bf16 dot-product peak when the kernels use vdpbf16ps.
        let used = if isa.ends_with("+bf16") {
            "bf16"
        } else {
            "f32"
        };
        assert_eq!(m["peak_used"], used, "{m}");
        let peak = m[format!("peak_{used}_gflops").as_str()].as_f64().unwrap();
        let frac = flash["peak_fraction"].as_f64().unwrap();
        let want = flash["gflops"].as_f64().unwrap() / peak;
        assert!((frac - want).abs() <= 1e-9 * want.max(1.0), "{flash} {m}");
    }
}

#[test]
fn bench_no_peak_skips_the_measurement() {
    let lines = bench_json_all(&[
        "bench",
        "--json",
        "--no-peak",
        "--no-naive",
        "--seqlen",
        "32",
        "--heads",
        "1",
        "--min-time",
        "0",
    ]);
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["kind"], "machine");
    assert!(lines[0]["isa"].as_str().is_some());
    assert!(lines[0]["peak_f32_gflops"].is_null(), "{}", lines[0]);
    assert!(lines[1]["peak_fraction"].is_null(), "{}", lines[1]);
    assert!(lines[1]["gflops"].as_f64().unwrap() > 0.0);

    let res = flashattn(&[
        "bench",
        "--no-peak",
        "--no-naive",
        "--seqlen",
        "32",
        "--heads",
        "1",
        "--min-time",
        "0",
    ]);
    assert!(res.status.success());
    let stdout = String::from_utf8(res.stdout).unwrap();
    assert!(stdout.contains("peak not measured (--no-peak)"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("flashattn ") && !l.starts_with("flashattn bench"))
        .unwrap();
    assert!(row.contains("n/a") && !row.contains('%'), "{row}");
}

#[test]
fn peak_prints_positive_rates() {
    let res = flashattn(&["peak", "--json", "--threads", "1", "--secs", "0.02"]);
    assert_ok(&res);
    let v: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(v["kind"], "peak");
    assert_eq!(v["threads"], 1);
    for k in ["peak_f32_gflops", "peak_bf16_gflops"] {
        if let Some(g) = v[k].as_f64() {
            assert!(g > 0.0 && g.is_finite(), "{v}");
        }
    }
    let res = flashattn(&["peak", "--secs", "0"]);
    assert_eq!(res.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&res.stderr).contains("--secs"));
}

/// A results file in `bench/compare_torch.py`'s format, written by hand.
const COMPARE_JSON: &str = r#"{
  "format": "flashattn-compare/1",
  "machine": {"threads": 2, "isa": "avx512+bf16", "peak_f32_gflops": 230.0, "peak_bf16_gflops": 460.0},
  "results": [
    {"impl": "flashattn", "dtype": "f32", "batch": 1, "heads": 16, "seqlen_q": 512, "seqlen_k": 512, "head_dim": 64, "causal": false, "pass": "fwd", "threads": 2, "gflops": 100.5},
    {"impl": "flashattn", "dtype": "f32", "batch": 1, "heads": 16, "seqlen_q": 1024, "seqlen_k": 1024, "head_dim": 64, "causal": false, "pass": "fwd", "threads": 2, "gflops": 120.25},
    {"impl": "torch_sdpa", "dtype": "f32", "batch": 1, "heads": 16, "seqlen_q": 512, "seqlen_k": 512, "head_dim": 64, "causal": false, "pass": "fwd", "threads": 2, "gflops": 110.0},
    {"impl": "torch_sdpa", "dtype": "f32", "batch": 1, "heads": 16, "seqlen_q": 1024, "seqlen_k": 1024, "head_dim": 64, "causal": false, "pass": "fwd", "threads": 2, "gflops": 130.0},
    {"impl": "naive", "dtype": "f32", "batch": 1, "heads": 16, "seqlen_q": 512, "seqlen_k": 512, "head_dim": 64, "causal": false, "pass": "fwd", "threads": 2, "gflops": 40.0},
    {"impl": "naive", "dtype": "f32", "batch": 1, "heads": 16, "seqlen_q": 1024, "seqlen_k": 1024, "head_dim": 64, "causal": false, "pass": "fwd", "threads": 2, "skipped": true, "gflops": 0.0},
    {"impl": "flashattn", "dtype": "bf16", "batch": 1, "heads": 16, "seqlen_q": 512, "seqlen_k": 512, "head_dim": 128, "causal": true, "pass": "fwd+bwd", "threads": 2, "gflops": 90.0}
  ]
}"#;

#[test]
fn plot_writes_an_svg() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("results.json");
    let output = dir.path().join("plot.svg");
    std::fs::write(&input, COMPARE_JSON).unwrap();
    let res = flashattn(&["plot", input.to_str().unwrap(), output.to_str().unwrap()]);
    assert_ok(&res);
    let svg = std::fs::read_to_string(&output).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // Text is SVG text (no font files needed): the title, the panels and the legend are there.
    for needle in [
        "Attention GFLOP/s vs sequence length",
        "f32, non-causal, fwd",
        "bf16, causal, fwd+bwd",
        "flashattn d=64",
        "torch_sdpa d=64",
        "naive d=64",
        "flashattn d=128",
        "GFLOP/s",
        "1024",
        "ISA avx512+bf16",
    ] {
        assert!(svg.contains(needle), "missing {needle:?}");
    }
    assert!(svg.matches("<polyline").count() >= 4, "one line per series");

    // `bench --json` lines are accepted as they are.
    let lines = dir.path().join("bench.jsonl");
    let res = flashattn(&[
        "bench",
        "--json",
        "--no-peak",
        "--seqlen",
        "32,64",
        "--heads",
        "1",
        "--min-time",
        "0",
    ]);
    assert!(res.status.success());
    std::fs::write(&lines, &res.stdout).unwrap();
    let out2 = dir.path().join("bench.svg");
    let res = flashattn(&[
        "plot",
        lines.to_str().unwrap(),
        out2.to_str().unwrap(),
        "--title",
        "T",
    ]);
    assert_ok(&res);
    let svg = std::fs::read_to_string(&out2).unwrap();
    assert!(svg.contains("flashattn d=64") && svg.contains("naive d=64"));
}

#[test]
fn plot_rejects_bad_input_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("plot.svg");
    let cases: [(&str, &str); 5] = [
        ("{\"results\": [", "not JSON"),
        ("{\"results\": []}", "no measurements"),
        ("{\"results\": 3}", "not an array"),
        ("[{\"impl\": \"flashattn\", \"gflops\": 1.0}]", "seqlen_q"),
        (
            "[{\"impl\": \"flashattn\", \"seqlen_q\": 64, \"gflops\": \"fast\"}]",
            "gflops",
        ),
    ];
    for (text, needle) in cases {
        let input = dir.path().join("bad.json");
        std::fs::write(&input, text).unwrap();
        let res = flashattn(&["plot", input.to_str().unwrap(), output.to_str().unwrap()]);
        assert_eq!(res.status.code(), Some(1), "{text}");
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{text}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!output.exists(), "no SVG for bad input");
    }
    let res = flashattn(&["plot", "/nonexistent/in.json", output.to_str().unwrap()]);
    assert_eq!(res.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&res.stderr).contains("cannot read"));
}

/// A benchmark asked for shapes no machine holds fails with one `error:` line naming the tensor
/// (exit code 1), where the input's allocation aborted the process: 131 TB of q, FP8 inputs of
/// 5 TB, a 16 TB KV cache, and sizes past usize.
#[test]
fn bench_of_shapes_too_large_fails_cleanly() {
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "bench",
                "--seqlen",
                "2000000000",
                "--heads",
                "64",
                "--head-dim",
                "256",
            ],
            "out of memory: 131072000000000 bytes for q could not be allocated",
        ),
        (
            &["bench", "--dtype", "e5m2", "--seqlen", "20000000000"],
            "for q could not be allocated",
        ),
        (
            &[
                "bench",
                "--decode",
                "--cache-len",
                "4000000000",
                "--no-bandwidth",
            ],
            "out of memory: 16384000000000 bytes for k_cache could not be allocated",
        ),
        (
            &[
                "bench",
                "--seqlen",
                "4000000000000",
                "--heads",
                "4000000000",
            ],
            "overflow",
        ),
    ];
    for (args, needle) in cases {
        let mut args = args.to_vec();
        if args[1] != "--decode" {
            args.extend(["--no-naive", "--no-peak"]);
        }
        let res = flashattn(&args);
        let err = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{args:?}: {err}");
        let last = err.lines().last().unwrap_or("");
        assert!(
            last.starts_with("error: ") && last.contains(needle),
            "{args:?}: {err}"
        );
    }
}

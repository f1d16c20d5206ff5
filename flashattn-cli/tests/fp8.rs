//! `flashattn run` on FP8 files: the output equals the library's FP8 forward bit for bit and the
//! f64 reference on the dequantised inputs within bf16 rounding; bad FP8 files fail by name.

mod common;

use common::*;
use flashattn::fp8::{
    flash_attn_fp8, flash_attn_varlen_fp8, Descale, Fp8TensorRef, F8E4M3, F8E5M2,
};
use flashattn::{reference, AttnOptions, TensorRef};
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
        &Descale::default().q(&dq).k(&dk).v(&dv),
        &opts,
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
    let lib = flash_attn_varlen_fp8(
        &Fp8TensorRef::contiguous(&q, &[tq, h, d]),
        &Fp8TensorRef::contiguous(&k, &[tk, h, d]),
        &Fp8TensorRef::contiguous(&v, &[tk, h, d]),
        &cq,
        &ck,
        &Descale::default().k(&[0.25]),
        &AttnOptions::default().window(3, -1),
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
        (fp8_tensors(), vec!["--device", "cuda"], vec!["CPU only"]),
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
    for flags in [
        &["--backward"][..],
        &["--decode"][..],
        &["--device", "cuda"][..],
    ] {
        let mut args = vec!["bench", "--dtype", "e4m3", "--seqlen", "16", "--no-peak"];
        args.extend_from_slice(flags);
        let res = flashattn(&args);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains("forward pass on the CPU only"), "{stderr}");
    }
}

//! End-to-end tests of the `flashattn` binary: `run` against the f64 reference, every kind of bad
//! input (non-zero exit, a message naming the tensor, no OUT file, an existing OUT untouched), and
//! the JSON lines of `bench`.

mod common;

use common::*;
use flashattn::{reference, AttnOptions, TensorRef};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};
use std::process::Output;

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

#[test]
fn batched_causal_softcap_alibi_gqa_matches_reference() {
    check_against_reference(Case {
        ty: Ty::F32,
        batched: Some((2, 37, 53)),
        cu: None,
        heads: 4,
        heads_kv: 2,
        d: 40,
        alibi: Some(vec![4]),
        flags: vec!["--causal", "--softcap", "5", "--threads", "2"],
        opts: AttnOptions {
            causal: true,
            softcap: Some(5.0),
            ..Default::default()
        },
    });
}

#[test]
fn batched_window_scale_per_batch_alibi_matches_reference() {
    check_against_reference(Case {
        ty: Ty::F32,
        batched: Some((2, 41, 29)),
        cu: None,
        heads: 3,
        heads_kv: 3,
        d: 16,
        alibi: Some(vec![2, 3]),
        flags: vec![
            "--window-left",
            "7",
            "--window-right",
            "3",
            "--scale",
            "0.3",
            "--threads",
            "1",
        ],
        opts: AttnOptions {
            window: (7, 3),
            softmax_scale: Some(0.3),
            ..Default::default()
        },
    });
}

#[test]
fn packed_varlen_causal_matches_reference() {
    check_against_reference(Case {
        ty: Ty::F32,
        batched: None,
        cu: Some((vec![0, 5, 17, 30, 30], vec![0, 9, 20, 41, 44])),
        heads: 4,
        heads_kv: 1,
        d: 32,
        alibi: None,
        flags: vec!["--causal"],
        opts: AttnOptions {
            causal: true,
            ..Default::default()
        },
    });
}

#[test]
fn f16_matches_reference() {
    check_against_reference(Case {
        ty: Ty::F16,
        batched: Some((1, 70, 70)),
        cu: None,
        heads: 2,
        heads_kv: 2,
        d: 64,
        alibi: None,
        flags: vec!["--causal", "--softcap", "10"],
        opts: AttnOptions {
            causal: true,
            softcap: Some(10.0),
            ..Default::default()
        },
    });
}

#[test]
fn bf16_packed_matches_reference() {
    check_against_reference(Case {
        ty: Ty::BF16,
        batched: None,
        cu: Some((vec![0, 33, 50], vec![0, 20, 64])),
        heads: 2,
        heads_kv: 2,
        d: 64,
        alibi: Some(vec![2, 2]),
        flags: vec![],
        opts: AttnOptions::default(),
    });
}

// ---- flash-attn's packed layouts ---------------------------------------------------------------

/// `parts` (each `rows · chunk` values) interleaved chunk by chunk: `[rows, parts, chunk]`.
fn interleave(parts: &[&[f32]], chunk: usize) -> Vec<f32> {
    (0..parts[0].len() / chunk)
        .flat_map(|r| {
            parts
                .iter()
                .flat_map(move |p| p[r * chunk..(r + 1) * chunk].to_vec())
        })
        .collect()
}

/// Runs `tensors` and returns the output file's tensors by name (raw bytes and shape).
fn run_tensors(tensors: &[Raw], flags: &[&str]) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    write_st(&input, tensors);
    assert_ok(&run_files(&input, &output, flags));
    let bytes = std::fs::read(&output).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut named: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    named.sort();
    named
}

/// `qkv` `[batch, seqlen, 3, heads, d]` (packed sequences: `[total, 3, heads, d]` with
/// cu_seqlens), and `q` with `kv`, as flash-attn's `flash_attn_qkvpacked_func` and
/// `flash_attn_kvpacked_func` take them: out and lse bit-identical to separate tensors, and the
/// gradients packed like the inputs (`dqkv`; `dq` and `dkv`), interleaved from dq, dk, dv.
#[test]
fn packed_qkv_and_kv_match_separate_tensors() {
    let (b, s, h, d) = (2, 7, 2, 8);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let [q, k, v, dout] = [0; 4].map(|_| random(&mut rng, b * s * h * d));
    let hd = h * d;
    let cu = [0, 3, 14];
    for varlen in [false, true] {
        let lead: Vec<usize> = if varlen { vec![b * s] } else { vec![b, s] };
        let shape = |parts: Option<usize>| -> Vec<usize> {
            let mut x = lead.clone();
            x.extend(parts);
            x.extend([h, d]);
            x
        };
        let mut extra = vec![f32_raw("dout", &shape(None), &dout)];
        if varlen {
            extra.push(i32_raw("cu_seqlens_q", &[3], &cu));
            extra.push(i32_raw("cu_seqlens_k", &[3], &cu));
        }
        let with = |mut t: Vec<Raw>| {
            t.extend(extra.iter().cloned());
            t
        };
        let separate = run_tensors(
            &with(vec![
                f32_raw("q", &shape(None), &q),
                f32_raw("k", &shape(None), &k),
                f32_raw("v", &shape(None), &v),
            ]),
            &["--causal"],
        );
        let get = |named: &[(String, Vec<usize>, Vec<u8>)], n: &str| {
            named
                .iter()
                .find(|x| x.0 == n)
                .unwrap_or_else(|| panic!("no {n}"))
                .clone()
        };
        let f32s = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let [dq, dk, dv] = ["dq", "dk", "dv"].map(|n| f32s(&get(&separate, n).2));
        let qkv = interleave(&[&q, &k, &v], hd);
        let packed = run_tensors(
            &with(vec![f32_raw("qkv", &shape(Some(3)), &qkv)]),
            &["--causal"],
        );
        let kv = interleave(&[&k, &v], hd);
        let kv_packed = run_tensors(
            &with(vec![
                f32_raw("q", &shape(None), &q),
                f32_raw("kv", &shape(Some(2)), &kv),
            ]),
            &["--causal"],
        );
        for n in ["out", "lse"] {
            assert_eq!(
                get(&packed, n),
                get(&separate, n),
                "qkv, {n}, varlen {varlen}"
            );
            assert_eq!(
                get(&kv_packed, n),
                get(&separate, n),
                "kv, {n}, varlen {varlen}"
            );
        }
        let names =
            |x: &[(String, Vec<usize>, Vec<u8>)]| x.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
        assert_eq!(names(&packed), ["dqkv", "lse", "out"]);
        assert_eq!(names(&kv_packed), ["dkv", "dq", "lse", "out"]);
        let dqkv = get(&packed, "dqkv");
        assert_eq!(dqkv.1, shape(Some(3)));
        assert_eq!(
            f32s(&dqkv.2),
            interleave(&[&dq, &dk, &dv], hd),
            "dqkv, varlen {varlen}"
        );
        let dkv = get(&kv_packed, "dkv");
        assert_eq!(dkv.1, shape(Some(2)));
        assert_eq!(
            f32s(&dkv.2),
            interleave(&[&dk, &dv], hd),
            "dkv, varlen {varlen}"
        );
        assert_eq!(get(&kv_packed, "dq"), get(&separate, "dq"));
    }
}

/// A file's `learnable_sink` (F32 `[heads]`): out, lse and the gradients (`dsink` among them)
/// are the library's bits.
#[test]
fn learnable_sinks_are_read_and_their_gradient_written() {
    let (sq, sk, h, hk, d) = (6, 9, 4, 2, 8);
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let q = random(&mut rng, sq * h * d);
    let (k, v) = (random(&mut rng, sk * hk * d), random(&mut rng, sk * hk * d));
    let dout = random(&mut rng, sq * h * d);
    let sinks = [0.3f32, -1.0, 2.0, 0.0];
    let (qs, ks) = ([1, sq, h, d], [1, sk, hk, d]);
    let named = run_tensors(
        &[
            f32_raw("q", &qs, &q),
            f32_raw("k", &ks, &k),
            f32_raw("v", &ks, &v),
            f32_raw("dout", &qs, &dout),
            f32_raw("learnable_sink", &[h], &sinks),
        ],
        &["--causal", "--threads", "1"],
    );
    let opts = AttnOptions::default()
        .causal(true)
        .learnable_sink(TensorRef::contiguous(&sinks, &[h]));
    let (qt, kt, vt, dt) = (
        TensorRef::contiguous(&q, &qs),
        TensorRef::contiguous(&k, &ks),
        TensorRef::contiguous(&v, &ks),
        TensorRef::contiguous(&dout, &qs),
    );
    let f = flashattn::flash_attn(&qt, &kt, &vt, &opts).unwrap();
    let g = f.backward(&qt, &kt, &vt, &dt, &opts).unwrap();
    let dsink = g.dsink.as_ref().unwrap();
    for (name, t) in [
        ("out", &f.out),
        ("lse", &f.lse),
        ("dq", &g.dq),
        ("dk", &g.dk),
        ("dv", &g.dv),
        ("dsink", dsink),
    ] {
        let got = named
            .iter()
            .find(|x| x.0 == name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(got.1, t.shape(), "{name}");
        assert_eq!(got.2, f32_bytes(&t.to_f32_vec()), "{name}");
    }
    expect_failure(
        with_tensors(vec![
            f32_raw("q", &qs, &q),
            f32_raw("k", &ks, &k),
            f32_raw("v", &ks, &v),
            f32_raw("learnable_sink", &[3], &sinks[..3]),
        ]),
        &[],
        &["learnable_sink", "[3]", "[4]"],
    );
}

#[test]
fn packed_layout_problems_are_named() {
    let qkv = vec![0.5f32; 2 * 4 * 3 * 2 * 8];
    let good = || vec![f32_raw("qkv", &[2, 4, 3, 2, 8], &qkv)];
    // The part dimension must be 3 (qkv) or 2 (kv).
    expect_failure(
        with_tensors(vec![f32_raw("qkv", &[2, 4, 2, 3, 8], &qkv)]),
        &[],
        &[
            "`qkv`",
            "[2, 4, 2, 3, 8]",
            "[batch, seqlen, 3, heads, head_dim]",
        ],
    );
    expect_failure(
        with_tensors(vec![f32_raw("qkv", &[2, 12, 16], &qkv)]),
        &[],
        &["`qkv`", "[total, 3, heads, head_dim]"],
    );
    expect_failure(
        with_tensors(replace(good(), f32_raw("k", &[2, 4, 2, 8], &qkv[..128]))),
        &[],
        &["`k`", "beside `qkv`"],
    );
    expect_failure(
        with_tensors(replace(
            good(),
            f32_raw("kv", &[2, 4, 2, 2, 8], &qkv[..256]),
        )),
        &[],
        &["`qkv` and `kv`"],
    );
    let q = f32_raw("q", &[2, 4, 2, 8], &qkv[..128]);
    expect_failure(
        with_tensors(vec![q.clone(), f32_raw("kv", &[2, 4, 3, 2, 8], &qkv)]),
        &[],
        &["`kv`", "[batch, seqlen, 2, heads, head_dim]"],
    );
    expect_failure(
        with_tensors(vec![f32_raw("kv", &[2, 4, 2, 2, 8], &qkv[..256])]),
        &[],
        &["missing", "`q`"],
    );
    expect_failure(
        with_tensors(vec![q, raw("kv", "BF16", &[2, 4, 2, 2, 8], vec![0; 512])]),
        &[],
        &["`kv`", "q and kv must share one dtype"],
    );
}

// ---- bad input -------------------------------------------------------------------------------

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

#[test]
fn missing_tensor_is_named() {
    expect_failure(
        with_tensors(without(good_tensors(), "v")),
        &[],
        &["missing", "`v`"],
    );
}

#[test]
fn unknown_tensor_is_named_with_accepted_list() {
    let t = replace(good_tensors(), raw("extra", "F32", &[1], f32_bytes(&[1.0])));
    expect_failure(
        with_tensors(t),
        &[],
        &[
            "`extra`",
            "q, k, v, qkv, kv, dout, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k",
        ],
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let t = replace(
        good_tensors(),
        raw("k", "F64", &[1, 6, 2, 8], vec![0; 6 * 2 * 8 * 8]),
    );
    expect_failure(with_tensors(t), &[], &["`k`", "F64"]);
}

#[test]
fn mixed_dtypes_are_named() {
    let t = replace(
        good_tensors(),
        raw("v", "F16", &[1, 6, 2, 8], vec![0; 6 * 2 * 8 * 2]),
    );
    expect_failure(with_tensors(t), &[], &["`v`", "f16"]);
}

#[test]
fn wrong_rank_is_named() {
    let t = replace(
        good_tensors(),
        raw("q", "F32", &[4, 16], vec![0; 4 * 16 * 4]),
    );
    expect_failure(with_tensors(t), &[], &["`q`", "rank 2"]);
}

#[test]
fn packed_shape_without_cu_seqlens_is_explained() {
    let t = replace(
        good_tensors(),
        raw("q", "F32", &[4, 2, 8], vec![0; 4 * 2 * 8 * 4]),
    );
    expect_failure(with_tensors(t), &[], &["`q`", "cu_seqlens_q"]);
}

#[test]
fn shape_mismatch_is_named() {
    let t = replace(
        good_tensors(),
        raw("k", "F32", &[1, 6, 2, 4], vec![0; 6 * 2 * 4 * 4]),
    );
    expect_failure(with_tensors(t), &[], &["`k`", "shape"]);
}

#[test]
fn one_cu_seqlens_without_the_other_is_named() {
    let t = replace(
        good_tensors(),
        raw("cu_seqlens_q", "I32", &[2], i32_bytes(&[0, 4])),
    );
    expect_failure(with_tensors(t), &[], &["cu_seqlens_q", "cu_seqlens_k"]);
}

#[test]
fn cu_seqlens_wrong_dtype_is_named() {
    let t = replace(
        good_tensors(),
        raw("cu_seqlens_q", "I64", &[2], vec![0; 16]),
    );
    let t = replace(t, raw("cu_seqlens_k", "I32", &[2], i32_bytes(&[0, 6])));
    expect_failure(with_tensors(t), &[], &["`cu_seqlens_q`", "I32"]);
}

#[test]
fn bad_cu_seqlens_values_are_named() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let t = vec![
        raw("q", "F32", &[4, 2, 8], f32_bytes(&random(&mut rng, 64))),
        raw("k", "F32", &[6, 2, 8], f32_bytes(&random(&mut rng, 96))),
        raw("v", "F32", &[6, 2, 8], f32_bytes(&random(&mut rng, 96))),
        raw("cu_seqlens_q", "I32", &[3], i32_bytes(&[0, 3, 2])),
        raw("cu_seqlens_k", "I32", &[3], i32_bytes(&[0, 3, 6])),
    ];
    expect_failure(with_tensors(t), &[], &["cu_seqlens_q", "decreases"]);
}

#[test]
fn alibi_problems_are_named() {
    let t = replace(
        good_tensors(),
        raw("alibi_slopes", "F32", &[3], f32_bytes(&[0.1, 0.2, 0.3])),
    );
    expect_failure(with_tensors(t), &[], &["alibi_slopes", "[3]"]);
    let t = replace(good_tensors(), raw("alibi_slopes", "F16", &[2], vec![0; 4]));
    expect_failure(with_tensors(t), &[], &["`alibi_slopes`", "F32"]);
}

#[test]
fn bad_options_are_reported() {
    expect_failure(
        with_tensors(good_tensors()),
        &["--softcap", "-1"],
        &["softcap"],
    );
    expect_failure(
        with_tensors(good_tensors()),
        &["--scale", "inf"],
        &["softmax_scale"],
    );
    expect_failure(
        with_tensors(good_tensors()),
        &["--window-left", "-5"],
        &["window"],
    );
    expect_failure(
        with_tensors(good_tensors()),
        &["--threads", "0"],
        &["--threads"],
    );
}

#[test]
fn unreadable_and_corrupt_files_are_reported() {
    expect_failure(|_: &Path| {}, &[], &["cannot read", "in.safetensors"]);
    expect_failure(
        |p: &Path| std::fs::write(p, b"not a safetensors file").unwrap(),
        &[],
        &["not a valid safetensors"],
    );
    // Truncated: the header promises more data than the file holds.
    expect_failure(
        |p: &Path| {
            write_st(p, &good_tensors());
            let bytes = std::fs::read(p).unwrap();
            std::fs::write(p, &bytes[..bytes.len() - 10]).unwrap();
        },
        &[],
        &["not a valid safetensors"],
    );
}

#[test]
fn unwritable_destination_is_reported_and_input_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_st(&input, &good_tensors());
    let res = run_files(&input, &dir.path().join("no/such/dir/out.safetensors"), &[]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).starts_with("error: "));
    assert_eq!(files_in(dir.path()), vec![input]);
}

#[test]
fn success_replaces_an_existing_out_and_leaves_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("in.safetensors"),
        dir.path().join("out.safetensors"),
    );
    write_st(&input, &good_tensors());
    std::fs::write(&output, b"old").unwrap();
    let res = run_files(&input, &output, &["--causal"]);
    assert_ok(&res);
    let (_, shape, _) = read_out(&output, "out");
    assert_eq!(shape, vec![1, 4, 2, 8]);
    assert_eq!(files_in(dir.path()), vec![input, output]);
}

// ---- bench -----------------------------------------------------------------------------------

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

/// With `dout` in the input, `run` also writes dq, dk, dv, matching the f64 reference backward,
/// with dropout (the same seed drives forward and backward).
#[test]
fn dout_writes_gradients_matching_reference() {
    let (b, sq, sk, h, hk, d) = (2usize, 37usize, 53usize, 4usize, 2usize, 16usize);
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let q = random(&mut rng, b * sq * h * d);
    let k = random(&mut rng, b * sk * hk * d);
    let v = random(&mut rng, b * sk * hk * d);
    let dout = random(&mut rng, b * sq * h * d);
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("in.safetensors"),
        dir.path().join("out.safetensors"),
    );
    write_st(
        &input,
        &[
            raw("q", "F32", &[b, sq, h, d], f32_bytes(&q)),
            raw("k", "F32", &[b, sk, hk, d], f32_bytes(&k)),
            raw("v", "F32", &[b, sk, hk, d], f32_bytes(&v)),
            raw("dout", "F32", &[b, sq, h, d], f32_bytes(&dout)),
        ],
    );
    let res = run_files(
        &input,
        &output,
        &["--causal", "--dropout", "0.2", "--seed", "9"],
    );
    assert_ok(&res);
    let opts = flashattn::AttnOptions::default()
        .causal(true)
        .dropout(0.2, 9);
    let (qt, kt, vt, dt) = (
        flashattn::TensorRef::contiguous(&q, &[b, sq, h, d]),
        flashattn::TensorRef::contiguous(&k, &[b, sk, hk, d]),
        flashattn::TensorRef::contiguous(&v, &[b, sk, hk, d]),
        flashattn::TensorRef::contiguous(&dout, &[b, sq, h, d]),
    );
    let want_out = flashattn::reference::attention(&qt, &kt, &vt, &opts).unwrap();
    let want = flashattn::reference::attention_backward(&qt, &kt, &vt, &dt, &opts).unwrap();
    assert_close("out", &read_out(&output, "out").2, &want_out.out, 1e-5);
    for (name, shape, w) in [
        ("dq", [b, sq, h, d], &want.dq),
        ("dk", [b, sk, hk, d], &want.dk),
        ("dv", [b, sk, hk, d], &want.dv),
    ] {
        let (dtype, got_shape, got) = read_out(&output, name);
        assert_eq!(dtype, Dtype::F32);
        assert_eq!(got_shape, shape.to_vec(), "{name} shape");
        assert_close(name, &got, w, 1e-5);
    }
    // dout of the wrong shape is named.
    write_st(
        &input,
        &[
            raw("q", "F32", &[b, sq, h, d], f32_bytes(&q)),
            raw("k", "F32", &[b, sk, hk, d], f32_bytes(&k)),
            raw("v", "F32", &[b, sk, hk, d], f32_bytes(&v)),
            raw(
                "dout",
                "F32",
                &[b, sq - 1, h, d],
                f32_bytes(&dout[..b * (sq - 1) * h * d]),
            ),
        ],
    );
    let bad = run_files(&input, &dir.path().join("never.safetensors"), &[]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("dout"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(!dir.path().join("never.safetensors").exists());
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

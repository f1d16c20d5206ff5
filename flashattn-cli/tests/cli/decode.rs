//! End-to-end tests of the `flashattn` binary's KV-cache decoding: `run` on a file holding
//! `k_cache`/`v_cache` (its outputs bit-identical to the library's on the same inputs, the caches
//! written back updated), its errors (one line naming the problem, no OUT, an existing OUT left
//! alone), and `bench --decode --json`.

use crate::common::*;
use flashattn::decode::SliceMut;
use flashattn::{
    flash_attn_with_kvcache, AttnOptions, BlockTable, KvCacheOptions, TensorMut, TensorRef,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// An output tensor as raw bits (f32 only here), with its shape.
fn read_f32(path: &Path, name: &str) -> (Vec<usize>, Vec<u32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("no `{name}` in the output"));
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    let bits = t
        .data()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (t.shape().to_vec(), bits)
}

/// A paged decode problem: 2 sequences, 2 new tokens each, rotary, GQA 4/2, d 16, pages of 8.
struct Problem {
    q: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    k_new: Vec<f32>,
    v_new: Vec<f32>,
    lens: Vec<i32>,
    table: Vec<i32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

const B: usize = 2;
const SQ: usize = 2;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 16;
const PAGE: usize = 8;
const BLOCKS: usize = 5; // per sequence
const N_PAGES: usize = B * BLOCKS + 1;
const RO: usize = 48;

fn problem() -> Problem {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut r = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect() };
    let q = r(B * SQ * H * D);
    let k_cache = r(N_PAGES * PAGE * HKV * D);
    let v_cache = r(N_PAGES * PAGE * HKV * D);
    let k_new = r(B * SQ * HKV * D);
    let v_new = r(B * SQ * HKV * D);
    let mut table: Vec<i32> = (0..N_PAGES as i32).collect();
    table.shuffle(&mut ChaCha8Rng::seed_from_u64(6));
    table.truncate(B * BLOCKS);
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pos in 0..RO {
        for i in 0..D / 4 {
            let a = pos as f32 * 10000f32.powf(-((2 * i) as f32) / (D / 2) as f32);
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Problem {
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        lens: vec![13, 30],
        table,
        cos,
        sin,
    }
}

fn tensors(p: &Problem) -> Vec<Raw> {
    let cache = [N_PAGES, PAGE, HKV, D];
    vec![
        f32_raw("q", &[B, SQ, H, D], &p.q),
        f32_raw("k_cache", &cache, &p.k_cache),
        f32_raw("v_cache", &cache, &p.v_cache),
        i32_raw("cache_seqlens", &[B], &p.lens),
        f32_raw("k_new", &[B, SQ, HKV, D], &p.k_new),
        f32_raw("v_new", &[B, SQ, HKV, D], &p.v_new),
        i32_raw("block_table", &[B, BLOCKS], &p.table),
        f32_raw("rotary_cos", &[RO, D / 4], &p.cos),
        f32_raw("rotary_sin", &[RO, D / 4], &p.sin),
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn run_paged_cache_with_append_and_rotary_matches_the_library() {
    let p = problem();
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    write_st(&input, &tensors(&p));
    let res = flashattn(&[
        "run",
        input.to_str().unwrap(),
        output.to_str().unwrap(),
        "--causal",
        "--softcap",
        "20",
        "--rotary-interleaved",
        "--num-splits",
        "2",
    ]);
    assert_ok(&res);

    // The same call in-process (a fixed split count: the same bits on any thread count).
    let (mut kc, mut vc) = (p.k_cache.clone(), p.v_cache.clone());
    let cache = [N_PAGES, PAGE, HKV, D];
    let mut attn = AttnOptions::default().causal(true);
    attn.softcap = Some(20.0);
    let new_shape = [B, SQ, HKV, D];
    let ro = [RO, D / 4];
    let opts = KvCacheOptions::default()
        .attn(attn)
        .new_kv(
            TensorRef::contiguous(&p.k_new, &new_shape),
            TensorRef::contiguous(&p.v_new, &new_shape),
        )
        .block_table(BlockTable::new(&p.table, B, BLOCKS))
        .rotary(
            TensorRef::contiguous(&p.cos, &ro),
            TensorRef::contiguous(&p.sin, &ro),
            true,
        )
        .num_splits(2);
    let want = {
        let mut k = TensorMut::contiguous(SliceMut::F32(&mut kc), &cache);
        let mut v = TensorMut::contiguous(SliceMut::F32(&mut vc), &cache);
        flash_attn_with_kvcache(
            &TensorRef::contiguous(&p.q, &[B, SQ, H, D]),
            &mut k,
            &mut v,
            &p.lens,
            &opts,
        )
        .unwrap()
    };
    let (shape, out) = read_f32(&output, "out");
    assert_eq!(shape, vec![B, SQ, H, D]);
    assert_eq!(out, bits(&want.out.to_f32_vec()), "out");
    let (shape, lse) = read_f32(&output, "lse");
    assert_eq!(shape, vec![B, H, SQ]);
    assert_eq!(lse, bits(&want.lse.to_f32_vec()), "lse");
    let (shape, k_after) = read_f32(&output, "k_cache");
    assert_eq!(shape, cache.to_vec());
    assert_eq!(k_after, bits(&kc), "k_cache written back, updated");
    assert_ne!(k_after, bits(&p.k_cache), "the new keys were appended");
    let (_, v_after) = read_f32(&output, "v_cache");
    assert_eq!(v_after, bits(&vc), "v_cache");
}

/// `run --device cuda` on the same paged file: with a GPU, out, lse and the caches agree with the
/// CPU run within rounding; without one, one `error:` line naming CUDA and no output file.
#[test]
fn run_kvcache_on_cuda_matches_cpu_or_fails_cleanly() {
    let p = problem();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.st");
    write_st(&input, &tensors(&p));
    let (cpu_out, gpu_out) = (dir.path().join("cpu.st"), dir.path().join("gpu.st"));
    let flags = ["--causal", "--rotary-interleaved", "--num-splits", "2"];
    let run = |out: &Path, device: &str| {
        let mut args = vec!["run", input.to_str().unwrap(), out.to_str().unwrap()];
        args.extend(flags);
        args.extend(["--device", device]);
        flashattn(&args)
    };
    assert_ok(&run(&cpu_out, "cpu"));
    let res = run(&gpu_out, "cuda");
    if !res.status.success() {
        let stderr = String::from_utf8_lossy(&res.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains("CUDA"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!gpu_out.exists(), "a failed run wrote its output");
        return;
    }
    for name in ["out", "lse", "k_cache", "v_cache"] {
        let (sa, a) = read_f32(&cpu_out, name);
        let (sb, b) = read_f32(&gpu_out, name);
        assert_eq!(sa, sb, "{name}");
        for (x, y) in a.iter().zip(&b) {
            let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
            assert!(
                x == y || (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                "{name}: cpu {x} gpu {y}"
            );
        }
    }
}

/// What `flashattn run` wrote (out, lse and k_cache, as bits) and what the library computes on
/// the same inputs: q, contiguous caches `[3, 20, HKV, D]` and `lens` (written to the file here,
/// with the `extra` tensors), `opts` (the library side uses one split, as the file's
/// single-threaded run does).
struct RunAndLibrary {
    out: Vec<u32>,
    lse: Vec<u32>,
    k_cache: Vec<u32>,
    want: flashattn::AttnOutput,
}

fn run_and_library(
    extra: Vec<Raw>,
    flags: &[&str],
    (q, q_shape): (&[f32], &[usize]),
    (kc, vc): (&[f32], &[f32]),
    lens: &[i32],
    opts: KvCacheOptions,
) -> RunAndLibrary {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    let shape = [3, 20, HKV, D];
    let mut tensors = vec![
        f32_raw("q", q_shape, q),
        f32_raw("k_cache", &shape, kc),
        f32_raw("v_cache", &shape, vc),
        i32_raw("cache_seqlens", &[3], lens),
    ];
    tensors.extend(extra);
    write_st(&input, &tensors);
    let mut args = vec!["run", input.to_str().unwrap(), output.to_str().unwrap()];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--threads", "1"]);
    assert_ok(&flashattn(&args));
    let (mut k2, mut v2) = (kc.to_vec(), vc.to_vec());
    let want = flash_attn_with_kvcache(
        &TensorRef::contiguous(q, q_shape),
        &mut TensorMut::contiguous(SliceMut::F32(&mut k2), &shape),
        &mut TensorMut::contiguous(SliceMut::F32(&mut v2), &shape),
        lens,
        &opts.num_splits(1),
    )
    .unwrap();
    let (out_shape, out) = read_f32(&output, "out");
    assert_eq!(out_shape, want.out.shape());
    let (lse_shape, lse) = read_f32(&output, "lse");
    assert_eq!(lse_shape, want.lse.shape());
    RunAndLibrary {
        out,
        lse,
        k_cache: read_f32(&output, "k_cache").1,
        want,
    }
}

/// Seeded q (`q_rows` rows of H heads) and k, v caches `[3, 20, HKV, D]` for [`run_and_library`].
fn random_inputs(seed: u64, q_rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut r = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect() };
    (r(q_rows * H * D), r(3 * 20 * HKV * D), r(3 * 20 * HKV * D))
}

#[test]
fn run_contiguous_cache_without_new_keys() {
    let (q, kc, vc) = random_inputs(9, 3);
    let lens = [20, 0, 7];
    let idx = [2, 0, 1];
    let leftpad = [5, 0, 2];
    let got = run_and_library(
        vec![
            i32_raw("cache_batch_idx", &[3], &idx),
            i32_raw("cache_leftpad", &[3], &leftpad),
        ],
        &[],
        (&q, &[3, 1, H, D]),
        (&kc, &vc),
        &lens,
        KvCacheOptions::default()
            .cache_batch_idx(&idx)
            .cache_leftpad(&leftpad),
    );
    assert_eq!(got.out, bits(&got.want.out.to_f32_vec()));
    assert_eq!(got.lse, bits(&got.want.lse.to_f32_vec()));
    // Sequence 1 has an empty cache: its rows are 0 with lse -inf.
    assert!(got.lse[H..2 * H]
        .iter()
        .all(|&x| f32::from_bits(x) == f32::NEG_INFINITY));
    assert_eq!(got.k_cache, bits(&kc), "nothing appended");
}

/// A file's `learnable_sink` (F32 `[heads]`) joins every row's normaliser: the library's bits,
/// and a sequence with an empty cache gets lse = its head's sink instead of -inf.
#[test]
fn run_with_learnable_sinks() {
    let (q, kc, vc) = random_inputs(10, 3);
    let lens = [20, 0, 7];
    let sinks: Vec<f32> = (0..H).map(|h| 0.5 * h as f32 - 1.0).collect();
    let got = run_and_library(
        vec![f32_raw("learnable_sink", &[H], &sinks)],
        &[],
        (&q, &[3, 1, H, D]),
        (&kc, &vc),
        &lens,
        KvCacheOptions::default().attn(
            flashattn::AttnOptions::default().learnable_sink(TensorRef::contiguous(&sinks, &[H])),
        ),
    );
    assert_eq!(got.out, bits(&got.want.out.to_f32_vec()));
    assert_eq!(got.lse, bits(&got.want.lse.to_f32_vec()));
    assert_eq!(got.lse[H..2 * H], bits(&sinks)[..]);
}

#[test]
fn run_packed_queries() {
    // Three sequences with 2, 0 and 3 queries, and one packed row after them; then the same
    // sequences appending as many new keys (chunked prefill beside decoding).
    let (q, kc, vc) = random_inputs(11, 6);
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let mut r = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect() };
    let (kn, vn) = (r(5 * HKV * D), r(5 * HKV * D));
    let cu = [0, 2, 2, 5];
    for append in [false, true] {
        let lens = if append { [12, 7, 15] } else { [20, 7, 12] };
        let mut extra = vec![i32_raw("cu_seqlens_q", &[4], &cu)];
        let mut opts = KvCacheOptions::default()
            .attn(AttnOptions::default().causal(true))
            .cu_seqlens_q(&cu);
        if append {
            extra.extend([
                i32_raw("cu_seqlens_k_new", &[4], &cu),
                f32_raw("k_new", &[5, HKV, D], &kn),
                f32_raw("v_new", &[5, HKV, D], &vn),
            ]);
            opts = opts.cu_seqlens_k_new(&cu).new_kv(
                TensorRef::contiguous(&kn, &[5, HKV, D]),
                TensorRef::contiguous(&vn, &[5, HKV, D]),
            );
        }
        let got = run_and_library(
            extra,
            &["--causal"],
            (&q, &[6, H, D]),
            (&kc, &vc),
            &lens,
            opts,
        );
        assert_eq!(got.want.out.shape(), &[6, H, D]);
        assert_eq!(got.want.lse.shape(), &[H, 6]);
        assert_eq!(got.out, bits(&got.want.out.to_f32_vec()));
        assert_eq!(got.lse, bits(&got.want.lse.to_f32_vec()));
        // The row after the last sequence: 0, lse -inf.
        assert!(got.out[5 * H * D..].iter().all(|&x| x == 0));
        assert!((0..H).all(|h| f32::from_bits(got.lse[h * 6 + 5]) == f32::NEG_INFINITY));
        // Appending: rows 0..2 of k_new went to sequence 0's positions 12..14, rows 2..5 to
        // sequence 2's 15..18; nothing else changed.
        let row = HKV * D;
        let mut want = kc.clone();
        if append {
            want[12 * row..14 * row].copy_from_slice(&kn[..2 * row]);
            want[(2 * 20 + 15) * row..(2 * 20 + 18) * row].copy_from_slice(&kn[2 * row..]);
        }
        assert_eq!(got.k_cache, bits(&want), "append {append}");
    }
}

/// A failing run: exit 1, one line on stderr naming every needle, no OUT (and an existing OUT
/// byte-for-byte as it was).
fn expect_failure(tensors: &[Raw], flags: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.st"), dir.path().join("out.st"));
    write_st(&input, tensors);
    for existing in [false, true] {
        if existing {
            std::fs::write(&output, b"previous").unwrap();
        }
        let mut args = vec!["run", input.to_str().unwrap(), output.to_str().unwrap()];
        args.extend_from_slice(flags);
        let res = flashattn(&args);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "a clean error exit: {stderr}");
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        for n in needles {
            assert!(stderr.contains(n), "stderr should mention {n:?}: {stderr}");
        }
        if existing {
            assert_eq!(std::fs::read(&output).unwrap(), b"previous");
            std::fs::remove_file(&output).unwrap();
        } else {
            assert!(!output.exists(), "no OUT on failure");
        }
    }
}

#[test]
fn run_errors_name_the_problem() {
    let p = problem();
    let good = || tensors(&p);
    // Appending 2 tokens at 39 overflows the 5 pages of 8 tokens.
    expect_failure(
        &replace(good(), i32_raw("cache_seqlens", &[B], &[13, 39])),
        &[],
        &["cache_seqlens[1] = 39", "40", "nothing was written"],
    );
    expect_failure(
        &replace(
            good(),
            i32_raw("block_table", &[B, BLOCKS], &[99; B * BLOCKS]),
        ),
        &[],
        &["block_table", "99"],
    );
    expect_failure(
        &replace(
            good(),
            f32_raw("block_table", &[B, BLOCKS], &[0.0; B * BLOCKS]),
        ),
        &[],
        &["block_table", "I32"],
    );
    expect_failure(
        &without(good(), "cache_seqlens"),
        &[],
        &["missing tensor `cache_seqlens`"],
    );
    expect_failure(
        &without(good(), "v_new"),
        &[],
        &["`k_new` is present without `v_new`"],
    );
    expect_failure(
        &without(without(good(), "k_new"), "v_new"),
        &[],
        &["rotary", "k_new"],
    );
    let mut with_k = good();
    with_k.push(f32_raw("k", &[1], &[0.0]));
    expect_failure(&with_k, &[], &["unexpected tensor `k`", "k_cache"]);
    expect_failure(&good(), &["--num-splits", "0"], &["num_splits"]);
    expect_failure(&good(), &["--dropout", "0.1"], &["dropout"]);
    expect_failure(
        &replace(
            good(),
            f32_raw(
                "k_new",
                &[B, SQ, HKV, D - 1],
                &p.k_new[..B * SQ * HKV * (D - 1)],
            ),
        ),
        &[],
        &["k_new"],
    );
}

// ---- bench --decode ----------------------------------------------------------------------------

fn json_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let res = flashattn(args);
    assert_ok(&res);
    String::from_utf8(res.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

#[test]
fn bench_decode_json_lines_have_the_fields() {
    let lines = json_lines(&[
        "bench",
        "--decode",
        "--json",
        "--no-bandwidth",
        "--cache-len",
        "300,64",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--head-dim",
        "32",
        "--min-time",
        "0.01",
        "--threads",
        "2",
    ]);
    assert_eq!(lines[0]["kind"], "machine");
    assert!(lines[0]["bandwidth"].is_null(), "{}", lines[0]);
    let m = &lines[1..];
    assert_eq!(m.len(), 4, "f32 and bf16 at two cache lengths");
    for (l, (dtype, cap)) in m
        .iter()
        .zip([("f32", 300), ("f32", 64), ("bf16", 300), ("bf16", 64)])
    {
        assert_eq!(l["pass"], "decode");
        assert_eq!(l["dtype"], dtype);
        assert_eq!(l["cache_len"], cap);
        assert_eq!(l["seqlen_q"], 1);
        assert_eq!(l["heads"], 4);
        assert_eq!(l["heads_kv"], 2);
        let elem = if dtype == "f32" { 4.0 } else { 2.0 };
        assert_eq!(
            l["kv_bytes"].as_f64().unwrap(),
            (cap * 2 * 32) as f64 * 2.0 * elem
        );
        assert!(l["median_ms"].as_f64().unwrap() > 0.0);
        assert!(l["gbps"].as_f64().unwrap() > 0.0);
        assert!(l["bandwidth_fraction"].is_null());
        assert!(l["read_gbps_around"].is_null());
        let err = l["max_abs_err"].as_f64().unwrap();
        let tol = if dtype == "f32" { 1e-5 } else { 2e-2 };
        assert!(err < tol, "{l}");
        // Read from /proc/self/smaps on Linux (how much the kernel granted varies).
        assert_eq!(
            l["huge_page_bytes"].is_u64(),
            cfg!(target_os = "linux"),
            "{l}"
        );
    }
}

#[test]
fn bench_decode_measures_bandwidth_and_pages() {
    let lines = json_lines(&[
        "bench",
        "--decode",
        "--json",
        "--cache-len",
        "256",
        "--page-size",
        "16",
        "--seqlen",
        "2",
        "--heads",
        "4",
        "--heads-kv",
        "4",
        "--head-dim",
        "16",
        "--dtype",
        "f32",
        "--num-splits",
        "3",
        "--min-time",
        "0.01",
    ]);
    let bw = &lines[0]["bandwidth"];
    assert!(bw["read_gbps"].as_f64().unwrap() > 0.1, "{bw}");
    assert!(bw["copy_gbps"].as_f64().unwrap() > 0.1, "{bw}");
    assert_eq!(bw["bytes"], 1u64 << 30);
    let m = &lines[1];
    assert_eq!(m["page_size"], 16);
    assert_eq!(m["num_splits"], 3);
    assert_eq!(m["seqlen_q"], 2);
    // The fraction divides by the read rate measured around this row.
    let around = m["read_gbps_around"].as_f64().unwrap();
    assert!(around > 0.1, "{m}");
    let want = m["gbps"].as_f64().unwrap() / around;
    let got = m["bandwidth_fraction"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-9 * want, "{m}");
    assert_eq!(lines[0]["bandwidth_used"], "read_gbps_around");
}

/// A head-major cache (`[batch, heads_kv, tokens, d]` storage) is read through its strides: the
/// sampled rows match the f64 reference read through the same strides, and paged head-major
/// pages run too.
#[test]
fn bench_decode_head_major_cache() {
    for paged in [false, true] {
        let mut args = vec![
            "bench",
            "--decode",
            "--json",
            "--no-bandwidth",
            "--head-major",
            "--cache-len",
            "300",
            "--heads",
            "6",
            "--heads-kv",
            "3",
            "--head-dim",
            "40",
            "--dtype",
            "f32",
            "--min-time",
            "0.01",
        ];
        if paged {
            args.extend(["--page-size", "7"]);
        }
        let lines = json_lines(&args);
        let m = &lines[1];
        assert_eq!(m["head_major"], true, "{m}");
        if paged {
            assert_eq!(m["page_size"], 7, "{m}");
        } else {
            let err = m["max_abs_err"].as_f64().unwrap();
            assert!(err < 1e-5, "{m}");
        }
    }
}

#[test]
fn bench_decode_rejects_bad_options() {
    for (args, needle) in [
        (
            vec!["--seqlen", "5", "--cache-len", "4"],
            "longer than --cache-len",
        ),
        (vec!["--page-size", "0"], "--page-size"),
        (vec!["--heads", "6", "--heads-kv", "4"], "multiple"),
        (vec!["--cache-len", "0"], "at least 1"),
    ] {
        let mut all = vec!["bench", "--decode", "--no-bandwidth"];
        all.extend(args);
        let res = flashattn(&all);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(needle), "{needle}: {stderr}");
    }
}

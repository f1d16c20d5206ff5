//! flash-attn's packed layouts (qkv, kv) and learnable sinks.

use super::*;

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

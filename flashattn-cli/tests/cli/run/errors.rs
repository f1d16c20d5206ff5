//! Bad input: a non-zero exit, a message naming the tensor, no OUT file, an existing OUT untouched.

use super::*;

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

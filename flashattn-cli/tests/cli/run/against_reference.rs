//! `run` against the f64 reference: batched and packed, every dtype, and the gradients.

use super::*;

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

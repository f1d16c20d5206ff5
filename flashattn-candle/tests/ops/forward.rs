//! The forward against flashattn's f64 reference, and the plumbing (strides, the
//! candle-flash-attn-style wrappers) against flashattn called directly, bit for bit.

use super::common::*;
use candle_core::{Device, Tensor};
use flashattn::reference;
use flashattn_candle::{flash_attn, flash_attn_varlen, flash_attn_windowed, flash_attn_with};

/// Shapes that break tiling (1, 113, 203; d = 40, 59), seqlen_q ≠ seqlen_k both ways, masks.
pub fn cases() -> Vec<Case> {
    vec![
        Case::new(1, 1, 1, 2, 64),
        Case::new(2, 113, 203, 3, 40),
        Case::new(1, 203, 113, 2, 59).causal(),
        Case::new(1, 113, 203, 2, 64).causal(),
        Case::new(1, 113, 113, 4, 128).gqa(2),
        Case::new(2, 64, 97, 4, 59).gqa(1).causal(),
        Case::new(1, 128, 128, 2, 64).window(Some(16), Some(8)),
        Case::new(1, 96, 80, 2, 40).softcap(5.0).alibi().causal(),
    ]
}

fn check_forward<T: Elem>(case: &Case, seed: u64) {
    let data = Data::<T>::new(case, seed);
    let [q, k, v, _] = data.views();
    let opts = data.flash_opts();
    let want = reference::attention(&q, &k, &v, &opts).unwrap().out;
    let naive = flashattn::naive::attention(&q, &k, &v, &opts)
        .unwrap()
        .out
        .to_f64_vec();
    let [qt, kt, vt, _] = data.tensors();
    let out = flash_attn_with(&qt, &kt, &vt, &data.candle_opts()).unwrap();
    assert_eq!(out.dims(), case.q_shape());
    assert_eq!(out.dtype(), qt.dtype());
    let ctx = format!("{case:?} {:?}", T::FLASH_DTYPE);
    check_bound(
        "out",
        &to_f64(&out),
        max_err(&naive, &want),
        &want,
        (T::FLASH_DTYPE, 2.0, 0.0),
        &ctx,
    );
}

fn grid<T: Elem>() {
    for (i, case) in cases().iter().enumerate() {
        check_forward::<T>(case, 100 + i as u64);
    }
}

#[test]
fn grid_f32() {
    grid::<f32>();
}

#[test]
fn grid_f16() {
    grid::<half::f16>();
}

#[test]
fn grid_bf16() {
    grid::<half::bf16>();
}

/// Views in another memory order (q, k, v made from `[batch, heads, seqlen, head_dim]` buffers),
/// k and v of a packed kv tensor (v at a start offset), and a view whose last dimension is
/// strided (copied first) give flashattn's result on the contiguous data exactly.
#[test]
fn strided_views_match_flashattn_exactly() {
    let case = Case::new(2, 37, 50, 4, 40).gqa(2).causal();
    let data = Data::<f32>::new(&case, 7);
    let [q, k, v, _] = data.views();
    let want = flashattn::flash_attn(&q, &k, &v, &data.flash_opts())
        .unwrap()
        .out
        .to_f32_vec();
    let [qt, kt, vt, _] = data.tensors();
    // Same values, heads-major storage: transpose to [b, h, s, d], copy, transpose back.
    let heads_major = |t: &Tensor| {
        let t = t.transpose(1, 2).unwrap().contiguous().unwrap();
        t.transpose(1, 2).unwrap()
    };
    let (qh, kh, vh) = (heads_major(&qt), heads_major(&kt), heads_major(&vt));
    assert!(!qh.is_contiguous());
    // Last dimension strided (stride 2): every other element of a [.., d, 2] tensor whose other
    // half is 1e30, which would show in the output if it were read.
    let last_strided = |t: &Tensor| {
        let junk = (t.ones_like().unwrap() * 1e30).unwrap();
        let pairs = Tensor::stack(&[t, &junk], 4).unwrap();
        pairs.narrow(4, 0, 1).unwrap().squeeze(4).unwrap()
    };
    let ql = last_strided(&qt);
    // flash-attn's packed kv layout [b, seqlen_k, 2, heads_kv, d]: v starts past k's first row.
    let kv = Tensor::stack(&[&kt, &vt], 2).unwrap();
    let select = |i| kv.narrow(2, i, 1).unwrap().squeeze(2).unwrap();
    let (kp, vp) = (select(0), select(1));
    assert!(vp.layout().start_offset() > 0);
    assert_eq!(ql.stride()[3], 2);
    let scale = 1.0 / (case.head_dim as f32).sqrt();
    for (name, q, k, v) in [
        ("contiguous", &qt, &kt, &vt),
        ("heads-major", &qh, &kh, &vh),
        ("q last-dim view", &ql, &kt, &vt),
        ("packed kv", &qt, &kp, &vp),
    ] {
        let out = flash_attn(q, k, v, scale, true).unwrap();
        let got = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            got == want,
            "{name}: differs from flashattn on contiguous data"
        );
    }
}

/// `flash_attn_windowed(None, Some(0))` is causal attention, as in candle-flash-attn.
#[test]
fn windowed_none_zero_is_causal() {
    let case = Case::new(1, 50, 70, 2, 64);
    let data = Data::<f32>::new(&case, 8);
    let [q, k, v, _] = data.tensors();
    let a = flash_attn(&q, &k, &v, 0.125, true).unwrap();
    let b = flash_attn_windowed(&q, &k, &v, 0.125, None, Some(0)).unwrap();
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
}

/// Packed sequences of lengths (5, 0, 113) over keys (40, 7, 203), u32 offsets as
/// candle-flash-attn takes them, against the packed f64 reference.
#[test]
fn varlen_matches_reference() {
    let (heads, heads_kv, d) = (4, 2, 59);
    let cu_q = [0i32, 5, 5, 118];
    let cu_k = [0i32, 40, 47, 250];
    let case = Case::new(1, 118, 250, heads, d).gqa(heads_kv);
    let data = Data::<f32>::new(&case, 9);
    let (qs, ks) = ([118, heads, d], [250, heads_kv, d]);
    let q = flashattn::TensorRef::contiguous(&data.q, &qs);
    let k = flashattn::TensorRef::contiguous(&data.k, &ks);
    let v = flashattn::TensorRef::contiguous(&data.v, &ks);
    let opts = flashattn::AttnOptions::default().causal(true);
    let want = reference::attention_varlen(&q, &k, &v, &cu_q, &cu_k, &opts)
        .unwrap()
        .out;
    let naive = flashattn::naive::attention_varlen(&q, &k, &v, &cu_q, &cu_k, &opts)
        .unwrap()
        .out
        .to_f64_vec();
    let dev = Device::Cpu;
    let t = |x: &[f32], s: [usize; 3]| Tensor::from_vec(x.to_vec(), &s, &dev).unwrap();
    let offsets = |c: &[i32]| {
        let c: Vec<u32> = c.iter().map(|&x| x as u32).collect();
        Tensor::new(c.as_slice(), &dev).unwrap()
    };
    let scale = 1.0 / (d as f32).sqrt();
    let out = flash_attn_varlen(
        &t(&data.q, qs),
        &t(&data.k, ks),
        &t(&data.v, ks),
        &offsets(&cu_q),
        &offsets(&cu_k),
        113,
        203,
        scale,
        true,
    )
    .unwrap();
    assert_eq!(out.dims(), qs);
    check_bound(
        "out",
        &to_f64(&out),
        max_err(&naive, &want),
        &want,
        (flashattn::DType::F32, 2.0, 0.0),
        "varlen",
    );
}

//! Bad input comes back as a candle error carrying flashattn's message, never a panic.

use candle_core::{DType, Device, Tensor, Var};
use flashattn_candle::{flash_attn, flash_attn_alibi, flash_attn_varlen, flash_attn_windowed};

fn zeros(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::zeros(shape, dtype, &Device::Cpu).unwrap()
}

/// The error of `r`, which must be one, as a string containing every one of `want`.
fn expect_err(r: candle_core::Result<Tensor>, want: &[&str]) {
    let msg = r.expect_err("bad input was accepted").to_string();
    for w in want {
        assert!(msg.contains(w), "{msg:?} does not mention {w:?}");
    }
}

#[test]
fn shape_mismatches() {
    let q = zeros(&[1, 8, 4, 32], DType::F32);
    // heads 4 over kv heads 3.
    let k = zeros(&[1, 8, 3, 32], DType::F32);
    expect_err(
        flash_attn(&q, &k, &k, 1.0, false),
        &["heads (4)", "heads_kv (3)"],
    );
    // k and v of different lengths.
    let (k, v) = (
        zeros(&[1, 8, 4, 32], DType::F32),
        zeros(&[1, 9, 4, 32], DType::F32),
    );
    expect_err(flash_attn(&q, &k, &v, 1.0, false), &["`v`", "shape"]);
    // head_dim of k differs from q's.
    let k = zeros(&[1, 8, 4, 16], DType::F32);
    expect_err(flash_attn(&q, &k, &k, 1.0, false), &["`k`", "shape"]);
    // Rank 3 without offsets.
    let q3 = zeros(&[8, 4, 32], DType::F32);
    expect_err(flash_attn(&q3, &q3, &q3, 1.0, false), &["`q`", "rank 3"]);
}

#[test]
fn dtypes() {
    let shape = [1, 8, 2, 16];
    let f64s = zeros(&shape, DType::F64);
    expect_err(
        flash_attn(&f64s, &f64s, &f64s, 1.0, false),
        &["q", "F64", "f32, f16 or bf16"],
    );
    let u32s = zeros(&shape, DType::U32);
    expect_err(flash_attn(&u32s, &u32s, &u32s, 1.0, false), &["U32"]);
    // Mixed: q f32, k and v f16.
    let (q, k) = (zeros(&shape, DType::F32), zeros(&shape, DType::F16));
    expect_err(flash_attn(&q, &k, &k, 1.0, false), &["`k`", "dtype"]);
}

#[test]
fn head_dims() {
    let big = zeros(&[1, 4, 1, 300], DType::F32);
    expect_err(
        flash_attn(&big, &big, &big, 1.0, false),
        &["head_dim 300", "1..=256"],
    );
    let empty = zeros(&[1, 4, 1, 0], DType::BF16);
    expect_err(
        flash_attn(&empty, &empty, &empty, 1.0, false),
        &["head_dim 0"],
    );
}

#[test]
fn options() {
    let t = zeros(&[1, 8, 2, 16], DType::F32);
    expect_err(
        flash_attn(&t, &t, &t, f32::INFINITY, false),
        &["softmax_scale"],
    );
    let slopes = zeros(&[3], DType::F32);
    expect_err(
        flash_attn_alibi(&t, &t, &t, &slopes, 1.0, false),
        &["alibi_slopes", "[3]"],
    );
    let opts = flashattn_candle::FlashAttnOptions::default().softcap(-1.0);
    expect_err(
        flashattn_candle::flash_attn_with(&t, &t, &t, &opts),
        &["softcap"],
    );
    // A window is fine at any size.
    assert!(flash_attn_windowed(&t, &t, &t, 1.0, Some(usize::MAX), Some(0)).is_ok());
}

#[test]
fn varlen_offsets() {
    let t = zeros(&[10, 2, 16], DType::F32);
    let dev = Device::Cpu;
    let good = Tensor::new(&[0u32, 4, 10], &dev).unwrap();
    // Past the end of q.
    let long = Tensor::new(&[0u32, 4, 11], &dev).unwrap();
    expect_err(
        flash_attn_varlen(&t, &t, &t, &long, &good, 10, 10, 1.0, false),
        &["cu_seqlens_q"],
    );
    // Not monotonic.
    let down = Tensor::new(&[0u32, 6, 4], &dev).unwrap();
    expect_err(
        flash_attn_varlen(&t, &t, &t, &good, &down, 10, 10, 1.0, false),
        &["cu_seqlens_k"],
    );
    // Float offsets; a 2-d offset tensor; an offset past i32.
    let float = Tensor::new(&[0f32, 4., 10.], &dev).unwrap();
    expect_err(
        flash_attn_varlen(&t, &t, &t, &float, &good, 10, 10, 1.0, false),
        &["seqlens_q", "F32"],
    );
    let square = Tensor::new(&[[0u32, 4], [4, 10]], &dev).unwrap();
    expect_err(
        flash_attn_varlen(&t, &t, &t, &good, &square, 10, 10, 1.0, false),
        &["seqlens_k", "rank-1"],
    );
    let huge = Tensor::new(&[0i64, 1 << 40], &dev).unwrap();
    expect_err(
        flash_attn_varlen(&t, &t, &t, &huge, &good, 10, 10, 1.0, false),
        &["i32 range"],
    );
    assert!(flash_attn_varlen(&t, &t, &t, &good, &good, 6, 6, 1.0, true).is_ok());
}

/// The gradient of a sum or a mean reaches the op's backward broadcast (every stride 0): it is
/// copied, not refused; q, k and v being one tensor sums the three gradients.
#[test]
fn backward_of_a_sum_and_a_mean() {
    let q =
        Var::from_tensor(&Tensor::ones((1, 5, 2, 8), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let out = flash_attn(q.as_tensor(), q.as_tensor(), q.as_tensor(), 0.5, true).unwrap();
    let g = out.mean_all().unwrap().backward().unwrap();
    let dq = g.get(q.as_tensor()).unwrap();
    assert_eq!(dq.dims(), &[1, 5, 2, 8]);
    let total = dq.sum_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(total.is_finite());
}

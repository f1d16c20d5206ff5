//! # flashattn-candle
//!
//! flashattn's attention as a [candle](https://github.com/huggingface/candle) custom op, with
//! candle-flash-attn's function names and signatures, running flashattn's CPU kernels (AVX-512,
//! AVX2, NEON, chosen at run time) forward and backward.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//!
//! let dev = Device::Cpu;
//! let (batch, seqlen, heads, head_dim) = (2, 64, 4, 32);
//! let q = Var::randn(0f32, 1.0, (batch, seqlen, heads, head_dim), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (batch, seqlen, heads, head_dim), &dev)?;
//! let v = Tensor::randn(0f32, 1.0, (batch, seqlen, heads, head_dim), &dev)?;
//!
//! let scale = 1.0 / (head_dim as f32).sqrt();
//! let out = flashattn_candle::flash_attn(&q, &k, &v, scale, true)?; // causal
//! assert_eq!(out.dims(), &[batch, seqlen, heads, head_dim]);
//!
//! let grads = out.sum_all()?.backward()?;                            // flashattn's backward
//! assert_eq!(grads.get(&q).unwrap().dims(), q.dims());
//!
//! // bf16 works the same; so do f16, GQA (fewer k/v heads), windows, ALiBi, softcap, varlen.
//! let [qb, kb, vb] = [q.as_tensor(), &k, &v].map(|t| t.to_dtype(DType::BF16));
//! let out = flashattn_candle::flash_attn(&qb?, &kb?, &vb?, scale, false)?;
//! assert_eq!(out.dtype(), DType::BF16);
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! ## What is supported
//!
//! - Tensors in CPU storage, f32, f16 or bf16 (q, k and v of one dtype), batched
//!   `[batch, seqlen, heads, head_dim]` or packed (`*_varlen`, [`Varlen`]); head_dim 1-256;
//!   seqlen_q ≠ seqlen_k; GQA/MQA (heads a multiple of k/v's heads); causal (bottom-right
//!   aligned), sliding windows, ALiBi, softcap. Any strides: views are read in place, except a
//!   tensor whose last dimension is strided, which is copied first.
//! - The backward: `Tensor::backward` computes dq, dk and dv with flashattn's fused backward,
//!   from the forward's `lse` kept in the op (see [below](#the-backward)).
//! - Not supported: CUDA and Metal tensors (the op returns an error saying so; candle-flash-attn
//!   covers CUDA), dropout, learnable sinks, KV caches (flashattn's own API has them).
//!
//! Errors: a bad shape, dtype, head_dim, window or offset array comes back as a
//! `candle_core::Error` carrying flashattn's message, which names the tensor and the problem;
//! nothing panics.
//!
//! ## The backward
//!
//! The forward keeps its `lse` (one f32 per query row and head) in the op, which candle's graph
//! holds only when the result may be differentiated; the backward then needs no second forward.
//!
//! ## Why no CUDA
//!
//! candle 0.11 and flashattn both use cudarc 0.19, but candle's `cuda` feature builds its own
//! kernels with nvcc, and candle's device owns its context and stream while flashattn's CUDA
//! backend keeps its own: passing candle's device buffers to it would need the two to agree on
//! context, stream and buffer lifetimes, which this crate does not attempt.

mod convert;
mod op;
mod options;

pub use candle_core;
pub use options::{FlashAttnOptions, Varlen};

use candle_core::{Result, Tensor};

/// The end of the error message for tensors that are not in CPU storage.
pub(crate) const UNSUPPORTED_DEVICE: &str =
    "flashattn-candle runs on CPU tensors (f32, f16, bf16): move q, k and v to `Device::Cpu`";

/// Attention with every option: q `[batch, seqlen_q, heads, head_dim]`, k and v `[batch,
/// seqlen_k, heads_kv, head_dim]` (packed `[total, heads, head_dim]` with [`Varlen`]); the result
/// has q's shape and dtype. Differentiable in q, k and v.
pub fn flash_attn_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
) -> Result<Tensor> {
    let (q, k, v) = (
        convert::last_dim_contiguous(q)?,
        convert::last_dim_contiguous(k)?,
        convert::last_dim_contiguous(v)?,
    );
    let op = op::FlashAttnOp::new(options::HostOptions::new(opts)?);
    q.apply_op3(&k, &v, op)
}

/// `softmax(q·kᵀ·softmax_scale)·v`, causal or not (candle-flash-attn's `flash_attn`).
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::default()
        .softmax_scale(softmax_scale)
        .causal(causal);
    flash_attn_with(q, k, v, &opts)
}

/// Sliding-window attention; `None` is unbounded, `(None, Some(0))` is causal.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::default()
        .softmax_scale(softmax_scale)
        .window(window_size_left, window_size_right);
    flash_attn_with(q, k, v, &opts)
}

/// Attention with ALiBi slopes `[heads]` or `[batch, heads]`.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::default()
        .softmax_scale(softmax_scale)
        .causal(causal)
        .alibi_slopes(alibi_slopes);
    flash_attn_with(q, k, v, &opts)
}

/// ALiBi with a sliding window.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::default()
        .softmax_scale(softmax_scale)
        .window(window_size_left, window_size_right)
        .alibi_slopes(alibi_slopes);
    flash_attn_with(q, k, v, &opts)
}

/// Packed sequences (see [`Varlen`]). `max_seqlen_q` and `max_seqlen_k` size CUDA grids in
/// candle-flash-attn; here they are unused (the offsets give the lengths).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::default()
        .softmax_scale(softmax_scale)
        .causal(causal)
        .varlen(seqlens_q, seqlens_k);
    flash_attn_with(q, k, v, &opts)
}

/// Packed sequences with a sliding window.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    _max_seqlen_q: usize,
    _max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::default()
        .softmax_scale(softmax_scale)
        .window(window_size_left, window_size_right)
        .varlen(seqlens_q, seqlens_k);
    flash_attn_with(q, k, v, &opts)
}

//! Validation of the forward and backward calls: batched and packed (varlen) q, k, v into
//! [`Params`] ([`attn`]; the layout is `opts.cu_seqlens`'), and the backward's `out`, `dout` and
//! `lse`.

use super::check::{
    check_cu_seqlens, check_dtype, check_shape, check_view, checked_product, layout_of, seq_table,
};
use super::contract::{Params, RowLayout, Seq, MAX_HEAD_DIM};
use super::options::{
    alibi_distance, check_alibi, check_block_mask, check_no_descale, check_options, check_sink,
    AttnOptions,
};
use crate::block_mask::MaskShape;
use crate::error::{ErrorKind, Result, TensorName};
use crate::tensor::{DType, TensorRef, ViewDesc};

/// Everything a call allocates in proportion to its shapes must be allocatable: out and dq
/// (q's shape), lse, dk and dv (k's shape), and the per-sequence table. f32 is the widest element.
fn check_sizes(
    q_shape: &[usize],
    k_shape: &[usize],
    batch: usize,
    heads: usize,
    rows: usize,
) -> Result<()> {
    checked_product("out", q_shape, 4)?;
    checked_product("k", k_shape, 4)?;
    checked_product("lse", &[rows, heads], 4)?;
    checked_product("q", &[batch], std::mem::size_of::<Seq>())?;
    Ok(())
}

/// Shared checks of q, k, v whatever the layout; returns (heads, heads_kv, head_dim).
fn check_qkv<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    rank: usize,
    layout: &'static str,
) -> Result<(usize, usize, usize)> {
    check_view("q", q, rank, layout)?;
    check_view("k", k, rank, layout)?;
    check_view("v", v, rank, layout)?;
    check_dtype("k", k, q.dtype())?;
    check_dtype("v", v, q.dtype())?;
    let (qs, ks) = (q.shape(), k.shape());
    let head_dim = qs[rank - 1];
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(ErrorKind::HeadDim {
            tensor: "q",
            head_dim,
        }
        .into());
    }
    // k must agree with q on batch (batched layout) and head_dim.
    let mut k_expected = ks.to_vec();
    if rank == 4 {
        k_expected[0] = qs[0];
    }
    k_expected[rank - 1] = head_dim;
    check_shape("k", k, &k_expected)?;
    check_shape("v", v, ks)?;
    let (heads, heads_kv) = (qs[rank - 2], ks[rank - 2]);
    if heads == 0 || heads_kv == 0 || heads % heads_kv != 0 {
        return Err(ErrorKind::HeadsNotMultiple { heads, heads_kv }.into());
    }
    Ok((heads, heads_kv, head_dim))
}

/// Validates a forward or backward call of f32/f16/bf16 inputs: refuses FP8 descale factors,
/// then [`layout`].
pub(crate) fn attn<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    opts: &AttnOptions,
) -> Result<Params> {
    check_no_descale(opts)?;
    layout(q, k, v, opts)
}

/// Validates q, k, v and the options (not `opts.descale`, which the FP8 calls read) in the layout
/// `opts.cu_seqlens` names: packed ([`varlen`]) when given, batched ([`batched`]) otherwise.
pub(crate) fn layout<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    opts: &AttnOptions,
) -> Result<Params> {
    match opts.cu_seqlens {
        Some((cq, ck)) => varlen(q, k, v, cq, ck, opts),
        None => batched(q, k, v, opts),
    }
}

/// Validates a batched call: q `[batch, seqlen_q, heads, d]`, k/v `[batch, seqlen_k, heads_kv, d]`.
pub(crate) fn batched<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    opts: &AttnOptions,
) -> Result<Params> {
    const LAYOUT: &str = "[batch, seqlen, heads, head_dim]";
    const PACKED: bool = false;
    let (heads, heads_kv, head_dim) = check_qkv(q, k, v, 4, LAYOUT)?;
    let (batch, seqlen_q, seqlen_k) = (q.shape()[0], q.shape()[1], k.shape()[1]);
    let o = check_options(opts, head_dim)?;
    let call = MaskShape {
        batch,
        heads,
        seqlen_q,
        seqlen_k,
    };
    check_block_mask(&o, call, PACKED)?;
    let alibi = check_alibi(opts, batch, heads, alibi_distance([(seqlen_q, seqlen_k)]))?;
    let sink = check_sink(opts, heads)?;
    let out_shape = vec![batch, seqlen_q, heads, head_dim];
    check_sizes(
        &out_shape,
        k.shape(),
        batch,
        heads,
        batch.saturating_mul(seqlen_q),
    )?;
    let seqs = seq_table((0..batch).map(|b| Seq {
        seqlen_q,
        seqlen_k,
        q_base: b * q.strides()[0],
        k_base: b * k.strides()[0],
        v_base: b * v.strides()[0],
        out_row0: b * seqlen_q,
        lse_base: b * heads * seqlen_q,
        k_row0: b * seqlen_k,
    }))?;
    Ok(Params {
        dtype: q.dtype(),
        heads,
        heads_kv,
        head_dim,
        seqs,
        q: layout_of(q),
        k: layout_of(k),
        v: layout_of(v),
        total_q: batch * seqlen_q,
        lse_head_stride: seqlen_q,
        out_shape,
        lse_shape: vec![batch, heads, seqlen_q],
        k_shape: k.shape().to_vec(),
        total_k: batch * seqlen_k,
        softmax_scale: o.softmax_scale,
        softcap: o.softcap,
        window_left: o.window_left,
        window_right: o.window_right,
        alibi,
        sink,
        dropout: o.dropout,
        packed: PACKED,
        kernels: o.kernels,
        descale: None,
        mask_mod: o.mask_mod,
        score_fn: o.score_fn,
    })
}

/// Validates a packed call: q `[total_q, heads, d]`, k/v `[total_k, heads_kv, d]`, and the
/// cumulative sequence lengths (batch + 1 entries each).
pub(crate) fn varlen<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<Params> {
    const LAYOUT: &str = "[total_tokens, heads, head_dim]";
    const PACKED: bool = true;
    let (heads, heads_kv, head_dim) = check_qkv(q, k, v, 3, LAYOUT)?;
    check_cu_seqlens(
        "cu_seqlens_q",
        cu_seqlens_q,
        cu_seqlens_q.len().max(1),
        q.shape()[0],
    )?;
    check_cu_seqlens(
        "cu_seqlens_k",
        cu_seqlens_k,
        cu_seqlens_q.len(),
        k.shape()[0],
    )?;
    let batch = cu_seqlens_q.len() - 1;
    let o = check_options(opts, head_dim)?;
    let lens = |cu: &[i32], b: usize| (cu[b + 1] - cu[b]) as usize;
    let longest = |cu: &[i32]| (0..batch).map(|b| lens(cu, b)).max().unwrap_or(0);
    let call = MaskShape {
        batch,
        heads,
        seqlen_q: longest(cu_seqlens_q),
        seqlen_k: longest(cu_seqlens_k),
    };
    check_block_mask(&o, call, PACKED)?;
    let distance =
        alibi_distance((0..batch).map(|b| (lens(cu_seqlens_q, b), lens(cu_seqlens_k, b))));
    let alibi = check_alibi(opts, batch, heads, distance)?;
    let sink = check_sink(opts, heads)?;
    let total_q = q.shape()[0];
    let out_shape = vec![total_q, heads, head_dim];
    check_sizes(&out_shape, k.shape(), batch, heads, total_q)?;
    let (ql, kl, vl) = (layout_of(q), layout_of(k), layout_of(v));
    let seqs = seq_table((0..batch).map(|b| {
        let (q0, k0) = (cu_seqlens_q[b] as usize, cu_seqlens_k[b] as usize);
        Seq {
            seqlen_q: cu_seqlens_q[b + 1] as usize - q0,
            seqlen_k: cu_seqlens_k[b + 1] as usize - k0,
            q_base: q0 * ql.row_stride,
            k_base: k0 * kl.row_stride,
            v_base: k0 * vl.row_stride,
            out_row0: q0,
            lse_base: q0,
            k_row0: k0,
        }
    }))?;
    Ok(Params {
        dtype: q.dtype(),
        heads,
        heads_kv,
        head_dim,
        seqs,
        q: ql,
        k: kl,
        v: vl,
        total_q,
        lse_head_stride: total_q,
        out_shape,
        lse_shape: vec![heads, total_q],
        k_shape: k.shape().to_vec(),
        total_k: k.shape()[0],
        softmax_scale: o.softmax_scale,
        softcap: o.softcap,
        window_left: o.window_left,
        window_right: o.window_right,
        alibi,
        sink,
        dropout: o.dropout,
        packed: PACKED,
        kernels: o.kernels,
        descale: None,
        mask_mod: o.mask_mod,
        score_fn: o.score_fn,
    })
}

/// A tensor laid out like q (`out`, `dout`): its row/head strides and, per sequence, the element
/// offset of row 0, head 0.
#[derive(Clone, Debug)]
pub(crate) struct QLike {
    pub layout: RowLayout,
    pub bases: Vec<usize>,
}

impl QLike {
    /// Element offset of (sequence b, row i, head h, 0).
    #[inline]
    pub fn offset(&self, b: usize, i: usize, h: usize) -> usize {
        self.bases[b] + i * self.layout.row_stride + h * self.layout.head_stride
    }
}

/// Checks a tensor that must have q's shape and dtype (any strides, last dimension contiguous).
pub(crate) fn q_like<V: ViewDesc + ?Sized>(name: TensorName, t: &V, p: &Params) -> Result<QLike> {
    let rank = p.out_shape.len();
    let layout = if p.packed {
        "[total_q, heads, head_dim]"
    } else {
        "[batch, seqlen_q, heads, head_dim]"
    };
    check_view(name, t, rank, layout)?;
    check_dtype(name, t, p.dtype)?;
    check_shape(name, t, &p.out_shape)?;
    let bases = crate::memory::try_collect(
        "the per-sequence table",
        p.seqs.iter().enumerate().map(|(b, s)| {
            if p.packed {
                s.out_row0 * t.strides()[0]
            } else {
                b * t.strides()[0]
            }
        }),
    )?;
    Ok(QLike {
        layout: layout_of(t),
        bases,
    })
}

/// What the backward pass reads besides q, k and v, validated.
#[derive(Clone, Debug)]
pub(crate) struct GradInputs {
    pub out: QLike,
    pub dout: QLike,
    /// The forward's LSE, gathered contiguous in `p.lse_shape` order.
    pub lse: Vec<f32>,
}

/// Validates `out`, `dout` (q's shape and dtype) and `lse` (f32, `p.lse_shape`).
pub(crate) fn grad_inputs(
    p: &Params,
    out: &TensorRef,
    lse: &TensorRef,
    dout: &TensorRef,
) -> Result<GradInputs> {
    let out = q_like("out", out, p)?;
    let dout = q_like("dout", dout, p)?;
    check_lse(p, lse)?;
    let data = lse.typed::<f32>().expect("dtype checked above");
    let st = lse.strides();
    // Sized up front (fallibly): lse's shape, not its buffer, sets the length.
    let mut gathered = crate::memory::try_filled("the gathered `lse`", 0f32, p.lse_len())?;
    let dst = gathered.iter_mut();
    if p.packed {
        let src = (0..p.heads).flat_map(|h| (0..p.total_q).map(move |i| h * st[0] + i * st[1]));
        dst.zip(src).for_each(|(x, at)| *x = data[at]);
    } else {
        let (batch, heads, sq) = (p.lse_shape[0], p.lse_shape[1], p.lse_shape[2]);
        let src = (0..batch).flat_map(|b| {
            (0..heads).flat_map(move |h| (0..sq).map(move |i| b * st[0] + h * st[1] + i * st[2]))
        });
        dst.zip(src).for_each(|(x, at)| *x = data[at]);
    }
    Ok(GradInputs {
        out,
        dout,
        lse: gathered,
    })
}

/// Checks the forward's `lse` handed to a backward call: f32, `p.lse_shape`, any strides.
pub(crate) fn check_lse<V: ViewDesc + ?Sized>(p: &Params, lse: &V) -> Result<()> {
    check_view(
        "lse",
        lse,
        p.lse_shape.len(),
        if p.packed {
            "[heads, total_q]"
        } else {
            "[batch, heads, seqlen_q]"
        },
    )?;
    check_dtype("lse", lse, DType::F32)?;
    check_shape("lse", lse, &p.lse_shape)
}

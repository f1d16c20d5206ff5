//! What the attention calls return ([`AttnOutput`], [`AttnGrads`]) and the caller-provided
//! destinations of their `_into` forms ([`OutBuffers`], [`GradBuffers`]): a low layer the backends
//! write into, below the calls in `lib.rs`.

use crate::tensor::{Element, SliceMut, Tensor, TensorRef};

/// What a forward call returns.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnOutput {
    /// Attention output, q's dtype and shape.
    pub out: Tensor,
    /// Log-sum-exp of each row's scaled scores (natural log), f32: `[batch, heads, seqlen_q]`
    /// (batched) or `[heads, total_q]` (packed). -inf for a row that sees no key.
    pub lse: Tensor,
}

/// What a backward call returns: gradients with the shapes and dtypes of q, k and v.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnGrads {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
    /// Gradient of [`AttnOptions::learnable_sink`], f32 `[heads]`, when the call has sinks.
    pub dsink: Option<Tensor>,
}

/// Caller-provided destinations of a forward call ([`crate::flash_attn_into`]): `out` holds q's shape
/// (`[batch, seqlen_q, heads, head_dim]` or packed `[total_q, heads, head_dim]`) contiguous, in
/// q's dtype; `lse` the shape of [`AttnOutput::lse`]. For embedding in frameworks that allocate
/// their own tensors (the Python package): the kernels write there, no copy.
#[derive(Debug)]
pub struct OutBuffers<'a> {
    pub out: SliceMut<'a>,
    pub lse: &'a mut [f32],
}

/// Caller-provided destinations of a backward call ([`crate::flash_attn_backward_into`]): dq with q's
/// shape, dk and dv with k's, contiguous, in q's dtype; `dsink` (`[heads]`) exactly when the call
/// has a learnable sink.
#[derive(Debug)]
pub struct GradBuffers<'a> {
    pub dq: SliceMut<'a>,
    pub dk: SliceMut<'a>,
    pub dv: SliceMut<'a>,
    pub dsink: Option<&'a mut [f32]>,
}

/// The buffer of a validated tensor (its dtype was checked against `T`).
pub(crate) fn data<'a, T: Element>(t: &TensorRef<'a>) -> &'a [T] {
    t.typed::<T>().expect("dtype validated")
}

"""flash-attn 2.8's Python interface, signature for signature, over flashattn's ops.

Arguments, defaults, shapes, dtypes and return values are flash-attn's. Extras, as keyword
arguments: ``learnable_sink`` (f32 ``[heads]``, gpt-oss style sinks, with their gradient),
``q_descale``/``k_descale``/``v_descale`` for ``torch.float8_e4m3fn``/``float8_e5m2`` inputs
(forward only, bf16 out, as FlashAttention-3: ``[1]`` or ``[batch, heads_kv]``, or 3-D per-block
tables ``[batch, heads or heads_kv, blocks of 128 rows]``, see ``flashattn.fp8``), and f32 inputs
(which flash-attn refuses), and ``block_mask`` (a ``flashattn.BlockMask``, see
``flashattn.block_mask``: a custom mask evaluated once; CPU, not FP8).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import _ops
from .reference import attention_probs

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _scale(softmax_scale: Optional[float], head_dim: int) -> float:
    return head_dim ** (-0.5) if softmax_scale is None else float(softmax_scale)


def _window(window_size: Sequence[int]) -> tuple[int, int]:
    if len(window_size) != 2:
        raise ValueError(f"flashattn: window_size must be (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


_ACCEPTED_DTYPES = frozenset(_ops.FLOAT_DTYPES + _ops.FP8_DTYPES)


def _check_qkv(q, k, v) -> None:
    """`_check_dtypes(q=q, k=k, v=v)`, with a fast path for the common case (plain tensors of
    one accepted dtype) that builds no keyword dict and loops over nothing."""
    d = getattr(q, "dtype", None)
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and d in _ACCEPTED_DTYPES and k.dtype == d and v.dtype == d):
        _check_dtypes(q=q, k=k, v=v)


def _check_dtypes(**tensors: Optional[Tensor]) -> None:
    dtype = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"flashattn: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _ACCEPTED_DTYPES:
            raise TypeError(
                f"flashattn: `{name}` has dtype {t.dtype}; expected float32, float16, bfloat16, "
                "float8_e4m3fn or float8_e5m2"
            )
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"flashattn: `{name}` has dtype {t.dtype}, but q has {dtype}")
        dtype = t.dtype


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    dropout_p: float,
    softmax_scale: Optional[float],
    causal: bool,
    window_size: Sequence[int],
    softcap: float,
    alibi_slopes: Optional[Tensor],
    return_attn_probs: bool,
    learnable_sink: Optional[Tensor],
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    block_mask=None,
):
    _check_qkv(q, k, v)
    scale = _scale(softmax_scale, q.shape[-1])
    left, right = _window(window_size)
    if block_mask is not None:
        if q.dtype in _ops.FP8_DTYPES or q_descale is not None or k_descale is not None \
                or v_descale is not None:
            raise ValueError("flashattn: block_mask does not go with FP8 inputs")
        if return_attn_probs and dropout_p > 0.0:
            raise ValueError("flashattn: return_attn_probs with dropout does not apply block_mask")
        from .block_mask import masked_attention

        out, lse, rng_state = masked_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, float(dropout_p), scale, causal, left, right,
            float(softcap), alibi_slopes, learnable_sink, block_mask,
        )
    elif q.dtype in _ops.FP8_DTYPES:
        if dropout_p != 0.0:
            raise ValueError("flashattn: FP8 inputs take no dropout (forward only)")
        out, lse = _ops.fwd_fp8(
            q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, scale, causal,
            left, right, softcap, alibi_slopes, learnable_sink,
        )
        rng_state = None
    else:
        if q_descale is not None or k_descale is not None or v_descale is not None:
            raise ValueError("flashattn: q_descale/k_descale/v_descale go with FP8 inputs only")
        out, lse, rng_state = _ops.forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, float(dropout_p), scale, causal, left, right,
            float(softcap), alibi_slopes, learnable_sink, return_attn_probs,
        )
    if not return_attn_probs:
        return out
    if dropout_p > 0.0:
        s_dmask = attention_probs(
            q, k, scale=scale, causal=causal, window_size=(left, right), softcap=softcap,
            alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, dropout_p=dropout_p, seed=int(rng_state[0]),
        )
    else:
        # flash-attn returns the probabilities only with dropout (they are for testing).
        s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    return out, lse, s_dmask


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    block_mask=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Attention over q ``[batch, seqlen_q, heads, d]``, k, v ``[batch, seqlen_k, heads_kv, d]``.

    Returns out (q's shape and dtype); with ``return_attn_probs``, ``(out, softmax_lse, S_dmask)``
    with ``softmax_lse`` f32 ``[batch, heads, seqlen_q]``. ``deterministic`` is accepted and always
    true: flashattn's backward is bit-identical for any thread count.
    """
    return _attention(
        q, k, v, None, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs, learnable_sink, q_descale, k_descale, v_descale,
        block_mask=block_mask,
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    block_mask=None,
):
    """q ``[batch, seqlen_q, heads, d]``, kv ``[batch, seqlen_k, 2, heads_kv, d]`` (views, no copy)."""
    return _attention(
        q, kv[:, :, 0], kv[:, :, 1], None, None, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, return_attn_probs, learnable_sink, None, None, None,
        block_mask=block_mask,
    )


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    block_mask=None,
):
    """qkv ``[batch, seqlen, 3, heads, d]`` (views, no copy)."""
    return _attention(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None, None, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, return_attn_probs, learnable_sink, None, None, None,
        block_mask=block_mask,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    learnable_sink=None,
    block_mask=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Packed sequences: q ``[total_q, heads, d]``, k, v ``[total_k, heads_kv, d]``, int32
    ``cu_seqlens_q``/``cu_seqlens_k`` ``[batch + 1]``; ``softmax_lse`` is ``[heads, total_q]``.

    With ``block_table`` (``[batch, max_blocks]``), k and v are paged caches ``[num_blocks,
    page_size, heads_kv, d]`` and sequence b reads its first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]``
    keys through its pages (forward only, as in flash-attn).
    """
    if block_table is not None:
        if block_mask is not None:
            raise ValueError("flashattn: block_table (paged k/v) takes no block_mask")
        if dropout_p != 0.0 or return_attn_probs:
            raise ValueError("flashattn: block_table takes no dropout and no return_attn_probs")
        cache_seqlens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        left, right = _window(window_size)
        out, _ = _ops.kvcache(
            q, k, v, cache_seqlens, None, None, None, None, None, None, block_table,
            cu_seqlens_q, None, None, None, _scale(softmax_scale, q.shape[-1]), causal, left,
            right, float(softcap), True, alibi_slopes, learnable_sink, 0, False,
        )
        return out
    return _attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, return_attn_probs, learnable_sink, q_descale, k_descale, v_descale,
        block_mask=block_mask,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    block_mask=None,
):
    """q ``[total_q, heads, d]``, kv ``[total_k, 2, heads_kv, d]`` (views, no copy)."""
    return _attention(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, return_attn_probs, learnable_sink, None, None, None,
        block_mask=block_mask,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    block_mask=None,
):
    """qkv ``[total, 3, heads, d]`` (views, no copy); one ``cu_seqlens`` for q and k."""
    return _attention(
        qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, return_attn_probs, learnable_sink, None, None, None,
        block_mask=block_mask,
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    learnable_sink=None,
    k_descale=None,
    v_descale=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
):
    """Decoding over KV caches, as flash-attn's: k and v (if given) are written into the caches
    in place at ``cache_seqlens`` (rotated with ``rotary_cos``/``rotary_sin``) before attending;
    ``cache_seqlens`` itself is not updated. FP8 caches (``float8_e4m3fn``/``float8_e5m2``) take
    ``k_descale``/``v_descale``; ``cu_seqlens_q``/``cu_seqlens_k_new`` pack queries and new keys
    of different lengths (flash-attn 3's chunked prefill). Inference only: no gradient.
    """
    _check_qkv(q, k, v)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flashattn: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    batch = (cu_seqlens_q.numel() - 1) if cu_seqlens_q is not None else q.shape[0]
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), k_cache.shape[1] if block_table is None else 0,
                                   dtype=torch.int32)
        if block_table is not None:
            raise ValueError("flashattn: cache_seqlens is required with block_table")
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    left, right = _window(window_size)
    out, lse = _ops.kvcache(
        q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, cache_batch_idx,
        cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k_new, k_descale, v_descale,
        _scale(softmax_scale, q.shape[-1]), bool(causal), left, right, float(softcap),
        bool(rotary_interleaved), alibi_slopes, learnable_sink, int(num_splits),
        return_softmax_lse,
    )
    return (out, lse) if return_softmax_lse else out

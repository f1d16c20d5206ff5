"""flash-attn's ``flash_attn.flash_attn_interface`` over flashattn: the public functions and the
low-level pairs that ring-attention and training libraries call directly.

``_flash_attn_forward`` returns ``(out, softmax_lse, S_dmask, rng_state)``;
``_flash_attn_backward`` writes dq, dk, dv into the given buffers (or allocates them) and returns
``softmax_d`` (``rowsum(dout ∘ out)``, ``[batch, heads, round128(seqlen_q)]``).
"""

from __future__ import annotations

import torch

from flashattn import _ops
from flashattn.interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flashattn.reference import attention_probs

__flashattn_compat__ = True


def _round128(n: int) -> int:
    return -(-n // 128) * 128


def _probs(q, k, return_softmax, dropout_p, softmax_scale, causal, wl, wr, softcap, alibi,
           rng_state, cu_q=None, cu_k=None):
    if not (return_softmax and dropout_p > 0.0):
        return torch.empty((0,), dtype=q.dtype, device=q.device)
    return attention_probs(
        q, k, scale=softmax_scale, causal=causal, window_size=(wl, wr), softcap=softcap,
        alibi_slopes=alibi, learnable_sink=None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        dropout_p=dropout_p, seed=int(rng_state[0]),
    )


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                        window_size_right=-1, softcap=0.0, alibi_slopes=None,
                        return_softmax=False):
    out, lse, rng_state = _ops.fwd(
        q, k, v, None, None, float(dropout_p), float(softmax_scale), bool(causal),
        int(window_size_left), int(window_size_right), float(softcap), alibi_slopes, None,
    )
    s = _probs(q, k, return_softmax, dropout_p, softmax_scale, causal, window_size_left,
               window_size_right, softcap, alibi_slopes, rng_state)
    return out, lse, s, rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None):
    if block_table is not None or leftpad_k is not None or seqused_k is not None:
        raise NotImplementedError(
            "flashattn: _flash_attn_varlen_forward with block_table, leftpad_k or seqused_k; "
            "use flash_attn_with_kvcache (block_table, cache_leftpad) instead"
        )
    out, lse, rng_state = _ops.fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, float(dropout_p), float(softmax_scale),
        bool(causal), int(window_size_left), int(window_size_right), float(softcap),
        alibi_slopes, None,
    )
    s = _probs(q, k, return_softmax, dropout_p, softmax_scale, causal, window_size_left,
               window_size_right, softcap, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k)
    return out, lse, s, rng_state


def _store(dst, src):
    if dst is None:
        return src
    dst.copy_(src)
    return dst


def _softmax_d(dout, out, packed):
    d = (dout.float() * out.float()).sum(-1)  # [b, sq, h] or [total, h]
    if packed:
        d = d.transpose(0, 1)
        return torch.nn.functional.pad(d, (0, 0))
    d = d.transpose(1, 2)
    return torch.nn.functional.pad(d, (0, _round128(d.shape[-1]) - d.shape[-1]))


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         alibi_slopes=None, deterministic=False, rng_state=None):
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64)
    gq, gk, gv, _ = _ops.bwd(
        dout, q, k, v, out, softmax_lse, None, None, float(dropout_p), float(softmax_scale),
        bool(causal), int(window_size_left), int(window_size_right), float(softcap),
        alibi_slopes, None, rng_state,
    )
    _store(dq, gq), _store(dk, gk), _store(dv, gv)
    return _softmax_d(dout, out, packed=False)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                                softcap=0.0, alibi_slopes=None, deterministic=False,
                                rng_state=None):
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64)
    gq, gk, gv, _ = _ops.bwd(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, float(dropout_p),
        float(softmax_scale), bool(causal), int(window_size_left), int(window_size_right),
        float(softcap), alibi_slopes, None, rng_state,
    )
    _store(dq, gq), _store(dk, gk), _store(dv, gv)
    return _softmax_d(dout, out, packed=True)

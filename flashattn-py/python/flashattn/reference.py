"""Naive attention in PyTorch, straight from the definitions: the tests' oracle (run in float64)
and the source of ``S_dmask`` for ``return_attn_probs``.

It builds each sequence's full score matrix, so it is O(seqlen_q · seqlen_k) in memory: for
checking, not for use. Semantics (flash-attn 2's): scores ``q·kᵀ·scale``, then softcap
``c·tanh(s/c)``, then ALiBi ``-slope·|i + sk - sq - j|``, then the masks (query i sees key j iff
``i + sk - sq - left <= j <= i + sk - sq + right``; causal is ``right = 0``), a softmax whose
normaliser also holds ``exp(sink)`` with a learnable sink, dropout (kept probabilities scaled by
``1/(1-p)``), and ``P·v``. A row that sees no key has out 0 and lse -inf (the sink's value with one).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def _bias_and_mask(sq, sk, causal, window_size, alibi_row, device, dtype):
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    diag = i + sk - sq  # the key aligned with query i
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    bias = None
    if alibi_row is not None:
        # alibi_row: [heads] slopes of this sequence.
        bias = -alibi_row.to(dtype).view(-1, 1, 1) * (diag - j).abs().to(dtype)
    return visible, bias


def _one_sequence(q, k, v, scale, causal, window_size, softcap, alibi_row, sink, keep, dropout_p,
                  dtype, user_mask=None):
    """q [sq, h, d], k/v [sk, hk, d] -> out [sq, h, d], lse [h, sq], probs [h, sq, sk];
    ``user_mask``: bool [h or 1, sq, sk], True where the query may see the key."""
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    g = h // hk
    qh = q.to(dtype).transpose(0, 1)  # [h, sq, d]
    kh = k.to(dtype).transpose(0, 1).repeat_interleave(g, dim=0)
    vh = v.to(dtype).transpose(0, 1).repeat_interleave(g, dim=0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible, bias = _bias_and_mask(sq, sk, causal, window_size, alibi_row, q.device, dtype)
    if user_mask is not None:
        visible = visible & user_mask.to(device=q.device, dtype=torch.bool)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~visible, float("-inf"))
    if sink is not None:
        sink_col = sink.to(dtype).view(h, 1, 1).expand(h, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe.unsqueeze(-1))
    p = torch.where(visible, p, torch.zeros_like(p))
    pd = p
    if dropout_p > 0.0:
        pd = torch.where(keep, p / (1.0 - dropout_p), torch.zeros_like(p))
    out = torch.matmul(pd, vh).transpose(0, 1)
    return out, lse, p


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    return_probs: bool = False,
    attn_mask: Optional[Tensor] = None,
):
    """Naive attention in ``dtype``; returns ``(out, lse)`` (and the probabilities, a list per
    sequence of ``[heads, sq, sk]``, with ``return_probs``). Layouts as flashattn's.
    ``attn_mask``: bool ``[batch or 1, heads or 1, Q_LEN, KV_LEN]``, True where a query sees a
    key (ANDed with the other masks); sequence b reads ``attn_mask[b, :, :sq, :sk]``."""
    from ._ops import dropout_keep_mask

    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens_q is None:
        seqs = [(q[b], k[b], v[b], b) for b in range(q.shape[0])]
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        seqs = [(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], b)
                for b in range(len(cq) - 1)]
    outs, lses, probs = [], [], []
    for qs, ks, vs, b in seqs:
        alibi_row = None
        if alibi_slopes is not None:
            alibi_row = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        keep = None
        if dropout_p > 0.0:
            h = qs.shape[1]
            keep = dropout_keep_mask(seed, dropout_p, b + 1, h, qs.shape[0], ks.shape[0])[b]
        user = None
        if attn_mask is not None:
            user = attn_mask[b if attn_mask.shape[0] > 1 else 0, :, :qs.shape[0], :ks.shape[0]]
        o, lse, p = _one_sequence(qs, ks, vs, scale, causal, window_size, softcap, alibi_row,
                                  learnable_sink, keep, dropout_p, dtype, user)
        outs.append(o)
        lses.append(lse)
        if return_probs:
            probs.append(p if keep is None else torch.where(keep, p, -p))
    if cu_seqlens_q is None:
        out, lse = torch.stack(outs), torch.stack(lses)
    else:
        out = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=dtype)
        lse = torch.cat(lses, dim=1) if lses else q.new_zeros((q.shape[1], 0), dtype=dtype)
        if out.shape[0] < q.shape[0]:  # rows after the last sequence: out 0, lse -inf
            pad = q.shape[0] - out.shape[0]
            out = torch.cat([out, out.new_zeros((pad,) + tuple(out.shape[1:]))])
            lse = torch.cat([lse, lse.new_full((lse.shape[0], pad), float("-inf"))], dim=1)
    return (out, lse, probs) if return_probs else (out, lse)


def attention_probs(q, k, *, scale, causal, window_size, softcap, alibi_slopes, learnable_sink,
                    cu_seqlens_q, cu_seqlens_k, dropout_p, seed) -> Tensor:
    """flash-attn's ``S_dmask``: the attention probabilities ``[batch, heads, sq_rounded,
    sk_rounded]`` (rounded up to multiples of 128, zero-padded) in q's dtype, negated where
    dropout dropped them."""
    v = k.new_zeros(k.shape)
    _, _, probs = attention_ref(
        q.detach(), k.detach(), v, scale=scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, dropout_p=dropout_p, seed=seed,
        dtype=torch.float32, return_probs=True,
    )
    sq = max((p.shape[1] for p in probs), default=0)
    sk = max((p.shape[2] for p in probs), default=0)
    rq, rk = -(-sq // 128) * 128, -(-sk // 128) * 128
    heads = q.shape[-2]
    s = torch.zeros((len(probs), heads, rq, rk), dtype=q.dtype, device=q.device)
    for b, p in enumerate(probs):
        s[b, :, : p.shape[1], : p.shape[2]] = p.to(q.dtype)
    return s

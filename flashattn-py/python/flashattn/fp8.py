"""FP8 quantisation of q, k, v for ``flash_attn_func``'s FP8 path, with FlashAttention-3's
incoherent processing as an option (the Rust library's ``flashattn::fp8::quantize_qkv``).

    from flashattn import flash_attn_func
    from flashattn.fp8 import quantize_qkv
    q8, k8, v8, qs, ks, vs = quantize_qkv(q, k, v, incoherent=True, seed=0)
    out = flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)

Each tensor is divided by its descale factor, ``amax / finfo(fp8_dtype).max`` over the values the
factor covers, and rounded to the format (saturating). The factors are one per (batch row, kv
head), ``[batch, heads_kv]`` (q's heads share their kv head's; ``granularity="head"``, the
default), one per tensor, ``[1]`` (``"tensor"``), or, as FlashAttention-3's block quantisation,
one per block of 128 rows of each (batch row, head): ``[batch, heads, ceil(seqlen_q / 128)]`` for
q and ``[batch, heads_kv, ceil(seqlen_k / 128)]`` for k and v (``"block"``); the FP8 forward
takes each (3-D tables mean per block).

Incoherent processing multiplies q and k along head_dim by ``M = D·H/√d`` (``H`` the
Walsh-Hadamard matrix, head_dim a power of two; ``D`` a diagonal of random signs from ``seed``):
``M`` is orthogonal, so ``q·kᵀ`` and the attention are unchanged while outliers are spread over
the row before rounding. Sign ``i`` is the top bit of SplitMix64 of ``seed + i`` (set: -1), the
same signs as the Rust library draws. Computed in float64.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["hadamard_signs", "incoherent_transform", "quantize_qkv"]

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def hadamard_signs(head_dim: int, seed: int = 0) -> Tensor:
    """The diagonal of ``D``: float64 ±1, ``head_dim`` values."""
    return torch.tensor(
        [-1.0 if _splitmix64((seed + i) & _MASK) >> 63 else 1.0 for i in range(head_dim)],
        dtype=torch.float64,
    )


def _walsh_hadamard(x: Tensor) -> Tensor:
    """``x·H`` along the last dimension (unnormalised, Sylvester's order)."""
    d = x.shape[-1]
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    return y.reshape(shape)


def incoherent_transform(x: Tensor, seed: int = 0) -> Tensor:
    """``x·D·H/√d`` along the last dimension, in float64 (head_dim a power of two)."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(
            f"flashattn: incoherent processing needs head_dim to be a power of two, got {d}")
    signs = hadamard_signs(d, seed).to(x.device)
    return _walsh_hadamard(x.double() * signs) / (d ** 0.5)


_BLOCK = 128  # rows per factor with granularity="block" (flashattn::fp8::DESCALE_BLOCK)


def _quantize_blocks(x: Tensor, fmt) -> Tuple[Tensor, Tensor]:
    """One factor per 128 rows of each (batch row, head): ``[b, h, ceil(s / 128)]``."""
    b, s, h, d = x.shape
    fmax = torch.finfo(fmt).max
    nb = -(-s // _BLOCK)
    pad = nb * _BLOCK - s
    xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).reshape(b, nb, _BLOCK, h, d)
    a = xp.abs().masked_fill(~torch.isfinite(xp), 0.0)
    amax = a.amax(dim=(2, 4)).permute(0, 2, 1)  # [b, h, nb]
    descale = (amax / fmax).float().clamp_min(torch.finfo(torch.float32).tiny)
    descale = torch.where(amax > 0, descale, torch.ones_like(descale)).contiguous()
    scaled = xp / descale.double().permute(0, 2, 1).reshape(b, nb, 1, h, 1)
    xq = scaled.clamp(-fmax, fmax).to(fmt).reshape(b, nb * _BLOCK, h, d)[:, :s]
    return xq.contiguous(), descale


def _quantize(x: Tensor, heads_kv: int, per_head: bool, fmt) -> Tuple[Tensor, Tensor]:
    b, s, h, d = x.shape
    fmax = torch.finfo(fmt).max
    a = x.abs().masked_fill(~torch.isfinite(x), 0.0)
    if per_head:
        amax = a.reshape(b, s, heads_kv, h // heads_kv, d).amax(dim=(1, 3, 4))  # [b, heads_kv]
    else:
        amax = a.amax().reshape(1)
    descale = (amax / fmax).float().clamp_min(torch.finfo(torch.float32).tiny)
    descale = torch.where(amax > 0, descale, torch.ones_like(descale))
    if per_head:
        shape = (b, 1, heads_kv, 1, 1)
        scaled = x.reshape(b, s, heads_kv, h // heads_kv, d) / descale.double().view(shape)
    else:
        scaled = x / descale.double()
    xq = scaled.clamp(-fmax, fmax).to(fmt).reshape(b, s, h, d)
    return xq, descale


def quantize_qkv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    incoherent: bool = False,
    seed: int = 0,
    per_head: bool = True,
    fp8_dtype=None,
    granularity: Optional[str] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q ``[batch, seqlen_q, heads, head_dim]``, k and v ``[batch, seqlen_k, heads_kv,
    head_dim]`` (float32, float16 or bfloat16) -> ``(q8, k8, v8, q_descale, k_descale,
    v_descale)``: FP8 tensors (``fp8_dtype``, default ``torch.float8_e4m3fn``) and float32 factors
    (``[batch, heads_kv]``, or ``[1]`` with ``per_head=False`` or ``granularity="tensor"``, or
    the per-block tables with ``granularity="block"``) for ``flash_attn_func``. With
    ``incoherent=True``, q and k are transformed first (see the module documentation)."""
    fmt = torch.float8_e4m3fn if fp8_dtype is None else fp8_dtype
    if granularity is None:
        granularity = "head" if per_head else "tensor"
    if granularity not in ("tensor", "head", "block"):
        raise ValueError(
            f"flashattn: granularity must be 'tensor', 'head' or 'block', got {granularity!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flashattn: {name} must be [batch, seqlen, heads, head_dim]")
    heads, heads_kv = q.shape[2], k.shape[2]
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"flashattn: heads ({heads}) must be a multiple of heads_kv ({heads_kv})")
    qd, kd, vd = q.double(), k.double(), v.double()
    if incoherent:
        qd, kd = incoherent_transform(qd, seed), incoherent_transform(kd, seed)
    if granularity == "block":
        (q8, qs), (k8, ks), (v8, vs) = (_quantize_blocks(t, fmt) for t in (qd, kd, vd))
        return q8, k8, v8, qs, ks, vs
    per_head = granularity == "head"
    q8, qs = _quantize(qd, heads_kv, per_head, fmt)
    k8, ks = _quantize(kd, heads_kv, per_head, fmt)
    v8, vs = _quantize(vd, heads_kv, per_head, fmt)
    return q8, k8, v8, qs, ks, vs

"""flash-attn's ``flash_attn.layers.rotary.apply_rotary_emb`` in plain torch (differentiable)."""

from __future__ import annotations

from typing import Optional, Union

import torch

__flashattn_compat__ = True


def _rotate(x, cos, sin, interleaved):
    # x [..., rotary_dim]; cos/sin broadcast to [..., rotary_dim / 2]
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        r0, r1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        return torch.stack((r0, r1), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


def apply_rotary_emb(x, cos, sin, interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None):
    """x ``[batch, seqlen, heads, d]`` (or packed ``[total, heads, d]`` with ``cu_seqlens``);
    cos, sin ``[seqlen_ro, rotary_dim / 2]``. Rotates the first ``rotary_dim`` dims of each head
    at position ``seqlen_offsets + t`` (GPT-NeoX halves, or GPT-J pairs with ``interleaved``);
    computed in f32, returned in x's dtype."""
    rd = cos.shape[-1] * 2
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        pos = torch.cat([torch.arange(cu[b + 1] - cu[b]) + (
            seqlen_offsets if isinstance(seqlen_offsets, int) else int(seqlen_offsets[b]))
            for b in range(len(cu) - 1)]) if len(cu) > 1 else torch.zeros(0, dtype=torch.long)
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # [total, 1, rd/2]
    else:
        t = torch.arange(x.shape[1], device=x.device)
        if isinstance(seqlen_offsets, int):
            pos = (t + seqlen_offsets).unsqueeze(0).expand(x.shape[0], -1)
        else:
            pos = t.unsqueeze(0) + seqlen_offsets.to(x.device).long().unsqueeze(1)
        c, s = cos[pos].unsqueeze(2), sin[pos].unsqueeze(2)  # [b, s, 1, rd/2]
    rotated = _rotate(x[..., :rd].float(), c.float(), s.float(), interleaved).to(x.dtype)
    if inplace:
        x[..., :rd] = rotated
        return x
    return torch.cat((rotated, x[..., rd:]), dim=-1)

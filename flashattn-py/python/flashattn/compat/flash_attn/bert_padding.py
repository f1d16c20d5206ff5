"""flash-attn's ``flash_attn.bert_padding``: moving between padded ``[batch, seqlen, ...]``
batches and packed ``[total_tokens, ...]`` ones (flashattn's own implementation, plain torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__flashattn_compat__ = True


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along the first axis (differentiable)."""
    return x.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int):
    """A zero tensor of ``first_axis_dim`` rows with ``values`` placed at ``indices``."""
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_copy(0, indices, values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states ``[batch, seqlen, ...]``, attention_mask ``[batch, seqlen]`` (1 = token).

    Returns ``(hidden_states [total, ...], indices, cu_seqlens int32 [batch + 1],
    max_seqlen_in_batch, seqused int32 [batch])``; with ``unused_mask``, tokens it marks are
    packed too (counted in cu_seqlens) but not in ``seqused``."""
    all_masks = attention_mask if unused_mask is None else (attention_mask + unused_mask)
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return (index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch,
            used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of :func:`unpad_input`: ``[total, ...]`` back to ``[batch, seqlen, ...]``."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view((batch, seqlen) + tuple(hidden_states.shape[1:]))

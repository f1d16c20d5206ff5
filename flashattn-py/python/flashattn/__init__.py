"""flashattn: exact FlashAttention in Rust, as PyTorch ops with flash-attn 2.8's interface.

    from flashattn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)   # q [batch, seqlen, heads, head_dim]

Every entry point is a ``torch.library`` custom op (``torch.ops.flashattn.*``) with a fake
implementation and an autograd formula, so ``loss.backward()`` and ``torch.compile`` work.
CPU tensors (f32, f16, bf16, FP8); see the README for what is not covered yet.
"""

from ._flashattn import MAX_HEAD_DIM, FlashAttnError, isa
from .block_mask import BLOCK_SIZE, BlockMask, create_block_mask
from .flex import ScoreModError, flex_attention, trace_score_mod
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "BLOCK_SIZE",
    "BlockMask",
    "FlashAttnError",
    "MAX_HEAD_DIM",
    "ScoreModError",
    "create_block_mask",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flex_attention",
    "isa",
    "trace_score_mod",
]

"""Custom masks evaluated once: ``create_block_mask`` (FlexAttention's), ``BlockMask.from_dense``
(SDPA's boolean ``attn_mask``); ``flex_attention`` (``flashattn.flex``) takes them too.

    from flashattn import create_block_mask, flash_attn_func, flex_attention

    def sliding_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

    bm = create_block_mask(sliding_causal, None, None, 4096, 4096)
    out = flash_attn_func(q, k, v, block_mask=bm)      # q [batch, seqlen, heads, d]
    out = flex_attention(qt, kt, vt, block_mask=bm)    # qt [batch, heads, seqlen, d]

The mask is evaluated once, in chunks of rows (memory bounded by ``chunk_elems`` booleans at a
time), into a summary per block of ``BLOCK_SIZE`` x ``BLOCK_SIZE`` pairs (none, all or some shown)
plus the bits of the partial blocks; every later call (forward and backward) reads those instead
of evaluating anything. Query ``q_idx`` sees key ``kv_idx`` iff the mask and the call's ``causal``
and ``window_size`` all allow it; a query that sees no key gets out 0 and lse -inf (and zero
gradients). CPU tensors only. The calls are the ops ``flashattn::fwd_masked`` / ``bwd_masked``,
with the mask as two tensor arguments, so ``torch.compile(fullgraph=True)`` traces them.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
from torch import Tensor

from . import _flashattn as _ext
from . import _ops
from ._flashattn import BLOCK_SIZE, FlashAttnError

__all__ = ["BLOCK_SIZE", "BlockMask", "create_block_mask"]

# Booleans evaluated per chunk by default: 16 Mi (16 MiB of mask, some times that in the mask
# function's temporaries).
_CHUNK_ELEMS = 1 << 24


def _dim(name: str, x, broadcast: bool) -> int:
    if x is None and broadcast:
        return 1
    try:
        n = None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        n = None
    if n is None or n < (1 if broadcast else 0):
        what = "a positive int or None" if broadcast else "an int >= 0"
        raise ValueError(f"flashattn: {name} must be {what}, got {x!r}")
    return n


def _from_bytes(data: bytes, dtype: torch.dtype) -> Tensor:
    """A 1-D tensor of `data`'s little-endian values (frombuffer refuses an empty buffer)."""
    if not data:
        return torch.empty((0,), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)


class BlockMask:
    """A mask evaluated once for ``(B, H, Q_LEN, KV_LEN)``; ``B`` or ``H`` 1 (``None`` when
    made) means the same mask for every sequence or query head. Pass it as ``block_mask=`` to
    the attention functions: its batch and heads must be the call's or 1, its lengths the call's
    (for the varlen functions: at least every sequence's; sequence ``b`` reads rows and keys
    from 0 of ``b``'s mask)."""

    def __init__(self, ext):
        # The mask is these two tensors, held once: every call reads them in place (the ops'
        # arguments; plain attributes, which torch.compile reads as graph inputs). The kind of
        # every block (int32 [B, H, m_blocks, n_blocks]: -1 none shown, -2 all, p >= 0 partial
        # block p) and the partial blocks' row words (int64 [partials, BLOCK_SIZE]).
        self._shape = tuple(ext.shape)
        b, h, sq, sk = self._shape
        kinds, bits = ext.parts()
        blocks = (b, h, -(-sq // BLOCK_SIZE), -(-sk // BLOCK_SIZE))
        self._kinds = _from_bytes(kinds, torch.int32).view(blocks)
        bits = _from_bytes(bits, torch.int64).view(-1, BLOCK_SIZE)
        # Masks of one shape differ in their number of partial blocks: that size is dynamic
        # from the start, and at least 2 (zero rows past the last partial block, which no kind
        # names), since torch.compile specialises sizes 0 and 1. So a compiled call takes any
        # mask of its shape without recompiling.
        if len(bits) < 2:
            bits = torch.cat([bits, bits.new_zeros(2 - len(bits), BLOCK_SIZE)])
        self._bits = bits
        torch._dynamo.maybe_mark_dynamic(self._bits, 0)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Q_LEN, KV_LEN)``."""
        return self._shape

    def block_counts(self) -> tuple[int, int, int]:
        """Blocks with no pair shown, with every pair shown, and partial ones."""
        empty = int((self._kinds == -1).sum())
        full = int((self._kinds == -2).sum())
        return (empty, full, self._kinds.numel() - empty - full)

    def sparsity(self) -> float:
        """The fraction of blocks with no pair shown (those the kernels skip), in [0, 1]."""
        empty, full, partial = self.block_counts()
        total = empty + full + partial
        return empty / total if total else 0.0

    def nbytes(self) -> int:
        """Bytes held: the block kinds and the partial blocks' bits."""
        return self._kinds.nbytes + self._bits.nbytes

    def to_dense(self) -> Tensor:
        """The mask as bool ``[B, H, Q_LEN, KV_LEN]`` (for checking; O(Q_LEN · KV_LEN))."""
        out = torch.empty(self.shape, dtype=torch.bool)
        mask = _ops._MaskArg(self._kinds, self._bits, self._shape[2], self._shape[3])
        mask._ext.write_dense(_ops._view("out", out))
        return out

    def __repr__(self) -> str:
        b, h, sq, sk = self.shape
        empty, full, partial = self.block_counts()
        return (f"BlockMask(shape=({b}, {h}, {sq}, {sk}), BLOCK_SIZE={BLOCK_SIZE}, "
                f"empty={empty}, full={full}, partial={partial})")

    @classmethod
    def from_dense(cls, mask: Tensor) -> "BlockMask":
        """From a boolean mask as SDPA's ``attn_mask`` (True: the query sees the key):
        ``[Q_LEN, KV_LEN]``, ``[H, Q_LEN, KV_LEN]`` or ``[B, H, Q_LEN, KV_LEN]``, B and H
        possibly 1 (shared)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError("flashattn: BlockMask.from_dense takes a torch.bool tensor, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if not 2 <= mask.dim() <= 4:
            raise ValueError("flashattn: a dense mask is [Q_LEN, KV_LEN], [H, Q_LEN, KV_LEN] or "
                             f"[B, H, Q_LEN, KV_LEN], got shape {tuple(mask.shape)}")
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        b, h, sq, sk = mask.shape
        builder = _ext.BlockMaskBuilder(b, h, sq, sk)
        rows = _rows_per_chunk(1, sk, _CHUNK_ELEMS)
        for bi in range(b):
            for hi in range(h):
                for q0 in range(0, sq, rows):
                    chunk = mask[bi, hi, q0:q0 + rows].detach().to("cpu").contiguous()
                    builder.rows(bi, hi, q0, _ops._view("block_mask", chunk))
        return cls(builder.finish())


def _rows_per_chunk(heads: int, kv_len: int, chunk_elems: int) -> int:
    """Query rows per evaluation: whole blocks, at least one."""
    rows = chunk_elems // max(1, heads * kv_len)
    return max(BLOCK_SIZE, rows // BLOCK_SIZE * BLOCK_SIZE)


def create_block_mask(
    mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device="cpu",
    *,
    chunk_elems: int = _CHUNK_ELEMS,
) -> BlockMask:
    """Evaluates ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` once, as FlexAttention's
    ``create_block_mask``. ``B``/``H`` None: one mask for every sequence/head (``b``/``h`` is
    then 0).

    ``mask_mod`` is called with int64 index tensors that broadcast against each other: ``b`` a
    0-d tensor, ``h`` of shape ``[heads, 1, 1]``, ``q_idx`` ``[rows, 1]`` and ``kv_idx``
    ``[KV_LEN]``, on ``device``; it must return a bool tensor that broadcasts to
    ``[heads, rows, KV_LEN]`` (elementwise torch code does: comparisons, ``&``, ``|``, indexing
    a tensor of document ids with ``q_idx``). Chunks hold at most about ``chunk_elems`` pairs
    (whole blocks of ``BLOCK_SIZE`` rows, at least one block of one head)."""
    if not callable(mask_mod):
        raise TypeError(f"flashattn: mask_mod must be callable, got {type(mask_mod).__name__}")
    b_n, h_n = _dim("B", B, True), _dim("H", H, True)
    sq, sk = _dim("Q_LEN", Q_LEN, False), _dim("KV_LEN", KV_LEN, False)
    if not isinstance(chunk_elems, int) or chunk_elems < 1:
        raise ValueError(f"flashattn: chunk_elems must be a positive int, got {chunk_elems!r}")
    builder = _ext.BlockMaskBuilder(b_n, h_n, sq, sk)
    # All heads at once when a block of rows of every head fits the chunk, else one at a time.
    hc = h_n if h_n * BLOCK_SIZE * sk <= chunk_elems else 1
    rows = _rows_per_chunk(hc, sk, chunk_elems)
    idx = dict(dtype=torch.int64, device=device)
    kv_idx = torch.arange(sk, **idx)
    for bi in range(b_n):
        b_t = torch.tensor(bi, **idx)
        for h0 in range(0, h_n, hc):
            hs = torch.arange(h0, min(h0 + hc, h_n), **idx)
            for q0 in range(0, sq, rows):
                q_idx = torch.arange(q0, min(q0 + rows, sq), **idx)
                want = (len(hs), len(q_idx), sk)
                got = mask_mod(b_t, hs.view(-1, 1, 1), q_idx.view(-1, 1), kv_idx)
                got = torch.as_tensor(got)
                if got.dtype != torch.bool:
                    raise TypeError(f"flashattn: mask_mod must return a bool tensor, got {got.dtype}")
                try:
                    got = got.broadcast_to(want)
                except RuntimeError as e:
                    raise ValueError(
                        f"flashattn: mask_mod returned shape {tuple(got.shape)}, which does not "
                        f"broadcast to [heads, rows, KV_LEN] = {list(want)}") from e
                got = got.to("cpu").contiguous()
                for j in range(len(hs)):
                    builder.rows(bi, h0 + j, q0, _ops._view("block_mask", got[j]))
    return BlockMask(builder.finish())


def check_block_mask(block_mask, **tensors: Optional[Tensor]) -> None:
    """Refuses what is not a BlockMask, and tensors off the CPU (the CUDA backend takes no mask)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError("flashattn: block_mask must be a flashattn.BlockMask (create_block_mask, "
                        f"BlockMask.from_dense), got {type(block_mask).__name__}")
    for name, t in tensors.items():
        if t is not None and t.device.type != "cpu":
            raise FlashAttnError(
                f"block_mask is supported on CPU tensors only; `{name}` is on {t.device}",
                "MaskModUnsupported")


def masked_attention(q, k, v, cu_q, cu_k, dropout_p, scale, causal, wl, wr, softcap, alibi,
                     sink, block_mask):
    """(out, lse, rng_state) with a block mask, differentiable in q, k, v (and the sink)."""
    check_block_mask(block_mask, q=q, k=k, v=v)
    return _ops.fwd_masked(q, k, v, cu_q, cu_k, dropout_p, scale, causal, wl, wr, softcap, alibi,
                           sink, block_mask._kinds, block_mask._bits, block_mask._shape[2],
                           block_mask._shape[3])

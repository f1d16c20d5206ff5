"""Context parallelism: attention over a sequence sharded across the ranks of a process group
(ring attention), forward and backward, on any ``torch.distributed`` backend.

Each rank holds a slice of q, k and v along the sequence (flash-attn's ``[batch, seqlen_local,
heads, head_dim]`` layout). The forward runs ``world_size`` steps: at each, the rank attends its
q to the k/v block it holds with flashattn's kernels (a block out and its lse), merges that into
its running result by the log-sum-exp (the online softmax's merge, exact), and passes the block to
the next rank while it computes (the transfer is posted before the compute and waited for after).
The backward runs the ring again with the final out and lse: each block's dq, dk, dv come from
flashattn's backward (``P = exp(S - lse)``, ``delta = rowsum(dout * out)`` over the whole row, so
block gradients simply add up); dq stays, the dk/dv accumulators travel with their k/v block and
arrive back at its owner after the last step.

Causal attention skips blocks wholly in the future and runs the diagonal block causal; a sliding
window skips blocks wholly outside it and shifts it into each block's coordinates. Two layouts:

- contiguous (``ring_flash_attn_func``): rank r holds tokens ``[r·L, (r+1)·L)``; with causal the
  last rank does ``world_size`` blocks of work and the first one;
- zigzag (``zigzag_ring_flash_attn_func``): the sequence is cut into ``2·world_size`` chunks and
  rank r holds chunks r and ``2·world_size - 1 - r`` (``zigzag_shard``/``zigzag_unshard``), so
  every rank does the same causal work: off the diagonal, half of q against all of a block or all
  of q against half of it.

Packed sequences (``*_varlen_func``, ``cu_seqlens``) take either layout sequence by sequence: the
plan is the same for every sequence, so each step is one varlen call (the zigzag halves picked
by index).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import _ops
from ._flashattn import FlashAttnError
from .interface import flash_attn_func, flash_attn_varlen_func

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_shard",
    "zigzag_unshard",
]

# Message tags: k and v travel with tags 0 and 1, their dk and dv accumulators with 2 and 3, so a
# backward step's two transfers in flight between the same pair of ranks never cross.
_TAG_KV = 0
_TAG_DKV = 2


def _error(message: str, kind: str) -> FlashAttnError:
    return FlashAttnError(f"flashattn.distributed: {message}", kind)


# ---- the ring ------------------------------------------------------------------------------------


class _Transfer:
    """Tensors in flight one step round the ring: `wait` returns the ones received."""

    def __init__(self, works: list, sent: Sequence[Tensor], received: list[Tensor]):
        self._works = works
        self._sent = sent  # kept alive until the sends complete
        self._received = received

    def wait(self) -> list[Tensor]:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], ()
        return self._received


@dataclass(frozen=True)
class _Ring:
    """A process group's ranks in a ring: this rank sends to `next_rank`, receives from
    `prev_rank` (both global ranks, as point-to-point ops take them)."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    next_rank: int
    prev_rank: int

    @staticmethod
    def of(group: Optional[dist.ProcessGroup]) -> "_Ring":
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise _error("this process is not a member of `group`", "ProcessGroup")

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        return _Ring(group, rank, world, global_rank((rank + 1) % world),
                     global_rank((rank - 1) % world))

    def start(self, tensors: Sequence[Tensor], tag: int) -> _Transfer:
        """Posts sends of `tensors` (contiguous) to the next rank and receives of as many tensors
        of the same shapes from the previous one (tags `tag`, `tag + 1`, ...)."""
        if self.world_size == 1:
            return _Transfer([], (), list(tensors))
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for i, (t, r) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, t, self.next_rank, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev_rank, self.group, tag + i))
        return _Transfer(dist.batch_isend_irecv(ops), tensors, received)


# ---- which part of a block each step computes ----------------------------------------------------


@dataclass(frozen=True)
class _Block:
    """One kernel call of a ring step: rows of local q against rows of the k/v block held, with
    the mask of that pair in the kernels' terms (causal, or a window aligned, as flash-attn's, to
    the bottom-right corner of the pair; -1 unbounded)."""

    q_rows: Union[slice, Tensor]  # packed zigzag halves: an index of rows
    kv_rows: Union[slice, Tensor]
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    cu_seqlens_q: Optional[Tensor] = None  # packed sequences: the call's boundaries
    cu_seqlens_k: Optional[Tensor] = None
    # A learnable sink is one more key (value 0) in every row's normaliser: it rides with the
    # one call per row that pairs local queries with their own keys.
    sink: bool = False


_ALL = slice(None)


@dataclass(frozen=True)
class _Packed:
    """Packed sequences on this rank: the local cu_seqlens; in the zigzag layout also the rows
    of each sequence's first and second chunks and the chunks' cu_seqlens."""

    cu_seqlens: Tensor
    first: Optional[Tensor] = None
    second: Optional[Tensor] = None
    cu_half: Optional[Tensor] = None

    @staticmethod
    def of(cu: Tensor, zigzag: bool, device: torch.device) -> "_Packed":
        """`device`: the tensors' (the row indices go there; cu_seqlens stay where given)."""
        if not zigzag:
            return _Packed(cu)
        bounds = cu.tolist()
        starts = bounds[:-1]
        halves = [(b - a) // 2 for a, b in zip(starts, bounds[1:])]
        empty = [torch.empty(0, dtype=torch.int64)]
        first = torch.cat([torch.arange(a, a + h) for a, h in zip(starts, halves)] + empty)
        second = torch.cat([torch.arange(a + h, a + 2 * h) for a, h in zip(starts, halves)]
                           + empty)
        cu_half = torch.tensor([0] + halves, dtype=torch.int64).cumsum(0).to(cu.dtype)
        return _Packed(cu, first.to(device), second.to(device), cu_half.to(cu.device))


def _rows(t: Tensor, rows: Union[slice, Tensor], packed: bool) -> Tensor:
    """Rows of q/k/v/out/dq-shaped `t` along the sequence: a view for a slice, a copy for an
    index."""
    return t[rows] if packed else t[:, rows]


def _add_rows(acc: Tensor, rows: Union[slice, Tensor], value: Tensor, packed: bool) -> None:
    if isinstance(rows, Tensor):
        acc.index_add_(0 if packed else 1, rows, value.to(acc.dtype))
    else:
        _rows(acc, rows, packed).add_(value)


@dataclass(frozen=True)
class _Options:
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    zigzag: bool

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0


def _blocks(rank: int, src: int, world: int, seqlen: int, o: _Options,
            packed: Optional[_Packed] = None) -> list[_Block]:
    """The calls rank `rank` makes against the k/v block of rank `src` (none: the block is wholly
    masked for every local query)."""
    if packed is not None:
        return _packed_blocks(rank, src, o, packed)
    if o.windowed:
        return _window_blocks(rank, src, world, seqlen, o)
    if not o.causal:
        return [_Block(_ALL, _ALL, sink=src == rank)]
    if src == rank:
        # Zigzag too: local q and k/v both hold chunks (rank, 2R-1-rank) in sequence order, so
        # causal over their concatenation is the right mask.
        return [_Block(_ALL, _ALL, causal=True, sink=True)]
    if not o.zigzag:
        return [_Block(_ALL, _ALL)] if src < rank else []
    half = seqlen // 2
    if src < rank:
        # Both local chunks come after the block's first chunk and before its second.
        return [_Block(_ALL, slice(0, half))]
    # src > rank: only the local second chunk follows the block, and it follows both its chunks.
    return [_Block(slice(half, None), _ALL)]


def _packed_blocks(rank: int, src: int, o: _Options, p: _Packed) -> list[_Block]:
    """`_blocks` for packed sequences: the same plan for every sequence at once (each has the
    same rank-relative structure), the zigzag halves picked by index."""
    cu = p.cu_seqlens
    if not o.causal or src == rank:
        return [_Block(_ALL, _ALL, causal=o.causal and src == rank, cu_seqlens_q=cu,
                       cu_seqlens_k=cu, sink=src == rank)]
    if not o.zigzag:
        return [_Block(_ALL, _ALL, cu_seqlens_q=cu, cu_seqlens_k=cu)] if src < rank else []
    if src < rank:
        return [_Block(_ALL, p.first, cu_seqlens_q=cu, cu_seqlens_k=p.cu_half)]
    return [_Block(p.second, _ALL, cu_seqlens_q=p.cu_half, cu_seqlens_k=cu)]


@dataclass(frozen=True)
class _Segment:
    """A run of local rows and the sequence position of its first row."""

    first_row: int
    length: int
    position: int


def _segments(rank: int, world: int, seqlen: int, zigzag: bool) -> list[_Segment]:
    if not zigzag:
        return [_Segment(0, seqlen, rank * seqlen)]
    c = seqlen // 2
    return [_Segment(0, c, rank * c), _Segment(c, c, (2 * world - 1 - rank) * c)]


def _window_blocks(rank: int, src: int, world: int, seqlen: int, o: _Options) -> list[_Block]:
    """With a window, one call per pair of (local q segment, k/v segment) that has a visible
    entry. Query at position p sees key at position t iff ``p - left <= t <= p + right`` (causal:
    right = 0). The kernels align a call's window to the bottom-right corner of its rows: query
    row i with key row ``i + sk - sq``, i.e. local key - local query = ``k_end - q_end`` for the
    pair's ends, whatever their starts. So the pair is trimmed at its ends (rows that see nothing
    there) until both shifted bounds are >= 0, which is always possible as left + right >= 0."""
    right = 0 if o.causal else o.window_right
    left = o.window_left
    blocks = []
    for qs in _segments(rank, world, seqlen, o.zigzag):
        for ks in _segments(src, world, seqlen, o.zigzag):
            # A segment with itself keeps every row (each query sees its own key).
            own = src == rank and qs == ks
            # Visible: lo <= key_row - query_row <= hi (rows local to the two segments).
            delta = qs.position - ks.position
            lo = None if left < 0 else delta - left
            hi = None if right < 0 else delta + right
            q0, q1, k0, k1 = 0, qs.length, 0, ks.length
            if hi is not None:
                k1 = min(k1, q1 + hi)  # keys after the last query's band
                q0 = max(q0, -hi)  # queries before the first key's band
            if lo is not None:
                q1 = min(q1, k1 - lo)  # queries after the last kept key's band
                k0 = max(k0, q0 + lo)  # keys before the first kept query's band
            if q1 <= q0 or k1 <= k0:
                continue
            shift = k1 - q1
            blocks.append(_Block(
                slice(qs.first_row + q0, qs.first_row + q1),
                slice(ks.first_row + k0, ks.first_row + k1),
                window_left=-1 if lo is None else shift - lo,
                window_right=-1 if hi is None else hi - shift,
                sink=own,
            ))
    return blocks


# ---- merge by lse --------------------------------------------------------------------------------


def _merge(acc_o: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """acc_o (f32 [batch, rows, heads, d] or packed [rows, heads, d]) and lse (f32 [batch, heads,
    rows] or [heads, rows]) become the
    attention over their keys and the block's, in place: the online softmax's merge. A row that
    has seen no key on either side (lse -inf) keeps out 0 and lse -inf, never NaN."""
    new_lse = torch.logaddexp(lse, block_lse)
    # -inf - -inf would be NaN: subtract 0 where both sides are empty (both factors are then 0).
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    # lse [batch, heads, rows] (packed: [heads, rows]) -> [batch, rows, heads, 1] (packed:
    # [rows, heads, 1]), out's layout.
    old_w = torch.exp(lse - safe).transpose(-1, -2).unsqueeze(-1)
    new_w = torch.exp(block_lse - safe).transpose(-1, -2).unsqueeze(-1)
    acc_o.mul_(old_w).add_(block_out.to(torch.float32) * new_w)
    lse.copy_(new_lse)


# ---- forward and backward ------------------------------------------------------------------------


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cu: Optional[Tensor], sink: Optional[Tensor],
                  ring: _Ring, o: _Options):
    """(out in q's dtype, lse f32 [batch, heads, seqlen_local]); packed sequences (`cu`, the
    local cu_seqlens): out [total, heads, d], lse [heads, total]."""
    packed = None if cu is None else _Packed.of(cu, o.zigzag, q.device)
    is_packed = packed is not None
    seqlen = q.shape[0] if is_packed else q.shape[1]
    acc_o = lse = None
    kv = [k, v]
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        transfer = None if last else ring.start(kv, _TAG_KV)
        src = (ring.rank - step) % ring.world_size
        for blk in _blocks(ring.rank, src, ring.world_size, seqlen, o, packed):
            r, c = blk.q_rows, blk.kv_rows
            block_out, block_lse, _ = _ops.forward(
                _rows(q, r, is_packed), _rows(kv[0], c, is_packed), _rows(kv[1], c, is_packed),
                blk.cu_seqlens_q, blk.cu_seqlens_k, 0.0, o.softmax_scale, blk.causal,
                blk.window_left, blk.window_right, o.softcap, None, sink if blk.sink else None,
                True)
            if acc_o is None and r is _ALL:
                acc_o, lse = block_out.to(torch.float32), block_lse
                continue
            if acc_o is None:
                acc_o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
                lse = torch.full(block_lse.shape[:-1] + (seqlen,), float("-inf"),
                                 dtype=torch.float32, device=q.device)
            if isinstance(r, slice):
                _merge(_rows(acc_o, r, is_packed), lse[..., r], block_out, block_lse)
            else:  # an index: merge copies of the rows, then put them back
                rows_o, rows_lse = _rows(acc_o, r, is_packed), lse[..., r]
                _merge(rows_o, rows_lse, block_out, block_lse)
                if is_packed:
                    acc_o[r] = rows_o
                else:
                    acc_o[:, r] = rows_o
                lse[..., r] = rows_lse
        if transfer is not None:
            kv = transfer.wait()
    return acc_o.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, cu: Optional[Tensor], sink: Optional[Tensor],
                   ring: _Ring, o: _Options):
    """(dq, dk, dv) of this rank's slices, in their inputs' dtypes, and the sink's gradient
    from this rank's rows (None without a sink)."""
    dsink = None
    packed = None if cu is None else _Packed.of(cu, o.zigzag, q.device)
    is_packed = packed is not None
    seqlen = q.shape[0] if is_packed else q.shape[1]
    rng_state = torch.zeros(2, dtype=torch.int64)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    dkv = None  # the accumulators of the block held now, in flight from the previous rank
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        kv_transfer = None if last else ring.start(kv, _TAG_KV)
        src = (ring.rank - step) % ring.world_size
        # The block's gradients first, then the accumulators they add to: their transfer from
        # the previous rank overlaps this compute, as the k/v transfer does.
        block_grads = []
        for blk in _blocks(ring.rank, src, ring.world_size, seqlen, o, packed):
            r, c = blk.q_rows, blk.kv_rows
            dq_b, dk_b, dv_b, dsink_b = _ops.bwd(
                _rows(dout, r, is_packed), _rows(q, r, is_packed), _rows(kv[0], c, is_packed),
                _rows(kv[1], c, is_packed), _rows(out, r, is_packed),
                lse[..., r].contiguous(), blk.cu_seqlens_q, blk.cu_seqlens_k, 0.0,
                o.softmax_scale, blk.causal, blk.window_left, blk.window_right, o.softcap, None,
                sink if blk.sink else None, rng_state)
            _add_rows(dq, r, dq_b, is_packed)
            if sink is not None and blk.sink:
                dsink = dsink_b if dsink is None else dsink + dsink_b
            block_grads.append((c, dk_b, dv_b))
        if dkv is None:
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:
            dk, dv = dkv.wait()
        for c, dk_b, dv_b in block_grads:
            _add_rows(dk, c, dk_b, is_packed)
            _add_rows(dv, c, dv_b, is_packed)
        dkv = ring.start([dk, dv], _TAG_DKV)
        if kv_transfer is not None:
            kv = kv_transfer.wait()
    # The last send carried each accumulator to its block's owner: what arrives is this rank's.
    dk, dv = dkv.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, sink, ring: _Ring, o: _Options):
        out, lse = _ring_forward(q, k, v, cu_seqlens, sink, ring, o)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sink)
        ctx.ring, ctx.opts = ring, o
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        # The gradient of lse is not propagated (as in flash-attn).
        q, k, v, out, lse, cu_seqlens, sink = ctx.saved_tensors
        dq, dk, dv, dsink = _ring_backward(dout, q, k, v, out, lse, cu_seqlens, sink, ctx.ring,
                                           ctx.opts)
        return dq, dk, dv, None, dsink, None, None


# ---- input checks --------------------------------------------------------------------------------

_CHECKED_FIELDS = ("batch", "seqlen_q", "heads", "head_dim", "seqlen_k", "heads_kv",
                   "head_dim_v", "dtype", "causal", "window_left", "window_right", "zigzag",
                   "softmax_scale", "softcap", "cu_seqlens", "learnable_sink")
_FLOAT_FIELDS = frozenset(("softmax_scale", "softcap"))
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _window(window_size) -> tuple[int, int]:
    """(left, right), -1 for unbounded (any negative value, as flash-attn reads it)."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise _error(f"window_size must be (left, right), got {window_size!r}", "Window") from None
    return max(left, -1), max(right, -1)


def _check_local(q, k, v, cu, dropout_p, window, alibi_slopes, zigzag, causal) -> None:
    packed = cu is not None
    layout = ("[total_local, heads, head_dim]" if packed
              else "[batch, seqlen_local, heads, head_dim]")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"flashattn.distributed: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_CODES:
            raise TypeError(
                f"flashattn.distributed: `{name}` has dtype {t.dtype}; expected float32, float16 "
                "or bfloat16")
        if t.dim() != (3 if packed else 4):
            raise _error(f"`{name}` must be {layout}, got shape {tuple(t.shape)}", "Shape")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"flashattn.distributed: q, k, v dtypes differ ({q.dtype}, {k.dtype}, "
                        f"{v.dtype})")
    if dropout_p != 0.0:
        raise _error("dropout is not supported by ring attention (the blocks' dropout masks "
                     "would not be the single-device call's); pass dropout_p=0.0", "Unsupported")
    if alibi_slopes is not None:
        raise _error("alibi_slopes is not supported by ring attention", "Unsupported")
    if packed:
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point:
            raise TypeError("flashattn.distributed: cu_seqlens must be a 1-D integer tensor")
        if window != (-1, -1):
            raise _error("window_size is not supported with packed sequences (each sequence's "
                         "parts sit at their own offsets)", "Unsupported")
    seq = 0 if packed else 1
    if (causal or zigzag or window != (-1, -1)) and q.shape[seq] != k.shape[seq]:
        raise _error(f"causal, windowed or zigzag ring attention needs q and k/v slices of one "
                     f"length, got seqlen_q {q.shape[seq]} and seqlen_k {k.shape[seq]}", "Shape")
    if packed and zigzag:
        odd = [b - a for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]) if (b - a) % 2]
        if odd:
            raise _error(f"the zigzag layout holds two chunks of equal length of each sequence "
                         f"per rank: local parts must be even, got {odd[0]}", "Shape")
    if zigzag and q.shape[seq] % 2:
        raise _error(f"the zigzag layout holds two chunks of equal length per rank: seqlen_local "
                     f"must be even, got {q.shape[seq]}", "Shape")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _check_ranks_agree(q, k, v, cu, has_sink: bool, ring: _Ring, o: _Options) -> None:
    """Every rank must call with the same shapes and options (the ring's buffers take the
    sender's shapes): one small all_gather compares them, so every rank raises the same error
    instead of one of them hanging."""
    if ring.world_size == 1:
        return
    if cu is None:
        dims = (q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1], k.shape[2],
                v.shape[3])
        cu_sum = 0
    else:
        dims = (cu.numel() - 1, q.shape[0], q.shape[1], q.shape[2], k.shape[0], k.shape[1],
                v.shape[2])
        # A position-weighted sum: equal on every rank when their cu_seqlens are.
        weights = torch.arange(1, cu.numel() + 1, dtype=torch.int64, device=cu.device)
        cu_sum = int((cu.to(torch.int64) * weights).sum())
    mine = dims + (_DTYPE_CODES[q.dtype], int(o.causal), o.window_left, o.window_right,
                   int(o.zigzag), _float_bits(o.softmax_scale), _float_bits(o.softcap), cu_sum,
                   int(has_sink))
    device = q.device if q.is_cuda and dist.get_backend(ring.group) != "gloo" else "cpu"
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(ring.world_size)]
    dist.all_gather(gathered, local, group=ring.group)
    rows = [tuple(t.tolist()) for t in gathered]
    for r, row in enumerate(rows):
        for field, a, b in zip(_CHECKED_FIELDS, rows[0], row):
            if a != b:
                if field in _FLOAT_FIELDS:
                    a, b = _bits_float(a), _bits_float(b)
                raise _error(f"ranks disagree on {field}: rank 0 has {a}, rank {r} has {b} (every "
                             "rank must hold slices of one shape and pass the same options)",
                             "Shape")


def _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, return_attn_probs, group, zigzag, check, cu_seqlens=None,
                    learnable_sink=None):
    window = _window(window_size)
    _check_local(q, k, v, cu_seqlens, dropout_p, window, alibi_slopes, zigzag, causal)
    if learnable_sink is not None:
        if not isinstance(learnable_sink, Tensor):
            raise TypeError("flashattn.distributed: `learnable_sink` must be a torch.Tensor, got "
                            f"{type(learnable_sink).__name__}")
        heads = q.shape[-2]
        if learnable_sink.dtype != torch.float32 or tuple(learnable_sink.shape) != (heads,):
            raise _error(f"learnable_sink must be float32 [heads] = [{heads}], got "
                         f"{learnable_sink.dtype} {tuple(learnable_sink.shape)}", "Shape")
    if not (dist.is_available() and dist.is_initialized()):
        raise _error("torch.distributed is not initialized: call "
                     "torch.distributed.init_process_group first", "ProcessGroup")
    ring = _Ring.of(group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    o = _Options(scale, bool(causal), window[0], window[1], float(softcap), zigzag)
    if check:
        _check_ranks_agree(q, k, v, cu_seqlens, learnable_sink is not None, ring, o)
    if ring.world_size == 1:
        # The whole sequence on one rank: flashattn's own call (same result, none of the ring's
        # f32 accumulators, which cost ~16% of a bf16 forward + backward's CPU time).
        args = (q, k, v) if cu_seqlens is None else (q, k, v, cu_seqlens, cu_seqlens, 0, 0)
        fn = flash_attn_func if cu_seqlens is None else flash_attn_varlen_func
        out, lse, _ = fn(*args, 0.0, scale, causal, window, softcap, None, False, True,
                         learnable_sink=learnable_sink)
        return (out, lse, None) if return_attn_probs else out
    # Sends need contiguous tensors; the kernels take any layout with unit head_dim stride.
    out, lse = _RingAttention.apply(q, k.contiguous(), v.contiguous(), cu_seqlens,
                                    learnable_sink, ring, o)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """Attention over a sequence split contiguously across the ranks of `group` (default: the
    world): rank r holds tokens ``[r·L, (r+1)·L)`` of q, k and v, each ``[batch, L, heads(_kv),
    head_dim]``. Returns this rank's slice of out (q's dtype); with ``return_attn_probs``,
    ``(out, softmax_lse, None)``, lse f32 ``[batch, heads, L]``. Every rank of the group must
    call it with slices of the same shapes; differentiable in q, k and v.

    ``check`` (default on) compares the ranks' shapes and options with one small all_gather per
    call (on CUDA also a host sync) and raises ``FlashAttnError`` on all ranks if they differ;
    off, a mismatch may hang. ``window_size`` (with or without causal) is the single-device
    call's sliding window over sequence positions. ``learnable_sink`` (f32 ``[heads]``, the same
    on every rank) gets this rank's rows' share of its gradient: sum it over the group. Not
    supported (``FlashAttnError``): dropout, ``alibi_slopes``. ``deterministic`` is accepted:
    the ring order fixes the summation order.
    """
    return _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, return_attn_probs, group, False, check,
                           learnable_sink=learnable_sink)


def zigzag_ring_flash_attn_func(
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """`ring_flash_attn_func` over the zigzag layout: rank r holds chunks r and ``2R - 1 - r`` of
    the sequence cut into ``2R`` equal chunks (R = the group's size), as `zigzag_shard` makes
    them; out and lse are in the same layout. With causal every rank does the same work."""
    return _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, return_attn_probs, group, True, check,
                           learnable_sink=learnable_sink)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                  deterministic=False, return_attn_probs=False, group=None, *,
                                  check=True, learnable_sink=None):
    """`ring_flash_attn_func` with kv ``[batch, L, 2, heads_kv, head_dim]``."""
    return _ring_attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, return_attn_probs, group, False,
                           check, learnable_sink=learnable_sink)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                   deterministic=False, return_attn_probs=False, group=None, *,
                                   check=True, learnable_sink=None):
    """`ring_flash_attn_func` with qkv ``[batch, L, 3, heads, head_dim]``."""
    return _ring_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, return_attn_probs, group,
                           False, check, learnable_sink=learnable_sink)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False,
                                         group=None, *, check=True, learnable_sink=None):
    """`zigzag_ring_flash_attn_func` with kv ``[batch, L, 2, heads_kv, head_dim]``."""
    return _ring_attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, return_attn_probs, group, True,
                           check, learnable_sink=learnable_sink)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                          deterministic=False, return_attn_probs=False,
                                          group=None, *, check=True, learnable_sink=None):
    """`zigzag_ring_flash_attn_func` with qkv ``[batch, L, 3, heads, head_dim]``."""
    return _ring_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, return_attn_probs, group,
                           True, check, learnable_sink=learnable_sink)


def ring_flash_attn_varlen_func(
    q,
    k,
    v,
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """Packed sequences split contiguously across the ranks: sequence b is cut into
    ``world_size`` equal parts and rank r holds part r of every sequence, packed as q, k, v
    ``[total_local, heads(_kv), head_dim]`` with ``cu_seqlens`` (int32 ``[batch + 1]``, the
    parts' boundaries, the same on every rank). lse is ``[heads, total_local]``. Otherwise as
    `ring_flash_attn_func`; no ``window_size`` (each sequence's parts sit at their own
    offsets); ``max_seqlen`` is accepted and unused."""
    return _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, return_attn_probs, group, False, check, cu_seqlens,
                           learnable_sink)


def zigzag_ring_flash_attn_varlen_func(
    q,
    k,
    v,
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """`ring_flash_attn_varlen_func` in the zigzag layout: each sequence cut into
    ``2·world_size`` equal chunks, rank r holding chunks r and ``2·world_size - 1 - r`` of every
    sequence (``zigzag_shard(x, rank, world_size, dim=0, cu_seqlens=...)``); the local
    ``cu_seqlens`` bound each sequence's two chunks together, so every part is even."""
    return _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, return_attn_probs, group, True, check, cu_seqlens,
                           learnable_sink)


def ring_flash_attn_varlen_kvpacked_func(
    q,
    kv,
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """`ring_flash_attn_varlen_func` with kv ``[total_local, 2, heads_kv, head_dim]``."""
    return _ring_attention(q, kv[:, 0], kv[:, 1], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, return_attn_probs, group, False, check,
                           cu_seqlens, learnable_sink)


def ring_flash_attn_varlen_qkvpacked_func(
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """`ring_flash_attn_varlen_func` with qkv ``[total_local, 3, heads, head_dim]``."""
    return _ring_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, return_attn_probs, group, False,
                           check, cu_seqlens, learnable_sink)


def zigzag_ring_flash_attn_varlen_kvpacked_func(
    q,
    kv,
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """`zigzag_ring_flash_attn_varlen_func` with kv ``[total_local, 2, heads_kv, head_dim]``."""
    return _ring_attention(q, kv[:, 0], kv[:, 1], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, return_attn_probs, group, True, check,
                           cu_seqlens, learnable_sink)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(
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
    group=None,
    *,
    check=True,
    learnable_sink=None,
):
    """`zigzag_ring_flash_attn_varlen_func` with qkv ``[total_local, 3, heads, head_dim]``."""
    return _ring_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, return_attn_probs, group, True,
                           check, cu_seqlens, learnable_sink)


# ---- the zigzag layout ---------------------------------------------------------------------------


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1, *,
                 cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Rank `rank`'s slice of a full-sequence tensor in the zigzag layout: chunks `rank` and
    ``2·world_size - 1 - rank`` of ``2·world_size`` equal chunks along `dim`, concatenated.
    Packed sequences: with `cu_seqlens` (the whole batch's boundaries along `dim`) each sequence
    is sharded on its own and the slices packed; the rank's cu_seqlens are then
    ``cu_seqlens // world_size``."""
    if not 0 <= rank < world_size:
        raise _error(f"rank {rank} is outside a group of {world_size}", "ProcessGroup")
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        return torch.cat([x.narrow(dim, 0, 0)] + [
            zigzag_shard(x.narrow(dim, a, b - a), rank, world_size, dim)
            for a, b in zip(bounds[:-1], bounds[1:])], dim)
    n = x.shape[dim]
    if n % (2 * world_size):
        raise _error(f"the zigzag layout cuts the sequence into 2 x {world_size} equal chunks: "
                     f"length {n} along dim {dim} is not a multiple of {2 * world_size}", "Shape")
    if n == 0:
        return x
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def zigzag_unshard(shards: Sequence[Tensor], dim: int = 1, *,
                   cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """The full-sequence tensor from every rank's zigzag slice (``shards[r]`` from rank r, e.g.
    from ``torch.distributed.all_gather``): the inverse of `zigzag_shard` (with the same
    `cu_seqlens`, the whole batch's, for packed sequences)."""
    if cu_seqlens is not None:
        world = len(shards)
        bounds = [b // world for b in cu_seqlens.tolist()]
        return torch.cat([shards[0].narrow(dim, 0, 0)] + [
            zigzag_unshard([s.narrow(dim, a, b - a) for s in shards], dim)
            for a, b in zip(bounds[:-1], bounds[1:])], dim)
    firsts, seconds = zip(*(s.chunk(2, dim) for s in shards))
    return torch.cat(list(firsts) + list(reversed(seconds)), dim)

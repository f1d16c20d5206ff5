"""flashattn's torch.library custom ops: the one place where tensors cross into Rust.

Each op has a real implementation (CPU tensors: their addresses, shapes and strides go to the
extension module, which runs the Rust kernels with the GIL released and writes into outputs
allocated here by torch), a fake implementation (shapes only, for torch.compile and meta
tensors) and, for the differentiable ones, an autograd formula that calls the fused backward.

Ops (namespace ``flashattn``):
- ``fwd``: q, k, v (batched, or packed with cu_seqlens) -> out, lse, rng_state
- ``bwd``: dout and the forward's tensors -> dq, dk, dv, dsink
- ``fwd_fp8``: FP8 q, k, v with descale factors -> out (bf16), lse
- ``fwd_kvcache``: decoding over KV caches, appending new keys in place -> out, lse
- ``fwd_masked``, ``bwd_masked``: ``fwd`` and ``bwd`` with a block mask's tensors (CPU)
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from . import _flashattn as _ext
from ._flashattn import FlashAttnError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = tuple(
    d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d
)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
for _d in FP8_DTYPES:
    _DTYPE_NAMES[_d] = str(_d).removeprefix("torch.")


def _on_cuda(**tensors: Optional[Tensor]) -> bool:
    """Whether a call runs on CUDA: every tensor on the CPU (False) or all on one CUDA device
    (True, unless FLASHATTN_PY_CUDA=0 turns the CUDA path off)."""
    if all(t is None or t.is_cpu for t in tensors.values()):
        return False
    devices = {t.device for t in tensors.values() if t is not None}
    if all(d.type == "cpu" for d in devices):
        return False
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        found = ", ".join(f"{n}: {t.device}" for n, t in tensors.items() if t is not None)
        raise ValueError(f"flashattn: tensors must all be on the CPU or on one CUDA device ({found})")
    if os.environ.get("FLASHATTN_PY_CUDA") == "0" or not hasattr(_ext, "cuda_fwd"):
        raise NotImplementedError(
            "flashattn: CUDA tensors are turned off (FLASHATTN_PY_CUDA=0), or this build has no "
            "CUDA backend"
        )
    return True


def _cuda_target(t: Tensor) -> tuple[int, int]:
    """(device ordinal, the CUstream torch runs on now) for a CUDA call."""
    return t.device.index, torch.cuda.current_stream(t.device).cuda_stream


def _view(name: str, t: Tensor, cuda: bool = False) -> tuple:
    """A tensor as the extension module takes it: (name, address, dtype, shape, strides)."""
    if not (t.is_cuda if cuda else t.is_cpu):
        raise NotImplementedError(
            f"flashattn: `{name}` is on {t.device}; this call runs on "
            f"{'CUDA' if cuda else 'the CPU'}"
        )
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise TypeError(
            f"flashattn: `{name}` has dtype {t.dtype}; expected float32, float16 or bfloat16 "
            "(or float8_e4m3fn / float8_e5m2 where FP8 is accepted)"
        )
    # torch.Size is a tuple: the extension module reads it as it is.
    return (name, t.data_ptr(), dtype, t.shape, t.stride())


def _maybe_view(name: str, t: Optional[Tensor], cuda: bool = False) -> Optional[tuple]:
    return None if t is None else _view(name, t, cuda)


def _ints(name: str, t: Optional[Tensor]) -> Optional[list]:
    if t is None:
        return None
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"flashattn: `{name}` must hold integers (torch.int32), got {t.dtype}")
    # On CUDA this copies to the host (the library takes index arrays on the host): one sync.
    return t.reshape(-1).tolist()


def _floats(name: str, t: Optional[Tensor]) -> Optional[list]:
    if t is None:
        return None
    return t.detach().to(torch.float32).reshape(-1).tolist()


def _host_table(t: Optional[Tensor]) -> Optional[Tensor]:
    """A small option table (ALiBi slopes, sinks, rotary cos/sin) on the host: the library takes
    them there and uploads them per call. From a CUDA tensor this is a device-to-host copy (one
    sync, as flash-attn's cu_seqlens would not need)."""
    return None if t is None else t.detach().to("cpu")


def _opts(
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    dropout_p: float = 0.0,
    seed: int = 0,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    cuda: bool = False,
    descale_per_block: bool = False,
    block_mask=None,
) -> dict:
    cu = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("flashattn: cu_seqlens_q and cu_seqlens_k go together")
        cu = (_ints("cu_seqlens_q", cu_seqlens_q), _ints("cu_seqlens_k", cu_seqlens_k))
    if cuda:
        alibi_slopes, learnable_sink = _host_table(alibi_slopes), _host_table(learnable_sink)
    return {
        "softmax_scale": float(softmax_scale),
        "causal": bool(causal),
        "window_left": int(window_left),
        "window_right": int(window_right),
        "softcap": float(softcap),
        "alibi_slopes": _maybe_view("alibi_slopes", alibi_slopes),
        "learnable_sink": _maybe_view("learnable_sink", learnable_sink),
        # The views hold addresses only: these keep the (host) tables alive for the call.
        "_keep": (alibi_slopes, learnable_sink),
        "dropout_p": float(dropout_p),
        "seed": int(seed),
        "num_threads": torch.get_num_threads(),
        "cu_seqlens": cu,
        "descale_per_block": bool(descale_per_block),
        # A flashattn.BlockMask's extension object (CPU forward and backward).
        "block_mask": None if block_mask is None else block_mask._ext,
    }


def _byte_range(t: Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _overlap(a: Tensor, b: Tensor) -> bool:
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


def _lse_shape(q: Tensor, packed: bool) -> tuple:
    # batched: [batch, heads, seqlen_q]; packed: [heads, total_q] (flash-attn 2's layouts).
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


def _empty_like(t: Tensor) -> Tensor:
    """A new contiguous tensor of `t`'s shape, dtype and device: what
    `torch.empty(t.shape, dtype=t.dtype, device=t.device)` makes, in a fraction of its time
    (~1 us instead of ~3 on a tiny CPU call: no keyword parsing of a shape, dtype and device)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _new_seed() -> int:
    # From torch's default CPU generator, so torch.manual_seed makes dropout reproducible.
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


_C = torch._C


def _modes_off() -> bool:
    """No torch.compile, tracing, dispatch or function mode, profiler or functorch transform is
    active: nothing would see an op call that skipped torch's dispatcher. Any of these missing
    from this torch: False."""
    try:
        return not (
            torch.compiler.is_compiling()
            or _C._len_torch_dispatch_stack()
            or _C._is_torch_function_mode_enabled()
            or _C._autograd._profiler_enabled()
            or _C._get_tracing_state() is not None
            or _C._functorch.peek_interpreter_stack() is not None
        )
    except AttributeError:
        return False


def _direct(*tensors: Optional[Tensor]) -> bool:
    """Whether `flashattn.interface` may run an op's body itself instead of calling the op:
    plain CPU tensors, no gradient to record and nothing that would see the op (`_modes_off`).
    Through torch's dispatcher a call passes Python layers for autograd, ADInplaceOrView and the
    backend kernel: ~30 us on a 2-vCPU VM, 3-6 times all of SDPA on a tiny call
    (bench/py_cpu_overhead.py). The body is the same code either way, so are the results."""
    if not _modes_off():
        return False
    grad = _C.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not Tensor or not t.is_cpu or (grad and t.requires_grad)):
            return False
    return True


# ---- forward and backward ------------------------------------------------------------------------


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_left,
             window_right, softcap, alibi_slopes, learnable_sink, want_lse: bool,
             cuda: Optional[bool] = None, block_mask=None):
    """The forward's work: (out, lse, seed); lse None when not `want_lse` (CPU only). `cuda`:
    the device when the caller knows it (`_on_cuda` otherwise). `block_mask`: a mask
    as `_MaskArg` holds it (`fwd_masked` and `bwd_masked` pass one)."""
    packed = cu_seqlens_q is not None
    if cuda is None:
        cuda = _on_cuda(q=q, k=k, v=v, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    seed = _new_seed() if dropout_p > 0.0 else 0
    out = _empty_like(q)
    lse = None
    if want_lse or cuda:
        lse = torch.empty(_lse_shape(q, packed), dtype=torch.float32, device=q.device)
    opts = _opts(
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
        learnable_sink, dropout_p, seed, cu_seqlens_q, cu_seqlens_k, cuda, block_mask=block_mask,
    )
    views = [_view("q", q, cuda), _view("k", k, cuda), _view("v", v, cuda),
             _view("out", out, cuda), _maybe_view("lse", lse, cuda)]
    if cuda:
        _ext.cuda_fwd(*_cuda_target(q), *views, opts)
    else:
        _ext.fwd(*views, opts)
    return out, lse, seed


def _fwd_fake(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> tuple:
    """The forward ops' outputs, shapes only: out, lse, rng_state."""
    packed = cu_seqlens_q is not None
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, packed), dtype=torch.float32)
    return out, lse, torch.empty((2,), dtype=torch.int64, device="cpu")


def _bwd_fake(q: Tensor, k: Tensor, v: Tensor, learnable_sink: Optional[Tensor]) -> tuple:
    """The backward ops' outputs, shapes only: dq, dk, dv, dsink (empty without a sink)."""
    n = q.shape[-2] if learnable_sink is not None else 0
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((n,), dtype=torch.float32))


@torch.library.custom_op("flashattn::fwd", mutates_args=())
def fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    # On the host on either backend: the backward reads the seed without a device sync.
    rng_state = torch.zeros(2, dtype=torch.int64)
    out, lse, seed = _forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_left,
        window_right, softcap, alibi_slopes, learnable_sink, True,
    )
    if seed:
        rng_state[0] = seed
    return out, lse, rng_state


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_left,
            window_right, softcap, alibi_slopes, learnable_sink, want_lse: bool):
    """`fwd` for `flashattn.interface`: (out, lse, rng_state), through the op, or where `_direct`
    allows through its body without the dispatcher (then lse and rng_state are None unless
    `want_lse`: the caller returns out alone)."""
    if not _direct(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink):
        return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal,
                   window_left, window_right, softcap, alibi_slopes, learnable_sink)
    out, lse, seed = _forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_left,
        window_right, softcap, alibi_slopes, learnable_sink, want_lse, cuda=False,
    )
    if not want_lse:
        return out, None, None
    rng_state = torch.zeros(2, dtype=torch.int64)
    rng_state[0] = seed
    return out, lse, rng_state


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_left,
      window_right, softcap, alibi_slopes, learnable_sink):
    return _fwd_fake(q, cu_seqlens_q)


@torch.library.custom_op("flashattn::bwd", mutates_args=())
def bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    rng_state: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p,
                     softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                     learnable_sink, int(rng_state[0]))


def _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale,
              causal, window_left, window_right, softcap, alibi_slopes, learnable_sink,
              seed: int, block_mask=None):
    """The backward's work: (dq, dk, dv, dsink); `block_mask` as in `_forward`."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    cuda = _on_cuda(q=q, k=k, v=v, out=out, lse=lse, dout=dout, alibi_slopes=alibi_slopes,
                    learnable_sink=learnable_sink)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    has_sink = learnable_sink is not None
    dsink = torch.empty((q.shape[-2],) if has_sink else (0,), dtype=torch.float32, device=q.device)
    opts = _opts(
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
        learnable_sink, dropout_p, seed, cu_seqlens_q, cu_seqlens_k, cuda, block_mask=block_mask,
    )
    views = [_view(n, t, cuda) for n, t in (("q", q), ("k", k), ("v", v), ("out", out),
                                            ("lse", lse), ("dout", dout), ("dq", dq),
                                            ("dk", dk), ("dv", dv))]
    ds = _view("dsink", dsink, cuda) if has_sink else None
    if cuda:
        _ext.cuda_bwd(*_cuda_target(q), *views, ds, opts)
    else:
        _ext.bwd(*views, ds, opts)
    return dq, dk, dv, dsink


@bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, learnable_sink, rng_state):
    return _bwd_fake(q, k, v, learnable_sink)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, dropout_p, scale, causal, wl, wr, softcap, alibi, sink) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_q, cu_k, alibi, sink)
    ctx.opts = (dropout_p, scale, causal, wl, wr, softcap)


def _fwd_backward(ctx, dout, dlse, drng):
    # The gradient of lse is not propagated (flash-attn's backward ignores it too).
    q, k, v, out, lse, rng_state, cu_q, cu_k, alibi, sink = ctx.saved_tensors
    dropout_p, scale, causal, wl, wr, softcap = ctx.opts
    dq, dk, dv, dsink = bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, dropout_p, scale, causal, wl, wr, softcap, alibi,
        sink, rng_state,
    )
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None,
            dsink if sink is not None else None)


torch.library.register_autograd("flashattn::fwd", _fwd_backward, setup_context=_fwd_setup_context)


# ---- block masks ---------------------------------------------------------------------------------


class _MaskArg:
    """A mask read in place from an op's tensors (checked, not copied), as `_opts` reads it
    (`._ext`), for one call."""

    __slots__ = ("_ext",)

    def __init__(self, kinds: Tensor, bits: Tensor, seqlen_q: int, seqlen_k: int):
        if kinds.dtype != torch.int32 or bits.dtype != torch.int64 or kinds.dim() != 4:
            raise TypeError(
                "flashattn: mask_kinds must be int32 [B, H, m_blocks, n_blocks] and mask_bits "
                f"int64, got {kinds.dtype} {tuple(kinds.shape)} and {bits.dtype}")
        kinds, bits = _cpu_contiguous(kinds), _cpu_contiguous(bits)
        self._ext = _ext.BlockMask.lend(
            (kinds.shape[0], kinds.shape[1], seqlen_q, seqlen_k),
            _view("mask_kinds", kinds.view(torch.uint8)), _view("mask_bits", bits.view(torch.uint8)),
            (kinds, bits))


def _cpu_contiguous(t: Tensor) -> Tensor:
    return t if t.is_cpu and t.is_contiguous() else t.to("cpu").contiguous()


@torch.library.custom_op("flashattn::fwd_masked", mutates_args=())
def fwd_masked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    mask_kinds: Tensor,
    mask_bits: Tensor,
    mask_seqlen_q: int,
    mask_seqlen_k: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`fwd` with a block mask given as `flashattn.BlockMask`'s tensors: `mask_kinds` int32
    `[B, H, m_blocks, n_blocks]` (-1 no pair shown, -2 all, p >= 0 partial block p) and
    `mask_bits` int64 `[partial blocks, BLOCK_SIZE]` (a row's keys per word). CPU only."""
    mask = _MaskArg(mask_kinds, mask_bits, mask_seqlen_q, mask_seqlen_k)
    rng_state = torch.zeros(2, dtype=torch.int64)
    out, lse, seed = _forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_left,
        window_right, softcap, alibi_slopes, learnable_sink, True, cuda=False, block_mask=mask,
    )
    rng_state[0] = seed
    return out, lse, rng_state


@fwd_masked.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_left,
      window_right, softcap, alibi_slopes, learnable_sink, mask_kinds, mask_bits, mask_seqlen_q,
      mask_seqlen_k):
    return _fwd_fake(q, cu_seqlens_q)


@torch.library.custom_op("flashattn::bwd_masked", mutates_args=())
def bwd_masked(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    rng_state: Tensor,
    mask_kinds: Tensor,
    mask_bits: Tensor,
    mask_seqlen_q: int,
    mask_seqlen_k: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`bwd` with the block mask of `fwd_masked`."""
    mask = _MaskArg(mask_kinds, mask_bits, mask_seqlen_q, mask_seqlen_k)
    return _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p,
                     softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                     learnable_sink, int(rng_state[0]), mask)


@bwd_masked.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, learnable_sink, rng_state, mask_kinds,
      mask_bits, mask_seqlen_q, mask_seqlen_k):
    return _bwd_fake(q, k, v, learnable_sink)


def _fwd_masked_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, dropout_p, scale, causal, wl, wr, softcap, alibi, sink, kinds, bits,
     mask_sq, mask_sk) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_q, cu_k, alibi, sink, kinds, bits)
    ctx.opts = (dropout_p, scale, causal, wl, wr, softcap, mask_sq, mask_sk)


def _fwd_masked_backward(ctx, dout, dlse, drng):
    # As `fwd`: the gradient of lse is not propagated.
    q, k, v, out, lse, rng_state, cu_q, cu_k, alibi, sink, kinds, bits = ctx.saved_tensors
    dropout_p, scale, causal, wl, wr, softcap, mask_sq, mask_sk = ctx.opts
    dq, dk, dv, dsink = bwd_masked(
        dout, q, k, v, out, lse, cu_q, cu_k, dropout_p, scale, causal, wl, wr, softcap, alibi,
        sink, rng_state, kinds, bits, mask_sq, mask_sk,
    )
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None,
            dsink if sink is not None else None, None, None, None, None)


torch.library.register_autograd("flashattn::fwd_masked", _fwd_masked_backward,
                                setup_context=_fwd_masked_setup_context)


# ---- FP8 forward ---------------------------------------------------------------------------------


@torch.library.custom_op("flashattn::fwd_fp8", mutates_args=())
def fwd_fp8(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    packed = cu_seqlens_q is not None
    cuda = _on_cuda(q=q, k=k, v=v, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(_lse_shape(q, packed), dtype=torch.float32, device=q.device)
    # Per-block factors: 3-D tables [batch, heads (q) or heads_kv (k, v), blocks of 128 rows].
    given = [t for t in (q_descale, k_descale, v_descale) if t is not None]
    per_block = any(t.dim() == 3 for t in given)
    if per_block and not all(t.dim() == 3 for t in given):
        raise ValueError(
            "flashattn: per-block descale factors are 3-D tables [batch, heads, blocks]; "
            "give q_descale, k_descale and v_descale all per block or none")
    opts = _opts(
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
        learnable_sink, 0.0, 0, cu_seqlens_q, cu_seqlens_k, cuda, per_block,
    )
    call = (
        _view("q", q, cuda), _view("k", k, cuda), _view("v", v, cuda), _view("out", out, cuda),
        _view("lse", lse, cuda), _floats("q_descale", q_descale),
        _floats("k_descale", k_descale), _floats("v_descale", v_descale), opts,
    )
    if cuda:
        _ext.cuda_fwd_fp8(*_cuda_target(q), *call)
    else:
        _ext.fwd_fp8(*call)
    return out, lse


@fwd_fp8.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, softmax_scale,
      causal, window_left, window_right, softcap, alibi_slopes, learnable_sink):
    packed = cu_seqlens_q is not None
    return (q.new_empty(q.shape, dtype=torch.bfloat16),
            q.new_empty(_lse_shape(q, packed), dtype=torch.float32))


# ---- decoding with a KV cache --------------------------------------------------------------------


def _kvcache(a: dict, want_lse: bool = True,
             cuda: Optional[bool] = None) -> tuple[Tensor, Optional[Tensor]]:
    """The body of `fwd_kvcache`, over its arguments by name; lse None when not `want_lse`
    (CPU only). `cuda`: the device when the caller knows it (`_on_cuda` otherwise)."""
    q, k_cache, v_cache, k, v = a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"]
    if k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr():
        raise FlashAttnError(
            "flashattn: k_cache overlaps v_cache: they are the same memory; pass two distinct caches",
            "Binding",
        )
    if _overlap(k_cache, v_cache):
        # One buffer holds both caches (flash-attn's `kv_cache[:, :, 0]`, `[:, :, 1]`): the library
        # writes through two exclusive views, so it works on copies that are written back after.
        # This costs a pass over both caches per call.
        kc = k_cache.clone(memory_format=torch.contiguous_format)
        vc = v_cache.clone(memory_format=torch.contiguous_format)
        out, lse = _kvcache({**a, "k_cache": kc, "v_cache": vc}, want_lse, cuda)
        if k is not None:
            k_cache.copy_(kc)
            v_cache.copy_(vc)
        return out, lse
    packed = a["cu_seqlens_q"] is not None
    if cuda is None:
        cuda = _on_cuda(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                        rotary_cos=a["rotary_cos"], rotary_sin=a["rotary_sin"])
    out = _empty_like(q)
    lse = None
    if want_lse or cuda:
        lse = torch.empty(_lse_shape(q, packed), dtype=torch.float32, device=q.device)
    opts = _opts(a["softmax_scale"], a["causal"], a["window_left"], a["window_right"],
                 a["softcap"], a["alibi_slopes"], a["learnable_sink"], cuda=cuda)
    table, bt = None, a["block_table"]
    if bt is not None:
        if bt.dim() != 2:
            raise ValueError(
                f"flashattn: block_table must be [batch, max_blocks_per_seq], got shape "
                f"{tuple(bt.shape)}"
            )
        table = (_ints("block_table", bt), bt.shape[0], bt.shape[1])
    cos, sin = a["rotary_cos"], a["rotary_sin"]
    if cuda:
        cos, sin = _host_table(cos), _host_table(sin)
    kv = {
        "k": _maybe_view("k", k, cuda),
        "v": _maybe_view("v", v, cuda),
        "rotary_cos": _maybe_view("rotary_cos", cos),
        "rotary_sin": _maybe_view("rotary_sin", sin),
        "_keep": (cos, sin),
        "rotary_interleaved": bool(a["rotary_interleaved"]),
        "cache_batch_idx": _ints("cache_batch_idx", a["cache_batch_idx"]),
        "cache_leftpad": _ints("cache_leftpad", a["cache_leftpad"]),
        "block_table": table,
        "cu_seqlens_q": _ints("cu_seqlens_q", a["cu_seqlens_q"]),
        "cu_seqlens_k_new": _ints("cu_seqlens_k_new", a["cu_seqlens_k_new"]),
        # flash-attn: any num_splits < 1 chooses automatically.
        "num_splits": max(int(a["num_splits"]), 0),
        "k_descale": _floats("k_descale", a["k_descale"]),
        "v_descale": _floats("v_descale", a["v_descale"]),
    }
    call = (_view("q", q, cuda), _view("k_cache", k_cache, cuda), _view("v_cache", v_cache, cuda),
            _ints("cache_seqlens", a["cache_seqlens"]), _view("out", out, cuda),
            _maybe_view("lse", lse, cuda), opts, kv)
    if cuda:
        _ext.cuda_kvcache(*_cuda_target(q), *call)
    else:
        _ext.kvcache(*call)
    return out, lse


@torch.library.custom_op("flashattn::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    block_table: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k_new: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    num_splits: int,
) -> tuple[Tensor, Tensor]:
    return _kvcache(dict(locals()))


def kvcache(q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, cache_batch_idx,
            cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k_new, k_descale, v_descale,
            softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
            alibi_slopes, learnable_sink, num_splits, want_lse: bool):
    """`fwd_kvcache` for `flashattn.interface`: (out, lse), through the op, or where `_direct`
    allows through its body without the dispatcher (then lse is None unless `want_lse`), bumping
    the caches' version counters as the op's ADInplaceOrView kernel does."""
    a = dict(locals())
    del a["want_lse"]
    if not _direct(q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin,
                   cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k_new,
                   k_descale, v_descale, alibi_slopes, learnable_sink):
        return fwd_kvcache(*a.values())
    torch.autograd.graph.increment_version((k_cache, v_cache))
    return _kvcache(a, want_lse, cuda=False)


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, cache_batch_idx,
      cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k_new, k_descale, v_descale,
      softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
      learnable_sink, num_splits):
    packed = cu_seqlens_q is not None
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, packed), dtype=torch.float32)


def dropout_keep_mask(seed: int, p: float, batch: int, heads: int, seqlen_q: int,
                      seqlen_k: int) -> Tensor:
    """The keep-mask (bool, [batch, heads, seqlen_q, seqlen_k]) the kernels draw for `seed`."""
    mask = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.uint8)
    _ext.dropout_keep_mask(int(seed), float(p), _view("mask", mask))
    return mask.bool()

"""FlexAttention's call, ``flex_attention(q, k, v, score_mod=, block_mask=, scale=, enable_gqa=)``,
on ``[batch, heads, seqlen, head_dim]`` tensors.

    from flashattn import flex_attention

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + seqlen_k - 1]     # bias [heads, 2 * S - 1]

    out = flex_attention(qt, kt, vt, score_mod=rel_bias)         # qt [batch, heads, seqlen, d]

``score_mod(score, b, h, q_idx, kv_idx)`` maps each scaled score ``q·k·scale`` (before the
softmax) to a new one. A Python callable cannot run per score inside the Rust kernels: it is
called once on placeholder values, which record what it does into a small expression program
(`trace_score_mod`), and the kernels evaluate that program per score in f64, with its
derivative for the backward. Supported: ``+ - * / // % **``, unary ``-``, ``abs``,
comparisons, ``&`` ``|`` ``~`` on conditions, ``torch.exp log tanh sigmoid sqrt rsqrt exp2 log2
square floor abs neg minimum maximum clamp where`` (and their tensor-method forms), Python
numbers and one-element tensors as constants, and captured tensors indexed by expressions of
the indices (``bias[h, q_idx - kv_idx]``; a negative index counts from the end, one out of range
reads NaN). Anything else raises `ScoreModError` naming it; so does a captured tensor that
requires grad (its gradient is not computed). Python control flow on a traced value (``if``,
``and``, ``or``) cannot be recorded: use ``torch.where``. CPU tensors only; under
``torch.compile`` a call with ``score_mod`` runs outside the graph.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from . import _flashattn as _ext
from . import _ops
from ._flashattn import FlashAttnError
from .block_mask import BlockMask, check_block_mask

__all__ = ["ScoreModError", "flex_attention", "trace_score_mod"]


class ScoreModError(TypeError):
    """A score function uses something the tracer cannot record (named in the message)."""


_SUPPORTED = ("+ - * / // % **, abs, comparisons, & | ~, torch.exp/log/tanh/sigmoid/sqrt/rsqrt/"
              "exp2/log2/square/floor/minimum/maximum/clamp/where, and captured tensors indexed "
              "by b, h, q_idx, kv_idx")


def _unsupported(what: str) -> ScoreModError:
    return ScoreModError(f"flashattn: score_mod uses {what}, which cannot be traced "
                         f"(supported: {_SUPPORTED})")


class _Trace:
    """The program being recorded: nodes ``(op, args, constant)`` and captured tables."""

    def __init__(self):
        self.nodes: list[tuple[str, list[int], float]] = []
        self.tables: list[tuple[list[float], list[int]]] = []
        self._table_of: dict[int, int] = {}
        self._consts: dict[str, int] = {}

    def add(self, op: str, args=(), c: float = 0.0) -> "_Sym":
        self.nodes.append((op, list(args), float(c)))
        return _Sym(self, len(self.nodes) - 1)

    def const(self, x: float) -> int:
        x = float(x)
        key = repr(x)  # keeps -0.0 apart from 0.0
        if key not in self._consts:
            self._consts[key] = self.add("const", (), x)._i
        return self._consts[key]

    def lift(self, x) -> int:
        """The node of a traced value or a constant."""
        if isinstance(x, _Sym):
            if x._trace is not self:
                raise _unsupported("a value traced by another call")
            return x._i
        if isinstance(x, _Partial):
            raise _unsupported(f"a captured tensor of shape {tuple(x._shape)} indexed by "
                               f"{len(x._index)} of its {len(x._shape)} dimensions as a value")
        if isinstance(x, bool):
            return self.const(1.0 if x else 0.0)
        if isinstance(x, (int, float)):
            return self.const(x)
        if isinstance(x, Tensor):
            if x.requires_grad:
                raise _unsupported("a captured tensor that requires grad (its gradient is not "
                                   "computed; detach it)")
            if x.numel() == 1:
                return self.const(x.item())
            raise _unsupported(f"a captured tensor of shape {tuple(x.shape)} as a value (index "
                               "it with b, h, q_idx, kv_idx)")
        raise _unsupported(f"a value of type {type(x).__name__}")

    def table(self, t: Tensor) -> int:
        if t.requires_grad:
            raise _unsupported("a captured tensor that requires grad (its gradient is not "
                               "computed; detach it)")
        if t.is_complex():
            raise _unsupported(f"a captured {t.dtype} tensor")
        key = id(t)
        if key not in self._table_of:
            values = t.detach().to("cpu", torch.float64).contiguous().reshape(-1).tolist()
            self.tables.append((values, list(t.shape)))
            self._table_of[key] = len(self.tables) - 1
        return self._table_of[key]

    def op(self, name: str, *args) -> "_Sym":
        return self.add(name, [self.lift(a) for a in args])


def _index_nodes(trace: _Trace, index) -> list[int]:
    items = index if isinstance(index, tuple) else (index,)
    out = []
    for it in items:
        if isinstance(it, (_Sym, int)) and not isinstance(it, bool):
            out.append(trace.lift(it))
        elif isinstance(it, Tensor) and it.numel() == 1 and not it.dtype.is_floating_point:
            out.append(trace.lift(it))
        else:
            raise _unsupported(f"an index of type {type(it).__name__} into a captured tensor "
                               "(only b, h, q_idx, kv_idx expressions and integers)")
    return out


class _Partial:
    """A captured tensor indexed in some of its dimensions (``bias[h]`` before ``[q - k]``)."""

    def __init__(self, trace: _Trace, table: int, shape, index: list[int]):
        self._trace, self._table, self._shape, self._index = trace, table, shape, index

    def __getitem__(self, index):
        return _lookup(self._trace, self._table, self._shape,
                       self._index + _index_nodes(self._trace, index))


def _lookup(trace: _Trace, table: int, shape, index: list[int]):
    if len(index) > len(shape):
        raise _unsupported(f"{len(index)} indices into a captured tensor of shape {tuple(shape)}")
    if len(index) < len(shape):
        return _Partial(trace, table, shape, index)
    return trace.add("lookup", [table] + index)


def _getitem(t, index):
    trace = next((x._trace for x in (index if isinstance(index, tuple) else (index,))
                  if isinstance(x, _Sym)), None)
    if isinstance(t, _Sym):
        raise _unsupported("indexing a traced value")
    if trace is None or not isinstance(t, Tensor):
        raise _unsupported("indexing without a traced index")
    return _lookup(trace, trace.table(t), t.shape, _index_nodes(trace, index))


# torch functions and tensor methods by name (dunders stripped): (op, arguments) or a builder.
_UNARY = {"exp": "exp", "log": "log", "tanh": "tanh", "sigmoid": "sigmoid", "sqrt": "sqrt",
          "abs": "abs", "absolute": "abs", "neg": "neg", "negative": "neg", "floor": "floor",
          "logical_not": "not", "invert": "not", "bitwise_not": "not"}
_BINARY = {"add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul",
           "div": "div", "divide": "div", "true_divide": "div", "truediv": "div",
           "floor_divide": "floordiv", "floordiv": "floordiv", "remainder": "rem", "mod": "rem",
           "pow": "pow", "minimum": "min", "maximum": "max", "lt": "lt", "less": "lt",
           "le": "le", "less_equal": "le", "gt": "gt", "greater": "gt", "ge": "ge",
           "greater_equal": "ge", "eq": "eq", "ne": "ne", "not_equal": "ne",
           "logical_and": "and", "and": "and", "bitwise_and": "and", "logical_or": "or",
           "or": "or", "bitwise_or": "or"}
# Reflected dunders: `Tensor.__rsub__(a, b)` is `b - a`.
_REFLECTED = {"radd": "add", "rsub": "sub", "rmul": "mul", "rtruediv": "div", "rdiv": "div",
              "rfloordiv": "floordiv", "rmod": "rem", "rpow": "pow", "rand": "and", "ror": "or"}
# Casts between float dtypes change nothing here (the program runs in f64).
_CASTS = {"float", "double", "half", "bfloat16", "to", "type_as", "clone", "contiguous",
          "detach"}


def _call(name: str, args, kwargs):
    if name == "getitem":
        return _getitem(*args)
    trace = next((a._trace for a in list(args) + list(kwargs.values()) if isinstance(a, _Sym)),
                 None)
    if trace is None:
        raise _unsupported(f"torch.{name} without a traced argument")
    if name in _UNARY and len(args) == 1 and not kwargs:
        return trace.op(_UNARY[name], args[0])
    if name in _BINARY and len(args) == 2:
        a, b = args
        kw = dict(kwargs)
        alpha = kw.pop("alpha", None)
        mode = kw.pop("rounding_mode", None)
        if kw:
            raise _unsupported(f"torch.{name} with {sorted(kw)}")
        op = _BINARY[name]
        if mode is not None:
            if op != "div" or mode != "floor":
                raise _unsupported(f"torch.{name} with rounding_mode={mode!r}")
            op = "floordiv"
        if alpha is not None:
            if op not in ("add", "sub"):
                raise _unsupported(f"torch.{name} with alpha")
            b = trace.op("mul", b, alpha)
        return trace.op(op, a, b)
    if name in _REFLECTED and len(args) == 2 and not kwargs:
        return trace.op(_REFLECTED[name], args[1], args[0])
    if name == "rsqrt" and len(args) == 1:
        return trace.op("div", 1.0, trace.op("sqrt", args[0]))
    if name == "square" and len(args) == 1:
        return trace.op("mul", args[0], args[0])
    if name == "exp2" and len(args) == 1:
        return trace.op("exp", trace.op("mul", args[0], math.log(2.0)))
    if name == "log2" and len(args) == 1:
        return trace.op("div", trace.op("log", args[0]), math.log(2.0))
    if name == "where" and len(args) == 3 and not kwargs:
        return trace.op("where", *args)
    if name in ("clamp", "clip"):
        x, lo, hi = (list(args) + [None, None])[:3]
        lo, hi = kwargs.get("min", lo), kwargs.get("max", hi)
        if lo is not None:
            x = trace.op("max", x, lo)
        if hi is not None:
            x = trace.op("min", x, hi)
        return x if isinstance(x, _Sym) else trace.add("const", (), float(x))
    if name in _CASTS:
        x = args[0]
        dtypes = [a for a in list(args[1:]) + list(kwargs.values()) if isinstance(a, torch.dtype)]
        if any(not (d.is_floating_point or d == torch.bool) for d in dtypes):
            raise _unsupported(f"a cast to {dtypes[0]} (integer casts truncate; use floor)")
        return x
    raise _unsupported(f"torch.{name}")


class _Sym:
    """A placeholder for a traced value: operations on it record nodes."""

    __slots__ = ("_trace", "_i")

    def __init__(self, trace: _Trace, i: int):
        self._trace, self._i = trace, i

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func)).strip("_")
        return _call(name, args, kwargs or {})

    def __bool__(self):
        raise _unsupported("Python control flow on a traced value (if, and, or, not, bool()): "
                           "use torch.where")

    def __index__(self):
        raise _unsupported("a traced value as a Python integer")

    def __float__(self):
        raise _unsupported("a traced value as a Python float")

    __int__ = __index__

    def __getitem__(self, index):
        raise _unsupported("indexing a traced value")

    def __getattr__(self, name):
        # Tensor-method forms: score.exp(), q_idx.float(), ...
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **kw: _call(name, (self,) + a, kw)

    def __repr__(self):
        return f"<traced value {self._i}>"


def _dunder(op: str, reflected: bool = False):
    if reflected:
        return lambda self, other: self._trace.op(op, other, self)
    return lambda self, other: self._trace.op(op, self, other)


for _name, _op in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
                   ("floordiv", "floordiv"), ("mod", "rem"), ("pow", "pow"), ("and", "and"),
                   ("or", "or")):
    setattr(_Sym, f"__{_name}__", _dunder(_op))
    setattr(_Sym, f"__r{_name}__", _dunder(_op, True))
for _name, _op in (("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge"), ("eq", "eq"),
                   ("ne", "ne")):
    setattr(_Sym, f"__{_name}__", _dunder(_op))
_Sym.__neg__ = lambda self: self._trace.op("neg", self)
_Sym.__pos__ = lambda self: self
_Sym.__abs__ = lambda self: self._trace.op("abs", self)
_Sym.__invert__ = lambda self: self._trace.op("not", self)
_Sym.__hash__ = None  # __eq__ records a node


def trace_score_mod(score_mod: Callable) -> "_ext.ScoreMod":
    """Records ``score_mod(score, b, h, q_idx, kv_idx)`` into the extension's program (what
    ``flex_attention`` hands the kernels). Raises `ScoreModError` naming what it cannot record."""
    if not callable(score_mod):
        raise TypeError(f"flashattn: score_mod must be callable, got {type(score_mod).__name__}")
    trace = _Trace()
    args = [trace.add(op) for op in ("score", "b", "h", "q_idx", "kv_idx")]
    out = trace.lift(score_mod(*args))
    return _ext.ScoreMod.from_program(trace.nodes, trace.tables, out)


def _opts(scale: float, block_mask: Optional[BlockMask], score_mod) -> dict:
    # The mask's two tensors, read in place for this call.
    mask = None if block_mask is None else _ops._MaskArg(
        block_mask._kinds, block_mask._bits, block_mask.shape[2], block_mask.shape[3])
    opts = _ops._opts(scale, False, -1, -1, 0.0, None, None, block_mask=mask)
    opts["score_mod"] = score_mod
    return opts


class _Flex(torch.autograd.Function):
    """Forward and backward with a traced score function (and a block mask), on flashattn's
    ``[B, S, H, D]`` views."""

    @staticmethod
    def forward(ctx, q, k, v, scale, score_mod, block_mask):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        views = [_ops._view(n, t) for n, t in (("q", q), ("k", k), ("v", v), ("out", out),
                                                ("lse", lse))]
        _ext.fwd(*views, _opts(scale, block_mask, score_mod))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.extra = (scale, score_mod, block_mask)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # The gradient of lse is not propagated (as flash-attn's backward).
        q, k, v, out, lse = ctx.saved_tensors
        scale, score_mod, block_mask = ctx.extra
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format)
                      for t in (q, k, v))
        views = [_ops._view(n, t) for n, t in (("q", q), ("k", k), ("v", v), ("out", out),
                                                ("lse", lse), ("dout", dout), ("dq", dq),
                                                ("dk", dk), ("dv", dv))]
        _ext.bwd(*views, None, _opts(scale, block_mask, score_mod))
        return dq, dk, dv, None, None, None


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Optional[Callable] = None,
    block_mask: Optional[BlockMask] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
):
    """FlexAttention's call on ``[B, H, S, D]`` tensors (no copy: strided views of flashattn's
    ``[B, S, H, D]`` layout): ``softmax(score_mod(q·kᵀ·scale))·v`` with the mask of
    ``block_mask`` (or none). ``score_mod(score, b, h, q_idx, kv_idx)`` is traced once per call
    (see the module's notes); the mask then hides pairs whatever their scores, and a score the
    function makes -inf hides its pair too. ``scale``: 1/sqrt(D) by default. Key/value heads
    other than the query's need ``enable_gqa`` (query heads a multiple of them). With
    ``return_lse``, ``(out, lse)``, lse f32 ``[B, H, S_q]`` (natural log)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"flashattn: flex_attention takes 4-D [B, H, S, D] tensors; "
                             f"`{name}` is {getattr(t, 'shape', type(t).__name__)}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"flashattn: query has {query.shape[1]} heads and key {key.shape[1]}: "
                         "pass enable_gqa=True for grouped-query attention")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if score_mod is None:
        from .interface import flash_attn_func

        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True,
                                      block_mask=block_mask)
        out = out.transpose(1, 2)
        return (out, lse) if return_lse else out
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu":
            raise FlashAttnError(f"score_mod is supported on CPU tensors only; `{name}` is on "
                                 f"{t.device}", "ScoreModUnsupported")
    if block_mask is not None:
        check_block_mask(block_mask, q=q, k=k, v=v)
    program = trace_score_mod(score_mod)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    out, lse = _Flex.apply(q, k, v, float(scale), program, block_mask)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out

"""Shared helpers (imported by the test modules; conftest.py puts this folder on sys.path) for flashattn's test suite.

The accuracy rule (project standard): a result in f32/f16/bf16 is compared with a float64
reference (``attention_ref`` on the same inputs widened to f64); its largest error must stay
within ``factor`` (2 for outputs, 3 for gradients) times the largest error of the same
computation done naively in the input precision (``attention_ref(..., dtype=<input dtype>)``,
gradients through torch autograd in that precision), plus a small floor of a few ulp.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from flashattn.reference import attention_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def dtype_id(d: torch.dtype) -> str:
    return DTYPE_IDS.get(d, str(d).removeprefix("torch."))


# ---- data ------------------------------------------------------------------------------------


def randn(shape: Sequence[int], dtype=torch.float32, *, seed: int, scale: float = 1.0,
          requires_grad: bool = False) -> torch.Tensor:
    """Seeded normal data (never zeros), drawn in f64 then rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def make_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype=torch.float32, *,
             seed=0, q_scale=1.0, requires_grad=False):
    q = randn((batch, seqlen_q, heads, head_dim), dtype, seed=seed, scale=q_scale,
              requires_grad=requires_grad)
    k = randn((batch, seqlen_k, heads_kv, head_dim), dtype, seed=seed + 1,
              requires_grad=requires_grad)
    v = randn((batch, seqlen_k, heads_kv, head_dim), dtype, seed=seed + 2,
              requires_grad=requires_grad)
    return q, k, v


def leaf64(t: torch.Tensor, requires_grad=True) -> torch.Tensor:
    return t.detach().double().requires_grad_(requires_grad)


def leaf(t: torch.Tensor, requires_grad=True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(requires_grad)


def naive_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the naive comparison computation runs in."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


# ---- error bounds ----------------------------------------------------------------------------


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def floor_for(dtype: torch.dtype, ref: torch.Tensor, ulps: float = 2.0) -> float:
    """A few ulp of ``dtype`` at the reference's magnitude (1e-5 at least for f32)."""
    mag = float(ref.detach().abs().max()) if ref.numel() else 0.0
    f = ulps * _eps(dtype) * max(mag, 1e-3)
    if dtype == torch.float32:
        f = max(f, 1e-5)
    return f


def max_err(a: torch.Tensor, b: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    d = (a.detach().double() - b.detach().double()).abs()
    if mask is not None:
        d = d[mask]
    return float(d.max()) if d.numel() else 0.0


def assert_close_to_ref(got: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, *,
                        dtype: torch.dtype, factor: float = 2.0, floor: Optional[float] = None,
                        name: str = "out"):
    """``max|got - ref| <= factor * max|naive - ref| + floor``; also: got is finite where ref is,
    and has ref's shape."""
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    g64 = got.detach().double()
    assert torch.isfinite(g64[finite]).all(), f"{name}: NaN/inf where the reference is finite"
    if (~finite).any():
        assert torch.equal(g64[~finite], ref.detach().double()[~finite]), (
            f"{name}: entries where the reference is non-finite differ")
    if floor is None:
        floor = floor_for(dtype, ref)
    err = max_err(got, ref, finite)
    nerr = max_err(naive, ref, finite)
    bound = factor * nerr + floor
    assert err <= bound, (
        f"{name}: max error {err:.3e} > {factor} x naive {nerr:.3e} + floor {floor:.1e} = {bound:.3e}"
    )


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor, naive_lse: torch.Tensor, *,
                     dtype: torch.dtype, name="lse"):
    """lse is f32 whatever the input dtype: its error is bounded like out's, with an f32 floor
    relative to its magnitude."""
    assert lse.dtype == torch.float32, f"{name}: dtype {lse.dtype}"
    floor = 1e-5 * max(1.0, float(ref_lse[torch.isfinite(ref_lse)].abs().max())
                       if torch.isfinite(ref_lse).any() else 1.0)
    assert_close_to_ref(lse, ref_lse, naive_lse, dtype=dtype, floor=floor, name=name)


# ---- forward / backward comparison -----------------------------------------------------------


def check_forward(inputs, dtype, ref_kwargs, *, out, lse=None, factor=2.0):
    """Runs the reference in f64 and naively in ``dtype`` on ``inputs`` (q, k, v) and bounds
    ``out`` (and ``lse`` if given) against it."""
    q, k, v = inputs
    ref_out, ref_lse = attention_ref(q.detach().double(), k.detach().double(),
                                     v.detach().double(), **ref_kwargs)
    nd = naive_dtype(dtype)
    nv_out, nv_lse = attention_ref(q.detach().to(nd), k.detach().to(nd), v.detach().to(nd),
                                   dtype=nd, **ref_kwargs)
    nv_out = nv_out.to(dtype)
    assert out.dtype == dtype
    assert_close_to_ref(out, ref_out, nv_out, dtype=dtype, factor=factor)
    if lse is not None:
        assert_lse_close(lse, ref_lse, nv_lse, dtype=dtype)
    return ref_out, ref_lse


def check_gradients(out, inputs, dtype, ref_kwargs, *, seed=1234, extra=None, names=None,
                    factor=3.0):
    """Backward of ``out`` (from the function under test, built on ``inputs``, leaves with
    requires_grad) against autograd through the reference in f64 and in ``dtype``.

    ``extra``: a learnable sink (f32 leaf) that ref_kwargs passes as ``learnable_sink``; its
    gradient is checked too."""
    dout = randn(out.shape, out.dtype, seed=seed)
    leaves = list(inputs) + ([extra] if extra is not None else [])
    grads = torch.autograd.grad(out, leaves, dout)
    for g in grads:
        assert g is not None

    r_leaves = [leaf64(t) for t in leaves]
    kw = dict(ref_kwargs)
    if extra is not None:
        kw["learnable_sink"] = r_leaves[-1]
    r_out, _ = attention_ref(*r_leaves[:3], **kw)
    r_grads = torch.autograd.grad(r_out, r_leaves, dout.double())

    nd = naive_dtype(dtype)
    n_leaves = [leaf(t.detach().to(nd)) for t in inputs]
    if extra is not None:
        n_leaves.append(leaf(extra.detach()))
        kw["learnable_sink"] = n_leaves[-1]
    n_out, _ = attention_ref(*n_leaves[:3], dtype=nd, **kw)
    n_grads = torch.autograd.grad(n_out, n_leaves, dout.to(nd))

    names = names or ["dq", "dk", "dv", "dsink"]
    for name, g, r, n, t in zip(names, grads, r_grads, n_grads, leaves):
        assert g.dtype == t.dtype, f"{name}: dtype {g.dtype} != {t.dtype}"
        assert_close_to_ref(g, r, n.to(g.dtype), dtype=g.dtype, factor=factor,
                            floor=floor_for(g.dtype, r), name=name)
    return grads, r_grads


# ---- dropout ---------------------------------------------------------------------------------


def keep_from_s_dmask(s_dmask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """flash-attn's S_dmask encodes dropped entries in the sign bit."""
    return ~torch.signbit(s_dmask[:, :, :seqlen_q, :seqlen_k])


def ref_with_keep(q, k, v, keep, dropout_p, *, dtype=torch.float64, **kw):
    """Attention with dropout applied through an explicit keep mask ``[batch, heads, sq, sk]``
    (batched layout), written independently of the package's dropout: probabilities from
    ``attention_ref(return_probs=True)``, then ``(P * keep / (1 - p)) @ v``."""
    _, lse, probs = attention_ref(q, k, v, dtype=dtype, return_probs=True, **kw)
    h, hk = q.shape[2], k.shape[2]
    outs = []
    for b, p in enumerate(probs):
        pd = torch.where(keep[b], p / (1.0 - dropout_p), torch.zeros_like(p))
        vh = v[b].to(dtype).transpose(0, 1).repeat_interleave(h // hk, dim=0)
        outs.append(torch.matmul(pd, vh).transpose(0, 1))
    return torch.stack(outs), lse


# ---- misc ------------------------------------------------------------------------------------


def alibi(batch: Optional[int], heads: int, seed: int = 7) -> torch.Tensor:
    """ALiBi slopes (f32, positive): [heads] or [batch, heads]."""
    shape = (heads,) if batch is None else (batch, heads)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 0.5 + 0.05).float()


def sink(heads: int, seed: int = 11, requires_grad=False) -> torch.Tensor:
    return randn((heads,), torch.float32, seed=seed, requires_grad=requires_grad)


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def ceil_div(a, b):
    return -(-a // b)


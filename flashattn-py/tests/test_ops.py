"""The torch.library ops themselves: torch.library.opcheck on each (schema, fake implementation,
autograd registration, AOT dispatch), and torch.compile(fullgraph=True) against eager.

Dropout stays 0 here: opcheck compares repeated runs, which random masks would break."""

from __future__ import annotations

import pytest
import torch

import flashattn  # noqa: F401  (registers torch.ops.flashattn)
from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from helpers import alibi, cu_seqlens, make_qkv, randn, sink

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# torch's schema check compares tensors with torch.allclose, which has no float8 CPU kernel
# ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): a torch limitation, so with FP8
# tensors the schema's mutation claims are checked by hand instead (inputs bit-identical after).
NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _bits(t):
    return t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone()


def _fwd_args(q, k, v, *, cu_q=None, cu_k=None, causal=True, wl=-1, wr=-1, softcap=0.0,
              slopes=None, s=None):
    return (q, k, v, cu_q, cu_k, 0.0, q.shape[-1] ** -0.5, causal, wl, wr, softcap, slopes, s)


@pytest.mark.parametrize("dt", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("opts", [
    dict(),
    dict(causal=False, wl=8, wr=3, softcap=5.0),
    dict(slopes="alibi", s="sink"),
], ids=["causal", "window-softcap", "alibi-sink"])
def test_opcheck_fwd(dt, opts):
    q, k, v = make_qkv(2, 17, 23, 4, 2, 40, dt, seed=1, requires_grad=True)
    opts = dict(opts)
    if opts.get("slopes"):
        opts["slopes"] = alibi(2, 4)
    if opts.get("s"):
        opts["s"] = sink(4, requires_grad=True)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, _fwd_args(q, k, v, **opts))


def test_opcheck_fwd_varlen():
    lens_q, lens_k = [5, 1, 9], [7, 12, 3]
    q = randn((15, 4, 40), F16, seed=2, requires_grad=True)
    k = randn((22, 2, 40), F16, seed=3, requires_grad=True)
    v = randn((22, 2, 40), F16, seed=4, requires_grad=True)
    args = _fwd_args(q, k, v, cu_q=cu_seqlens(lens_q), cu_k=cu_seqlens(lens_k))
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args)


@pytest.mark.parametrize("with_sink", [False, True])
def test_opcheck_bwd(with_sink):
    q, k, v = make_qkv(2, 17, 23, 4, 2, 40, F32, seed=5)
    s = sink(4) if with_sink else None
    out, lse, rng = torch.ops.flashattn.fwd(*_fwd_args(q, k, v, s=s))
    dout = randn(out.shape, F32, seed=6)
    args = (dout, q, k, v, out, lse, None, None, 0.0, 40 ** -0.5, True, -1, -1, 0.0, None, s, rng)
    torch.library.opcheck(torch.ops.flashattn.bwd.default, args)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_opcheck_fwd_fp8(fmt):
    fmt = getattr(torch, fmt, None)
    if fmt is None:
        pytest.skip("torch without float8")
    q, k, v = (t.to(fmt) for t in make_qkv(2, 17, 23, 4, 2, 40, F32, seed=7))
    d = torch.tensor([0.5])
    args = (q, k, v, None, None, d, torch.tensor([[1.5, 0.7], [0.9, 1.1]]), d, 40 ** -0.5, True,
            -1, -1, 0.0, None, None)
    before = [_bits(t) for t in (q, k, v)]
    torch.library.opcheck(torch.ops.flashattn.fwd_fp8.default, args, test_utils=NO_SCHEMA)
    out, lse = torch.ops.flashattn.fwd_fp8(*args)
    assert out.dtype == BF16 and lse.dtype == F32
    for t, b in zip((q, k, v), before):
        assert torch.equal(_bits(t), b), "fwd_fp8 declares no mutation"


def _kv_args(q, kc, vc, sl, kn=None, vn=None, *, cos=None, sin=None, batch_idx=None,
             leftpad=None, table=None, cu_q=None, cu_k=None, causal=True, num_splits=0):
    return (q, kc, vc, sl, kn, vn, cos, sin, batch_idx, leftpad, table, cu_q, cu_k, None, None,
            q.shape[-1] ** -0.5, causal, -1, -1, 0.0, True, None, None, num_splits)


@pytest.mark.parametrize("variant", ["append", "rotary-batch_idx", "paged", "no-new"])
def test_opcheck_fwd_kvcache(variant):
    b, n, h, hk, d = 2, 2, 4, 2, 32
    q = randn((b, n, h, d), F16, seed=8)
    kn, vn = randn((b, n, hk, d), F16, seed=9), randn((b, n, hk, d), F16, seed=10)
    sl = torch.tensor([5, 20], dtype=torch.int32)
    if variant == "paged":
        kc, vc = randn((6, 16, hk, d), F16, seed=11), randn((6, 16, hk, d), F16, seed=12)
        table = torch.tensor([[4, 0], [2, 5]], dtype=torch.int32)
        args = _kv_args(q, kc, vc, sl, kn, vn, table=table)
    else:
        rows = 3 if variant == "rotary-batch_idx" else b
        kc, vc = randn((rows, 40, hk, d), F16, seed=11), randn((rows, 40, hk, d), F16, seed=12)
        if variant == "append":
            args = _kv_args(q, kc, vc, sl, kn, vn, num_splits=2)
        elif variant == "no-new":
            args = _kv_args(q, kc, vc, sl, causal=False)
        else:
            ang = torch.arange(40, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1, d // 2)
            args = _kv_args(q, kc, vc, sl, kn, vn, cos=ang.cos().half(), sin=ang.sin().half(),
                            batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    torch.library.opcheck(torch.ops.flashattn.fwd_kvcache.default, args)


def test_opcheck_fwd_kvcache_fp8():
    fmt = getattr(torch, "float8_e4m3fn", None)
    if fmt is None:
        pytest.skip("torch without float8")
    b, n, h, hk, d = 2, 1, 2, 2, 32
    q = randn((b, n, h, d), BF16, seed=13)
    kn, vn = randn((b, n, hk, d), BF16, seed=14), randn((b, n, hk, d), BF16, seed=15)
    kc = randn((b, 24, hk, d), F32, seed=16).to(fmt)
    vc = randn((b, 24, hk, d), F32, seed=17).to(fmt)
    sl = torch.tensor([3, 10], dtype=torch.int32)
    args = list(_kv_args(q, kc, vc, sl, kn, vn))
    args[13], args[14] = torch.tensor([0.5]), torch.tensor([2.0])
    # Mutation as the schema declares: the caches change (the append), the other inputs do not.
    mine = list(args)
    mine[1], mine[2] = kc.clone(), vc.clone()
    q0, kn0 = q.clone(), kn.clone()
    torch.ops.flashattn.fwd_kvcache(*mine)
    assert not torch.equal(_bits(mine[1]), _bits(kc)) and not torch.equal(_bits(mine[2]), _bits(vc))
    assert torch.equal(q, q0) and torch.equal(kn, kn0)
    torch.library.opcheck(torch.ops.flashattn.fwd_kvcache.default, tuple(args),
                          test_utils=NO_SCHEMA)


# ---- torch.compile ---------------------------------------------------------------------------


def test_compile_forward_backward_inductor():
    # One inductor compile (the slow part of this file) covering forward and backward.
    torch._dynamo.reset()
    b, h = 2, 4
    q, k, v = make_qkv(b, 33, 47, h, 2, 40, F32, seed=21, requires_grad=True)
    slopes = alibi(b, h)
    s = sink(h, requires_grad=True)

    def f(q, k, v, s):
        out = flash_attn_func(q, k, v, causal=True, window_size=(20, -1), alibi_slopes=slopes,
                              learnable_sink=s)
        return (out * out).sum(), out

    compiled = torch.compile(f, fullgraph=True)
    loss_c, out_c = compiled(q, k, v, s)
    grads_c = torch.autograd.grad(loss_c, (q, k, v, s))
    loss_e, out_e = f(q, k, v, s)
    grads_e = torch.autograd.grad(loss_e, (q, k, v, s))
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-6)
    for a, e in zip(grads_c, grads_e):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_compile_varlen_and_kvcache_aot_eager():
    # fullgraph capture of the varlen op and of the mutating kvcache op (AOT autograd
    # functionalisation of the in-place cache update), through the cheap aot_eager backend.
    torch._dynamo.reset()
    lens = [9, 1, 14]
    cu = cu_seqlens(lens)
    q = randn((24, 2, 32), BF16, seed=22, requires_grad=True)
    k = randn((24, 2, 32), BF16, seed=23, requires_grad=True)
    v = randn((24, 2, 32), BF16, seed=24, requires_grad=True)

    def varlen(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, causal=True)

    out_c = torch.compile(varlen, fullgraph=True, backend="aot_eager")(q, k, v)
    out_e = varlen(q, k, v)
    assert torch.equal(out_c, out_e)
    dout = randn(out_e.shape, BF16, seed=25)
    gc = torch.autograd.grad(out_c, (q, k, v), dout)
    ge = torch.autograd.grad(out_e, (q, k, v), dout)
    for a, e in zip(gc, ge):
        assert torch.equal(a, e)

    kc, vc = randn((2, 32, 2, 32), F16, seed=26), randn((2, 32, 2, 32), F16, seed=27)
    qd = randn((2, 1, 2, 32), F16, seed=28)
    kn, vn = randn((2, 1, 2, 32), F16, seed=29), randn((2, 1, 2, 32), F16, seed=30)
    sl = torch.tensor([4, 17], dtype=torch.int32)

    def decode(qd, kc, vc, kn, vn):
        return flash_attn_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=sl, causal=True)

    kc_e, vc_e = kc.clone(), vc.clone()
    out_e = decode(qd, kc_e, vc_e, kn, vn)
    out_c = torch.compile(decode, fullgraph=True, backend="aot_eager")(qd, kc, vc, kn, vn)
    assert torch.equal(out_c, out_e)
    assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e), "the compiled call must update the caches"


# ---- eager calls that skip the dispatcher ---------------------------------------------------------
#
# flashattn.interface runs an op's body itself when nothing could see the op (plain CPU tensors, no
# gradient to record, no mode, tracing or profiler: `_ops._direct`). These check that the op is
# still what such observers see, that both ways give the same bits and the same side effects.


def test_direct_call_matches_the_op():
    q, k, v = make_qkv(2, 19, 31, 4, 2, 40, BF16, seed=41)
    slopes, s = alibi(2, 4), sink(4)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, learnable_sink=s)
    out_op, lse_op, _ = torch.ops.flashattn.fwd(
        *_fwd_args(q, k, v, slopes=slopes, s=s))
    assert torch.equal(out, out_op)
    out2, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, learnable_sink=s,
                                   return_attn_probs=True)
    assert torch.equal(out2, out_op) and torch.equal(lse, lse_op)


def test_observers_see_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = make_qkv(1, 8, 8, 2, 2, 32, F32, seed=42)
    kc, vc = randn((1, 16, 2, 32), F32, seed=43), randn((1, 16, 2, 32), F32, seed=44)
    with Log() as log:
        flash_attn_func(q, k, v)
        flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=5)
    assert any("flashattn.fwd" in o for o in log.ops), log.ops
    assert any("flashattn.fwd_kvcache" in o for o in log.ops), log.ops
    with torch.profiler.profile() as prof:
        flash_attn_func(q, k, v)
    assert any("flashattn::fwd" in e.name for e in prof.events())


def test_direct_kvcache_bumps_the_caches_versions():
    # As the op's ADInplaceOrView kernel does: autograd then notices a cache written in place.
    kc, vc = randn((1, 16, 2, 32), F32, seed=45), randn((1, 16, 2, 32), F32, seed=46)
    q, kn, vn = (randn((1, 1, 2, 32), F32, seed=s) for s in (47, 48, 49))
    before = (kc._version, vc._version)
    flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5)
    assert kc._version > before[0] and vc._version > before[1]


def test_calls_from_other_threads():
    # Each Python thread joins a pool of its own on its first call (the caller is one of its
    # threads); a later call with another thread count goes to a shared pool. Same bits from
    # every thread, also for the decode (its split count follows the thread count, so it is
    # compared at equal counts; torch's count is per process, hence set here, between batches).
    from concurrent.futures import ThreadPoolExecutor

    q, k, v = make_qkv(2, 67, 67, 4, 2, 64, F32, seed=50)
    kc, vc = randn((2, 600, 2, 64), F32, seed=51), randn((2, 600, 2, 64), F32, seed=52)
    qd = randn((2, 1, 4, 64), F32, seed=53)
    sl = torch.tensor([599, 300], dtype=torch.int32)

    def calls(_=None):
        return (flash_attn_func(q, k, v, causal=True),
                flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sl))

    saved = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(3) as ex:
            for n in (1, 2, 1):
                torch.set_num_threads(n)
                want = calls()
                for out, dec in ex.map(calls, range(6)):
                    assert torch.equal(out, want[0])
                    assert torch.equal(dec, want[1])
    finally:
        torch.set_num_threads(saved)

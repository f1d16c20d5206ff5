"""Gradients (dq, dk, dv, and the learnable sink's) against torch autograd through the float64
reference, within 3x the error of autograd through the reference in the input precision."""

from __future__ import annotations

import pytest
import torch

from flashattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from helpers import (DTYPES, alibi, check_gradients, dtype_id, leaf, make_qkv, randn, sink)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (dtype, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal)
SHAPES = [
    (F32, 2, 113, 203, 4, 2, 59, True),
    (F16, 2, 203, 113, 4, 1, 40, False),
    (BF16, 1, 113, 203, 4, 4, 111, False),
    (F16, 1, 1, 203, 2, 1, 256, True),
    (BF16, 2, 113, 113, 4, 2, 256, True),
    (F32, 2, 1, 1, 2, 2, 40, False),
    (BF16, 2, 203, 1, 2, 1, 59, True),
    (F16, 1, 1023, 1023, 2, 1, 64, True),
]


def _id(c):
    dt, b, sq, sk, h, hk, d, causal = c
    return f"{dtype_id(dt)}-b{b}-sq{sq}-sk{sk}-h{h}-hk{hk}-d{d}" + ("-causal" if causal else "")


@pytest.mark.parametrize("case", SHAPES, ids=[_id(c) for c in SHAPES])
def test_backward_shapes(case):
    dt, b, sq, sk, h, hk, d, causal = case
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=sq * 3 + d, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal)
    check_gradients(out, (q, k, v), dt, dict(causal=causal))


OPTIONS = {
    "window": dict(window_size=(17, 4)),
    "window-causal": dict(window_size=(30, -1), causal=True),
    "softcap": dict(softcap=6.0, causal=True),
    "alibi[h]": dict(alibi_slopes=alibi(None, 4)),
    "alibi[b,h]": dict(alibi_slopes=alibi(2, 4), causal=True),
    "scale": dict(scale=0.3),
    "everything": dict(window_size=(50, 10), softcap=8.0, alibi_slopes=alibi(2, 4), scale=0.2),
}


def _call_kwargs(kw):
    kw = dict(kw)
    if "scale" in kw:
        kw["softmax_scale"] = kw.pop("scale")
    return kw


@pytest.mark.parametrize("dt", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_backward_options(dt, name):
    kw = OPTIONS[name]
    q, k, v = make_qkv(2, 113, 203, 4, 2, 59, dt, seed=7, q_scale=2.0, requires_grad=True)
    out = flash_attn_func(q, k, v, **_call_kwargs(kw))
    check_gradients(out, (q, k, v), dt, kw)


@pytest.mark.parametrize("dt", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_learnable_sink(dt, causal):
    h = 4
    q, k, v = make_qkv(2, 113, 203, h, 2, 40, dt, seed=17, requires_grad=True)
    s = sink(h, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal, learnable_sink=s)
    grads, _ = check_gradients(out, (q, k, v), dt, dict(causal=causal), extra=s)
    dsink = grads[3]
    assert dsink.shape == (h,) and dsink.dtype == torch.float32
    assert (dsink != 0).all()


def test_backward_sink_with_empty_rows():
    # seqlen_q > seqlen_k causal: rows that see only the sink contribute to dsink and nothing else.
    h = 2
    q, k, v = make_qkv(1, 40, 9, h, 1, 40, F32, seed=19, requires_grad=True)
    s = sink(h, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, learnable_sink=s)
    grads, _ = check_gradients(out, (q, k, v), F32, dict(causal=True), extra=s)
    assert (grads[0][:, :31] == 0).all()


@pytest.mark.parametrize("dt", DTYPES, ids=dtype_id)
def test_backward_huge_logits(dt):
    q, k, v = make_qkv(2, 113, 203, 4, 2, 64, dt, seed=23, q_scale=30.0, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True)
    grads, _ = check_gradients(out, (q, k, v), dt, dict(causal=True))
    for g in grads:
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("dt", [F32, BF16], ids=dtype_id)
def test_backward_strided_views(dt):
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 40
    big_q = randn((b, sq, h * 2, d + 8), dt, seed=29, requires_grad=True)
    big_k = randn((b, sk + 3, hk, d + 1), dt, seed=30, requires_grad=True)
    big_v = randn((b * 2, sk, hk, d), dt, seed=31, requires_grad=True)
    q = big_q[:, :, ::2, 8:]
    k = big_k[:, 3:, :, :d]
    v = big_v[::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = flash_attn_func(q, k, v, causal=True)
    dout = randn(out.shape, dt, seed=32)
    gq, gk, gv = torch.autograd.grad(out, (big_q, big_k, big_v), dout)
    # Gradients land in the viewed elements only.
    assert (gq[:, :, 1::2] == 0).all() and (gq[..., :8] == 0).all()
    assert (gk[:, :3] == 0).all() and (gv[1::2] == 0).all()
    ql, kl, vl = (leaf(t.contiguous()) for t in (q, k, v))
    out_c = flash_attn_func(ql, kl, vl, causal=True)
    cq, ck, cv = torch.autograd.grad(out_c, (ql, kl, vl), dout)
    assert torch.equal(gq[:, :, ::2, 8:], cq)
    assert torch.equal(gk[:, 3:, :, :d], ck)
    assert torch.equal(gv[::2], cv)
    check_gradients(flash_attn_func(ql, kl, vl, causal=True), (ql, kl, vl), dt,
                    dict(causal=True), seed=32)


def test_backward_non_contiguous_dout():
    q, k, v = make_qkv(2, 64, 80, 2, 2, 40, F16, seed=37, requires_grad=True)
    out = flash_attn_func(q, k, v)
    dout_big = randn((2, 64, 2, 80), F16, seed=38)
    dout = dout_big[..., ::2]  # last dim strided: the op must cope (it makes it contiguous)
    g1 = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), dout.contiguous())
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_kvpacked_and_qkvpacked_backward():
    b, s, h, d = 2, 113, 4, 59
    qkv = randn((b, s, 3, h, d), BF16, seed=41, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    dout = randn(out.shape, BF16, seed=42)
    (g,) = torch.autograd.grad(out, qkv, dout)
    parts = [leaf(qkv[:, :, i].detach().contiguous()) for i in range(3)]
    ref = flash_attn_func(*parts, causal=True)
    gp = torch.autograd.grad(ref, parts, dout)
    for i in range(3):
        assert torch.equal(g[:, :, i], gp[i])
    check_gradients(flash_attn_func(*parts, causal=True), parts, BF16, dict(causal=True), seed=42)

    q = randn((b, s, h, d), F16, seed=43, requires_grad=True)
    kv = randn((b, 150, 2, 2, d), F16, seed=44, requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, window_size=(20, 5))
    dout = randn(out.shape, F16, seed=45)
    gq, gkv = torch.autograd.grad(out, (q, kv), dout)
    k2, v2 = leaf(kv[:, :, 0].detach().contiguous()), leaf(kv[:, :, 1].detach().contiguous())
    q2 = leaf(q)
    out2 = flash_attn_func(q2, k2, v2, window_size=(20, 5))
    rq, rk, rv = torch.autograd.grad(out2, (q2, k2, v2), dout)
    assert torch.equal(gq, rq) and torch.equal(gkv[:, :, 0], rk) and torch.equal(gkv[:, :, 1], rv)


def test_backward_deterministic_bitwise():
    # deterministic=True (flashattn is always deterministic): the same gradients bit for bit on
    # repeat and for any thread count.
    q, k, v = make_qkv(2, 203, 203, 4, 1, 64, BF16, seed=47, requires_grad=True)
    dout = randn((2, 203, 4, 64), BF16, seed=48)

    def grads():
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    first = grads()
    second = grads()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = grads()
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_lse_gradient_is_ignored():
    # Using lse in a loss is allowed; as flash-attn's, the backward ignores lse's gradient (a
    # documented limitation), so the gradient equals that of the out term alone.
    q, k, v = make_qkv(1, 30, 40, 2, 2, 40, F32, seed=53, requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    g_out = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    g_both = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    for a, b in zip(g_out, g_both):
        assert torch.equal(a, b)


def test_double_call_accumulates_into_grad():
    q, k, v = make_qkv(1, 30, 40, 2, 2, 40, F32, seed=59, requires_grad=True)
    flash_attn_func(q, k, v).sum().backward()
    once = q.grad.clone()
    flash_attn_func(q, k, v).sum().backward()
    torch.testing.assert_close(q.grad, 2 * once, rtol=0, atol=0)


def test_backward_partial_requires_grad():
    q = randn((1, 30, 2, 16), F32, seed=61, requires_grad=True)
    k = randn((1, 40, 2, 16), F32, seed=62)
    v = randn((1, 40, 2, 16), F32, seed=63, requires_grad=True)
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert k.grad is None and q.grad is not None and v.grad is not None
    ql, kl, vl = leaf(q), leaf(k), leaf(v)
    flash_attn_func(ql, kl, vl, causal=True).sum().backward()
    assert torch.equal(q.grad, ql.grad) and torch.equal(v.grad, vl.grad)

"""Dropout: the output and gradients must equal the reference's given the same keep mask (read
from S_dmask's sign bits, or regenerated from rng_state's seed with
``flashattn._ops.dropout_keep_mask``), and the mask must drop about a fraction p of entries."""

from __future__ import annotations

import pytest
import torch

from flashattn import _ops, flash_attn_func, flash_attn_varlen_func
from flashattn.reference import attention_ref
from helpers import (alibi, assert_close_to_ref, ceil_div, cu_seqlens, dtype_id, floor_for,
                     keep_from_s_dmask, leaf, leaf64, make_qkv, naive_dtype, randn,
                     ref_with_keep)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _fwd(q, k, v, p, causal=False, window=(-1, -1), softcap=0.0, slopes=None, sink=None):
    scale = q.shape[-1] ** -0.5
    return _ops.fwd(q, k, v, None, None, p, scale, causal, window[0], window[1], softcap, slopes,
                    sink)


@pytest.mark.parametrize("dt,p,causal,hk", [(F32, 0.17, False, 4), (F16, 0.5, True, 2),
                                            (BF16, 0.3, False, 1), (F16, 0.9, True, 4)],
                         ids=lambda x: dtype_id(x) if isinstance(x, torch.dtype) else str(x))
def test_dropout_forward_matches_mask_from_seed(dt, p, causal, hk):
    b, sq, sk, h, d = 2, 113, 203, 4, 59
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=1)
    out, lse, rng_state = _fwd(q, k, v, p, causal=causal)
    seed = int(rng_state[0])
    keep = _ops.dropout_keep_mask(seed, p, b, h, sq, sk)
    assert keep.shape == (b, h, sq, sk) and keep.dtype == torch.bool
    frac = keep.float().mean().item()
    assert abs(frac - (1 - p)) < 0.02, f"kept fraction {frac} for p={p}"
    kw = dict(causal=causal)
    ref, ref_lse = ref_with_keep(q.double(), k.double(), v.double(), keep, p, **kw)
    nd = naive_dtype(dt)
    naive, _ = ref_with_keep(q.to(nd), k.to(nd), v.to(nd), keep, p, dtype=nd, **kw)
    assert_close_to_ref(out, ref, naive.to(dt), dtype=dt)
    # lse is that of the undropped softmax.
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-4)
    # The package's reference (seeded) agrees with the explicit-mask reference.
    ref2, _ = attention_ref(q.double(), k.double(), v.double(), dropout_p=p, seed=seed, **kw)
    torch.testing.assert_close(ref2, ref, rtol=0, atol=1e-12)


def test_dropout_masks_differ_per_batch_and_head():
    keep = _ops.dropout_keep_mask(1234, 0.5, 2, 2, 64, 64)
    assert not torch.equal(keep[0], keep[1])
    assert not torch.equal(keep[:, 0], keep[:, 1])
    assert torch.equal(keep, _ops.dropout_keep_mask(1234, 0.5, 2, 2, 64, 64))
    assert not torch.equal(keep, _ops.dropout_keep_mask(1235, 0.5, 2, 2, 64, 64))


@pytest.mark.parametrize("dt", [F16, BF16, F32], ids=dtype_id)
def test_dropout_s_dmask_public(dt):
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 40
    p = 0.25
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=2)
    slopes = alibi(None, h)
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=p, causal=True, alibi_slopes=slopes,
                                        return_attn_probs=True)
    assert s_dmask.shape == (b, h, ceil_div(sq, 128) * 128, ceil_div(sk, 128) * 128)
    assert s_dmask.dtype == dt
    assert (s_dmask[:, :, sq:] == 0).all() and (s_dmask[:, :, :, sk:] == 0).all()
    keep = keep_from_s_dmask(s_dmask, sq, sk)
    kw = dict(causal=True, alibi_slopes=slopes)
    # |S_dmask| holds the (undropped) probabilities.
    _, _, probs = attention_ref(q.double(), k.double(), v.double(), return_probs=True, **kw)
    probs = torch.stack(probs)
    assert_close_to_ref(s_dmask[:, :, :sq, :sk].abs().double(), probs, probs.to(dt),
                        dtype=dt, name="S_dmask")
    frac = keep[probs > 0].float().mean().item()
    assert abs(frac - (1 - p)) < 0.03
    ref, _ = ref_with_keep(q.double(), k.double(), v.double(), keep, p, **kw)
    nd = naive_dtype(dt)
    naive, _ = ref_with_keep(q.to(nd), k.to(nd), v.to(nd), keep, p, dtype=nd, **kw)
    assert_close_to_ref(out, ref, naive.to(dt), dtype=dt)


def test_dropout_reproducible_with_manual_seed():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 40, F32, seed=3)
    torch.manual_seed(42)
    a = flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(42)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    c = flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, flash_attn_func(q, k, v))


@pytest.mark.parametrize("dt,p,causal", [(F32, 0.2, True), (BF16, 0.4, False), (F16, 0.1, True)],
                         ids=lambda x: dtype_id(x) if isinstance(x, torch.dtype) else str(x))
def test_dropout_gradients(dt, p, causal):
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 59
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=4, requires_grad=True)
    out, lse, rng_state = _fwd(q, k, v, p, causal=causal)
    keep = _ops.dropout_keep_mask(int(rng_state[0]), p, b, h, sq, sk)
    dout = randn(out.shape, dt, seed=5)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    r = [leaf64(t) for t in (q, k, v)]
    r_out, _ = ref_with_keep(*r, keep, p, causal=causal)
    r_grads = torch.autograd.grad(r_out, r, dout.double())
    nd = naive_dtype(dt)
    n = [leaf(t.detach().to(nd)) for t in (q, k, v)]
    n_out, _ = ref_with_keep(*n, keep, p, causal=causal, dtype=nd)
    n_grads = torch.autograd.grad(n_out, n, dout.to(nd))
    for name, g, rg, ng in zip(("dq", "dk", "dv"), grads, r_grads, n_grads):
        assert_close_to_ref(g, rg, ng.to(dt), dtype=dt, factor=3.0, floor=floor_for(dt, rg),
                            name=name)


def test_dropout_gradients_public_api():
    # Through flash_attn_func (autograd of the public function), the mask taken from S_dmask.
    b, sq, sk, h, hk, d = 1, 113, 113, 2, 1, 40
    p = 0.3
    q, k, v = make_qkv(b, sq, sk, h, hk, d, F32, seed=6, requires_grad=True)
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    keep = keep_from_s_dmask(s_dmask, sq, sk)
    dout = randn(out.shape, F32, seed=7)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    r = [leaf64(t) for t in (q, k, v)]
    r_out, _ = ref_with_keep(*r, keep, p, causal=True)
    torch.testing.assert_close(out.double(), r_out.detach(), rtol=0, atol=1e-5)
    r_grads = torch.autograd.grad(r_out, r, dout.double())
    for g, rg in zip(grads, r_grads):
        torch.testing.assert_close(g.double(), rg, rtol=0, atol=2e-5)


def test_dropout_varlen_matches_seeded_reference():
    lens_q, lens_k = [113, 1, 60], [203, 7, 60]
    h, hk, d, p = 4, 2, 40, 0.35
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn((sum(lens_q), h, d), F16, seed=8)
    k = randn((sum(lens_k), hk, d), F16, seed=9)
    v = randn((sum(lens_k), hk, d), F16, seed=10)
    scale = d ** -0.5
    out, lse, rng_state = _ops.fwd(q, k, v, cq, ck, p, scale, True, -1, -1, 0.0, None, None)
    seed = int(rng_state[0])
    kw = dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, dropout_p=p, seed=seed)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), **kw)
    naive, _ = attention_ref(q, k, v, dtype=F16, **kw)
    assert_close_to_ref(out, ref, naive, dtype=F16)
    # Public function: S_dmask per sequence, padded to the longest.
    out2, _, s_dmask = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                              dropout_p=p, causal=True, return_attn_probs=True)
    assert s_dmask.shape[:2] == (3, h)
    for bi, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        keep = keep_from_s_dmask(s_dmask[bi:bi + 1], lq, lk)
        sl_q, sl_k = slice(int(cq[bi]), int(cq[bi + 1])), slice(int(ck[bi]), int(ck[bi + 1]))
        qs, ks, vs = q[sl_q][None], k[sl_k][None], v[sl_k][None]
        r, _ = ref_with_keep(qs.double(), ks.double(), vs.double(), keep, p, causal=True)
        n, _ = ref_with_keep(qs, ks, vs, keep, p, causal=True, dtype=F16)
        assert_close_to_ref(out2[sl_q][None], r, n, dtype=F16, name=f"out[seq {bi}]")


def test_dropout_with_sink_and_window():
    h = 2
    q, k, v = make_qkv(2, 64, 96, h, 1, 40, F32, seed=11)
    s = randn((h,), F32, seed=12)
    p = 0.2
    out, lse, rng_state = _fwd(q, k, v, p, window=(10, 10), sink=s)
    keep = _ops.dropout_keep_mask(int(rng_state[0]), p, 2, h, 64, 96)
    kw = dict(window_size=(10, 10), learnable_sink=s)
    ref, _ = ref_with_keep(q.double(), k.double(), v.double(), keep, p, **kw)
    naive, _ = ref_with_keep(q, k, v, keep, p, dtype=F32, **kw)
    assert_close_to_ref(out, ref, naive, dtype=F32)


def test_dropout_with_sink_gradients():
    h, p = 2, 0.3
    q, k, v = make_qkv(1, 30, 40, h, 2, 16, F32, seed=13, requires_grad=True)
    s = randn((h,), F32, seed=14, requires_grad=True)
    out, _, rng_state = _fwd(q, k, v, p, sink=s)
    dout = randn(out.shape, F32, seed=15)
    grads = torch.autograd.grad(out, (q, k, v, s), dout)
    r = [leaf64(t) for t in (q, k, v, s)]
    r_out, _ = attention_ref(r[0], r[1], r[2], learnable_sink=r[3], dropout_p=p,
                             seed=int(rng_state[0]))
    torch.testing.assert_close(out.double(), r_out.detach(), rtol=0, atol=1e-5)
    r_grads = torch.autograd.grad(r_out, r, dout.double())
    for g, rg in zip(grads, r_grads):
        torch.testing.assert_close(g.double(), rg, rtol=0, atol=1e-5)


def test_dropout_deterministic_across_threads():
    q, k, v = make_qkv(2, 100, 100, 4, 2, 40, BF16, seed=16, requires_grad=True)

    def run():
        torch.manual_seed(5)
        out = flash_attn_func(q, k, v, dropout_p=0.2, causal=True, deterministic=True)
        return (out,) + torch.autograd.grad(out.float().sum(), (q, k, v))

    first = run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(first, single):
        assert torch.equal(a, b)

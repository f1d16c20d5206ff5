"""Packed sequences (flash_attn_varlen_func and its kv/qkv-packed forms, and block_table paged
keys) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from flashattn import (flash_attn_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func)
from flashattn.reference import attention_ref
from helpers import (alibi, assert_close_to_ref, check_forward, check_gradients, cu_seqlens,
                     dtype_id, leaf, randn, sink)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def packed(lens_q, lens_k, h, hk, d, dt, seed=0, requires_grad=False, q_scale=1.0):
    q = randn((sum(lens_q), h, d), dt, seed=seed, scale=q_scale, requires_grad=requires_grad)
    k = randn((sum(lens_k), hk, d), dt, seed=seed + 1, requires_grad=requires_grad)
    v = randn((sum(lens_k), hk, d), dt, seed=seed + 2, requires_grad=requires_grad)
    return q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k)


# (dtype, lens_q, lens_k, heads, heads_kv, head_dim, causal)
CASES = [
    (F32, [113, 1, 203], [203, 113, 1], 4, 2, 59, True),
    (F16, [113, 203], [113, 203], 4, 4, 40, False),
    (BF16, [1, 1, 1, 1], [203, 7, 113, 1], 4, 1, 111, True),
    (F16, [60, 0, 17], [45, 30, 0], 2, 1, 256, True),
    (BF16, [203, 113], [113, 203], 2, 2, 40, False),
    (F32, [1023], [1023], 2, 1, 64, True),
]


def _id(c):
    dt, lq, lk, h, hk, d, causal = c
    return f"{dtype_id(dt)}-q{'_'.join(map(str, lq))}-k{'_'.join(map(str, lk))}-h{h}-hk{hk}-d{d}" + (
        "-causal" if causal else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_varlen_forward(case):
    dt, lens_q, lens_k, h, hk, d, causal = case
    q, k, v, cq, ck = packed(lens_q, lens_k, h, hk, d, dt, seed=sum(lens_q) + d)
    out, lse, s = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                         return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == dt
    assert lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32
    check_forward((q, k, v), dt, dict(causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck),
                  out=out, lse=lse)


def test_varlen_equals_batched_per_sequence():
    lens_q, lens_k = [113, 5, 64], [70, 203, 64]
    h, hk, d = 4, 2, 40
    q, k, v, cq, ck = packed(lens_q, lens_k, h, hk, d, F32, seed=3)
    slopes = alibi(3, h)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 113, 203, causal=True, window_size=(30, 0),
                                 alibi_slopes=slopes)
    for b in range(3):
        sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        one = flash_attn_func(q[sq][None], k[sk][None], v[sk][None], causal=True,
                              window_size=(30, 0), alibi_slopes=slopes[b])
        torch.testing.assert_close(out[sq], one[0], rtol=0, atol=1e-6)


OPTIONS = {
    "window": dict(window_size=(12, 3)),
    "softcap": dict(softcap=4.0, causal=True),
    "alibi[b,h]": dict(alibi_slopes=alibi(3, 4), causal=True),
    "alibi[h]": dict(alibi_slopes=alibi(None, 4)),
    "sink": dict(learnable_sink=sink(4), causal=True),
}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dt", [F16, BF16], ids=dtype_id)
def test_varlen_options(name, dt):
    kw = OPTIONS[name]
    lens_q, lens_k = [113, 1, 60], [203, 50, 113]
    q, k, v, cq, ck = packed(lens_q, lens_k, 4, 2, 59, dt, seed=5, q_scale=2.0)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, 113, 203, return_attn_probs=True, **kw)
    check_forward((q, k, v), dt, dict(cu_seqlens_q=cq, cu_seqlens_k=ck, **kw), out=out,
                  lse=lse)


def test_varlen_rows_after_last_sequence():
    # q holds more rows than cu_seqlens_q covers: they get out 0 and lse -inf.
    lens_q, lens_k = [30, 20], [40, 25]
    q, k, v, cq, ck = packed(lens_q, lens_k, 2, 2, 40, F32, seed=7)
    q_extra = torch.cat([q, randn((6, 2, 40), F32, seed=8)])
    out, lse, _ = flash_attn_varlen_func(q_extra, k, v, cq, ck, 30, 40, return_attn_probs=True)
    assert (out[50:] == 0).all()
    assert torch.isneginf(lse[:, 50:]).all()
    check_forward((q_extra, k, v), F32, dict(cu_seqlens_q=cq, cu_seqlens_k=ck), out=out,
                  lse=lse)


@pytest.mark.parametrize("dt,causal,kw", [
    (F32, True, {}),
    (F16, False, dict(window_size=(20, 20))),
    (BF16, True, dict(alibi_slopes=alibi(3, 4), softcap=5.0)),
], ids=["f32-causal", "f16-window", "bf16-alibi-softcap"])
def test_varlen_backward(dt, causal, kw):
    lens_q, lens_k = [113, 1, 77], [203, 20, 77]
    q, k, v, cq, ck = packed(lens_q, lens_k, 4, 2, 59, dt, seed=11, requires_grad=True)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 113, 203, causal=causal, **kw)
    check_gradients(out, (q, k, v), dt, dict(causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                              **kw))


def test_varlen_backward_sink():
    lens_q, lens_k = [113, 40], [60, 203]
    q, k, v, cq, ck = packed(lens_q, lens_k, 4, 1, 40, F16, seed=13, requires_grad=True)
    s = sink(4, requires_grad=True)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 113, 203, causal=True, learnable_sink=s)
    check_gradients(out, (q, k, v), F16, dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck),
                    extra=s)


def test_varlen_kvpacked_and_qkvpacked():
    lens = [113, 1, 203]
    h, d = 4, 40
    cu = cu_seqlens(lens)
    qkv = randn((sum(lens), 3, h, d), BF16, seed=17, requires_grad=True)
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu, 203, causal=True,
                                                   return_attn_probs=True)
    parts = (qkv[:, 0], qkv[:, 1], qkv[:, 2])
    check_forward(parts, BF16, dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu),
                  out=out, lse=lse)
    dout = randn(out.shape, BF16, seed=18)
    (g,) = torch.autograd.grad(out, qkv, dout)
    ls = [leaf(p.detach().contiguous()) for p in parts]
    o2 = flash_attn_varlen_func(*ls, cu, cu, 203, 203, causal=True)
    g2 = torch.autograd.grad(o2, ls, dout)
    for i in range(3):
        assert torch.equal(g[:, i], g2[i])

    lens_k = [50, 60, 70]
    ck = cu_seqlens(lens_k)
    q = randn((sum(lens), h, d), F16, seed=19)
    kv = randn((sum(lens_k), 2, 2, d), F16, seed=20)
    out, lse, _ = flash_attn_varlen_kvpacked_func(q, kv, cu, ck, 203, 70, window_size=(5, 5),
                                                  return_attn_probs=True)
    check_forward((q, kv[:, 0], kv[:, 1]), F16,
                  dict(window_size=(5, 5), cu_seqlens_q=cu, cu_seqlens_k=ck), out=out, lse=lse)


def test_varlen_strided():
    lens_q, lens_k = [113, 90], [203, 64]
    h, hk, d = 4, 2, 59
    bq = randn((sum(lens_q), h * 2, d + 3), F32, seed=23)
    bk = randn((sum(lens_k) * 2, hk, d), F32, seed=24)
    bv = randn((sum(lens_k), hk, 2 * d), F32, seed=25)
    q, k, v = bq[:, 1::2, 3:], bk[::2], bv[..., d:]
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, 113, 203, causal=True,
                                         return_attn_probs=True)
    check_forward((q, k, v), F32, dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck),
                  out=out, lse=lse)


# ---- block_table (paged keys) -----------------------------------------------------------------


def _paged(lens_k, page, num_blocks, hk, d, dt, seed):
    """Random paged caches and a shuffled block table covering each sequence's keys; returns the
    caches, the table and each sequence's keys/values gathered contiguously."""
    g = torch.Generator().manual_seed(seed)
    k_cache = randn((num_blocks, page, hk, d), dt, seed=seed)
    v_cache = randn((num_blocks, page, hk, d), dt, seed=seed + 1)
    max_blocks = max(-(-n // page) for n in lens_k)
    perm = torch.randperm(num_blocks, generator=g)
    assert num_blocks >= len(lens_k) * max_blocks
    table = perm[: len(lens_k) * max_blocks].view(len(lens_k), max_blocks).to(torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lens_k):
        ks.append(k_cache[table[b].long()].reshape(-1, hk, d)[:n])
        vs.append(v_cache[table[b].long()].reshape(-1, hk, d)[:n])
    return k_cache, v_cache, table, torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("dt,page,causal", [(F16, 16, True), (BF16, 256, False), (F32, 7, True)],
                         ids=["f16-page16-causal", "bf16-page256", "f32-page7-causal"])
def test_varlen_block_table(dt, page, causal):
    lens_q, lens_k = [1, 113, 5], [203, 113, 40]
    h, hk, d = 4, 2, 40
    q = randn((sum(lens_q), h, d), dt, seed=31)
    num_blocks = 3 * (-(-203 // page)) + 3
    k_cache, v_cache, table, k, v = _paged(lens_k, page, num_blocks, hk, d, dt, seed=32)
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 113, 203, causal=causal,
                                 block_table=table)
    assert out.shape == q.shape
    assert torch.equal(k_cache, kc0) and torch.equal(v_cache, vc0)
    check_forward((q, k, v), dt, dict(causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck),
                  out=out)
    # The same as the plain varlen call on the gathered keys, up to rounding.
    plain = flash_attn_varlen_func(q, k, v, cq, ck, 113, 203, causal=causal)
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal, cu_seqlens_q=cq,
                           cu_seqlens_k=ck)
    assert_close_to_ref(out, ref, plain, dtype=dt, factor=2.0)


def test_varlen_block_table_with_alibi_and_sink():
    lens_q, lens_k = [3, 4], [40, 20]
    h, hk, d, page = 4, 2, 40, 16
    q = randn((sum(lens_q), h, d), F32, seed=41)
    k_cache, v_cache, table, k, v = _paged(lens_k, page, 8, hk, d, F32, seed=42)
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    kw = dict(causal=True, alibi_slopes=alibi(2, h), learnable_sink=sink(h))
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 4, 40, block_table=table, **kw)
    check_forward((q, k, v), F32, dict(cu_seqlens_q=cq, cu_seqlens_k=ck, **kw), out=out)

"""Forward of the batched entry points (flash_attn_func and its packed forms) against the float64
reference, with the error bound of the project standard (see helpers.py)."""

from __future__ import annotations

import pytest
import torch

import flashattn
from flashattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashattn.reference import attention_ref
from helpers import (DTYPES, alibi, check_forward, dtype_id, make_qkv,
                     randn, sink)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (dtype, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal)
SHAPES = [
    (F32, 2, 113, 203, 4, 4, 59, False),
    (F16, 2, 113, 203, 4, 2, 40, True),
    (BF16, 1, 203, 113, 4, 1, 111, True),
    (F32, 2, 203, 113, 2, 1, 256, False),
    (F16, 1, 1, 203, 4, 1, 256, True),
    (BF16, 2, 1, 1, 2, 2, 40, False),
    (BF16, 2, 113, 1, 4, 2, 59, True),
    (F32, 1, 1023, 1023, 2, 1, 40, True),
    (F16, 2, 64, 64, 4, 4, 128, False),
    (BF16, 1, 77, 77, 4, 2, 64, False),
]


def _id(c):
    dt, b, sq, sk, h, hk, d, causal = c
    return f"{dtype_id(dt)}-b{b}-sq{sq}-sk{sk}-h{h}-hk{hk}-d{d}" + ("-causal" if causal else "")


@pytest.mark.parametrize("case", SHAPES, ids=[_id(c) for c in SHAPES])
def test_forward_shapes(case):
    dt, b, sq, sk, h, hk, d, causal = case
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=sq + sk + d)
    out, lse, s = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == dt
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert s.numel() == 0  # flash-attn returns probabilities only with dropout
    check_forward((q, k, v), dt, dict(causal=causal), out=out, lse=lse)
    # Without return_attn_probs: the output alone, the same values.
    out2 = flash_attn_func(q, k, v, causal=causal)
    assert torch.equal(out2, out)


# (window_size, causal)
WINDOWS = [((10, 0), False), ((-1, 5), False), ((3, 7), False), ((0, 0), False),
           ((16, -1), True), ((5, 2), True), ((0, -1), False)]


@pytest.mark.parametrize("window,causal", WINDOWS, ids=[f"{w}-{'c' if c else 'nc'}" for w, c in WINDOWS])
@pytest.mark.parametrize("sq,sk", [(113, 203), (203, 113)])
def test_forward_window(window, causal, sq, sk):
    dt = F16
    q, k, v = make_qkv(2, sq, sk, 4, 2, 59, dt, seed=3)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                  return_attn_probs=True)
    check_forward((q, k, v), dt, dict(causal=causal, window_size=window), out=out, lse=lse)


def test_window_with_causal_equals_right_zero():
    q, k, v = make_qkv(1, 50, 70, 2, 2, 40, F32, seed=5)
    a = flash_attn_func(q, k, v, causal=True, window_size=(8, 8))
    b = flash_attn_func(q, k, v, causal=False, window_size=(8, 0))
    assert torch.equal(a, b)
    c = flash_attn_func(q, k, v, causal=True, window_size=(-1, -1))
    d = flash_attn_func(q, k, v, causal=False, window_size=(-1, 0))
    assert torch.equal(c, d)


@pytest.mark.parametrize("dt", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_forward_softcap(dt, softcap):
    q, k, v = make_qkv(2, 113, 203, 4, 2, 40, dt, seed=9, q_scale=4.0)
    out, lse, _ = flash_attn_func(q, k, v, softcap=softcap, causal=True, return_attn_probs=True)
    check_forward((q, k, v), dt, dict(softcap=softcap, causal=True), out=out, lse=lse)
    # A softcap matters here (scores beyond it): it must change the output.
    plain = flash_attn_func(q, k, v, causal=True)
    assert not torch.equal(plain, out)


@pytest.mark.parametrize("dt", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes[h]", "slopes[b,h]"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_alibi(dt, per_batch, causal):
    b, h = 2, 4
    q, k, v = make_qkv(b, 113, 203, h, 2, 59, dt, seed=21)
    slopes = alibi(b if per_batch else None, h)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                  return_attn_probs=True)
    check_forward((q, k, v), dt, dict(causal=causal, alibi_slopes=slopes), out=out, lse=lse)


def test_alibi_per_batch_rows_differ():
    # [batch, heads] slopes: batch row b uses slopes[b] (same inputs in both rows, different out).
    q, k, v = make_qkv(1, 40, 60, 2, 2, 40, F32, seed=4)
    q, k, v = (t.expand(2, -1, -1, -1).contiguous() for t in (q, k, v))
    slopes = torch.tensor([[0.1, 0.5], [0.9, 0.2]])
    out = flash_attn_func(q, k, v, alibi_slopes=slopes)
    for row in range(2):
        one = flash_attn_func(q[row:row + 1], k[row:row + 1], v[row:row + 1],
                              alibi_slopes=slopes[row])
        assert torch.equal(out[row:row + 1], one)
    assert not torch.equal(out[0], out[1])


@pytest.mark.parametrize("dt", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (8, 8))])
def test_forward_learnable_sink(dt, causal, window):
    h = 4
    q, k, v = make_qkv(2, 113, 203, h, 2, 40, dt, seed=31)
    s = sink(h) * 2
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=s,
                                  return_attn_probs=True)
    check_forward((q, k, v), dt, dict(causal=causal, window_size=window, learnable_sink=s),
                  out=out, lse=lse)


def test_sink_on_empty_rows():
    # seqlen_q > seqlen_k, causal: the first rows see no key; with a sink their lse is the sink's
    # value and out is 0.
    h = 2
    q, k, v = make_qkv(1, 20, 5, h, h, 40, F32, seed=2)
    s = sink(h)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, learnable_sink=s, return_attn_probs=True)
    empty = 20 - 5
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    torch.testing.assert_close(lse[0, :, :empty], s.view(h, 1).expand(h, empty), rtol=0, atol=1e-6)
    assert torch.isfinite(out).all()


def test_empty_rows_without_sink():
    q, k, v = make_qkv(2, 30, 7, 2, 1, 40, BF16, seed=8)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=True)
    assert torch.isfinite(out).all()
    assert (out[:, :23] == 0).all()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    check_forward((q, k, v), BF16, dict(causal=True), out=out, lse=lse)


@pytest.mark.parametrize("dt", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_huge_logits(dt, causal):
    # q scaled by 30: scores in the hundreds, softmax saturated; the online softmax must not
    # overflow (NaN never passes).
    q, k, v = make_qkv(2, 113, 203, 4, 2, 64, dt, seed=41, q_scale=30.0)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_forward((q, k, v), dt, dict(causal=causal), out=out, lse=lse)


@pytest.mark.parametrize("dt", DTYPES, ids=dtype_id)
def test_forward_all_options_combined(dt):
    b, h = 2, 4
    q, k, v = make_qkv(b, 113, 203, h, 1, 111, dt, seed=51, q_scale=3.0)
    kw = dict(causal=True, window_size=(40, 3), softcap=10.0, alibi_slopes=alibi(b, h),
              learnable_sink=sink(h))
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=0.2, return_attn_probs=True, **kw)
    check_forward((q, k, v), dt, dict(scale=0.2, **kw), out=out, lse=lse)


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_forward_softmax_scale(scale):
    q, k, v = make_qkv(1, 64, 96, 2, 2, 40, F16, seed=61)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
    check_forward((q, k, v), F16, dict(scale=scale), out=out, lse=lse)
    default = flash_attn_func(q, k, v)
    assert not torch.equal(default, out)


# ---- strided inputs and the packed entry points ----------------------------------------------


@pytest.mark.parametrize("dt", [F32, BF16], ids=dtype_id)
def test_forward_strided_views(dt):
    # Views into larger buffers: non-contiguous in batch, seqlen and heads; last dim contiguous.
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 59
    big_q = randn((b, sq * 2, h + 3, d + 5), dt, seed=71)
    big_k = randn((b + 1, sk, hk * 2, d + 1), dt, seed=72)
    big_v = randn((b, sk + 4, hk, 3 * d), dt, seed=73)
    q = big_q[:, ::2, 1:h + 1, 2:d + 2]
    k = big_k[1:, :, ::2, :d]
    v = big_v[:, 4:, :, d:2 * d]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    contiguous = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, contiguous)
    check_forward((q, k, v), dt, dict(causal=True), out=out, lse=lse)


def test_forward_transposed_layout():
    # [batch, heads, seqlen, d] tensors transposed to [batch, seqlen, heads, d]: strides permuted.
    q = randn((2, 4, 113, 40), F16, seed=81).transpose(1, 2)
    k = randn((2, 2, 203, 40), F16, seed=82).transpose(1, 2)
    v = randn((2, 2, 203, 40), F16, seed=83).transpose(1, 2)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    check_forward((q, k, v), F16, {}, out=out, lse=lse)


@pytest.mark.parametrize("dt", [F16, F32], ids=dtype_id)
def test_kvpacked_forward(dt):
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 40
    q = randn((b, sq, h, d), dt, seed=91)
    kv = randn((b, sk, 2, hk, d), dt, seed=92)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)
    check_forward((q, kv[:, :, 0], kv[:, :, 1]), dt, dict(causal=True), out=out, lse=lse)
    same = flash_attn_func(q, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous(), causal=True)
    assert torch.equal(out, same)


@pytest.mark.parametrize("dt", [BF16, F32], ids=dtype_id)
def test_qkvpacked_forward(dt):
    b, s, h, d = 2, 203, 4, 111
    qkv = randn((b, s, 3, h, d), dt, seed=93)
    slopes = alibi(None, h)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, window_size=(20, 20), alibi_slopes=slopes,
                                            return_attn_probs=True)
    check_forward((qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), dt,
                  dict(window_size=(20, 20), alibi_slopes=slopes), out=out, lse=lse)


# ---- determinism, threads, devices -----------------------------------------------------------


def test_forward_repeatable_and_thread_independent():
    q, k, v = make_qkv(2, 203, 203, 4, 2, 64, BF16, seed=101)
    first = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(first, flash_attn_func(q, k, v, causal=True))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = flash_attn_func(q, k, v, causal=True, deterministic=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, one)


def test_inputs_not_modified():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 40, F16, seed=111)
    copies = [t.clone() for t in (q, k, v)]
    flash_attn_func(q, k, v, causal=True, softcap=3.0)
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)


def test_meta_tensors_give_shapes():
    # Meta tensors run the fake implementation: shapes and dtypes, no computation.
    q = torch.empty((2, 7, 4, 40), dtype=F16, device="meta")
    k = torch.empty((2, 9, 2, 40), dtype=F16, device="meta")
    out, lse, s = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == F16
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32


def test_non_cpu_tensor_raises_not_implemented(monkeypatch):
    from flashattn import _ops

    with pytest.raises(NotImplementedError, match="CPU"):
        _ops._view("q", torch.empty((1, 2, 1, 8), device="meta"))
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to build a CUDA tensor on")
    # CUDA tensors run on the CUDA backend unless FLASHATTN_PY_CUDA=0 turns it off.
    monkeypatch.setenv("FLASHATTN_PY_CUDA", "0")
    q = torch.randn(1, 4, 2, 40, device="cuda", dtype=F16)
    with pytest.raises(NotImplementedError, match="FLASHATTN_PY_CUDA=0"):
        flash_attn_func(q, q, q)


def test_out_matches_independent_softmax_formula():
    # A second, independent oracle (not attention_ref): torch's scaled_dot_product_attention in
    # f64 on a plain causal case with equal lengths (top-left == bottom-right when sq == sk).
    q, k, v = make_qkv(2, 113, 113, 4, 4, 40, F32, seed=121)
    out = flash_attn_func(q, k, v, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2),
        is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out.double(), sdpa, rtol=0, atol=2e-5)


def test_isa_reported():
    assert isinstance(flashattn.isa(), str) and flashattn.isa()
    assert flashattn.MAX_HEAD_DIM == 256

"""FP8 inputs (float8_e4m3fn, float8_e5m2) with descale factors: out is bf16 and is compared with
the float64 reference on the dequantised values, within 2x the error of the same attention done
naively in bf16 on those values."""

from __future__ import annotations

import pytest
import torch

from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flashattn.reference import attention_ref
from helpers import (alibi, assert_close_to_ref, assert_lse_close, cu_seqlens, randn, sink)

E4M3 = getattr(torch, "float8_e4m3fn", None)
E5M2 = getattr(torch, "float8_e5m2", None)
pytestmark = pytest.mark.skipif(E4M3 is None or E5M2 is None, reason="torch without float8")
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
BF16 = torch.bfloat16


def quantise(x: torch.Tensor, fmt, per: str, heads_axis: int = 2, seed: int = 0):
    """x (f64) -> (fp8 tensor, descale, dequantised f64). ``per``: "tensor" (one factor) or
    "bh" (one per batch row and kv head, [batch, heads_kv]); descale chosen so the values use the
    format's range, and not a power of two (so the scaling path is exercised)."""
    fmax = torch.finfo(fmt).max
    if per == "tensor":
        descale = (x.abs().max() / (fmax * 0.5) * 1.37).reshape(1).float()
        d_b = descale.double().view(*([1] * x.dim()))
    else:
        amax = x.abs().amax(dim=tuple(i for i in range(x.dim()) if i not in (0, heads_axis)))
        descale = (amax / (fmax * 0.5) * 1.37).float()  # [batch, heads_kv]
        shape = [1] * x.dim()
        shape[0], shape[heads_axis] = x.shape[0], x.shape[heads_axis]
        d_b = descale.double().view(shape)
    xq = (x / d_b).to(fmt)
    return xq, descale, xq.double() * d_b


def _check(out, lse, deq, kw, *, lse_check=True):
    qd, kd, vd = deq
    ref, ref_lse = attention_ref(qd, kd, vd, **kw)
    naive, naive_lse = attention_ref(qd.to(BF16), kd.to(BF16), vd.to(BF16), dtype=BF16, **kw)
    assert out.dtype == BF16
    assert torch.isfinite(out).all()
    assert_close_to_ref(out, ref, naive, dtype=BF16)
    if lse_check:
        assert_lse_close(lse, ref_lse, naive_lse, dtype=BF16)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("per", ["tensor", "bh"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", [
    (2, 113, 203, 4, 2, 59, True),
    (1, 203, 113, 4, 1, 128, False),
    (2, 1, 203, 2, 2, 256, True),
])
def test_fp8_forward(fmt, per, b, sq, sk, h, hk, d, causal):
    qf = randn((b, sq, h, d), torch.float64, seed=1, scale=2.0)
    kf = randn((b, sk, hk, d), torch.float64, seed=2)
    vf = randn((b, sk, hk, d), torch.float64, seed=3, scale=3.0)
    # q's factors are per (batch, kv head) too: a query head uses its kv head's factor.
    q8, qs, qd = quantise(qf.view(b, sq, hk, h // hk, d).flatten(3), fmt, per)
    qd = qd.view(b, sq, h, d)
    q8 = q8.view(b, sq, h, d)
    k8, ks, kd = quantise(kf, fmt, per)
    v8, vs, vd = quantise(vf, fmt, per)
    out, lse, _ = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks,
                                  v_descale=vs, return_attn_probs=True)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    _check(out, lse, (qd, kd, vd), dict(causal=causal))


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_without_descale(fmt):
    q = randn((2, 64, 2, 40), torch.float64, seed=4).to(fmt)
    k = randn((2, 80, 2, 40), torch.float64, seed=5).to(fmt)
    v = randn((2, 80, 2, 40), torch.float64, seed=6).to(fmt)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    _check(out, lse, (q.double(), k.double(), v.double()), {})


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_options(fmt):
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 40
    q8, qs, qd = quantise(randn((b, sq, h, d), torch.float64, seed=7, scale=4.0), fmt, "tensor")
    k8, ks, kd = quantise(randn((b, sk, hk, d), torch.float64, seed=8), fmt, "tensor")
    v8, vs, vd = quantise(randn((b, sk, hk, d), torch.float64, seed=9), fmt, "tensor")
    kw = dict(causal=True, window_size=(50, -1), softcap=8.0, alibi_slopes=alibi(b, h),
              learnable_sink=sink(h))
    out, lse, _ = flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs,
                                  return_attn_probs=True, **kw)
    _check(out, lse, (qd, kd, vd), kw)


def test_fp8_huge_logits():
    fmt = E5M2
    q8, qs, qd = quantise(randn((1, 113, 2, 64), torch.float64, seed=10, scale=30.0), fmt,
                          "tensor")
    k8, ks, kd = quantise(randn((1, 113, 2, 64), torch.float64, seed=11), fmt, "tensor")
    v8, vs, vd = quantise(randn((1, 113, 2, 64), torch.float64, seed=12), fmt, "tensor")
    out, lse, _ = flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs,
                                  causal=True, return_attn_probs=True)
    assert torch.isfinite(lse).all()
    _check(out, lse, (qd, kd, vd), dict(causal=True))


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_varlen(fmt):
    lens_q, lens_k = [113, 1, 40], [203, 50, 40]
    h, hk, d = 4, 2, 59
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q8, qs, qd = quantise(randn((sum(lens_q), h, d), torch.float64, seed=13)[None], fmt, "tensor")
    k8, ks, kd = quantise(randn((sum(lens_k), hk, d), torch.float64, seed=14)[None], fmt, "tensor")
    v8, vs, vd = quantise(randn((sum(lens_k), hk, d), torch.float64, seed=15)[None], fmt, "tensor")
    out, lse, _ = flash_attn_varlen_func(q8[0], k8[0], v8[0], cq, ck, 113, 203, causal=True,
                                         q_descale=qs, k_descale=ks, v_descale=vs,
                                         return_attn_probs=True)
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    _check(out, lse, (qd[0], kd[0], vd[0]), dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck))


def test_fp8_descale_is_applied():
    # Doubling v_descale doubles out exactly (it scales the finished rows), and k_descale acts as
    # a softmax temperature: out changes.
    q = randn((1, 32, 2, 40), torch.float64, seed=16).to(E4M3)
    k = randn((1, 32, 2, 40), torch.float64, seed=17).to(E4M3)
    v = randn((1, 32, 2, 40), torch.float64, seed=18).to(E4M3)
    one = torch.tensor([1.0])
    a = flash_attn_func(q, k, v, q_descale=one, k_descale=one, v_descale=one)
    b = flash_attn_func(q, k, v, q_descale=one, k_descale=one, v_descale=torch.tensor([2.0]))
    assert torch.equal(b, a * 2)
    c = flash_attn_func(q, k, v, q_descale=one, k_descale=torch.tensor([3.0]), v_descale=one)
    assert not torch.equal(a, c)
    assert torch.equal(a, flash_attn_func(q, k, v))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("per", ["tensor", "bh"])
def test_fp8_kvcache(fmt, per):
    # FP8 caches with bf16 q and new keys: the new keys are quantised into the cache
    # (x / descale, rounded to the format), then attention runs on the dequantised cache.
    b, n, h, hk, d, cap = 2, 3, 4, 2, 40, 256
    kc8, ks, _ = quantise(randn((b, cap, hk, d), torch.float64, seed=19), fmt, per)
    vc8, vs, _ = quantise(randn((b, cap, hk, d), torch.float64, seed=20), fmt, per)
    q = randn((b, n, h, d), BF16, seed=21)
    kn, vn = randn((b, n, hk, d), BF16, seed=22), randn((b, n, hk, d), BF16, seed=23)
    sl = torch.tensor([113, 7], dtype=torch.int32)

    def shaped(desc):
        return desc.double().view(1, 1, 1, 1) if per == "tensor" else desc.double().view(b, 1, hk, 1)

    k_exp, v_exp = kc8.clone(), vc8.clone()
    for bi in range(b):
        s = int(sl[bi])
        k_exp[bi, s:s + n] = (kn[bi].double() / shaped(ks)[min(bi, shaped(ks).shape[0] - 1)]).to(fmt)
        v_exp[bi, s:s + n] = (vn[bi].double() / shaped(vs)[min(bi, shaped(vs).shape[0] - 1)]).to(fmt)
    out, lse = flash_attn_with_kvcache(q, kc8, vc8, kn, vn, cache_seqlens=sl, causal=True,
                                       k_descale=ks, v_descale=vs, return_softmax_lse=True)
    assert out.dtype == BF16
    # Quantisation may round a tie differently from torch's f64 path by one step at most.
    diff = (kc8.double() - k_exp.double()).abs()
    step = k_exp.double().abs() * (2.0 ** -(3 if fmt == E4M3 else 2)) + 1e-30
    assert (diff <= step).all()
    assert (kc8.view(torch.uint8) != k_exp.view(torch.uint8)).float().mean() < 0.01
    assert ((vc8.double() - v_exp.double()).abs() <= v_exp.double().abs() * 0.25 + 1e-30).all()
    kd, vd = kc8.double() * shaped(ks), vc8.double() * shaped(vs)
    for bi in range(b):
        e = int(sl[bi]) + n
        ref, ref_lse = attention_ref(q[bi:bi + 1].double(), kd[bi:bi + 1, :e], vd[bi:bi + 1, :e],
                                     causal=True)
        naive, naive_lse = attention_ref(q[bi:bi + 1], kd[bi:bi + 1, :e].to(BF16),
                                         vd[bi:bi + 1, :e].to(BF16), causal=True, dtype=BF16)
        assert_close_to_ref(out[bi:bi + 1], ref, naive, dtype=BF16, name=f"out[{bi}]")
        assert_lse_close(lse[bi:bi + 1], ref_lse, naive_lse, dtype=BF16)


def test_fp8_rejects_dropout_and_descale_on_float():
    q = randn((1, 8, 2, 16), torch.float64, seed=24).to(E4M3)
    with pytest.raises(ValueError, match="dropout"):
        flash_attn_func(q, q, q, dropout_p=0.1)
    x = randn((1, 8, 2, 16), BF16, seed=25)
    with pytest.raises(ValueError, match="descale"):
        flash_attn_func(x, x, x, q_descale=torch.tensor([1.0]))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_bad_descale(bad):
    import flashattn

    q = randn((1, 8, 2, 16), torch.float64, seed=26).to(E4M3)
    with pytest.raises(flashattn.FlashAttnError, match="descale"):
        flash_attn_func(q, q, q, k_descale=torch.tensor([bad]))


def test_fp8_mixed_formats_rejected():
    q = randn((1, 8, 2, 16), torch.float64, seed=27)
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_func(q.to(E4M3), q.to(E5M2), q.to(E4M3))


def test_fp8_varlen_per_sequence_descale():
    # In packed form, descale [num_sequences, heads_kv]: sequence b uses row b.
    lens_q, lens_k = [3, 4], [40, 20]
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn((7, 4, 32), torch.float64, seed=28).to(E4M3)
    k = randn((60, 2, 32), torch.float64, seed=29).to(E4M3)
    v = randn((60, 2, 32), torch.float64, seed=30).to(E4M3)
    ds = torch.tensor([[0.5, 1.0], [2.0, 0.25]])
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, 4, 40, k_descale=ds,
                                         return_attn_probs=True)
    kd = k.double().clone()
    kd[:40] *= ds[0].double().view(1, 2, 1)
    kd[40:] *= ds[1].double().view(1, 2, 1)
    _check(out, lse, (q.double(), kd, v.double()), dict(cu_seqlens_q=cq, cu_seqlens_k=ck))

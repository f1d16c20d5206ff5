"""flashattn.fp8.quantize_qkv: the incoherent transform keeps q·kᵀ (float64), the quantised
values round-trip within half a step of e4m3, the factors are what flash_attn_func takes, and on
data with outliers incoherent processing lowers the FP8 forward's RMSE against float64."""

from __future__ import annotations

import pytest
import torch

from flashattn import flash_attn_func
from flashattn.fp8 import hadamard_signs, incoherent_transform, quantize_qkv
from flashattn.reference import attention_ref

E4M3 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(E4M3 is None, reason="torch without float8")


def outliers(shape, seed):
    """N(0, 1), plus N(0, 10²) on 0.1% of the entries (FlashAttention-3's test data)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g, dtype=torch.float64) < 0.001
    return x + mask * 10.0 * torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("d", [1, 16, 128, 256])
def test_transform_keeps_qk(d):
    q, k = outliers((3, 50, 2, d), 1), outliers((3, 70, 2, d), 2)
    qm, km = incoherent_transform(q, seed=5), incoherent_transform(k, seed=5)
    want = torch.einsum("bihd,bjhd->bhij", q, k)
    got = torch.einsum("bihd,bjhd->bhij", qm, km)
    assert torch.allclose(got, want, rtol=0, atol=1e-11 * want.abs().max().item())
    # A different seed gives different signs, and mostly mixed ones.
    s = hadamard_signs(128, 7)
    assert not torch.equal(s, hadamard_signs(128, 8))
    assert 40 <= int((s < 0).sum()) <= 88


def test_transform_needs_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        incoherent_transform(torch.ones(2, 3, 1, 24))


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("incoherent", [False, True])
def test_round_trip(per_head, incoherent):
    b, s, h, hk, d = 2, 33, 4, 2, 64
    q, k, v = outliers((b, s, h, d), 3), outliers((b, s, hk, d), 4), outliers((b, s, hk, d), 5)
    q8, k8, v8, qs, ks, vs = quantize_qkv(q.float(), k.float(), v.float(),
                                          incoherent=incoherent, seed=3, per_head=per_head)
    assert q8.dtype == k8.dtype == v8.dtype == E4M3
    assert qs.shape == ks.shape == vs.shape == ((b, hk) if per_head else (1,))
    for x8, xs, x, rot in ((q8, qs, q, True), (k8, ks, k, True), (v8, vs, v, False)):
        want = x.float().double()
        if incoherent and rot:
            want = incoherent_transform(want, seed=3)
        nh = x.shape[2]
        f = xs.double().view(b, 1, hk, 1).repeat_interleave(nh // hk, dim=2) if per_head \
            else xs.double()
        deq = x8.double() * f
        step = torch.maximum(want.abs() * 2.0 ** -4, f * 2.0 ** -10) * (1 + 1e-9)
        assert ((deq - want).abs() <= step).all()
        assert x8.double().abs().max().item() == 448.0


def test_accuracy_gain_with_outliers():
    b, s, h, d = 1, 512, 2, 128
    q, k, v = (outliers((b, s, h, d), i) for i in (10, 11, 12))
    ref, _ = attention_ref(q, k, v)

    def rmse(incoherent):
        q8, k8, v8, qs, ks, vs = quantize_qkv(q.float(), k.float(), v.float(),
                                              incoherent=incoherent, seed=1, per_head=False)
        out = flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)
        return (out.double() - ref).pow(2).mean().sqrt().item()

    plain, inc = rmse(False), rmse(True)
    assert inc < 0.75 * plain, (plain, inc)


@pytest.mark.parametrize("incoherent", [False, True])
def test_block_round_trip(incoherent):
    """granularity="block": one factor per 128 rows of each (batch row, head), tables
    [batch, heads, ceil(seqlen / 128)], each its block's amax over 448."""
    b, sq, sk, h, hk, d = 2, 200, 130, 4, 2, 64
    q, k, v = outliers((b, sq, h, d), 6), outliers((b, sk, hk, d), 7), outliers((b, sk, hk, d), 8)
    # The second q block a hundred times larger: its own factor.
    q[:, 128:] *= 100.0
    q8, k8, v8, qs, ks, vs = quantize_qkv(q.float(), k.float(), v.float(),
                                          incoherent=incoherent, seed=3, granularity="block")
    assert qs.shape == (b, h, 2) and ks.shape == vs.shape == (b, hk, 2)
    assert qs.dtype == torch.float32
    assert (qs[:, :, 1] > 30 * qs[:, :, 0]).all()
    for x8, xs, x, rot in ((q8, qs, q, True), (k8, ks, k, True), (v8, vs, v, False)):
        want = x.float().double()
        if incoherent and rot:
            want = incoherent_transform(want, seed=3)
        s = x.shape[1]
        f = xs.double().repeat_interleave(128, dim=2)[:, :, :s].permute(0, 2, 1).unsqueeze(-1)
        deq = x8.double() * f
        step = torch.maximum(want.abs() * 2.0 ** -4, f * 2.0 ** -10) * (1 + 1e-9)
        assert ((deq - want).abs() <= step).all()
        for blk in range(xs.shape[2]):
            amax = want[:, 128 * blk:128 * (blk + 1)].abs().amax(dim=(1, 3))
            assert torch.equal(xs[:, :, blk], (amax / 448.0).float())


@pytest.mark.parametrize("causal", [False, True])
def test_block_forward(causal):
    """flash_attn_func takes the per-block tables (3-D: per block) and matches the float64
    reference on the dequantised inputs; mixing per-block and per-head tables is refused."""
    b, sq, sk, h, hk, d = 1, 150, 260, 4, 2, 64
    q, k, v = outliers((b, sq, h, d), 9), outliers((b, sk, hk, d), 10), outliers((b, sk, hk, d), 11)
    q8, k8, v8, qs, ks, vs = quantize_qkv(q.float(), k.float(), v.float(), granularity="block")
    out = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape

    def deq(x8, xs):
        f = xs.double().repeat_interleave(128, dim=2)[:, :, :x8.shape[1]]
        return x8.double() * f.permute(0, 2, 1).unsqueeze(-1)

    ref, _ = attention_ref(deq(q8, qs), deq(k8, ks), deq(v8, vs), causal=causal)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2.0 ** -7 * ref.abs().max().item(), err
    _, _, _, qh, _, _ = quantize_qkv(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="per block"):
        flash_attn_func(q8, k8, v8, q_descale=qh, k_descale=ks, v_descale=vs)
    with pytest.raises(Exception, match="q_descale"):
        flash_attn_func(q8, k8, v8, q_descale=qs[:, :, :1], k_descale=ks, v_descale=vs)

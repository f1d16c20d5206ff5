"""CUDA tensors through flashattn's CUDA backend: results against the CPU path's on the same
values, gradients included, caches appended in place. Skipped with the reason printed where there
is no GPU or FLASHATTN_PY_CUDA=0 turns the path off."""

import os

import pytest
import torch

import flashattn
from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(os.environ.get("FLASHATTN_PY_CUDA") == "0",
                       reason="FLASHATTN_PY_CUDA=0 turns the CUDA path off"),
]


def _close(gpu, cpu, what, dtype):
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    g, c = gpu.detach().cpu().float(), cpu.detach().float()
    assert torch.isfinite(g).all(), f"{what}: non-finite on CUDA"
    err = (g - c).abs().max().item()
    assert err <= tol * max(1.0, c.abs().max().item()), f"{what}: max error {err}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_match_the_cpu(dtype, causal):
    torch.manual_seed(0)
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 64
    q, k, v = (torch.randn(b, s, n, d).to(dtype) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d).to(dtype)
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    out_c, lse_c, _ = flash_attn_func(*cpu, causal=causal, return_attn_probs=True)
    out_g, lse_g, _ = flash_attn_func(*gpu, causal=causal, return_attn_probs=True)
    assert out_g.device.type == "cuda" and lse_g.device.type == "cuda"
    _close(out_g, out_c, "out", dtype)
    _close(lse_g, lse_c, "lse", torch.float32)
    out_c.backward(dout)
    out_g.backward(dout.cuda())
    for name, g, c in zip("qkv", gpu, cpu):
        _close(g.grad, c.grad, f"d{name}", dtype)


def test_varlen_matches_the_cpu():
    torch.manual_seed(1)
    cu = torch.tensor([0, 30, 31, 90], dtype=torch.int32)
    q, k, v = (torch.randn(90, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    c = flash_attn_varlen_func(q, k, v, cu, cu, 59, 59, causal=True)
    g = flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), cu.cuda(), 59, 59,
                               causal=True)
    _close(g, c, "out", torch.bfloat16)


def test_kvcache_appends_in_place_like_the_cpu():
    torch.manual_seed(2)
    b, s, h, hk, d = 2, 64, 4, 2, 64
    kc, vc = (torch.randn(b, s, hk, d, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, h, d, dtype=torch.bfloat16)
    kn, vn = (torch.randn(b, 1, hk, d, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([10, 40], dtype=torch.int32)
    kc_g, vc_g = kc.cuda(), vc.cuda()
    c = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
    g = flash_attn_with_kvcache(q.cuda(), kc_g, vc_g, kn.cuda(), vn.cuda(), cache_seqlens=lens,
                                causal=True)
    _close(g, c, "out", torch.bfloat16)
    assert torch.equal(kc_g.cpu(), kc) and torch.equal(vc_g.cpu(), vc), "caches differ"


def test_runs_on_the_current_stream_without_a_sync():
    q = torch.randn(1, 256, 4, 64, dtype=torch.float16, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = flash_attn_func(q, q, q)
    s.synchronize()
    ref = flash_attn_func(q.cpu(), q.cpu(), q.cpu())
    _close(out, ref, "out", torch.float16)


def test_cpu_and_cuda_tensors_mixed_are_refused():
    q = torch.randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match="one CUDA device"):
        flash_attn_func(q, q.cuda(), q)
    assert flashattn.isa()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_alibi_and_sinks_forward_and_backward_match_the_cpu(dtype):
    torch.manual_seed(3)
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 64
    q, k, v = (torch.randn(b, s, n, d).to(dtype) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d).to(dtype)
    slopes = torch.rand(b, h, dtype=torch.float32) * 0.3
    sink = torch.randn(h, dtype=torch.float32)
    cpu = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    gpu = [t.cuda().requires_grad_() for t in (q, k, v, sink)]
    out_c = flash_attn_func(*cpu[:3], causal=True, alibi_slopes=slopes, learnable_sink=cpu[3])
    out_g = flash_attn_func(*gpu[:3], causal=True, alibi_slopes=slopes.cuda(),
                            learnable_sink=gpu[3])
    _close(out_g, out_c, "out", dtype)
    out_c.backward(dout)
    out_g.backward(dout.cuda())
    for name, g, c in zip(("dq", "dk", "dv", "dsink"), gpu, cpu):
        _close(g.grad, c.grad, name, dtype)


def test_kvcache_with_rotary_matches_the_cpu():
    torch.manual_seed(4)
    b, s, h, hk, d = 2, 64, 4, 2, 64
    kc, vc = (torch.randn(b, s, hk, d, dtype=torch.float16) for _ in range(2))
    q = torch.randn(b, 2, h, d, dtype=torch.float16)
    kn, vn = (torch.randn(b, 2, hk, d, dtype=torch.float16) for _ in range(2))
    angle = torch.rand(s, d // 4) * 6.28
    cos, sin = angle.cos().half(), angle.sin().half()
    lens = torch.tensor([5, 50], dtype=torch.int32)
    for interleaved in (True, False):
        kc_c, vc_c, kc_g, vc_g = kc.clone(), vc.clone(), kc.cuda(), vc.cuda()
        c = flash_attn_with_kvcache(q, kc_c, vc_c, kn, vn, cos, sin, cache_seqlens=lens,
                                    causal=True, rotary_interleaved=interleaved)
        g = flash_attn_with_kvcache(q.cuda(), kc_g, vc_g, kn.cuda(), vn.cuda(), cos.cuda(),
                                    sin.cuda(), cache_seqlens=lens.cuda(), causal=True,
                                    rotary_interleaved=interleaved)
        _close(g, c, f"out (interleaved={interleaved})", torch.float16)
        _close(kc_g, kc_c, "rotated k_cache", torch.float16)
        assert torch.equal(vc_g.cpu(), vc_c), "v_cache differs"


E4M3 = getattr(torch, "float8_e4m3fn", None)


@pytest.mark.skipif(E4M3 is None, reason="torch without float8")
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_matches_the_cpu(causal):
    torch.manual_seed(5)
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 128
    q, k, v = (torch.randn(b, s, n, d).to(E4M3) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    qd, kd, vd = (torch.tensor([x]) for x in (0.5, 0.25, 2.0))
    c = flash_attn_func(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    g = flash_attn_func(q.cuda(), k.cuda(), v.cuda(), causal=causal, q_descale=qd.cuda(),
                        k_descale=kd.cuda(), v_descale=vd.cuda())
    assert g.dtype == torch.bfloat16 and g.device.type == "cuda"
    _close(g, c, "out", torch.bfloat16)


@pytest.mark.skipif(E4M3 is None, reason="torch without float8")
def test_fp8_kvcache_appends_in_place_like_the_cpu():
    torch.manual_seed(6)
    b, s, h, hk, d = 2, 64, 4, 2, 64
    kc, vc = (torch.randn(b, s, hk, d).to(E4M3) for _ in range(2))
    q = torch.randn(b, 1, h, d, dtype=torch.bfloat16)
    kn, vn = (torch.randn(b, 1, hk, d, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([10, 40], dtype=torch.int32)
    kd, vd = torch.tensor([0.5]), torch.tensor([2.0])
    kc_c, vc_c, kc_g, vc_g = kc.clone(), vc.clone(), kc.cuda(), vc.cuda()
    c = flash_attn_with_kvcache(q, kc_c, vc_c, kn, vn, cache_seqlens=lens, causal=True,
                                k_descale=kd, v_descale=vd)
    g = flash_attn_with_kvcache(q.cuda(), kc_g, vc_g, kn.cuda(), vn.cuda(), cache_seqlens=lens,
                                causal=True, k_descale=kd.cuda(), v_descale=vd.cuda())
    _close(g, c, "out", torch.bfloat16)
    assert torch.equal(kc_g.cpu().view(torch.uint8), kc_c.view(torch.uint8)), "k_cache differs"
    assert torch.equal(vc_g.cpu().view(torch.uint8), vc_c.view(torch.uint8)), "v_cache differs"

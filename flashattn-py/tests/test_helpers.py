"""The accuracy checks themselves must be able to fail: a perturbed result or a wrong option is
caught by the same bounds the suite relies on."""

from __future__ import annotations

import pytest
import torch

from flashattn import flash_attn_func
from helpers import check_forward, check_gradients, make_qkv


@pytest.mark.parametrize("dt", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_bound_catches_perturbed_output(dt):
    q, k, v = make_qkv(1, 64, 64, 2, 2, 40, dt, seed=1)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_forward((q, k, v), dt, dict(causal=True), out=out, lse=lse)
    bad = out.clone()
    # 8 ulp at the output's magnitude (f32: beyond its 1e-5 floor).
    bump = 1e-4 if dt == torch.float32 else 8 * torch.finfo(dt).eps * max(1.0, float(bad.abs().max()))
    bad[0, 17, 1, 3] += bump
    with pytest.raises(AssertionError, match="max error"):
        check_forward((q, k, v), dt, dict(causal=True), out=bad)
    bad_lse = lse.clone()
    bad_lse[0, 1, 5] += 1e-3 if dt == torch.float32 else 0.2
    with pytest.raises(AssertionError):
        check_forward((q, k, v), dt, dict(causal=True), out=out, lse=bad_lse)


def test_bound_catches_wrong_option_and_nan():
    q, k, v = make_qkv(1, 64, 80, 2, 1, 40, torch.float16, seed=2)
    out = flash_attn_func(q, k, v, causal=False)
    with pytest.raises(AssertionError):
        check_forward((q, k, v), torch.float16, dict(causal=True), out=out)
    nan = out.clone()
    nan[0, 0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        check_forward((q, k, v), torch.float16, {}, out=nan)


def test_gradient_bound_catches_wrong_gradient():
    q, k, v = make_qkv(1, 40, 50, 2, 2, 40, torch.bfloat16, seed=3, requires_grad=True)
    # Differentiating a causal call against a non-causal reference must fail.
    out = flash_attn_func(q, k, v, causal=True)
    with pytest.raises(AssertionError, match="d[qkv]"):
        check_gradients(out, (q, k, v), torch.bfloat16, dict(causal=False))

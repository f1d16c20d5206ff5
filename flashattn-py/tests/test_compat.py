"""flashattn.compat: the ``flash_attn`` alias modules (the low-level forward/backward pairs that
training libraries call, bert_padding, layers.rotary)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import flashattn
import flashattn.compat
from flashattn.reference import attention_ref
from helpers import (assert_close_to_ref, check_forward, cu_seqlens, keep_from_s_dmask, leaf,
                     make_qkv, randn, ref_with_keep)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture
def fa():
    """``import flash_attn`` through the compat alias (removed again afterwards)."""
    saved = {n: sys.modules.get(n) for n in flashattn.compat._MODULES}
    flashattn.compat.install()
    import flash_attn

    yield flash_attn
    flashattn.compat.uninstall()
    for n, m in saved.items():
        if m is not None:
            sys.modules[n] = m


def test_install_and_uninstall(fa):
    assert "flashattn" in fa.__version__
    assert fa.flash_attn_func is flashattn.flash_attn_func
    from flash_attn.bert_padding import pad_input, unpad_input  # noqa: F401
    from flash_attn.flash_attn_interface import _flash_attn_forward  # noqa: F401
    from flash_attn.layers.rotary import apply_rotary_emb  # noqa: F401

    flashattn.compat.install()  # idempotent
    flashattn.compat.uninstall()
    assert "flash_attn" not in sys.modules
    assert "flash_attn.layers.rotary" not in sys.modules


def test_install_refuses_to_shadow_a_real_flash_attn():
    saved = sys.modules.get("flash_attn")
    real = types.ModuleType("flash_attn")
    real.__file__ = "/somewhere/flash_attn/__init__.py"
    sys.modules["flash_attn"] = real
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            flashattn.compat.install()
        assert sys.modules["flash_attn"] is real
        flashattn.compat.install(replace=True)
        assert sys.modules["flash_attn"] is not real
        assert sys.modules["flash_attn"].flash_attn_func is flashattn.flash_attn_func
    finally:
        flashattn.compat.uninstall()
        if saved is not None:
            sys.modules["flash_attn"] = saved
        else:
            sys.modules.pop("flash_attn", None)


# ---- _flash_attn_forward / _flash_attn_backward -----------------------------------------------


@pytest.mark.parametrize("dt,causal,window,softcap", [(F16, True, (-1, -1), 0.0),
                                                      (BF16, False, (20, 5), 4.0),
                                                      (F32, True, (30, -1), 0.0)],
                         ids=["f16-causal", "bf16-window-softcap", "f32-causal-window"])
def test_low_level_forward_backward(fa, dt, causal, window, softcap):
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 59
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=1)
    scale = d ** -0.5
    out, lse, s, rng = _flash_attn_forward(q, k, v, 0.0, scale, causal, window[0], window[1],
                                           softcap, None, False)
    assert lse.shape == (b, h, sq) and s.numel() == 0 and rng.shape == (2,)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    check_forward((q, k, v), dt, kw, out=out, lse=lse)

    dout = randn(out.shape, dt, seed=2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ids = (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal,
                                     window[0], window[1], softcap, None, False, rng)
    assert (dq.data_ptr(), dk.data_ptr(), dv.data_ptr()) == ids
    # The gradients written into dq, dk, dv are autograd's through the public function.
    ql, kl, vl = (leaf(t) for t in (q, k, v))
    out2 = flashattn.flash_attn_func(ql, kl, vl, causal=causal, window_size=window,
                                     softcap=softcap)
    assert torch.equal(out2, out)
    gq, gk, gv = torch.autograd.grad(out2, (ql, kl, vl), dout)
    assert torch.equal(dq, gq) and torch.equal(dk, gk) and torch.equal(dv, gv)
    # softmax_d: rowsum(dout * out) as [b, h, round128(sq)] (zero padding).
    assert softmax_d.shape == (b, h, 128) and softmax_d.dtype == torch.float32
    expect = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[..., :sq].double(), expect, rtol=1e-5, atol=1e-4)
    assert (softmax_d[..., sq:] == 0).all()


def test_low_level_backward_allocates_and_uses_rng_state(fa):
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    b, sq, sk, h, d, p = 1, 64, 80, 2, 40, 0.3
    q, k, v = make_qkv(b, sq, sk, h, h, d, F32, seed=3)
    scale = d ** -0.5
    out, lse, s, rng = _flash_attn_forward(q, k, v, p, scale, False, return_softmax=True)
    keep = keep_from_s_dmask(s, sq, sk)
    ref, _ = ref_with_keep(q.double(), k.double(), v.double(), keep, p)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    dout = randn(out.shape, F32, seed=4)
    dq = torch.empty_like(q)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, None, None, p, scale, False,
                         rng_state=rng)
    r = [leaf(t.double()) for t in (q, k, v)]
    r_out, _ = ref_with_keep(*r, keep, p)
    rq, _, _ = torch.autograd.grad(r_out, r, dout.double())
    torch.testing.assert_close(dq.double(), rq, rtol=0, atol=2e-5)


def test_low_level_varlen_pair(fa):
    from flash_attn.flash_attn_interface import (_flash_attn_varlen_backward,
                                                 _flash_attn_varlen_forward)

    lens_q, lens_k = [113, 1, 50], [60, 203, 50]
    h, hk, d = 4, 2, 40
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn((sum(lens_q), h, d), BF16, seed=5)
    k = randn((sum(lens_k), hk, d), BF16, seed=6)
    v = randn((sum(lens_k), hk, d), BF16, seed=7)
    scale = d ** -0.5
    out, lse, s, rng = _flash_attn_varlen_forward(q, k, v, cq, ck, 113, 203, 0.0, scale, True)
    assert lse.shape == (h, sum(lens_q))
    check_forward((q, k, v), BF16, dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck),
                  out=out, lse=lse)
    dout = randn(out.shape, BF16, seed=8)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cq, ck, 113,
                                            203, 0.0, scale, True, rng_state=rng)
    ql, kl, vl = (leaf(t) for t in (q, k, v))
    o2 = flashattn.flash_attn_varlen_func(ql, kl, vl, cq, ck, 113, 203, causal=True)
    g = torch.autograd.grad(o2, (ql, kl, vl), dout)
    assert torch.equal(dq, g[0]) and torch.equal(dk, g[1]) and torch.equal(dv, g[2])
    assert softmax_d.shape[0] == h
    expect = (dout.double() * out.double()).sum(-1).transpose(0, 1)
    torch.testing.assert_close(softmax_d[:, :sum(lens_q)].double(), expect, rtol=1e-5, atol=1e-3)


def test_low_level_varlen_refuses_paged(fa):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    q = randn((4, 2, 16), F16, seed=9)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        _flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, 0.25, False,
                                   block_table=torch.zeros((1, 1), dtype=torch.int32))


# ---- bert_padding ----------------------------------------------------------------------------


def _mask(lengths, seqlen):
    return (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).long()


def test_unpad_pad_round_trip(fa):
    from flash_attn.bert_padding import pad_input, unpad_input

    b, s, h, d = 3, 37, 2, 8
    lengths = [37, 1, 20]
    x = randn((b, s, h, d), F32, seed=10)
    mask = _mask(lengths, s)
    x_unpad, indices, cu, max_s, used = unpad_input(x, mask)
    assert x_unpad.shape == (sum(lengths), h, d)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 37, 38, 58]
    assert max_s == 37 and used.tolist() == lengths
    assert torch.equal(x_unpad, x[mask.bool()])
    back = pad_input(x_unpad, indices, b, s)
    assert torch.equal(back, x * mask[:, :, None, None])

    # A non-prefix mask (holes) round-trips as well; unused_mask tokens are packed but not used.
    holes = (torch.rand(b, s, generator=torch.Generator().manual_seed(11)) > 0.4).long()
    xu, idx, cu2, _, _ = unpad_input(x, holes)
    assert torch.equal(pad_input(xu, idx, b, s), x * holes[:, :, None, None])
    unused = _mask([0, 5, 3], s) * (1 - mask)
    xu3, _, cu3, _, used3 = unpad_input(x, mask, unused)
    assert cu3[-1].item() == sum(lengths) + int(unused.sum())
    assert used3.tolist() == lengths


def test_unpad_gradient_flows(fa):
    from flash_attn.bert_padding import pad_input, unpad_input

    x = randn((2, 9, 4), F32, seed=12, requires_grad=True)
    mask = _mask([9, 4], 9)
    xu, idx, _, _, _ = unpad_input(x, mask)
    (g,) = torch.autograd.grad(pad_input(xu * 2, idx, 2, 9).sum(), x)
    assert torch.equal(g, 2.0 * mask[:, :, None].float().expand_as(x))


def test_unpadded_attention_equals_padded(fa):
    from flash_attn.bert_padding import pad_input, unpad_input

    b, s, h, d = 2, 113, 2, 40
    lengths = [113, 60]
    q, k, v = make_qkv(b, s, s, h, h, d, F16, seed=13)
    mask = _mask(lengths, s)
    qu, idx, cu, max_s, _ = unpad_input(q, mask)
    ku, _, _, _, _ = unpad_input(k, mask)
    vu, _, _, _, _ = unpad_input(v, mask)
    out_u = fa.flash_attn_varlen_func(qu, ku, vu, cu, cu, max_s, max_s, causal=True)
    out = pad_input(out_u, idx, b, s)
    for i, n in enumerate(lengths):
        ref, _ = attention_ref(q[i:i + 1, :n].double(), k[i:i + 1, :n].double(),
                               v[i:i + 1, :n].double(), causal=True)
        nv, _ = attention_ref(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], causal=True,
                              dtype=F16)
        assert_close_to_ref(out[i:i + 1, :n], ref, nv, dtype=F16)
        assert (out[i, n:] == 0).all()


# ---- layers.rotary ---------------------------------------------------------------------------


def _hand_rotary(x, cos, sin, positions, interleaved):
    """Rotation as complex multiplication, in f64: x [.., t, h, d] with positions [.., t]."""
    rd = cos.shape[-1] * 2
    x64 = x.double()
    rot = torch.polar(torch.ones_like(cos.double()), torch.atan2(sin.double(), cos.double()))
    z = rot[positions].unsqueeze(-2)  # [.., t, 1, rd/2]
    if interleaved:
        c = torch.view_as_complex(x64[..., :rd].reshape(*x.shape[:-1], rd // 2, 2).contiguous())
        r = torch.view_as_real(c * z).flatten(-2)
    else:
        c = torch.complex(x64[..., :rd // 2], x64[..., rd // 2:rd])
        y = c * z
        r = torch.cat([y.real, y.imag], dim=-1)
    return torch.cat([r, x64[..., rd:]], dim=-1)


def _tables(n, rd, seed):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(n, rd // 2, generator=g, dtype=torch.float64) * 6.0
    return ang.cos().float(), ang.sin().float()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rd,offsets", [(40, 0), (24, 7), (40, "tensor")])
def test_apply_rotary_emb(fa, interleaved, rd, offsets):
    from flash_attn.layers.rotary import apply_rotary_emb

    b, t, h, d = 2, 13, 3, 40
    x = randn((b, t, h, d), F32, seed=14)
    cos, sin = _tables(64, rd, seed=15)
    if offsets == "tensor":
        offsets = torch.tensor([3, 40])
        pos = torch.arange(t)[None] + offsets[:, None]
    else:
        pos = (torch.arange(t) + offsets)[None].expand(b, -1)
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    want = _hand_rotary(x, cos, sin, pos, interleaved)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    assert torch.equal(got[..., rd:], x[..., rd:])
    # inplace writes into x and returns it.
    y = x.clone()
    ret = apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True,
                           seqlen_offsets=offsets)
    assert ret is y and torch.equal(y, got)


def test_apply_rotary_emb_varlen_and_half(fa):
    from flash_attn.layers.rotary import apply_rotary_emb

    lens = [5, 1, 9]
    cu = cu_seqlens(lens)
    x = randn((sum(lens), 2, 32), BF16, seed=16)
    cos, sin = _tables(40, 32, seed=17)
    got = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=9, seqlen_offsets=2)
    assert got.dtype == BF16
    pos = torch.cat([torch.arange(n) + 2 for n in lens])
    want = _hand_rotary(x, cos, sin, pos, False)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)

"""Bad input: a FlashAttnError (ValueError, args (message, kind)) or TypeError naming the problem,
never a crash; a KV cache is left bit-identical by a rejected call."""

from __future__ import annotations

import pytest
import torch

import flashattn
from flashattn import (FlashAttnError, flash_attn_func, flash_attn_varlen_func,
                       flash_attn_with_kvcache)
from flashattn.reference import attention_ref
from helpers import randn

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _qkv(b=2, sq=10, sk=12, h=4, hk=2, d=40, dt=F32):
    return (randn((b, sq, h, d), dt, seed=1), randn((b, sk, hk, d), dt, seed=2),
            randn((b, sk, hk, d), dt, seed=3))


def _cu(*xs):
    return torch.tensor(xs, dtype=torch.int32)


Q, K, V = _qkv()
QP, KP = randn((10, 4, 40), F32, seed=4), randn((12, 2, 40), F32, seed=5)

# name -> (call, exception type, regex the message must match)
CASES = {
    "rank 3 for batched": (lambda: flash_attn_func(Q[0], K[0], V[0]), FlashAttnError, r"rank 3.*expected 4"),
    "rank 5": (lambda: flash_attn_func(Q[None], K[None], V[None]), FlashAttnError, r"rank 5"),
    "varlen rank 4": (lambda: flash_attn_varlen_func(Q, K, V, _cu(0, 10), _cu(0, 12), 10, 12),
                      FlashAttnError, r"rank 4.*expected 3"),
    "head_dim mismatch": (lambda: flash_attn_func(Q, K[..., :32], V[..., :32]), FlashAttnError,
                          r"`k`.*\[2, 12, 2, 32\].*expected \[2, 12, 2, 40\]"),
    "v head_dim mismatch": (lambda: flash_attn_func(Q, K, V[..., :32]), FlashAttnError, r"`v`"),
    "heads not multiple": (lambda: flash_attn_func(Q, *_qkv(hk=3)[1:]), FlashAttnError,
                           r"heads \(4\).*multiple of heads_kv \(3\)"),
    "head_dim > 256": (lambda: flash_attn_func(*_qkv(h=2, hk=2, d=264)), FlashAttnError,
                       r"head_dim 264"),
    "batch mismatch": (lambda: flash_attn_func(Q, K[:1], V[:1]), FlashAttnError, r"`k`.*shape"),
    "k/v seqlen mismatch": (lambda: flash_attn_func(Q, K, V[:, :11]), FlashAttnError, r"`v`"),
    "dtype mismatch": (lambda: flash_attn_func(Q.half(), K.bfloat16(), V.half()), TypeError,
                       r"`k`.*bfloat16.*float16"),
    "int dtype": (lambda: flash_attn_func(Q.int(), K.int(), V.int()), TypeError, r"`q`.*int32"),
    "float64": (lambda: flash_attn_func(Q.double(), K.double(), V.double()), TypeError,
                r"float64"),
    "not a tensor": (lambda: flash_attn_func(Q.numpy(), K, V), TypeError, r"`q`.*Tensor"),
    "last dim not contiguous": (lambda: flash_attn_func(randn((2, 10, 4, 80), F32, seed=6)[..., ::2], K, V),
                                FlashAttnError, r"`q`.*last dimension.*contiguous"),
    "window negative": (lambda: flash_attn_func(Q, K, V, window_size=(-5, 3)), FlashAttnError,
                        r"window \(-5, 3\)"),
    "window arity": (lambda: flash_attn_func(Q, K, V, window_size=(1, 2, 3)), ValueError,
                     r"window_size"),
    "dropout 1": (lambda: flash_attn_func(Q, K, V, dropout_p=1.0), FlashAttnError, r"dropout_p 1"),
    "dropout 1.5": (lambda: flash_attn_func(Q, K, V, dropout_p=1.5), FlashAttnError, r"dropout_p"),
    "dropout negative": (lambda: flash_attn_func(Q, K, V, dropout_p=-0.1), FlashAttnError,
                         r"dropout_p"),
    "dropout nan": (lambda: flash_attn_func(Q, K, V, dropout_p=float("nan")), FlashAttnError,
                    r"dropout_p"),
    "softcap negative": (lambda: flash_attn_func(Q, K, V, softcap=-1.0), FlashAttnError, r"softcap"),
    "softcap inf": (lambda: flash_attn_func(Q, K, V, softcap=float("inf")), FlashAttnError,
                    r"softcap"),
    "softmax_scale nan": (lambda: flash_attn_func(Q, K, V, softmax_scale=float("nan")),
                          FlashAttnError, r"softmax_scale"),
    "alibi shape": (lambda: flash_attn_func(Q, K, V, alibi_slopes=torch.rand(3)), FlashAttnError,
                    r"alibi_slopes.*\[3\]"),
    "alibi dtype": (lambda: flash_attn_func(Q, K, V, alibi_slopes=torch.rand(4).half()),
                    FlashAttnError, r"alibi_slopes.*f16"),
    "sink shape": (lambda: flash_attn_func(Q, K, V, learnable_sink=torch.rand(2)), FlashAttnError,
                   r"learnable_sink.*\[2\]"),
    "sink dtype": (lambda: flash_attn_func(Q, K, V, learnable_sink=torch.rand(4).bfloat16()),
                   FlashAttnError, r"learnable_sink.*bf16"),
    "cu_seqlens decreasing": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(0, 6, 4), _cu(0, 6, 12), 6, 6),
                              FlashAttnError, r"cu_seqlens_q.*decreases"),
    "cu_seqlens past total": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(0, 4, 11), _cu(0, 6, 12), 7, 6),
                              FlashAttnError, r"cu_seqlens_q.*11.*10 tokens"),
    "cu_seqlens_k past total": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(0, 4, 10), _cu(0, 6, 13), 6, 7),
                                FlashAttnError, r"cu_seqlens_k"),
    "cu_seqlens not from 0": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(1, 4, 10), _cu(0, 6, 12), 6, 6),
                              FlashAttnError, r"cu_seqlens_q.*start"),
    "cu_seqlens count mismatch": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(0, 4, 10), _cu(0, 12), 6, 12),
                                  FlashAttnError, r"cu_seqlens_k.*entries"),
    "cu_seqlens empty": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(), _cu(), 6, 6),
                         FlashAttnError, r"cu_seqlens"),
    "cu_seqlens float": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(0, 4, 10).float(), _cu(0, 6, 12), 6, 6),
                         TypeError, r"cu_seqlens_q.*integers"),
    "cu_seqlens negative": (lambda: flash_attn_varlen_func(QP, KP, KP, _cu(0, -1, 10), _cu(0, 6, 12), 6, 6),
                            FlashAttnError, r"cu_seqlens_q"),
    "block_table with dropout": (lambda: flash_attn_varlen_func(
        QP, randn((4, 16, 2, 40), F32, seed=7), randn((4, 16, 2, 40), F32, seed=8), _cu(0, 10), _cu(0, 12),
        10, 12, dropout_p=0.1, block_table=_cu(0).view(1, 1)), ValueError, r"block_table"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rejected(name):
    call, exc, pattern = CASES[name]
    with pytest.raises(exc, match=pattern) as info:
        call()
    if isinstance(info.value, FlashAttnError):
        assert isinstance(info.value, ValueError)
        message, kind = info.value.args
        assert isinstance(message, str) and isinstance(kind, str) and kind


def test_error_kinds():
    with pytest.raises(FlashAttnError) as info:
        flash_attn_func(*_qkv(h=2, hk=2, d=264))
    assert info.value.args[1] == "HeadDim"
    with pytest.raises(FlashAttnError) as info:
        flash_attn_func(Q, K, V, dropout_p=1.0)
    assert info.value.args[1] == "Dropout"
    with pytest.raises(FlashAttnError) as info:
        flash_attn_varlen_func(QP, KP, KP, _cu(0, 6, 4), _cu(0, 6, 12), 6, 6)
    assert info.value.args[1] == "CuSeqlens"


def test_bwd_op_rejects_inconsistent_lse():
    # The raw bwd op with inconsistent shapes (lse of the wrong size) is an error, not a crash.
    q, k, v = _qkv()
    out, lse, rng = torch.ops.flashattn.fwd(q, k, v, None, None, 0.0, 0.1, False, -1, -1, 0.0,
                                            None, None)
    with pytest.raises((FlashAttnError, TypeError)):
        torch.ops.flashattn.bwd(out, q, k, v, out, lse[:, :, :5], None, None, 0.0, 0.1, False,
                                -1, -1, 0.0, None, None, rng)


def test_empty_keys_give_zero_out():
    # seqlen_k = 0 is valid: every row sees no key -> out 0, lse -inf (as the reference).
    q, k, v = _qkv(sk=0)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double())
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse.double(), ref_lse)


def test_empty_batch():
    q, k, v = _qkv(b=0)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape


def test_empty_queries():
    q, k, v = _qkv(sq=0)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (2, 0, 4, 40) and lse.shape == (2, 4, 0)


def test_varlen_empty_queries():
    q = randn((0, 4, 40), F32, seed=9)
    out = flash_attn_varlen_func(q, KP, KP, _cu(0, 0, 0), _cu(0, 6, 12), 0, 6)
    assert out.shape == (0, 4, 40)


# ---- KV cache: rejected calls leave the caches bit-identical ------------------------------------


def _kv_setup(dt=F16):
    b, h, hk, d = 2, 4, 2, 40
    kc, vc = randn((b, 64, hk, d), dt, seed=10), randn((b, 64, hk, d), dt, seed=11)
    q = randn((b, 3, h, d), dt, seed=12)
    kn, vn = randn((b, 3, hk, d), dt, seed=13), randn((b, 3, hk, d), dt, seed=14)
    return q, kc, vc, kn, vn


KV_CASES = {
    "cache_seqlens past the cache": (dict(cache_seqlens=_cu(10, 62)), FlashAttnError,
                                     r"cache_seqlens\[1\] = 62.*65 slots.*64"),
    "cache_seqlens past the cache (no append)": (dict(cache_seqlens=_cu(10, 65), new=False),
                                                 FlashAttnError, r"cache_seqlens\[1\] = 65"),
    "cache_seqlens negative": (dict(cache_seqlens=_cu(10, -1)), FlashAttnError,
                               r"cache_seqlens.*-1"),
    "cache_seqlens count": (dict(cache_seqlens=_cu(10)), FlashAttnError, r"cache_seqlens.*entries"),
    "cache_seqlens float": (dict(cache_seqlens=_cu(10, 20).float()), TypeError, r"cache_seqlens"),
    "k without v": (dict(vn=None), FlashAttnError, r"k and v"),
    "new keys dtype": (dict(kn="half-f32"), TypeError, r"`k`"),
    "new keys head_dim": (dict(kn="hd32"), FlashAttnError, r"k_new"),
    "cache_batch_idx out of range": (dict(cache_batch_idx=_cu(0, 2)), FlashAttnError,
                                     r"cache_batch_idx.*2"),
    "cache_batch_idx negative": (dict(cache_batch_idx=_cu(0, -1)), FlashAttnError,
                                 r"cache_batch_idx"),
    "cache_leftpad past seqlen": (dict(cache_leftpad=_cu(11, 0)), FlashAttnError,
                                  r"cache_leftpad.*11"),
    "rotary table too short": (dict(rotary=16), FlashAttnError, r"rotary.*16 rows"),
    "rotary dim too large": (dict(rotary="odd"), FlashAttnError, r"rotary_dim"),
    "num_splits too large": (dict(num_splits=1000), FlashAttnError, r"num_splits"),
    "window": (dict(window_size=(-3, 0)), FlashAttnError, r"window"),
    "softcap": (dict(softcap=float("inf")), FlashAttnError, r"softcap"),
    "alibi": (dict(alibi_slopes=torch.rand(3)), FlashAttnError, r"alibi_slopes"),
    "sink": (dict(learnable_sink=torch.rand(3)), FlashAttnError, r"learnable_sink"),
    "q head_dim": (dict(q="hd32"), FlashAttnError, r"shape"),
    "k_cache is v_cache": (dict(vc="alias"), FlashAttnError, r"overlaps"),
    "new k inside the cache": (dict(kn="alias"), FlashAttnError, r"overlaps"),
}


@pytest.mark.parametrize("name", list(KV_CASES))
def test_kvcache_rejected_leaves_cache(name):
    opts, exc, pattern = KV_CASES[name]
    opts = dict(opts)
    q, kc, vc, kn, vn = _kv_setup()
    kw = dict(cache_seqlens=_cu(10, 20), causal=True)
    if opts.pop("new", True) is False:
        kn = vn = None
    if "vn" in opts:
        vn = opts.pop("vn")
    special = opts.pop("kn", None)
    if special == "half-f32":
        kn, vn = kn.float(), vn.float()
    elif special == "hd32":
        kn, vn = kn[..., :32], vn[..., :32]
    elif special == "alias":
        kn = kc[:, :3]
    if opts.pop("q", None) == "hd32":
        q = q[..., :32]
    if opts.pop("vc", None) == "alias":
        vc = kc
    rot = opts.pop("rotary", None)
    if rot == 16:
        kw["rotary_cos"], kw["rotary_sin"] = torch.rand(16, 20), torch.rand(16, 20)
    elif rot == "odd":
        kw["rotary_cos"], kw["rotary_sin"] = torch.rand(64, 21), torch.rand(64, 21)
    kw.update(opts)
    kc0, vc0 = kc.clone(), vc.clone()
    with pytest.raises(exc, match=pattern):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    assert torch.equal(kc, kc0), "k_cache modified by a rejected call"
    assert torch.equal(vc, vc0), "v_cache modified by a rejected call"


@pytest.mark.parametrize("table,seqlens,pattern", [
    ([[0, 1], [2, 9]], [5, 20], r"block_table.*9"),
    ([[0, 1], [2, 3]], [5, 30], r"30.*33 slots.*32"),
    ([[0, 1], [2, -1]], [5, 20], r"block_table"),
])
def test_paged_cache_rejected_leaves_pages(table, seqlens, pattern):
    q, _, _, kn, vn = _kv_setup(BF16)
    kp, vp = randn((6, 16, 2, 40), BF16, seed=15), randn((6, 16, 2, 40), BF16, seed=16)
    kp0, vp0 = kp.clone(), vp.clone()
    with pytest.raises(FlashAttnError, match=pattern):
        flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=_cu(*seqlens),
                                block_table=torch.tensor(table, dtype=torch.int32))
    assert torch.equal(kp, kp0) and torch.equal(vp, vp0)


def test_paged_cache_needs_2d_table_and_seqlens():
    q, _, _, kn, vn = _kv_setup()
    kp, vp = randn((6, 16, 2, 40), F16, seed=17), randn((6, 16, 2, 40), F16, seed=18)
    kp0 = kp.clone()
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=_cu(5, 20),
                                block_table=_cu(0, 1, 2, 3))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kp, vp, kn, vn, block_table=_cu(0, 1, 2, 3).view(2, 2))
    assert torch.equal(kp, kp0)


def test_fp8_cache_rejected_leaves_cache():
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None:
        pytest.skip("torch without float8")
    q, kc, vc, kn, vn = _kv_setup(BF16)
    kc8, vc8 = kc.float().to(e4m3), vc.float().to(e4m3)
    kb, vb = kc8.view(torch.uint8).clone(), vc8.view(torch.uint8).clone()
    with pytest.raises(FlashAttnError, match="descale"):
        flash_attn_with_kvcache(q, kc8, vc8, kn, vn, cache_seqlens=_cu(10, 20),
                                k_descale=torch.tensor([-1.0]))
    with pytest.raises(FlashAttnError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc8, vc8, kn, vn, cache_seqlens=_cu(10, 63))
    assert torch.equal(kc8.view(torch.uint8), kb) and torch.equal(vc8.view(torch.uint8), vb)


def test_cache_last_dim_not_contiguous():
    q, kc, vc, kn, vn = _kv_setup()
    wide = randn((2, 64, 2, 80), F16, seed=19)
    w0 = wide.clone()
    with pytest.raises(FlashAttnError, match="k_cache.*last dimension"):
        flash_attn_with_kvcache(q, wide[..., ::2], vc, kn, vn, cache_seqlens=_cu(10, 20))
    assert torch.equal(wide, w0)


def test_rotary_cos_without_sin_rejected():
    q, kc, vc, kn, vn = _kv_setup(F32)
    kc0 = kc.clone()
    try:
        with pytest.raises((FlashAttnError, ValueError, TypeError), match="rotary"):
            flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=torch.rand(64, 20),
                                    cache_seqlens=_cu(10, 20))
    finally:
        assert torch.equal(kc, kc0)


def test_negative_num_splits_is_automatic():
    q, kc, vc, _, _ = _kv_setup(F32)
    auto = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_cu(10, 20), num_splits=0)
    neg = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_cu(10, 20), num_splits=-1)
    assert torch.equal(auto, neg)


def test_flash_attn_error_is_value_error():
    assert issubclass(flashattn.FlashAttnError, ValueError)

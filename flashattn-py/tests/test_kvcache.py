"""flash_attn_with_kvcache: in-place appends (the cache contents are checked after each call), and
the attention over the updated caches against the float64 reference, with rotary embeddings,
cache_batch_idx, cache_leftpad, paged caches (block_table), num_splits and return_softmax_lse."""

from __future__ import annotations

import pytest
import torch

from flashattn import flash_attn_with_kvcache
from flashattn.compat.flash_attn.layers.rotary import apply_rotary_emb
from flashattn.reference import attention_ref
from helpers import (alibi, assert_close_to_ref, assert_lse_close, cu_seqlens, dtype_id,
                     naive_dtype, randn, sink)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def kv_reference(q, k_cache, v_cache, rows, ends, starts=None, *, q_ref=None, dtype=torch.float64,
                 alibi_slopes=None, **kw):
    """Batch row b attends keys ``k_cache[rows[b], starts[b]:ends[b]]`` (``k_cache`` being the
    expected cache after the append, built by the test); returns (out, lse) stacked."""
    q_ref = q if q_ref is None else q_ref
    outs, lses = [], []
    for b in range(q.shape[0]):
        s0 = 0 if starts is None else int(starts[b])
        ks = k_cache[int(rows[b]), s0:int(ends[b])][None]
        vs = v_cache[int(rows[b]), s0:int(ends[b])][None]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        o, l = attention_ref(q_ref[b:b + 1].to(dtype), ks.to(dtype), vs.to(dtype), dtype=dtype,
                             alibi_slopes=slopes, **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def check_kv_out(out, q, k_exp, v_exp, rows, ends, starts=None, *, lse=None, q_ref=None,
                 q_naive=None, **kw):
    dt = q.dtype
    ref, ref_lse = kv_reference(q, k_exp, v_exp, rows, ends, starts,
                                q_ref=None if q_ref is None else q_ref.double(), **kw)
    nd = naive_dtype(dt)
    naive, naive_lse = kv_reference(q, k_exp, v_exp, rows, ends, starts,
                                    q_ref=None if q_naive is None else q_naive, dtype=nd, **kw)
    assert out.shape == q.shape and out.dtype == dt
    assert_close_to_ref(out, ref, naive.to(dt), dtype=dt)
    if lse is not None:
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        assert_lse_close(lse, ref_lse, naive_lse, dtype=dt)


def caches(batch_cache, cap, hk, d, dt, seed):
    return (randn((batch_cache, cap, hk, d), dt, seed=seed),
            randn((batch_cache, cap, hk, d), dt, seed=seed + 1))


def expected_after_append(cache, new, rows, seqlens):
    exp = cache.clone()
    for b in range(new.shape[0]):
        s = int(seqlens[b])
        exp[int(rows[b]), s:s + new.shape[1]] = new[b]
    return exp


# (dtype, batch, seqlen_new (= seqlen_q), heads, heads_kv, head_dim, causal, cache_seqlens)
APPEND = [
    (F32, 2, 1, 4, 2, 59, False, [50, 113]),
    (F16, 2, 5, 4, 1, 40, True, [0, 203]),
    (BF16, 1, 113, 4, 4, 111, True, [90]),
    (F16, 2, 1, 2, 2, 256, False, [1, 250]),
    (BF16, 2, 3, 4, 2, 64, True, [203, 7]),
]


def _aid(c):
    dt, b, n, h, hk, d, causal, sl = c
    return f"{dtype_id(dt)}-b{b}-new{n}-h{h}-hk{hk}-d{d}-seq{'_'.join(map(str, sl))}" + (
        "-causal" if causal else "")


@pytest.mark.parametrize("case", APPEND, ids=[_aid(c) for c in APPEND])
def test_append_and_attend(case):
    dt, b, n, h, hk, d, causal, sl = case
    cap = 256 + 3
    k_cache, v_cache = caches(b, cap, hk, d, dt, seed=1)
    q = randn((b, n, h, d), dt, seed=3)
    k_new, v_new = randn((b, n, hk, d), dt, seed=4), randn((b, n, hk, d), dt, seed=5)
    seqlens = torch.tensor(sl, dtype=torch.int32)
    rows = list(range(b))
    k_exp = expected_after_append(k_cache, k_new, rows, seqlens)
    v_exp = expected_after_append(v_cache, v_new, rows, seqlens)
    seqlens_before = seqlens.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                       causal=causal, return_softmax_lse=True)
    assert torch.equal(k_cache, k_exp), "k_cache after the append"
    assert torch.equal(v_cache, v_exp), "v_cache after the append"
    assert torch.equal(seqlens, seqlens_before), "cache_seqlens is not updated"
    ends = [s + n for s in sl]
    check_kv_out(out, q, k_exp, v_exp, rows, ends, lse=lse, causal=causal)


@pytest.mark.parametrize("dt", [F32, BF16], ids=dtype_id)
def test_no_new_keys(dt):
    b, h, hk, d = 2, 4, 2, 40
    k_cache, v_cache = caches(b, 203, hk, d, dt, seed=7)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = randn((b, 2, h, d), dt, seed=9)
    sl = torch.tensor([113, 1], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=sl, causal=True)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)
    check_kv_out(out, q, k0, v0, [0, 1], sl.tolist(), causal=True)


def test_cache_seqlens_int_and_none():
    b, h, d = 2, 2, 40
    k_cache, v_cache = caches(b, 64, h, d, F32, seed=11)
    q = randn((b, 1, h, d), F32, seed=12)
    full = flash_attn_with_kvcache(q, k_cache, v_cache)
    check_kv_out(full, q, k_cache, v_cache, [0, 1], [64, 64])
    as_int = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=30)
    check_kv_out(as_int, q, k_cache, v_cache, [0, 1], [30, 30])
    as_tensor = flash_attn_with_kvcache(q, k_cache, v_cache,
                                        cache_seqlens=torch.tensor([30, 30], dtype=torch.int32))
    assert torch.equal(as_int, as_tensor)


def _rotary_tables(seqlen_ro, rotary_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    inv = inv * (1 + 0.1 * torch.rand(inv.shape, generator=g, dtype=torch.float64))
    angles = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv[None]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def _rotate_q(q, cos, sin, seqlens, interleaved, per_token: bool):
    """q rotated in f32 as the kernel keeps it: at cache_seqlens[b] + i when per_token (causal or
    windowed), else every query at cache_seqlens[b]."""
    qf = q.float()
    if per_token:
        return apply_rotary_emb(qf, cos.float(), sin.float(), interleaved=interleaved,
                                seqlen_offsets=seqlens)
    cols = [apply_rotary_emb(qf[:, i:i + 1], cos.float(), sin.float(), interleaved=interleaved,
                             seqlen_offsets=seqlens) for i in range(q.shape[1])]
    return torch.cat(cols, dim=1)


@pytest.mark.parametrize("dt,interleaved,causal,window,rd,d", [
    (F32, True, True, (-1, -1), 59 - 1, 59),
    (F16, False, True, (-1, -1), 40, 40),
    (BF16, True, False, (-1, -1), 32, 111),
    (F16, False, False, (-1, -1), 64, 128),
    (BF16, False, False, (6, 2), 40, 40),
], ids=["f32-interleaved-causal-partial", "f16-neox-causal", "bf16-interleaved-partial-noncausal",
        "f16-neox-noncausal", "bf16-neox-window"])
def test_rotary(dt, interleaved, causal, window, rd, d):
    b, n, h, hk = 2, 4, 4, 2
    cap = 160
    k_cache, v_cache = caches(b, cap, hk, d, dt, seed=13)
    q = randn((b, n, h, d), dt, seed=15)
    k_new, v_new = randn((b, n, hk, d), dt, seed=16), randn((b, n, hk, d), dt, seed=17)
    seqlens = torch.tensor([100, 3], dtype=torch.int32)
    cos, sin = _rotary_tables(cap, rd, dt if dt != F32 else F32, seed=18)
    k_rot = apply_rotary_emb(k_new, cos, sin, interleaved=interleaved, seqlen_offsets=seqlens)
    assert not torch.equal(k_rot, k_new)
    k_exp = expected_after_append(k_cache, k_rot, [0, 1], seqlens)
    v_exp = expected_after_append(v_cache, v_new, [0, 1], seqlens)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                  rotary_sin=sin, cache_seqlens=seqlens, causal=causal,
                                  window_size=window, rotary_interleaved=interleaved)
    # The appended keys are rotated (and rounded to the cache's dtype): within an ulp of the
    # compat rotation; values and every other position untouched.
    torch.testing.assert_close(k_cache.float(), k_exp.float(), rtol=torch.finfo(dt).eps,
                               atol=1e-6)
    assert torch.equal(v_cache, v_exp)
    mask = torch.ones_like(k_cache, dtype=torch.bool)
    for bi in range(b):
        mask[bi, int(seqlens[bi]):int(seqlens[bi]) + n] = False
    assert torch.equal(k_cache[mask], k_exp[mask])
    per_token = causal or window != (-1, -1)
    q_rot = _rotate_q(q, cos, sin, seqlens, interleaved, per_token)
    ends = (seqlens + n).tolist()
    check_kv_out(out, q, k_cache, v_exp, [0, 1], ends, q_ref=q_rot, q_naive=q_rot.to(dt),
                 causal=causal, window_size=window)


def test_rotary_changes_output():
    b, n, h, d = 1, 2, 2, 40
    k_cache, v_cache = caches(b, 64, h, d, F32, seed=19)
    q = randn((b, n, h, d), F32, seed=20)
    kn, vn = randn((b, n, h, d), F32, seed=21), randn((b, n, h, d), F32, seed=22)
    cos, sin = _rotary_tables(64, d, F32, seed=23)
    sl = torch.tensor([10], dtype=torch.int32)
    a = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), kn, vn, cache_seqlens=sl,
                                causal=True)
    r = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), kn, vn, rotary_cos=cos,
                                rotary_sin=sin, cache_seqlens=sl, causal=True)
    assert not torch.equal(a, r)


@pytest.mark.parametrize("dt", [F16, F32], ids=dtype_id)
def test_cache_batch_idx(dt):
    b, n, h, hk, d = 2, 3, 4, 2, 40
    k_cache, v_cache = caches(5, 128, hk, d, dt, seed=25)
    q = randn((b, n, h, d), dt, seed=26)
    kn, vn = randn((b, n, hk, d), dt, seed=27), randn((b, n, hk, d), dt, seed=28)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    sl = torch.tensor([60, 113], dtype=torch.int32)
    rows = idx.tolist()
    k_exp = expected_after_append(k_cache, kn, rows, sl)
    v_exp = expected_after_append(v_cache, vn, rows, sl)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=sl,
                                       cache_batch_idx=idx, causal=True, return_softmax_lse=True)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    check_kv_out(out, q, k_exp, v_exp, rows, (sl + n).tolist(), lse=lse, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_cache_leftpad(causal):
    dt = BF16
    b, n, h, hk, d = 2, 2, 4, 1, 59
    k_cache, v_cache = caches(b, 203, hk, d, dt, seed=31)
    q = randn((b, n, h, d), dt, seed=32)
    kn, vn = randn((b, n, hk, d), dt, seed=33), randn((b, n, hk, d), dt, seed=34)
    sl = torch.tensor([150, 40], dtype=torch.int32)
    lp = torch.tensor([37, 0], dtype=torch.int32)
    k_exp = expected_after_append(k_cache, kn, [0, 1], sl)
    v_exp = expected_after_append(v_cache, vn, [0, 1], sl)
    slopes = alibi(b, h)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=sl,
                                  cache_leftpad=lp, causal=causal, alibi_slopes=slopes)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    check_kv_out(out, q, k_exp, v_exp, [0, 1], (sl + n).tolist(), lp.tolist(), causal=causal,
                 alibi_slopes=slopes)


def _paged_setup(b, page, max_blocks, hk, d, dt, seed):
    num_blocks = b * max_blocks + 2
    k_pages = randn((num_blocks, page, hk, d), dt, seed=seed)
    v_pages = randn((num_blocks, page, hk, d), dt, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks)
    return k_pages, v_pages, table.to(torch.int32).contiguous()


def _gather(pages, table):
    # [b, max_blocks * page, hk, d]: each sequence's logical cache.
    return torch.stack([pages[row.long()].reshape(-1, *pages.shape[2:]) for row in table])


@pytest.mark.parametrize("dt,page,n,causal", [(F16, 16, 1, True), (BF16, 256, 5, True),
                                              (F32, 10, 3, False)],
                         ids=["f16-page16-new1", "bf16-page256-new5", "f32-page10-new3"])
def test_block_table(dt, page, n, causal):
    b, h, hk, d = 2, 4, 2, 40
    max_blocks = -(-300 // page)
    k_pages, v_pages, table = _paged_setup(b, page, max_blocks, hk, d, dt, seed=41)
    q = randn((b, n, h, d), dt, seed=43)
    kn, vn = randn((b, n, hk, d), dt, seed=44), randn((b, n, hk, d), dt, seed=45)
    sl = torch.tensor([203, page - 1], dtype=torch.int32)  # the second append crosses a page
    k_log = expected_after_append(_gather(k_pages, table), kn, [0, 1], sl)
    v_log = expected_after_append(_gather(v_pages, table), vn, [0, 1], sl)
    used = set(table.flatten().tolist())
    free = [i for i in range(k_pages.shape[0]) if i not in used]
    k_free0 = k_pages[free].clone()
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, kn, vn, cache_seqlens=sl,
                                       block_table=table, causal=causal, return_softmax_lse=True)
    assert torch.equal(_gather(k_pages, table), k_log)
    assert torch.equal(_gather(v_pages, table), v_log)
    assert torch.equal(k_pages[free], k_free0), "pages outside the table were written"
    check_kv_out(out, q, k_log, v_log, [0, 1], (sl + n).tolist(), lse=lse, causal=causal)


def test_block_table_with_leftpad_and_rotary():
    dt, b, n, h, hk, d, page = F16, 2, 2, 2, 2, 64, 32
    k_pages, v_pages, table = _paged_setup(b, page, 4, hk, d, dt, seed=47)
    q = randn((b, n, h, d), dt, seed=48)
    kn, vn = randn((b, n, hk, d), dt, seed=49), randn((b, n, hk, d), dt, seed=50)
    sl = torch.tensor([70, 33], dtype=torch.int32)
    lp = torch.tensor([5, 33], dtype=torch.int32)
    cos, sin = _rotary_tables(128, d, dt, seed=51)
    k_rot = apply_rotary_emb(kn, cos, sin, interleaved=False, seqlen_offsets=sl)
    k_log = expected_after_append(_gather(k_pages, table), k_rot, [0, 1], sl)
    v_log = expected_after_append(_gather(v_pages, table), vn, [0, 1], sl)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=sl, cache_leftpad=lp, block_table=table,
                                  causal=True, rotary_interleaved=False)
    k_now = _gather(k_pages, table)
    torch.testing.assert_close(k_now.float(), k_log.float(), rtol=torch.finfo(dt).eps, atol=1e-6)
    assert torch.equal(_gather(v_pages, table), v_log)
    q_rot = _rotate_q(q, cos, sin, sl, False, True)
    check_kv_out(out, q, k_now, v_log, [0, 1], (sl + n).tolist(), lp.tolist(), q_ref=q_rot,
                 q_naive=q_rot.to(dt), causal=True)


@pytest.mark.parametrize("num_splits", [0, 1, 3, 16])
def test_num_splits(num_splits):
    dt, b, h, hk, d = BF16, 2, 4, 1, 111
    k_cache, v_cache = caches(b, 1023, hk, d, dt, seed=61)
    q = randn((b, 1, h, d), dt, seed=62)
    sl = torch.tensor([1023, 500], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=sl,
                                       num_splits=num_splits, return_softmax_lse=True)
    check_kv_out(out, q, k_cache, v_cache, [0, 1], sl.tolist(), lse=lse)
    if num_splits > 0:
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            again = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=sl,
                                            num_splits=num_splits)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(out, again), "a fixed num_splits is bit-identical on any thread count"


@pytest.mark.parametrize("name,kw", [
    ("window", dict(window_size=(20, 0))),
    ("softcap", dict(softcap=3.0, causal=True)),
    ("alibi[h]", dict(alibi_slopes=alibi(None, 4), causal=True)),
    ("sink", dict(learnable_sink=sink(4))),
    ("scale", dict(softmax_scale=0.4, causal=True)),
])
def test_kvcache_options(name, kw):
    dt, b, n, h, hk, d = F16, 2, 3, 4, 2, 40
    k_cache, v_cache = caches(b, 256, hk, d, dt, seed=71)
    q = randn((b, n, h, d), dt, seed=72, scale=2.0)
    kn, vn = randn((b, n, hk, d), dt, seed=73), randn((b, n, hk, d), dt, seed=74)
    sl = torch.tensor([113, 30], dtype=torch.int32)
    k_exp = expected_after_append(k_cache, kn, [0, 1], sl)
    v_exp = expected_after_append(v_cache, vn, [0, 1], sl)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=sl,
                                       return_softmax_lse=True, **kw)
    rkw = dict(kw)
    if "softmax_scale" in rkw:
        rkw["scale"] = rkw.pop("softmax_scale")
    check_kv_out(out, q, k_exp, v_exp, [0, 1], (sl + n).tolist(), lse=lse, **rkw)


def test_strided_cache_views():
    # k_cache/v_cache as non-contiguous views (strided heads, a slice of a wider last dim): the
    # append must go through the strides and leave the rest of the buffers alone.
    dt, b, n, h, hk, d = F32, 2, 2, 2, 2, 40
    big_k = randn((b, 128, hk * 2, d), dt, seed=81)
    big_v = randn((b, 128, hk, d + 8), dt, seed=85)
    k_cache, v_cache = big_k[:, :, 1::2], big_v[..., 8:]
    big_k0, big_v0 = big_k.clone(), big_v.clone()
    assert not (k_cache.is_contiguous() or v_cache.is_contiguous())
    q = randn((b, n, h, d), dt, seed=82)
    kn = randn((b, n, hk * 2, d), dt, seed=83)[:, :, ::2]
    vn = randn((b, n, hk, d), dt, seed=84)
    sl = torch.tensor([64, 100], dtype=torch.int32)
    k_exp = expected_after_append(k_cache, kn, [0, 1], sl)
    v_exp = expected_after_append(v_cache, vn, [0, 1], sl)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=sl, causal=True)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    assert torch.equal(big_k[:, :, 0::2], big_k0[:, :, 0::2])
    assert torch.equal(big_v[..., :8], big_v0[..., :8])
    check_kv_out(out, q, k_exp, v_exp, [0, 1], (sl + n).tolist(), causal=True)


def test_packed_kv_cache_views():
    dt, b, n, h, hk, d = F32, 2, 2, 2, 2, 40
    kv = randn((b, 128, 2, hk, d), dt, seed=81)
    k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    q = randn((b, n, h, d), dt, seed=82)
    kn, vn = randn((b, n, hk, d), dt, seed=83), randn((b, n, hk, d), dt, seed=84)
    sl = torch.tensor([64, 100], dtype=torch.int32)
    k_exp = expected_after_append(k_cache, kn, [0, 1], sl)
    v_exp = expected_after_append(v_cache, vn, [0, 1], sl)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=sl, causal=True)
    assert torch.equal(kv[:, :, 0], k_exp) and torch.equal(kv[:, :, 1], v_exp)
    check_kv_out(out, q, k_exp, v_exp, [0, 1], (sl + n).tolist(), causal=True)


def test_packed_queries_and_new_keys():
    # cu_seqlens_q / cu_seqlens_k_new: chunked prefill mixed with decoding.
    dt, h, hk, d = BF16, 4, 2, 59
    lens = [5, 1, 30]
    cu = cu_seqlens(lens)
    k_cache, v_cache = caches(3, 256, hk, d, dt, seed=91)
    q = randn((sum(lens), h, d), dt, seed=92)
    kn, vn = randn((sum(lens), hk, d), dt, seed=93), randn((sum(lens), hk, d), dt, seed=94)
    sl = torch.tensor([100, 0, 203], dtype=torch.int32)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for bi in range(3):
        s, a, e = int(sl[bi]), int(cu[bi]), int(cu[bi + 1])
        k_exp[bi, s:s + e - a] = kn[a:e]
        v_exp[bi, s:s + e - a] = vn[a:e]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=sl,
                                       causal=True, return_softmax_lse=True, cu_seqlens_q=cu,
                                       cu_seqlens_k_new=cu)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    assert out.shape == q.shape and lse.shape == (h, sum(lens))
    for bi in range(3):
        a, e = int(cu[bi]), int(cu[bi + 1])
        qb = q[a:e][None]
        ref, rl = kv_reference(qb, k_exp, v_exp, [bi], [int(sl[bi]) + e - a], causal=True)
        nv, _ = kv_reference(qb, k_exp, v_exp, [bi], [int(sl[bi]) + e - a], causal=True,
                             dtype=dt)
        assert_close_to_ref(out[a:e][None], ref, nv, dtype=dt, name=f"out[seq {bi}]")


def test_kvcache_no_grad_needed_and_repeat_decode():
    # Several decode steps: each appends one token; the cache grows as expected.
    dt, b, h, d = F32, 1, 2, 40
    k_cache, v_cache = caches(b, 32, h, d, dt, seed=101)
    k_cache.zero_()  # contents past the cached length must never be read
    v_cache.fill_(float("nan"))
    steps_k, steps_v = [], []
    for t in range(4):
        q = randn((b, 1, h, d), dt, seed=200 + t)
        kn, vn = randn((b, 1, h, d), dt, seed=300 + t), randn((b, 1, h, d), dt, seed=400 + t)
        steps_k.append(kn)
        steps_v.append(vn)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=t, causal=True)
        assert torch.isfinite(out).all(), "read past the cached length (NaN garbage)"
        k_all, v_all = torch.cat(steps_k, 1), torch.cat(steps_v, 1)
        assert torch.equal(k_cache[:, :t + 1], k_all) and torch.equal(v_cache[:, :t + 1], v_all)
        ref, _ = attention_ref(q.double(), k_all.double(), v_all.double(), causal=True)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_cache_batch_idx_with_per_batch_alibi_and_sink():
    # ALiBi [batch, heads] slopes follow the query batch row, not the cache row it reads.
    dt, b, n, h, hk, d = F32, 2, 2, 4, 2, 40
    k_cache, v_cache = caches(3, 64, hk, d, dt, seed=111)
    q = randn((b, n, h, d), dt, seed=112)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    sl = torch.tensor([30, 50], dtype=torch.int32)
    slopes, s = alibi(b, h), sink(h)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=sl, cache_batch_idx=idx,
                                       alibi_slopes=slopes, learnable_sink=s, causal=True,
                                       return_softmax_lse=True)
    check_kv_out(out, q, k_cache, v_cache, idx.tolist(), sl.tolist(), lse=lse, causal=True,
                 alibi_slopes=slopes, learnable_sink=s)


def test_empty_rows_in_decode():
    # More queries than visible keys, causal: the first rows see nothing (out 0, lse -inf).
    dt = F32
    k_cache, v_cache = caches(1, 8, 2, 16, dt, seed=121)
    q = randn((1, 5, 2, 16), dt, seed=122)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2, causal=True,
                                       return_softmax_lse=True)
    assert (out[:, :3] == 0).all() and torch.isneginf(lse[..., :3]).all()
    check_kv_out(out, q, k_cache, v_cache, [0], [2], lse=lse, causal=True)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_paged_cache(fmt):
    fmt = getattr(torch, fmt, None)
    if fmt is None:
        pytest.skip("torch without float8")
    b, h, hk, d, page = 2, 4, 2, 32, 16
    kp = randn((8, page, hk, d), F32, seed=131).to(fmt)
    vp = randn((8, page, hk, d), F32, seed=132).to(fmt)
    q = randn((b, 1, h, d), BF16, seed=133)
    table = torch.tensor([[3, 1, 0], [2, 5, 7]], dtype=torch.int32)
    sl = torch.tensor([40, 20], dtype=torch.int32)
    ks, vs = torch.tensor([0.5]), torch.tensor([1.5])
    out = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=sl, block_table=table, k_descale=ks,
                                  v_descale=vs)
    k_log = _gather(kp.double(), table) * 0.5
    v_log = _gather(vp.double(), table) * 1.5
    check_kv_out(out, q, k_log, v_log, [0, 1], sl.tolist())

"""Block masks (``create_block_mask``, ``BlockMask.from_dense``, ``flex_attention``): forward and
gradients against the float64 reference with the same dense boolean mask (and torch's SDPA with
an explicit boolean mask), with causal and windows ANDed, GQA, seqlen_q != seqlen_k both ways,
packed sequences, rows that see no key, and the inputs refused; the ops ``flashattn::fwd_masked``
and ``bwd_masked`` through torch.library.opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashattn
from flashattn import (BlockMask, FlashAttnError, create_block_mask, flash_attn_func,
                       flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flex_attention)
from flashattn.reference import attention_ref
from helpers import (check_forward, check_gradients, cu_seqlens, dtype_id, leaf, make_qkv,
                     sink)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q - kv).abs() <= 24


def prefix_lm(b, h, q, kv):
    return (kv < 20) | (q >= kv)


def empty_rows(b, h, q, kv):
    # Rows 3, 10, 17, ... see no key (broadcast: the result has no kv dimension of its own).
    return (q % 7 != 3) & (kv >= 0)


def document(sq, sk):
    """Documents cut at key positions 0, 50, 90, 160 (queries at their bottom-right aligned
    positions, as the causal rule places them); differs per sequence b by a shift."""
    cuts = torch.tensor([50, 90, 160])
    doc_k = torch.bucketize(torch.arange(sk), cuts, right=True)
    doc_q = torch.bucketize(torch.arange(sq) + sk - sq, cuts, right=True)

    def mask(b, h, q, kv):
        return doc_q[q] + b == doc_k[kv] + b * (kv % 2)
    return mask


def random_mask(heads, sq, sk):
    table = torch.rand((heads, sq, sk), generator=torch.Generator().manual_seed(5)) < 0.5

    def mask(b, h, q, kv):
        return table[h, q, kv]
    return mask


def dense_of(mask_mod, b, h, sq, sk):
    """The mask evaluated on the full grid: bool [b, h, sq, sk]."""
    bi = torch.arange(b).view(-1, 1, 1, 1)
    hi = torch.arange(h).view(1, -1, 1, 1)
    qi = torch.arange(sq).view(1, 1, -1, 1)
    ki = torch.arange(sk).view(1, 1, 1, -1)
    return torch.as_tensor(mask_mod(bi, hi, qi, ki)).broadcast_to((b, h, sq, sk)).contiguous()


MASKS = ["causal", "sliding", "prefix_lm", "document", "random", "empty_rows"]


def make_mask(name, h, sq, sk):
    return {"causal": causal, "sliding": sliding, "prefix_lm": prefix_lm,
            "empty_rows": empty_rows, "document": document(sq, sk),
            "random": random_mask(h, sq, sk)}[name]


# (dtype, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal option)
SHAPES = [
    (F32, 2, 113, 203, 4, 2, 40, False),
    (BF16, 1, 203, 113, 4, 1, 59, True),
    (F16, 2, 1, 1, 2, 2, 40, False),
    (F32, 1, 130, 130, 2, 2, 64, True),
]


def _id(c):
    dt, b, sq, sk, h, hk, d, causal_opt = c
    return f"{dtype_id(dt)}-b{b}-sq{sq}-sk{sk}-h{h}-hk{hk}-d{d}" + ("-causal" if causal_opt else "")


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("case", SHAPES, ids=[_id(c) for c in SHAPES])
def test_forward_and_gradients_match_the_reference(case, name):
    dt, b, sq, sk, h, hk, d, causal_opt = case
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=sq + 3 * sk + len(name), requires_grad=True)
    mask_mod = make_mask(name, h, sq, sk)
    bm = create_block_mask(mask_mod, b, h, sq, sk)
    dense = dense_of(mask_mod, b, h, sq, sk)
    assert torch.equal(bm.to_dense(), dense)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal_opt, return_attn_probs=True,
                                  block_mask=bm)
    ref = dict(causal=causal_opt, attn_mask=dense)
    check_forward((q, k, v), dt, ref, out=out, lse=lse)
    check_gradients(out, (q, k, v), dt, ref)


def test_rows_that_see_no_key_give_zero_out_minus_inf_lse_and_zero_gradients():
    b, sq, sk, h, d = 1, 113, 203, 2, 40
    q, k, v = make_qkv(b, sq, sk, h, h, d, F32, seed=3, requires_grad=True)
    bm = create_block_mask(empty_rows, None, None, sq, sk)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, block_mask=bm)
    rows = torch.arange(sq) % 7 == 3
    assert torch.equal(out[:, rows], torch.zeros_like(out[:, rows]))
    assert torch.isneginf(lse[:, :, rows]).all() and torch.isfinite(lse[:, :, ~rows]).all()
    (dq,) = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert torch.equal(dq[:, rows], torch.zeros_like(dq[:, rows]))
    assert torch.isfinite(dq).all()


def test_agrees_with_sdpa_and_an_explicit_boolean_mask():
    b, sq, sk, h, d = 2, 203, 113, 4, 59
    q, k, v = make_qkv(b, sq, sk, h, h, d, F32, seed=9)
    mask_mod = document(sq, sk)
    dense = dense_of(mask_mod, b, h, sq, sk)
    seen = dense.any(-1)  # SDPA gives NaN where a row sees nothing
    want = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v)), attn_mask=dense).transpose(1, 2)
    for bm in (create_block_mask(mask_mod, b, h, sq, sk), BlockMask.from_dense(dense)):
        got = flash_attn_func(q, k, v, block_mask=bm)
        err = (got.double() - want).abs()
        assert float(err.transpose(1, 2)[seen].max()) < 1e-5
        assert torch.equal(got.transpose(1, 2)[~seen], torch.zeros_like(got.transpose(1, 2)[~seen]))


def test_dense_chunked_and_shared_masks_give_the_same_bits():
    b, sq, sk, h, hk, d = 2, 203, 203, 4, 2, 40
    q, k, v = make_qkv(b, sq, sk, h, hk, d, BF16, seed=4)
    mod = random_mask(h, sq, sk)
    whole = create_block_mask(mod, b, h, sq, sk)
    # 64 x 203 pairs per chunk: one head and one block of rows at a time.
    tiny = create_block_mask(mod, b, h, sq, sk, chunk_elems=1)
    dense = BlockMask.from_dense(dense_of(mod, 1, h, sq, sk))
    assert torch.equal(whole.to_dense(), tiny.to_dense())
    outs = [flash_attn_func(q, k, v, window_size=(50, 10), block_mask=m)
            for m in (whole, tiny, dense)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # A mask that ignores b and h: B = H = None is the same mask for all.
    shared = create_block_mask(causal, None, None, sq, sk)
    assert shared.shape == (1, 1, sq, sk)
    full = create_block_mask(causal, b, h, sq, sk)
    assert torch.equal(flash_attn_func(q, k, v, block_mask=shared),
                       flash_attn_func(q, k, v, block_mask=full))
    # The causal rule as a mask (same alignment when sq == sk): the causal option's bits.
    assert torch.equal(flash_attn_func(q, k, v, block_mask=shared),
                       flash_attn_func(q, k, v, causal=True))
    empty, full_blocks, partial = shared.block_counts()
    assert (empty, full_blocks, partial) == (6, 6, 4) and shared.sparsity() == 6 / 16
    assert "BlockMask(shape=(1, 1, 203, 203)" in repr(shared)


def test_packed_forms_and_varlen():
    b, s, h, d = 2, 113, 4, 40
    q, k, v = make_qkv(b, s, s, h, h, d, F32, seed=6)
    bm = create_block_mask(prefix_lm, None, h, s, s)
    want = flash_attn_func(q, k, v, block_mask=bm)
    kv = torch.stack([k, v], dim=2)
    qkv = torch.stack([q, k, v], dim=2)
    assert torch.equal(flash_attn_kvpacked_func(q, kv, block_mask=bm), want)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, block_mask=bm), want)

    # Packed sequences read the mask at their own coordinates: a mask of the longest lengths.
    lens_q, lens_k = [70, 0, 113], [90, 5, 203]
    tq, tk = sum(lens_q), sum(lens_k)
    qp = leaf(torch.randn(tq, h, d))
    kp, vp = leaf(torch.randn(tk, 2, d)), leaf(torch.randn(tk, 2, d))
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    mod = random_mask(h, 120, 210)
    bm = create_block_mask(mod, 3, h, 120, 210)
    out = flash_attn_varlen_func(qp, kp, vp, cq, ck, 113, 203, causal=True, block_mask=bm)
    ref = dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, attn_mask=dense_of(mod, 3, h, 120, 210))
    check_forward((qp, kp, vp), F32, ref, out=out)
    check_gradients(out, (qp, kp, vp), F32, ref)
    short = create_block_mask(mod, 3, h, 112, 210)
    with pytest.raises(FlashAttnError, match="seqlen_q 112") as e:
        flash_attn_varlen_func(qp, kp, vp, cq, ck, 113, 203, block_mask=short)
    assert e.value.args[1] == "BlockMaskShape"


@pytest.mark.parametrize("gqa", [False, True])
def test_flex_attention_matches_sdpa(gqa):
    b, h, hk, sq, sk, d = 2, 4, 2 if gqa else 4, 113, 203, 40
    q = torch.randn(b, h, sq, d, requires_grad=True)
    k = torch.randn(b, hk, sk, d, requires_grad=True)
    v = torch.randn(b, hk, sk, d, requires_grad=True)
    mod = sliding
    bm = create_block_mask(mod, None, None, sq, sk)
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa, return_lse=True)
    assert out.shape == (b, h, sq, d) and lse.shape == (b, h, sq)
    dense = dense_of(mod, 1, 1, sq, sk)
    k64, v64 = (t.detach().double().repeat_interleave(h // hk, dim=1) for t in (k, v))
    want = F.scaled_dot_product_attention(q.detach().double(), k64, v64, attn_mask=dense)
    assert float((out.detach().double() - want).abs().max()) < 1e-5
    plain = flex_attention(q, k, v, enable_gqa=gqa, scale=0.3)
    want = F.scaled_dot_product_attention(q.detach().double(), k64, v64, scale=0.3)
    assert float((plain.detach().double() - want).abs().max()) < 1e-5
    out.sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape
    if gqa:
        with pytest.raises(ValueError, match="enable_gqa"):
            flex_attention(q, k, v, block_mask=bm)


def test_bad_input_is_refused():
    b, s, h, d = 2, 10, 3, 8
    q, k, v = make_qkv(b, s, s, h, h, d, F32, seed=1)
    for bm, dim in [(create_block_mask(causal, 3, h, s, s), "batch"),
                    (create_block_mask(causal, b, 2, s, s), "heads"),
                    (create_block_mask(causal, b, h, s + 1, s), "seqlen_q"),
                    (create_block_mask(causal, b, h, s, s - 1), "seqlen_k")]:
        with pytest.raises(FlashAttnError, match=dim) as e:
            flash_attn_func(q, k, v, block_mask=bm)
        assert e.value.args[1] == "BlockMaskShape"
    with pytest.raises(TypeError, match="bool"):
        create_block_mask(lambda b, h, q, kv: q - kv, b, h, s, s)
    with pytest.raises(ValueError, match="broadcast"):
        create_block_mask(lambda b, h, q, kv: torch.ones(5, dtype=torch.bool), b, h, s, s)
    with pytest.raises(ValueError, match="Q_LEN"):
        create_block_mask(causal, b, h, -1, s)
    with pytest.raises(ValueError, match="B must"):
        create_block_mask(causal, 0, h, s, s)
    with pytest.raises(ValueError, match="KV_LEN must"):
        create_block_mask(causal, b, h, s, 2.5)
    assert create_block_mask(causal, torch.tensor(b), None, s, s).shape == (b, 1, s, s)
    with pytest.raises(TypeError, match="callable"):
        create_block_mask(None, b, h, s, s)
    with pytest.raises(TypeError, match="torch.bool"):
        BlockMask.from_dense(torch.ones(s, s))
    with pytest.raises(ValueError, match="dense mask"):
        BlockMask.from_dense(torch.ones(s, dtype=torch.bool))
    with pytest.raises(TypeError, match="flashattn.BlockMask"):
        flash_attn_func(q, k, v, block_mask=torch.ones(s, s, dtype=torch.bool))
    bm = create_block_mask(causal, None, None, s, s)
    with pytest.raises(ValueError, match="FP8"):
        flash_attn_func(q, k, v, block_mask=bm, q_descale=torch.ones(1))
    # Tensors off the CPU (meta here; CUDA alike) are refused, naming the tensor and device.
    qm = q.to("meta")
    with pytest.raises(FlashAttnError, match="`q` is on meta") as e:
        flash_attn_func(qm, k.to("meta"), v.to("meta"), block_mask=bm)
    assert e.value.args[1] == "MaskModUnsupported"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_refused():
    q, k, v = (t.cuda() for t in make_qkv(1, 8, 8, 2, 2, 16, F16, seed=1))
    bm = create_block_mask(causal, None, None, 8, 8)
    with pytest.raises(FlashAttnError, match="CPU tensors only"):
        flash_attn_func(q, k, v, block_mask=bm)


def test_long_masks_stay_small():
    # 8192 x 8192 causal: 128 x 128 blocks, 128 of them partial (the diagonal).
    bm = create_block_mask(causal, None, None, 8192, 8192)
    empty, full, partial = bm.block_counts()
    assert (empty, full, partial) == (128 * 127 // 2, 128 * 127 // 2, 128)
    assert bm.nbytes() < 200_000


# ---- the ops (torch.library) and torch.compile ---------------------------------------------------


def _fwd_masked_args(q, k, v, bm, *, causal=False, s=None):
    return (q, k, v, None, None, 0.0, q.shape[-1] ** -0.5, causal, -1, -1, 0.0, None, s,
            bm._kinds, bm._bits, bm.shape[2], bm.shape[3])


@pytest.mark.parametrize("with_sink", [False, True])
def test_opcheck_masked_ops(with_sink):
    b, sq, sk, h, hk, d = 2, 113, 203, 4, 2, 40
    q, k, v = make_qkv(b, sq, sk, h, hk, d, F32, seed=11, requires_grad=True)
    s = sink(h, requires_grad=True) if with_sink else None
    bm = create_block_mask(document(sq, sk), b, None, sq, sk)
    assert bm.block_counts()[2] > 0, "the mask has partial blocks (bits in the op's arguments)"
    args = _fwd_masked_args(q, k, v, bm, causal=True, s=s)
    torch.library.opcheck(torch.ops.flashattn.fwd_masked.default, args)
    out, lse, rng = torch.ops.flashattn.fwd_masked(*args)
    # The op gives what the public call gives.
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True, learnable_sink=s,
                                            block_mask=bm))
    # The backward op has no gradient of its own: its inputs need none.
    q, k, v, out, lse = (t.detach() for t in (q, k, v, out, lse))
    s = None if s is None else s.detach()
    bargs = (torch.randn_like(out), q, k, v, out, lse, None, None, 0.0, d ** -0.5, True, -1, -1,
             0.0, None, s, rng, bm._kinds, bm._bits, sq, sk)
    torch.library.opcheck(torch.ops.flashattn.bwd_masked.default, bargs)


def test_masked_op_refuses_inconsistent_mask_tensors():
    q, k, v = make_qkv(1, 70, 70, 2, 2, 16, F32, seed=2)
    bm = create_block_mask(causal, None, None, 70, 70)
    args = list(_fwd_masked_args(q, k, v, bm))
    kinds = bm._kinds.clone()
    kinds[0, 0, 0, 0] = -3
    with pytest.raises(FlashAttnError, match="block kind -3"):
        torch.ops.flashattn.fwd_masked(*args[:13], kinds, *args[14:])
    with pytest.raises(FlashAttnError, match="blocks, got"):
        torch.ops.flashattn.fwd_masked(*args[:13], bm._kinds[..., :1], *args[14:])
    with pytest.raises(TypeError, match="mask_bits"):
        torch.ops.flashattn.fwd_masked(*args[:14], bm._bits.int(), *args[15:])
    bits = bm._bits.clone()
    bits[-1, 0] = -1  # every key of row 64 (keys 70.. are past the edge)
    with pytest.raises(FlashAttnError, match="bits past"):
        torch.ops.flashattn.fwd_masked(*args[:14], bits, *args[15:])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_masked_forward_backward_matches_eager(backend):
    torch._dynamo.reset()
    b, h, hk, sq, sk, d = 2, 4, 2, 113, 203, 40
    bm = create_block_mask(document(sq, sk), b, None, sq, sk)
    qt, kt, vt = (torch.randn(b, n, s, d, generator=torch.Generator().manual_seed(i))
                  .requires_grad_() for i, (n, s) in enumerate([(h, sq), (hk, sk), (hk, sk)]))
    snk = sink(h, requires_grad=True)

    def f(qt, kt, vt, snk, bm):
        flex = flex_attention(qt, kt, vt, block_mask=bm, enable_gqa=True)
        q, k, v = (t.transpose(1, 2) for t in (qt, kt, vt))
        fa = flash_attn_func(q, k, v, causal=True, window_size=(60, -1), learnable_sink=snk,
                             block_mask=bm)
        return (flex * flex).sum() + (fa * fa).sum(), flex, fa

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    loss_c, *outs_c = compiled(qt, kt, vt, snk, bm)
    grads_c = torch.autograd.grad(loss_c, (qt, kt, vt, snk))
    loss_e, *outs_e = f(qt, kt, vt, snk, bm)
    grads_e = torch.autograd.grad(loss_e, (qt, kt, vt, snk))
    for a, e in zip(outs_c, outs_e):
        assert torch.equal(a, e)
    for a, e in zip(grads_c, grads_e):
        assert torch.isfinite(a).all() and a.abs().sum() > 0
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_compiled_call_takes_a_new_mask_of_its_shape_without_recompiling():
    # Masks of one shape with 2, 0, 1 and 4 partial blocks: one graph for all of them, forward
    # and backward (the partial blocks' count is a dynamic size, and never 0 or 1).
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    n = 128
    masks = [create_block_mask(f, None, None, n, n) for f in (
        causal,
        lambda b, h, q, kv: q // 64 >= kv // 64,
        lambda b, h, q, kv: (q >= kv) | (q >= 64),
        lambda b, h, q, kv: (q - kv) % 5 != 0,
    )]
    assert [m.block_counts()[2] for m in masks] == [2, 0, 1, 4]
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v, bm: flash_attn_func(q, k, v, block_mask=bm),
                             backend=cnt, fullgraph=True)
    q, k, v = make_qkv(1, n, n, 2, 2, 16, F32, seed=3, requires_grad=True)
    for bm in masks:
        out = compiled(q, k, v, bm)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        out_e = flash_attn_func(q, k, v, block_mask=bm)
        grads_e = torch.autograd.grad((out_e * out_e).sum(), (q, k, v))
        assert torch.equal(out, out_e)
        for a, e in zip(grads, grads_e):
            assert torch.equal(a, e)
    assert cnt.frame_count == 1


def test_mask_tensors_are_read_in_place_or_copied_when_unaligned():
    # The mask is its two tensors (nothing else held); the op reads them in place, and copies
    # a view that is not aligned to its element, with the same result.
    q, k, v = make_qkv(1, 150, 150, 2, 2, 16, F32, seed=4)
    bm = create_block_mask(lambda b, h, q, kv: (q - kv) % 3 != 0, None, None, 150, 150)
    assert bm.nbytes() == bm._kinds.nbytes + bm._bits.nbytes
    args = list(_fwd_masked_args(q, k, v, bm))
    want = torch.ops.flashattn.fwd_masked(*args)[0]
    assert torch.equal(want, flash_attn_func(q, k, v, block_mask=bm))
    raw = bytearray(bm._bits.nbytes + 4)
    bits = torch.frombuffer(raw, dtype=torch.int64, offset=4, count=bm._bits.numel())
    bits = bits.view(bm._bits.shape)
    bits.copy_(bm._bits)
    assert bits.data_ptr() % 8 == 4
    assert torch.equal(torch.ops.flashattn.fwd_masked(*args[:14], bits, *args[15:])[0], want)

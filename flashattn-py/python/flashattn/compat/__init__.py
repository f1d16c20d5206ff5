"""Makes ``import flash_attn`` resolve to flashattn, for code written against flash-attn.

    import flashattn.compat
    flashattn.compat.install()
    from flash_attn import flash_attn_func          # flashattn's
    from flash_attn.bert_padding import unpad_input, pad_input
    from flash_attn.layers.rotary import apply_rotary_emb

The modules are flashattn's own (``flash_attn.__version__`` says so); no package metadata is
registered, so tools that ask for the ``flash-attn`` distribution still see it missing.
"""

from __future__ import annotations

import importlib
import sys

_MODULES = (
    "flash_attn",
    "flash_attn.flash_attn_interface",
    "flash_attn.bert_padding",
    "flash_attn.layers",
    "flash_attn.layers.rotary",
)


def install(replace: bool = False) -> None:
    """Registers the ``flash_attn`` modules in ``sys.modules``. If a real ``flash_attn`` was
    imported already, raises ``RuntimeError`` unless ``replace`` is true."""
    current = sys.modules.get("flash_attn")
    if current is not None and not getattr(current, "__flashattn_compat__", False) and not replace:
        raise RuntimeError(
            "flashattn.compat.install(): a flash_attn module is already imported "
            f"({getattr(current, '__file__', '?')}); pass replace=True to shadow it"
        )
    for name in _MODULES:
        sys.modules[name] = importlib.import_module(f"flashattn.compat.{name}")


def uninstall() -> None:
    """Removes the aliases that :func:`install` registered."""
    for name in _MODULES:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__flashattn_compat__", False):
            del sys.modules[name]

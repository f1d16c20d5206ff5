"""The README's promise: a model written against flash-attn trains on the CPU with flashattn."""

import importlib.util
import math
import sys
from pathlib import Path

import flashattn.compat

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_step.py"


def test_train_step_example_runs_through_flashattn_and_learns():
    spec = importlib.util.spec_from_file_location("train_step_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        assert getattr(sys.modules["flash_attn"], "__flashattn_compat__", False)
        assert mod.flash_attn_func.__module__ == "flashattn.interface"
        losses = mod.main()
    finally:
        flashattn.compat.uninstall()
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert "flash_attn" not in sys.modules

"""Shared fixtures. Heavy imports stay inside the fixtures so test files that need no torch stay fast."""

from __future__ import annotations

import pytest

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_positions=128)


@pytest.fixture(scope="session")
def tiny_policy():
    """(model, tokenizer): a randomly initialised 2-layer, 32-wide char-level Qwen2 (seed 0).

    Shared by many tests: do not train it in place (deep-copy it first)."""
    import torch

    from engines.modeling import build_tiny_policy

    torch.set_num_threads(1)
    model, tok = build_tiny_policy(**TINY, seed=0)
    return model.eval(), tok


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_policy, tmp_path_factory) -> str:
    """`tiny_policy` saved as a Hugging Face model directory (safetensors + tokenizer + config)."""
    from engines.modeling import save_policy

    model, tok = tiny_policy
    return save_policy(model, tok, str(tmp_path_factory.mktemp("tiny_policy")))

"""Two published policy versions of one run for the live-sync tests: v0000 = a model folder as is,
v0001 = the same with every weight moved (what a training step gives)."""

from __future__ import annotations

import os

import torch


def publish_two_versions(store, model_dir: str, work: str, run: str) -> str:
    """Publish runs/<run>/policy/v0000 and v0001 into `store`; returns v0001's local folder."""
    from engines.models.modeling import load_policy, save_policy

    store.publish(model_dir, f"runs/{run}/policy/v0000", kind="checkpoint", producer="test")
    model, tok = load_policy(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-2)
    v1 = save_policy(model, tok, os.path.join(str(work), "v1"))
    store.publish(v1, f"runs/{run}/policy/v0001", kind="checkpoint", producer="test")
    return v1

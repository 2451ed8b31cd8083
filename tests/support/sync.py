"""What the weight-sync tests share (tests/engines/weight_sync/test_update_group.py, tests/tasks/actors/test_hybrid.py): the tiny
model's shape, how long a test waits for a spawned rank or engine, a free port, and digests of
weights (bitwise comparison across processes)."""

from __future__ import annotations

import hashlib
import socket

import torch

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_positions=128)
WAIT = 120           # s: the longest a test waits for an engine process (they import torch first)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digests(model_or_state, dtype=torch.float32) -> dict[str, str]:
    """name -> sha256 of each tensor's bytes in `dtype`: of a module's state dict, or of a state dict."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    return {k: hashlib.sha256(t.detach().to(dtype).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, t in state.items()}


def moved_tiny_digests() -> dict[str, str]:
    """Digests of the tiny policy (seed 0) with every weight times -0.5: what the sharded-trainer tests'
    ranks make of their shards, unsharded."""
    from engines.models.modeling import build_tiny_policy

    model, _ = build_tiny_policy(**TINY, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)
    return digests(model)


def release(procs: list, leave) -> None:
    """Let spawned ranks waiting on `leave` end; kill any still alive after WAIT."""
    leave.set()
    for p in procs:
        p.join(timeout=WAIT)
        if p.is_alive():
            p.kill()

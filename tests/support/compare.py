"""Bitwise comparison of checkpoints and trainer states (tests/tasks/run/test_replay.py,
tests/tasks/loop/test_publish_plan.py)."""

from __future__ import annotations

import torch


def assert_bitwise_equal(a, b, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and scalars; `where` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)

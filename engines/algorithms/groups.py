"""Per-group statistics for group-relative estimators (GRPO, RLOO, ...).

Notation: B samples (= prompts × G), G samples per prompt. ``index`` [B] is any integer id shared
by the samples of one prompt; ids need not be contiguous or sorted, and groups may differ in size.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_stats(scores: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, unbiased std and size of each sample's group, broadcast back to the samples.

    scores [B], index [B] (long) → (mean [B], std [B], size [B]), float32. A group of size 1 has
    std 0.
    """
    x = scores.float()                                                 # [B]
    _, inv = torch.unique(index, return_inverse=True)                  # [B] in 0..n_groups-1
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    size = torch.bincount(inv, minlength=n_groups).float()             # [n_groups]
    mean = torch.zeros(n_groups, device=x.device).index_add_(0, inv, x) / size
    sq_dev = torch.zeros(n_groups, device=x.device).index_add_(0, inv, (x - mean[inv]) ** 2)
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1.0))               # [n_groups]
    return mean[inv], std[inv], size[inv]

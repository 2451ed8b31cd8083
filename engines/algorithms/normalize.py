"""Normalisation: reward normalisation (batch / group / running) and clipping, advantage
whitening and clipping.

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.

Running statistics are state that lives across iterations; it is kept outside these functions:
``normalize_rewards`` takes the previous ``RunningStats`` and returns the updated one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from engines.algorithms.aggregate import masked_mean
from engines.algorithms.groups import group_stats

REWARD_NORMS = ("none", "batch", "group", "running")


class RunningStats(NamedTuple):
    """Streaming mean/variance (Chan et al. parallel update). ``m2`` is the sum of squared
    deviations; variance = m2 / (count − 1). Plain floats, so it serialises with a checkpoint."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    @property
    def std(self) -> float:
        return (self.m2 / max(self.count - 1.0, 1.0)) ** 0.5


def update_running_stats(stats: RunningStats, x: Tensor) -> RunningStats:
    """Merge the values of ``x`` (any shape) into ``stats``."""
    x = x.detach().double().flatten()
    n = float(x.numel())
    if n == 0:
        return stats
    batch_mean = float(x.mean())
    batch_m2 = float(((x - batch_mean) ** 2).sum())
    total = stats.count + n
    delta = batch_mean - stats.mean
    mean = stats.mean + delta * n / total
    m2 = stats.m2 + batch_m2 + delta * delta * stats.count * n / total
    return RunningStats(total, mean, m2)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, epsilon: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + ε) over the unmasked entries, var unbiased (verl ``masked_whiten``).
    values [B,T], mask [B,T] → [B,T]. With ``shift_mean=False`` the mean is added back."""
    mask = mask.float()
    mean = masked_mean(values, mask)
    n = mask.sum()
    var = masked_mean((values - mean) ** 2, mask) * n / (n - 1).clamp(min=1.0)
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    return whitened if shift_mean else whitened + mean


@torch.no_grad()
def normalize_rewards(
    scores: Tensor,
    index: Tensor,
    mode: str,
    *,
    running: RunningStats | None = None,
    epsilon: float = 1e-6,
) -> tuple[tuple[Tensor, RunningStats | None], dict[str, float]]:
    """Normalise sequence scores [B] → ((scores [B], running stats), metrics).

      none:    s
      batch:   (s − mean_B(s)) / (std_B(s) + ε)
      group:   (s − mean_g(s)) / (std_g(s) + ε)   per prompt (0 for a group of size 1)
      running: (s − μ) / (σ + ε) with μ, σ over every score seen so far, this batch included;
               the updated ``RunningStats`` is returned (pass ``running=None`` the first time).
    The running stats are returned unchanged (None included) by the other modes.
    """
    x = scores.float()                                                 # [B]
    if mode == "none":
        out = x
    elif mode == "batch":
        out = (x - x.mean()) / (x.std(unbiased=True).nan_to_num(0.0) + epsilon)
    elif mode == "group":
        mean, std, _ = group_stats(x, index)                           # [B]
        out = (x - mean) / (std + epsilon)
    elif mode == "running":
        running = update_running_stats(running or RunningStats(), x)
        out = (x - running.mean) / (running.std + epsilon)
    else:
        raise ValueError(f"reward normalisation {mode!r} is not one of {list(REWARD_NORMS)}")
    metrics = {"reward/normalized_mean": float(out.mean()) if out.numel() else 0.0}
    if running is not None:
        metrics.update({"reward/running_mean": running.mean, "reward/running_std": running.std})
    return (out, running), metrics


def clip_rewards(scores: Tensor, clip: float) -> tuple[Tensor, dict[str, float]]:
    """Clamp scores to [−clip, clip]. scores [B] (or [B,T]) → same shape."""
    clipped = scores.clamp(-clip, clip)
    frac = float((clipped != scores).float().mean()) if scores.numel() else 0.0
    return clipped, {"reward/clip_frac": frac}


def clip_advantages(advantages: Tensor, response_mask: Tensor, clip: float) -> tuple[Tensor, dict[str, float]]:
    """Clamp advantages [B,T] to [−clip, clip] on unmasked tokens (masked tokens → 0)."""
    mask = response_mask.float()
    clipped = advantages.clamp(-clip, clip) * mask
    frac = float(masked_mean((clipped != advantages * mask).float(), mask))
    return clipped, {"advantage/clip_frac": frac}

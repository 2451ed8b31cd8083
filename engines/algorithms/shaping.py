"""Masks, reward shaping and the dynamic-sampling group filter.

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.
``index`` [B] is the group (prompt) id of each sample.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from engines.algorithms.groups import group_stats


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence score on its last unmasked response token (outcome reward).
    scores [B], response_mask [B,T] → token_level_rewards [B,T]; a row with no unmasked token
    gets no reward."""
    mask = response_mask.float()
    T = mask.shape[-1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)                # [B,T]
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(-1).values  # [B]
    rewards = torch.zeros_like(mask)                                              # [B,T]
    has_tokens = last >= 0
    rows = torch.nonzero(has_tokens).squeeze(-1)
    rewards[rows, last[rows]] = scores.float()[rows]
    return rewards


def truncated_from_finish_reason(finish_reasons: Sequence[str]) -> Tensor:
    """finish_reason per sample (vLLM/HF: "stop", "length", ...) → truncated [B] bool."""
    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)


def mask_truncated(response_mask: Tensor, truncated: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Drop truncated responses from the loss (DAPO, arXiv 2503.14476, "overlong filtering"):
    rows with truncated=True get mask 0. response_mask [B,T], truncated [B] bool → mask [B,T]."""
    keep = (~truncated.bool()).to(response_mask.dtype).unsqueeze(-1)               # [B,1]
    frac = float(truncated.float().mean()) if truncated.numel() else 0.0
    return response_mask * keep, {"mask/truncated_frac": frac}


def difficulty_mask(scores: Tensor, index: Tensor, *, low: float, high: float) -> tuple[Tensor, dict[str, float]]:
    """Keep only prompts of useful difficulty (ROLL "difficulty mask"; cf. DAPO dynamic sampling):
    a group is kept when its pass rate mean_g(s) lies in [low, high].
    scores [B] (0/1 correctness, or any score in [0,1]), index [B] → keep [B] bool."""
    mean, _, _ = group_stats(scores, index)                                        # [B]
    keep = (mean >= low) & (mean <= high)
    frac = float(keep.float().mean()) if keep.numel() else 0.0
    return keep, {"mask/difficulty_kept_frac": frac}


def overlong_penalty(
    response_lengths: Tensor, *, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> tuple[Tensor, dict[str, float]]:
    """Soft overlong punishment, DAPO (arXiv 2503.14476, eq. 13), times ``penalty_factor``:

      0                                   if L ≤ L_max − L_buf
      ((L_max − L_buf) − L) / L_buf       if L_max − L_buf < L ≤ L_max
      −1                                  if L > L_max
    response_lengths [B] → penalty [B] (≤ 0), to add to the scores.
    """
    length = response_lengths.float()
    soft_start = float(max_len - buffer_len)
    penalty = ((soft_start - length) / float(buffer_len)).clamp(-1.0, 0.0) * penalty_factor
    frac = float((penalty < 0).float().mean()) if penalty.numel() else 0.0
    return penalty, {"reward/overlong_penalized_frac": frac, "reward/overlong_penalty_mean": float(penalty.mean()) if penalty.numel() else 0.0}


def filter_groups(rewards: Tensor, index: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Dynamic sampling (DAPO, arXiv 2503.14476): drop groups whose rewards are all equal — they
    give zero group-relative advantage and only dilute the batch. Groups of size 1 are dropped.
    rewards [B], index [B] → keep_mask [B] bool."""
    x = rewards.float()                                                            # [B]
    _, inv = torch.unique(index, return_inverse=True)                              # [B]
    n = int(inv.max()) + 1 if inv.numel() else 0
    g_max = torch.full((n,), -torch.inf, device=x.device).scatter_reduce(0, inv, x, "amax")         # [n_groups]
    g_min = torch.full((n,), torch.inf, device=x.device).scatter_reduce(0, inv, x, "amin")          # [n_groups]
    keep = (g_max > g_min)[inv]                                                    # [B]
    n_groups = int(torch.unique(index).numel())
    n_kept = int(torch.unique(index[keep]).numel())
    return keep, {
        "dynamic_sampling/groups": float(n_groups),
        "dynamic_sampling/kept_groups": float(n_kept),
        "dynamic_sampling/kept_frac": n_kept / n_groups if n_groups else 0.0,
    }

"""GiGPO: group-in-group advantages for multi-turn agents (Feng et al. 2025, "Group-in-Group Policy
Optimization for LLM Agent Training", arXiv 2505.10978).

Notation: B episodes (= seeds × G), G episodes per seed (one group), T response tokens (policy and
environment tokens interleaved), K turns (padded).

Two levels of relative credit, no critic:
  episode level  A^E_i = (R_i − mean_g R) / (std_g R + ε),   R_i = Σ_t r_{i,t} the episode return;
  step level     A^S_{i,k} = (R_{i,k} − mean_s R) / (std_s R + ε) over the *step group* s: every
                 (episode j, turn l) of the same episode group whose environment state before the
                 action equals that of (i, k) (an "anchor state"; repeated visits within one episode
                 count too), with R_{i,k} = Σ_{l≥k} γ^{l−k} r_{i,l} the discounted return from turn k;
  combined       A_{i,t} = A^E_i + ω · A^S_{i,k(t)} on every policy token t of turn k(t), 0 on
                 environment tokens.
Groups of size 1 (and flat groups) give 0 at either level. ``norm_by_std=False`` drops both
divisions (the paper's F_norm = 1 variant). The paper uses γ = 0.95, ω = 1.

Trajectory-level credit (StarPO, Wang et al. 2025, "RAGEN", arXiv 2504.20073) is plain ``grpo`` on
the episode return placed on the last policy token, with the loss mask as ``response_mask``; it
is not registered twice.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from engines.algorithms.groups import group_stats
from engines.algorithms.registry import register_advantage

Result = tuple[tuple[Tensor, Tensor], dict[str, float]]


def step_returns(step_rewards: Tensor, step_valid: Tensor, gamma: float) -> Tensor:
    """R_{i,k} = r_{i,k} + γ R_{i,k+1} over the valid turns; [B,K] → [B,K] (0 on padding)."""
    valid = step_valid.float()
    out = torch.zeros_like(step_rewards, dtype=torch.float32)          # [B,K]
    running = torch.zeros(step_rewards.shape[0], device=step_rewards.device)  # [B]
    for k in reversed(range(step_rewards.shape[1])):
        running = (step_rewards[:, k].float() + gamma * running) * valid[:, k]
        out[:, k] = running
    return out


@register_advantage("gigpo", group_baseline=True)
@torch.no_grad()
def gigpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    turn_index: Tensor | None = None,
    step_rewards: Tensor | None = None,
    step_state_ids: Tensor | None = None,
    step_weight: float = 1.0,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Result:
    """GiGPO (arXiv 2505.10978). Extra inputs (see ``gigpo_step_tensors`` to build them):
      turn_index [B,T] long      turn k of each response token, −1 on environment tokens/padding
      step_rewards [B,K] float   reward of each turn (0 on padding)
      step_state_ids [B,K] long  anchor-state id before each turn (equal id = equal state), −1 pad
    ``gamma`` discounts across turns (not tokens); ``step_weight`` is ω.
    Returns (advantages [B,T], returns = advantages), metrics.
    """
    if turn_index is None or step_rewards is None or step_state_ids is None:
        raise ValueError("advantage estimator 'gigpo' needs turn_index [B,T], step_rewards [B,K] and "
                         "step_state_ids [B,K] (build them with gigpo_step_tensors)")
    mask = response_mask.float()
    B, K = step_state_ids.shape
    # episode level
    scores = token_level_rewards.float().sum(-1)                       # [B]
    mean, std, size = group_stats(scores, index)                       # [B]
    adv_episode = scores - mean                                        # [B]
    if norm_by_std:
        adv_episode = adv_episode / (std + epsilon)
    # step level
    valid = step_state_ids >= 0                                        # [B,K]
    returns_k = step_returns(step_rewards, valid, gamma)               # [B,K]
    rows = torch.arange(B, device=index.device).unsqueeze(1).expand(B, K)  # [B,K]
    pairs = torch.stack([index.long()[rows][valid], step_state_ids.long()[valid]], dim=-1)  # [N,2]
    adv_step = torch.zeros(B, K, dtype=torch.float32, device=scores.device)  # [B,K]
    step_size = torch.zeros(0)
    if pairs.shape[0]:
        _, step_group = torch.unique(pairs, dim=0, return_inverse=True)    # [N]
        r = returns_k[valid]                                               # [N]
        s_mean, s_std, step_size = group_stats(r, step_group)              # [N]
        a = r - s_mean
        if norm_by_std:
            a = a / (s_std + epsilon)
        adv_step[valid] = a
    # broadcast to tokens
    k_of_t = turn_index.long()                                         # [B,T]
    policy = (k_of_t >= 0) & (k_of_t < K)                              # [B,T]
    step_of_t = adv_step.gather(1, k_of_t.clamp(min=0, max=max(K - 1, 0))) if K else torch.zeros_like(mask)  # [B,T]
    advantages = (adv_episode.unsqueeze(-1) + step_weight * step_of_t) * policy.float() * mask  # [B,T]
    metrics = {
        "advantage/frac_zero_std_samples": float(((size < 2) | (std == 0)).float().mean()),
        "advantage/gigpo_step_grouped_frac": float((step_size > 1).float().mean()) if step_size.numel() else 0.0,
        "advantage/gigpo_step_group_size": float(step_size.mean()) if step_size.numel() else 0.0,
    }
    return (advantages, advantages), metrics


def gigpo_step_tensors(turn_index: Sequence[Sequence[int]], turn_rewards: Sequence[Sequence[float]],
                       state_keys: Sequence[Sequence[Hashable]], width: int | None = None) -> dict[str, Tensor]:
    """Rollout-table columns (one list per episode) → gigpo's keyword tensors.

    turn_index: per response token (−1 on env tokens); turn_rewards, state_keys: per turn. ``width``
    is T of the collated batch (default the longest row). Equal keys get equal ids batch-wide;
    gigpo itself separates episode groups. Returns {turn_index [B,T], step_rewards [B,K],
    step_state_ids [B,K]}.
    """
    B = len(turn_index)
    T = width if width is not None else max((len(t) for t in turn_index), default=0)
    K = max((len(k) for k in state_keys), default=0)
    ti = torch.full((B, max(T, 1)), -1, dtype=torch.long)              # [B,T]
    rewards = torch.zeros((B, max(K, 1)), dtype=torch.float32)         # [B,K]
    ids = torch.full((B, max(K, 1)), -1, dtype=torch.long)             # [B,K]
    table: dict[Hashable, int] = {}
    for b in range(B):
        if len(turn_index[b]) > T:
            raise ValueError(f"turn_index row {b} has {len(turn_index[b])} tokens, more than width={T}")
        if len(turn_rewards[b]) != len(state_keys[b]):
            raise ValueError(f"row {b}: {len(turn_rewards[b])} turn rewards but {len(state_keys[b])} state keys")
        ti[b, : len(turn_index[b])] = torch.tensor(turn_index[b], dtype=torch.long)
        rewards[b, : len(turn_rewards[b])] = torch.tensor(turn_rewards[b], dtype=torch.float32)
        ids[b, : len(state_keys[b])] = torch.tensor([table.setdefault(k, len(table)) for k in state_keys[b]], dtype=torch.long)
    return {"turn_index": ti, "step_rewards": rewards, "step_state_ids": ids}

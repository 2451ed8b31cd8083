"""Advantage estimators: token-level rewards → (advantages, returns).

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.

Every estimator has the signature
    fn(token_level_rewards [B,T], response_mask [B,T], index [B], *, values [B,T] | None = None,
       gamma = 1.0, lam = 1.0, <own keyword options>) -> ((advantages [B,T], returns [B,T]), metrics)
and runs without gradient. Outcome estimators use the sequence score
``token_level_rewards.sum(-1)`` and broadcast one advantage over the response tokens. In every
group-relative estimator a group of size 1 has no baseline and gets advantage 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.algorithms.groups import group_stats
from engines.algorithms.normalize import masked_whiten
from engines.algorithms.registry import register_advantage

Result = tuple[tuple[Tensor, Tensor], dict[str, float]]


def _discounted_returns(token_level_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go over the policy's own tokens: G_t = r_t + γ G_{t'}, t' the next unmasked token
    after t. Masked tokens (environment tokens between turns, padding) are not steps: the running
    return passes them unchanged (no discount, their reward not counted, as ``gae`` skips them),
    so a reward in a later turn reaches every earlier turn. verl's REINFORCE++ instead resets the
    sum at every masked token, which cuts multi-turn credit at the first environment token.
    [B,T] → [B,T], 0 on masked tokens."""
    valid = response_mask > 0                                          # [B,T]
    rewards = token_level_rewards.float()                              # [B,T]
    returns = torch.zeros_like(rewards)                                # [B,T]
    running = torch.zeros(rewards.shape[0], device=rewards.device)     # [B]
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns


@register_advantage("grpo", group_baseline=True)
@torch.no_grad()
def grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Result:
    """GRPO, Shao et al. 2024 (DeepSeekMath, arXiv 2402.03300); Dr.GRPO with ``norm_by_std=False``
    (Liu et al. 2025, arXiv 2503.20783).

    A_i = (s_i − mean_g(s)) / (std_g(s) + ε)   (or s_i − mean_g(s) without std), s_i = Σ_t r_{i,t},
    std unbiased; the same A_i on every response token. returns = advantages.
    """
    mask = response_mask.float()
    scores = token_level_rewards.float().sum(-1)                       # [B]
    mean, std, size = group_stats(scores, index)                       # [B] each
    centred = scores - mean                                            # [B]; 0 in groups of size 1
    adv = centred / (std + epsilon) if norm_by_std else centred        # [B]
    advantages = adv.unsqueeze(-1) * mask                              # [B,T]
    solo_or_flat = (size < 2) | (std == 0)
    metrics = {"advantage/frac_zero_std_samples": float(solo_or_flat.float().mean())}
    return (advantages, advantages), metrics


@register_advantage("rloo", group_baseline=True)
@torch.no_grad()
def rloo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Result:
    """RLOO, REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019).

    A_i = s_i − (Σ_{j≠i} s_j)/(G−1) = G/(G−1) · (s_i − mean_g(s)), broadcast over tokens.
    """
    mask = response_mask.float()
    scores = token_level_rewards.float().sum(-1)                       # [B]
    mean, _, size = group_stats(scores, index)                         # [B]
    adv = (scores - mean) * size / (size - 1).clamp(min=1.0)           # [B]; 0 when size == 1
    advantages = adv.unsqueeze(-1) * mask                              # [B,T]
    return (advantages, advantages), {}


@register_advantage("reinforce")
@torch.no_grad()
def reinforce(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    baseline: str = "batch",
    ema_baseline: float | None = None,
    ema_decay: float = 0.9,
) -> Result:
    """REINFORCE with a scalar baseline (Williams 1992; ReMax-style batch baseline).

    A_{i,t} = G_{i,t} − b, with G_{i,t} = Σ_{unmasked k≥t} γ^{n(t,k)} r_{i,k} the return-to-go over
    the policy's tokens (n(t,k): unmasked tokens in [t, k); masked tokens carry the sum, see
    ``_discounted_returns``).
      baseline="batch": b = mean_i(s_i) over the batch.
      baseline="ema":   b = ``ema_baseline`` (the value carried from earlier batches; the batch
                        mean on the first call), and the new value
                        ``decay·b + (1−decay)·mean_i(s_i)`` is returned in
                        ``metrics["advantage/ema_baseline"]`` for the caller to keep.
    returns = G.
    """
    if baseline not in ("batch", "ema"):
        raise ValueError(f"reinforce baseline {baseline!r} is not one of ['batch', 'ema']")
    mask = response_mask.float()
    returns = _discounted_returns(token_level_rewards, mask, gamma)    # [B,T]
    batch_mean = float(token_level_rewards.float().sum(-1).mean())
    metrics: dict[str, float] = {}
    if baseline == "ema" and ema_baseline is not None:
        b = float(ema_baseline)
        metrics["advantage/ema_baseline"] = ema_decay * b + (1.0 - ema_decay) * batch_mean
    else:
        b = batch_mean
        if baseline == "ema":
            metrics["advantage/ema_baseline"] = batch_mean
    metrics["advantage/baseline"] = b
    advantages = (returns - b) * mask                                  # [B,T]
    return (advantages, returns * mask), metrics


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Result:
    """REINFORCE++, Hu 2025 (arXiv 2501.03262): discounted return-to-go whitened over the batch.

    A = whiten_batch(G) with G the return-to-go of ``reinforce`` (carried across masked tokens);
    returns = G. Departs from verl, which restarts G after every masked token.
    """
    mask = response_mask.float()
    returns = _discounted_returns(token_level_rewards, mask, gamma)    # [B,T]
    advantages = masked_whiten(returns, mask) * mask                   # [B,T]
    return (advantages, returns * mask), {}


@register_advantage("reinforce_plus_plus_baseline", group_baseline=True)
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Result:
    """REINFORCE++-baseline, Hu 2025 (arXiv 2501.03262 v3+): subtract the group mean, then whiten
    over the batch. A = whiten_batch(s_i − mean_g(s)) broadcast over tokens; returns = A.
    """
    mask = response_mask.float()
    scores = token_level_rewards.float().sum(-1)                       # [B]
    mean, _, _ = group_stats(scores, index)                            # [B]
    centred = (scores - mean).unsqueeze(-1) * mask                     # [B,T]
    advantages = masked_whiten(centred, mask) * mask                   # [B,T]
    return (advantages, advantages), {}


@register_advantage("on_policy_distill")
@torch.no_grad()
def on_policy_distill(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    reward_weight: float = 0.0,
) -> Result:
    """On-policy distillation (GKD, Agarwal et al. 2024, arXiv 2306.13649; the recipe of Thinking
    Machines' "On-Policy Distillation", 2025, that verl and ROLL ship): the reference is the
    teacher, and every sampled token is scored by the negative single-sample reverse KL
        r_t = −(log π_old(x_t) − log π_teacher(x_t))                     (k1 on the sampled token)
    with π_old the policy that sampled (``old_logprobs`` [B,T]) and π_teacher the reference's
    log-probs (``ref_logprobs`` [B,T]). A = return-to-go of r with ``gamma`` (carried across masked
    tokens like ``reinforce``): γ = 0 gives each token its own term (the recipe), γ = 1 the sum of
    the reverse KL still ahead. No baseline: E[A] is minus the expected reverse KL, which the
    update lowers. ``reward_weight`` w > 0 adds w·(s_i − mean_batch(s)) on every token of
    sequence i (s_i = the shaped task reward, ``token_level_rewards.sum(-1)``), for a mix of
    distillation and the task's reward. returns = A. Metric distill/reverse_kl: mean per-token r's
    negation over the unmasked tokens.
    """
    if old_logprobs is None or ref_logprobs is None:
        raise ValueError("advantage 'on_policy_distill' needs the sampling policy's and the teacher's per-token "
                         "log-probs (old_logprobs and ref_logprobs [B,T]) from the reference stage")
    mask = response_mask.float()
    token_kl = (old_logprobs.float() - ref_logprobs.float()) * mask     # [B,T]
    advantages = _discounted_returns(-token_kl, mask, gamma)           # [B,T]
    if reward_weight:
        scores = token_level_rewards.float().sum(-1)                   # [B]
        advantages = advantages + reward_weight * (scores - scores.mean()).unsqueeze(-1) * mask
    n = mask.sum().clamp(min=1.0)
    return (advantages, advantages), {"distill/reverse_kl": float(token_kl.sum() / n)}


@register_advantage("gae")
@torch.no_grad()
def gae(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> Result:
    """GAE, Schulman et al. 2016 (arXiv 1506.02438), as used by PPO for LLMs (Ouyang et al. 2022).

    δ_t = r_t + γ V_{t+1} − V_t,  A_t = δ_t + γλ A_{t+1},  returns = A + V, then A is whitened
    over the batch (``whiten=True``, as verl does). V after the last token is 0. Masked tokens
    are skipped: value and advantage are carried across them (multi-turn loss masks).
    values [B,T] is required.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values [B,T]; got values=None")
    mask = response_mask.float()
    rewards, values = token_level_rewards.float(), values.float()
    B, T = rewards.shape
    next_value = torch.zeros(B, device=rewards.device)                 # [B]
    next_adv = torch.zeros(B, device=rewards.device)                   # [B]
    advantages = torch.zeros_like(rewards)                             # [B,T]
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]      # [B]
        adv_t = delta + gamma * lam * next_adv                         # [B]
        advantages[:, t] = adv_t
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        next_adv = torch.where(mask[:, t] > 0, adv_t, next_adv)
    returns = (advantages + values) * mask                             # [B,T]
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return (advantages * mask, returns), {}

"""Policy losses: PPO clip (clip-higher, dual-clip), CISPO, GSPO, each with optional truncated
importance sampling (TIS) for the train/inference mismatch.

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.

Every loss has the signature
    fn(logprobs [B,T], old_logprobs [B,T], advantages [B,T], response_mask [B,T], *,
       loss_agg_mode, num_tokens=None, num_seqs=None, loss_scale_factor=None, <own options>,
       rollout_logprobs=None, tis_level="token", tis_cap=2.0) -> (loss scalar, metrics)
``logprobs`` carries the gradient; ``old_logprobs`` are the (recomputed) log-probs of the policy
that generated the batch; ``rollout_logprobs``, when given, are the log-probs the inference
engine reported for the same tokens, and turn on TIS. ``num_tokens``/``num_seqs`` are the global
counts of the mini-batch under gradient accumulation (see ``aggregate.agg_loss``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.algorithms.aggregate import agg_loss, masked_mean
from engines.algorithms.registry import register_policy_loss

LOG_RATIO_LIMIT = 20.0  # exp(±20) keeps the ratio finite in float32, as verl does

Result = tuple[Tensor, dict[str, float]]


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights π_old(y)/π_rollout(y), capped at ``cap`` (TIS; Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training").

      token:    w_{i,t} = min(exp(old_{i,t} − rollout_{i,t}), cap)
      sequence: w_i     = min(exp(Σ_t mask·(old_{i,t} − rollout_{i,t})), cap), broadcast over tokens
    → (weights [B,T], detached, metrics).
    """
    mask = response_mask.float()
    log_w = (old_logprobs.float() - rollout_logprobs.float()) * mask   # [B,T]
    if level == "token":
        raw = torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))                     # [B,T]
    elif level == "sequence":
        raw = torch.exp(log_w.sum(-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).unsqueeze(-1)  # [B,1]
        raw = raw.expand_as(log_w)                                                          # [B,T]
    else:
        raise ValueError(f"tis level {level!r} is not one of ['token', 'sequence']")
    weights = raw.clamp(max=cap)
    metrics = {
        "actor/tis_weight_mean": float(masked_mean(weights, mask)),
        "actor/tis_clipfrac": float(masked_mean((raw > cap).float(), mask)),
    }
    return weights * mask, metrics


def _apply_tis(pg_losses, old_logprobs, rollout_logprobs, response_mask, level, cap, metrics):
    if rollout_logprobs is None:
        return pg_losses
    weights, tis_metrics = truncated_is_weights(old_logprobs, rollout_logprobs, response_mask, level=level, cap=cap)
    metrics.update(tis_metrics)
    return pg_losses * weights                                         # [B,T]


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_level: str = "token",
    tis_cap: float = 2.0,
) -> Result:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), with separate low/high clip
    ("clip-higher", DAPO, arXiv 2503.14476) and optional dual clip (Ye et al. 2020,
    arXiv 1912.09729).

      r = exp(logp − old),  l = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))
      dual clip (clip_ratio_c = c > 1): where A < 0, l = min(l, −A·c)
    Metrics: actor/pg_clipfrac (tokens where the clip is active), actor/ppo_kl (mean old − logp),
    actor/pg_clipfrac_lower (tokens capped by the dual clip).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    mask = response_mask.float()
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B,T]
    ratio = torch.exp(log_ratio)                                                    # [B,T]
    loss_unclipped = -advantages * ratio                                            # [B,T]
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)                         # [B,T]
    metrics = {
        "actor/pg_clipfrac": float(masked_mean((loss_clipped > loss_unclipped).float(), mask)),
        "actor/ppo_kl": float(masked_mean(-log_ratio.detach(), mask)),
    }
    if clip_ratio_c is not None:
        loss_dual = -advantages * clip_ratio_c                                      # [B,T]
        capped = (advantages < 0) & (pg_losses > loss_dual)
        metrics["actor/pg_clipfrac_lower"] = float(masked_mean(capped.float(), mask))
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, loss_dual), pg_losses)
    pg_losses = _apply_tis(pg_losses, old_logprobs, rollout_logprobs, mask, tis_level, tis_cap, metrics)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)
    return loss, metrics


@register_policy_loss("cispo")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_logprobs: Tensor | None = None,
    tis_level: str = "token",
    tis_cap: float = 2.0,
) -> Result:
    """CISPO, MiniMax-M1 (arXiv 2506.13585): clip the importance weight, not the update, so
    every token keeps a gradient.

      l = −sg(clip(r, 1−ε_low, 1+ε_high)) · A · logp,  r = exp(logp − old)
    The paper leaves the lower side open (set clip_ratio_low ≥ 1) and tunes ε_high.
    """
    mask = response_mask.float()
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B,T]
    ratio = torch.exp(log_ratio).detach()                                           # [B,T]
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)               # [B,T]
    pg_losses = -advantages * weight * logprobs                                     # [B,T]
    metrics = {
        "actor/pg_clipfrac": float(masked_mean((weight != ratio).float(), mask)),
        "actor/ppo_kl": float(masked_mean(-log_ratio.detach(), mask)),
    }
    pg_losses = _apply_tis(pg_losses, old_logprobs, rollout_logprobs, mask, tis_level, tis_cap, metrics)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)
    return loss, metrics


@register_policy_loss("gspo")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    rollout_logprobs: Tensor | None = None,
    tis_level: str = "sequence",
    tis_cap: float = 2.0,
) -> Result:
    """GSPO, Zheng et al. 2025 (arXiv 2507.18071): a sequence-level, length-normalised ratio.

      s_i = exp(mean_t(logp − old)),  s_{i,t} = sg(s_i) · exp(logp_{i,t} − sg(logp_{i,t}))
      l = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1−ε_low, 1+ε_high))
    The value of s_{i,t} is s_i on every token; its gradient is s_i·∇logp_{i,t}. The paper uses
    ε = 3e-4 / 4e-4 and aggregates "seq-mean-token-mean".
    """
    mask = response_mask.float()
    log_ratio = logprobs - old_logprobs                                             # [B,T]
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)        # [B]
    log_s = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)     # [B,T]
    s = torch.exp(log_s.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))                   # [B,T]
    loss_unclipped = -advantages * s
    loss_clipped = -advantages * s.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)                         # [B,T]
    metrics = {
        "actor/pg_clipfrac": float(masked_mean((loss_clipped > loss_unclipped).float(), mask)),
        "actor/ppo_kl": float(masked_mean(-log_ratio.detach(), mask)),
    }
    pg_losses = _apply_tis(pg_losses, old_logprobs, rollout_logprobs, mask, tis_level, tis_cap, metrics)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)
    return loss, metrics


# Losses whose per-token term is -A·f(ratio, ...): a row whose advantages are all zero has exactly zero
# gradient, so the update may skip it (engines/training/update.py, AlgorithmConfig.skip_zero_advantage).
ZERO_AT_ZERO_ADVANTAGE = (ppo_clip, cispo, gspo)

"""The bridge between ``AlgorithmConfig`` and the pure functions of this package.

The trainer calls only the functions of this module; they read the config, pick the registered
functions by name and pass each one the options it declares (a registered function gets every
config-derived option whose name appears in its signature, and no other).

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.

Typical use in one training step:
    keep, m = select_groups(cfg, scores, index)                         # rollout side, optional
    rewards, mask, stats, m = shape_rewards(cfg, scores, mask, index, truncated=..., reward_stats=stats)
    if not cfg.use_kl_loss: rewards, m = apply_kl_penalty(cfg, rewards, old_logp, ref_logp, mask)
    adv, returns, m = compute_advantages(cfg, rewards, mask, index, values)
    n_tok, n_seq = global_counts(mask)                                   # per mini-batch
    for micro-batch: loss, m = actor_loss(cfg, logp, old_logp, ref_logp, adv, mask,
                                          entropy=ent, num_tokens=n_tok, num_seqs=n_seq)
Loss metrics of one micro-batch are its share of the mini-batch loss: sum them over micro-batches.
"""

from __future__ import annotations

import inspect
import typing
from typing import Callable

import torch
from torch import Tensor

from engines.algorithms.aggregate import agg_loss, masked_mean
from engines.algorithms.critic import value_loss
from engines.algorithms.kl import AdaptiveKLController, FixedKLController
from engines.algorithms.normalize import RunningStats, clip_advantages, clip_rewards, masked_whiten, normalize_rewards
from engines.algorithms.registry import get_advantage, get_kl, get_policy_loss
from engines.algorithms.shaping import difficulty_mask, filter_groups, mask_truncated, overlong_penalty, scores_to_token_rewards

if typing.TYPE_CHECKING:  # annotations only: the engine runs without pydantic (a GPU box may not have it)
    from engines.algorithms.config import AlgorithmConfig



def _declared(fn: Callable, **candidates) -> dict:
    """The subset of ``candidates`` whose names ``fn`` declares as parameters."""
    params = inspect.signature(fn).parameters
    return {name: value for name, value in candidates.items() if name in params}


@torch.no_grad()
def compute_advantages(
    cfg: AlgorithmConfig,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Tensor,
    values: Tensor | None = None,
    *,
    ema_baseline: float | None = None,
    extra: dict | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Advantages and returns with ``cfg.advantage``, then optional whitening and clipping.

    token_level_rewards [B,T], response_mask [B,T], index [B] (group id), values [B,T] (critic,
    gae only) → (advantages [B,T], returns [B,T], metrics). ``ema_baseline`` is the reinforce
    EMA state; the new value comes back in ``metrics["advantage/ema_baseline"]``. ``extra``: further
    per-batch tensors an estimator declares (gigpo: turn_index [B,T], step_rewards [B,K],
    step_state_ids [B,K] from ``gigpo_step_tensors``; on_policy_distill: old_logprobs and
    ref_logprobs [B,T]).
    """
    fn = get_advantage(cfg.advantage)
    opts = _declared(fn, norm_by_std=cfg.norm_adv_by_std, baseline=cfg.reinforce_baseline,
                     ema_baseline=ema_baseline, ema_decay=cfg.reinforce_ema_decay,
                     step_weight=cfg.gigpo_step_weight, reward_weight=cfg.distill_reward_weight, **(extra or {}))
    (advantages, returns), metrics = fn(token_level_rewards, response_mask, index, values=values,
                                        gamma=cfg.gamma, lam=cfg.lam, **opts)
    mask = response_mask.float()
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask) * mask
    if cfg.adv_clip is not None:
        advantages, clip_metrics = clip_advantages(advantages, mask, cfg.adv_clip)
        metrics.update(clip_metrics)
    metrics.update({
        "advantage/mean": float(masked_mean(advantages, mask)),
        "advantage/abs_max": float((advantages * mask).abs().max()) if advantages.numel() else 0.0,
        "advantage/returns_mean": float(masked_mean(returns, mask)),
    })
    return advantages, returns, metrics


def actor_loss(
    cfg: AlgorithmConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    entropy: Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    rollout_logprobs: Tensor | None = None,
    kl_coef: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Actor loss = policy loss + β·agg(KL) (when ``cfg.use_kl_loss`` and a reference is given)
    − entropy_coef·agg(entropy).

    logprobs (with gradient), old_logprobs, ref_logprobs, advantages, response_mask, entropy,
    rollout_logprobs: [B,T]. ``num_tokens``/``num_seqs``: global counts of the mini-batch (see
    ``aggregate.global_counts``). ``rollout_logprobs`` turn on TIS when ``cfg.tis_cap`` is set.
    ``kl_coef`` overrides ``cfg.kl_coef`` (the adaptive controller's current value).
    → (loss scalar, metrics with actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, and
    actor/kl_loss, actor/kl_coef, actor/entropy when those terms are computed).
    """
    mask = response_mask.float()
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=cfg.loss_scale_factor)
    fn = get_policy_loss(cfg.policy_loss)
    opts = _declared(fn, clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                     clip_ratio_c=cfg.clip_ratio_c, tis_level=cfg.tis_level, tis_cap=cfg.tis_cap)
    if cfg.tis_cap is not None and rollout_logprobs is not None:
        opts["rollout_logprobs"] = rollout_logprobs
    pg_loss, metrics = fn(logprobs, old_logprobs, advantages, mask, loss_agg_mode=cfg.loss_agg_mode, **agg, **opts)
    metrics["actor/pg_loss"] = float(pg_loss.detach())
    loss = pg_loss

    if cfg.use_kl_loss and ref_logprobs is not None:
        beta = cfg.kl_coef if kl_coef is None else kl_coef
        kl = get_kl(cfg.kl_estimator)(logprobs, ref_logprobs)                          # [B,T]
        kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
        loss = loss + beta * kl_loss
        metrics.update({"actor/kl_loss": float(kl_loss.detach()), "actor/kl_coef": float(beta)})

    if entropy is not None:
        entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * entropy_loss
        metrics["actor/entropy"] = float(entropy_loss.detach())
    return loss, metrics


@torch.no_grad()
def apply_kl_penalty(
    cfg: AlgorithmConfig,
    token_level_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """KL as a per-token reward penalty (for ``cfg.use_kl_loss = False``): r_t ← r_t − β·KL_t.

    token_level_rewards, response_mask, logprobs, ref_logprobs [B,T] → (token_level_rewards [B,T],
    metrics). ``kl_coef`` overrides
    ``cfg.kl_coef``. Metric actor/reward_kl_penalty is the mean per-token KL, to feed an
    adaptive controller.
    """
    mask = response_mask.float()
    beta = cfg.kl_coef if kl_coef is None else kl_coef
    kl = get_kl(cfg.kl_estimator)(logprobs, ref_logprobs) * mask                        # [B,T]
    metrics = {"actor/reward_kl_penalty": float(masked_mean(kl, mask)),
               "actor/reward_kl_penalty_coeff": float(beta)}
    return token_level_rewards - beta * kl, metrics


def critic_loss(
    cfg: AlgorithmConfig,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss with ``cfg.cliprange_value`` and ``cfg.loss_agg_mode``. All [B,T]."""
    return value_loss(values, old_values, returns, response_mask, cliprange_value=cfg.cliprange_value,
                      loss_agg_mode=cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                      loss_scale_factor=cfg.loss_scale_factor)


@torch.no_grad()
def shape_rewards(
    cfg: AlgorithmConfig,
    scores: Tensor,
    response_mask: Tensor,
    index: Tensor,
    *,
    truncated: Tensor | None = None,
    reward_stats: RunningStats | None = None,
) -> tuple[Tensor, Tensor, RunningStats | None, dict[str, float]]:
    """Sequence scores → token-level rewards, and the response mask after the masks.

    Order: difficulty mask (on the raw pass rate), soft overlong penalty, clipping,
    normalisation, placement on the last response token, truncation mask.
    scores [B], response_mask [B,T], index [B], truncated [B] bool (finish_reason == "length",
    required when cfg.mask_truncated) → (token_level_rewards [B,T], response_mask [B,T],
    reward_stats (running normalisation state, pass back next time), metrics).
    """
    metrics: dict[str, float] = {"reward/raw_mean": float(scores.float().mean()) if scores.numel() else 0.0}
    mask = response_mask
    if cfg.difficulty_low > 0.0 or cfg.difficulty_high < 1.0:
        keep, m = difficulty_mask(scores, index, low=cfg.difficulty_low, high=cfg.difficulty_high)
        metrics.update(m)
        mask = mask * keep.to(mask.dtype).unsqueeze(-1)
    scores = scores.float()
    if cfg.overlong_buffer_len > 0:
        penalty, m = overlong_penalty(response_mask.float().sum(-1), max_len=cfg.overlong_max_len,
                                      buffer_len=cfg.overlong_buffer_len, penalty_factor=cfg.overlong_penalty_factor)
        scores = scores + penalty
        metrics.update(m)
    if cfg.reward_clip is not None:
        scores, m = clip_rewards(scores, cfg.reward_clip)
        metrics.update(m)
    (scores, reward_stats), m = normalize_rewards(scores, index, cfg.reward_norm, running=reward_stats)
    metrics.update(m)
    token_level_rewards = scores_to_token_rewards(scores, response_mask)               # [B,T]
    if cfg.mask_truncated:
        if truncated is None:
            raise ValueError("algorithm.mask_truncated = True needs truncated [B] (finish_reason == 'length')")
        mask, m = mask_truncated(mask, truncated)
        metrics.update(m)
    return token_level_rewards, mask, reward_stats, metrics


def select_groups(cfg: AlgorithmConfig, scores: Tensor, index: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Dynamic sampling: keep mask [B] bool over samples, dropping groups whose scores are all
    equal when ``cfg.filter_groups``; all True otherwise."""
    if not cfg.filter_groups:
        return torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device), {}
    return filter_groups(scores, index)


def make_kl_controller(cfg: AlgorithmConfig) -> FixedKLController | AdaptiveKLController:
    """The KL coefficient controller for ``cfg.kl_ctrl``; the trainer keeps it across steps."""
    if cfg.kl_ctrl == "adaptive":
        return AdaptiveKLController(value=cfg.kl_coef, target=cfg.kl_target, horizon=cfg.kl_horizon)
    return FixedKLController(value=cfg.kl_coef)

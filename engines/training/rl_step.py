"""From a scored rollout batch to one actor (and critic) update: the training stage's computation.

`prepare_update` takes a `RolloutBatch` (engines/training/rollout_batch.py: the table as tensors, converted
once) and applies reward shaping, the KL-in-reward penalty (when KL is not a loss term) and the
advantage estimator chosen in the config, and advances the objective's cross-iteration state
(`AlgorithmState`: adaptive KL coefficient, reinforce EMA baseline, running reward statistics),
which the trainer keeps and checkpoints. `train_update` runs the whole update on the engines
(critic, then actor) from the same batch: what the training actor (tasks/actors/train.py
`TrainWorker.update`) calls. Everything here is plain PyTorch.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field

import torch

from engines.algorithms.aggregate import masked_mean
from engines.algorithms.normalize import RunningStats
from engines.algorithms.objective import (
    apply_kl_penalty,
    compute_advantages,
    make_kl_controller,
    shape_rewards,
)
from engines.algorithms.registry import get_kl
from engines.training.rollout_batch import RolloutBatch

if typing.TYPE_CHECKING:  # annotations only: the engine runs without pydantic (a GPU box may not have it)
    from engines.algorithms.config import AlgorithmConfig


@dataclass
class AlgorithmState:
    """The objective's state across iterations; plain floats, saved in each checkpoint's
    trainer_state.pt so a resumed run continues it.

    kl_coef:      current β of the KL controller (None = not started: cfg.kl_coef)
    ema_baseline: reinforce EMA baseline (None = not started)
    reward_stats: running reward normalisation (count, mean, m2) (None = not started)
    """

    kl_coef: float | None = None
    ema_baseline: float | None = None
    reward_stats: tuple[float, float, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "AlgorithmState":
        d = d or {}
        stats = d.get("reward_stats")
        return cls(d.get("kl_coef"), d.get("ema_baseline"), None if stats is None else tuple(float(x) for x in stats))


@dataclass
class UpdateInputs:
    """advantages, returns, response_mask: [B,T]; values: [B,T] critic values (gae) or None;
    kl_coef: β for this update; state: the state after this batch; metrics."""

    advantages: torch.Tensor
    returns: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None
    kl_coef: float
    state: AlgorithmState
    metrics: dict[str, float] = field(default_factory=dict)


def prepare_update(batch: RolloutBatch, cfg: AlgorithmConfig, state: AlgorithmState | None = None) -> UpdateInputs:
    """Shaping, KL penalty and advantages of one scored batch, with the carried state."""
    state = state or AlgorithmState()
    if batch.scores is None or batch.group_index is None or batch.truncated is None:
        raise ValueError("prepare_update needs a scored table: columns reward, group_id and finish_reason")
    stats = None if state.reward_stats is None else RunningStats(*state.reward_stats)
    rewards, mask, stats, metrics = shape_rewards(cfg, batch.scores, batch.response_mask, batch.group_index,
                                                  truncated=batch.truncated, reward_stats=stats)   # [B,T]
    ctrl = make_kl_controller(cfg)
    if state.kl_coef is not None:
        ctrl.value = state.kl_coef
    kl_coef = float(ctrl.value)
    if batch.old_logprobs is not None and batch.ref_logprobs is not None:
        old, ref = batch.old_logprobs, batch.ref_logprobs                                          # [B,T]
        if not cfg.use_kl_loss and cfg.kl_coef > 0:
            rewards, m = apply_kl_penalty(cfg, rewards, old, ref, mask, kl_coef=kl_coef)
            metrics.update(m)
        # the KL the adaptive controller steers on: the sampling policy vs the reference, this batch
        current_kl = float(masked_mean(get_kl(cfg.kl_estimator)(old, ref), mask.float()))
        ctrl.update(current_kl, n_steps=batch.size)
        metrics["actor/kl_ctrl_current_kl"] = current_kl
    extra = {}
    if batch.old_logprobs is not None and batch.ref_logprobs is not None:  # read by an estimator that declares them
        extra.update(old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs)
    if cfg.advantage == "gigpo":  # step-level credit needs the per-turn structure of agentic rows
        if batch.turn_index is None:
            raise ValueError("advantage 'gigpo' needs agentic rollout columns ['state_keys', 'turn_index', 'turn_rewards'] "
                             "(workflows/agentic.py)")
        extra.update(turn_index=batch.turn_index, step_rewards=batch.step_rewards, step_state_ids=batch.step_state_ids)
    adv, returns, m = compute_advantages(cfg, rewards, mask, batch.group_index, batch.values, ema_baseline=state.ema_baseline,
                                         extra=extra)
    metrics.update(m)
    new_state = AlgorithmState(
        kl_coef=float(ctrl.value),
        ema_baseline=m.get("advantage/ema_baseline", state.ema_baseline),
        reward_stats=None if stats is None else tuple(float(x) for x in stats),
    )
    return UpdateInputs(adv, returns, mask, batch.values, kl_coef, new_state, metrics)


def train_update(actor, critic, batch: RolloutBatch, cfg: AlgorithmConfig, state: AlgorithmState | None, *,
                 temperature: float, mini_batch_size: int, max_tokens_per_micro_batch: int, seed: int,
                 train_actor: bool = True) -> tuple[dict[str, float], AlgorithmState]:
    """One update from a scored batch: `prepare_update`, then the critic's step (`critic`: a
    TorchCriticEngine, or None without one) and, unless `train_actor` is False (critic warmup), the
    actor's (`actor`: a TorchTrainEngine, engines/training/update.py). Returns (metrics, the state after it)."""
    update = prepare_update(batch, cfg, state)
    tokens = batch.with_response_mask(update.response_mask).tokens()                               # the masks' mask
    metrics = dict(update.metrics)
    sizes = dict(mini_batch_size=mini_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch, seed=seed)
    if critic is not None:
        metrics.update(critic.train_step(tokens, update.returns, update.values, cfg, **sizes))
    if train_actor:
        in_update = cfg.old_logprobs_in_update(batch.size, mini_batch_size)
        old = None if in_update else batch.old_logprobs                                          # None: the update's own forward
        behaviour = batch.behaviour_logprobs if cfg.tis_cap is not None or in_update else None
        metrics.update(actor.train_step(tokens, update.advantages, old, batch.ref_logprobs, cfg, temperature=temperature,
                                        rollout_logprobs=behaviour, kl_coef=update.kl_coef, **sizes))
    return metrics, update.state

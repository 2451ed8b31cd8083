"""From a scored rollout table to the inputs of one actor (and critic) update: the training stage's
computation before the engines run.

`table_tensors` turns the table into the update's tensors, once: the padded token batch
(`table_to_batch`) and every token-level float column as [B, T] (`token_column`); the trainer
(tasks/workers.py `TrainWorker.step`) and `prepare_update` both read those. `prepare_update`
applies reward shaping, the KL-in-reward penalty (when KL is not a loss term) and the advantage
estimator chosen in the config, and advances the objective's cross-iteration state
(`AlgorithmState`: adaptive KL coefficient, reinforce EMA baseline, running reward statistics),
which the trainer keeps and checkpoints.
Everything here is plain PyTorch.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch

from engines.algorithms.aggregate import masked_mean
from engines.algorithms.normalize import RunningStats
from engines.algorithms.objective import apply_kl_penalty, compute_advantages, make_kl_controller, shape_rewards
from engines.algorithms.registry import get_kl
from engines.batching import TokenBatch, collate

if typing.TYPE_CHECKING:  # annotations only: the engine runs without pydantic (a GPU box may not have it)
    from configs.algorithm import AlgorithmConfig


def _as_list(x) -> list:
    return x.tolist() if isinstance(x, np.ndarray) else list(x)


def table_to_batch(df: pd.DataFrame, pad_id: int) -> TokenBatch:
    masks = [_as_list(m) for m in df["loss_mask"]] if "loss_mask" in df.columns else None
    return collate(
        [_as_list(p) for p in df["prompt_token_ids"]],
        [_as_list(r) for r in df["response_token_ids"]],
        pad_id,
        loss_masks=masks,
    )


def token_column(df: pd.DataFrame, column: str, width: int) -> torch.Tensor:
    """A list-valued token-level column -> [B, width] float tensor, zero-padded on the right."""
    out = torch.zeros((len(df), width), dtype=torch.float32)
    for i, v in enumerate(df[column]):
        v = _as_list(v)[:width]
        if v:
            out[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


@dataclass
class TableTensors:
    """A rollout table as the tensors of one update, converted once by `table_tensors`.

    batch:  token ids, attention and response masks (loss_mask when the table has one), [B, P+T] / [B, T]
    token:  column name -> [B, T] float32, zero-padded on the right: the token-level float columns
            asked for that the table has (behaviour_logprobs, old_logprobs, ref_logprobs, values)
    """

    batch: TokenBatch
    token: dict[str, torch.Tensor]


def table_tensors(df: pd.DataFrame, pad_id: int, token_columns) -> TableTensors:
    """`df` -> TableTensors: `table_to_batch`, and `token_column` for each of `token_columns` present
    (tasks/types.py TOKEN_FLOAT_COLUMNS, the declared ones; engines/ does not import tasks/)."""
    batch = table_to_batch(df, pad_id)
    T = batch.responses.shape[1]
    return TableTensors(batch, {c: token_column(df, c, T) for c in token_columns if c in df.columns})


def group_index(df: pd.DataFrame) -> torch.Tensor:
    """[B] long group id (samples of the same prompt share it)."""
    codes, _ = pd.factorize(df["group_id"])
    return torch.as_tensor(codes, dtype=torch.long)


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


def prepare_update(df: pd.DataFrame, batch: TokenBatch, cfg: AlgorithmConfig, state: AlgorithmState | None = None,
                   token: dict[str, torch.Tensor] | None = None) -> UpdateInputs:
    """Shaping, KL penalty and advantages of one scored table, with the carried state. `token`:
    the table's token-level columns already as tensors (`table_tensors(...).token`); a column not
    in it is converted from `df` here."""
    state = state or AlgorithmState()
    T = batch.responses.shape[1]
    token = token or {}
    has = set(df.columns) | set(token)

    def column(name: str) -> torch.Tensor:                                           # [B, T]
        return token[name] if name in token else token_column(df, name, T)

    scores = torch.as_tensor(df["reward"].to_numpy(dtype=np.float32))                 # [B]
    index = group_index(df)                                                           # [B]
    truncated = torch.as_tensor((df["finish_reason"] == "length").to_numpy().copy())  # [B]
    stats = None if state.reward_stats is None else RunningStats(*state.reward_stats)
    rewards, mask, stats, metrics = shape_rewards(cfg, scores, batch.response_mask, index, truncated=truncated,
                                                  reward_stats=stats)
    ctrl = make_kl_controller(cfg)
    if state.kl_coef is not None:
        ctrl.value = state.kl_coef
    kl_coef = float(ctrl.value)
    has_logprobs = {"old_logprobs", "ref_logprobs"} <= has
    if has_logprobs:
        old, ref = column("old_logprobs"), column("ref_logprobs")                                 # [B,T]
        if not cfg.use_kl_loss and cfg.kl_coef > 0:
            rewards, m = apply_kl_penalty(cfg, rewards, old, ref, mask, kl_coef=kl_coef)
            metrics.update(m)
        # the KL the adaptive controller steers on: the sampling policy vs the reference, this batch
        current_kl = float(masked_mean(get_kl(cfg.kl_estimator)(old, ref), mask.float()))
        ctrl.update(current_kl, n_steps=len(df))
        metrics["actor/kl_ctrl_current_kl"] = current_kl
    values = column("values") if "values" in has else None
    extra = None
    if cfg.advantage == "gigpo":  # step-level credit needs the per-turn structure of agentic rows
        import json

        from engines.algorithms.gigpo import gigpo_step_tensors

        missing = {"turn_index", "turn_rewards", "state_keys"} - set(df.columns)
        if missing:
            raise ValueError(f"advantage 'gigpo' needs agentic rollout columns {sorted(missing)} (workflows/agentic.py)")
        keys = [json.loads(k) if isinstance(k, str) else list(k) for k in df["state_keys"]]
        extra = gigpo_step_tensors([_as_list(t) for t in df["turn_index"]], [_as_list(r) for r in df["turn_rewards"]], keys, width=T)
    adv, returns, m = compute_advantages(cfg, rewards, mask, index, values, ema_baseline=state.ema_baseline, extra=extra)
    metrics.update(m)
    new_state = AlgorithmState(
        kl_coef=float(ctrl.value),
        ema_baseline=m.get("advantage/ema_baseline", state.ema_baseline),
        reward_stats=None if stats is None else tuple(float(x) for x in stats),
    )
    return UpdateInputs(adv, returns, mask, values, kl_coef, new_state, metrics)


def advantages_from_table(df: pd.DataFrame, batch: TokenBatch, cfg: AlgorithmConfig, *, kl_coef: float | None = None):
    """(advantages [B,T], response_mask [B,T] after masks, metrics): `prepare_update` without
    carried state (one-off use, tests and hand scripts)."""
    u = prepare_update(df, batch, cfg, AlgorithmState(kl_coef=kl_coef))
    return u.advantages, u.response_mask, u.metrics

"""From a scored rollout table to one actor update: the training stage's computation.

`table_to_batch` turns rows into padded tensors; `advantages_from_table` applies reward shaping,
the KL-in-reward penalty (when KL is not a loss term) and the advantage estimator chosen in the
config; `train_on_table` runs the engine's update. Everything here is plain PyTorch.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from configs.algorithm import AlgorithmConfig
from engines.algorithms.objective import apply_kl_penalty, compute_advantages, shape_rewards
from engines.batching import TokenBatch, collate


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


def group_index(df: pd.DataFrame) -> torch.Tensor:
    """[B] long group id (samples of the same prompt share it)."""
    codes, _ = pd.factorize(df["group_id"])
    return torch.as_tensor(codes, dtype=torch.long)


def advantages_from_table(df: pd.DataFrame, batch: TokenBatch, cfg: AlgorithmConfig, *, kl_coef: float | None = None):
    """(advantages [B,T], response_mask [B,T] after masks, metrics)."""
    T = batch.responses.shape[1]
    scores = torch.as_tensor(df["reward"].to_numpy(dtype=np.float32))                 # [B]
    index = group_index(df)                                                           # [B]
    truncated = torch.as_tensor((df["finish_reason"] == "length").to_numpy().copy())       # [B]
    rewards, mask, _, metrics = shape_rewards(cfg, scores, batch.response_mask, index, truncated=truncated)
    if not cfg.use_kl_loss and cfg.kl_coef > 0:
        rewards, m = apply_kl_penalty(
            cfg, rewards, token_column(df, "old_logprobs", T), token_column(df, "ref_logprobs", T), mask, kl_coef=kl_coef
        )
        metrics.update(m)
    values = token_column(df, "values", T) if "values" in df.columns else None
    adv, _returns, m = compute_advantages(cfg, rewards, mask, index, values)
    metrics.update(m)
    return adv, mask, metrics

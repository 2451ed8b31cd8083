"""Loss aggregation over tokens and sequences, with an explicit normaliser.

Notation: B samples (= prompts × G) in the micro-batch, G samples per prompt, T response tokens.

Gradient accumulation: a mini-batch is split into micro-batches whose losses are summed before
the optimizer step. Pass the GLOBAL counts of the whole mini-batch (``num_tokens``, ``num_seqs``,
see ``global_counts``) and every mode divides by them instead of the local counts, so the sum of
the micro-batch losses equals the loss of the whole mini-batch, whatever the micro-batch size.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def global_counts(response_mask: Tensor) -> tuple[float, float]:
    """(num_tokens, num_seqs) of a whole mini-batch, to pass to ``agg_loss`` for each micro-batch.

    response_mask [B,T]. ``num_seqs`` counts only sequences with at least one unmasked token, so
    a sequence dropped by a mask (truncation, difficulty) does not dilute the mean.
    """
    mask = response_mask.float()
    return float(mask.sum()), float((mask.sum(-1) > 0).sum())


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1. Masked entries contribute exactly 0 (also to the
    gradient), even when they hold inf or nan."""
    zeroed = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is 1 (0 when nothing is unmasked)."""
    count = mask.float().sum() if dim is None else mask.float().sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss into a scalar (verl ``agg_loss`` semantics).

    loss_mat [B,T], mask [B,T] (0/1, float or bool) → scalar. With n_i = Σ_t mask[i,t]:
      token-mean:              Σ_i Σ_t l[i,t] / num_tokens               (num_tokens = Σ_i n_i)
      seq-mean-token-sum:      Σ_i (Σ_t l[i,t]) / num_seqs
      seq-mean-token-mean:     Σ_i (Σ_t l[i,t] / n_i) / num_seqs
      seq-mean-token-sum-norm: Σ_i (Σ_t l[i,t] / loss_scale_factor) / num_seqs   (Dr.GRPO,
                               arXiv 2503.20783: a constant length normaliser; the default
                               loss_scale_factor is T, set it to the max response length so it
                               does not change with padding or micro-batch)
    ``num_tokens``/``num_seqs`` default to the local counts (num_seqs counts sequences with at
    least one unmasked token); pass the global counts of the mini-batch under gradient
    accumulation. Masked tokens get exactly zero gradient.
    """
    mask = mask.float()
    tokens_per_seq = mask.sum(-1)                                      # [B]
    if num_tokens is None:
        num_tokens = tokens_per_seq.sum()
    if num_seqs is None:
        num_seqs = (tokens_per_seq > 0).float().sum()
    num_tokens = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss_mat.device).clamp(min=1.0)
    num_seqs = torch.as_tensor(num_seqs, dtype=torch.float32, device=loss_mat.device).clamp(min=1.0)

    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / num_tokens
    seq_sums = masked_sum(loss_mat, mask, dim=-1)                      # [B]
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sums / tokens_per_seq.clamp(min=1.0)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        scale = float(loss_mat.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        return (seq_sums / scale).sum() / num_seqs
    raise ValueError(f"loss_agg_mode {mode!r} is not one of {list(LOSS_AGG_MODES)}")

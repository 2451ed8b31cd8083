"""Critic (value function) loss for PPO with GAE.

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.algorithms.aggregate import agg_loss, masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float | None,
    loss_agg_mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (PPO2 baselines; Ouyang et al. 2022), verl ``compute_value_loss``.

      V_clip = old + clip(V − old, −c, c),  l = ½ · max((V − R)², (V_clip − R)²)
    values (with gradient), old_values, returns, response_mask: [B,T] → (loss scalar, metrics).
    ``cliprange_value=None`` turns the clip off (l = ½ (V − R)²).
    """
    mask = response_mask.float()
    loss_unclipped = (values - returns).square()                                   # [B,T]
    if cliprange_value is None:
        losses = loss_unclipped
        clipfrac = torch.zeros(())
    else:
        v_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        loss_clipped = (v_clipped - returns).square()                              # [B,T]
        losses = torch.maximum(loss_unclipped, loss_clipped)
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    loss = 0.5 * agg_loss(losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                          loss_scale_factor=loss_scale_factor)
    metrics = {
        "critic/vf_loss": float(loss.detach()),
        "critic/vf_clipfrac": float(clipfrac),
        "critic/vpred_mean": float(masked_mean(values.detach(), mask)),
    }
    return loss, metrics

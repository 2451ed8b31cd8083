"""KL estimators between the policy and the reference model, and the KL coefficient controllers.

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.

Estimators are token level and do no aggregation: ``fn(logprobs, ref_logprobs) -> kl [B,T]``
with log π and log π_ref of the sampled tokens [B,T]. Estimators k1..k3 follow Schulman,
"Approximating KL divergence" (2020); with x = log π − log π_ref on samples from π:
  k1 = x (unbiased, high variance, can be negative)   k2 = x²/2 (biased, low variance)
  k3 = exp(−x) − 1 + x (unbiased, ≥ 0, low variance; GRPO's choice)
They are used either as a loss term or as a per-token reward penalty (see objective.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engines.algorithms.registry import register_kl


@register_kl("k1")
def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log π − log π_ref. [B,T] → [B,T]."""
    return logprobs - ref_logprobs


@register_kl("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|log π − log π_ref|. [B,T] → [B,T]."""
    return (logprobs - ref_logprobs).abs()


@register_kl("k2")
def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = ½ (log π − log π_ref)². [B,T] → [B,T]."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register_kl("k3")
def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = π_ref/π − log(π_ref/π) − 1, clamped to [−10, 10] as verl's "low_var_kl" does.
    [B,T] → [B,T]. (GRPO, arXiv 2402.03300, eq. 4.)"""
    log_ref_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)      # [B,T]
    return (torch.exp(log_ref_ratio) - log_ref_ratio - 1.0).clamp(-10.0, 10.0)


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, *, target: float, horizon: int) -> float:
    """One update of the adaptive KL coefficient, Ziegler et al. 2019 (arXiv 1909.08593, §2.2):
    e = clip(KL/target − 1, −0.2, 0.2),  β ← β · (1 + e · n_steps / horizon)."""
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019). The trainer keeps it, reads ``value`` for
    each step and calls ``update`` with the measured KL and the number of samples seen."""

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        self.value = adaptive_kl_coef(self.value, current_kl, n_steps, target=self.target, horizon=self.horizon)


@dataclass
class FixedKLController:
    """Constant KL coefficient; ``update`` does nothing (same interface as the adaptive one)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        return None

"""Preference losses (DPO family) on per-sequence log-probs, and the log-probs they take.

Notation: B preference pairs (one chosen and one rejected response each), L tokens of a padded
sequence (prompt + response), V vocabulary. Log base e throughout.

Every loss takes the four per-sequence log-probs of a pair and returns one loss per pair:
    fn(policy_chosen_logps [B], policy_rejected_logps [B], reference_chosen_logps [B],
       reference_rejected_logps [B], *, beta, label_smoothing) -> (losses [B], metrics)
With the log-ratios  c = policy_chosen − reference_chosen,  r = policy_rejected − reference_rejected
and the margin h = c − r, each loss is a function of β·h (TRL DPOTrainer's `delta_score` with
f_divergence_type="reverse_kl"). The caller reduces ``losses`` (TRL: ``losses.mean()``).
Metrics are TRL DPOTrainer's, batch means: rewards/chosen = mean β·c, rewards/rejected = mean β·r,
rewards/margins = mean β·h, rewards/accuracies = mean 1[β·c > β·r], logps/chosen and
logps/rejected = mean policy log-probs (of whatever was passed: summed or token-mean).
The log-probs come from ``sequence_logprobs`` (summed for sigmoid/hinge/robust, token-mean for ipo).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # the label of a token outside the loss, when no loss_mask is given (HF/TRL)

Result = tuple[Tensor, dict[str, float]]

PREFERENCE_LOSSES: dict[str, Callable[..., Result]] = {}
"""name → fn(policy_chosen_logps[B], policy_rejected_logps[B], reference_chosen_logps[B],
reference_rejected_logps[B], *, beta, label_smoothing) -> (losses[B], metrics)"""


def register_preference_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a preference loss under ``name``."""

    def decorator(fn: Callable) -> Callable:
        if name in PREFERENCE_LOSSES and PREFERENCE_LOSSES[name] is not fn:
            old = PREFERENCE_LOSSES[name]
            raise ValueError(f"preference loss {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        PREFERENCE_LOSSES[name] = fn
        return fn

    return decorator


def get_preference_loss(name: str) -> Callable[..., Result]:
    """The preference loss registered as ``name``; ``KeyError`` listing the known names."""
    try:
        return PREFERENCE_LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown preference loss {name!r}; known: {sorted(PREFERENCE_LOSSES)}") from None


# --- log-probs of response tokens -------------------------------------------------------------
def token_logprobs(logits: Tensor, labels: Tensor, loss_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Log-prob of each label token under the logits, with the causal shift.

    logits [B,L,V], labels [B,L] (the input ids), loss_mask [B,L] (1 on the label tokens that count,
    i.e. the response tokens; aligned with ``labels``, not with the logits). Shift: the logits at
    position j predict the token at j+1, so logits[:, :-1] score labels[:, 1:] and loss_mask[:, 1:]
    selects the scored tokens (TRL's ``completion_mask[..., 1:]``). Without ``loss_mask`` the tokens
    whose label is -100 are left out (HF/TRL convention).
    → (logps [B,L-1], mask [B,L-1] bool); logps is exactly 0 where mask is 0. Computed in float32 (float64 kept).
    """
    if loss_mask is None:
        loss_mask = labels != IGNORE_INDEX
    mask = loss_mask[:, 1:].bool()                                                # [B,L-1]
    targets = torch.where(mask, labels[:, 1:], torch.zeros_like(labels[:, 1:]))  # -100 is no index
    shifted = logits[:, :-1] if logits.dtype == torch.float64 else logits[:, :-1].float()  # [B,L-1,V]
    picked = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)                # [B,L-1]
    logps = picked - torch.logsumexp(shifted, dim=-1)                             # [B,L-1]
    return torch.where(mask, logps, torch.zeros_like(logps)), mask


def sequence_logprobs(logits: Tensor, labels: Tensor, loss_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-sequence log-prob of the response: (summed [B], token-mean [B]).

    Same inputs and shift as ``token_logprobs``: sum_i = Σ_j mask[i,j]·log p(labels[i,j+1] | ≤ j),
    mean_i = sum_i / max(n_i, 1) with n_i the number of scored tokens. DPO (sigmoid, hinge, robust)
    takes the sums, as TRL does; IPO takes the means (see ``ipo``).
    """
    logps, mask = token_logprobs(logits, labels, loss_mask)                       # [B,L-1]
    summed = logps.sum(-1)                                                        # [B]
    return summed, summed / mask.sum(-1).clamp(min=1)


# --- the losses -------------------------------------------------------------------------------
def preference_metrics(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> dict[str, float]:
    """TRL DPOTrainer's metrics, batch means: rewards/chosen (β·c), rewards/rejected (β·r),
    rewards/margins (β·(c − r)), rewards/accuracies (fraction with β·c > β·r, strictly),
    logps/chosen, logps/rejected (policy log-probs as passed)."""
    with torch.no_grad():
        chosen = beta * (policy_chosen_logps - reference_chosen_logps).float()    # [B]
        rejected = beta * (policy_rejected_logps - reference_rejected_logps).float()  # [B]
        return {
            "rewards/chosen": float(chosen.mean()),
            "rewards/rejected": float(rejected.mean()),
            "rewards/margins": float((chosen - rejected).mean()),
            "rewards/accuracies": float((chosen > rejected).float().mean()),
            "logps/chosen": float(policy_chosen_logps.float().mean()),
            "logps/rejected": float(policy_rejected_logps.float().mean()),
        }


def _margin(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor, beta: float) -> Tensor:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    return (pc - rc) - (pr - rr)                                            # h [B]


def _no_smoothing(name: str, label_smoothing: float) -> None:
    if label_smoothing != 0.0:
        raise ValueError(f"label_smoothing is not used by the {name!r} loss: got {label_smoothing}, expected 0.0 "
                         "(conservative DPO is 'sigmoid' with label_smoothing > 0, robust DPO is 'robust')")


@register_preference_loss("sigmoid")
def dpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Result:
    """DPO, Rafailov et al. 2023 (arXiv 2305.18290, eq. 7), with conservative DPO's label smoothing
    (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"):

      l = −(1 − ε)·log σ(β·h) − ε·log σ(−β·h),   h = (π_c − ref_c) − (π_r − ref_r),  ε ∈ [0, 0.5]
    ε = 0 is plain DPO. Inputs: summed log-probs of the response tokens. Matches TRL's "sigmoid"
    up to 0.2x (``dpo_loss``); TRL 1.x's "sigmoid" ignores label_smoothing (its smoothed losses there
    are "robust" and "exo_pair").
    """
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] for 'sigmoid' (cDPO), got {label_smoothing}")
    h = _margin(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)  # [B]
    metrics = preference_metrics(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
                                 reference_rejected_logps, beta=beta)
    return losses, metrics


@register_preference_loss("robust")
def robust_dpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Result:
    """Robust DPO, Chowdhury et al. 2024 (arXiv 2403.00409): an unbiased loss under labels
    flipped with probability ε:

      l = ((1 − ε)·(−log σ(β·h)) − ε·(−log σ(−β·h))) / (1 − 2ε),   ε ∈ [0, 0.5)
    Matches TRL's "robust". Inputs: summed log-probs.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for 'robust', got {label_smoothing}")
    h = _margin(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta)
    clean = -(1.0 - label_smoothing) * F.logsigmoid(beta * h)                     # [B]
    flipped = -label_smoothing * F.logsigmoid(-beta * h)                          # [B]
    losses = (clean - flipped) / (1.0 - 2.0 * label_smoothing)                    # [B]
    metrics = preference_metrics(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
                                 reference_rejected_logps, beta=beta)
    return losses, metrics


@register_preference_loss("ipo")
def ipo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Result:
    """IPO, Azar et al. 2023 (arXiv 2310.12036, eq. 17), β playing the paper's τ:

      l = (h − 1/(2β))²
    Inputs: TOKEN-MEAN log-probs (the ``mean`` of ``sequence_logprobs``), as TRL does (TRL divides
    each log-ratio by the response length; the IPO authors confirmed their results use this
    normalised form). Summed log-probs give the paper's literal eq. 17, whose scale grows with the
    length. The metrics are then those of the mean log-probs (TRL 1.x reports summed ones).
    """
    _no_smoothing("ipo", label_smoothing)
    h = _margin(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta)
    losses = (h - 1.0 / (2.0 * beta)) ** 2                                        # [B]
    metrics = preference_metrics(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
                                 reference_rejected_logps, beta=beta)
    return losses, metrics


@register_preference_loss("hinge")
def hinge(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Result:
    """Hinge loss on the reward margin, SLiC-HF (Zhao et al. 2023, arXiv 2305.10425) as used by
    RSO (Liu et al. 2023, arXiv 2309.06657):

      l = max(0, 1 − β·h)
    Matches TRL's "hinge". Inputs: summed log-probs.
    """
    _no_smoothing("hinge", label_smoothing)
    h = _margin(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta)
    losses = torch.relu(1.0 - beta * h)                                           # [B]
    metrics = preference_metrics(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
                                 reference_rejected_logps, beta=beta)
    return losses, metrics

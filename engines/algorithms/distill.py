"""Token-level distillation: divergences between the student's and the teacher's next-token
distributions, on the teacher's top-k or on the full vocabulary, and the loss mixed with SFT.

Notation: B sequences, T positions, V vocabulary, k teacher top-k ids per position. Log base e.
Every tensor is aligned on the same T positions: position t holds the distributions over the
token at t (the caller has already shifted, as ``preference.token_logprobs`` describes), and
mask [B,T] is 1 on the positions that count.

Support and renormalisation (one rule for both paths): at each position the divergence is taken
over a support S, and the student (s) and the teacher (q) are each renormalised over S:
  top-k:      S = the teacher's k ids whose given log-prob is finite; q = softmax over S of the
              given teacher log-probs / τ_t; s = softmax over S of the student logits at those
              ids / τ_s (= the full-vocabulary student softmax gathered at S and renormalised over
              S). No "rest" bucket. This is ROLL's distill pipeline (teacher top-k softmax,
              student logits gathered at the teacher's ids) and TRL's server distillation with
              ``loss_add_tail=False``.
  full vocab: S = the ids where the teacher logit is finite (all V, usually); q = softmax of
              teacher logits / τ_t, s = softmax of student logits / τ_s over S. With k = V the
              top-k path gives the same numbers.
Temperatures divide the logits (or the teacher's log-probs, which differ from its logits by a
constant per position) before the softmax; no τ² factor. TRL's GKD uses one temperature for both
(τ_s = τ_t = temperature); ROLL divides the student by kd_temperature and the teacher by
kd_temperature·teacher_temperature.

Divergences (registered by name; KL(p ‖ r) = Σ_S p·(log p − log r), 0·log 0 = 0):
  forward_kl          KL(q ‖ s)
  reverse_kl          KL(s ‖ q)
  jsd                 GKD's generalised JSD, β ∈ [0, 1] (TRL ``GKDTrainer.generalized_jsd_loss``):
                      m = β·q + (1 − β)·s,  β·KL(q ‖ m) + (1 − β)·KL(s ‖ m);
                      β = 0 is forward_kl and β = 1 is reverse_kl exactly (TRL's special cases)
  skewed_forward_kl   KL(q ‖ λ·q + (1 − λ)·s), skew λ ∈ [0, 1] (DistiLLM, arXiv 2402.03898; ROLL)
  skewed_reverse_kl   KL(s ‖ (1 − λ)·q + λ·s)
Gradients flow through every student term, the mixtures included; the teacher is a constant.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from engines.algorithms.aggregate import masked_sum

Result = tuple[Tensor, dict[str, float]]

DIVERGENCES: dict[str, Callable[..., Tensor]] = {}
"""name → fn(student_logps[...,K], teacher_logps[...,K], support[...,K] bool, *, own options) -> [...]
(both log-probs already normalised over the support and 0 outside it)"""


def register_divergence(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a token-level distillation divergence under ``name``."""

    def decorator(fn: Callable) -> Callable:
        if name in DIVERGENCES and DIVERGENCES[name] is not fn:
            old = DIVERGENCES[name]
            raise ValueError(f"divergence {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        DIVERGENCES[name] = fn
        return fn

    return decorator


def get_divergence(name: str) -> Callable[..., Tensor]:
    """The divergence registered as ``name``; ``KeyError`` listing the known names."""
    try:
        return DIVERGENCES[name]
    except KeyError:
        raise KeyError(f"unknown divergence {name!r}; known: {sorted(DIVERGENCES)}") from None


# --- divergences over a support ---------------------------------------------------------------
def _kl(p_logps: Tensor, r_logps: Tensor, support: Tensor) -> Tensor:
    """KL(p ‖ r) = Σ_S p·(log p − log r) over the last dim. [...,K] → [...]."""
    p = torch.where(support, p_logps.exp(), torch.zeros_like(p_logps))
    return torch.where(support, p * (p_logps - r_logps), torch.zeros_like(p_logps)).sum(-1)


def _log_mix(a_logps: Tensor, b_logps: Tensor, weight_a: float) -> Tensor:
    """log(w·a + (1 − w)·b), elementwise, w ∈ (0, 1). [...,K] → [...,K]."""
    return torch.logaddexp(a_logps + math.log(weight_a), b_logps + math.log1p(-weight_a))


def _at_least_f32(x: Tensor) -> Tensor:
    """float32 for half-precision inputs, float64 kept."""
    return x if x.dtype == torch.float64 else x.float()


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


@register_divergence("forward_kl")
def forward_kl(student_logps: Tensor, teacher_logps: Tensor, support: Tensor) -> Tensor:
    """KL(teacher ‖ student) = Σ_S q·(log q − log s) (Hinton et al. 2015 at τ = 1; ROLL's forward_kl)."""
    return _kl(teacher_logps, student_logps, support)


@register_divergence("reverse_kl")
def reverse_kl(student_logps: Tensor, teacher_logps: Tensor, support: Tensor) -> Tensor:
    """KL(student ‖ teacher) = Σ_S s·(log s − log q) (MiniLLM, Gu et al., arXiv 2306.08543)."""
    return _kl(student_logps, teacher_logps, support)


@register_divergence("jsd")
def generalized_jsd(student_logps: Tensor, teacher_logps: Tensor, support: Tensor, *, beta: float = 0.5) -> Tensor:
    """Generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, arXiv 2306.13649, eq. 1),
    exactly as TRL's ``GKDTrainer.generalized_jsd_loss``:

      m = β·q + (1 − β)·s,   JSD_β = β·KL(q ‖ m) + (1 − β)·KL(s ‖ m)
    β = 0 → KL(q ‖ s) (forward) and β = 1 → KL(s ‖ q) (reverse), the unscaled KLs, as TRL
    special-cases them (the formula itself tends to 0 at both ends). β = 0.5 is the symmetric JSD
    (ROLL's "js_divergence").
    """
    _check_unit("beta", beta)
    if beta == 0.0:
        return _kl(teacher_logps, student_logps, support)
    if beta == 1.0:
        return _kl(student_logps, teacher_logps, support)
    mix = _log_mix(teacher_logps, student_logps, beta)                            # [...,K]
    return beta * _kl(teacher_logps, mix, support) + (1.0 - beta) * _kl(student_logps, mix, support)


@register_divergence("skewed_forward_kl")
def skewed_forward_kl(student_logps: Tensor, teacher_logps: Tensor, support: Tensor, *, skew: float = 0.1) -> Tensor:
    """Skew KL of DistiLLM (Ko et al. 2024, arXiv 2402.03898): KL(q ‖ λ·q + (1 − λ)·s).
    λ = 0 is forward_kl, λ = 1 is 0. ROLL's "skewed_forward_kl" with skew_lambda = λ."""
    _check_unit("skew", skew)
    if skew == 0.0:
        return _kl(teacher_logps, student_logps, support)
    if skew == 1.0:
        return _kl(teacher_logps, teacher_logps, support)
    return _kl(teacher_logps, _log_mix(teacher_logps, student_logps, skew), support)


@register_divergence("skewed_reverse_kl")
def skewed_reverse_kl(student_logps: Tensor, teacher_logps: Tensor, support: Tensor, *, skew: float = 0.1) -> Tensor:
    """Skew reverse KL of DistiLLM (arXiv 2402.03898): KL(s ‖ (1 − λ)·q + λ·s).
    λ = 0 is reverse_kl, λ = 1 is 0. ROLL's "skewed_reverse_kl" with skew_lambda = λ."""
    _check_unit("skew", skew)
    if skew == 0.0:
        return _kl(student_logps, teacher_logps, support)
    if skew == 1.0:
        return _kl(student_logps, student_logps, support)
    return _kl(student_logps, _log_mix(teacher_logps, student_logps, 1.0 - skew), support)


# --- per-position divergence from logits ------------------------------------------------------
def _renormalise(scores: Tensor, support: Tensor) -> Tensor:
    """log softmax of ``scores`` over the support (last dim), 0 outside it. Positions with an empty
    support give all zeros (and a zero divergence), without nan in the value or the gradient."""
    floor = torch.finfo(scores.dtype).min
    safe = torch.where(support, scores, torch.full_like(scores, floor))          # finite everywhere
    logps = safe - torch.logsumexp(safe, dim=-1, keepdim=True)
    return torch.where(support, logps, torch.zeros_like(logps))


def _check_temperatures(student_temperature: float, teacher_temperature: float) -> None:
    for name, value in (("student_temperature", student_temperature), ("teacher_temperature", teacher_temperature)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def topk_token_divergence(
    student_logits: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logps: Tensor,
    *,
    divergence: str = "forward_kl",
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    **options: float,
) -> Tensor:
    """Divergence at each position on the teacher's top-k (module docstring: support and renormalisation).

    student_logits [B,T,V]; teacher_topk_ids [B,T,k] (distinct ids); teacher_topk_logps [B,T,k]
    (the teacher's log-probs, or logits, at those ids, at temperature 1; −inf marks an id outside
    the support). ``options``: the divergence's own (``beta`` for jsd, ``skew`` for the skewed
    KLs). → [B,T], no masking (see ``distill_loss``). Computed in float32 (float64 inputs stay float64).
    """
    _check_temperatures(student_temperature, teacher_temperature)
    fn = get_divergence(divergence)
    teacher = _at_least_f32(teacher_topk_logps)                                   # [B,T,k]
    support = torch.isfinite(teacher)                                             # [B,T,k]
    student = _at_least_f32(student_logits.gather(-1, teacher_topk_ids.long()))   # [B,T,k], gather first
    student_logps = _renormalise(student / student_temperature, support)          # [B,T,k]
    teacher_logps = _renormalise(teacher / teacher_temperature, support)          # [B,T,k]
    return fn(student_logps, teacher_logps.detach(), support, **options)          # [B,T]


def full_vocab_token_divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    divergence: str = "forward_kl",
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    **options: float,
) -> Tensor:
    """Divergence at each position over the full vocabulary. student_logits, teacher_logits
    [B,T,V] (a −inf teacher logit takes its id out of the support). → [B,T], no masking.
    Computed in float32 (float64 inputs stay float64)."""
    _check_temperatures(student_temperature, teacher_temperature)
    fn = get_divergence(divergence)
    teacher = _at_least_f32(teacher_logits)                                       # [B,T,V]
    support = torch.isfinite(teacher)                                             # [B,T,V]
    student_logps = _renormalise(_at_least_f32(student_logits) / student_temperature, support)
    teacher_logps = _renormalise(teacher / teacher_temperature, support)
    return fn(student_logps, teacher_logps.detach(), support, **options)          # [B,T]


def sft_token_nll(student_logits: Tensor, labels: Tensor) -> Tensor:
    """−log softmax(student_logits)[labels] at each position, temperature 1 (ROLL's language loss).
    student_logits [B,T,V], labels [B,T] aligned with the logits (already shifted; any value,
    −100 included, where the caller's mask is 0). → [B,T], no masking; float32 (float64 kept)."""
    safe = labels.clamp(min=0).long()                                             # [B,T]
    logits = _at_least_f32(student_logits)                                        # [B,T,V]
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)


# --- the loss ---------------------------------------------------------------------------------
def distill_loss(
    token_divergence: Tensor,
    mask: Tensor,
    *,
    token_nll: Tensor | None = None,
    distill_loss_weight: float = 1.0,
    num_tokens: float | None = None,
) -> Result:
    """Token-mean of the divergence over the mask, mixed with the SFT loss as ROLL's distill
    pipeline does (``distill_loss_weight``, ROLL's default 0.5):

      D = Σ mask·div / N,   S = Σ mask·nll / N,   loss = w·D + (1 − w)·S
    token_divergence, token_nll [B,T] (from ``topk_token_divergence`` / ``full_vocab_token_divergence``
    and ``sft_token_nll``), mask [B,T]. N = ``num_tokens`` (the global count of unmasked positions
    of the mini-batch under gradient accumulation, as in ``aggregate.agg_loss``) or the local count,
    at least 1. w = 1 (the default) needs no ``token_nll``. Masked positions get exactly zero
    gradient. Metrics: distill/loss, distill/divergence (D), distill/sft_nll (S, when given).
    """
    _check_unit("distill_loss_weight", distill_loss_weight)
    if token_nll is None and distill_loss_weight < 1.0:
        raise ValueError(f"distill_loss_weight={distill_loss_weight} mixes in the SFT loss: pass token_nll")
    count = mask.float().sum() if num_tokens is None else torch.as_tensor(float(num_tokens))
    count = count.to(token_divergence.device).clamp(min=1.0)
    div = masked_sum(token_divergence, mask) / count                             # scalar
    loss = distill_loss_weight * div
    metrics = {"distill/divergence": float(div.detach())}
    if token_nll is not None:
        nll = masked_sum(token_nll, mask) / count                                # scalar
        loss = loss + (1.0 - distill_loss_weight) * nll
        metrics["distill/sft_nll"] = float(nll.detach())
    metrics["distill/loss"] = float(loss.detach())
    return loss, metrics


"""Preference losses (DPO, cDPO, robust DPO, IPO, hinge) and the sequence log-probs they take: each
checked against the formula written again here in plain Python (math), on hand-made and random
inputs, against the analytic DPO gradient, and for the metrics TRL's DPOTrainer reports.

TRL itself: TRL ≥ 1.0 computes these losses inline in ``DPOTrainer._compute_loss`` (no function to
call; the expressions below are those of TRL 1.16 ``trl/trainer/dpo_trainer.py``, and cDPO those
of TRL 0.x ``DPOTrainer.dpo_loss`` "sigmoid" with label_smoothing), so there is no TRL call here.
"""

import math
import random

import pytest
import torch

from engines.algorithms.preference import (
    PREFERENCE_LOSSES,
    get_preference_loss,
    sequence_logprobs,
    token_logprobs,
)

LOSSES = ["sigmoid", "robust", "ipo", "hinge"]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _reference_loss(name: str, pc: float, pr: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """The loss of one pair, from the papers' formulas (see engines/algorithms/preference.py)."""
    h = (pc - rc) - (pr - rr)
    if name == "sigmoid":                         # Rafailov et al. eq. 7, cDPO smoothing (Mitchell 2023)
        return -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)
    if name == "robust":                          # Chowdhury et al. 2024
        return (-(1 - eps) * _log_sigmoid(beta * h) + eps * _log_sigmoid(-beta * h)) / (1 - 2 * eps)
    if name == "ipo":                             # Azar et al. eq. 17, τ = β
        return (h - 1 / (2 * beta)) ** 2
    if name == "hinge":                           # SLiC / RSO
        return max(0.0, 1 - beta * h)
    raise AssertionError(name)


def _pairs(n: int, seed: int) -> list[tuple[float, float, float, float]]:
    rng = random.Random(seed)
    return [tuple(rng.uniform(-40.0, -1.0) for _ in range(4)) for _ in range(n)]


def _call(name, pairs, **kw):
    cols = [torch.tensor([p[i] for p in pairs], dtype=torch.float64) for i in range(4)]
    return get_preference_loss(name)(*cols, **kw)


# --- hand-worked values -----------------------------------------------------------------------
def test_dpo_hand_value():
    # c = −5 − (−6) = 1, r = −7 − (−6) = −1, h = 2, β·h = 0.2: −log σ(0.2) = log(1 + e^−0.2) = 0.598139
    losses, m = _call("sigmoid", [(-5.0, -7.0, -6.0, -6.0)], beta=0.1)
    assert losses.item() == pytest.approx(0.598139, abs=1e-6)
    # rewards: β·c = 0.1, β·r = −0.1, margin 0.2, accuracy 1; logps are the policy's
    assert m == pytest.approx({"rewards/chosen": 0.1, "rewards/rejected": -0.1, "rewards/margins": 0.2,
                               "rewards/accuracies": 1.0, "logps/chosen": -5.0, "logps/rejected": -7.0})


def test_cdpo_hand_value():
    # β·h = 0.2, ε = 0.1: 0.9·log(1 + e^−0.2) + 0.1·log(1 + e^0.2) = 0.538325 + 0.079814 = 0.618139
    losses, _ = _call("sigmoid", [(-5.0, -7.0, -6.0, -6.0)], beta=0.1, label_smoothing=0.1)
    assert losses.item() == pytest.approx(0.618139, abs=1e-6)


def test_ipo_hand_value():
    # h = 0 (policy = reference): (0 − 1/(2·0.1))² = 25; h = 5 is the target margin: 0
    losses, _ = _call("ipo", [(-2.0, -3.0, -2.0, -3.0), (-1.0, -6.0, -2.0, -2.0)], beta=0.1)
    assert losses.tolist() == pytest.approx([25.0, 0.0])


def test_hinge_hand_value_and_flat_side():
    # β·h = 0.2 → 0.8; h = 1 − (−14) = 15, β·h = 1.5 → 0, with zero gradient
    pc = torch.tensor([-5.0, -1.0], requires_grad=True)
    losses, _ = get_preference_loss("hinge")(pc, torch.tensor([-7.0, -16.0]), torch.tensor([-6.0, -2.0]),
                                             torch.tensor([-6.0, -2.0]), beta=0.1, label_smoothing=0.0)
    assert losses.tolist() == pytest.approx([0.8, 0.0])
    losses.sum().backward()
    assert pc.grad.tolist() == pytest.approx([-0.1, 0.0])


# --- against the formulas on random inputs ----------------------------------------------------
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 2.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_losses_match_the_formula(name, beta, seed):
    pairs = _pairs(9, seed)
    eps_values = [0.0, 0.1, 0.3] if name in ("sigmoid", "robust") else [0.0]
    for eps in eps_values:
        losses, _ = _call(name, pairs, beta=beta, label_smoothing=eps)
        expected = [_reference_loss(name, *p, beta, eps) for p in pairs]
        assert losses.shape == (len(pairs),)
        assert losses.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_trl_definitions(seed):
    pairs = _pairs(7, seed) + [(-3.0, -3.0, -2.0, -2.0)]     # a tie: β·c = β·r, not counted as accurate
    beta = 0.3
    _, m = _call("sigmoid", pairs, beta=beta)
    chosen = [beta * (pc - rc) for pc, pr, rc, rr in pairs]
    rejected = [beta * (pr - rr) for pc, pr, rc, rr in pairs]
    n = len(pairs)
    assert m["rewards/chosen"] == pytest.approx(sum(chosen) / n)
    assert m["rewards/rejected"] == pytest.approx(sum(rejected) / n)
    assert m["rewards/margins"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / n)
    assert m["rewards/accuracies"] == pytest.approx(sum(c > r for c, r in zip(chosen, rejected)) / n)
    assert m["logps/chosen"] == pytest.approx(sum(p[0] for p in pairs) / n)
    assert m["logps/rejected"] == pytest.approx(sum(p[1] for p in pairs) / n)


# --- conventions and properties ---------------------------------------------------------------
def test_cdpo_limits():
    pairs = _pairs(6, 3)
    plain, _ = _call("sigmoid", pairs, beta=0.2)
    smoothed0, _ = _call("sigmoid", pairs, beta=0.2, label_smoothing=0.0)
    robust0, _ = _call("robust", pairs, beta=0.2, label_smoothing=0.0)
    torch.testing.assert_close(plain, smoothed0)
    torch.testing.assert_close(plain, robust0)
    # ε = 0.5: the label carries no information, the loss is even in h (swap chosen and rejected)
    swapped = [(pr, pc, rr, rc) for pc, pr, rc, rr in pairs]
    a, _ = _call("sigmoid", pairs, beta=0.2, label_smoothing=0.5)
    b, _ = _call("sigmoid", swapped, beta=0.2, label_smoothing=0.5)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo_gradient_is_the_analytic_one(eps):
    # ∂l/∂π_c = −β·((1 − ε)·σ(−β·h) − ε·σ(β·h)) = −∂l/∂π_r; the reference gets no gradient
    pairs = _pairs(5, 4)
    pc = torch.tensor([p[0] for p in pairs], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([p[1] for p in pairs], dtype=torch.float64, requires_grad=True)
    rc = torch.tensor([p[2] for p in pairs], dtype=torch.float64)
    rr = torch.tensor([p[3] for p in pairs], dtype=torch.float64)
    beta = 0.1
    losses, _ = get_preference_loss("sigmoid")(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    losses.sum().backward()

    def sig(x):
        return 1 / (1 + math.exp(-x))

    expected = [-beta * ((1 - eps) * sig(-beta * ((a - c) - (b - d))) - eps * sig(beta * ((a - c) - (b - d))))
                for a, b, c, d in pairs]
    assert pc.grad.tolist() == pytest.approx(expected, rel=1e-9)
    assert pr.grad.tolist() == pytest.approx([-g for g in expected], rel=1e-9)


def test_registry_and_bad_options():
    assert set(LOSSES) <= set(PREFERENCE_LOSSES)
    with pytest.raises(KeyError, match=r"unknown preference loss 'dpo'.*'hinge'.*'ipo'.*'sigmoid'"):
        get_preference_loss("dpo")
    pairs = _pairs(2, 5)
    with pytest.raises(ValueError, match="label_smoothing is not used by the 'ipo'"):
        _call("ipo", pairs, beta=0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing is not used by the 'hinge'"):
        _call("hinge", pairs, beta=0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        _call("robust", pairs, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\]"):
        _call("sigmoid", pairs, beta=0.1, label_smoothing=0.6)
    with pytest.raises(ValueError, match="beta must be > 0"):
        _call("sigmoid", pairs, beta=0.0)


# --- sequence log-probs -----------------------------------------------------------------------
def _loop_sequence_logprobs(logits, labels, mask):
    """Σ over j with mask[b, j+1] of log softmax(logits[b, j])[labels[b, j+1]], in plain Python."""
    sums, means = [], []
    for b in range(len(labels)):
        total, n = 0.0, 0
        for j in range(len(labels[b]) - 1):
            if not mask[b][j + 1]:
                continue
            row = logits[b][j]
            log_z = math.log(sum(math.exp(x) for x in row))
            total += row[labels[b][j + 1]] - log_z
            n += 1
        sums.append(total)
        means.append(total / max(n, 1))
    return sums, means


@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_logprobs_match_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, L, V = 3, 6, 5
    logits = torch.randn(B, L, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, L), generator=g)
    # row 0: prompt of 2 then 4 response tokens; row 1: response of 2 then padding; row 2: nothing
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    sums, means = sequence_logprobs(logits, labels, mask)
    exp_sums, exp_means = _loop_sequence_logprobs(logits.tolist(), labels.tolist(), mask.tolist())
    assert sums.tolist() == pytest.approx(exp_sums, rel=1e-6, abs=1e-6)
    assert means.tolist() == pytest.approx(exp_means, rel=1e-6, abs=1e-6)
    assert sums[2].item() == 0.0 and means[2].item() == 0.0
    # without a mask the −100 labels are left out (HF/TRL); their values are never used as indices
    labels_100 = labels.masked_fill(mask == 0, -100)
    sums_100, _ = sequence_logprobs(logits, labels_100)
    torch.testing.assert_close(sums_100, sums)
    logps, tok_mask = token_logprobs(logits, labels_100)
    assert logps.shape == (B, L - 1) and torch.equal(tok_mask, mask[:, 1:].bool())
    assert torch.all(logps[~tok_mask] == 0)


def test_sequence_logprobs_feed_dpo_with_gradient():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    labels = torch.randint(0, 4, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    sums, _ = sequence_logprobs(logits, labels, mask)
    losses, _ = get_preference_loss("sigmoid")(sums[:1], sums[1:], sums[:1].detach(), sums[1:].detach(), beta=0.1)
    losses.mean().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # the last position predicts nothing, and positions whose next token is masked get no gradient
    assert torch.all(logits.grad[:, -1] == 0)
    assert torch.all(logits.grad[0, 0] != 0) and torch.all(logits.grad[0, 3] == 0)

"""Policy losses (ppo_clip, cispo, gspo, TIS), the critic loss and KL: hand-worked values,
equivalence with a naive per-token Python loop, and exactly zero gradient on masked tokens."""

import math

import pytest
import torch

from engines.algorithms.kl import AdaptiveKLController, FixedKLController, adaptive_kl_coef
from engines.algorithms.registry import get_kl, get_policy_loss
from engines.algorithms.policy_losses import truncated_is_weights
from engines.algorithms.critic import value_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSSES = ["ppo_clip", "cispo", "gspo"]


# --- hand-worked values -----------------------------------------------------------------------
def test_cispo_hand_values():
    # (A, ratio) = (1, 1.5) and (−1, 0.5); old = −1; weights clip to 1.2 and 0.8 (both clipped)
    old = torch.full((2, 1), -1.0)
    logp = (old + torch.tensor([[math.log(1.5)], [math.log(0.5)]])).requires_grad_(True)
    adv = torch.tensor([[1.0], [-1.0]])
    loss, m = get_policy_loss("cispo")(logp, old, adv, torch.ones(2, 1), loss_agg_mode="token-mean")
    # l = −sg(w)·A·logp: −1.2 · (−0.594535) = 0.713442 and 0.8 · (−1.693147) = −1.354518; mean −0.320538
    assert loss.item() == pytest.approx(-0.320538, abs=1e-5)
    assert m["actor/pg_clipfrac"] == 1.0
    loss.backward()
    # clipped tokens still get a gradient (the point of CISPO): −w·A / 2 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.6], [0.4]]))


def test_gspo_hand_values():
    # one sequence, log-ratios [0.2, 0.0] → s = exp(0.1) = 1.105171, A = 1
    old = torch.tensor([[-1.0, -2.0]])
    logp = (old + torch.tensor([[0.2, 0.0]])).requires_grad_(True)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    loss, m = get_policy_loss("gspo")(logp, old, adv, mask, loss_agg_mode="token-mean",
                                      clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-1.105171, abs=1e-5)          # inside [0.8, 1.2]
    loss.backward()
    # ∂/∂logp_t of −A·s_{i,t} = −s_i, / 2 tokens = −0.552585 on both tokens
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -0.552585))
    # ε_high = 0.05: s clipped at 1.05 → loss −1.05, no gradient
    logp.grad = None
    loss, m = get_policy_loss("gspo")(logp, old, adv, mask, loss_agg_mode="token-mean",
                                      clip_ratio_low=0.05, clip_ratio_high=0.05)
    assert loss.item() == pytest.approx(-1.05) and m["actor/pg_clipfrac"] == 1.0
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_truncated_is_weights_hand_values():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2)
    # token: ratios [2, 1], capped at 1.5 → [1.5, 1]
    w, m = truncated_is_weights(old, rollout, mask, level="token", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0]]))
    assert m["actor/tis_clipfrac"] == 0.5
    # sequence: product 2 · 1 = 2, capped at 1.5 on both tokens
    w, _ = truncated_is_weights(old, rollout, mask, level="sequence", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5]]))
    # in ppo_clip with ratio 1 and A = 1: loss = mean(−1 · [1.5, 1]) = −1.25
    logp = old.clone().requires_grad_(True)
    loss, m = get_policy_loss("ppo_clip")(logp, old, torch.ones(1, 2), mask, loss_agg_mode="token-mean",
                                          rollout_logprobs=rollout, tis_cap=1.5)
    assert loss.item() == pytest.approx(-1.25) and "actor/tis_weight_mean" in m
    with pytest.raises(ValueError, match="tis level"):
        truncated_is_weights(old, rollout, mask, level="batch")


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old, returns, mask = torch.zeros(1, 2), torch.tensor([[0.8, 1.0]]), torch.ones(1, 2)
    loss, m = value_loss(values, old, returns, mask, cliprange_value=0.5, loss_agg_mode="token-mean")
    # token 0: max((1 − 0.8)², (0.5 − 0.8)²) = 0.09 (clipped); token 1: max(1, 1) = 1
    # ½ · (0.09 + 1) / 2 = 0.2725
    assert loss.item() == pytest.approx(0.2725)
    assert m["critic/vf_clipfrac"] == 0.5 and m["critic/vf_loss"] == pytest.approx(0.2725)
    loss.backward()
    # token 0 clipped: no gradient; token 1: ½ · 2 · (0 − 1) / 2 = −0.5
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.5]]))
    loss, _ = value_loss(values, old, returns, mask, cliprange_value=None, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(0.5 * (0.04 + 1.0) / 2)       # unclipped MSE: 0.26


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs"])
def test_token_kl_estimators_match_loop(name):
    g = torch.Generator().manual_seed(1)
    lp, lr = -torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3
    fn = {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: min(max(math.exp(b - a) - (b - a) - 1, -10.0), 10.0),
        "abs": lambda a, b: abs(a - b),
    }[name]
    loop = torch.tensor([[fn(a, b) for a, b in zip(r1, r2)] for r1, r2 in zip(lp.tolist(), lr.tolist())])
    torch.testing.assert_close(get_kl(name)(lp, lr), loop, atol=1e-5, rtol=1e-5)


def test_adaptive_kl_controller():
    # error = clip(0.15/0.1 − 1, ±0.2) = 0.2; β = 0.1 · (1 + 0.2 · 100/1000) = 0.102
    assert adaptive_kl_coef(0.1, 0.15, 100, target=0.1, horizon=1000) == pytest.approx(0.102)
    # error = 0.09/0.1 − 1 = −0.1; β = 0.1 · (1 − 0.1 · 0.1) = 0.099
    ctrl = AdaptiveKLController(value=0.1, target=0.1, horizon=1000)
    ctrl.update(0.09, 100)
    assert ctrl.value == pytest.approx(0.099)
    fixed = FixedKLController(value=0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1


# --- loop references --------------------------------------------------------------------------
def agg_loop(l, mask, mode, T):
    rows = [[v for v, m in zip(lr, mr) if m] for lr, mr in zip(l, mask.tolist())]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    per_seq = {"seq-mean-token-sum": lambda r: sum(r), "seq-mean-token-mean": lambda r: sum(r) / len(r),
               "seq-mean-token-sum-norm": lambda r: sum(r) / T}[mode]
    return sum(per_seq(r) for r in rows) / len(rows)


def pg_loop(name, logp, old, adv, mask, lo, hi, c):
    out = []
    B, T = len(logp), len(logp[0])
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        seq_ratio = math.exp(sum(logp[i][t] - old[i][t] for t in valid) / max(len(valid), 1))
        row = []
        for t in range(T):
            a, r = adv[i][t], math.exp(logp[i][t] - old[i][t])
            if name == "ppo_clip":
                l = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
                if a < 0:
                    l = min(l, -a * c)
            elif name == "cispo":
                l = -a * min(max(r, 1 - lo), 1 + hi) * logp[i][t]
            else:  # gspo: value of s_{i,t} is the sequence ratio
                l = max(-a * seq_ratio, -a * min(max(seq_ratio, 1 - lo), 1 + hi))
            row.append(l)
        out.append(row)
    return out


def _random_pg_case(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 7, (1,), generator=g))
    T = int(torch.randint(1, 7, (1,), generator=g))
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    logp = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0, 0] = 1.0
    return logp, old, adv, mask


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_policy_losses_match_loop_reference(name, mode, seed):
    logp, old, adv, mask = _random_pg_case(seed)
    lo, hi, c = 0.2, 0.28, 3.0
    kw = dict(clip_ratio_low=lo, clip_ratio_high=hi, **({"clip_ratio_c": c} if name == "ppo_clip" else {}))
    loss, _ = get_policy_loss(name)(logp, old, adv, mask, loss_agg_mode=mode, **kw)
    ref = agg_loop(pg_loop(name, logp.tolist(), old.tolist(), adv.tolist(), mask, lo, hi, c), mask, mode, logp.shape[1])
    assert loss.item() == pytest.approx(ref, rel=1e-4, abs=1e-5)


# --- masked tokens get exactly zero gradient --------------------------------------------------
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tis", [None, "token", "sequence"])
def test_masked_tokens_get_zero_gradient(name, mode, tis):
    logp, old, adv, mask = _random_pg_case(5)
    garbage = mask == 0
    logp = torch.where(garbage, torch.full_like(logp, 50.0), logp).requires_grad_(True)  # huge ratios behind the mask
    adv = torch.where(garbage, torch.full_like(adv, -1e6), adv)
    rollout = None if tis is None else old + 0.1
    loss, _ = get_policy_loss(name)(logp, old, adv, mask, loss_agg_mode=mode, rollout_logprobs=rollout,
                                    tis_level=tis or "token")
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(logp.grad[garbage] == 0)
    assert torch.all(torch.isfinite(logp.grad))


def test_value_loss_masked_tokens_get_zero_gradient():
    values = torch.tensor([[1.0, 1e6, 2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, _ = value_loss(values, torch.zeros(1, 3), torch.ones(1, 3), mask, cliprange_value=0.5,
                         loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    assert values.grad[0, 1] == 0 and torch.isfinite(loss)

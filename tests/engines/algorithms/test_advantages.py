"""Advantage estimators: hand-worked values, and equivalence with a naive per-sample Python loop
on random shapes, group layouts, masks and seeds."""

import inspect
import math
import statistics

import pytest
import torch

from engines.algorithms.registry import get_advantage


# --- hand-worked values -----------------------------------------------------------------------
def test_rloo_hand_values():
    # group 0 scores [1, 0, 0]: A = s_i − mean of the others = [1 − 0, 0 − 0.5, 0 − 0.5]; group 1 solo → 0
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [2.0, 0.0]])
    mask = torch.ones(4, 2)
    (adv, ret), _ = get_advantage("rloo")(rewards, mask, torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 0.0]))
    torch.testing.assert_close(ret, adv)


def test_reinforce_batch_and_ema_baseline():
    # scores [1, 0, 0, 1] → batch baseline 0.5; γ = 1 so G_t = s on every valid token
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    index = torch.arange(4)
    (adv, ret), m = get_advantage("reinforce")(rewards, mask, index)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [-0.5, -0.5], [0.5, 0.0]]))
    assert m["advantage/baseline"] == 0.5
    # EMA: the carried baseline 0.2 is used; new = 0.9 · 0.2 + 0.1 · 0.5 = 0.23
    (adv, _), m = get_advantage("reinforce")(rewards, mask, index, baseline="ema", ema_baseline=0.2, ema_decay=0.9)
    torch.testing.assert_close(adv[0], torch.tensor([0.8, 0.8]))
    assert m["advantage/ema_baseline"] == pytest.approx(0.23)
    # first EMA call: no state yet → batch mean, which becomes the state
    _, m = get_advantage("reinforce")(rewards, mask, index, baseline="ema")
    assert m["advantage/ema_baseline"] == pytest.approx(0.5)
    # γ = 0.5, reward 1 at t = 2: G = [0.25, 0.5, 1]; baseline = mean score = 1
    (adv, ret), _ = get_advantage("reinforce")(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), torch.zeros(1), gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-0.75, -0.5, 0.0]]))
    with pytest.raises(ValueError, match="baseline"):
        get_advantage("reinforce")(rewards, mask, index, baseline="critic")


def test_reinforce_plus_plus_hand_values():
    # γ = 1: returns [[1, 1], [0, 0]]; over 4 tokens mean 0.5, unbiased var = 4 · 0.25 / 3 = 1/3
    # → A = ±0.5 / sqrt(1/3) = ±0.866025
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    (adv, ret), _ = get_advantage("reinforce_plus_plus")(rewards, torch.ones(2, 2), torch.arange(2))
    a = 0.5 / math.sqrt(1 / 3 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[a, a], [-a, -a]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_returns_carry_across_a_masked_turn_gap():
    # multi-turn row: policy turn a0 a1 | environment tokens o2 o3 (mask 0) | policy turn a4 a5,
    # outcome reward 1 on the last policy token (t = 5), γ = 0.5. Masked tokens are not steps:
    # G5 = 1, G4 = 0.5 · 1 = 0.5, o3 and o2 pass 0.5 on undiscounted, G1 = 0.5 · 0.5 = 0.25,
    # G0 = 0.125 → returns [0.125, 0.25, 0, 0, 0.5, 1] (a reset at the gap gave the first turn 0)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    (adv, ret), _ = get_advantage("reinforce")(rewards, mask, torch.zeros(1), gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]))
    # batch baseline b = mean score = 1: A = G − b on the policy tokens
    torch.testing.assert_close(adv, torch.tensor([[-0.875, -0.75, 0.0, 0.0, -0.5, 0.0]]))
    # REINFORCE++: whiten [0.125, 0.25, 0.5, 1] over the 4 policy tokens: mean 0.46875,
    # unbiased var = 0.44921875 / 3 = 0.149740 → A = (G − 0.46875) / 0.386962
    (adv, ret), _ = get_advantage("reinforce_plus_plus")(rewards, mask, torch.zeros(1), gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-0.888330, -0.565301, 0.0, 0.0, 0.080757, 1.372874]]),
                               atol=1e-5, rtol=0)
    # γ = 1: both turns get the outcome; a reward on an environment token (7 on o3) is not counted
    for r in (rewards, torch.tensor([[0.0, 0.0, 0.0, 7.0, 0.0, 1.0]])):
        (_, ret), _ = get_advantage("reinforce_plus_plus")(r, mask, torch.zeros(1), gamma=1.0)
        torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]))


def test_multi_turn_table_credits_the_first_turn():
    # the training stage's path: a rollout table with loss_mask → prepare_update → advantages.
    # Row 0: turn 1 (2 tokens) | 2 environment tokens | turn 2 (1 token), reward 1; row 1: same
    # layout, reward 0. γ = 1: returns [1, 1, 0, 0, 1] and [0, 0, 0, 0, 0]; whitened over the 6
    # policy tokens (mean 0.5, unbiased var 0.3): ±0.5 / 0.547723 = ±0.912871 on every policy token
    import pandas as pd

    from engines.algorithms.config import AlgorithmConfig
    from engines.training.rl_step import prepare_update
    from engines.data.rollout_table import batch_from_table

    df = pd.DataFrame({"group_id": ["a", "b"], "prompt_token_ids": [[5, 6], [5, 7]],
                       "response_token_ids": [[1, 2, 3, 4, 5]] * 2, "loss_mask": [[1, 1, 0, 0, 1]] * 2,
                       "reward": [1.0, 0.0], "finish_reason": ["stop", "stop"]})
    batch = batch_from_table(df, pad_id=0)
    u = prepare_update(batch, AlgorithmConfig(advantage="reinforce_plus_plus", gamma=1.0, kl_coef=0.0))
    torch.testing.assert_close(u.returns, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [0.0] * 5]))
    a = 0.5 / math.sqrt(0.3 + 1e-8)
    torch.testing.assert_close(u.advantages, torch.tensor([[a, a, 0.0, 0.0, a], [-a, -a, 0.0, 0.0, -a]]))


def test_reinforce_plus_plus_baseline_hand_values():
    # group 0 [1, 0] → centred [0.5, −0.5]; group 1 [1, 1] → [0, 0]
    # whiten over 4 tokens: mean 0, var = (0.25 + 0.25) / 3 = 1/6 → A = [1.224745, −1.224745, 0, 0]
    rewards = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    (adv, _), _ = get_advantage("reinforce_plus_plus_baseline")(rewards, torch.ones(4, 1), torch.tensor([0, 0, 1, 1]))
    a = 0.5 / math.sqrt(1 / 6 + 1e-8)
    torch.testing.assert_close(adv[:, 0], torch.tensor([a, -a, 0.0, 0.0]))


def test_gae_hand_values():
    rewards, values, mask = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.8]]), torch.ones(1, 2)
    gae = get_advantage("gae")
    # γ = λ = 1: δ1 = 1 + 0 − 0.8 = 0.2, A1 = 0.2; δ0 = 0 + 0.8 − 0.5 = 0.3, A0 = 0.5; R = A + V = [1, 1]
    (adv, ret), _ = gae(rewards, mask, torch.zeros(1), values=values, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0]]))
    # γ = 0.9, λ = 0.5: δ0 = 0.9 · 0.8 − 0.5 = 0.22, A0 = 0.22 + 0.45 · 0.2 = 0.31; R0 = 0.81
    (adv, ret), _ = gae(rewards, mask, torch.zeros(1), values=values, gamma=0.9, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.81, 1.0]]))
    # a masked (environment) token in the middle is skipped: same numbers as above, 0 on it
    (adv, ret), _ = gae(torch.tensor([[0.0, 7.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0]]), torch.zeros(1),
                        values=torch.tensor([[0.5, 99.0, 0.8]]), whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.2]]))
    # whitened over the 2 valid tokens: mean 0.35, var = 2 · 0.0225 / 1 → A = ±0.15 / 0.212132 = ±0.707107
    (adv, _), _ = gae(rewards, mask, torch.zeros(1), values=values)
    torch.testing.assert_close(adv, torch.tensor([[0.707107, -0.707107]]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="values"):
        gae(rewards, mask, torch.zeros(1))


# --- loop references --------------------------------------------------------------------------
def _random_case(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(2, 12, (1,), generator=g))
    T = int(torch.randint(1, 9, (1,), generator=g))
    index = torch.randint(0, max(1, B // 2), (B,), generator=g) * 10 + 3    # uneven, non-contiguous ids
    mask = (torch.rand(B, T, generator=g) > 0.3).float()                    # holes, like multi-turn masks
    mask[:, 0] = 1.0
    rewards = torch.randn(B, T, generator=g) * mask
    values = torch.randn(B, T, generator=g)
    return rewards, mask, index, values


def _scores(rewards):
    return [float(sum(row)) for row in rewards.tolist()]


def _group_members(index):
    ids = index.tolist()
    return [[j for j in range(len(ids)) if ids[j] == ids[i]] for i in range(len(ids))]


def _broadcast(per_sample, mask):
    return torch.tensor([[a * m for m in row] for a, row in zip(per_sample, mask.tolist())])


def _whiten_loop(mat, mask):
    vals = [v for row, mrow in zip(mat, mask.tolist()) for v, m in zip(row, mrow) if m]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) * m for v, m in zip(row, mrow)] for row, mrow in zip(mat, mask.tolist())]


def _returns_loop(rewards, mask, gamma):
    # G_t = Σ_{k ≥ t, k unmasked} γ^{n(t,k)} r_k, n(t,k) = unmasked tokens in [t, k), on unmasked t
    out = []
    for r_row, m_row in zip(rewards.tolist(), mask.tolist()):
        valid = [t for t, m in enumerate(m_row) if m]
        row = [0.0] * len(r_row)
        for i, t in enumerate(valid):
            row[t] = sum(gamma ** (j - i) * r_row[k] for j, k in enumerate(valid) if j >= i)
        out.append(row)
    return out


def grpo_loop(rewards, mask, index, norm_by_std=True, eps=1e-6):
    s = _scores(rewards)
    adv = []
    for i, members in enumerate(_group_members(index)):
        if len(members) == 1:
            adv.append(0.0)
            continue
        group = [s[j] for j in members]
        centred = s[i] - statistics.mean(group)
        adv.append(centred / (statistics.stdev(group) + eps) if norm_by_std else centred)
    return _broadcast(adv, mask)


def rloo_loop(rewards, mask, index):
    s = _scores(rewards)
    adv = []
    for i, members in enumerate(_group_members(index)):
        others = [s[j] for j in members if j != i]
        adv.append(s[i] - sum(others) / len(others) if others else 0.0)
    return _broadcast(adv, mask)


def rpp_baseline_loop(rewards, mask, index):
    s = _scores(rewards)
    centred = [s[i] - statistics.mean([s[j] for j in members]) for i, members in enumerate(_group_members(index))]
    return torch.tensor(_whiten_loop(_broadcast(centred, mask).tolist(), mask))


def rpp_loop(rewards, mask, gamma):
    return torch.tensor(_whiten_loop(_returns_loop(rewards, mask, gamma), mask))


def reinforce_loop(rewards, mask, gamma):
    b = statistics.mean(_scores(rewards))
    returns = _returns_loop(rewards, mask, gamma)
    return torch.tensor([[(g - b) * m for g, m in zip(row, mrow)] for row, mrow in zip(returns, mask.tolist())])


def gae_loop(rewards, mask, values, gamma, lam):
    adv_rows = []
    for r_row, m_row, v_row in zip(rewards.tolist(), mask.tolist(), values.tolist()):
        valid = [t for t, m in enumerate(m_row) if m]
        row, a_next, v_next = [0.0] * len(r_row), 0.0, 0.0
        for t in reversed(valid):
            a_next = r_row[t] + gamma * v_next - v_row[t] + gamma * lam * a_next
            v_next = v_row[t]
            row[t] = a_next
        adv_rows.append(row)
    return torch.tensor(_whiten_loop(adv_rows, mask))


@pytest.mark.parametrize("seed", range(8))
def test_estimators_match_loop_reference(seed):
    rewards, mask, index, values = _random_case(seed)
    gamma, lam = (1.0, 1.0) if seed % 2 else (0.9, 0.8)
    atol = dict(atol=1e-4, rtol=1e-4)
    run = lambda name, **kw: get_advantage(name)(rewards, mask, index, gamma=gamma, lam=lam, **kw)[0][0]
    torch.testing.assert_close(run("grpo"), grpo_loop(rewards, mask, index), **atol)
    torch.testing.assert_close(run("grpo", norm_by_std=False), grpo_loop(rewards, mask, index, norm_by_std=False), **atol)
    torch.testing.assert_close(run("rloo"), rloo_loop(rewards, mask, index), **atol)
    torch.testing.assert_close(run("reinforce"), reinforce_loop(rewards, mask, gamma), **atol)
    torch.testing.assert_close(run("reinforce_plus_plus"), rpp_loop(rewards, mask, gamma), **atol)
    torch.testing.assert_close(run("reinforce_plus_plus_baseline"), rpp_baseline_loop(rewards, mask, index), **atol)
    torch.testing.assert_close(run("gae", values=values), gae_loop(rewards, mask, values, gamma, lam), **atol)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"])
def test_estimators_zero_on_masked_tokens_and_no_grad(name):
    rewards, mask, index, values = _random_case(11)
    rewards.requires_grad_(True)
    (adv, ret), metrics = get_advantage(name)(rewards, mask, index, values=values)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    assert not adv.requires_grad and all(isinstance(v, float) for v in metrics.values())


def test_group_baseline_declarations_match_the_estimators():
    """GROUP_BASELINE (registry; the config refuses its members with G = 1) holds exactly the
    estimators whose advantages are all 0 when every group has one sample. gigpo needs step inputs:
    its episode-level term is grpo's."""
    from engines.algorithms.registry import ADVANTAGES, GROUP_BASELINE

    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.5]])   # [B=4, T=2]
    mask = torch.ones(4, 2)
    index = torch.arange(4)                                                     # G = 1: four groups of one
    values = torch.tensor([[0.1, 0.2], [0.3, 0.1], [0.0, 0.4], [0.2, 0.2]])
    logps = {"old_logprobs": torch.tensor([[-1.0, -2.0]] * 4), "ref_logprobs": torch.tensor([[-0.5, -1.0]] * 4)}
    for name in sorted(set(ADVANTAGES) - {"gigpo"}):
        fn = get_advantage(name)   # on_policy_distill scores tokens by the teacher's log-probs, not by the group
        extra = {k: v for k, v in logps.items() if k in inspect.signature(fn).parameters}
        (adv, _), _ = fn(rewards, mask, index, values=values, **extra)
        assert bool((adv == 0).all()) == (name in GROUP_BASELINE), name
    assert "gigpo" in GROUP_BASELINE

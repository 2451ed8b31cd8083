"""Reward normalisation and clipping, advantage whitening/clipping, masks, overlong penalty,
dynamic-sampling filter, and their wiring through the config bridge."""

import math
import statistics

import pytest
import torch
from pydantic import ValidationError

from engines.algorithms.kl import AdaptiveKLController
from engines.algorithms.normalize import RunningStats, masked_whiten, normalize_rewards
from engines.algorithms.objective import actor_loss, compute_advantages, critic_loss, make_kl_controller, select_groups, shape_rewards
from engines.algorithms.shaping import difficulty_mask, filter_groups, mask_truncated, overlong_penalty, scores_to_token_rewards, truncated_from_finish_reason
from engines.algorithms.config import AlgorithmConfig
from engines.algorithms.normalize import clip_advantages, clip_rewards, update_running_stats


# --- normalisation ----------------------------------------------------------------------------
def test_normalize_rewards_batch_and_group():
    scores, index = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0]), torch.tensor([0, 0, 1, 1, 2])
    (out, state), _ = normalize_rewards(scores[:4], index[:4], "batch")
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 → ±0.866024
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.5 / (math.sqrt(1 / 3) + 1e-6))
    assert state is None
    (out, _), _ = normalize_rewards(scores, index, "group")
    # per pair: mean 0.5, std sqrt(0.5) = 0.707107 → ±0.707106; solo group → 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out, torch.tensor([a, -a, a, -a, 0.0]))
    (out, _), _ = normalize_rewards(scores, index, "none")
    torch.testing.assert_close(out, scores)
    with pytest.raises(ValueError, match="reward normalisation"):
        normalize_rewards(scores, index, "z")


def test_normalize_rewards_running_state_in_and_out():
    # batch 1 = [1, 3]: count 2, mean 2, m2 2 → std sqrt(2) → [−0.707107, 0.707107]
    (out, state), m = normalize_rewards(torch.tensor([1.0, 3.0]), torch.arange(2), "running")
    assert state == pytest.approx(RunningStats(2.0, 2.0, 2.0))
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 1e-6))
    # batch 2 = [5]: all seen [1, 3, 5] → mean 3, unbiased var 4 → (5 − 3)/2 = 1
    (out, state), m = normalize_rewards(torch.tensor([5.0]), torch.arange(1), "running", running=state)
    assert (state.count, state.mean, state.std) == pytest.approx((3.0, 3.0, 2.0))
    assert out.item() == pytest.approx(1.0, abs=1e-5) and m["reward/running_mean"] == pytest.approx(3.0)


@pytest.mark.parametrize("seed", range(4))
def test_running_stats_match_whole_data_loop(seed):
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(int(torch.randint(1, 6, (1,), generator=g)), generator=g) for _ in range(5)]
    state = RunningStats()
    for b in batches:
        state = update_running_stats(state, b)
    everything = [v for b in batches for v in b.tolist()]
    assert state.mean == pytest.approx(statistics.mean(everything), abs=1e-9)
    assert state.std == pytest.approx(statistics.stdev(everything), abs=1e-9)


def test_clip_rewards_and_advantages():
    out, m = clip_rewards(torch.tensor([-3.0, 0.5, 2.0]), 1.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.5, 1.0]))
    assert m["reward/clip_frac"] == pytest.approx(2 / 3)
    adv, m = clip_advantages(torch.tensor([[3.0, -0.5, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]), 2.0)
    torch.testing.assert_close(adv, torch.tensor([[2.0, -0.5, 0.0]]))
    assert m["advantage/clip_frac"] == 0.5


def test_masked_whiten_hand_values():
    # valid [1, 3] (9 is masked): mean 2, unbiased var 2 → [−0.707107, 0.707107]
    x, mask = torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    out = masked_whiten(x, mask)
    torch.testing.assert_close(out[0, :2], torch.tensor([-0.707107, 0.707107]), atol=1e-5, rtol=0)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False)[0, :2], torch.tensor([1.292893, 2.707107]),
                               atol=1e-5, rtol=0)


# --- masks and shaping ------------------------------------------------------------------------
def test_scores_to_token_rewards_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = scores_to_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]))


def test_truncation_mask():
    truncated = truncated_from_finish_reason(["stop", "length", "stop"])
    assert truncated.tolist() == [False, True, False]
    mask, m = mask_truncated(torch.ones(3, 2), truncated)
    torch.testing.assert_close(mask, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
    assert m["mask/truncated_frac"] == pytest.approx(1 / 3)


def test_difficulty_mask():
    # pass rates: group 0 = 0/2, group 1 = 1/2, group 2 = 2/2; keep [0.1, 0.9] → group 1 only
    scores, index = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    keep, m = difficulty_mask(scores, index, low=0.1, high=0.9)
    assert keep.tolist() == [False, False, True, True, False, False]
    assert m["mask/difficulty_kept_frac"] == pytest.approx(1 / 3)
    keep, _ = difficulty_mask(scores, index, low=0.0, high=1.0)        # inclusive bounds keep all
    assert keep.all()


def test_overlong_penalty_hand_values():
    # L_max = 10, buffer 4 → soft zone (6, 10]: penalty (6 − L)/4; −1 beyond 10
    lengths = torch.tensor([5, 6, 8, 10, 12])
    pen, m = overlong_penalty(lengths, max_len=10, buffer_len=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    pen, _ = overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]))
    assert m["reward/overlong_penalized_frac"] == pytest.approx(0.6)


def test_filter_groups_hand_values():
    # g0 [1, 1] equal → drop; g1 [0, 1] keep; g2 [0.1, 0.1] equal → drop; g3 solo → drop
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.1, 0.1, 3.0])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep, m = filter_groups(rewards, index)
    assert keep.tolist() == [False, False, True, True, False, False, False]
    assert (m["dynamic_sampling/groups"], m["dynamic_sampling/kept_groups"]) == (4.0, 1.0)


@pytest.mark.parametrize("seed", range(6))
def test_filter_groups_and_difficulty_match_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 16, (1,), generator=g))
    index = torch.randint(0, 5, (B,), generator=g)
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    ids = index.tolist()
    members = [[rewards[j].item() for j in range(B) if ids[j] == ids[i]] for i in range(B)]
    keep_loop = [len(set(m)) > 1 for m in members]
    assert filter_groups(rewards, index)[0].tolist() == keep_loop
    keep_loop = [0.25 <= sum(m) / len(m) <= 0.75 for m in members]
    assert difficulty_mask(rewards, index, low=0.25, high=0.75)[0].tolist() == keep_loop


# --- config wiring ----------------------------------------------------------------------------
def test_config_cross_field_checks():
    with pytest.raises(ValidationError, match="difficulty_low"):
        AlgorithmConfig(difficulty_low=0.8, difficulty_high=0.2)
    with pytest.raises(ValidationError, match="overlong_max_len"):
        AlgorithmConfig(overlong_buffer_len=4)
    with pytest.raises(ValidationError, match="clip_ratio_c"):
        AlgorithmConfig(clip_ratio_c=1.0)
    AlgorithmConfig(overlong_buffer_len=4, overlong_max_len=10)


def test_shape_rewards_defaults_only_place_scores():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards, out_mask, stats, _ = shape_rewards(AlgorithmConfig(), torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0]))
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out_mask, mask)
    assert stats is None


def test_shape_rewards_all_options():
    cfg = AlgorithmConfig(overlong_buffer_len=2, overlong_max_len=4, reward_clip=1.0, reward_norm="running",
                          mask_truncated=True, difficulty_low=0.1, difficulty_high=0.9)
    # lengths [4, 3, 1, 1]: penalties (2 − L)/2 = [−1, −0.5, 0, 0]; group 1 pass rate 1 → masked
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    scores, index = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    truncated = torch.tensor([True, False, False, False])
    rewards, out_mask, stats, m = shape_rewards(cfg, scores, mask, index, truncated=truncated)
    # penalised [0, −0.5, 1, 1], clip ±1 no change, running over them: mean 0.375, std 0.75
    expected = (torch.tensor([0.0, -0.5, 1.0, 1.0]) - 0.375) / (0.75 + 1e-6)
    torch.testing.assert_close(rewards[[0, 1, 2, 3], [3, 2, 0, 0]], expected)
    assert stats.count == 4.0
    torch.testing.assert_close(out_mask.sum(-1), torch.tensor([0.0, 3.0, 0.0, 0.0]))  # truncated, difficulty
    with pytest.raises(ValueError, match="truncated"):
        shape_rewards(cfg, scores, mask, index)


def test_compute_advantages_whiten_clip_and_ema_wiring():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0]])
    mask, index = torch.ones(3, 2), torch.arange(3)
    cfg = AlgorithmConfig(advantage="reinforce", reinforce_baseline="ema", reinforce_ema_decay=0.5,
                          whiten_advantages=True, adv_clip=1.0)
    adv, ret, m = compute_advantages(cfg, rewards, mask, index, ema_baseline=0.0)
    # batch mean 4/3; new EMA = 0.5 · 0 + 0.5 · 4/3 = 2/3; advantages whitened then clipped to ±1
    assert m["advantage/ema_baseline"] == pytest.approx(2 / 3)
    assert adv.abs().max() <= 1.0 and m["advantage/clip_frac"] > 0
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0], [3.0, 3.0]]))
    with pytest.raises(ValueError, match="values"):
        compute_advantages(AlgorithmConfig(advantage="gae"), rewards, mask, index)


def test_actor_loss_tis_kl_and_critic_loss_wiring():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    logp, adv, mask = old.clone().requires_grad_(True), torch.ones(1, 2), torch.ones(1, 2)
    rollout = torch.log(torch.tensor([[0.25, 0.5]]))
    # TIS off by default even when rollout log-probs are passed
    loss, m = actor_loss(AlgorithmConfig(use_kl_loss=False), logp, old, None, adv, mask, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-1.0) and "actor/tis_weight_mean" not in m
    loss, m = actor_loss(AlgorithmConfig(use_kl_loss=False, tis_cap=1.5), logp, old, None, adv, mask,
                         rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-1.25)                          # weights [1.5, 1]
    # k1 KL loss, β = 0.5 (kl_coef override): log π = ln[.5, .5], log π_ref = ln[.25, .75]
    # → k1 = [ln 2, ln(2/3)] = [0.693147, −0.405465], token-mean 0.143841
    ref = torch.tensor([[0.25, 0.75]]).log()
    cfg = AlgorithmConfig(kl_estimator="k1")
    loss, m = actor_loss(cfg, logp, old, ref, adv, mask, kl_coef=0.5)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * 0.143841, abs=1e-6) and m["actor/kl_coef"] == 0.5
    assert "actor/kl_loss" not in actor_loss(cfg, logp, old, None, adv, mask)[1]     # no reference: no KL term
    vloss, m = critic_loss(AlgorithmConfig(advantage="gae"), torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2),
                           torch.tensor([[0.8, 1.0]]), mask)
    assert vloss.item() == pytest.approx(0.2725)                        # see test_value_loss_hand_values


def test_select_groups_and_kl_controller_from_config():
    rewards, index = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    assert select_groups(AlgorithmConfig(), rewards, index)[0].all()
    assert select_groups(AlgorithmConfig(filter_groups=True), rewards, index)[0].tolist() == [False, False, True, True]
    ctrl = make_kl_controller(AlgorithmConfig(kl_ctrl="adaptive", kl_coef=0.1, kl_target=0.1, kl_horizon=1000))
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(0.15, 100)
    assert ctrl.value == pytest.approx(0.102)
    assert make_kl_controller(AlgorithmConfig()).value == 0.001

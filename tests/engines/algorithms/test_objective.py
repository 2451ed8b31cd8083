"""Core of the algorithm library: registry, aggregation, grpo, ppo_clip, k1/k2/k3, config and
the objective bridge. Expected values are worked by hand in the comments."""

import math

import pytest
import torch
from pydantic import ValidationError

from engines.algorithms.registry import ADVANTAGES, get_advantage, get_kl, get_policy_loss, register_advantage
from engines.algorithms.objective import actor_loss, apply_kl_penalty, compute_advantages
from engines.algorithms.aggregate import agg_loss, global_counts
from engines.algorithms.config import AlgorithmConfig

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# --- registry ---------------------------------------------------------------------------------
def test_unknown_name_lists_known_names():
    with pytest.raises(KeyError, match="unknown advantage estimator 'gpro'.*'grpo'"):
        get_advantage("gpro")
    with pytest.raises(KeyError, match="ppo_clip"):
        get_policy_loss("ppo")
    with pytest.raises(KeyError, match="k3"):
        get_kl("k4")


def test_register_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda *a, **k: None)
    assert ADVANTAGES["grpo"].__name__ == "grpo"


# --- aggregation ------------------------------------------------------------------------------
def _agg_example():
    # row 0: 3 valid tokens [1, 2, 3]; row 1: 1 valid token [4], then garbage behind the mask
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    return loss, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 2.5),               # (1+2+3+4) / 4 tokens
        ("seq-mean-token-sum", 5.0),       # (6 + 4) / 2 seqs
        ("seq-mean-token-mean", 3.0),      # (6/3 + 4/1) / 2
        ("seq-mean-token-sum-norm", 10 / 6),  # (6/3 + 4/3) / 2, divisor T = 3
    ],
)
def test_agg_loss_hand_values(mode, expected):
    loss, mask = _agg_example()
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected)


def test_agg_loss_norm_uses_loss_scale_factor_and_global_counts():
    loss, mask = _agg_example()
    # (6/5 + 4/5) / 2 = 1.0
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=5).item() == pytest.approx(1.0)
    # global counts replace the local ones: 10 / 8 tokens, 10 / 4 seqs
    assert agg_loss(loss, mask, "token-mean", num_tokens=8).item() == pytest.approx(1.25)
    assert agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss, mask, "token-sum")


def test_global_counts_skip_empty_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert global_counts(mask) == (3.0, 2.0)


def _random_batch(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)            # some rows may be empty
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).float()
    return loss, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agg_loss_micro_batch_invariance(mode, seed):
    loss, mask = _random_batch(seed)
    full = agg_loss(loss, mask, mode, loss_scale_factor=7)
    n_tok, n_seq = global_counts(mask)
    for micro in (1, 2, 3):
        parts = [
            agg_loss(loss[i:i + micro], mask[i:i + micro], mode, num_tokens=n_tok, num_seqs=n_seq,
                     loss_scale_factor=7)
            for i in range(0, loss.shape[0], micro)
        ]
        assert torch.stack(parts).sum().item() == pytest.approx(full.item(), abs=1e-6)


def test_agg_loss_masked_tokens_get_zero_gradient():
    loss, mask = _agg_example()
    loss.requires_grad_(True)
    for mode in MODES:
        loss.grad = None
        agg_loss(loss, mask, mode).backward()
        assert torch.all(loss.grad[mask == 0] == 0)
        assert torch.all(loss.grad[mask == 1] != 0)


# --- grpo -------------------------------------------------------------------------------------
def _grpo_example():
    # group 7: scores [1, 0, 1, 0] on the last valid token; group 3: a single sample (score 1)
    rewards = torch.zeros(5, 3)
    rewards[0, 2] = 1.0
    rewards[2, 1] = 1.0
    rewards[4, 0] = 1.0
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    index = torch.tensor([7, 7, 7, 7, 3])
    return rewards, mask, index


def test_grpo_hand_values():
    rewards, mask, index = _grpo_example()
    (adv, ret), metrics = get_advantage("grpo")(rewards, mask, index)
    # mean 0.5; unbiased std = sqrt(4 · 0.25 / 3) = 0.57735; A = ±0.5 / (0.57735 + 1e-6) = ±0.866024
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([[a, a, a], [-a, -a, 0], [a, a, 0], [-a, -a, -a], [0, 0, 0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)
    assert metrics["advantage/frac_zero_std_samples"] == pytest.approx(0.2)   # the solo sample


def test_dr_grpo_does_not_divide_by_std():
    rewards, mask, index = _grpo_example()
    (adv, _), _ = get_advantage("grpo")(rewards, mask, index, norm_by_std=False)
    # A = s − mean = ±0.5; the group of size 1 gets 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0]))


# --- ppo_clip ---------------------------------------------------------------------------------
def _ppo_example():
    # one token per row: (A, ratio) = (1, 1.5), (−1, 0.5), (1, 1.0), (−1, 1.1)
    ratio = torch.tensor([[1.5], [0.5], [1.0], [1.1]])
    old = torch.full((4, 1), -1.0)
    logp = (old + ratio.log()).requires_grad_(True)
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    mask = torch.ones(4, 1)
    return logp, old, adv, mask


def test_ppo_clip_hand_values():
    logp, old, adv, mask = _ppo_example()
    loss, m = get_policy_loss("ppo_clip")(logp, old, adv, mask, loss_agg_mode="token-mean")
    # per token max(−A·r, −A·clip(r, 0.8, 1.2)):
    #   (1, 1.5):  max(−1.5, −1.2) = −1.2  clipped
    #   (−1, 0.5): max( 0.5,  0.8) =  0.8  clipped
    #   (1, 1.0):  −1.0;   (−1, 1.1): 1.1 (inside the range)
    # token-mean = (−1.2 + 0.8 − 1.0 + 1.1) / 4 = −0.075
    assert loss.item() == pytest.approx(-0.075, abs=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    # ppo_kl = mean(old − logp) = −(ln 1.5 + ln 0.5 + 0 + ln 1.1) / 4 = 0.048093
    assert m["actor/ppo_kl"] == pytest.approx(0.048093, abs=1e-5)
    loss.backward()
    # d/dlogp of −A·r = −A·r on the unclipped tokens; 0 on clipped ones; / 4 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [0.0], [-0.25], [0.275]]))


def test_ppo_clip_higher_and_dual_clip():
    logp, old, adv, mask = _ppo_example()
    # clip-higher ε_high = 0.6: row 0 becomes max(−1.5, −1.5) = −1.5, unclipped
    loss, m = get_policy_loss("ppo_clip")(logp, old, adv, mask, loss_agg_mode="token-mean",
                                          clip_ratio_high=0.6)
    assert loss.item() == pytest.approx((-1.5 + 0.8 - 1.0 + 1.1) / 4, abs=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.25)
    # dual clip c = 3: A = −1, r = 5 → max(5, 1.2) = 5, capped at −A·c = 3
    old1, adv1, mask1 = torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1)
    logp1 = torch.tensor([[math.log(5.0)]], requires_grad=True)
    loss, m = get_policy_loss("ppo_clip")(logp1, old1, adv1, mask1, loss_agg_mode="token-mean", clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert m["actor/pg_clipfrac_lower"] == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("ppo_clip")(logp1, old1, adv1, mask1, loss_agg_mode="token-mean", clip_ratio_c=0.5)


# --- KL ---------------------------------------------------------------------------------------
def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    x = math.log(2.0)  # log π − log π_ref = 0.693147
    assert get_kl("k1")(logp, ref).item() == pytest.approx(x)                  # 0.693147
    assert get_kl("abs")(ref, logp).item() == pytest.approx(x)                 # |−x|
    assert get_kl("k2")(logp, ref).item() == pytest.approx(0.5 * x * x)        # 0.240227
    assert get_kl("k3")(logp, ref).item() == pytest.approx(0.5 - 1 + x)        # e^{−x} − 1 + x = 0.193147


# --- config -----------------------------------------------------------------------------------
def test_config_defaults_and_name_validation():
    cfg = AlgorithmConfig()
    assert (cfg.advantage, cfg.policy_loss, cfg.kl_estimator, cfg.loss_agg_mode) == ("grpo", "ppo_clip", "k3", "token-mean")
    with pytest.raises(ValidationError, match=r"algorithm.policy_loss = 'ppo'.*allowed: \['cispo', 'gspo', 'ppo_clip'\]"):
        AlgorithmConfig(policy_loss="ppo")
    with pytest.raises(ValidationError, match="kl_estimator"):
        AlgorithmConfig(kl_estimator="k4")
    with pytest.raises(ValidationError, match="kl_coef"):
        AlgorithmConfig(kl_coef=-0.1)
    with pytest.raises(ValidationError, match="ppo_epochs"):
        AlgorithmConfig(ppo_epochs=0)
    with pytest.raises(ValidationError, match="loss_agg_mode"):
        AlgorithmConfig(loss_agg_mode="token-sum")
    with pytest.raises(ValidationError, match="extra_forbidden"):
        AlgorithmConfig(clip_ratio=0.2)


def test_every_field_is_documented():
    for name, field in AlgorithmConfig.model_fields.items():
        assert field.description and len(field.description) > 40, name


# --- objective bridge -------------------------------------------------------------------------
def test_compute_advantages_uses_config():
    rewards, mask, index = _grpo_example()
    adv, ret, m = compute_advantages(AlgorithmConfig(norm_adv_by_std=False), rewards, mask, index)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0]))
    assert m["advantage/mean"] == pytest.approx(0.0, abs=1e-6)


def test_actor_loss_combines_pg_kl_and_entropy():
    logp, old, adv, mask = _ppo_example()
    ref = logp.detach() - math.log(2.0)          # log π − log π_ref = ln 2 on every token
    entropy = torch.full((4, 1), 2.0)
    cfg = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, m = actor_loss(cfg, logp, old, ref, adv, mask, entropy=entropy)
    # −0.075 + 0.1 · k3(ln 2) − 0.01 · 2 = −0.075 + 0.0193147 − 0.02 = −0.0756853
    assert loss.item() == pytest.approx(-0.0756853, abs=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(-0.075, abs=1e-6)
    assert m["actor/kl_loss"] == pytest.approx(0.193147, abs=1e-6)
    assert m["actor/entropy"] == pytest.approx(2.0)
    assert {"actor/pg_clipfrac", "actor/ppo_kl"} <= set(m)
    assert all(isinstance(v, float) for v in m.values())
    # use_kl_loss=False: no KL term in the loss
    loss, m = actor_loss(AlgorithmConfig(use_kl_loss=False), logp, old, ref, adv, mask)
    assert loss.item() == pytest.approx(-0.075, abs=1e-6) and "actor/kl_loss" not in m


def test_apply_kl_penalty_subtracts_beta_kl_per_token():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5], [0.25, 0.25]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    cfg = AlgorithmConfig(use_kl_loss=False, kl_estimator="k1", kl_coef=0.5)
    out, m = apply_kl_penalty(cfg, rewards, logp, ref, mask)
    # k1 = ln 2 where ref = 0.25, 0 where ref = 0.5; masked token untouched
    ln2 = math.log(2.0)
    torch.testing.assert_close(out, torch.tensor([[-0.5 * ln2, 1.0], [-0.5 * ln2, 0.0]]))
    assert m["actor/reward_kl_penalty"] == pytest.approx(2 * ln2 / 3)        # mean over 3 tokens


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "cispo", "gspo"])
@pytest.mark.parametrize("mode", MODES)
def test_actor_loss_gradient_invariant_to_micro_batch_size(policy_loss, mode):
    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    _, mask = _random_batch(4, B, T)
    old = -torch.rand(B, T, generator=g) - 0.1
    base = old + 0.3 * torch.randn(B, T, generator=g)
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    ent = torch.rand(B, T, generator=g)
    cfg = AlgorithmConfig(policy_loss=policy_loss, loss_agg_mode=mode, loss_scale_factor=T,
                          entropy_coef=0.01, kl_coef=0.1, clip_ratio_c=3.0)

    def grad_and_loss(micro):
        logp = base.clone().requires_grad_(True)
        n_tok, n_seq = global_counts(mask)
        total = 0.0
        for i in range(0, B, micro):
            s = slice(i, i + micro)
            loss, _ = actor_loss(cfg, logp[s], old[s], ref[s], adv[s], mask[s], entropy=ent[s],
                                 num_tokens=n_tok, num_seqs=n_seq)
            loss.backward()
            total += loss.item()
        return total, logp.grad

    full_loss, full_grad = grad_and_loss(B)
    for micro in (1, 2, 4):
        loss, grad = grad_and_loss(micro)
        assert loss == pytest.approx(full_loss, abs=1e-5)
        torch.testing.assert_close(grad, full_grad)

"""The on_policy_distill advantage (engines/algorithms/advantages.py) against the recipe written out
independently (per-token k1 reverse KL, return-to-go over the unmasked tokens, optional centred
reward), through prepare_update, and a policy-gradient loop that must bring a sampled policy to its
teacher; plus the config's refusals and the run kind it is tagged with."""

from __future__ import annotations

import pytest
import torch

from configs.checks import check_kind, tagged_kind
from configs.schema import load_config
from engines.algorithms.config import AlgorithmConfig
from engines.algorithms.objective import compute_advantages
from engines.training.rl_step import prepare_update
from engines.training.rollout_batch import RolloutBatch


def _expected(old, ref, mask, gamma, scores=None, weight=0.0):
    """The recipe by hand: r_t = ref_t - old_t on unmasked tokens, A_t = r_t + gamma * A_next over the
    unmasked tokens that follow (masked ones pass the sum on), + weight * (score - batch mean)."""
    out = []
    mean = sum(scores) / len(scores) if scores else 0.0
    for i in range(len(old)):
        running, row = 0.0, [0.0] * len(old[i])
        for t in reversed(range(len(old[i]))):
            if mask[i][t]:
                running = (ref[i][t] - old[i][t]) + gamma * running
                row[t] = running + (weight * (scores[i] - mean) if scores else 0.0)
        out.append(row)
    return out


def _case():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g) * 3          # [B,T] log-probs
    ref = -torch.rand(3, 5, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)  # a gap in row 1
    return old, ref, mask


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_advantage_is_the_per_token_reverse_kl_summed_ahead(gamma):
    old, ref, mask = _case()
    cfg = AlgorithmConfig(advantage="on_policy_distill", gamma=gamma, kl_coef=0.0)
    adv, returns, m = compute_advantages(cfg, torch.zeros(3, 5), mask, torch.arange(3),
                                         extra={"old_logprobs": old, "ref_logprobs": ref})
    want = torch.tensor(_expected(old.tolist(), ref.tolist(), mask.tolist(), gamma))
    assert torch.allclose(adv, want, atol=1e-6) and torch.allclose(returns, want, atol=1e-6)
    kl = ((old - ref) * mask).sum() / mask.sum()
    assert m["distill/reverse_kl"] == pytest.approx(float(kl), abs=1e-6)


def test_reward_weight_adds_the_centred_task_reward_on_every_token():
    old, ref, mask = _case()
    rewards = torch.zeros(3, 5)
    rewards[0, 2], rewards[1, 3], rewards[2, 4] = 1.0, 0.0, 0.5          # on each row's last token
    cfg = AlgorithmConfig(advantage="on_policy_distill", gamma=0.0, kl_coef=0.0, distill_reward_weight=2.0)
    adv, _, _ = compute_advantages(cfg, rewards, mask, torch.arange(3), extra={"old_logprobs": old, "ref_logprobs": ref})
    want = _expected(old.tolist(), ref.tolist(), mask.tolist(), 0.0, scores=[1.0, 0.0, 0.5], weight=2.0)
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)


def test_without_the_teachers_logprobs_it_refuses():
    _, _, mask = _case()
    cfg = AlgorithmConfig(advantage="on_policy_distill", kl_coef=0.0)
    with pytest.raises(ValueError, match="old_logprobs and ref_logprobs"):
        compute_advantages(cfg, torch.zeros(3, 5), mask, torch.arange(3))


def test_prepare_update_feeds_the_reference_stage_logprobs():
    old, ref, mask = _case()
    B, P, T = 3, 2, 5
    batch = RolloutBatch(input_ids=torch.zeros(B, P + T, dtype=torch.long), attention_mask=torch.ones(B, P + T, dtype=torch.long),
                         position_ids=torch.arange(P + T).repeat(B, 1), responses=torch.zeros(B, T, dtype=torch.long),
                         response_mask=mask, response_lengths=mask.sum(-1).long(), scores=torch.tensor([1.0, 0.0, 1.0]),
                         group_index=torch.tensor([0, 0, 1]), truncated=torch.zeros(B, dtype=torch.bool),
                         ref_logprobs=ref, old_logprobs=old)
    cfg = AlgorithmConfig(advantage="on_policy_distill", gamma=1.0, kl_coef=0.0)
    update = prepare_update(batch, cfg)
    assert torch.allclose(update.advantages, torch.tensor(_expected(old.tolist(), ref.tolist(), mask.tolist(), 1.0)), atol=1e-6)
    assert "distill/reverse_kl" in update.metrics


def test_policy_gradient_on_it_brings_the_student_to_the_teacher():
    """A categorical student over 6 tokens, per-position (4 positions), sampled on-policy; REINFORCE with
    this advantage (γ = 0). The exact reverse KL to a fixed teacher must fall by 90%: a sign or
    alignment error makes it grow or stall."""
    torch.manual_seed(0)
    V, T, B = 6, 4, 256
    teacher = torch.log_softmax(torch.randn(T, V) * 2, -1)               # [T,V]
    logits = torch.zeros(T, V, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.05)
    cfg = AlgorithmConfig(advantage="on_policy_distill", gamma=0.0, kl_coef=0.0)

    def exact_kl():
        s = torch.log_softmax(logits.detach(), -1)
        return float((s.exp() * (s - teacher)).sum())

    start = exact_kl()
    for _ in range(300):
        student = torch.log_softmax(logits, -1)                          # [T,V]
        tokens = torch.multinomial(student.detach().exp(), B, replacement=True).T   # [B,T]
        logp = student.gather(1, tokens.T).T                             # [B,T]
        ref = teacher.gather(1, tokens.T).T
        mask = torch.ones(B, T)
        adv, _, _ = compute_advantages(cfg, torch.zeros(B, T), mask, torch.arange(B),
                                       extra={"old_logprobs": logp.detach(), "ref_logprobs": ref})
        loss = -(adv * logp).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert start > 0.5 and exact_kl() < 0.1 * start, (start, exact_kl())


def test_config_refusals_and_kind():
    with pytest.raises(ValueError, match="distill_reward_weight"):
        AlgorithmConfig(advantage="grpo", distill_reward_weight=0.5)
    with pytest.raises(ValueError, match="a second time"):
        AlgorithmConfig(advantage="on_policy_distill", use_kl_loss=False, kl_coef=0.1)
    assert AlgorithmConfig(advantage="on_policy_distill", kl_coef=0.0).reference_needed()
    assert not AlgorithmConfig(advantage="grpo", kl_coef=0.0).reference_needed()
    with pytest.raises(ValueError, match="model.reference_path to the teacher"):
        load_config(None, ["algorithm.advantage=on_policy_distill", "algorithm.kl_coef=0"])
    cfg = load_config(None, ["algorithm.advantage=on_policy_distill", "algorithm.kl_coef=0",
                             "model.reference_path=package:some-model"])
    check_kind(cfg, "on_policy_distill")
    check_kind(cfg, "rl")
    assert tagged_kind(cfg, "rl") == tagged_kind(cfg, "on_policy_distill") == "on_policy_distill"
    plain = load_config(None, [])
    assert tagged_kind(plain, "rl") == "rl"
    with pytest.raises(ValueError, match="distill_on_policy runs the RL loop"):
        check_kind(plain, "on_policy_distill")

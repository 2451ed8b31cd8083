"""GiGPO and trajectory-level (StarPO = grpo on the episode return) advantages: hand-worked values,
a loop reference, the table-column helper, and a run on manager episodes."""

from __future__ import annotations

import random

import pytest
import torch

from engines.algorithms.registry import get_advantage
from engines.algorithms.gigpo import gigpo, gigpo_step_tensors, step_returns
from engines.agentic.env_manager import run_episodes, token_rewards
from engines.generation.engine import Completion, SamplingParams
from engines.models.modeling import build_char_tokenizer

torch.set_num_threads(1)

# Four episodes, T = 6 tokens, K = 3 turns, γ = 0.5. Anchor states A=0, B=1, C=2.
#   E1 (group 0): states [A, B],    turn rewards [0, 1]    → return 1, step returns [0.5, 1]
#   E2 (group 0): states [A, C, B], turn rewards [0, 0, 1] → return 1, step returns [0.25, 0.5, 1]
#   E3 (group 0): states [A, C],    turn rewards [0, 0]    → return 0, step returns [0, 0]
#   E4 (group 7): states [A, A],    turn rewards [0, 1]    → return 1, step returns [0.5, 1]
TURN_INDEX = torch.tensor([[0, 0, -1, 1, -1, -1],
                           [0, -1, 1, -1, 2, -1],
                           [0, 0, -1, 1, 1, -1],
                           [0, -1, 1, 1, -1, -1]])
MASK = (TURN_INDEX >= 0).float()
TOKEN_REWARDS = torch.zeros(4, 6)
TOKEN_REWARDS[0, 3] = TOKEN_REWARDS[1, 4] = TOKEN_REWARDS[3, 3] = 1.0   # return on the last policy token
INDEX = torch.tensor([0, 0, 0, 7])
STEP_REWARDS = torch.tensor([[0.0, 1, 0], [0, 0, 1], [0, 0, 0], [0, 1, 0]])
STATES = torch.tensor([[0, 1, -1], [0, 2, 1], [0, 2, -1], [0, 0, -1]])


def per_token(turn_values: list[list[float]]) -> torch.Tensor:
    out = torch.zeros(4, 6)
    for b in range(4):
        for t in range(6):
            k = int(TURN_INDEX[b, t])
            if k >= 0:
                out[b, t] = turn_values[b][k]
    return out


def run(**kw):
    (adv, ret), metrics = gigpo(TOKEN_REWARDS, MASK, INDEX, gamma=0.5, turn_index=TURN_INDEX,
                                step_rewards=STEP_REWARDS, step_state_ids=STATES, **kw)
    return adv, ret, metrics


@pytest.mark.parametrize("norm", [True, False])
def test_algorithm_norm_adv_by_std_reaches_gigpo(norm):
    """`algorithm.norm_adv_by_std` is passed to gigpo by `compute_advantages`: false gives the
    hand-worked values without std below (a config that sets it is not ignored for gigpo)."""
    from engines.algorithms.config import AlgorithmConfig
    from engines.algorithms.objective import compute_advantages

    cfg = AlgorithmConfig(advantage="gigpo", gamma=0.5, norm_adv_by_std=norm)
    adv, _, _ = compute_advantages(cfg, TOKEN_REWARDS, MASK, INDEX, extra={
        "turn_index": TURN_INDEX, "step_rewards": STEP_REWARDS, "step_state_ids": STATES})
    assert torch.allclose(adv, run(norm_by_std=norm)[0], atol=1e-6)
    assert not torch.allclose(run(norm_by_std=True)[0], run(norm_by_std=False)[0], atol=1e-3)


def test_step_returns_discounted_per_turn():
    # E2: R_2 = 1, R_1 = 0 + 0.5·1 = 0.5, R_0 = 0 + 0.5·0.5 = 0.25
    assert torch.allclose(step_returns(STEP_REWARDS, STATES >= 0, 0.5),
                          torch.tensor([[0.5, 1, 0], [0.25, 0.5, 1], [0, 0, 0], [0.5, 1, 0]]))


def test_gigpo_hand_worked_without_std():
    # episode level, group 0 returns [1, 1, 0], mean 2/3 → A^E = [1/3, 1/3, −2/3]; E4 alone → 0
    # step groups: (0, A): returns [0.5, 0.25, 0] mean 0.25 → [0.25, 0, −0.25]
    #              (0, B): [1, 1] → [0, 0];  (0, C): [0.5, 0] mean 0.25 → [0.25, −0.25]
    #              (7, A): E4 visits A twice, [0.5, 1] mean 0.75 → [−0.25, 0.25]
    # A = A^E + 1·A^S per turn:
    expected = per_token([[1 / 3 + 0.25, 1 / 3],
                          [1 / 3, 1 / 3 + 0.25, 1 / 3],
                          [-2 / 3 - 0.25, -2 / 3 - 0.25],
                          [-0.25, 0.25]])
    adv, ret, metrics = run(norm_by_std=False)
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.equal(ret, adv)
    assert (adv[MASK == 0] == 0).all()                                 # environment tokens get nothing
    assert metrics["advantage/gigpo_step_grouped_frac"] == 1.0
    assert metrics["advantage/gigpo_step_group_size"] == pytest.approx(21 / 9)  # sizes 3,3,3,2,2,2,2,2,2


def test_gigpo_hand_worked_with_std_and_step_weight():
    # A^E: std([1,1,0]) = sqrt(1/3) = 0.57735 → [0.57735, 0.57735, −1.15470], E4 → 0
    # A^S: (0,A) std 0.25 → [1, 0, −1]; (0,B) flat → 0; (0,C) std 0.35355 → [0.70711, −0.70711];
    #      (7,A) std 0.35355 → [−0.70711, 0.70711]
    # ω = 0.5:
    e, s = 0.57735, 0.70711
    expected = per_token([[e + 0.5, e],
                          [e, e + 0.5 * s, e],
                          [-2 * e - 0.5, -2 * e - 0.5 * s],
                          [-0.5 * s, 0.5 * s]])
    adv, _, _ = run(norm_by_std=True, step_weight=0.5)
    assert torch.allclose(adv, expected, atol=1e-4)


def test_trajectory_level_is_grpo_on_the_episode_return():
    # StarPO: grpo with the loss mask; group 0 → ±: [0.57735, 0.57735, −1.15470] on policy tokens, E4 → 0
    (adv, _), _ = get_advantage("grpo")(TOKEN_REWARDS, MASK, INDEX)
    assert torch.allclose(adv, per_token([[0.57735] * 2, [0.57735] * 3, [-1.15470] * 2, [0.0] * 2]), atol=1e-4)
    adv_gigpo, _, _ = run(step_weight=0.0)                             # ω = 0 is the episode level alone
    assert torch.allclose(adv_gigpo, adv, atol=1e-6)


def test_gigpo_is_registered_and_asks_for_its_inputs():
    assert get_advantage("gigpo") is gigpo
    with pytest.raises(ValueError, match="turn_index"):
        gigpo(TOKEN_REWARDS, MASK, INDEX)


def loop_reference(token_rewards, mask, index, turn_index, step_rewards, states, gamma, omega):
    B, K = states.shape
    R = token_rewards.sum(-1).tolist()
    idx = index.tolist()
    def stats(xs):
        m = sum(xs) / len(xs)
        sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        return m, sd
    a_e = []
    for b in range(B):
        m, sd = stats([R[j] for j in range(B) if idx[j] == idx[b]])
        a_e.append((R[b] - m) / (sd + 1e-6))
    ret = [[0.0] * K for _ in range(B)]
    for b in range(B):
        run = 0.0
        for k in reversed(range(K)):
            if states[b, k] >= 0:
                run = float(step_rewards[b, k]) + gamma * run
                ret[b][k] = run
    a_s = [[0.0] * K for _ in range(B)]
    for b in range(B):
        for k in range(K):
            if states[b, k] < 0:
                continue
            xs = [ret[j][l] for j in range(B) for l in range(K) if idx[j] == idx[b] and states[j, l] == states[b, k]]
            m, sd = stats(xs)
            a_s[b][k] = (ret[b][k] - m) / (sd + 1e-6)
    out = torch.zeros_like(token_rewards)
    for b in range(B):
        for t in range(token_rewards.shape[1]):
            k = int(turn_index[b, t])
            if k >= 0 and mask[b, t] > 0:
                out[b, t] = a_e[b] + omega * a_s[b][k]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_gigpo_matches_a_loop_reference(seed):
    rng = random.Random(seed)
    B, K = rng.randint(2, 9), rng.randint(1, 5)
    index = torch.tensor([rng.randrange(3) for _ in range(B)])
    turns = [rng.randint(1, K) for _ in range(B)]
    states = torch.full((B, K), -1)
    step_rewards = torch.zeros(B, K)
    rows = []
    for b in range(B):
        for k in range(turns[b]):
            states[b, k] = rng.randrange(3)
            step_rewards[b, k] = rng.choice([0.0, -0.1, 1.0])
        row = []
        for k in range(turns[b]):
            row += [k] * rng.randint(1, 3) + [-1] * rng.randint(0, 2)
        rows.append(row)
    T = max(len(r) for r in rows)
    turn_index = torch.tensor([r + [-1] * (T - len(r)) for r in rows])
    mask = (turn_index >= 0).float()
    token_rewards = torch.randn(B, T) * mask
    (adv, _), _ = gigpo(token_rewards, mask, index, gamma=0.9, turn_index=turn_index, step_rewards=step_rewards,
                        step_state_ids=states, step_weight=0.7)
    ref = loop_reference(token_rewards, mask, index, turn_index, step_rewards, states, 0.9, 0.7)
    assert torch.allclose(adv, ref, atol=1e-4)


def test_step_tensors_from_table_columns():
    cols = gigpo_step_tensors(turn_index=[[0, 0, -1, 1], [0]], turn_rewards=[[0.0, 1.0], [-0.1]],
                              state_keys=[["0,0", "1,0"], ["0,0"]], width=5)
    assert cols["turn_index"].tolist() == [[0, 0, -1, 1, -1], [0, -1, -1, -1, -1]]
    assert cols["step_rewards"].tolist() == [[0.0, 1.0], [pytest.approx(-0.1), 0.0]]
    assert cols["step_state_ids"].tolist() == [[0, 1], [0, -1]]        # equal keys, equal ids
    with pytest.raises(ValueError, match="row 0"):
        gigpo_step_tensors([[0]], [[0.0, 1.0]], [["a"]])


class _Scripted:
    def __init__(self, tok, script):
        self.tok, self.script, self.turn = tok, script, 0

    def generate(self, prompts, params):
        text = self.script[self.turn]
        self.turn += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return [Completion(i, 0, ids, [-0.5] * len(ids), "stop", text) for i in range(len(prompts))]


def test_gigpo_on_manager_episodes():
    tok = build_char_tokenizer()
    eps = run_episodes(_Scripted(tok, ["down\n", "right\n", "up\n"]), tok, "frozenlake", [0, 1], group_size=2,
                       max_turns=3, max_context_tokens=500, sampling=SamplingParams(max_new_tokens=8))
    T = max(len(e.response_token_ids) for e in eps)
    cols = gigpo_step_tensors([e.turn_index for e in eps], [e.turn_rewards for e in eps], [e.state_keys for e in eps], T)
    rewards = torch.tensor([r + [0.0] * (T - len(r)) for r in (token_rewards(e) for e in eps)])
    mask = torch.tensor([m + [0] * (T - len(m)) for m in (e.loss_mask for e in eps)], dtype=torch.float32)
    index = torch.tensor([e.group_id for e in eps])
    (adv, _), metrics = gigpo(rewards, mask, index, gamma=0.95, **cols)
    assert adv.shape == (4, T) and (adv[mask == 0] == 0).all()
    assert metrics["advantage/gigpo_step_grouped_frac"] == 1.0         # identical scripts: every state shared in its group

"""The environment manager: token-in/token-out on multi-turn rollouts with a tiny random policy,
turn semantics with a scripted engine, truncation, a crashing environment, metrics, demonstrations."""

from __future__ import annotations

import pytest
import torch

from engines.models.batching import batched_logprobs, collate
from engines.agentic.env_manager import Episode, episode_metrics, run_episodes, solved_episodes, token_rewards
from engines.agentic.envs import ENVIRONMENTS, make_env
from engines.generation.engine import Completion, HFGenerationEngine, SamplingParams
from engines.models.modeling import build_char_tokenizer, build_tiny_policy
from tests.support.webshop import one_option_short

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy():
    model, tok = build_tiny_policy(hidden_size=32, num_layers=2, num_heads=2, max_positions=512, seed=0)
    return model.eval(), tok


class CountingEngine:
    def __init__(self, inner):
        self.inner, self.batch_sizes = inner, []

    def generate(self, prompt_token_ids, params):
        self.batch_sizes.append(len(prompt_token_ids))
        assert params.n == 1
        return self.inner.generate(prompt_token_ids, params)


class ScriptedEngine:
    """Turn k of every episode answers script[k] (token ids of the char tokenizer, logprob −0.5 each)."""

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.turn = tok, script, 0

    def generate(self, prompt_token_ids, params):
        text = self.script[self.turn]
        self.turn += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return [Completion(i, 0, list(ids), [-0.5] * len(ids), "stop", text) for i in range(len(prompt_token_ids))][::-1]


def segments(ep: Episode):
    """Maximal runs of equal loss_mask: [(mask, token ids)]."""
    out = []
    for t, m in zip(ep.response_token_ids, ep.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


@pytest.mark.parametrize("env_name,env_kwargs", [("frozenlake", {"size": 4}), ("tool_math", {})])
def test_token_in_token_out_invariant_with_a_tiny_random_policy(policy, env_name, env_kwargs):
    model, tok = policy
    engine = CountingEngine(HFGenerationEngine(model, tok))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, stop=("\n",), seed=0)
    seeds, G, max_turns = [0, 1], 2, 3
    eps = run_episodes(engine, tok, env_name, seeds, group_size=G, max_turns=max_turns,
                       max_context_tokens=400, sampling=sampling, env_kwargs=env_kwargs)
    assert [(e.seed, e.group_id, e.sample_id) for e in eps] == [(0, 0, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert engine.batch_sizes[0] == len(seeds) * G                  # one batched call per turn
    assert len(engine.batch_sizes) == max(e.turns for e in eps) and max(e.turns for e in eps) >= 2
    for ep in eps:
        n = len(ep.response_token_ids)
        assert len(ep.loss_mask) == len(ep.behaviour_logprobs) == len(ep.turn_index) == n
        assert 1 <= ep.turns <= max_turns and len(ep.state_keys) == len(ep.turn_rewards) == ep.turns
        assert len(ep.env_replies) in (ep.turns, ep.turns - 1)
        # decoded training sequence == the turns concatenated
        turns_text = "".join(a + (ep.env_replies[k] if k < len(ep.env_replies) else "") for k, a in enumerate(ep.actions))
        assert tok.decode(ep.prompt_token_ids + ep.response_token_ids, skip_special_tokens=True) == ep.prompt + turns_text
        assert ep.prompt_token_ids == tok(ep.prompt, add_special_tokens=False)["input_ids"]
        # the mask covers exactly the policy's tokens: runs alternate policy / env, in turn order
        runs = segments(ep)
        assert [m for m, _ in runs] == [1, 0] * len(ep.env_replies) + [1] * (ep.turns - len(ep.env_replies))
        for k, (m, ids) in enumerate(runs):
            if m == 1:
                assert tok.decode(ids, skip_special_tokens=True) == ep.actions[k // 2]
            else:
                assert ids == tok(ep.env_replies[k // 2], add_special_tokens=False)["input_ids"]
        assert all((ti >= 0) == bool(m) for ti, m in zip(ep.turn_index, ep.loss_mask))
        assert all(lp == 0.0 for lp, m in zip(ep.behaviour_logprobs, ep.loss_mask) if not m)
    # behaviour log-probs == a recomputation on the collated training sequences
    batch = collate([e.prompt_token_ids for e in eps], [e.response_token_ids for e in eps], tok.pad_token_id,
                    loss_masks=[e.loss_mask for e in eps])
    recomputed = batched_logprobs(model, batch)
    for i, ep in enumerate(eps):
        n = len(ep.response_token_ids)
        behaviour = torch.tensor(ep.behaviour_logprobs)
        assert torch.allclose(recomputed[i, :n], behaviour * batch.response_mask[i, :n], atol=1e-4)
        assert torch.equal(batch.response_mask[i, :n], torch.tensor(ep.loss_mask, dtype=torch.float32))


def test_scripted_turns_rewards_flags_and_layout():
    tok = build_char_tokenizer()
    env = make_env("frozenlake")
    env.reset(1)
    assert env.solve() == ["down", "down", "down", "right", "right", "right"]
    script = ["down\n", "jump\n", "down", "left\n", "down\n", "right\n", "right\n", "right\n"]
    eps = run_episodes(ScriptedEngine(tok, script), tok, "frozenlake", [1], group_size=2, max_turns=10,
                       max_context_tokens=1000, sampling=SamplingParams(max_new_tokens=8))
    for ep in eps:
        assert ep.actions == script
        assert ep.valid_actions == [True, False, True, True, True, True, True, True]
        assert ep.effective_actions == [True, False, True, False, True, True, True, True]   # "left" into the border
        assert ep.turn_rewards == [0.0, -0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert ep.success and ep.done and not ep.truncated and ep.finish_reason == "done"
        assert ep.state_keys == ["0,0", "1,0", "1,0", "2,0", "2,0", "3,0", "3,1", "3,2"]
        assert ep.env_replies[1].startswith("invalid\n") and ep.env_replies[3].startswith("blocked\n")
        assert ep.env_replies[2].startswith("\n")          # "down" had no newline: the env adds it
        assert len(ep.env_replies) == 7 and ep.final_reply == "goal reached.\n"
        assert ep.behaviour_logprobs.count(-0.5) == sum(ep.loss_mask) == sum(len(a) for a in script)
        assert "[turn 2] policy: jump" in ep.transcript and "invalid" in ep.transcript
    assert pytest.approx(eps[0].episode_return) == 0.9
    m = episode_metrics(eps)
    assert m["env/success_rate"] == 1.0 and m["env/turns"] == 8.0
    assert m["env/effective_action_rate"] == pytest.approx(6 / 8) and m["env/invalid_action_rate"] == pytest.approx(1 / 8)
    assert m["env/return"] == pytest.approx(0.9) and m["env/truncated_rate"] == 0.0


def test_token_rewards_episode_and_per_turn():
    ep = Episode(seed=0, group_id=0, sample_id=0, prompt="", prompt_token_ids=[1],
                 response_token_ids=[5, 6, 7, 8, 9, 10], loss_mask=[1, 1, 0, 1, 0, 1],
                 turn_index=[0, 0, -1, 1, -1, 2], turn_rewards=[0.5, -0.1, 1.0])
    assert token_rewards(ep) == [0, 0, 0, 0, 0, pytest.approx(1.4)]                 # return on the last policy token
    assert token_rewards(ep, per_turn=True) == [0, 0.5, 0, -0.1, 0, 1.0]            # each turn's reward on its last token


def test_solved_episodes_match_the_managers_layout():
    tok = build_char_tokenizer()
    (prompt, response), = solved_episodes("sokoban", [4], max_turns=20)
    env = make_env("sokoban")
    env.reset(4)
    script = [a + "\n" for a in env.solve()]
    (ep,) = run_episodes(ScriptedEngine(tok, script), tok, "sokoban", [4], group_size=1, max_turns=20,
                         max_context_tokens=4000, sampling=SamplingParams(max_new_tokens=8))
    assert ep.success and (ep.prompt, tok.decode(ep.response_token_ids)) == (prompt, response)
    assert len(solved_episodes("tool_math", list(range(10)), max_turns=4)) == 10
    assert solved_episodes("frozenlake", [0], max_turns=2) == []                    # cannot finish in 2 turns: skipped



def _demo_states(seed: int, response: str, **kwargs) -> tuple[list[tuple[int, int]], bool]:
    """Replay a FrozenLake demonstration: the positions before each action, and whether it ends on the goal."""
    lines = response.split("\n")
    actions = [lines[0]] + [line.removeprefix("move: ") for line in lines[1:] if line.startswith("move: ")]
    env = make_env("frozenlake", **kwargs)
    env.reset(seed)
    states, info = [], {}
    for a in actions:
        states.append(env.pos)
        _, _, _, info = env.step(a + "\n")
    return states, bool(info.get("success"))


def test_solved_episodes_detours_cover_states_off_the_shortest_paths():
    """detour_rate > 0: the teacher sometimes steps off its plan (an effective move that keeps the goal
    reachable) and re-plans, so the corpus holds states no shortest path visits, and still only
    successful demonstrations; detour_rate = 0 stays on shortest paths."""
    def off_path(seed, pos):  # remaining shortest path from pos longer than a shortest path through it
        env = make_env("frozenlake")
        env.reset(seed)
        total = len(env.solve())
        env.pos = pos
        return pos[0] + pos[1] + len(env.solve()) > total

    seeds = list(range(40))
    for rate, expect_off in ((0.0, False), (0.3, True)):
        pairs = solved_episodes("frozenlake", seeds, max_turns=12, detour_rate=rate, habit_seed=1)
        assert len(pairs) >= 20
        demos = {}
        for prompt, response in pairs:
            seed = next(s for s in seeds if make_env("frozenlake").reset(s) == prompt.removeprefix(make_env("frozenlake").instructions))
            states, success = _demo_states(seed, response)
            assert success, response
            demos[seed] = states
        assert any(off_path(seed, pos) for seed, states in demos.items() for pos in states) == expect_off, rate

def test_random_ties_pick_among_every_shortest_first_move():
    """random_ties: each demonstration is still a shortest path, but where down and right both start one
    the teacher does not always go down first (the breadth-first order), so demonstrations on
    the same seeds differ and their first moves are split; ToolMath (no moves) is unchanged."""
    from engines.agentic.env_manager import shortest_plan_moves

    env = make_env("frozenlake")
    env.reset(0)
    plan = env.solve()
    moves = shortest_plan_moves(env, plan)
    assert plan[0] in moves and set(moves) <= {"down", "right"}
    for move in moves:  # each one starts a plan as short as the solver's
        trial = make_env("frozenlake")
        trial.reset(0)
        trial.step(move + "\n")
        assert len(trial.solve()) == len(plan) - 1
    seeds = list(range(60))
    fixed = solved_episodes("frozenlake", seeds, max_turns=8)
    tied = solved_episodes("frozenlake", seeds, max_turns=8, random_ties=True, habit_seed=3)
    assert len(tied) == len(fixed) == 60  # no detours: every map solved within 8 turns (shortest paths are 6 moves)
    tie_firsts = []  # first moves of the tied demonstrations on maps where down and right both start a shortest plan
    for seed, (_, base), (_, response) in zip(seeds, fixed, tied):  # none dropped, so in seed order
        states, success = _demo_states(seed, response)
        assert success and len(states) == len(_demo_states(seed, base)[0])
        start = make_env("frozenlake")
        start.reset(seed)
        options = shortest_plan_moves(start, start.solve())
        assert base.split("\n")[0] == options[0] and response.split("\n")[0] in options  # breadth-first: down first
        if len(options) > 1:
            tie_firsts.append(response.split("\n")[0])
    assert len(tie_firsts) >= 20 and 0.25 <= tie_firsts.count("right") / len(tie_firsts) <= 0.75, tie_firsts
    assert solved_episodes("tool_math", list(range(5)), max_turns=4, random_ties=True) == \
        solved_episodes("tool_math", list(range(5)), max_turns=4)


def test_truncation_by_context_length():
    tok = build_char_tokenizer()
    sampling = SamplingParams(max_new_tokens=8)
    env = make_env("frozenlake")
    first = len(tok(env.instructions + env.reset(0), add_special_tokens=False)["input_ids"])
    reply = len(tok(env.step("jump\n")[0], add_special_tokens=False)["input_ids"])
    limit = first + 5 + reply + 8                             # room for one "jump\n" + reply, then one more turn
    (ep,) = run_episodes(ScriptedEngine(tok, ["jump\n"] * 5), tok, "frozenlake", [0], group_size=1, max_turns=5,
                         max_context_tokens=limit, sampling=sampling)
    assert ep.truncated and ep.finish_reason == "truncated" and ep.turns == 2
    assert len(ep.prompt_token_ids) + len(ep.response_token_ids) <= limit
    assert ep.final_reply.startswith("invalid") and len(ep.env_replies) == 1
    assert episode_metrics([ep])["env/truncated_rate"] == 1.0
    with pytest.raises(ValueError, match="max_context_tokens=50 is too small"):
        run_episodes(ScriptedEngine(tok, ["up\n"]), tok, "frozenlake", [0], group_size=1, max_turns=1,
                     max_context_tokens=50, sampling=sampling)


class _Broken:
    name, instructions, invalid_penalty = "broken", "broken env\n", -0.1

    def reset(self, seed):
        self.seed = seed
        return "move: "

    def step(self, action_text):
        if self.seed == 1:
            raise RuntimeError("boom")
        return "move: ", 0.0, False, {"valid_action": True, "effective": True, "success": False}

    def state_key(self):
        return "s"

    def solve(self):
        return None


def test_a_crashing_environment_costs_only_its_episode(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "broken", _Broken)
    tok = build_char_tokenizer()
    eps = run_episodes(ScriptedEngine(tok, ["up\n"] * 3), tok, "broken", [0, 1], group_size=1, max_turns=3,
                       max_context_tokens=200, sampling=SamplingParams(max_new_tokens=4))
    assert eps[0].turns == 3 and eps[0].env_error is None and eps[0].finish_reason == "max_turns"
    assert eps[1].turns == 1 and eps[1].env_error == "RuntimeError: boom" and eps[1].finish_reason == "env_error"
    assert episode_metrics(eps)["env/env_error_rate"] == 0.5


CHATML_LIKE = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}"
               "{% if m['role'] == 'assistant' %}{{ eos_token }}\n{% else %}(end)\n{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<assistant>\n{% endif %}")


def test_chat_format_frames_turns_like_the_template_and_keeps_token_in_token_out(policy):
    """chat=True: the decoded training sequence is exactly the template's rendering of the
    conversation (system, user, assistant, user, ...), and only the actions carry loss."""
    from engines.agentic.env_manager import ChatFormat

    model, tok = policy
    tok.chat_template = CHATML_LIKE
    try:
        fmt = ChatFormat.of(tok)
        assert (fmt.end_of_turn, fmt.user_open, fmt.user_close) == ("<eos>", "\n<user>\n", "(end)\n<assistant>\n")
        engine = ScriptedEngine(tok, ["right<eos>", "down", "left"])  # turn 1 ends its turn itself, turn 2 does not
        eps = run_episodes(engine, tok, "frozenlake", [3], group_size=1, max_turns=3, max_context_tokens=600,
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=6, stop=("\n",)),
                           env_kwargs={"size": 4}, chat=True)
        ep = eps[0]
        assert ep.actions[:2] == ["right", "down"] and ep.valid_actions[:2] == [True, True]
        env = make_env("frozenlake", size=4)
        first_obs = env.reset(3)
        second_obs, *_ = env.step("right")
        third_obs, *_ = env.step("down")
        conversation = [{"role": "system", "content": env.instructions.strip()}, {"role": "user", "content": first_obs},
                        {"role": "assistant", "content": "right"}, {"role": "user", "content": second_obs},
                        {"role": "assistant", "content": "down"}, {"role": "user", "content": third_obs}]
        expected = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        text = tok.decode(ep.prompt_token_ids + ep.response_token_ids)
        assert ep.turns == 3 and text == expected + "left"        # seed 3: right, down are safe moves
        runs = segments(ep)
        assert tok.decode(runs[0][1]) == "right<eos>" and runs[0][0] == 1
        assert tok.decode(runs[1][1]) == "\n<user>\n" + second_obs + "(end)\n<assistant>\n" and runs[1][0] == 0
        assert tok.decode(runs[3][1]) == "<eos>\n<user>\n" + third_obs + "(end)\n<assistant>\n" and runs[3][0] == 0
    finally:
        tok.chat_template = None


def test_an_env_that_scores_its_outcomes_gets_env_score_beside_the_return_it_pays():
    """WebShop with reward="success" pays 0 for a purchase one option short; the episode keeps WebShop's
    score of it (info["score"]) and episode_metrics logs env/score, which frozenlake (no score) lacks."""
    tok = build_char_tokenizer()
    kwargs = {"page_size": 3, "brackets": "()", "repeat_instruction": False, "reward": "success"}
    teacher = make_env("webshop", **kwargs)
    teacher.reset(4)
    short = one_option_short(teacher, teacher.solve())
    eps = run_episodes(ScriptedEngine(tok, [a + "\n" for a in short]), tok, "webshop", [4], group_size=1,
                       max_turns=len(short), max_context_tokens=4000, sampling=SamplingParams(max_new_tokens=40),
                       env_kwargs=kwargs)
    (ep,) = eps
    assert ep.done and not ep.success and ep.episode_return == 0.0 and ep.actions == [a + "\n" for a in short]
    assert 0.5 <= ep.score < 1.0 and f"webshop score {ep.score:.2f}" in ep.final_reply
    m = episode_metrics(eps + [Episode(seed=5, group_id=1, sample_id=0, prompt="", prompt_token_ids=[])])
    assert m["env/score"] == pytest.approx(ep.score / 2)          # the unscored episode counts 0
    assert m["env/return"] == 0.0 and m["env/success_rate"] == 0.0
    assert "env/score" not in episode_metrics(run_episodes(ScriptedEngine(tok, ["down\n"]), tok, "frozenlake", [1],
                                                           group_size=1, max_turns=1, max_context_tokens=1000,
                                                           sampling=SamplingParams(max_new_tokens=8)))

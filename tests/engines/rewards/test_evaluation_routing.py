"""Evaluation scores every row with the reward training gives it: the same routing (reward.functions,
metadata.reward_fn, the domain) through the same function. Training's score is taken from the
scoring stage itself (`tasks.actors.pools.score_table` in real Ray reward workers), eval's from
`engines.rewards.evaluation.evaluate`, on the same responses."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[3]
GRADED = "tests.support.rewards:graded"  # 1.0 when the response starts with a digit, else 0.5


class ScriptedEngine:
    """Greedy 'generation' that answers prompt i with responses[i]: eval's scoring, without a model."""

    def __init__(self, responses: list[str]):
        self.responses = responses

    def generate(self, prompt_token_ids, params):
        from engines.generation.engine import Completion

        return [Completion(i, 0, [3] * len(r), [0.0] * len(r), "stop", r) for i, r in enumerate(self.responses)]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield
    ray.shutdown()


def training_rewards(tmp_path, cfg, rows: pd.DataFrame) -> list[float]:
    """What the scoring stage gives `rows` (columns domain, response, prompt, answer, metadata) under `cfg`."""
    from engines.data.datasets import encode_nested
    from tasks.actors.pools import score_table
    from tasks.run.types import RunSpec

    spec = RunSpec(cfg.to_json(), cfg.hash(), f"evalroute{os.getpid()}", str(tmp_path), "", "")
    rewards, errors = score_table(spec, encode_nested(rows))
    assert errors == [None] * len(rows), errors
    return rewards


def test_metadata_routed_row_scores_as_in_training(ray_local, tmp_path, tiny_policy):
    """A domain with no reward of its own name, routed by metadata.reward_fn (old eval: 0.0)."""
    from configs.schema import parse_config
    from engines.rewards.evaluation import evaluate
    from engines.generation.engine import HFGenerationEngine

    model, tok = tiny_policy
    table = pd.DataFrame([{"prompt": p, "domain": "custom", "answer": "1", "metadata": {"reward_fn": GRADED}}
                          for p in ("1+2=", "9-3=", "7*1=")])
    metrics, rows = evaluate(HFGenerationEngine(model, tok), tok, table, max_new_tokens=3)
    want = training_rewards(tmp_path, parse_config({}), rows)
    assert rows["reward"].tolist() == want
    assert set(want) <= {0.5, 1.0}  # graded never gives 0: a row scored 0 was not routed
    assert metrics["reward/custom"] == pytest.approx(sum(want) / 3)
    assert metrics["accuracy/custom"] == pytest.approx(want.count(1.0) / 3)  # correct = reward >= 1.0


def test_reward_functions_route_eval_as_in_training(ray_local, tmp_path):
    """reward.functions routes a domain (and wins over metadata.reward_fn), in eval as in training."""
    from configs.schema import parse_config
    from engines.rewards.evaluation import evaluate

    cfg = parse_config({"reward": {"functions": {"mine": GRADED, "arithmetic": GRADED}}})
    table = pd.DataFrame([{"prompt": "a", "domain": "mine", "answer": "1", "metadata": {}},
                          {"prompt": "b", "domain": "mine", "answer": "1", "metadata": {}},
                          {"prompt": "c", "domain": "arithmetic", "answer": "5", "metadata": {"reward_fn": "exact_match"}}])
    metrics, rows = evaluate(ScriptedEngine(["7", "x", "5"]), _tokenizer(), table, max_new_tokens=4, reward=cfg.reward)
    assert rows["reward"].tolist() == [1.0, 0.5, 1.0] == training_rewards(tmp_path, cfg, rows)
    assert metrics["accuracy/mine"] == 0.5 and metrics["reward/mine"] == 0.75


def _tokenizer():
    from engines.models.modeling import build_char_tokenizer

    return build_char_tokenizer()


@pytest.mark.skipif(any(__import__("importlib").util.find_spec(m) is None for m in ("reasoning_gym", "math_verify")),
                    reason="needs the rewards extra (reasoning-gym, math-verify)")
def test_multidomain_preset_math_eval_uses_the_reasoning_gym_scorer(ray_local, tmp_path):
    """The preset's `math` rows are reasoning-gym tasks: training scores them with reasoning-gym's own
    scorer (make_dataset routes them by metadata.reward_fn), and so must eval -- not math-verify,
    which gives "The answer is N" full marks where reasoning-gym gives partial credit."""
    from configs.schema import load_config
    from engines.rewards.evaluation import evaluate
    from engines.rewards.math import math_reward
    from engines.rewards.routing import reward_name
    from engines.rewards.reasoning_gym import reasoning_gym_reward
    from tasks.run.splits import source_splits

    # the routing is under test, not the speed: a fresh reward worker's first call imports reasoning-gym
    cfg = load_config(REPO / "configs/smollm2_multidomain.yaml",
                      overrides={"data.train_size": 2, "data.eval_size": 3, "reward.timeout_s": 120})
    d = cfg.data.model_dump()
    (math_src,) = [s for s in d["sources"] if s["domain"] == "math"]
    _, table, _ = source_splits(math_src, d, cfg.run.seed)  # the preset's math eval rows, as make_dataset builds them
    responses = [f"The answer is {a}" for a in table["answer"]]
    metrics, rows = evaluate(ScriptedEngine(responses), _tokenizer(), table, max_new_tokens=8, reward=cfg.reward)
    samples = [r.to_dict() for _, r in table.iterrows()]
    assert {reward_name("math", s, dict(cfg.reward.functions)) for s in samples} == {"reasoning_gym"}
    want = training_rewards(tmp_path, cfg, rows)
    assert rows["reward"].tolist() == pytest.approx(want)
    assert want == pytest.approx([reasoning_gym_reward(r, s) for r, s in zip(responses, samples)])
    assert all(w < 1.0 for w in want)  # reasoning-gym: partial credit for an answer outside <answer> tags
    assert [math_reward(r, s) for r, s in zip(responses, samples)] == [1.0] * 3  # math-verify: full marks
    assert metrics["accuracy/math"] == 0.0 and 0.0 < metrics["reward/math"] < 1.0

"""Unit tests of evaluation per domain (engines/rewards/evaluation.py), on a tiny char-level Qwen2 built in the test
(seconds on one CPU thread)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from engines.rewards.evaluation import evaluate
from engines.generation.engine import (
    Completion,
    HFGenerationEngine,
)
from engines.models.modeling import encode_prompts
from engines.data.synthetic import make_problems
from tests.support.engines import encode

torch.set_num_threads(1)


class ScriptedEngine:
    """A GenerationEngine that answers arithmetic correctly and reverse wrongly, in reverse order."""

    def __init__(self, table):
        self.table = table

    def generate(self, prompt_token_ids, params):
        assert params.temperature == 0.0 and params.n == 1
        out = []
        for i in reversed(range(len(prompt_token_ids))):
            row = self.table.iloc[i]
            text = f"{row['answer']}\n" if row["domain"] == "arithmetic" else "zzz"
            out.append(Completion(i, 0, [3] * len(text), [0.0] * len(text), "stop", text))
        return out

    def load_weights(self, model_dir):
        raise NotImplementedError


def eval_table(n: int = 6) -> pd.DataFrame:
    return pd.DataFrame([{"prompt": p.prompt, "domain": p.domain, "answer": p.answer} for p in make_problems("eval", n)])


def test_evaluate_scores_per_domain(tiny_policy):
    _, tok = tiny_policy
    table = eval_table(6)
    metrics, rows = evaluate(ScriptedEngine(table), tok, table, max_new_tokens=8)
    assert metrics["accuracy/arithmetic"] == 1.0 and metrics["accuracy/reverse"] == 0.0
    assert metrics["accuracy"] == 0.5
    assert len(rows) == 6 and rows["prompt"].tolist() == table["prompt"].tolist()  # back in table order
    assert rows["reward"].tolist() == [1.0, 0.0] * 3
    assert {"response", "reward", "response_length", "domain", "answer"} <= set(rows.columns)


def test_evaluate_with_the_hf_engine(tiny_policy):
    model, tok = tiny_policy
    table = eval_table(4)
    metrics, rows = evaluate(HFGenerationEngine(model, tok), tok, table, max_new_tokens=4)
    assert set(metrics) == {"accuracy", "length", "accuracy/arithmetic", "accuracy/reverse", "reward", "reward/arithmetic", "reward/reverse",
                            "errors", "errors/arithmetic", "errors/reverse"}
    assert metrics["errors"] == 0.0
    assert all(0.0 <= v <= 1.0 for k, v in metrics.items() if k.startswith(("accuracy", "reward")))
    assert 1 <= metrics["length"] <= 4
    assert len(rows) == 4 and set(rows["reward"]) <= {0.0, 1.0}
    assert encode_prompts(tok, ["1+2="]) == encode(tok, ["1+2="])


def test_evaluation_counts_reward_errors_and_fails_a_domain_that_mostly_errs(tiny_policy):
    """A reward that fails on every row no longer reads as accuracy 0: evaluation reports errors per domain, and
    over reward.max_error_rate it raises naming the function, the domain and an example (issue 60)."""
    from engines.rewards.config import RewardConfig
    from engines.rewards.routing import RewardErrorRate

    _, tok = tiny_policy
    table = eval_table(6)
    broken = RewardConfig(functions={"reverse": "tests.support.hostile_rewards:infinite"})
    with pytest.raises(RewardErrorRate, match=r"evaluation: the reward of domain 'reverse' \(function "
                                              r"'tests.support.hostile_rewards:infinite'\) failed on 3 of 3 rows .*reward is inf"):
        evaluate(ScriptedEngine(table), tok, table, max_new_tokens=8, reward=broken)
    tolerant = RewardConfig(functions=broken.functions, max_error_rate=1.0)
    metrics, rows = evaluate(ScriptedEngine(table), tok, table, max_new_tokens=8, reward=tolerant)
    assert metrics["errors"] == 3.0 and metrics["errors/reverse"] == 3.0 and metrics["errors/arithmetic"] == 0.0
    assert rows["reward_error"].notna().sum() == 3

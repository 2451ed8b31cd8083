"""Unit tests of evaluation per domain (engines/rewards/evaluation.py), on a tiny char-level Qwen2 built in the test
(seconds on one CPU thread)."""

from __future__ import annotations

import pandas as pd
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
    assert set(metrics) == {"accuracy", "length", "accuracy/arithmetic", "accuracy/reverse", "reward", "reward/arithmetic", "reward/reverse"}
    assert all(0.0 <= v <= 1.0 for k, v in metrics.items() if k.startswith(("accuracy", "reward")))
    assert 1 <= metrics["length"] <= 4
    assert len(rows) == 4 and set(rows["reward"]) <= {0.0, 1.0}
    assert encode_prompts(tok, ["1+2="]) == encode(tok, ["1+2="])

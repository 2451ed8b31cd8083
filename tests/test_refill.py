"""DAPO dynamic-sampling refills (tasks/scoring.py `refill_prompts`) draw with `data.domain_weights`."""

from __future__ import annotations

import pandas as pd

from configs.schema import parse_config


def _train() -> pd.DataFrame:
    domains = ["a"] * 100 + ["b"] * 100 + ["c"] * 100
    return pd.DataFrame({"prompt_id": range(300), "domain": domains, "prompt": [f"p{i}" for i in range(300)]})


def test_refills_follow_the_domain_weights():
    from tasks.scoring import refill_prompts

    train = _train()
    cfg = parse_config({"data": {"domain_weights": {"a": 3, "b": 1, "c": 0}}})
    first, second = refill_prompts(cfg, train, 8, 5, 1), refill_prompts(cfg, train, 8, 5, 2)
    for batch in (first, second):          # quotas 3/4 * 8 = 6 and 1/4 * 8 = 2; weight 0 = never
        assert batch["domain"].value_counts().to_dict() == {"a": 6, "b": 2}
        assert (batch["prompt_id"] < 100).sum() == 6 and (batch["prompt_id"] >= 200).sum() == 0
    assert set(first["prompt_id"]) != set(second["prompt_id"])                 # a fresh draw per round
    assert refill_prompts(cfg, train, 8, 5, 1).equals(first)                   # deterministic


def test_refills_without_weights_are_unchanged():
    from tasks.rollout import iteration_prompts
    from tasks.scoring import refill_prompts

    train, cfg = _train(), parse_config({"run": {"seed": 3}})
    assert refill_prompts(cfg, train, 8, 5, 1).equals(iteration_prompts(train, 8, 5, 3 + 7919))
    assert set(refill_prompts(cfg, train, 64, 5, 1)["domain"]) == {"a", "b", "c"}

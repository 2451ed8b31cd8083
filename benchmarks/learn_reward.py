"""The reward of `flyroll bench --learning`'s TRL side, importable without flyroll or pandas.

TRL's worker (benchmarks/trl_grpo_learn.py) runs in its own environment (.venv-trl), which has
reasoning-gym but not flyroll. It scores each completion with `score(response, row)`, where `row`
is what the benchmark driver wrote for that prompt (benchmarks/bench_learning.py `reward_row`):

- {"reward": "reasoning_gym", "rg_dataset", "rg_config", "rg_entry"}: the task's own reasoning-gym
  score of the answer between the last <answer>...</answer> tags (without tags: the whole
  response), as engines/rewards/reasoning_gym.py `reasoning_gym_reward` gives it;
- {"reward": "exact_match", "answer"}: 1.0 when the response's first line, stripped, equals the
  answer, as engines/rewards/exact_match.py `exact_match_reward` (the synthetic domains' reward).

tests/benchmarks/test_bench_learning.py checks both against flyroll's own functions.
"""

from __future__ import annotations

import functools
import json

REWARDS = ("reasoning_gym", "exact_match")


@functools.lru_cache(maxsize=64)
def _rg_scorer(name: str, config_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config_json)).score_answer


def reasoning_gym_score(response: str, rg_dataset: str, rg_config: dict | None, rg_entry: dict) -> float:
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(response or "")
    if answer is None:
        answer = (response or "").strip()
    score = _rg_scorer(rg_dataset, json.dumps(rg_config or {}, sort_keys=True))
    return float(score(answer, rg_entry))


def exact_match_score(response: str, answer: str) -> float:
    return float(response.split("\n", 1)[0].strip() == str(answer).strip())


def score(response: str, row: dict) -> float:
    """The reward of `response` to the prompt described by `row` (see the module docstring)."""
    kind = row.get("reward")
    if kind == "reasoning_gym":
        return reasoning_gym_score(response, row["rg_dataset"], row.get("rg_config"), row["rg_entry"])
    if kind == "exact_match":
        return exact_match_score(response, row["answer"])
    raise ValueError(f"learn_reward.score: row['reward'] is {kind!r}; expected one of {list(REWARDS)}")

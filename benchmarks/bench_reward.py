"""The reward both `flyroll bench` workers score with (flyroll_grpo_step.py, trl_grpo_step.py run in
different environments; both find this file next to them on sys.path).

- `shaped` (default): 1.0 when the first line is the answer; else 0.5 when the answer appears in the
  completion as a word of its own; else a brevity term 0.2 * (1 - min(len, 200) / 200) of the
  completion's length in characters. Samples of one prompt almost never tie, so every group has
  non-zero advantages and the update does its full work in both systems.
- `exact`: 1.0 when the first line is the answer, else 0.0 (`engines/rewards/exact_match.py `exact_match_reward``).
  A binary reward, as most RLVR runs use; a group whose samples all score alike has zero
  advantages (SmolLM2 at temperature 1 solves none of these prompts: every group does).
"""

from __future__ import annotations

import re

REWARDS = ("shaped", "exact")


def bench_reward(kind: str, text: str, answer: str) -> float:
    answer = answer.strip()
    if text.split("\n", 1)[0].strip() == answer:
        return 1.0
    if kind == "exact":
        return 0.0
    if kind != "shaped":
        raise ValueError(f"reward {kind!r}: expected one of {REWARDS}")
    if answer and re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", text):
        return 0.5
    return 0.2 * (1 - min(len(text), 200) / 200)


def shaped_reward(response: str, sample: dict) -> float:
    """`shaped` as a flyroll reward function (`reward.functions`: fn(response, sample) -> float), so
    `flyroll bench --pipeline-as-step` scores the workflow's samples as the bench step scores its own."""
    return bench_reward("shaped", response, str(sample["answer"]))


def exact_reward(response: str, sample: dict) -> float:
    """`exact` as a flyroll reward function (see `shaped_reward`)."""
    return bench_reward("exact", response, str(sample["answer"]))

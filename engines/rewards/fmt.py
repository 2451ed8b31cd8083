"""Format reward: 1.0 when the response follows the expected answer format, else 0.0.

Only the shape is checked, never correctness; pair it with a domain reward (math, code) and a
small weight, as DeepSeek-R1 does with its format reward.
"""

from __future__ import annotations

import functools
import re

ANSWER_TAG_OR_BOXED = r"<answer>.+?</answer>|\\boxed\{.+?\}"
THINK_THEN_ANSWER = r"^\s*<think>.+?</think>\s*<answer>.+?</answer>\s*$"


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def format_reward(response: str, sample: dict, pattern: str = ANSWER_TAG_OR_BOXED) -> float:
    """1.0 if `pattern` (re.search, DOTALL) matches `response`, else 0.0.

    `sample["metadata"]["format_pattern"]`, when present, overrides `pattern`, so one dataset can
    ask for its own format (e.g. `THINK_THEN_ANSWER`).
    """
    pattern = (sample.get("metadata") or {}).get("format_pattern") or pattern
    try:
        rx = _compile(pattern)
    except re.error as e:
        raise ValueError(f"format_reward: pattern={pattern!r} is not a valid regex ({e})") from e
    return 1.0 if rx.search(response or "") else 0.0

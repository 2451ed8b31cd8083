"""The `reasoning_gym` reward: each reasoning-gym task scores its own answers (`score_answer`).

Rows come from engines/data/sources.py `reasoning_gym_source`, whose metadata carries the generator's
name, settings and entry.
"""

from __future__ import annotations

import functools
import json


@functools.lru_cache(maxsize=64)
def _rg_scorer(name: str, config_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config_json)).score_answer


def reasoning_gym_reward(response: str, sample: dict) -> float:
    """The task's own reasoning-gym score (usually 0/1, some give partial credit) of the answer
    between the last <answer>...</answer> tags of `response` (without tags: the whole response)."""
    from reasoning_gym.utils import extract_answer

    meta = sample.get("metadata") or {}
    if "rg_dataset" not in meta or "rg_entry" not in meta:
        raise KeyError("reasoning_gym_reward: sample['metadata'] lacks 'rg_dataset'/'rg_entry'; "
                       "expected a row made by engines.data.sources.reasoning_gym_source")
    answer = extract_answer(response or "")
    if answer is None:
        answer = (response or "").strip()
    score = _rg_scorer(meta["rg_dataset"], json.dumps(meta.get("rg_config") or {}, sort_keys=True))
    return float(score(answer, meta["rg_entry"]))

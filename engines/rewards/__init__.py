"""Reward functions, routed per domain, and the isolation every reward call runs under.

A reward function is a plain typed function `fn(response: str, sample: dict) -> float`. Domains
map to functions by name in `REWARDS`; add one with `@register_reward("name")` in one file.

Two names route to a model instead of a function: `judge` and `reward_model`. The reward worker
scores those in batches with a model it builds once (`engines/rewards/models.py`).

Every call runs in a worker process (engines/rewards/calls.py `RewardCalls`): a raise, a value that
is not a finite number, a timeout (the process is killed) or a crash costs only that sample (reward
0.0, the error kept in `reward_error`), and a batch never takes longer than its budget.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from engines.rewards.exact_match import exact_match_reward

RewardFn = Callable[[str, dict], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return deco


register_reward("arithmetic")(exact_match_reward)
register_reward("reverse")(exact_match_reward)
register_reward("exact_match")(exact_match_reward)

# Domain rewards with optional dependencies register lazily: name -> "module:function".
_LAZY = {
    "math": "engines.rewards.math:math_reward",
    "code": "engines.rewards.code:code_reward",
    "format": "engines.rewards.fmt:format_reward",
    "ifeval": "engines.rewards.ifeval:ifeval_reward",
    "reasoning_gym": "engines.rewards.reasoning_gym:reasoning_gym_reward",
}


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`, or `name` = "package.module:function" imported."""
    if name in ("judge", "reward_model"):
        raise KeyError(f"{name!r} is a model reward, not a per-sample function: the reward workers score it in "
                       f"batches with the model set in reward.{name} (engines/rewards/models.py)")
    if name not in REWARDS and (name in _LAZY or ":" in name):
        module, fn = _LAZY.get(name, name).split(":", 1)
        try:
            REWARDS[name] = getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError) as e:
            raise KeyError(f"reward function {name!r} cannot be imported: {e}") from None
    if name not in REWARDS:
        raise KeyError(f"no reward function for domain {name!r}; registered: {sorted(set(REWARDS) | set(_LAZY))}")
    return REWARDS[name]


@dataclass(frozen=True)
class RewardResult:
    reward: float
    error: str | None      # None, or what went wrong ("timeout after 5.0s", "ValueError: ...")
    seconds: float
    isolation: str | None = None   # the sandbox mode that ran the code reward's program; None for other rewards

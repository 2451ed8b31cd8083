"""Name registries for the RL math: advantage estimators, policy losses, KL estimators.

Variants are chosen by name from the config (``AlgorithmConfig.advantage = "grpo"``); a new
variant is one decorated function in one file, never an ``if`` branch in a trainer:

    @register_advantage("my_estimator")
    def my_estimator(token_level_rewards, response_mask, index, *, values=None, gamma=1.0, lam=1.0):
        ...

Notation: B samples (= prompts × G), G samples per prompt, T response tokens.
"""

from __future__ import annotations

from typing import Callable

ADVANTAGES: dict[str, Callable] = {}
"""name → fn(token_level_rewards[B,T], response_mask[B,T], index[B], *, values, gamma, lam, ...)
-> ((advantages[B,T], returns[B,T]), metrics)"""

GROUP_BASELINE: set[str] = set()
"""Advantage estimators whose baseline is the prompt's own group (registered with
``group_baseline=True``): with one sample per prompt every advantage they give is 0, so the config
refuses them with G = 1 (configs/schema.py)."""

POLICY_LOSSES: dict[str, Callable] = {}
"""name → fn(logprobs[B,T], old_logprobs[B,T], advantages[B,T], response_mask[B,T], *,
loss_agg_mode, num_tokens, num_seqs, ...) -> (loss scalar, metrics)"""

KL_ESTIMATORS: dict[str, Callable] = {}
"""name → fn(logprobs[B,T], ref_logprobs[B,T]) -> kl[B,T]  (token level, sampled tokens only,
no aggregation)"""


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        if name in table and table[name] is not fn:
            old = table[name]
            raise ValueError(
                f"{kind} {name!r} is already registered by {old.__module__}.{old.__qualname__}"
            )
        table[name] = fn
        return fn

    return decorator


def _get(table: dict[str, Callable], kind: str, name: str) -> Callable:
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; known: {sorted(table)}") from None


def register_advantage(name: str, *, group_baseline: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register an advantage estimator under ``name``. ``group_baseline``: its baseline
    is the prompt's group (GRPO, RLOO, ...), so it needs at least 2 samples per prompt."""
    if group_baseline:
        GROUP_BASELINE.add(name)
    return _register(ADVANTAGES, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a policy loss under ``name``."""
    return _register(POLICY_LOSSES, "policy loss", name)


def register_kl(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a token-level KL estimator under ``name``."""
    return _register(KL_ESTIMATORS, "KL estimator", name)


def get_advantage(name: str) -> Callable:
    """The advantage estimator registered as ``name``; ``KeyError`` listing the known names."""
    return _get(ADVANTAGES, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name``; ``KeyError`` listing the known names."""
    return _get(POLICY_LOSSES, "policy loss", name)


def get_kl(name: str) -> Callable:
    """The KL estimator registered as ``name``; ``KeyError`` listing the known names."""
    return _get(KL_ESTIMATORS, "KL estimator", name)

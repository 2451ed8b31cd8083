"""The WebShop teacher's plan cut one option short (tests/engines/agentic/envs/test_webshop.py, tests/engines/agentic/test_env_manager.py)."""

from __future__ import annotations


def one_option_short(env, plan: list[str]) -> list[str]:
    """`plan`, the teacher's actions for `env`'s current goal, without its last option click: a purchase
    WebShop scores below 1 (its option share is short by one). Either bracket style: `click[x]`, `click(x)`."""
    last = max(i for i, a in enumerate(plan) if a[len("click["):-1] in env.goal.options)
    return plan[:last] + plan[last + 1:]

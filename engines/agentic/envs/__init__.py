"""Multi-turn text environments, chosen by name (see docs/agentic.md).

Adding an environment is one file: a class with the ``TextEnv`` protocol of ``base.py``, then
one line in ``ENVIRONMENTS`` below.
"""

from __future__ import annotations

from engines.agentic.envs.base import TextEnv
from engines.agentic.envs.frozenlake import FrozenLake
from engines.agentic.envs.sokoban import Sokoban
from engines.agentic.envs.tool_math import ToolMath
from engines.agentic.envs.tool_table import ToolTable
from engines.agentic.envs.webshop import WebShop

ENVIRONMENTS: dict[str, type] = {
    "frozenlake": FrozenLake,
    "sokoban": Sokoban,
    "tool_math": ToolMath,
    "tool_table": ToolTable,
    "webshop": WebShop,
}


def make_env(name: str, **kwargs) -> TextEnv:
    """A fresh environment ``name`` built with ``kwargs`` (its constructor options)."""
    try:
        cls = ENVIRONMENTS[name]
    except KeyError:
        raise KeyError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}") from None
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"environment {name!r}: bad options {sorted(kwargs)}: {e}") from None

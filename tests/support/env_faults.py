"""A FrozenLake whose step misbehaves on chosen seeds, importable by Ray workers (tests/infra/test_env_pool.py)."""

from __future__ import annotations

import os
import time
from typing import ClassVar

from engines.agentic.envs import make_env


class FaultyLake:
    """``behaviour[seed]``: ``raise`` raises in step, ``hang`` blocks in step (``_hang``: 60 s), ``slow``
    sleeps 1 s per step, ``kill_once`` SIGKILLs its own process (the env worker) on its first step
    anywhere (``marker`` file remembers), ``kill`` on every step. ``behaviour`` and ``marker`` are
    arguments (what a Ray worker gets) or, unset, class attributes a test sets (tests/engines/agentic/test_async_env_manager.py)."""
    name, invalid_penalty = "faulty", -0.1
    behaviour: ClassVar[dict[int, str]] = {}
    marker: ClassVar[str] = ""

    def __init__(self, behaviour: dict[int, str] | None = None, marker: str | None = None):
        if behaviour is not None:
            self.behaviour = behaviour
        if marker is not None:
            self.marker = marker
        self.env = make_env("frozenlake", size=4)
        self.instructions = self.env.instructions

    def reset(self, seed):
        self.seed = seed
        return self.env.reset(seed)

    def step(self, action_text):
        how = self.behaviour.get(self.seed)
        if how == "raise":
            raise RuntimeError("boom")
        if how == "hang":
            self._hang()
        if how == "slow":
            time.sleep(1.0)
        if how == "kill" or (how == "kill_once" and self._first_to_mark()):
            os.kill(os.getpid(), 9)
        return self.env.step(action_text)

    def _hang(self) -> None:
        time.sleep(60)

    def _first_to_mark(self) -> bool:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def state_key(self):
        return self.env.state_key()

    def solve(self):
        return None

"""A FrozenLake whose step misbehaves on chosen seeds, importable by Ray workers (tests/test_env_pool_ray.py)."""

from __future__ import annotations

import os
import time

from engines.envs import make_env


class FaultyLake:
    """``behaviour[seed]``: ``raise`` raises in step, ``hang`` sleeps 60 s in step, ``kill_once`` SIGKILLs
    its own process (the env worker) on its first step anywhere (``marker`` file remembers), ``kill`` on
    every step."""
    name, invalid_penalty = "faulty", -0.1

    def __init__(self, behaviour: dict[int, str], marker: str = ""):
        self.behaviour, self.marker = behaviour, marker
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
            time.sleep(60)
        if how == "kill" or (how == "kill_once" and self._first_to_mark()):
            os.kill(os.getpid(), 9)
        return self.env.step(action_text)

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

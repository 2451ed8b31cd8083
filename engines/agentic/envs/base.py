"""The text-environment protocol: ``reset(seed) -> observation``, ``step(action_text) -> (observation,
reward, done, info)``, plus what the environment manager and the solvers need.

An environment is one file in ``engines/agentic/envs/`` with one class registered in
``engines/agentic/envs/__init__.py``. Everything it prints must be plain text a tokenizer can take turn by
turn: no colour codes, and for the embedded tiny policy only characters of
``engines.models.modeling.CHARSET`` (digits, lowercase, ``+-*/=()<> ,.:?`` and newline) — by default, or
with an option (``webshop``: ``brackets="()"``); ``tool_table`` speaks JSON tool calls and is for
real tokenizers only.

Contract of ``step``:
  - it never raises on the policy's text: an unparsable or illegal action leaves the state
    unchanged, costs ``invalid_penalty`` (reward) and sets ``info["valid_action"] = False``;
  - ``info`` always holds ``valid_action`` (parsed and legal), ``effective`` (the state changed) and
    ``success`` (the task is solved); environments may add their own keys;
  - the observation it returns is the text the policy reads before its next action (ending with
    the action cue, e.g. ``"move: "``).
The manager ends an episode on ``done`` or after ``max_turns`` actions; an environment does not
count turns itself.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol, runtime_checkable

INVALID_PENALTY = -0.1  # default reward for an unparsable or illegal action

MOVES = ("left", "down", "right", "up")            # gymnasium FrozenLake order: LEFT=0 DOWN=1 RIGHT=2 UP=3
DELTAS = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}  # (drow, dcol)
_MOVE_ALIASES = {**{m: m for m in MOVES}, **{m[0]: m for m in MOVES}}


@runtime_checkable
class TextEnv(Protocol):
    name: str
    instructions: str        # the system text that precedes the first observation
    invalid_penalty: float

    def reset(self, seed: int) -> str:
        """Start the episode of ``seed`` (same seed, same start state); returns the first observation."""
        ...

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        """Apply the policy's raw text; returns (observation, reward, done, info). Never raises on bad text."""
        ...

    def state_key(self) -> str:
        """A string equal for two episodes iff their environment states are equal (GiGPO anchor states)."""
        ...

    def solve(self) -> list[str] | None:
        """Scripted solver: action texts that solve the episode from the current state, or None."""
        ...


def parse_move(action_text: str) -> str | None:
    """The move named by the first non-empty line of ``action_text``: one of ``left down right up``
    (or ``l d r u``), case-insensitive, a trailing ``.`` allowed; ``None`` for anything else."""
    for line in action_text.splitlines():
        word = line.strip().rstrip(".").strip().lower()
        if word:
            return _MOVE_ALIASES.get(word)
    return None


def step_info(valid: bool, effective: bool, success: bool, **extra) -> dict:
    """The ``info`` dict every environment returns."""
    return {"valid_action": valid, "effective": effective, "success": success, **extra}


def teacher_rate(env: str, name: str, rate: float) -> float:
    """``rate`` checked as the share of seeds on which an environment's teacher (``solve()``) plays
    its full plan (``tool_table`` ``teacher_tool_rate``, ``webshop`` ``teacher_option_rate``)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{env} {name}: {rate!r}; expected a share in [0, 1]")
    return rate


def teacher_lapses(seed: int, rate: float) -> bool:
    """Whether the teacher departs from its full plan on episode ``seed`` (it keeps to it on a ``rate``
    share of seeds). Drawn from the seed alone, so the same seeds every time."""
    return random.Random(f"teacher-{seed}").random() >= rate


def bfs(start: Hashable, successors: Callable[[Hashable], Iterable[tuple[str, Hashable]]],
        is_goal: Callable[[Hashable], bool], max_states: int = 200_000) -> list[str] | None:
    """Shortest action sequence from ``start`` to a goal state; ``successors(s)`` yields
    (action, next_state). ``None`` when no goal is reachable within ``max_states`` states."""
    if is_goal(start):
        return []
    parent: dict[Hashable, tuple[Hashable, str] | None] = {start: None}
    queue = deque([start])
    while queue and len(parent) <= max_states:
        s = queue.popleft()
        for action, nxt in successors(s):
            if nxt in parent:
                continue
            parent[nxt] = (s, action)
            if is_goal(nxt):
                path = []
                node = nxt
                while parent[node] is not None:
                    prev, a = parent[node]
                    path.append(a)
                    node = prev
                return path[::-1]
            queue.append(nxt)
    return None

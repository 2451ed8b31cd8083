"""FrozenLake as a text environment: gymnasium ``FrozenLake-v1`` rules on random maps.

The map of an episode comes from gymnasium's ``generate_random_map(size, p, seed)`` (start top
left, goal bottom right, a path guaranteed), so seed ``s`` gives the same map as
``gym.make("FrozenLake-v1", desc=generate_random_map(size, p, s))``. Transitions are gymnasium's
(``is_slippery=False``: the move happens; moving into the border leaves the player in place;
entering ``H`` or ``G`` ends the episode, reward 1 on ``G``) re-implemented in plain Python so the
state can be copied and searched; ``tests/engines/agentic/envs/test_envs.py`` checks them against gymnasium's own env.
``is_slippery=True`` follows gymnasium's rule (the intended move or one of its two perpendicular
neighbours, 1/3 each) with the episode's own ``random.Random(seed)``, not gymnasium's generator.

Text (tiny-tokenizer characters only): ``.`` ice, ``o`` hole, ``g`` goal, ``p`` the player; an
action is one word ``left down right up`` (or ``l d r u``) on its own line. With
``neighbours=True`` each rendering ends with one more line naming the four tiles next to the player,
``around: left=ice down=hole right=goal up=edge`` — the grid made local, which a small policy reads
far more easily than a 2-D picture (the presets turn it on; it changes nothing in the rules).
"""

from __future__ import annotations

import random

from engines.agentic.envs.base import DELTAS, INVALID_PENALTY, MOVES, bfs, parse_move, step_info

_TILE = {"S": ".", "F": ".", "H": "o", "G": "g"}


class FrozenLake:
    name = "frozenlake"
    instructions = "frozenlake: walk p to g, avoid holes o. moves: left down right up.\n"

    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = False,
                 invalid_penalty: float = INVALID_PENALTY, goal_reward: float = 1.0, neighbours: bool = False):
        if size < 2:
            raise ValueError(f"frozenlake size must be >= 2, got {size}")
        self.size, self.p, self.is_slippery = size, p, is_slippery
        self.invalid_penalty, self.goal_reward = invalid_penalty, goal_reward
        self.neighbours = neighbours
        self.desc: list[str] = []
        self.pos = (0, 0)
        self.done = False
        self._rng = random.Random(0)

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int) -> str:
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map  # the map generator is gymnasium's

        self.desc = generate_random_map(size=self.size, p=self.p, seed=seed)
        self.pos, self.done = (0, 0), False
        self._rng = random.Random(seed)
        return self.render() + "move: "

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        move = parse_move(action_text)
        if move is None or self.done:
            return "invalid\n" + self.render() + "move: ", self.invalid_penalty, self.done, step_info(False, False, self.tile() == "G")
        if self.is_slippery:
            a = MOVES.index(move)
            move = MOVES[self._rng.choice([(a - 1) % 4, a, (a + 1) % 4])]
        new = self._move(self.pos, move)
        effective = new != self.pos
        self.pos = new
        tile = self.tile()
        success = tile == "G"
        self.done = tile in "GH"
        info = step_info(True, effective, success, move=move)
        if success:
            return "goal reached.\n", self.goal_reward, True, info
        if tile == "H":
            return "you fell in a hole.\n", 0.0, True, info
        prefix = "" if effective else "blocked\n"
        return prefix + self.render() + "move: ", 0.0, False, info

    def state_key(self) -> str:
        return f"{self.pos[0]},{self.pos[1]}"

    def solve(self) -> list[str] | None:
        """Shortest path to the goal avoiding holes (as if not slippery)."""
        def successors(pos):
            for m in MOVES:
                nxt = self._move(pos, m)
                if self.desc[nxt[0]][nxt[1]] != "H":
                    yield m, nxt
        return bfs(self.pos, successors, lambda pos: self.desc[pos[0]][pos[1]] == "G")

    # ------------------------------------------------------------------ helpers
    def tile(self) -> str:
        return self.desc[self.pos[0]][self.pos[1]]

    @property
    def gym_state(self) -> int:
        """The state index gymnasium uses (row * ncol + col)."""
        return self.pos[0] * self.size + self.pos[1]

    def _move(self, pos: tuple[int, int], move: str) -> tuple[int, int]:
        dr, dc = DELTAS[move]
        return (min(max(pos[0] + dr, 0), self.size - 1), min(max(pos[1] + dc, 0), self.size - 1))

    def render(self) -> str:
        rows = []
        for r, line in enumerate(self.desc):
            chars = [_TILE[ch] for ch in line]
            if r == self.pos[0]:
                chars[self.pos[1]] = "p"
            rows.append("".join(chars))
        text = "\n".join(rows) + "\n"
        if self.neighbours:
            text += "around: " + " ".join(f"{m}={self._neighbour(m)}" for m in MOVES) + "\n"
        return text

    def _neighbour(self, move: str) -> str:
        new = self._move(self.pos, move)
        if new == self.pos:
            return "edge"
        return {"H": "hole", "G": "goal"}.get(self.desc[new[0]][new[1]], "ice")

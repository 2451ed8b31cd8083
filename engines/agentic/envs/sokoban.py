"""Sokoban with one box as a text environment (ROLL's SimpleSokoban), with its own room generator.

``gym-sokoban`` (the usual source of rooms) is not used: its 0.0.6 wheel needs the retired ``gym``
package and ``pkg_resources`` at import and draws from the global ``random`` state. The generator
follows its method, made exhaustive: a walled room with a few inner walls (floor kept
connected), the box placed on the target, then *reverse play*: the player walks and pulls the
box behind it; a breadth-first search over all reverse plays gives every start state together
with its shortest solution length, and the room starts from a random one of those needing
1..``max_moves`` moves. Every pull is the reverse of a legal push, so every room is solvable.
Same seed, same room.

Rules: a move into a wall does nothing; a move into the box pushes it when the cell behind it is
floor, otherwise nothing. The box on the target ends the episode (``win_reward``). A box from
which the target can no longer be reached (exact BFS over (player, box) states; with one box that
is cheap) is a deadlock and ends the episode with ``success = False`` and ``info["deadlock"]``.

Text (tiny-tokenizer characters only): ``x`` wall, ``.`` floor, ``t`` target, ``b`` box,
``*`` box on target, ``p`` player, ``+`` player on target; actions ``left down right up``.
With ``neighbours=True`` each rendering ends with one more line naming the four cells next to the
player, ``around: left=wall down=box right=floor up=target`` (the grid made local, as FrozenLake's
option of the same name): a small char-level policy finds the box and the walls there instead of
counting columns. The rules and the grid are unchanged.
"""

from __future__ import annotations

import random

from engines.agentic.envs.base import DELTAS, INVALID_PENALTY, MOVES, bfs, parse_move, step_info

Cell = tuple[int, int]


def _add(a: Cell, d: tuple[int, int], k: int = 1) -> Cell:
    return (a[0] + k * d[0], a[1] + k * d[1])


def _connected(cells: set[Cell]) -> bool:
    if not cells:
        return False
    start = next(iter(cells))
    seen, stack = {start}, [start]
    while stack:
        c = stack.pop()
        for d in DELTAS.values():
            n = _add(c, d)
            if n in cells and n not in seen:
                seen.add(n)
                stack.append(n)
    return len(seen) == len(cells)


def generate_room(seed: int, dim: tuple[int, int] = (6, 6), inner_walls: int = 2,
                  max_moves: int = 8) -> tuple[set[Cell], Cell, Cell, Cell]:
    """(floor cells, target, box, player) of a solvable one-box room whose shortest solution has
    1..``max_moves`` moves; ``dim`` includes the outer wall. Deterministic in ``seed``."""
    h, w = dim
    if h < 4 or w < 4 or (h - 2) * (w - 2) < 4:
        raise ValueError(f"sokoban dim_room must be at least (4, 4) with the wall, got {dim}")
    if max_moves < 1:
        raise ValueError(f"sokoban max_moves must be >= 1, got {max_moves}")
    rng = random.Random(seed)
    for _ in range(1000):
        floor = {(r, c) for r in range(1, h - 1) for c in range(1, w - 1)}
        for _ in range(inner_walls):
            cell = rng.choice(sorted(floor))
            if len(floor) > 4 and _connected(floor - {cell}):
                floor.discard(cell)
        target = rng.choice(sorted(floor))
        dist = _reverse_play(floor, target)
        starts = sorted(s for s, k in dist.items() if 1 <= k <= max_moves)
        if starts:
            player, box = rng.choice(starts)
            return floor, target, box, player
    raise RuntimeError(f"no solvable sokoban room for seed {seed} and dim {dim}")


def _reverse_play(floor: set[Cell], target: Cell) -> dict[tuple[Cell, Cell], int]:
    """Every (player, box) state reachable by reverse play from the solved room (box on target,
    player anywhere), with its shortest forward solution length. Reverse moves: the player walks,
    or walks away from the box and pulls it along (the reverse of a push)."""
    frontier = [(p, target) for p in sorted(floor) if p != target]
    dist = {s: 0 for s in frontier}
    k = 0
    while frontier:
        k += 1
        nxt_frontier = []
        for player, box in frontier:
            for d in DELTAS.values():
                nxt = _add(player, d)
                if nxt not in floor or nxt == box:
                    continue
                candidates = [(nxt, box)]
                if _add(player, d, -1) == box:
                    candidates.append((nxt, player))
                for s in candidates:
                    if s not in dist:
                        dist[s] = k
                        nxt_frontier.append(s)
        frontier = nxt_frontier
    return dist


def _successors(floor: set[Cell]):
    def successors(state):
        player, box = state
        for m in MOVES:
            d = DELTAS[m]
            nxt = _add(player, d)
            if nxt not in floor:
                continue
            if nxt == box:
                pushed = _add(box, d)
                if pushed in floor:
                    yield m, (nxt, pushed)
            else:
                yield m, (nxt, box)
    return successors


def _solve(floor: set[Cell], targets: set[Cell], player: Cell, box: Cell) -> list[str] | None:
    return bfs((player, box), _successors(floor), lambda s: s[1] in targets)


class Sokoban:
    name = "sokoban"
    instructions = "sokoban: push box b onto target t. x wall, p you. moves: left down right up.\n"

    def __init__(self, dim_room: tuple[int, int] = (6, 6), inner_walls: int = 2, max_moves: int = 8,
                 invalid_penalty: float = INVALID_PENALTY, win_reward: float = 1.0, step_penalty: float = 0.0,
                 end_on_deadlock: bool = True, neighbours: bool = False):
        self.dim_room, self.inner_walls, self.max_moves = tuple(dim_room), inner_walls, max_moves
        self.invalid_penalty, self.win_reward, self.step_penalty = invalid_penalty, win_reward, step_penalty
        self.end_on_deadlock, self.neighbours = end_on_deadlock, neighbours
        self.floor: set[Cell] = set()
        self.targets: set[Cell] = set()
        self.box: Cell = (0, 0)
        self.player: Cell = (0, 0)
        self.done = False

    def set_room(self, rows: list[str]) -> str:
        """Load a hand-made room in the text notation (tests, curated levels); returns the observation."""
        self.floor, self.targets, self.done = set(), set(), False
        boxes, players = [], []
        for r, line in enumerate(rows):
            for c, ch in enumerate(line):
                if ch not in "x.tb*p+":
                    raise ValueError(f"sokoban room: unknown tile {ch!r} at row {r}, column {c}")
                if ch != "x":
                    self.floor.add((r, c))
                if ch in "t*+":
                    self.targets.add((r, c))
                if ch in "b*":
                    boxes.append((r, c))
                if ch in "p+":
                    players.append((r, c))
        if len(boxes) != 1 or len(players) != 1 or len(self.targets) != 1:
            raise ValueError(f"sokoban room needs exactly one box, one player and one target; got {len(boxes)}, {len(players)}, {len(self.targets)}")
        self.dim_room = (len(rows), max(len(r) for r in rows))
        self.box, self.player = boxes[0], players[0]
        return self.render() + "move: "

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int) -> str:
        self.floor, target, self.box, self.player = generate_room(seed, self.dim_room, self.inner_walls, self.max_moves)
        self.targets, self.done = {target}, False
        return self.render() + "move: "

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        move = parse_move(action_text)
        if move is None or self.done:
            return "invalid\n" + self.render() + "move: ", self.invalid_penalty, self.done, step_info(False, False, self.box in self.targets, deadlock=False)
        d = DELTAS[move]
        nxt = _add(self.player, d)
        effective = pushed = False
        if nxt in self.floor and nxt != self.box:
            self.player, effective = nxt, True
        elif nxt == self.box and _add(self.box, d) in self.floor:
            self.player, self.box, effective, pushed = nxt, _add(self.box, d), True, True
        success = self.box in self.targets
        deadlock = pushed and not success and self.solve() is None
        info = step_info(True, effective, success, deadlock=deadlock, move=move)
        if success:
            self.done = True
            return "solved.\n", self.win_reward, True, info
        if deadlock and self.end_on_deadlock:
            self.done = True
            return "deadlock: the box is stuck.\n", self.step_penalty, True, info
        prefix = "" if effective else "blocked\n"
        return prefix + self.render() + "move: ", self.step_penalty, False, info

    def state_key(self) -> str:
        return f"{self.player[0]},{self.player[1]};{self.box[0]},{self.box[1]}"

    def solve(self) -> list[str] | None:
        """Shortest move sequence that puts the box on the target (BFS over (player, box))."""
        return _solve(self.floor, self.targets, self.player, self.box)

    def render(self) -> str:
        h, w = self.dim_room
        rows = []
        for r in range(h):
            line = []
            for c in range(w):
                cell = (r, c)
                on_target = cell in self.targets
                if cell == self.player:
                    line.append("+" if on_target else "p")
                elif cell == self.box:
                    line.append("*" if on_target else "b")
                elif cell not in self.floor:
                    line.append("x")
                else:
                    line.append("t" if on_target else ".")
            rows.append("".join(line))
        text = "\n".join(rows) + "\n"
        if self.neighbours:
            text += "around: " + " ".join(f"{m}={self._neighbour(m)}" for m in MOVES) + "\n"
        return text

    def _neighbour(self, move: str) -> str:
        cell = _add(self.player, DELTAS[move])
        if cell == self.box:
            return "box"
        if cell not in self.floor:
            return "wall"
        return "target" if cell in self.targets else "floor"

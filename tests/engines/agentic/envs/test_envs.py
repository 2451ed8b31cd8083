"""Text environments against their rules: FrozenLake vs gymnasium's own env, Sokoban push / win /
deadlock on hand-made rooms, the tool calculator, action parsers on malformed text, solvers."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from engines.agentic.envs import ENVIRONMENTS, make_env
from engines.agentic.envs.base import MOVES, parse_move
from engines.agentic.envs.sokoban import Sokoban, generate_room
from engines.agentic.envs.tool_math import ToolMath, safe_eval
from engines.models.modeling import CHARSET

# options that make an environment's text fit the tiny tokenizer (webshop renders WebShop's [...] by default)
TINY_KWARGS = {"webshop": {"brackets": "()"}}
NOT_TINY = {"tool_table"}        # JSON tool calls and capitals: for real tokenizers only (tests/engines/agentic/envs/test_tool_table.py)


def tiny_env(name: str):
    return make_env(name, **TINY_KWARGS.get(name, {}))


MALFORMED = ["", "   ", "\n\n", "jump", "downn", "left right", "<eos>", "move: up", "?" * 300, "\x00\x01", "l e f t",
             "calc:", "answer:", "calc: 2**99999", "calc: __import__('os')", "answer: lots", "calc: (1+", "calc: 1/0"]


# ------------------------------------------------------------------ parser
def test_parse_move_accepts_words_letters_case_and_trailing_dot():
    assert parse_move("down\n") == "down"
    assert parse_move("  Up.  ") == "up"
    assert parse_move("\nr\nleft") == "right"          # first non-empty line only
    for bad in ["jump", "downn", "left right", "move: up", "", "1"]:
        assert parse_move(bad) is None


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_malformed_actions_are_penalised_counted_and_never_crash(name):
    env = tiny_env(name)
    first = env.reset(3)
    key = env.state_key()
    for text in MALFORMED:
        obs, reward, done, info = env.step(text)
        assert info["valid_action"] is False, text
        assert info["effective"] is False and info["success"] is False
        assert reward == env.invalid_penalty
        assert done is False
        assert env.state_key() == key                     # state unchanged
        assert isinstance(obs, str) and obs.startswith("invalid") and (name in NOT_TINY or set(obs) <= set(CHARSET))
    assert first


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_text_uses_only_the_tiny_tokenizer_charset_and_is_deterministic(name):
    env = tiny_env(name)
    tiny = set(CHARSET) if name not in NOT_TINY else None
    rng = random.Random(0)
    for seed in range(20):
        obs = env.instructions + env.reset(seed)
        assert tiny is None or set(obs) <= tiny, (seed, set(obs) - tiny)
        assert obs == env.instructions + tiny_env(name).reset(seed)     # same seed, same start
        for _ in range(6):
            text = rng.choice(["left", "down", "right", "up", "calc: 3*4", "answer: 12", "xyz", "search(red mug)",
                               "click(next >)", "<answer>12</answer>"])
            obs, _, done, _ = env.step(text)
            assert tiny is None or set(obs) <= tiny
            if done:
                break


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_solver_solves_every_seed(name):
    for seed in range(25):
        env = tiny_env(name)
        env.reset(seed)
        plan = env.solve()
        assert plan, seed
        for k, action in enumerate(plan):
            _, reward, done, info = env.step(action + "\n")
            assert info["valid_action"]
            assert done == (k == len(plan) - 1), (seed, k)
        assert info["success"] and reward > 0


def test_make_env_errors_name_the_problem():
    with pytest.raises(KeyError, match="unknown environment 'chess'"):
        make_env("chess")
    with pytest.raises(TypeError, match="frozenlake"):
        make_env("frozenlake", colour=True)


# ------------------------------------------------------------------ FrozenLake vs gymnasium
@pytest.mark.parametrize("size", [4, 6])
def test_frozenlake_transitions_match_gymnasium(size):
    gym = pytest.importorskip("gymnasium")
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    rng = random.Random(size)
    for seed in range(12):
        ours = make_env("frozenlake", size=size)
        ours.reset(seed)
        ref = gym.make("FrozenLake-v1", desc=generate_random_map(size=size, seed=seed), is_slippery=False)
        state, _ = ref.reset(seed=seed)
        assert ours.desc == generate_random_map(size=size, seed=seed)
        assert ours.gym_state == state
        for _ in range(40):
            a = rng.randrange(4)
            state, reward, terminated, truncated, _ = ref.step(a)
            _, our_reward, done, info = ours.step(MOVES[a] + "\n")
            assert ours.gym_state == state
            assert our_reward == reward and done == terminated
            assert info["valid_action"] and info["success"] == (reward == 1.0)
            if terminated:
                break
        ref.close()


def test_frozenlake_rendering_and_effective_flag():
    env = make_env("frozenlake", size=4)
    obs = env.reset(0)
    assert obs.endswith("move: ") and obs.splitlines()[0][0] == "p"   # start top left
    assert obs.splitlines()[3][3] == "g"
    _, _, _, info = env.step("up")                        # into the border: valid, nothing changes
    assert info["valid_action"] and not info["effective"]
    _, _, _, info = env.step("left")
    assert not info["effective"]
    assert "\x1b" not in obs                              # no colour codes


def test_frozenlake_neighbours_line_names_the_four_adjacent_tiles():
    plain, env = make_env("frozenlake", size=4), make_env("frozenlake", size=4, neighbours=True)
    env.reset(7), plain.reset(7)
    env.desc = plain.desc = ["SFHF", "FFFF", "HFFF", "FFFG"]
    env.pos = plain.pos = (1, 0)
    assert env.render() == plain.render() + "around: left=edge down=hole right=ice up=ice\n"
    env.pos = (3, 2)
    assert env.render().splitlines()[-1] == "around: left=ice down=edge right=goal up=ice"
    assert set(env.render()) <= set(CHARSET)                # the tiny tokenizer can read it


def test_frozenlake_slippery_is_seeded():
    a, b = make_env("frozenlake", is_slippery=True), make_env("frozenlake", is_slippery=True)
    a.reset(5), b.reset(5)
    for m in ["right", "down", "down", "right", "down", "right"]:
        assert a.step(m) == b.step(m)


# ------------------------------------------------------------------ Sokoban rules
def room(rows: str) -> Sokoban:
    env = Sokoban()
    env.set_room(rows.split())
    return env


def test_sokoban_walk_and_wall():
    env = room("""xxxxxx
                  x....x
                  xp.b.x
                  x...tx
                  xxxxxx""")
    _, r, done, info = env.step("left")                   # wall
    assert (info["valid_action"], info["effective"], done, r) == (True, False, False, 0.0)
    assert env.player == (2, 1)
    _, _, _, info = env.step("up")                        # walk
    assert info["effective"] and env.player == (1, 1) and env.box == (2, 3)


def test_sokoban_push_win_and_blocked_push():
    env = room("""xxxxxx
                  x....x
                  x.pbtx
                  x....x
                  xxxxxx""")
    assert env.state_key() == "2,2;2,3"
    obs, r, done, info = env.step("right")                # push the box onto the target
    assert env.box == (2, 4) and env.player == (2, 3)
    assert (r, done, info["success"], info["deadlock"]) == (1.0, True, True, False)
    assert obs == "solved.\n"
    env = room("""xxxxx
                  xpbxx
                  x..tx
                  xxxxx""")
    _, _, done, info = env.step("right")                  # wall behind the box: no push
    assert not info["effective"] and env.box == (1, 2) and not done
    assert env.render() == "xxxxx\nxpbxx\nx..tx\nxxxxx\n"


def test_sokoban_deadlock_in_corner_ends_episode():
    env = room("""xxxxxx
                  x.pb.x
                  x....x
                  x...tx
                  xxxxxx""")
    _, r, done, info = env.step("right")                  # box into the top-right corner
    assert env.box == (1, 4)
    assert (done, info["deadlock"], info["success"], r) == (True, True, False, 0.0)
    assert env.solve() is None


def test_sokoban_deadlock_against_a_wall_without_target():
    env = room("""xxxxxx
                  x....x
                  x..b.x
                  x..p.x
                  x...tx
                  xxxxxx""")
    _, _, done, info = env.step("up")                     # box against the top wall; the target is on row 4
    assert env.box == (1, 3) and done and info["deadlock"]
    env = room("""xxxxxx
                  x....x
                  x..b.x
                  x..p.x
                  x...tx
                  xxxxxx""")
    env.end_on_deadlock = False                           # flagged but the episode goes on
    obs, _, done, info = env.step("up")
    assert info["deadlock"] and not done and obs.endswith("move: ")


def test_sokoban_push_that_keeps_the_room_solvable_is_not_a_deadlock():
    env = room("""xxxxxxx
                  x.....x
                  x.pb..x
                  x.....x
                  x....tx
                  xxxxxxx""")
    _, r, done, info = env.step("right")
    assert env.box == (2, 4) and info["effective"]
    assert (done, info["deadlock"], r) == (False, False, 0.0)
    assert env.solve() is not None


def test_sokoban_player_on_target_and_box_on_target_render():
    env = room("""xxxxx
                  x+..x
                  x.b.x
                  xxxxx""")
    assert env.render().splitlines()[1] == "x+..x"
    env.step("right")
    assert env.render().splitlines()[1] == "xtp.x"
    env.step("left")
    env.step("down")
    env.step("right")                                     # push the box right, off nothing
    assert env.render().splitlines()[2] == "x.pbx"


def test_sokoban_generator_is_seeded_solvable_and_bounded():
    for seed in range(30):
        floor, target, box, player = generate_room(seed, (6, 6), 2, max_moves=6)
        assert (floor, target, box, player) == generate_room(seed, (6, 6), 2, max_moves=6)
        assert box != target and box in floor and player in floor and player != box
        env = make_env("sokoban", max_moves=6)
        env.reset(seed)
        assert 1 <= len(env.solve()) <= 6


def test_sokoban_neighbours_line_names_the_four_adjacent_cells():
    env = room("""xxxxx
                  xtbpx
                  x...x
                  xxxxx""")
    env.neighbours = True
    assert env.render().endswith("x...x\nxxxxx\naround: left=box down=floor right=wall up=wall\n")
    obs, _, _, _ = env.step("down")
    assert obs.splitlines()[-2] == "around: left=floor down=wall right=wall up=floor"
    env.step("left")                                      # now below the box
    assert env.render().splitlines()[-1] == "around: left=floor down=wall right=floor up=box"
    env.step("left")
    assert env.render().splitlines()[-1] == "around: left=wall down=wall right=floor up=target"
    plain = make_env("sokoban", dim_room=(5, 5), inner_walls=0, max_moves=3)
    near = make_env("sokoban", dim_room=(5, 5), inner_walls=0, max_moves=3, neighbours=True)
    assert near.reset(3).startswith(plain.reset(3).removesuffix("move: ")) and near.solve() == plain.solve()


def test_sokoban_bad_room_names_the_tile():
    with pytest.raises(ValueError, match="unknown tile '#'"):
        Sokoban().set_room(["###", "#p#"])


# ------------------------------------------------------------------ tool math
def test_safe_eval_values_and_refusals():
    assert safe_eval("2+3*4") == 14
    assert safe_eval("(2+3)*4") == 20
    assert safe_eval("-7/2") == Fraction(-7, 2)
    assert safe_eval(" 1.5*2 ") == 3
    for bad, why in [("2**10", "Pow"), ("abs(2)", "Call"), ("x+1", "Name"), ("1/0", "division by zero"),
                     ("9" * 20 + "*9", "too large"), ("1+" * 40 + "1", "longer"), ("(1+", "not an arithmetic"),
                     ("'a'", "Constant"), ("", "empty")]:
        with pytest.raises(ValueError, match=why):
            safe_eval(bad)


def test_tool_math_episode():
    env = ToolMath()
    obs = env.reset(1)
    assert obs.endswith("> ") and env.state_key() == "calc:"
    obs, r, done, info = env.step(f"calc: {env.expr}\n")
    assert obs == f"= {env.value}\n> " and (r, done) == (0.0, False)
    assert info["valid_action"] and info["effective"]
    _, _, _, info = env.step(f"Calc: {env.expr}")         # the same value again: valid, not effective
    assert info["valid_action"] and not info["effective"]
    assert env.state_key() == f"calc:{env.value}"
    obs, r, done, info = env.step(f"answer: {env.value + 1}")
    assert (r, done, info["success"]) == (0.0, True, False) and "wrong" in obs
    env.reset(1)
    _, r, done, info = env.step(f"answer: {env.value}.")
    assert (r, done, info["success"]) == (1.0, True, True)

"""engines/agentic/envs/tool_table.py: questions over a generated table, answered through tool calls."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from engines.agentic.envs import make_env
from engines.agentic.envs.tool_table import ToolTable, make_table
from engines.sandbox.isolation import SandboxUnavailable
from engines.agentic.tool_calls import calculate


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_tables_are_seeded_and_the_teacher_expression_computes_the_answer():
    assert make_table(4) == make_table(4) and make_table(4) != make_table(5)
    for seed in range(100):
        rows, question, value, expression = make_table(seed)
        assert 6 <= len(rows) <= 9 and question.endswith("?")
        assert abs(Fraction(calculate(expression)) - value) < Fraction(1, 10 ** 6), seed


def test_kinds_keep_a_subset_of_the_questions():
    """`kinds` draws the question from a subset; the default gives the four kinds over several rows
    (not item_value), and a subset's tables are still solved by the teacher's expression. An unknown
    kind is refused, naming the known ones."""
    from engines.agentic.envs.tool_table import DEFAULT_KINDS, KINDS

    starts = {"value_above": "What is the total value", "total_quantity": "How many",
              "average_price": "What is the average price", "stock_difference": "What is the stock value"}
    assert set(DEFAULT_KINDS) == set(starts) and set(KINDS) == set(starts) | {"item_value"}
    assert {next(k for k, s in starts.items() if make_table(seed)[1].startswith(s)) for seed in range(40)} == set(DEFAULT_KINDS)
    for kinds in (("total_quantity",), ("average_price", "stock_difference")):
        for seed in range(40):
            rows, question, value, expression = make_table(seed, kinds)
            assert any(question.startswith(starts[k]) for k in kinds), (kinds, question)
            assert abs(Fraction(calculate(expression)) - value) < Fraction(1, 10 ** 6)
    env = make_env("tool_table", kinds=["total_quantity"])
    assert env.reset(2).rstrip().endswith("(the sum of their quantities)?")
    with pytest.raises(ValueError, match="expected a non-empty subset of .*item_value"):
        make_env("tool_table", kinds=["median"])


def test_item_value_asks_one_rows_price_times_its_quantity():
    """item_value names one item of the table; its value is that row's price times its quantity, the
    teacher's expression computes it, and the questions spread over the table's rows."""
    picked = set()
    for seed in range(60):
        rows, question, value, expression = make_table(seed, ("item_value",))
        named = [r for r in rows if question == f"What is the {r[0]} stock worth (price times quantity)?"]
        assert len(named) == 1, question
        _, _, price, qty = named[0]
        assert value == price * qty and abs(Fraction(calculate(expression)) - value) < Fraction(1, 10 ** 6)
        picked.add(rows.index(named[0]))
    assert len(picked) >= 5
    env = make_env("tool_table", kinds=["item_value"])
    env.reset(7)
    obs, r, done, info = env.step(f"<answer>{float(env.value):.2f}</answer>")
    assert (r, done, info["success"]) == (1.0, True, True)


def test_episode_tool_call_then_answer():
    env = make_env("tool_table")
    obs = env.reset(3)
    assert obs.startswith("item | category | price | quantity\n") and env.question in obs
    assert "<tools>" in env.instructions and '"name": "calculator"' in env.instructions
    assert env.state_key() == "results:"
    obs, r, done, info = env.step(call("calculator", expression=env.expression))
    assert obs.startswith("<tool_response>\n") and (r, done) == (0.0, False)
    assert info["valid_action"] and info["effective"] and info["tools"] == ["calculator"]
    _, _, _, info = env.step(call("calculator", expression=env.expression))   # same result again: not effective
    assert info["valid_action"] and not info["effective"]
    obs, r, done, info = env.step(f"<answer>{float(env.value) + 1:.2f}</answer>")
    assert (r, done, info["success"]) == (0.0, True, False) and obs.startswith("Wrong")
    env.reset(3)
    _, r, done, info = env.step(f"<answer>{float(env.value):.2f}</answer>")
    assert (r, done, info["success"]) == (1.0, True, True)


@pytest.mark.parametrize("text, why", [
    ("the total is 12", "no <tool_call> and no <answer> found"),
    ("<answer>twelve</answer>", "the answer 'twelve' is not a number"),
    ("So: <answer>12</answer>", "write only <answer>NUMBER</answer>"),
    ("<answer>1</answer><answer>2</answer>", "write only <answer>NUMBER</answer>"),
    (call("calculator", expression="1") + "<answer>1</answer>", "a turn is either a tool call or an answer, not both"),
    ('<tool_call>{"name": "calculator"</tool_call>', "the tool call is not valid json"),
    (call("python", code="print(1)"), "unknown tool 'python'; tools: calculator"),
    (call("calculator", expression="2**9999"), "calculator: exponent 9999 beyond 100"),
])
def test_refused_turns_are_invalid_with_the_reason(text, why):
    env = ToolTable()
    env.reset(0)
    obs, r, done, info = env.step(text)
    assert obs.startswith("invalid: " + why) and r == env.invalid_penalty and not done
    assert not info["valid_action"] and env.state_key() == "results:"


def test_python_tool_option():
    try:
        env = ToolTable(python=True, describe_tools=False)
    except SandboxUnavailable as e:
        pytest.skip(f"the sandbox cannot start on this host: {e}")
    assert "<tools>" not in env.instructions and [s["function"]["name"] for s in env.tool_specs] == ["calculator", "python"]
    env.reset(1)
    rows = [(p, q) for _, _, p, q in env.rows]
    obs, _, _, info = env.step(call("python", code=f"print(sum(q for p, q in {[(float(p), q) for p, q in rows]}))"))
    assert info["valid_action"] and obs == f"<tool_response>\n{sum(q for _, q in rows)}\n</tool_response>\n"


def test_teacher_tool_rate_makes_a_teacher_that_sometimes_answers_without_the_tool():
    """`teacher_tool_rate` < 1: on that share of seeds (drawn from the seed) `solve()` calls the
    calculator, on the rest it answers at once; every demonstration is still right, and the bootstrap
    corpus (`solved_episodes`) is made of exactly those episodes. 1.0 (the default) always calls it."""
    from engines.agentic.env_manager import solved_episodes

    def plays(rate, seed):
        env = make_env("tool_table", teacher_tool_rate=rate, kinds=["total_quantity"])
        env.reset(seed)
        actions = env.solve()
        for a in actions:
            _, r, done, info = env.step(a)
        assert done and info["success"] and r == 1.0, (rate, seed, actions)
        return actions

    direct = [len(plays(0.3, seed)) == 1 for seed in range(200)]
    assert 0.6 < sum(direct) / 200 < 0.8
    assert direct == [len(plays(0.3, seed)) == 1 for seed in range(200)]           # the same seeds every time
    assert all(len(plays(1.0, seed)) == 2 for seed in range(50))
    assert all(len(plays(0.0, seed)) == 1 for seed in range(50))
    corpus = solved_episodes("tool_table", list(range(20)), max_turns=4,
                             env_kwargs={"teacher_tool_rate": 0.3, "kinds": ["total_quantity"]})
    assert [("<tool_call>" in response) for _, response in corpus] == [not d for d in direct[:20]]
    with pytest.raises(ValueError, match="teacher_tool_rate"):
        make_env("tool_table", teacher_tool_rate=1.5)

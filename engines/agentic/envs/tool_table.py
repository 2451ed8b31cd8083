"""Questions over a small generated table, answered with tool calls (calculator, sandboxed Python).

Each episode is a table of 6-9 shop items (item, category, price, quantity) and one question, by
default one that needs several operations: the total value (price × quantity) of the items of a
category with a quantity above a bound, the total quantity of a category, the average price of a
category, or the stock value of the most expensive category item minus the cheapest one's (``kinds``
keeps a subset of ``value_above``, ``total_quantity``, ``average_price``, ``stock_difference``, the
default draw). ``item_value``, drawn only when ``kinds`` names it, asks one named item's stock value:
one row's price times its quantity, easy to read off the table, hard to multiply without the
calculator. The policy calls tools in the Qwen2.5 / Hermes format (``engines/agentic/tool_calls.py``) and ends
the episode with ``<answer>NUMBER</answer>``: reward ``correct_reward`` when it is within
``tolerance`` of the true value, 0 otherwise. A tool result comes back as ``<tool_response>...</tool_response>`` (what
Qwen2.5's template renders for a ``tool`` message inside a user turn); a refused turn (no call and
no answer, malformed JSON, unknown tool, wrong arguments, several calls, text around a call, a
calculator refusal) is an invalid action (``invalid_penalty``, state unchanged) whose observation,
``invalid: <why>``, says what was wrong.

``describe_tools=True`` (default) puts the Hermes tool preamble (``tools_system_prompt``) at the end
of ``instructions`` (kept as ``tools_preamble``), which works with any tokenizer; the env managers
(engines/agentic/env_manager.py ``EnvTurns``) render ``tool_specs`` through a chat template that takes
``tools=`` instead and then drop ``tools_preamble``, so the tools are described once.
``describe_tools=False`` leaves the description to the template (a manager refuses it without one).
``stop``: a turn ends at ``</tool_call>`` or ``</answer>``. ``python=True`` adds the sandboxed
Python tool (bubblewrap; ``make_env`` fails with ``SandboxUnavailable`` on a host without it unless
``allow_weaker`` names a weaker mode). The text uses JSON and capitals, so this environment is for
real tokenizers (SmolLM2, Qwen), not the tiny char-level policy.

``teacher_tool_rate`` (1.0 by default) shapes only ``solve()``, the teacher whose episodes a
policy is pre-trained or warm-started on: on that share of seeds (drawn from the seed, so the same
seeds every time) it calls the calculator, on the others it answers at once, doing the arithmetic in
its head. A student model copies the direct answers' form but not their arithmetic, so below 1 the
warm-started policy answers some questions without the tool and gets them wrong, and RL has to teach
it that calling the calculator pays (as ``env.bootstrap_habit_rate`` gives the grid worlds a habit
to unlearn). The episodes themselves do not change.

State (GiGPO anchors, effective actions): the ordered distinct tool results so far.
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction

from engines.agentic.envs.base import INVALID_PENALTY, step_info, teacher_lapses, teacher_rate
from engines.agentic.tool_calls import call_tools, calculator_tool, python_tool, tool_specs, tools_system_prompt

ITEMS = {
    "fruit": ["apple", "banana", "cherry", "mango", "pear", "plum"],
    "tools": ["hammer", "wrench", "saw", "drill", "pliers", "chisel"],
    "office": ["pen", "stapler", "notebook", "folder", "marker", "ruler"],
    "toys": ["kite", "puzzle", "yo-yo", "ball", "robot", "doll"],
}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


KINDS = ("value_above", "total_quantity", "average_price", "stock_difference", "item_value")   # every question kind
DEFAULT_KINDS = KINDS[:4]   # the default draw: the questions over several rows (item_value reads one row)


def check_kinds(kinds) -> tuple[str, ...]:
    """`kinds` as a tuple; a ValueError naming the known ones unless it is a non-empty subset of KINDS."""
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"tool_table kinds: {list(kinds)!r}; expected a non-empty subset of {list(KINDS)}")
    return tuple(kinds)


def make_table(seed: int, kinds: tuple[str, ...] = DEFAULT_KINDS) -> tuple[list[tuple[str, str, Fraction, int]], str, Fraction, str]:
    """(rows, question, value, expression) for ``seed``: rows are (item, category, price, quantity);
    ``expression`` computes ``value`` from the rows (the teacher's calculator input). The question's
    kind is drawn from ``kinds`` (``DEFAULT_KINDS``, the four over several rows, by default: the same
    tables and questions as a subset gives for the seeds whose draw it keeps)."""
    check_kinds(kinds)
    rng = random.Random(seed)
    cats = rng.sample(sorted(ITEMS), 3)
    rows = []
    for cat in cats:
        for item in rng.sample(ITEMS[cat], rng.randint(2, 3)):
            rows.append((item, cat, Fraction(rng.randint(100, 4000), 100), rng.randint(1, 9)))
    rng.shuffle(rows)
    cat = rng.choice(cats)
    mine = [r for r in rows if r[1] == cat]
    kind = KINDS.index(kinds[rng.randrange(len(kinds))])
    if kind == 0:
        bound = rng.choice(sorted({r[3] for r in mine}))
        bound = max(bound - 1, 0)
        sel = [r for r in mine if r[3] > bound]
        question = f"What is the total value (price times quantity) of the {cat} items with a quantity above {bound}?"
        terms = [f"{_num(r[2])}*{r[3]}" for r in sel]
        value = sum((r[2] * r[3] for r in sel), Fraction(0))
    elif kind == 1:
        question = f"How many {cat} items are in stock in total (the sum of their quantities)?"
        terms = [str(r[3]) for r in mine]
        value = Fraction(sum(r[3] for r in mine))
    elif kind == 2:
        question = f"What is the average price of the {cat} items, rounded to 2 decimals?"
        terms = [f"({'+'.join(_num(r[2]) for r in mine)})/{len(mine)}"]
        value = sum((r[2] for r in mine), Fraction(0)) / len(mine)
    elif kind == 3:
        hi, lo = max(mine, key=lambda r: r[2]), min(mine, key=lambda r: r[2])
        question = (f"What is the stock value (price times quantity) of the most expensive {cat} item "
                    f"minus that of the cheapest {cat} item?")
        terms = [f"{_num(hi[2])}*{hi[3]}-{_num(lo[2])}*{lo[3]}"]
        value = hi[2] * hi[3] - lo[2] * lo[3]
    else:
        item, _, price, qty = rng.choice(rows)
        question = f"What is the {item} stock worth (price times quantity)?"
        terms = [f"{_num(price)}*{qty}"]
        value = price * qty
    return rows, question, value, "+".join(terms)


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.2f}"


def render_table(rows) -> str:
    lines = ["item | category | price | quantity"]
    lines += [f"{item} | {cat} | {_num(price)} | {qty}" for item, cat, price, qty in rows]
    return "\n".join(lines)


def parse_answer(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip().replace(",", "").replace("$", "").rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


class ToolTable:
    name = "tool_table"
    stop = ("</tool_call>", "</answer>")   # a turn ends at its call or its answer (engines/agentic/env_manager.py EnvTurns)

    def __init__(self, invalid_penalty: float = INVALID_PENALTY, correct_reward: float = 1.0, tolerance: float = 0.01,
                 python: bool = False, describe_tools: bool = True, python_timeout_s: float = 3.0,
                 allow_weaker: str | None = None, allow_text: bool = False, kinds: tuple[str, ...] | list[str] = DEFAULT_KINDS,
                 teacher_tool_rate: float = 1.0):
        self.invalid_penalty, self.correct_reward, self.tolerance = invalid_penalty, correct_reward, Fraction(tolerance)
        self.teacher_tool_rate = teacher_rate("tool_table", "teacher_tool_rate", teacher_tool_rate)
        self.kinds = check_kinds(kinds)   # an unknown kind is refused here, not at the first reset
        self.allow_text = allow_text
        tools = [calculator_tool()]
        if python:
            tools.append(python_tool(timeout_s=python_timeout_s, allow_weaker=allow_weaker))
        self.tools = {t.name: t for t in tools}
        self.tool_specs = tool_specs(tools)
        self.instructions = ("Answer the question about the table. Use the tools for arithmetic: write one "
                             "<tool_call> per turn and nothing else. When you know the result, reply "
                             "<answer>NUMBER</answer> and nothing else.\n")
        self.tools_preamble = "\n" + tools_system_prompt(tools) + "\n" if describe_tools else ""
        self.instructions += self.tools_preamble
        self.rows, self.question, self.value, self.expression = [], "", Fraction(0), ""
        self.seed = 0
        self.results: list[str] = []
        self.done = False

    def reset(self, seed: int) -> str:
        self.rows, self.question, self.value, self.expression = make_table(seed, self.kinds)
        self.seed, self.results, self.done = seed, [], False
        return f"{render_table(self.rows)}\n\n{self.question}\n"

    def _invalid(self, why: str) -> tuple[str, float, bool, dict]:
        return f"invalid: {why}\n", self.invalid_penalty, self.done, step_info(False, False, False, error=why)

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return self._invalid("the episode is over")
        answers = _ANSWER.findall(action_text)
        if answers:
            if "<tool_call>" in action_text:
                return self._invalid("a turn is either a tool call or an answer, not both")
            if len(answers) > 1 or (_ANSWER.sub("", action_text).strip() and not self.allow_text):
                return self._invalid("write only <answer>NUMBER</answer>")
            guess = parse_answer(answers[0])
            if guess is None:
                return self._invalid(f"the answer {answers[0].strip()[:40]!r} is not a number")
            self.done = True
            success = abs(guess - self.value) <= self.tolerance
            text = "Correct.\n" if success else f"Wrong, it is {float(self.value):.2f}.\n"
            return text, self.correct_reward if success else 0.0, True, step_info(True, True, success)
        if "<tool_call>" not in action_text:
            return self._invalid("no <tool_call> and no <answer> found")
        turn = call_tools(action_text, self.tools, allow_text=self.allow_text)
        if turn.error is not None:
            return self._invalid(turn.error)
        new = [r for r in turn.results if r not in self.results]
        self.results += new
        return turn.observation + "\n", 0.0, False, step_info(True, bool(new), False, tools=[c.name for c in turn.calls])

    def state_key(self) -> str:
        return "results:" + "|".join(self.results)

    def solve(self) -> list[str] | None:
        """Calculate the question's expression with the calculator (unless done), then answer; on the
        seeds `teacher_tool_rate` leaves out, answer at once."""
        value = f"{float(self.value):.2f}".rstrip("0").rstrip(".")
        answer = f"<answer>{value}</answer>"
        if teacher_lapses(self.seed, self.teacher_tool_rate):
            return [answer]
        call = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": self.expression}}) + \
               "\n</tool_call>"
        done_calc = any(abs(Fraction(r) - self.value) <= self.tolerance for r in self.results if _is_number(r))
        return [answer] if done_calc else [call, answer]


def _is_number(text: str) -> bool:
    return parse_answer(text) is not None


__all__ = ["KINDS", "ToolTable", "make_table", "render_table", "parse_answer"]

"""Tool use over several turns: arithmetic word problems solved with a calculator tool.

Each turn the policy writes one line: ``calc: <expression>`` returns ``= <value>`` from a safe
calculator (an ``ast`` walk over + - * / and parentheses on numbers: no ``eval``, no names, no
powers, bounded length and magnitude), or ``answer: <number>`` ends the episode, reward
``correct_reward`` when it equals the true value. Anything else, or an expression the calculator
refuses, is an invalid action (``invalid_penalty``, state unchanged). Problems are templated
stories (tiny-tokenizer characters only), the same for the same seed.

State (for GiGPO anchor states and the effective-action rate): the ordered list of distinct values
the calculator has returned; a repeated calculation is valid but not effective.
"""

from __future__ import annotations

import ast
import random
from fractions import Fraction

from engines.agentic.envs.base import INVALID_PENALTY, step_info

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b, ast.Div: None}


def safe_eval(expr: str, *, max_len: int = 64, max_abs: int = 10**12) -> Fraction:
    """Exact value of an arithmetic expression of numbers, ``+ - * /``, unary ``-``/``+`` and
    parentheses. ``ValueError`` (with the reason) for anything else, division by zero, an
    expression longer than ``max_len`` characters or an intermediate value beyond ``max_abs``."""
    expr = expr.strip()
    if not expr:
        raise ValueError("empty expression")
    if len(expr) > max_len:
        raise ValueError(f"expression longer than {max_len} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = Fraction(str(node.value))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            value = -value if isinstance(node.op, ast.USub) else value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ValueError("division by zero")
                value = left / right
            else:
                value = _OPS[type(node.op)](left, right)
        else:
            what = node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node
            raise ValueError(f"{type(what).__name__} is not allowed")
        if abs(value) > max_abs:
            raise ValueError("number too large")
        return value

    return walk(tree)


def format_number(value: Fraction) -> str:
    """``17``, ``-3``, ``2.5``: integers exactly, other values to 4 decimals."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.4f}".rstrip("0").rstrip(".")


def parse_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip().rstrip(".").strip())
    except (ValueError, ZeroDivisionError):
        return None


def make_problem(seed: int) -> tuple[str, str, Fraction]:
    """(story, expression, value) for ``seed``; needs two operations, so the calculator helps."""
    rng = random.Random(seed)
    kind = rng.randrange(4)
    if kind == 0:
        b, c = rng.randint(3, 9), rng.randint(3, 12)
        a = b * c + rng.randint(1, 60)
        story, expr = f"a shop has {a} pens. it sells {b} boxes of {c} pens. how many pens are left?", f"{a}-{b}*{c}"
    elif kind == 1:
        a, b = rng.randint(3, 12), rng.randint(4, 15)
        c = rng.randint(1, a * b - 1)
        story, expr = f"tom buys {a} bags of {b} apples and eats {c}. how many apples are left?", f"{a}*{b}-{c}"
    elif kind == 2:
        a, q, c = rng.randint(2, 9), rng.randint(3, 20), rng.randint(1, 9)
        story, expr = f"{a} kids share {a * q} sweets equally, then each gets {c} more. how many sweets does each kid have?", f"{a * q}/{a}+{c}"
    else:
        a, b, c = rng.randint(3, 12), rng.randint(10, 60), rng.randint(1, 9)
        story, expr = f"a train has {a} cars of {b} seats and {c} seats are empty. how many people sit?", f"{a}*{b}-{c}"
    return story, expr, safe_eval(expr)


class ToolMath:
    name = "tool_math"
    instructions = "solve the problem. reply calc: <expression> to use the calculator, or answer: <number> to finish.\n"

    def __init__(self, invalid_penalty: float = INVALID_PENALTY, correct_reward: float = 1.0):
        self.invalid_penalty, self.correct_reward = invalid_penalty, correct_reward
        self.story, self.expr, self.value = "", "", Fraction(0)
        self.results: list[Fraction] = []
        self.done = False

    def reset(self, seed: int) -> str:
        self.story, self.expr, self.value = make_problem(seed)
        self.results, self.done = [], False
        return f"{self.story}\n> "

    def _invalid(self, why: str) -> tuple[str, float, bool, dict]:
        return f"invalid: {why.lower()}\n> ", self.invalid_penalty, self.done, step_info(False, False, False, error=why)

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        line = next((ln.strip().lower() for ln in action_text.splitlines() if ln.strip()), "")
        if self.done:
            return self._invalid("the episode is over")
        if line.startswith("calc:"):
            try:
                value = safe_eval(line[len("calc:"):])
            except ValueError as e:
                return self._invalid(str(e))
            effective = value not in self.results
            if effective:
                self.results.append(value)
            return f"= {format_number(value)}\n> ", 0.0, False, step_info(True, effective, False)
        if line.startswith("answer:"):
            guess = parse_number(line[len("answer:"):])
            if guess is None:
                return self._invalid("the answer is not a number")
            self.done = True
            success = guess == self.value
            text = "correct.\n" if success else f"wrong, it is {format_number(self.value)}.\n"
            return text, self.correct_reward if success else 0.0, True, step_info(True, True, success)
        return self._invalid("expected calc: or answer:")

    def state_key(self) -> str:
        return "calc:" + ",".join(format_number(v) for v in self.results)

    def solve(self) -> list[str] | None:
        """Calculate the story's expression (unless already done), then answer."""
        answer = f"answer: {format_number(self.value)}"
        return [answer] if self.value in self.results else [f"calc: {self.expr}", answer]

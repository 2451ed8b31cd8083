"""Tool calling in the Qwen2.5 / Hermes convention: tool specs, call parsing, the calculator and
the sandboxed Python tool.

The convention (what Qwen2.5's and Hermes' chat templates render, and what their instruct models
write): the tools are JSON-schema function specs handed to
``tokenizer.apply_chat_template(messages, tools=[spec, ...])``, which puts them in the system turn
inside ``<tools></tools>``; the model calls a tool by writing

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3*4+5"}}
    </tool_call>

and the result comes back as a ``tool`` role message, which those templates render as a user
turn holding ``<tool_response>\\n...\\n</tool_response>``. ``tool_response(text)`` is that block, so
an environment whose observation is ``tool_response(result)``, framed as a user turn, gives an
instruct model token for token what its own template gives for a tool message.
``tools_system_prompt(tools)`` is the Hermes system text for tokenizers whose template has no
tool support (or no template: the tiny policy).

Parsing never raises on model text: ``parse_tool_calls`` raises ``ToolCallError`` with a message
meant for the model (malformed JSON, unknown tool, missing / unexpected / mistyped arguments,
more calls than allowed, text outside the tags), and ``call_tools`` turns that, and a tool's own
refusal (``ToolError``), into an error observation. A tool run that fails in its own way (a Python
program that raises) is a result, not an error: the model reads the traceback.

Tools: ``calculator_tool()`` (``simpleeval`` restricted to numbers and ``+ - * / // % **``, unary
``-``/``+``, parentheses; bounded length, exponent and magnitude) and ``python_tool()`` (the program
runs in ``engines.sandbox.runner.run_program`` — bubblewrap, rlimits, a wall-clock limit — and the tool
returns its stdout, or its verdict and the end of stderr). The sandbox takes ~0.1-1 s a call:
real tool latency.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engines.sandbox.isolation import require_isolation
from engines.sandbox.runner import run_program

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


class ToolCallError(ValueError):
    """The model's text holds no well-formed call of a known tool; the message is for the model."""


class ToolError(ValueError):
    """A tool refused its arguments (e.g. the calculator an expression it does not evaluate)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call. ``parameters`` is a JSON schema of an object (``properties``,
    ``required``); ``run(**arguments) -> str`` returns the result text or raises ``ToolError``."""
    name: str
    description: str
    parameters: dict
    run: Callable[..., str] = field(compare=False)

    def spec(self) -> dict:
        """The OpenAI / transformers function spec that ``apply_chat_template(tools=...)`` takes."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolTurn:
    """What one model turn of tool calls gave: the calls made, their results, the observation text
    for the model; ``error`` is set (and ``calls`` may be empty) when the turn was refused."""
    calls: tuple[ToolCall, ...]
    results: tuple[str, ...]
    observation: str
    error: str | None = None


def tool_specs(tools: Sequence[Tool]) -> list[dict]:
    return [t.spec() for t in tools]


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    """The Hermes / Qwen2.5 tool preamble (as their chat templates render it into the system turn)."""
    listed = "\n".join(json.dumps(s) for s in tool_specs(tools))
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tool_response(content: str) -> str:
    """A tool result as Qwen2.5 / Hermes templates render a ``tool`` message's content."""
    return f"<tool_response>\n{content}\n</tool_response>"


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, tools: Mapping[str, Tool], *, max_calls: int = 1,
                     allow_text: bool = False) -> list[ToolCall]:
    """The calls in ``text``, each checked against its tool's schema; ``ToolCallError`` (a message
    for the model) for: no call, an unclosed tag, more than ``max_calls`` calls, text outside the
    tags (unless ``allow_text``), JSON that does not parse or is not ``{"name", "arguments"}``, an
    unknown tool, a missing, unexpected or mistyped argument."""
    bodies = _CALL.findall(text)
    if not bodies:
        if "<tool_call>" in text:
            raise ToolCallError("<tool_call> is not closed by </tool_call>")
        raise ToolCallError("no <tool_call>...</tool_call> found")
    if len(bodies) > max_calls:
        raise ToolCallError(f"{len(bodies)} tool calls in one turn; at most {max_calls} allowed")
    outside = _CALL.sub("", text).strip()
    if outside and not allow_text:
        raise ToolCallError(f"text outside <tool_call></tool_call>: {outside[:60]!r}; write only the call")
    return [_check_call(body, tools) for body in bodies]


def _check_call(body: str, tools: Mapping[str, Tool]) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid json: {e.msg} at character {e.pos}") from None
    if not isinstance(obj, dict) or "name" not in obj:
        raise ToolCallError('a tool call is a json object {"name": ..., "arguments": {...}}')
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):            # some models send the arguments as a json string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError(f"the arguments of {name!r} are not a json object") from None
    if name not in tools:
        raise ToolCallError(f"unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
    if not isinstance(args, dict):
        raise ToolCallError(f"the arguments of {name!r} are not a json object")
    schema = tools[name].parameters
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        raise ToolCallError(f"{name}: missing argument {missing[0]!r}")
    for key, value in args.items():
        if key not in props:
            raise ToolCallError(f"{name}: unexpected argument {key!r}; arguments: {', '.join(props)}")
        want = _JSON_TYPES.get(props[key].get("type", ""), object)
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise ToolCallError(f"{name}: argument {key!r} must be a {props[key].get('type')}, "
                                f"got {type(value).__name__}")
    return ToolCall(name, args)


def call_tools(text: str, tools: Mapping[str, Tool], *, max_calls: int = 1, allow_text: bool = False) -> ToolTurn:
    """Parse ``text`` and run its calls. The observation is one ``tool_response`` block per call
    (Qwen2.5 renders consecutive tool messages so) or, on a refused turn, ``error: <why>``. Never
    raises on the model's text."""
    try:
        calls = parse_tool_calls(text, tools, max_calls=max_calls, allow_text=allow_text)
        results = []
        for c in calls:
            try:
                results.append(tools[c.name].run(**c.arguments))
            except ToolError as e:
                raise ToolCallError(f"{c.name}: {e}") from None
    except ToolCallError as e:
        return ToolTurn((), (), f"error: {e}", error=str(e))
    return ToolTurn(tuple(calls), tuple(results), "\n".join(tool_response(r) for r in results))


# ---------------------------------------------------------------------------------------------- calculator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_ABS = 10 ** 15


def _number(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ToolError(f"{type(x).__name__} values are not allowed, only numbers")
    if isinstance(x, float) and not math.isfinite(x):
        raise ToolError("the result is not a finite number")
    if abs(x) > MAX_ABS:
        raise ToolError(f"number beyond {MAX_ABS:.0e}")
    return x


def _binary(op: Callable) -> Callable:
    def run(a, b):
        a, b = _number(a), _number(b)
        try:
            return _number(op(a, b))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("number too large") from None
    return run


def _power(a, b):
    if abs(_number(b)) > MAX_EXPONENT:
        raise ToolError(f"exponent {b} beyond {MAX_EXPONENT}")
    if _number(a) == 0 and b < 0:
        raise ToolError("division by zero")
    result = a ** b
    if isinstance(result, complex):
        raise ToolError("the result is not a real number")
    return _number(result)


def _evaluator():
    import simpleeval  # the `agentic` extra, like gymnasium for FrozenLake: the registry imports without it

    ev = simpleeval.SimpleEval(names={}, functions={})
    ev.operators = {ast.Add: _binary(operator.add), ast.Sub: _binary(operator.sub), ast.Mult: _binary(operator.mul),
                    ast.Div: _binary(operator.truediv), ast.FloorDiv: _binary(operator.floordiv),
                    ast.Mod: _binary(operator.mod), ast.Pow: _power,
                    ast.USub: lambda a: -_number(a), ast.UAdd: lambda a: +_number(a)}
    ev.nodes = {ast.Expr: ev.nodes[ast.Expr], ast.BinOp: ev.nodes[ast.BinOp], ast.UnaryOp: ev.nodes[ast.UnaryOp],
                ast.Constant: lambda node: _number(node.value)}
    return ev


def calculate(expression: str) -> int | float:
    """Value of an arithmetic expression: numbers, ``+ - * / // % **``, unary ``-``/``+``, parentheses.
    ``ToolError`` for names, calls, attributes, strings, comparisons, anything else; for an
    expression longer than ``MAX_EXPRESSION_CHARS``, an exponent beyond ``MAX_EXPONENT``, a value
    beyond ``MAX_ABS``, division by zero."""
    expression = expression.strip()
    if not expression:
        raise ToolError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression)
    except SyntaxError:
        raise ToolError("not an arithmetic expression") from None
    if len(tree.body) != 1:
        raise ToolError("one expression only")
    from simpleeval import InvalidExpression

    try:
        return _evaluator().eval(expression, previously_parsed=tree.body[0])
    except InvalidExpression as e:
        raise ToolError(f"only numbers and + - * / // % ** are allowed ({type(e).__name__})") from None


def format_value(x: int | float) -> str:
    """``17``, ``-3``, ``2.5``, ``0.3333333333``: integers exactly, other values to 10 significant decimals."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 2 ** 53:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.10f}".rstrip("0").rstrip(".")


def calculator_tool() -> Tool:
    def run(expression: str) -> str:
        return format_value(calculate(expression))
    return Tool("calculator", "Evaluate an arithmetic expression of numbers with + - * / // % ** and parentheses.",
                {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 3*4.5 + 2"}},
                 "required": ["expression"]}, run)


# ---------------------------------------------------------------------------------------------- python

def python_tool(*, timeout_s: float = 3.0, memory_mb: int = 256, max_output_chars: int = 2000,
                allow_weaker: str | None = None) -> Tool:
    """A tool that runs a Python program in ``engines.sandbox.runner`` and returns what it printed (cut to
    ``max_output_chars``); a run that is not ``passed`` returns ``<verdict>:`` and the end of its
    stderr. Checks the sandbox can start here and now (``SandboxUnavailable`` otherwise, naming the
    missing isolation), so a host without bubblewrap fails at construction, not on every call."""
    require_isolation(allow_weaker)

    def run(code: str) -> str:
        v = run_program(code, timeout_s=timeout_s, memory_mb=memory_mb, allow_weaker=allow_weaker)
        if v.verdict == "passed":
            out = v.stdout if v.stdout.strip() else "(no output; print the result)"
        else:
            err = "\n".join(ln for ln in v.stderr.strip().splitlines() if not ln.startswith("[sandbox"))
            out = f"{v.verdict}: {err[-max_output_chars // 2:]}" if err else f"{v.verdict}"
        return out[:max_output_chars].rstrip("\n")
    return Tool("python", "Run a Python 3 program (no network, no files kept) and return what it prints. "
                f"Time limit {timeout_s:g} s.",
                {"type": "object", "properties": {"code": {"type": "string", "description": "the program; print the answer"}},
                 "required": ["code"]}, run)

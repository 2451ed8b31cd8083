"""engines/agentic/tool_calls.py: call parsing under malformed input (each case → its error observation),
the calculator's values and refusals, the Python tool through the real sandbox, and the tools in a
Qwen2.5-style chat template (the environment's tool_response equals the template's tool message)."""

from __future__ import annotations

import json

import pytest

from tests.support.tool_episodes import QWEN25_TEMPLATE

from engines.sandbox.isolation import SandboxUnavailable, isolation
from engines.agentic.tool_calls import (MAX_EXPONENT, Tool, ToolError, calculate, calculator_tool, call_tools, format_value,
                                parse_tool_calls, python_tool, tool_response, tool_specs, tools_system_prompt)

CALC = {"calculator": calculator_tool()}


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ------------------------------------------------------------------ parsing
def test_a_well_formed_call_runs_and_comes_back_as_a_tool_response():
    turn = call_tools(call("calculator", expression="12*3 + 4"), CALC)
    assert turn.error is None and [c.name for c in turn.calls] == ["calculator"]
    assert turn.results == ("40",) and turn.observation == "<tool_response>\n40\n</tool_response>"
    # arguments sent as a JSON string (some models do) are accepted
    turn = call_tools('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>', CALC)
    assert turn.results == ("4",)


@pytest.mark.parametrize("text, error", [
    ("the answer is 4", "no <tool_call>...</tool_call> found"),
    ("", "no <tool_call>...</tool_call> found"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "<tool_call> is not closed by </tool_call>"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}</tool_call>',
     "the tool call is not valid json: Expecting ',' delimiter at character 55"),
    ("<tool_call>calculator(1+1)</tool_call>", "the tool call is not valid json: Expecting value at character 0"),
    ('<tool_call>["calculator"]</tool_call>', 'a tool call is a json object {"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'; tools: calculator"),
    ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "calculator: missing argument 'expression'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
     "calculator: missing argument 'expression'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1", "x": 2}}</tool_call>',
     "calculator: unexpected argument 'x'; arguments: expression"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>',
     "calculator: argument 'expression' must be a string, got int"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "the arguments of 'calculator' are not a json object"),
    (call("calculator", expression="1") + call("calculator", expression="2"), "2 tool calls in one turn; at most 1 allowed"),
    ("Let me compute. " + call("calculator", expression="1"),
     "text outside <tool_call></tool_call>: 'Let me compute.'; write only the call"),
    (call("calculator", expression="x + 1"), "calculator: only numbers and + - * / // % ** are allowed (FeatureNotAvailable)"),
    (call("calculator", expression="2**1000"), f"calculator: exponent 1000 beyond {MAX_EXPONENT}"),
])
def test_malformed_calls_give_their_error_observation_never_a_crash(text, error):
    turn = call_tools(text, CALC)
    assert turn.error == error and turn.observation == f"error: {error}"
    assert turn.calls == () and turn.results == ()


def test_several_calls_and_text_around_them_when_allowed():
    text = "First: " + call("calculator", expression="1+1") + "\nthen " + call("calculator", expression="2*5")
    calls = parse_tool_calls(text, CALC, max_calls=2, allow_text=True)
    assert [c.arguments["expression"] for c in calls] == ["1+1", "2*5"]
    turn = call_tools(text, CALC, max_calls=2, allow_text=True)
    # one tool_response block per call, as Qwen2.5 renders consecutive tool messages
    assert turn.observation == "<tool_response>\n2\n</tool_response>\n<tool_response>\n10\n</tool_response>"


# ------------------------------------------------------------------ calculator
def test_calculator_values():
    assert calculate("3*4+5") == 17 and calculate("(2+3)*(4-1)") == 15 and calculate("-(3)") == -3
    assert calculate("7/2") == 3.5 and calculate("7//2") == 3 and calculate("7%4") == 3 and calculate("2**10") == 1024
    assert format_value(calculate("0.1+0.2")) == "0.3" and format_value(calculate("2.5*4")) == "10"
    assert format_value(calculate("1/3")) == "0.3333333333"


@pytest.mark.parametrize("expr, why", [
    ("9**999999999", "exponent"),                 # huge exponent: refused before computing
    ("2**101", "exponent"),
    ("10**15*10**15", "number beyond"),            # magnitude bound on every intermediate value
    ("x + 1", "FeatureNotAvailable"),              # names
    ("abs(-3)", "FeatureNotAvailable"),            # calls
    ("().__class__", "FeatureNotAvailable"),       # attribute access
    ("(1).real", "FeatureNotAvailable"),
    ("__import__('os')", "FeatureNotAvailable"),
    ("'ab' * 3", "str values are not allowed"),    # strings
    ("True + 1", "bool values are not allowed"),
    ("1 < 2", "FeatureNotAvailable"),              # comparisons, boolean operators, conditionals
    ("1 and 2", "FeatureNotAvailable"),
    ("1 if 1 else 2", "FeatureNotAvailable"),
    ("[1, 2]", "FeatureNotAvailable"),
    ("a = 3", "FeatureNotAvailable"),              # assignment
    ("1; 2", "one expression only"),
    ("1/0", "division by zero"),
    ("0**-1", "division by zero"),
    ("(-8)**0.5", "not a real number"),
    ("1e308*10", "number beyond"),            # floats too
    ("(1+", "not an arithmetic expression"),
    ("", "empty expression"),
    ("1+" * 150 + "1", "longer than"),
])
def test_calculator_refusals(expr, why):
    with pytest.raises(ToolError, match=why.replace("*", r"\*")):
        calculate(expr)


# ------------------------------------------------------------------ python through the real sandbox
def _python_tool_or_skip():
    try:
        return python_tool(timeout_s=2.0)
    except SandboxUnavailable as e:        # no bubblewrap here, and no weaker mode is allowed by default
        pytest.skip(f"the sandbox cannot start on this host ({isolation().mode}): {e}")


def test_python_tool_runs_in_the_sandbox_and_returns_stdout_or_the_verdict():
    py = _python_tool_or_skip()
    tools = {"python": py, **CALC}
    turn = call_tools(call("python", code="rows = [(3, 4.5), (2, 10)]\nprint(sum(q * p for q, p in rows))"), tools)
    assert turn.error is None and turn.results == ("33.5",)
    assert py.run(code="x = 1") == "(no output; print the result)"
    crashed = py.run(code="1/0")                                   # a failing program is a result, not an error
    assert crashed.startswith("crashed:") and "ZeroDivisionError" in crashed
    assert py.run(code="while True: pass").startswith("timeout")    # the time limit holds
    net = py.run(code="import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('reached')")
    assert "reached" not in net


# ------------------------------------------------------------------ chat template
@pytest.fixture
def qwen_tokenizer():
    from engines.models.modeling import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def test_chat_template_renders_the_tools_and_the_preamble_matches(qwen_tokenizer):
    tools = [calculator_tool()]
    system = "Answer with the tools."
    text = qwen_tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "2+2?"}],
                                              tools=tool_specs(tools), add_generation_prompt=True, tokenize=False)
    assert '"name": "calculator"' in text and '"required": ["expression"]' in text
    # the template's system turn is our instructions + the Hermes preamble, character for character
    assert text.startswith("<|im_start|>system\n" + system + "\n\n" + tools_system_prompt(tools) + "<|im_end|>\n")
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_a_model_call_and_our_tool_response_are_what_the_template_renders(qwen_tokenizer):
    """What the model writes (the template's assistant tool_call) parses, and the observation we
    return, framed as a user turn, is token for token the template's ``tool`` message."""
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}]}]
    rendered = qwen_tokenizer.apply_chat_template(msgs, tokenize=False)
    model_turn = rendered.split("<|im_start|>assistant")[1].removesuffix("<|im_end|>\n")
    turn = call_tools(model_turn, CALC)
    assert turn.error is None and turn.results == ("4",)
    with_tool = qwen_tokenizer.apply_chat_template(msgs + [{"role": "tool", "content": turn.results[0]}], tokenize=False)
    assert with_tool == rendered + "<|im_start|>user\n" + turn.observation + "<|im_end|>\n"


def test_tool_spec_shape():
    spec = calculator_tool().spec()
    assert spec["type"] == "function" and spec["function"]["name"] == "calculator"
    assert spec["function"]["parameters"]["required"] == ["expression"]
    assert tool_response("x") == "<tool_response>\nx\n</tool_response>"
    echo = Tool("echo", "echo", {"type": "object", "properties": {"n": {"type": "integer"}}}, lambda n=0: str(n))
    assert call_tools('<tool_call>{"name": "echo", "arguments": {"n": true}}</tool_call>', {"echo": echo}).error == \
        "echo: argument 'n' must be a integer, got bool"

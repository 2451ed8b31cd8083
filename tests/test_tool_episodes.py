"""Tool calls wired into the env managers (engines/env_manager.py EnvTurns): tool_table episodes driven
by a scripted engine that honours stop strings as the HF engine does. A turn ends at the env's own
stop strings (the text the engine would write after `</tool_call>` never reaches the env); a
malformed call gets an error observation and the episode goes on; a real calculator call's
`<tool_response>` is the next observation; a chat template that takes `tools=` renders the tool
specs (the plain-text preamble dropped), one that ignores them keeps the preamble; the lock-step
and asynchronous managers give identical episodes."""

from __future__ import annotations

import string

import pytest

from engines.env_manager import ChatFormat, run_episodes
from engines.generation import Completion, SamplingParams
from engines.modeling import build_char_tokenizer
from tests.support.async_envs import fields, run_async
from tests.test_tool_calls import QWEN25_TEMPLATE

MALFORMED = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 2+}\n</tool_call>'
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23.15*9-20.51*7"}}\n</tool_call>'
ANSWER = "<answer>64.78</answer>"
AFTER = "\nI will now wait for the result."   # what a model may write past its call: cut by the stop string
PLAIN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}"
                  "{% if m['role'] == 'assistant' %}{{ eos_token }}\n{% else %}(end)\n{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>\n{% endif %}")
# takes tools= and renders them its own way (names only), so where the description came from shows
LISTING_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
                    + PLAIN_TEMPLATE)
SAMPLING = SamplingParams(max_new_tokens=200)


class ScriptedToolEngine:
    """Turn k of an episode (k = tool responses + refusals in its prompt so far): a malformed call, a
    real calculator call, then the answer, each followed by text the stop strings must cut. Cuts at
    the first stop string as HFGenerationEngine does (at the token that completes it); a function of
    the prompt only, so deterministic under any batching."""

    def __init__(self, tok):
        self.tok, self.stops = tok, []

    def generate(self, prompt_token_ids, params, abort=None):
        self.stops.append(tuple(params.stop))
        out = []
        for i, p in enumerate(prompt_token_ids):
            prompt = self.tok.decode(p)
            k = prompt.count("<tool_response>") + prompt.count("invalid:")
            ids = self.tok([MALFORMED, CALL, ANSWER][min(k, 2)] + AFTER, add_special_tokens=False)["input_ids"]
            for end in range(1, len(ids) + 1):
                if any(s in self.tok.decode(ids[:end]) for s in params.stop):
                    ids = ids[:end]
                    break
            out.append(Completion(i, 0, ids, [-0.5] * len(ids), "stop", self.tok.decode(ids)))
        return out


def _tokenizer(template: str):
    tok = build_char_tokenizer(string.printable)   # JSON, capitals: the char tokenizer's default set has neither
    tok.chat_template = template
    return tok


def _both(tok, env_kwargs=None):
    def factory():
        return ScriptedToolEngine(tok)
    factory.tok = tok
    engine = factory()
    ref = run_episodes(engine, tok, "tool_table", [0, 1], group_size=2, max_turns=5, max_context_tokens=4000,
                       sampling=SAMPLING, env_kwargs=env_kwargs, chat=True)
    out = run_async("tool_table", [0, 1], G=2, max_turns=5, env_kwargs=env_kwargs, engine_factory=factory, chat=True,
                    max_context_tokens=4000, sampling=SAMPLING)
    return ref, out, engine


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, LISTING_TEMPLATE, PLAIN_TEMPLATE],
                         ids=["qwen25-takes-tools", "listing-takes-tools", "ignores-tools"])
def test_tool_table_episode_refusal_then_real_call_then_answer_both_managers(template):
    from engines.envs import make_env

    tok = _tokenizer(template)
    ref, out, engine = _both(tok)
    assert all(s == ("</tool_call>", "</answer>") for s in engine.stops)   # the env's stop strings, merged into sampling
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]
    for ep in ref:
        assert ep.actions == [MALFORMED, CALL, ANSWER]                      # cut at the stop string, AFTER never sent
        assert ep.valid_actions == [False, True, True] and ep.done and ep.finish_reason == "done"
        assert "invalid: the tool call is not valid json" in ep.env_replies[0]
        assert "<tool_response>\n64.78\n</tool_response>" in ep.env_replies[1]
        assert ep.turn_rewards[:2] == [-0.1, 0.0]
    env = make_env("tool_table")
    observation = env.reset(ref[0].seed)
    fmt = ChatFormat.of(tok)
    first = ref[0].prompt
    if fmt.takes_tools:   # rendered by the template from tool_specs, the plain preamble dropped
        assert first == fmt.first(env.instructions.removesuffix(env.tools_preamble), observation, tools=env.tool_specs)
    else:
        assert first == fmt.first(env.instructions, observation)
    if template is LISTING_TEMPLATE:
        assert "<tools>calculator;</tools>" in first and "# Tools" not in first
    else:   # Qwen2.5's rendering and the env's preamble are the same text: described once either way
        assert first.count("# Tools") == 1 and first.count('"name": "calculator"') == 1


def test_tools_takes_tools_probe():
    assert ChatFormat.of(_tokenizer(QWEN25_TEMPLATE)).takes_tools and ChatFormat.of(_tokenizer(LISTING_TEMPLATE)).takes_tools
    assert not ChatFormat.of(_tokenizer(PLAIN_TEMPLATE)).takes_tools


def test_tools_described_nowhere_is_refused():
    tok = _tokenizer(PLAIN_TEMPLATE)
    with pytest.raises(RuntimeError, match="describe_tools=True"):   # raised at the reset, naming the seed
        run_episodes(ScriptedToolEngine(tok), tok, "tool_table", [0], group_size=1, max_turns=2, max_context_tokens=4000,
                     sampling=SAMPLING, env_kwargs={"describe_tools": False}, chat=True)
    qwen = _tokenizer(QWEN25_TEMPLATE)   # the template describes them: fine, and the prompt has them once
    ep, = run_episodes(ScriptedToolEngine(qwen), qwen, "tool_table", [0], group_size=1, max_turns=2, max_context_tokens=4000,
                       sampling=SAMPLING, env_kwargs={"describe_tools": False}, chat=True)
    assert ep.prompt.count("# Tools") == 1 and ep.env_replies and "invalid: " in ep.env_replies[0]

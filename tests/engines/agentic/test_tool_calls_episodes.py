"""Tool calls wired into the env managers (engines/agentic/env_manager.py EnvTurns): tool_table episodes driven
by a scripted engine that honours stop strings as the HF engine does. A turn ends at the env's own
stop strings (the text the engine would write after `</tool_call>` never reaches the env); a
malformed call gets an error observation and the episode goes on; a real calculator call's
`<tool_response>` is the next observation; a chat template that takes `tools=` renders the tool
specs (the plain-text preamble dropped), one that ignores them keeps the preamble; the lock-step
and asynchronous managers give identical episodes."""

from __future__ import annotations


import pytest

from engines.agentic.env_manager import ChatFormat, run_episodes
from tests.support.async_envs import fields, run_async
from tests.support.tool_episodes import (
    ANSWER, CALL, LISTING_TEMPLATE, MALFORMED, PLAIN_TEMPLATE, QWEN25_TEMPLATE, SAMPLING, ScriptedToolEngine, char_tokenizer,
)


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
    from engines.agentic.envs import make_env

    tok = char_tokenizer(template)
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


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, PLAIN_TEMPLATE, None], ids=["qwen25-takes-tools", "ignores-tools", "no-chat"])
def test_solved_episodes_in_the_chat_format_match_the_managers_layout(template):
    """A warm start's demonstrations (solved_episodes with the chat format: tasks/stages/prepare.py
    `warm_start`) are exactly the text the manager builds when the policy plays the solver's moves:
    the first prompt with the tools, each call cut at its stop string, each tool response framed as a
    user turn; with segments the trained parts are exactly the actions."""
    from engines.agentic.env_manager import solved_episodes
    from engines.agentic.envs import make_env

    tok = char_tokenizer(template or PLAIN_TEMPLATE)
    fmt = ChatFormat.of(tok) if template else None
    for seed in (3, 7):
        env = make_env("tool_table")
        env.reset(seed)
        moves = tuple(env.solve())
        assert moves[0].startswith("<tool_call>") and moves[-1].startswith("<answer>")
        (ep,) = run_episodes(ScriptedToolEngine(tok, moves), tok, "tool_table", [seed], group_size=1, max_turns=4,
                             max_context_tokens=8000, sampling=SAMPLING, chat=fmt is not None)
        (prompt, response), = solved_episodes("tool_table", [seed], max_turns=4, fmt=fmt)
        assert ep.success and ep.actions == list(moves)
        assert (prompt, response) == (ep.prompt, tok.decode(ep.response_token_ids))
        (_, parts), = solved_episodes("tool_table", [seed], max_turns=4, fmt=fmt, segments=True)
        assert [text for text, trained in parts if trained] == ep.actions
        assert [text for text, trained in parts if not trained] == ep.env_replies


def test_tools_takes_tools_probe():
    assert ChatFormat.of(char_tokenizer(QWEN25_TEMPLATE)).takes_tools and ChatFormat.of(char_tokenizer(LISTING_TEMPLATE)).takes_tools
    assert not ChatFormat.of(char_tokenizer(PLAIN_TEMPLATE)).takes_tools


def test_tools_described_nowhere_is_refused():
    tok = char_tokenizer(PLAIN_TEMPLATE)
    with pytest.raises(RuntimeError, match="describe_tools=True"):   # raised at the reset, naming the seed
        run_episodes(ScriptedToolEngine(tok), tok, "tool_table", [0], group_size=1, max_turns=2, max_context_tokens=4000,
                     sampling=SAMPLING, env_kwargs={"describe_tools": False}, chat=True)
    qwen = char_tokenizer(QWEN25_TEMPLATE)   # the template describes them: fine, and the prompt has them once
    ep, = run_episodes(ScriptedToolEngine(qwen), qwen, "tool_table", [0], group_size=1, max_turns=2, max_context_tokens=4000,
                       sampling=SAMPLING, env_kwargs={"describe_tools": False}, chat=True)
    assert ep.prompt.count("# Tools") == 1 and ep.env_replies and "invalid: " in ep.env_replies[0]

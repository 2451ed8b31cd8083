"""Tool-call test helpers: Qwen2.5's chat template (its tool parts verbatim), templates that list or
ignore tools, a scripted engine that ends its text at stop strings as the HF engine does, and the
calls it plays (tests/engines/agentic/test_tool_calls.py, tests/engines/agentic/test_tool_calls_episodes.py, tests/infra/test_env_pool.py)."""

from __future__ import annotations

import string

from engines.generation.engine import Completion, SamplingParams
from engines.models.modeling import build_char_tokenizer

# Qwen2.5-Instruct's chat template, its tool parts verbatim (system turn with <tools>, assistant
# tool_calls as <tool_call> JSON, tool messages as <tool_response> blocks in a user turn).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)



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
    """Turn k of an episode (k = tool responses + refusals in its prompt so far): `script[k]` (by
    default a malformed call, a real calculator call, then the answer), each followed by text the stop
    strings must cut. Cuts at the first stop string as HFGenerationEngine does (at the token that
    completes it); a function of the prompt only, so deterministic under any batching."""

    def __init__(self, tok, script: tuple[str, ...] = (MALFORMED, CALL, ANSWER)):
        self.tok, self.script, self.stops = tok, script, []

    def generate(self, prompt_token_ids, params, abort=None):
        self.stops.append(tuple(params.stop))
        out = []
        for i, p in enumerate(prompt_token_ids):
            prompt = self.tok.decode(p)
            k = prompt.count("<tool_response>") + prompt.count("invalid:")
            ids = self.tok(self.script[min(k, len(self.script) - 1)] + AFTER, add_special_tokens=False)["input_ids"]
            for end in range(1, len(ids) + 1):
                if any(s in self.tok.decode(ids[:end]) for s in params.stop):
                    ids = ids[:end]
                    break
            out.append(Completion(i, 0, ids, [-0.5] * len(ids), "stop", self.tok.decode(ids)))
        return out


def char_tokenizer(template: str):
    tok = build_char_tokenizer(string.printable)   # JSON, capitals: the char tokenizer's default set has neither
    tok.chat_template = template
    return tok

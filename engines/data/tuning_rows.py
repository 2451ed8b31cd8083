"""Demonstration and preference tables: the rows SFT (workflows/sft.py) and DPO (workflows/dpo.py) train on.

Read from the same files as prompt tables (JSONL, CSV or parquet, local or fsspec; engines/data/datasets.py
`read_rows`), validated row by row: a bad row is skipped and reported with its line and the field at
fault, never trained on.

A **demonstration** (`SFTRow`) is one of

- `{"prompt": str, "response": str}` (`completion` is taken for `response`, TRL's prompt-completion form);
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation whose last message is the
  assistant's, the response; the messages before it are the prompt, rendered by the model's chat template.

A **preference pair** (`PreferenceRow`) is `{"prompt", "chosen", "rejected"}`: `prompt` a string or a
list of messages (TRL's conversational form), `chosen` and `rejected` strings or one-message lists
`[{"role": "assistant", "content": ...}]`. A pair whose chosen and rejected responses are identical
carries no preference and is refused.

Both may carry `domain` and `answer` (the final answer a reward checks: then the rows also give an
eval prompt table, and SFT evaluates its versions with the run's rewards) and any other key, kept in
`metadata`. Tables store a conversation's prompt messages as JSON text in `prompt_messages` (`prompt`
is then the last user message, for reports).
"""

from __future__ import annotations

import json
from typing import Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from engines.data.datasets import LoadResult, read_rows, validate_rows
from engines.data.text_lines import DEFAULT_MAX_LINE_BYTES

SFT_COLUMNS = ("prompt", "prompt_messages", "response", "domain", "answer", "metadata")
PREFERENCE_COLUMNS = ("prompt", "prompt_messages", "chosen", "rejected", "domain", "answer", "metadata")
DEFAULT_DOMAIN = "sft"


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr


def _answer_text(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    return v


def _not_blank(v: str, what: str) -> str:
    if not v.strip():
        raise ValueError(f"{what} is blank")
    return v


class _Row(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    domain: StrictStr | None = Field(None, min_length=1)
    answer: StrictStr | None = None
    metadata: dict = Field(default_factory=dict)

    @field_validator("answer", mode="before")
    @classmethod
    def _number_answer(cls, v):
        return _answer_text(v)

    @field_validator("metadata", mode="before")
    @classmethod
    def _null_metadata(cls, v):
        return {} if v is None else v

    def _common(self, prompt: str, messages: list[Message] | None) -> dict:
        extra = {k: v for k, v in (self.model_extra or {}).items()}
        return {"prompt": prompt,
                "prompt_messages": json.dumps([m.model_dump() for m in messages]) if messages is not None else None,
                "domain": self.domain or DEFAULT_DOMAIN, "answer": self.answer,
                "metadata": json.dumps({**extra, **self.metadata}, sort_keys=True)}


def _prompt_text(messages: list[Message]) -> str:
    users = [m.content for m in messages if m.role == "user"]
    return users[-1] if users else messages[-1].content


class SFTRow(_Row):
    """One demonstration: prompt + response, or a conversation ending with the assistant's message."""

    prompt: StrictStr | None = None
    response: StrictStr | None = None
    completion: StrictStr | None = None
    messages: list[Message] | None = None

    @model_validator(mode="after")
    def _one_form(self):
        response = self.response if self.response is not None else self.completion
        if self.messages is not None:
            if self.prompt is not None or response is not None:
                raise ValueError("row has both 'messages' and 'prompt'/'response'; give one form")
            if len(self.messages) < 2:
                raise ValueError("messages: expected at least a prompt message and the assistant's reply, got "
                                 f"{len(self.messages)} message(s)")
            if self.messages[-1].role != "assistant":
                raise ValueError(f"messages: the last message is the response and must be the assistant's, got role "
                                 f"{self.messages[-1].role!r}")
            _not_blank(self.messages[-1].content, "messages[-1].content (the response)")
        else:
            if self.prompt is None or response is None:
                missing = [n for n, v in (("prompt", self.prompt), ("response", response)) if v is None]
                raise ValueError(f"row lacks {' and '.join(map(repr, missing))}; expected prompt + response (or "
                                 "completion), or messages")
            _not_blank(self.prompt, "prompt")
            _not_blank(response, "response")
        return self

    def record(self) -> dict:
        if self.messages is not None:
            return {**self._common(_prompt_text(self.messages[:-1]), self.messages[:-1]),
                    "response": self.messages[-1].content}
        return {**self._common(self.prompt, None),
                "response": self.response if self.response is not None else self.completion}


def _reply(v, what: str) -> str:
    """A response given as a string or as TRL's one-message list [{"role": "assistant", "content": ...}]."""
    if isinstance(v, list):
        if len(v) != 1 or not isinstance(v[0], dict) or v[0].get("role") != "assistant" \
                or not isinstance(v[0].get("content"), str):
            raise ValueError(f"{what}: expected a string or one assistant message [{{'role': 'assistant', 'content': "
                             f"...}}], got {str(v)[:60]}")
        v = v[0]["content"]
    if not isinstance(v, str):
        raise ValueError(f"{what}: expected a string, got {type(v).__name__}")
    return _not_blank(v, what)


class PreferenceRow(_Row):
    """One preference pair: a prompt (text or messages), the chosen and the rejected response."""

    prompt: StrictStr | list[Message]
    chosen: StrictStr | list[dict]
    rejected: StrictStr | list[dict]

    @model_validator(mode="after")
    def _pair(self):
        if isinstance(self.prompt, str):
            _not_blank(self.prompt, "prompt")
        elif not self.prompt:
            raise ValueError("prompt: an empty list of messages")
        chosen, rejected = _reply(self.chosen, "chosen"), _reply(self.rejected, "rejected")
        if chosen == rejected:
            raise ValueError("chosen and rejected are identical: the pair carries no preference")
        return self

    def record(self) -> dict:
        messages = None if isinstance(self.prompt, str) else self.prompt
        text = self.prompt if messages is None else _prompt_text(messages)
        return {**self._common(text, messages), "chosen": _reply(self.chosen, "chosen"),
                "rejected": _reply(self.rejected, "rejected")}


ROW_KINDS = {"sft": (SFTRow, SFT_COLUMNS, "demonstration file"),
             "preference": (PreferenceRow, PREFERENCE_COLUMNS, "preference file")}


def load_rows(uri: str, kind: str, *, storage_options: dict | None = None, default_domain: str | None = None,
              max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> LoadResult:
    """The good rows of a demonstration (`kind` "sft") or preference ("preference") file, and a
    RowError (line, reason) for each bad one; rows without a `domain` take `default_domain`. Raises
    FileNotFoundError (missing file) and ValueError (unknown format, empty or unreadable file, no
    good row), naming the file."""
    model, columns, what = ROW_KINDS[kind]
    rows, notes, long, fmt = read_rows(uri, storage_options=storage_options, max_line_bytes=max_line_bytes, what=what)
    if default_domain:
        rows = [(i, {**r, "domain": r.get("domain") or default_domain} if isinstance(r, dict) else r) for i, r in rows]
    good, errors = validate_rows(rows, model)
    result = LoadResult(pd.DataFrame(good, columns=list(columns), dtype=object), errors, uri, notes,
                        long if fmt != "parquet" else None)
    if not good:
        raise ValueError(f"{what} {uri!r} has no valid row ({len(errors)} rejected): " + result.summary())
    return result


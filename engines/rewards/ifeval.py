"""Instruction-following reward: IFEval verifiable constraints (Zhou et al. 2023, arXiv 2311.07911).

The checkers are the IFEval ones shipped by the `if-verifiable` package (its `ifeval` registry:
25 instruction types, e.g. `change_case:english_lowercase`, `length_constraints:number_words`,
`punctuation:no_comma`, `keywords:existence`, `detectable_format:json_format`). Two of them need
NLTK's punkt data, which cannot be downloaded here: on import this module points the package at
local regex splitters (sentences: the package's own rule-based `split_into_sentences`; words:
`\\w+` runs and punctuation), and never calls `nltk.download` (the package's `ifbench` half,
which downloads at import, is never imported). `langdetect` is seeded so language checks are
deterministic.

`ifeval_reward(response, sample)` reads `sample["metadata"]`:
  instruction_id_list: list[str]     the constraints, ids of `INSTRUCTION_IDS`
  kwargs: list[dict]                 one dict of arguments per constraint (IFEval's format)
  all_or_nothing: bool (False)       1.0 only when every constraint holds (IFEval "prompt-level")
  loose: bool (False)                IFEval's loose mode: also accept the response without its
                                     first/last line or markdown asterisks
and returns the fraction of constraints satisfied (IFEval "instruction-level"), or 0/1 with
`all_or_nothing`. A `<think>...</think>` prefix is ignored. An unknown id raises (a data error).
"""

from __future__ import annotations

import re
import types

import langdetect
from if_verifiable.common import get_loose_transformations, strip_thinking
from if_verifiable.ifeval import instructions_util
from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS, INSTRUCTION_DICT

_WORD = re.compile(r"\w+(?:[-']\w+)*|[^\w\s]+")


def word_tokenize(text: str) -> list[str]:
    """Words (hyphenated/apostrophe words kept whole) and punctuation runs; stands in for
    nltk.word_tokenize, which needs the punkt data."""
    return _WORD.findall(text)


def count_sentences(text: str) -> int:
    """Sentences by the package's rule-based splitter; stands in for nltk's punkt tokenizer."""
    return len([s for s in instructions_util.split_into_sentences(text) if s.strip()])


class _NoNltkData:
    @staticmethod
    def load(resource, *a, **k):
        raise RuntimeError(f"nltk data {resource!r} is not available offline; flyroll supplies local splitters")


# `instructions_util` reaches NLTK through its module global `nltk`: give it a namespace with the
# data-free pieces (RegexpTokenizer for word counts) and the local splitters, leaving the real
# nltk module untouched for anyone else.
import nltk.tokenize as _nltk_tokenize  # noqa: E402

instructions_util.nltk = types.SimpleNamespace(tokenize=_nltk_tokenize, word_tokenize=word_tokenize, data=_NoNltkData)
instructions_util.count_sentences = count_sentences
langdetect.DetectorFactory.seed = 0

INSTRUCTION_IDS: tuple[str, ...] = tuple(sorted(INSTRUCTION_DICT))


def conflicts(instruction_id: str) -> set[str]:
    """Ids that cannot be asked together with `instruction_id` (itself included)."""
    out = {instruction_id} | set(INSTRUCTION_CONFLICTS.get(instruction_id, ()))
    out |= {k for k, v in INSTRUCTION_CONFLICTS.items() if instruction_id in v}
    return out


def _checker(instruction_id: str, kwargs: dict | None, prompt: str):
    """(checker, its description) built from IFEval-format kwargs (None values dropped)."""
    cls = INSTRUCTION_DICT.get(instruction_id)
    if cls is None:
        raise KeyError(f"ifeval: unknown instruction id {instruction_id!r}; known: {list(INSTRUCTION_IDS)}")
    checker = cls(instruction_id)
    text = checker.build_description(**{k: v for k, v in (kwargs or {}).items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        text = checker.build_description(prompt=prompt)
    return checker, text


def describe(instruction_id: str, kwargs: dict | None = None) -> str:
    """The instruction's text as IFEval words it (for building prompts)."""
    return _checker(instruction_id, kwargs, "")[1]


def check_instructions(response: str, instruction_ids: list[str], kwargs_list: list[dict] | None,
                       prompt: str = "", loose: bool = False) -> list[bool]:
    """Whether `response` follows each instruction (IFEval strict, or loose with `loose`)."""
    if kwargs_list is not None and len(kwargs_list) != len(instruction_ids):
        raise ValueError(f"ifeval: {len(instruction_ids)} instruction ids but {len(kwargs_list)} kwargs dicts")
    response = strip_thinking(response or "")
    variants = get_loose_transformations(response) if loose else [response]
    out = []
    for i, iid in enumerate(instruction_ids):
        checker, _ = _checker(iid, kwargs_list[i] if kwargs_list else None, prompt)
        out.append(any(v.strip() and bool(checker.check_following(v)) for v in variants))
    return out


def ifeval_reward(response: str, sample: dict) -> float:
    """Fraction of the sample's instructions followed (or 0/1 with `all_or_nothing`); see module."""
    meta = sample.get("metadata") or {}
    ids = meta.get("instruction_id_list")
    if not ids:
        raise KeyError("ifeval_reward: sample['metadata'] has no 'instruction_id_list'; expected IFEval instruction ids + 'kwargs'")
    followed = check_instructions(response, list(ids), meta.get("kwargs"), sample.get("prompt", ""), bool(meta.get("loose")))
    if meta.get("all_or_nothing"):
        return float(all(followed))
    return sum(followed) / len(followed)

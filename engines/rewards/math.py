"""Rule-based math reward: extract the final answer, check equivalence with math-verify.

`math_reward(response, sample)` is 1.0 when the response's final answer is mathematically
equivalent to `sample["answer"]` (½ = 0.5 = \\frac{1}{2} = 1/2, 2x+1 = 1+2x, {1,2} = {2,1}),
else 0.0. The final answer is the last `\\boxed{...}` (or `\\fbox{...}`); without one, the last
`Answer: ...` or `#### ...` line (GSM8K); without one, the last number in the text.

math-verify's own timeouts use `signal.alarm`, which only works in the main thread; they are
switched off here (`parsing_timeout=None`, `timeout_seconds=None`) and the caller (the reward
worker) bounds each call instead.
"""

from __future__ import annotations

import logging
import re

from math_verify import parse, verify

logging.getLogger("math_verify").setLevel(logging.ERROR)   # "timeout disabled" warning: intended

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LINE = re.compile(r"^(?:.*?\banswer\s*(?:is)?\s*[:=]|\s*####)\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_VULGAR = {"½": "1/2", "⅓": "1/3", "⅔": "2/3", "¼": "1/4", "¾": "3/4", "⅕": "1/5", "⅖": "2/5",
           "⅗": "3/5", "⅘": "4/5", "⅙": "1/6", "⅚": "5/6", "⅛": "1/8", "⅜": "3/8", "⅝": "5/8",
           "⅞": "7/8", "−": "-", "×": "\\times ", "÷": "/"}


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_answer(response: str) -> str | None:
    """The final answer as text: last \\boxed{}, else last `Answer:`/`####` line, else last number."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    lines = [m.group(1) for m in _ANSWER_LINE.finditer(response)]
    if lines and lines[-1].strip(" .$"):
        return lines[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _normalise(text: str) -> str:
    for k, v in _VULGAR.items():
        text = text.replace(k, v)
    return text.strip().strip("$").strip()


def _parse(text: str) -> list:
    return parse(f"${_normalise(text)}$", parsing_timeout=None)


def math_reward(response: str, sample: dict) -> float:
    """1.0 when the final answer of `response` equals `sample["answer"]` up to mathematical
    equivalence, else 0.0. Raises ValueError when the reference answer itself cannot be parsed
    (a data error, which the reward worker flags)."""
    if "answer" not in sample or sample["answer"] is None:
        raise KeyError("math_reward: sample has no 'answer'; expected the reference final answer")
    gold_text = str(sample["answer"])
    gold_text = last_boxed(gold_text) or gold_text
    gold = _parse(gold_text)
    if not gold:
        raise ValueError(f"math_reward: sample['answer']={gold_text!r} could not be parsed by math-verify")
    pred_text = extract_answer(response or "")
    if not pred_text:
        return 0.0
    pred = _parse(pred_text)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0

"""Code reward: run the response's program against the sample's tests in the sandbox.

`code_reward(response, sample)`: the program is the last ```python fenced block of the response
(else the whole text); `sample["tests"]` runs after it in the same namespace (see
`engines.sandbox.runner.split_tests` for the accepted forms). 1.0 when every test passed; with
`sample["metadata"]["partial_credit"]`, the fraction of tests passed; 0.0 for a program that the
sandbox refused (verdict "forbidden"), whatever it passed.

metadata keys read: partial_credit (bool), entry_point (HumanEval: appends `check(entry_point)`
when the tests define `check` but never call it), timeout_s (default 5; in a reward worker process at
most the call's time left minus 1 s, `call_time_left`, so a program that loops scores 0 instead of
timing out the reward call), memory_mb (default 512).
The isolation (bubblewrap required unless a weaker mode is allowed by name) and the work dir's
budget come from the process's sandbox policy (`engines.sandbox.runner.configure`, config
`reward.sandbox`); the score carries the mode that ran it (`CodeScore.isolation`).
"""

from __future__ import annotations

import re

from engines.rewards.calls import call_time_left
from engines.sandbox.runner import run_program

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


class CodeScore(float):
    """The code reward's score, a float that also says which sandbox mode ran the program
    (`isolation`; engines/rewards/calls.py keeps it for the reward/<domain>/isolation_* metrics)."""

    isolation: str = ""

    def __new__(cls, value: float, isolation: str) -> "CodeScore":
        obj = super().__new__(cls, value)
        obj.isolation = isolation
        return obj


def extract_program(response: str) -> str:
    """The last ```python (or ```py) fenced block; else the last unlabelled fenced block; else
    the whole response."""
    blocks = _FENCE.findall(response or "")
    labelled = [body for lang, body in blocks if lang]
    if labelled:
        return labelled[-1]
    if blocks:
        return blocks[-1][1]
    return response or ""


def code_reward(response: str, sample: dict) -> float:
    """Sandboxed test pass rate of the program in `response`: 1.0 / fraction / 0.0 (see module)."""
    tests = sample.get("tests")
    if not tests:
        raise KeyError("code_reward: sample has no 'tests'; expected assert lines or a check() harness")
    joined = tests if isinstance(tests, str) else "\n".join(map(str, tests))
    if not re.search(r"\bassert\b|^\s*check\(|^def check\(", joined, re.M):  # a string literal would "pass"
        raise ValueError(f"code_reward: tests contain no assert and no check() harness: {joined[:120]!r}")
    meta = sample.get("metadata") or {}
    entry = meta.get("entry_point") or sample.get("entry_point")
    if isinstance(tests, str) and entry and re.search(r"^def check\(", tests, re.M) \
            and not re.search(r"^check\(", tests, re.M):
        tests = f"{tests}\n\ncheck({entry})\n"
    timeout_s = float(meta.get("timeout_s", 5.0))
    left = call_time_left()
    if left is not None:   # the program's limit ends inside the reward call's: a program that loops scores 0, not an error
        timeout_s = min(timeout_s, max(0.1, left - 1.0))
    v = run_program(extract_program(response), tests=tests, timeout_s=timeout_s, memory_mb=int(meta.get("memory_mb", 512)))
    if v.verdict == "passed":
        return CodeScore(1.0, v.isolation)
    if v.verdict != "forbidden" and meta.get("partial_credit") and v.tests_total:
        return CodeScore((v.tests_passed or 0) / v.tests_total, v.isolation)
    return CodeScore(0.0, v.isolation)

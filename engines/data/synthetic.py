"""Bundled verifiable tasks for the embedded default: multi-step arithmetic and string reversal.

Each generator is deterministic given (split, index): the train and eval splits draw from
disjoint seeds, so the eval split is fixed forever and never overlaps training prompts.

The bootstrap corpus comes from a deliberately imperfect *teacher*: with probability
`teacher_accuracy` a demonstration is correct, otherwise it shows one systematic, plausible
mistake (forgetting the last arithmetic step; copying instead of reversing). A policy
pre-trained on it can sample the right answer but prefers a wrong habit -- the regime in which
RL with verifiable rewards helps (it must find and reinforce the right behaviour from reward
alone; nothing in RL sees the teacher's labels).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

DOMAINS = ("arithmetic", "reverse")
_LETTERS = string.ascii_lowercase[:10]
_SPLIT_SEED = {"train": 1_000_003, "eval": 7_000_001, "bootstrap": 9_000_011}


@dataclass(frozen=True)
class Problem:
    domain: str
    prompt: str
    answer: str
    mistake: str  # the teacher's systematic wrong answer for this prompt


def _arithmetic(rng: random.Random) -> Problem:
    n_ops = rng.choice((2, 3))
    terms = [rng.randint(0, 9) for _ in range(n_ops)] + [rng.randint(1, 9)]  # a last "+0"/"-0" would make the mistake right
    ops = [rng.choice("+-") for _ in range(n_ops)]
    expr, value = str(terms[0]), terms[0]
    partial = value
    for i, (op, t) in enumerate(zip(ops, terms[1:])):
        expr += f"{op}{t}"
        value = value + t if op == "+" else value - t
        if i < n_ops - 1:
            partial = value
    return Problem("arithmetic", f"{expr}=", str(value), str(partial))


def _reverse(rng: random.Random) -> Problem:
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 6)))
    while word == word[::-1]:
        word = "".join(rng.choice(_LETTERS) for _ in range(len(word)))
    return Problem("reverse", f"rev {word}=", word[::-1], word)


_GENERATORS = {"arithmetic": _arithmetic, "reverse": _reverse}


def make_problems(split: str, n: int, domains: tuple[str, ...] = DOMAINS, seed: int = 0) -> list[Problem]:
    """`n` problems of `split` ("train", "eval" or "bootstrap"), domains interleaved round-robin."""
    if split not in _SPLIT_SEED:
        raise ValueError(f"split must be one of {sorted(_SPLIT_SEED)}, got {split!r}")
    unknown = set(domains) - set(_GENERATORS)
    if unknown:
        raise ValueError(f"unknown synthetic domains {sorted(unknown)}; known: {sorted(_GENERATORS)}")
    rng = random.Random(_SPLIT_SEED[split] + seed)
    eval_prompts: set[str] = set()
    if split != "eval":  # keep training prompts disjoint from the fixed eval split
        eval_prompts = {p.prompt for p in make_problems("eval", 512, domains)}
    out: list[Problem] = []
    while len(out) < n:
        p = _GENERATORS[domains[len(out) % len(domains)]](rng)
        if p.prompt not in eval_prompts:
            out.append(p)
    return out


def teacher_demonstration(p: Problem, rng: random.Random, teacher_accuracy: float) -> str:
    """The teacher's answer: correct with probability `teacher_accuracy`, else its habitual mistake."""
    return p.answer if rng.random() < teacher_accuracy else p.mistake

"""The synthetic tasks (engines/data/synthetic.py) the tiny default trains on: deterministic splits, eval
prompts disjoint from training, correct answers, teacher mistakes that are wrong, and the exact-match
reward they are scored with."""

from __future__ import annotations

import random

import pytest

from engines.models.modeling import CHARSET
from engines.rewards import get_reward
from engines.data.synthetic import DOMAINS, make_problems, teacher_demonstration
from engines.rewards.exact_match import exact_match_reward, extract_answer


def test_synthetic_problems_are_deterministic():
    for split in ("train", "eval", "bootstrap"):
        assert make_problems(split, 40) == make_problems(split, 40)
    assert make_problems("train", 40, seed=1) != make_problems("train", 40)
    assert make_problems("train", 10) == make_problems("train", 40)[:10]  # a prefix is stable
    assert [p.domain for p in make_problems("eval", 6)] == list(DOMAINS) * 3  # round-robin
    assert {p.domain for p in make_problems("train", 6, domains=("reverse",))} == {"reverse"}
    with pytest.raises(ValueError, match="split"):
        make_problems("test", 3)
    with pytest.raises(ValueError, match="unknown synthetic domains"):
        make_problems("train", 3, domains=("poetry",))


def test_eval_split_is_disjoint_from_training_prompts():
    eval_prompts = {p.prompt for p in make_problems("eval", 512)}  # the largest eval split configs allow
    for split in ("train", "bootstrap"):
        assert not eval_prompts & {p.prompt for p in make_problems(split, 3000)}


def test_synthetic_answers_are_correct():
    rng = random.Random(0)
    for p in make_problems("eval", 200) + make_problems("train", 200):
        assert p.prompt.endswith("=")
        assert set(p.prompt) <= set(CHARSET) and set(p.answer) <= set(CHARSET)
        if p.domain == "arithmetic":
            expr = p.prompt[:-1]
            assert int(p.answer) == eval(expr)  # noqa: S307 -- digits and +/- only
            last_op = max(expr.rfind("+"), expr.rfind("-"))
            assert int(p.mistake) == eval(expr[:last_op])  # the teacher forgets the last step
        else:
            word = p.prompt[len("rev ") : -1]
            assert p.prompt.startswith("rev ") and p.answer == word[::-1] and p.mistake == word
            assert word != word[::-1]  # never a palindrome: the mistake is always wrong
        assert teacher_demonstration(p, rng, 1.0) == p.answer and teacher_demonstration(p, rng, 0.0) == p.mistake


def test_teacher_mistakes_are_wrong():
    """BUG (engines/data/synthetic.py, _arithmetic): the last term is drawn from 0..9, and when it is 0
    "forgetting the last step" gives the right answer, so ~10% of the teacher's arithmetic
    "mistakes" are correct and the share of correct demonstrations exceeds `teacher_accuracy`."""
    bad = [p for p in make_problems("bootstrap", 400) if p.mistake == p.answer]
    assert not bad, f"{len(bad)}/400 teacher mistakes equal the answer, e.g. {bad[0].prompt}{bad[0].answer}"


def test_exact_match_reward():
    sample = {"answer": 42}
    assert exact_match_reward("42", sample) == 1.0
    assert exact_match_reward(" 42 \nand then some", sample) == 1.0  # first line, stripped
    assert exact_match_reward("4", sample) == 0.0
    assert exact_match_reward("42 ", {"answer": " 42"}) == 1.0
    assert exact_match_reward("\n42", sample) == 0.0  # the answer is the first line
    assert extract_answer("cba\nrev") == "cba"
    assert get_reward("arithmetic") is exact_match_reward and get_reward("reverse") is exact_match_reward
    with pytest.raises(KeyError, match="poetry.*registered"):
        get_reward("poetry")

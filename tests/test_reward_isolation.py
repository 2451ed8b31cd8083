"""`engines.rewards.score_isolated`: one reward call in a worker pool, with its value checked and a
time limit, so a reward function that raises, hangs or returns garbage gives an isolated failure
that names what was wrong (moved out of tests/test_engines.py)."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

from engines.rewards import score_isolated
from engines.synthetic import exact_match_reward


@pytest.fixture
def pool():
    with cf.ThreadPoolExecutor(max_workers=2) as p:
        yield p


def test_score_isolated_normal_value(pool):
    res, hung = score_isolated(exact_match_reward, "7", {"answer": "7"}, 1.0, pool)
    assert (res.reward, res.error, hung) == (1.0, None, False)
    res, hung = score_isolated(lambda r, s: 0.25, "x", {}, 1.0, pool)
    assert res.reward == 0.25 and res.error is None and res.seconds >= 0


def test_score_isolated_raising_fn(pool):
    def broken(response, sample):
        raise ZeroDivisionError("division by zero in the scorer")

    res, hung = score_isolated(broken, "x", {}, 1.0, pool)
    assert res.reward == 0.0 and not hung
    assert res.error.startswith("ZeroDivisionError") and "division by zero" in res.error


def test_score_isolated_hanging_fn(pool):
    release = threading.Event()

    finished = threading.Event()

    def hangs(response, sample):
        release.wait(2.0)  # "sleeps" 2 s unless released at the end of the test
        finished.set()
        return 1.0

    try:
        res, hung = score_isolated(hangs, "x", {}, 0.2, pool)
        assert res.reward == 0.0 and hung
        assert "timeout" in res.error and res.seconds >= 0.2
        assert not finished.is_set()  # the caller got its answer while the reward call was still stuck
    finally:
        release.set()


@pytest.mark.parametrize("value", [float("nan"), "not a number", None])
def test_score_isolated_bad_values_are_flagged(pool, value):
    res, hung = score_isolated(lambda r, s: value, "x", {}, 1.0, pool)
    assert res.reward == 0.0 and not hung and res.error
    if value != value:
        assert "NaN" in res.error

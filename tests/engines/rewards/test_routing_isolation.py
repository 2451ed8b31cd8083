"""`engines.rewards.score_isolated`: one reward call in a worker pool, with its value checked and a
time limit, so a reward function that raises, hangs or returns garbage gives an isolated failure
that names what was wrong (moved out of tests/test_engines.py)."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

from engines.rewards import score_isolated
from engines.rewards.exact_match import exact_match_reward


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


# --- the code sandbox through the scoring path (issue 41) -------------------------------------------

def test_code_scores_say_which_isolation_ran_them(pool):
    """score_samples sets the sandbox policy from the reward section's `sandbox` and every code result carries the
    mode; reward_metrics counts them per domain as reward/<domain>/isolation_<mode>."""
    import pickle

    import pandas as pd

    from engines.rewards.config import RewardConfig, SandboxConfig
    from engines.rewards.routing import Scored, score_samples
    from engines.rewards.models import ModelRewards
    from engines.sandbox.runner import POLICY
    from engines.sandbox.isolation import isolation

    if not isolation().fs_view:
        pytest.skip("no bubblewrap on this host: the code reward refuses (test_runner_escape covers that)")
    code = "```python\ndef f(x):\n    return x + 1\n```"
    items = [("code", code, {"tests": ["assert f(1) == 2"]}), ("arithmetic", "7", {"answer": "7"})]
    saved = (POLICY.allow_weaker, POLICY.max_disk_mb, POLICY.max_files)
    try:
        reward = RewardConfig(timeout_s=30.0, sandbox=SandboxConfig(max_disk_mb=64, max_files=500))
        out, hung = score_samples(items, reward, pool, ModelRewards(pool))
        assert (POLICY.max_disk_mb, POLICY.max_files) == (64, 500)
    finally:
        POLICY.allow_weaker, POLICY.max_disk_mb, POLICY.max_files = saved
    assert not hung and [tuple(o) for o in out] == [(1.0, None), (1.0, None)]
    assert out[0].isolation == isolation().mode and out[1].isolation is None
    back = pickle.loads(pickle.dumps(out[0]))          # crosses Ray as a pickle
    assert type(back) is Scored and back.isolation == out[0].isolation and tuple(back) == (1.0, None)
    try:
        from tasks.actors.pools import ScoredList, reward_metrics, with_rewards
    except ImportError as e:        # tasks/ needs flytekit and ray
        pytest.skip(f"tasks.stages.scoring not importable: {e}")
    df = pd.DataFrame({"domain": ["code", "code", "arithmetic"], "group_id": [0, 0, 1],
                       "response_token_ids": [[1, 2], [3], [4]]})
    scored = with_rewards(df, ScoredList([1.0, 0.0, 1.0], [out[0].isolation, out[0].isolation, None]), [None] * 3)
    m = reward_metrics(scored)
    assert m[f"reward/code/isolation_{isolation().mode}"] == 2.0
    assert not any(k.startswith("reward/arithmetic/isolation_") for k in m)


def test_sandbox_unavailable_fails_the_scoring_not_one_sample(pool, monkeypatch):
    """A worker that cannot run bubblewrap (and was allowed no weaker mode) raises for the batch,
    with the reason and the fix, instead of scoring code samples 0 one by one."""
    from engines.sandbox import isolation as sandbox_isolation
    from engines.rewards.code import code_reward
    from engines.sandbox.isolation import SandboxUnavailable

    weak = sandbox_isolation.Isolation("plain", (), False, False)
    monkeypatch.setattr(sandbox_isolation, "_probed", lambda: (weak, "bubblewrap (`bwrap`) is not on PATH"))
    with pytest.raises(SandboxUnavailable, match="Refusing to run model code.*apt-get install bubblewrap"):
        score_isolated(code_reward, "```python\nprint(1)\n```", {"tests": ["assert True"]}, 5.0, pool)

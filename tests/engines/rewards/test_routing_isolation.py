"""engines/rewards/routing.py `score_samples` with the code sandbox, the batch's error-rate check and the routes check
(the calls' own isolation -- timeouts, crashes, values -- is tests/engines/rewards/test_calls.py)."""

from __future__ import annotations

import pytest

from engines.rewards.calls import Call, RewardCalls
from engines.rewards.code import code_reward


@pytest.fixture(scope="module")
def calls():
    with RewardCalls(2) as c:
        yield c


def _no_bwrap_code_reward(response, sample):
    """The code reward in a worker that finds no bubblewrap (the probe replaced in that process)."""
    from engines.sandbox import isolation as sandbox_isolation

    weak = sandbox_isolation.Isolation("plain", (), False, False)
    sandbox_isolation._probed = lambda: (weak, "bubblewrap (`bwrap`) is not on PATH")
    return code_reward(response, sample)


# --- the code sandbox through the scoring path (issue 41) -------------------------------------------

def test_code_scores_say_which_isolation_ran_them(calls):
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
        out, hung = score_samples(items, reward, calls, ModelRewards(None))
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


def test_sandbox_unavailable_fails_the_scoring_not_one_sample():
    """A worker that cannot run bubblewrap (and was allowed no weaker mode) raises for the batch,
    with the reason and the fix, instead of scoring code samples 0 one by one."""
    from engines.sandbox.isolation import SandboxUnavailable

    with RewardCalls(1) as fresh, pytest.raises(SandboxUnavailable, match="Refusing to run model code.*apt-get install bubblewrap"):
        fresh.run([Call("code", _no_bwrap_code_reward, "```python\nprint(1)\n```", {"tests": ["assert True"]})])


# --- values, error rates and routes (issue 60) -------------------------------------------------------

def test_every_value_is_checked_against_its_domain_bounds(calls):
    """Reward functions' values (in the workers) and the batch as a whole (here) must be finite and in bounds:
    reward.bounds per domain, reward.max_abs elsewhere."""
    from engines.rewards.config import RewardConfig
    from engines.rewards.models import ModelRewards
    from engines.rewards.routing import score_samples

    reward = RewardConfig(functions={"inf": "tests.support.hostile_rewards:infinite", "big": "tests.support.hostile_rewards:huge",
                                     "graded": "tests.support.rewards:graded"},
                          bounds={"graded": (0.0, 0.75)})
    items = [("inf", "x", {}), ("big", "x", {}), ("graded", "1", {}), ("graded", "a", {}), ("arithmetic", "7", {"answer": "7"})]
    out, hung = score_samples(items, reward, calls, ModelRewards(None))
    assert not hung and [o[0] for o in out] == [0.0, 0.0, 0.0, 0.5, 1.0]
    assert "reward is inf" in out[0][1] and "outside [-1e+06, 1e+06]" in out[1][1]
    assert "1 is outside [0, 0.75]" in out[2][1] and out[3][1] is None and out[4][1] is None


def test_a_domain_over_the_error_rate_fails_naming_function_domain_and_an_example():
    from engines.rewards.config import RewardConfig
    from engines.rewards.routing import RewardErrorRate, check_error_rate

    reward = RewardConfig(functions={"qa": "my_pkg.rewards:qa"})
    rows = [("qa", {}, "ValueError: cannot parse 'x'")] * 3 + [("qa", {}, None)] + [("arithmetic", {}, None)] * 4
    with pytest.raises(RewardErrorRate) as e:
        check_error_rate(rows, reward, "iteration 2's scoring")
    msg = str(e.value)
    for part in ("iteration 2's scoring", "domain 'qa'", "'my_pkg.rewards:qa'", "3 of 4 rows", "75%",
                 "reward.max_error_rate 0.5", "ValueError: cannot parse 'x'"):
        assert part in msg, part
    assert check_error_rate(rows, RewardConfig(max_error_rate=0.75), "eval") == {"qa": 3, "arithmetic": 0}   # 75% is not over
    assert check_error_rate(rows[3:], reward, "eval") == {"qa": 0, "arithmetic": 0}


def test_a_domain_nothing_can_score_is_refused_with_every_cause():
    from engines.rewards.config import RewardConfig
    from engines.rewards.routing import check_routes

    reward = RewardConfig(functions={"qa": "judge"})
    rows = [("arithmetic", {}), ("poetry", {}), ("qa", {}), ("mathish", {"metadata": {"reward_fn": "reasoning_gym"}}),
            ("other", {"metadata": {"reward_fn": "no_such.module:fn"}})]
    with pytest.raises(ValueError) as e:
        check_routes(rows, reward, "data.sources")
    msg = str(e.value)
    assert "domain 'poetry': no reward function for domain 'poetry'" in msg
    assert "domain 'qa' (routed to 'judge'): domain routes to 'judge' but reward.judge.model is not set" in msg
    assert "domain 'other' (routed to 'no_such.module:fn')" in msg and "cannot be imported" in msg
    assert "domain 'arithmetic'" not in msg and "domain 'mathish'" not in msg and "reward.functions" in msg
    check_routes(rows[:1], reward, "data.sources")   # a scorable domain passes

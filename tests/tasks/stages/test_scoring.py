"""Scoring in real Ray reward workers: a reward that raises, hangs or kills its worker costs only its
own sample (reward 0, error kept), and every other sample is still scored."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from configs.schema import parse_config
from tasks.run.types import RunSpec

REPO = Path(__file__).resolve().parents[3]
ROUTES = {d: f"tests.support.hostile_rewards:{d}" for d in ("ok", "boom", "hang", "crash")}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_workers_left(ray_local):
    """Each test's reward workers are killed after it: they reserve CPUs of this 2-CPU Ray, and a worker no hang
    tainted stays alive for the next scoring of its run."""
    import ray

    yield
    for a in ray.util.list_named_actors(all_namespaces=True):
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))


def _spec(tmp_path, workers: int) -> RunSpec:
    cfg = parse_config({"reward": {"functions": ROUTES, "timeout_s": 1.0, "num_workers": workers}})
    return RunSpec(cfg.to_json(), cfg.hash(), f"t{os.getpid()}-{workers}", str(tmp_path), "", "")


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_rewards_cost_only_their_sample(ray_local, tmp_path, workers):
    from tasks.actors.pools import score_table

    domains = ["ok", "boom", "ok", "hang", "ok", "crash", "ok", "arithmetic", "ok"]
    df = pd.DataFrame({"domain": domains, "response": ["7"] * len(domains), "prompt": ["3+4="] * len(domains),
                       "answer": ["7"] * len(domains)})
    rewards, errors = score_table(_spec(tmp_path, workers), df)
    by = list(zip(domains, rewards, errors))
    assert [r for d, r, e in by if d == "ok"] == [1.0] * 5 and all(e is None for d, r, e in by if d == "ok")
    assert by[7] == ("arithmetic", 1.0, None)  # the built-in reward still routes by domain name
    assert by[1][1] == 0.0 and by[1][2].startswith("ValueError: cannot parse")
    assert by[3][1] == 0.0 and "timeout after 1s in reward function 'tests.support.hostile_rewards:hang'" in by[3][2]
    assert by[5][1] == 0.0 and "'tests.support.hostile_rewards:crash' killed its worker process (exit code 3)" in by[5][2]


def test_unknown_reward_function_is_named(ray_local, tmp_path):
    from tasks.actors.pools import score_table

    df = pd.DataFrame({"domain": ["nosuch"], "response": ["x"], "prompt": ["p"], "answer": ["a"]})
    rewards, errors = score_table(_spec(tmp_path, 1), df)
    assert rewards == [0.0] and "no reward function for domain 'nosuch'" in errors[0]


def test_a_reward_that_fails_on_most_rows_fails_the_batch_naming_it(ray_local, tmp_path):
    """inf is no score (issue 60): every 'qa' row is an error, and the batch fails over reward.max_error_rate
    naming the function, the domain and an example; the 'ok' rows beside it are scored."""
    from engines.rewards.routing import RewardErrorRate
    from tasks.actors.pools import check_reward_errors, reward_metrics, score_table, with_rewards

    cfg = parse_config({"reward": {"functions": {"qa": "tests.support.hostile_rewards:infinite", **ROUTES}}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), f"t{os.getpid()}-rate", str(tmp_path), "", "")
    df = pd.DataFrame({"domain": ["qa", "ok"] * 3, "response": ["7"] * 6, "prompt": ["p"] * 6, "answer": ["7"] * 6,
                       "group_id": [0, 0, 1, 1, 2, 2], "response_token_ids": [[1]] * 6})
    scored = with_rewards(df, *score_table(spec, df))
    assert scored["reward"].tolist() == [0.0, 1.0] * 3
    assert reward_metrics(scored)["reward/qa/errors"] == 3.0
    with pytest.raises(RewardErrorRate, match=r"iteration 4's scoring: the reward of domain 'qa' \(function "
                                              r"'tests.support.hostile_rewards:infinite'\) failed on 3 of 3 rows.*reward is inf"):
        check_reward_errors(cfg.reward, scored, "iteration 4's scoring")


def test_hanging_rewards_are_bounded_by_the_batch_budget_and_named_in_the_metrics(ray_local, tmp_path):
    """Eight calls that each hang 60 s, with reward.timeout_s 1 s and reward.budget_s 2 s, in one reward worker of 2
    processes: scoring returns within the budget (plus the kill), every hang is flagged naming the function, and
    reward/timeouts/<function> counts them. The old thread pool waited 1 s per call, one call after another."""
    import time

    from tasks.actors.pools import reward_metrics, score_table, with_rewards

    cfg = parse_config({"reward": {"functions": ROUTES, "timeout_s": 1.0, "budget_s": 2.0}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), f"t{os.getpid()}-budget", str(tmp_path), "", "")
    warm = pd.DataFrame({"domain": ["ok"], "response": ["7"], "prompt": ["p"], "answer": ["7"]})
    assert score_table(spec, warm)[0] == [1.0]   # the worker and its processes are up
    df = pd.DataFrame({"domain": ["hang"] * 8, "response": ["7"] * 8, "prompt": ["p"] * 8, "answer": ["7"] * 8,
                       "group_id": list(range(8)), "response_token_ids": [[1]] * 8})
    t0 = time.monotonic()
    rewards, errors = score_table(spec, df)
    wall = time.monotonic() - t0
    assert wall < 2.0 + 4.0, wall
    assert rewards == [0.0] * 8 and all("'tests.support.hostile_rewards:hang'" in e for e in errors)
    assert sum("timeout after 1s" in e for e in errors) >= 2 and any("reward.budget_s" in e for e in errors)
    m = reward_metrics(with_rewards(df, rewards, errors))
    assert m["reward/hang/timeouts"] == m["reward/timeouts/tests.support.hostile_rewards_hang"] >= 2

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
    assert by[3][1] == 0.0 and "timeout after 1.0s" in by[3][2]
    assert by[5][1] == 0.0 and "crashed" in by[5][2]


def test_unknown_reward_function_is_named(ray_local, tmp_path):
    from tasks.actors.pools import score_table

    df = pd.DataFrame({"domain": ["nosuch"], "response": ["x"], "prompt": ["p"], "answer": ["a"]})
    rewards, errors = score_table(_spec(tmp_path, 1), df)
    assert rewards == [0.0] and "no reward function for domain 'nosuch'" in errors[0]

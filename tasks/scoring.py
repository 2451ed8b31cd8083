"""Scoring: verifiable rewards per domain in reward-worker actors; a broken reward costs one sample."""

from __future__ import annotations

import numpy as np
import pandas as pd
import ray
from flytekit import task

from infra.ray_session import actor_pool, is_local_execution, kill_pool
from infra.resources import actor_options, ray_job, task_resources
from tasks.common import check_columns, config_of, console, stage
from tasks.types import RunSpec
from tasks.workers import RewardWorker


def _items(df: pd.DataFrame) -> list[tuple[str, str, dict]]:
    keep = [c for c in ("prompt", "answer", "domain", "tests", "metadata") if c in df.columns]
    return [(row["domain"], row["response"], {k: row[k] for k in keep}) for _, row in df.iterrows()]


def score_table(spec: RunSpec, df: pd.DataFrame, role: str = "reward") -> tuple[list[float], list[str | None]]:
    """Rewards and errors for every row. Raises and timeouts are isolated per call inside a worker; a
    worker that hangs is replaced after its batch; a worker that crashes has its rows re-scored one
    by one in fresh workers, so only the sample that kills a worker is lost (scored 0, flagged)."""
    cfg = config_of(spec)
    n, timeout, routes = cfg.reward.num_workers, cfg.reward.timeout_s, dict(cfg.reward.functions)
    opts = actor_options("scoring", is_local_execution())
    items = _items(df)
    shards = [s for s in np.array_split(np.arange(len(items)), n) if len(s)]
    workers = actor_pool(RewardWorker, role, n, spec.run_id, {}, opts)
    futures = [w.score.remote([items[i] for i in s], timeout, routes) for w, s in zip(workers, shards)]
    rewards: list[float] = [0.0] * len(items)
    errors: list[str | None] = [None] * len(items)
    tainted = False
    for shard, fut in zip(shards, futures):
        try:
            results, hung = ray.get(fut)
            tainted |= hung
        except ray.exceptions.RayActorError:
            console.print(f"[yellow]a reward worker died; re-scoring its {len(shard)} samples one by one[/]")
            kill_pool(role, n, spec.run_id)
            results = []
            for i in shard:
                solo = actor_pool(RewardWorker, f"{role}-solo", 1, spec.run_id, {}, opts)[0]
                try:
                    (res,), hung = ray.get(solo.score.remote([items[i]], timeout, routes))
                    tainted |= hung
                except ray.exceptions.RayActorError as e:
                    res = (0.0, f"reward worker crashed: {type(e).__name__}")
                    kill_pool(f"{role}-solo", 1, spec.run_id)
                results.append(res)
        for i, (r, e) in zip(shard, results):
            rewards[int(i)], errors[int(i)] = r, e
    if tainted:  # threads stuck in a hung reward call: replace the workers
        kill_pool(role, n, spec.run_id)
    return rewards, errors


@task(task_config=ray_job("scoring"), **task_resources("scoring"))
def score(spec: RunSpec, batch: pd.DataFrame, iteration: int) -> pd.DataFrame:
    """Adds `reward` and `reward_error` to every row."""
    check_columns(batch, "rollout")
    metrics: dict[str, float] = {}
    with stage(spec, "scoring", iteration, metrics):
        rewards, errors = score_table(spec, batch)
        df = batch.copy()
        df["reward"] = rewards
        df["reward_error"] = errors
        metrics["reward/mean"] = float(np.mean(rewards))
        metrics["reward/errors"] = float(sum(e is not None for e in errors))
        metrics["reward/accuracy"] = float(np.mean([r >= 1.0 for r in rewards]))
        for domain, grp in df.groupby("domain"):
            metrics[f"reward/{domain}/mean"] = float(grp["reward"].mean())
            metrics[f"reward/{domain}/accuracy"] = float((grp["reward"] >= 1.0).mean())
            metrics[f"reward/{domain}/response_length"] = float(grp["response_token_ids"].map(len).mean())
        solved = df.groupby("group_id")["reward"].agg(["min", "max"])
        metrics["reward/groups_all_equal_frac"] = float((solved["min"] == solved["max"]).mean())
    return df

"""Scoring: verifiable rewards per domain in reward-worker actors; a broken reward costs one sample.

With dynamic sampling (`algorithm.filter_groups`, DAPO arXiv 2503.14476) the stage also drops the
groups whose rewards are all equal (zero group-relative advantage) and refills the batch: it samples
groups for further prompts with the rollout's generation actors, scores them and keeps the informative
ones, until it has `rollout.prompts_per_iteration` groups or has made
`algorithm.max_generation_rounds` generation calls (the rollout's included); then it trains on what
it has (on the unfiltered batch when no group at all is informative). Refill prompts are drawn
with the rollout's `data.domain_weights` when they are set (`refill_prompts`). Refills run where
generation runs: the rollout task calls `score_batch` with its own actors (its Ray cluster is the
one sized for them; a generation actor created here would ask the scoring cluster for a GPU it does
not have), logging it as this stage, and the `score` task passes the scored table through.

Domains routed to a model reward (`judge`, `reward_model`) are scored in batches by a model each
reward worker loads once (engines/rewards/models.py).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import ray
from flytekit import task

from infra.ray_session import actor_pool, is_local_execution, kill_pool
from infra.resources import actor_options_for, ray_job, role_devices, task_resources
from tasks.common import check_columns, config_of, console, stage
from tasks.types import RunSpec
from tasks.workers import RewardWorker


def _items(df: pd.DataFrame) -> list[tuple[str, str, dict]]:
    from engines.datasets import decode_nested

    df = decode_nested(df)  # tests/metadata travel through parquet as JSON text
    keep = [c for c in ("prompt", "answer", "domain", "tests", "metadata") if c in df.columns]
    return [(row["domain"], row["response"], {k: row[k] for k in keep}) for _, row in df.iterrows()]


def score_table(spec: RunSpec, df: pd.DataFrame, role: str = "reward") -> tuple[list[float], list[str | None]]:
    """Rewards and errors for every row. Raises and timeouts are isolated per call inside a worker; a
    worker that hangs is replaced after its batch; a worker that crashes has its rows re-scored one
    by one in fresh workers, so only the sample that kills a worker is lost (scored 0, flagged).
    Domains routed to `judge` / `reward_model` are scored in timed batches by a model each worker
    loads once and keeps (engines/rewards/models.py)."""
    cfg = config_of(spec)
    n, timeout, routes = cfg.reward.num_workers, cfg.reward.timeout_s, dict(cfg.reward.functions)
    device, dtype = role_devices(cfg, "reward")["reward"]  # where the reward workers' models live
    models = {"judge": {**cfg.reward.judge.model_dump(), "device": device, "dtype": dtype},
              "reward_model": {**cfg.reward.reward_model.model_dump(), "device": device, "dtype": dtype}}
    opts = actor_options_for(cfg, "reward", is_local_execution())
    items = _items(df)
    shards = [s for s in np.array_split(np.arange(len(items)), n) if len(s)]
    workers = actor_pool(RewardWorker, role, n, spec.run_id, {}, opts)
    futures = [w.score.remote([items[i] for i in s], timeout, routes, models) for w, s in zip(workers, shards)]
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
                    (res,), hung = ray.get(solo.score.remote([items[i]], timeout, routes, models))
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


def informative_groups(cfg, df: pd.DataFrame) -> list:
    """group_ids that `objective.select_groups` keeps (rewards not all equal), in order of appearance."""
    import torch

    from engines.algorithms.objective import select_groups

    codes, _ = pd.factorize(df["group_id"])
    keep, _ = select_groups(cfg.algorithm, torch.as_tensor(df["reward"].to_numpy(dtype=np.float32)),
                            torch.as_tensor(codes, dtype=torch.long))
    return list(dict.fromkeys(df["group_id"][keep.numpy()]))


def _scored(spec: RunSpec, df: pd.DataFrame) -> pd.DataFrame:
    rewards, errors = score_table(spec, df)
    df = df.copy()
    df["reward"] = rewards
    df["reward_error"] = pd.Series(errors, index=df.index, dtype=object)  # None, not NaN (pandas 3 infers str)
    return df


def refill_prompts(cfg, train: pd.DataFrame, n: int, iteration: int, round_: int) -> pd.DataFrame:
    """Candidate prompts for a refill of `iteration` after `round_` generation rounds (1 = the
    rollout's only, so the first refill): a fresh draw mixed by
    `data.domain_weights` (per-domain quotas, as the rollout draws its batch) when weights are set,
    else a slice of a per-round reshuffle of the train split. The caller drops prompts already used
    this iteration, so the kept mix can differ from the weights by those."""
    if cfg.data.domain_weights:  # the rollout's own draw is seed * 1_000_003 + iteration
        from engines.datasets import mix_domains, split_by_domain

        return mix_domains(split_by_domain(train), dict(cfg.data.domain_weights), n,
                           seed=cfg.run.seed * 1_000_003 + iteration + 7919 * round_).reset_index(drop=True)
    from tasks.rollout import iteration_prompts

    return iteration_prompts(train, n, iteration, cfg.run.seed + 7919 * round_)


def dynamic_sampling(spec: RunSpec, df: pd.DataFrame, iteration: int,
                     refill: tuple[list, pd.DataFrame] | None) -> tuple[pd.DataFrame, dict[str, float]]:
    """Keep informative groups of the scored `df`, refilling with new prompts (see module doc).
    `refill`: (generation actors serving the policy that sampled `df`, the train prompt table);
    None = no refills (the groups of `df` only)."""
    from tasks.rollout import sample_groups

    cfg = config_of(spec)
    want, rounds, max_rounds = cfg.rollout.prompts_per_iteration, 1, cfg.algorithm.max_generation_rounds
    seen = df["group_id"].nunique()
    parts = [df[df["group_id"].isin(informative_groups(cfg, df))]]
    kept = parts[0]["group_id"].nunique()
    if kept < want and rounds < max_rounds and refill is not None:
        workers, train = refill
        used = set(df["prompt_id"])
        while kept < want and rounds < max_rounds:
            prompts = refill_prompts(cfg, train, want, iteration, rounds)
            prompts = prompts[~prompts["prompt_id"].isin(used)].drop_duplicates("prompt_id")
            used |= set(prompts["prompt_id"])
            rounds += 1
            if prompts.empty:
                continue
            more = _scored(spec, sample_groups(spec, workers, prompts, int(df["policy_version"].iloc[0]), iteration,
                                                cfg.run.seed * 100_003 + iteration + 50_021 * rounds))
            seen += more["group_id"].nunique()
            parts.append(more[more["group_id"].isin(informative_groups(cfg, more))])
            kept += parts[-1]["group_id"].nunique()
    out = pd.concat(parts, ignore_index=True)
    groups = list(dict.fromkeys(out["group_id"]))[:want]
    out = out[out["group_id"].isin(groups)].reset_index(drop=True)
    if out.empty:
        console.print(f"[yellow]dynamic sampling: no informative group in {rounds} generation rounds; training on the unfiltered batch[/]")
        out = df
    metrics = {"dynamic_sampling/kept_groups": float(len(groups)), "dynamic_sampling/dropped_groups": float(seen - kept),
               "dynamic_sampling/generation_rounds": float(rounds), "dynamic_sampling/samples": float(len(out))}
    return out, metrics


def score_batch(spec: RunSpec, batch: pd.DataFrame, iteration: int,
                refill: tuple[list, pd.DataFrame] | None = None) -> pd.DataFrame:
    """The scoring stage: rewards for every row, reward/* metrics of these samples and, with
    `algorithm.filter_groups`, dynamic sampling (`refill`: see `dynamic_sampling`)."""
    check_columns(batch, "rollout")
    metrics: dict[str, float] = {}
    with stage(spec, "scoring", iteration, metrics):
        df = _scored(spec, batch)
        rewards = df["reward"].tolist()
        metrics["reward/mean"] = float(np.mean(rewards))
        metrics["reward/errors"] = float(df["reward_error"].notna().sum())
        metrics["reward/accuracy"] = float(np.mean([r >= 1.0 for r in rewards]))
        for domain, grp in df.groupby("domain"):
            metrics[f"reward/{domain}/mean"] = float(grp["reward"].mean())
            metrics[f"reward/{domain}/accuracy"] = float((grp["reward"] >= 1.0).mean())
            metrics[f"reward/{domain}/errors"] = float(grp["reward_error"].notna().sum())  # e.g. judge failures
            metrics[f"reward/{domain}/response_length"] = float(grp["response_token_ids"].map(len).mean())
        solved = df.groupby("group_id")["reward"].agg(["min", "max"])
        metrics["reward/groups_all_equal_frac"] = float((solved["min"] == solved["max"]).mean())
        if config_of(spec).algorithm.filter_groups:  # reward/* above describe the rollout's own samples
            df, m = dynamic_sampling(spec, df, iteration, refill)
            metrics.update(m)
    return df


@task(task_config=ray_job("scoring"), **task_resources("scoring"))
def score(spec: RunSpec, batch: pd.DataFrame, iteration: int) -> pd.DataFrame:
    """Adds `reward` and `reward_error` to every row. A table that already has them was scored
    (and, with `algorithm.filter_groups`, refilled) by the rollout task: it passes through as is."""
    if "reward" in batch.columns:
        check_columns(batch, "rollout", "scoring")
        return batch
    return score_batch(spec, batch, iteration)

"""Scoring: verifiable rewards per domain in reward-worker actors; a broken reward costs one sample.

With dynamic sampling (`algorithm.filter_groups`, DAPO arXiv 2503.14476) the rollout task runs the
rollout scheduler (engines/scheduler.py) through `dynamic_sampling`: chunks of prompts go to its
generation actors, each generated group goes to these reward workers at once (`RayRewards`), and
the groups that fail the filters (`group_filters`: all rewards equal; with `mask_truncated`, all
samples truncated; with a difficulty band, mean reward outside it) are dropped, until the batch
holds `rollout.prompts_per_iteration` kept groups or the prompt budget,
`prompts_per_iteration * algorithm.max_generation_rounds` prompts, is spent; then it trains on what
it has (on the first scored groups, unfiltered, when none passes). Prompts after the rollout's own
batch are drawn by `refill_prompts` (with `data.domain_weights` when they are set). This runs
where generation runs, in the rollout task (its Ray cluster is the one sized for the generation
actors; one created here would ask the scoring cluster for a GPU it does not have), and the
`score` task passes the scored table through. With `rollout.score_while_generating` (and no
filter) the same scheduler runs over the rollout's own B prompts only: every group is kept, and the
point is that each is scored while later chunks (`rollout.chunk_prompts`) still generate.

Domains routed to a model reward (`judge`, `reward_model`) are scored in batches by a model each
reward worker loads once (engines/rewards/models.py).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import ray
from flytekit import task

from infra.ray_session import actor_pool, kill_pool, shared_local_ray
from infra.ray_cluster import ray_job
from infra.resources import actor_options_for, role_devices, task_resources
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
              "reward_model": {**cfg.reward.reward_model.model_dump(), "device": device, "dtype": dtype},
              "sandbox": cfg.reward.sandbox.model_dump()}
    opts = actor_options_for(cfg, "reward", shared_local_ray())
    items = _items(df)
    shards = [s for s in np.array_split(np.arange(len(items)), n) if len(s)]
    workers = actor_pool(RewardWorker, role, n, spec.run_id, {}, opts)
    futures = [w.score.remote([items[i] for i in s], timeout, routes, models) for w, s in zip(workers, shards)]
    rewards: list[float] = [0.0] * len(items)
    errors: list[str | None] = [None] * len(items)
    isolation: list[str | None] = [None] * len(items)   # returned as rewards.isolation (see ScoredList)
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
        for i, res in zip(shard, results):
            rewards[int(i)], errors[int(i)] = res
            isolation[int(i)] = getattr(res, "isolation", None)
    if tainted:  # threads stuck in a hung reward call: replace the workers
        kill_pool(role, n, spec.run_id)
    return ScoredList(rewards, isolation), errors


class ScoredList(list):
    """`score_table`'s rewards, with `isolation`: per row, the code sandbox mode that scored it (or None)."""

    def __init__(self, rewards, isolation):
        super().__init__(rewards)
        self.isolation = isolation


def with_rewards(df: pd.DataFrame, rewards: list[float], errors: list[str | None]) -> pd.DataFrame:
    """A copy of `df` with the scoring stage's columns: `reward` (float) and `reward_error` (None or
    the failure), one per row in order."""
    df = df.copy()
    df["reward"] = pd.Series(rewards, index=df.index, dtype=float)
    df["reward_error"] = pd.Series(errors, index=df.index, dtype=object)  # None, not NaN (pandas 3 infers str)
    isolation = getattr(rewards, "isolation", None)
    if isolation is not None and any(m is not None for m in isolation):
        df["reward_isolation"] = pd.Series(isolation, index=df.index, dtype=object)
    return df


def _scored(spec: RunSpec, df: pd.DataFrame) -> pd.DataFrame:
    return with_rewards(df, *score_table(spec, df))


def refill_prompts(cfg, train: pd.DataFrame, n: int, iteration: int, round_: int) -> pd.DataFrame:
    """Candidate prompts for the `round_`-th refill draw of `iteration` (1 = the first, after the
    rollout's own batch; see `prompt_stream`): a fresh draw mixed by
    `data.domain_weights` (per-domain quotas, as the rollout draws its batch) when weights are set,
    else a slice of a per-round reshuffle of the train split. The caller drops prompts already used
    this iteration, so the kept mix can differ from the weights by those."""
    if cfg.data.domain_weights:  # the rollout's own draw is seed * 1_000_003 + iteration
        from engines.datasets import mix_domains, split_by_domain

        return mix_domains(split_by_domain(train), dict(cfg.data.domain_weights), n,
                           seed=cfg.run.seed * 1_000_003 + iteration + 7919 * round_).reset_index(drop=True)
    from tasks.rollout import iteration_prompts

    return iteration_prompts(train, n, iteration, cfg.run.seed + 7919 * round_)


class RayRewards:
    """engines/scheduler.py `RewardSide` over the reward workers: one `RewardWorker.score` call per
    group, round-robin over `reward.num_workers` actors, each sample's call isolated (timeout,
    exception -> 0 and flagged). A group whose worker crashes is re-scored by `score_table` (one by
    one in fresh workers). `abort` drops the call's result: a call already queued or running still
    finishes (each sample bounded by `reward.timeout_s`). `close` replaces workers left holding a
    hung call."""

    def __init__(self, spec: RunSpec, role: str = "reward"):
        cfg = config_of(spec)
        device, dtype = role_devices(cfg, "reward")["reward"]
        models = {"judge": {**cfg.reward.judge.model_dump(), "device": device, "dtype": dtype},
                  "reward_model": {**cfg.reward.reward_model.model_dump(), "device": device, "dtype": dtype},
                  "sandbox": cfg.reward.sandbox.model_dump()}
        self.spec, self.role, self.n = spec, role, cfg.reward.num_workers
        self.args = (cfg.reward.timeout_s, dict(cfg.reward.functions), models)
        self.opts = actor_options_for(cfg, "reward", shared_local_ray())
        self.workers = actor_pool(RewardWorker, role, self.n, spec.run_id, {}, self.opts)
        self.rows, self.calls, self.hung, self.aborted = {}, 0, False, []

    def submit(self, rows: list[dict]):
        keep = ("prompt", "answer", "domain", "tests", "metadata")
        items = [(r["domain"], r["response"], {k: r[k] for k in keep if k in r}) for r in rows]
        ref = self.workers[self.calls % len(self.workers)].score.remote(items, *self.args)
        self.rows[ref], self.calls = rows, self.calls + 1
        return ref

    def ready(self, handles: list, timeout: float) -> list:
        return ray.wait(handles, num_returns=len(handles), timeout=timeout)[0]

    def result(self, ref) -> list[tuple[float, str | None]]:
        from engines.datasets import encode_nested

        rows = self.rows.pop(ref)
        try:
            results, hung = ray.get(ref)
            self.hung |= hung
            return results
        except ray.exceptions.RayActorError:
            console.print(f"[yellow]a reward worker died; re-scoring its group of {len(rows)} one by one[/]")
            kill_pool(self.role, self.n, self.spec.run_id)
            self.workers = actor_pool(RewardWorker, self.role, self.n, self.spec.run_id, {}, self.opts)
            rewards, errors = score_table(self.spec, encode_nested(pd.DataFrame(rows)), role=f"{self.role}-retry")
            return list(zip(rewards, errors))

    def abort(self, ref) -> None:
        # no ray.cancel (see tasks/rollout.py RayGeneration.abort): the call finishes and is dropped
        self.rows.pop(ref, None)
        self.aborted.append(ref)

    def close(self) -> None:
        """Replace the workers when a call was left holding a hung reward (aborted calls that have
        finished by now included; one still running is left to end within its timeouts)."""
        done = ray.wait(self.aborted, num_returns=len(self.aborted), timeout=0)[0] if self.aborted else []
        for ref in done:
            try:
                self.hung |= ray.get(ref)[1]
            except (ray.exceptions.TaskCancelledError, ray.exceptions.RayError):
                pass
        if self.hung:
            kill_pool(self.role, self.n, self.spec.run_id)


def prompt_stream(cfg, first: pd.DataFrame, train: pd.DataFrame, iteration: int):
    """Prompt-table rows for the scheduler: the rollout's own batch, then `max_generation_rounds - 1`
    refill draws (`refill_prompts`), each prompt at most once per iteration (group ids stay unique)."""
    used: set = set()
    for round_ in range(cfg.algorithm.max_generation_rounds):
        batch = first if round_ == 0 else refill_prompts(cfg, train, cfg.rollout.prompts_per_iteration, iteration, round_)
        for _, p in batch.iterrows():
            if p["prompt_id"] not in used:
                used.add(p["prompt_id"])
                yield p


def dynamic_sampling(spec: RunSpec, generation, prompts: pd.DataFrame, train: pd.DataFrame,
                     iteration: int) -> tuple[pd.DataFrame, dict[str, float]]:
    """The scored table of up to `rollout.prompts_per_iteration` groups that pass `group_filters`,
    and its metrics (module doc). `generation`: a `GenerationSide` (tasks/rollout.py `RayGeneration`)
    serving the policy; `prompts`: the rollout's own batch; `train`: the split refills draw from.
    `reward/*` metrics describe every scored sample, kept or dropped."""
    from engines.datasets import encode_nested
    from engines.scheduler import DROPPED, RolloutScheduler, group_filters

    cfg = config_of(spec)
    want, workers = cfg.rollout.prompts_per_iteration, cfg.rollout.num_workers
    filters = group_filters(cfg.algorithm)
    rewards = RayRewards(spec)
    try:  # without filters every group is kept: the budget is the batch itself, never a refill
        result = RolloutScheduler(generation, rewards, filters, want=want,
                                  max_prompts=want * cfg.algorithm.max_generation_rounds if filters else want,
                                  chunk_size=cfg.rollout.chunk_prompts or -(-want // workers),
                                  max_chunks_in_flight=workers).run(
            prompt_stream(cfg, prompts, train, iteration))
    finally:
        rewards.close()
    groups = result.kept
    if not groups:
        console.print("[yellow]dynamic sampling: no group passed the filters within the prompt budget; training on "
                      "the first scored groups, unfiltered[/]")
        groups = [g for g in result.groups if g.status == DROPPED][:want]

    def table(gs) -> pd.DataFrame:
        scored = [(r, x, e) for g in gs for r, x, e in zip(g.rows, g.rewards, g.errors)]
        return with_rewards(encode_nested(pd.DataFrame([r for r, _, _ in scored])),
                            [x for _, x, _ in scored], [e for _, _, e in scored])

    metrics = {**reward_metrics(table([g for g in result.groups if g.rewards])), **result.metrics(want)}
    if not filters:  # nothing was filtered: the dynamic_sampling/* counts would only restate the batch
        metrics = {k: v for k, v in metrics.items() if not k.startswith("dynamic_sampling/")}
    return table(groups), metrics


def reward_metrics(df: pd.DataFrame) -> dict[str, float]:
    """reward/* metrics of a scored table: mean, accuracy, errors, per domain, all-equal groups."""
    metrics: dict[str, float] = {}
    rewards = df["reward"].tolist()
    metrics["reward/mean"] = float(np.mean(rewards))
    metrics["reward/errors"] = float(df["reward_error"].notna().sum())
    metrics["reward/accuracy"] = float(np.mean([r >= 1.0 for r in rewards]))
    for domain, grp in df.groupby("domain"):
        metrics[f"reward/{domain}/mean"] = float(grp["reward"].mean())
        metrics[f"reward/{domain}/accuracy"] = float((grp["reward"] >= 1.0).mean())
        metrics[f"reward/{domain}/errors"] = float(grp["reward_error"].notna().sum())  # e.g. judge failures
        metrics[f"reward/{domain}/response_length"] = float(grp["response_token_ids"].map(len).mean())
        if "reward_isolation" in grp.columns:   # which sandbox mode scored this batch's code samples
            for mode, count in grp["reward_isolation"].dropna().value_counts().items():
                metrics[f"reward/{domain}/isolation_{mode}"] = float(count)
    solved = df.groupby("group_id")["reward"].agg(["min", "max"])
    metrics["reward/groups_all_equal_frac"] = float((solved["min"] == solved["max"]).mean())
    return metrics


def score_batch(spec: RunSpec, batch: pd.DataFrame, iteration: int) -> pd.DataFrame:
    """The scoring stage: rewards for every row and the reward/* metrics of these samples."""
    check_columns(batch, "rollout", at="entering scoring")
    metrics: dict[str, float] = {}
    with stage(spec, "scoring", iteration, metrics):
        df = _scored(spec, batch)
        check_columns(df, "rollout", "scoring", at="leaving scoring")
        metrics.update(reward_metrics(df))
    return df


@task(task_config=ray_job("scoring"), **task_resources("scoring"))
def score(spec: RunSpec, batch: pd.DataFrame, iteration: int) -> pd.DataFrame:
    """Adds `reward` and `reward_error` to every row. A table that already has them was scored
    (with `algorithm.filter_groups` or `rollout.score_while_generating`, by the rollout task's
    scheduler): it passes through as is."""
    if "reward" in batch.columns:
        check_columns(batch, "rollout", "scoring", at="entering scoring (scored by the rollout's scheduler)")
        return batch
    return score_batch(spec, batch, iteration)

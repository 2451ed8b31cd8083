"""The run's actor pools and what they do for every stage: the generation actors (sampling a
rollout's groups, serving evaluation and episodes) and the reward workers (scoring a table, or one
group at a time for the rollout scheduler).

Stage tasks share these (tasks/stages/rollout.py samples through them, tasks/stages/scoring.py and
tasks/stages/evaluation.py score through `score_table`, tasks/stages/weight_sync.py hands the live generators a
new policy, tasks/stages/agentic.py plays episodes on them); no stage imports another.

`RayGeneration` and `RayRewards` are engines/generation/scheduler.py's `GenerationSide` and `RewardSide` over
these actors (tasks/loop/prompts.py `dynamic_sampling` runs the scheduler with them).
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pandas as pd
import ray

from engines.data.datasets import decode_nested, encode_nested
from engines.generation.engine import SamplingParams
from engines.rewards.models import RewardPlacement
from engines.rewards.routing import check_error_rate
from infra.ray_session import actor_pool, kill_pool, shared_local_ray
from infra.resources import actor_options_for, role_devices
from tasks.run.common import config_of, console
from tasks.actors.hybrid import role_actors
from tasks.run.types import PolicyRef, RunSpec
from tasks.actors.reward import RewardWorker
from tasks.run.seeds import chunk_seed


# -- generation ---------------------------------------------------------------------------------

def generation_actors(spec: RunSpec) -> list:
    """The run's generation actors (created on first use, placed as `placement.actor_infer`; with
    placement.hybrid the generation roles of the hybrid workers), serving whatever they last loaded."""
    return role_actors(config_of(spec), spec.run_id, "actor_infer")


class EngineVersionError(RuntimeError):
    """A generation engine that does not report the policy version it was asked to serve."""


def generation_pool(spec: RunSpec, policy: PolicyRef) -> list:
    """The run's generation actors, serving `policy` (first load or in-place weight update). Every
    engine reports the version it then serves; one that reports another is an EngineVersionError
    naming it (`flyroll/<run_id>/generation/<i>`), what it serves and `policy`, never a rollout on a
    stale policy."""
    workers = generation_actors(spec)
    served = ray.get([w.load.remote(spec, policy.key, policy.version) for w in workers])
    wrong = [f"flyroll/{spec.run_id}/generation/{i} serves v{version} ({how})"
             for i, (how, version) in enumerate(served) if version != policy.version]
    if wrong:
        raise EngineVersionError(f"generation engines asked to serve {policy.key} as v{policy.version}: " + "; ".join(wrong))
    return workers


def rollout_sampling(cfg, seed: int | None = None, **overrides):
    """The rollout's SamplingParams from `cfg.rollout` (G samples, temperature, top_p, max_new_tokens,
    stop), seeded by `seed`; `overrides` replace fields (the agentic tasks: n=1, greedy). The one
    place sampling settings are read from the config: the rollout, the DAPO scheduler's chunks
    (`RayGeneration`) and the agentic episodes (tasks/stages/agentic.py) all sample through it."""
    r = cfg.rollout
    params = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                            max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), seed=seed)
    return replace(params, **overrides) if overrides else params


def sample_groups(spec: RunSpec, workers: list, prompts: pd.DataFrame, version: int, iteration: int, seed: int) -> pd.DataFrame:
    """G samples for each prompt from `workers`, one row per sample (the ROLLOUT_COLUMNS of
    tasks/run/types.py, plus the prompt table's `answer`, `tests`, `metadata`); group id
    `<iteration>:<prompt_id>`. The rollout and the DAPO refills both sample through it."""
    groups = generate_groups(spec, workers, prompts, version, iteration, seed)
    return encode_nested(pd.DataFrame([r for group in groups for r in group]))  # tests/metadata as JSON text through parquet


def generate_groups(spec: RunSpec, workers: list, prompts: pd.DataFrame, version: int, iteration: int, seed: int,
                    **overrides) -> list[list[dict]]:
    """Per prompt of `prompts`, in order, its G sample rows (`completion_rows`) from `workers`, the
    prompts split evenly over them; `overrides` replace sampling fields (`rollout_sampling`)."""
    cfg = config_of(spec)
    ids = ray.get(workers[0].encode.remote(prompts["prompt"].tolist(), cfg.model.apply_chat_template))
    groups = []
    for shard, completions in generate_sharded(workers, ids, rollout_sampling(cfg, seed, **overrides)):
        part = [prompts.iloc[int(i)] for i in shard]
        groups.extend(completion_rows(part, [ids[int(i)] for i in shard], completions, version, iteration))
    return groups


def generate_sharded(workers: list, ids: list[list[int]], params) -> list[tuple[np.ndarray, list]]:
    """`ids` split evenly over the generation actors, one `generate` call each, at once: per non-empty
    shard, in order, (its indices into `ids`, its completions; prompt_index within the shard)."""
    shards = [s for s in np.array_split(np.arange(len(ids)), len(workers)) if len(s)]
    futures = [w.generate.remote([ids[int(i)] for i in shard], params) for w, shard in zip(workers, shards)]
    return list(zip(shards, ray.get(futures)))


def completion_rows(prompts: list, ids: list[list[int]], completions: list, version: int, iteration: int) -> list[list[dict]]:
    """One list of sample rows (ROLLOUT_COLUMNS plus the prompt's `answer`, `tests`, `metadata`) per
    prompt of `prompts` (prompt-table rows), from the engine's `completions` of their token `ids`."""
    groups: list[list[dict]] = [[] for _ in prompts]
    for c in completions:
        p = prompts[c.prompt_index]
        groups[c.prompt_index].append({
            "prompt_id": p["prompt_id"], "group_id": f"{iteration}:{p['prompt_id']}", "sample_id": c.sample_index,
            "domain": p["domain"], "prompt": p["prompt"], **{k: p[k] for k in ("answer", "tests", "metadata") if k in p.index},
            "prompt_token_ids": ids[c.prompt_index], "response": c.text,
            "response_token_ids": c.token_ids, "behaviour_logprobs": c.logprobs,
            "finish_reason": c.finish_reason, "policy_version": version,
        })
    return groups


class RayGeneration:
    """engines/generation/scheduler.py `GenerationSide` over the generation actors: each chunk goes to an idle
    actor (encode, then generate; run at most len(workers) chunks in flight), seeded by `seed` and its
    chunk number, under a request id. `abort` tells the actor to stop that request
    (`GenerationWorker.abort`: the engine, HF or vLLM, stops after its current decode step, so the
    actor is free for the next stage at once) and drops its result."""

    def __init__(self, spec: RunSpec, workers: list, version: int, iteration: int, seed: int):
        cfg = config_of(spec)
        self.chat, self.version, self.iteration, self.seed = cfg.model.apply_chat_template, version, iteration, seed
        self.params = rollout_sampling(cfg)  # each chunk gets its own seed (`submit`)
        self.idle, self.busy, self.chunks = list(workers), {}, 0

    def submit(self, prompts: list):
        w = self.idle.pop(0)  # the scheduler keeps at most len(workers) chunks in flight
        ids = w.encode.remote([p["prompt"] for p in prompts], self.chat)
        request = f"{self.iteration}-{self.seed}-{self.chunks}"
        ref = w.generate.remote(ids, replace(self.params, seed=chunk_seed(self.seed, self.chunks)), request)
        self.busy[ref] = (request, w, ids, prompts)
        self.chunks += 1
        return ref

    def ready(self, handles: list, timeout: float) -> list:
        return ray.wait(handles, num_returns=len(handles), timeout=timeout)[0]

    def result(self, ref) -> list[list[dict]]:
        _, w, ids, prompts = self.busy.pop(ref)
        self.idle.append(w)
        return completion_rows(prompts, ray.get(ids), ray.get(ref), self.version, self.iteration)

    def abort(self, ref) -> None:
        # no ray.cancel: cancelling a queued actor task leaves a gap in the actor's ordered queue, which
        # then stalls for 30 s and cancels every later call (seen under load); the actor stops the
        # request itself and the result is dropped
        request, w, _, _ = self.busy.pop(ref, (None, None, None, None))
        if w is not None:
            w.abort.remote(request)


# -- rewards ------------------------------------------------------------------------------------

def _items(df: pd.DataFrame) -> list[tuple[str, str, dict]]:
    df = decode_nested(df)  # tests/metadata travel through parquet as JSON text
    keep = [c for c in ("prompt", "answer", "domain", "tests", "metadata") if c in df.columns]
    return [(row["domain"], row["response"], {k: row[k] for k in keep}) for _, row in df.iterrows()]


def reward_placement(cfg) -> RewardPlacement:
    """Where the reward workers' models live: the reward role's device and dtype."""
    return RewardPlacement(*role_devices(cfg, "reward")["reward"])


def score_table(spec: RunSpec, df: pd.DataFrame, role: str = "reward") -> tuple[list[float], list[str | None]]:
    """Rewards and errors for every row. Raises and timeouts are isolated per call inside a worker; a
    worker that hangs is replaced after its batch; a worker that crashes has its rows re-scored one
    by one in fresh workers, so only the sample that kills a worker is lost (scored 0, flagged).
    Domains routed to `judge` / `reward_model` are scored in timed batches by a model each worker
    loads once and keeps (engines/rewards/models.py)."""
    cfg = config_of(spec)
    n, args = cfg.reward.num_workers, (cfg.reward, reward_placement(cfg))
    opts = actor_options_for(cfg, "reward", shared_local_ray())
    items = _items(df)
    shards = [s for s in np.array_split(np.arange(len(items)), n) if len(s)]
    workers = actor_pool(RewardWorker, role, n, spec.run_id, {}, opts)
    futures = [w.score.remote([items[i] for i in s], *args) for w, s in zip(workers, shards)]
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
                    (res,), hung = ray.get(solo.score.remote([items[i]], *args))
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


class RayRewards:
    """engines/generation/scheduler.py `RewardSide` over the reward workers: one `RewardWorker.score` call per
    group, round-robin over `reward.num_workers` actors, each sample's call isolated (timeout,
    exception -> 0 and flagged). A group whose worker crashes is re-scored by `score_table` (one by
    one in fresh workers). `abort` drops the call's result: a call already queued or running still
    finishes (each sample bounded by `reward.timeout_s`). `close` replaces workers left holding a
    hung call."""

    def __init__(self, spec: RunSpec, role: str = "reward"):
        cfg = config_of(spec)
        self.spec, self.role, self.n = spec, role, cfg.reward.num_workers
        self.args = (cfg.reward, reward_placement(cfg))
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
        # no ray.cancel (see RayGeneration.abort): the call finishes and is dropped
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


_TIMEOUT = re.compile(r"timeout after [\d.]+s in reward function '([^']+)'")


def _timed_out(error: str) -> str | None:
    """The reward function a row's error says timed out (engines/rewards/calls.py's wording), or None."""
    m = _TIMEOUT.search(str(error))
    return m.group(1) if m else None


def _metric_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_./-]", "_", name)


def check_reward_errors(reward, df: pd.DataFrame, where: str) -> None:
    """engines/rewards/routing.py `check_error_rate` over a scored table (its reward_error column): raises when a
    domain's reward failed on more than reward.max_error_rate of the rows, naming function, domain and an example."""
    rows = decode_nested(df[[c for c in ("domain", "metadata", "reward_error") if c in df.columns]])
    meta = rows["metadata"] if "metadata" in rows.columns else [None] * len(rows)
    check_error_rate([(str(d), {"metadata": m}, e) for d, m, e in zip(rows["domain"], meta, rows["reward_error"])],
                     reward, where)


def reward_metrics(df: pd.DataFrame) -> dict[str, float]:
    """reward/* metrics of a scored table: mean, accuracy, errors and timeouts per domain, timeouts per reward
    function (reward/timeouts/<function>), the sandbox modes, all-equal groups."""
    metrics: dict[str, float] = {}
    rewards = df["reward"].tolist()
    metrics["reward/mean"] = float(np.mean(rewards))
    metrics["reward/errors"] = float(df["reward_error"].notna().sum())
    metrics["reward/accuracy"] = float(np.mean([r >= 1.0 for r in rewards]))
    for domain, grp in df.groupby("domain"):
        metrics[f"reward/{domain}/mean"] = float(grp["reward"].mean())
        metrics[f"reward/{domain}/accuracy"] = float((grp["reward"] >= 1.0).mean())
        metrics[f"reward/{domain}/errors"] = float(grp["reward_error"].notna().sum())  # e.g. judge failures
        timeouts = grp["reward_error"].dropna().map(_timed_out).dropna()
        metrics[f"reward/{domain}/timeouts"] = float(len(timeouts))
        for name, count in timeouts.value_counts().items():   # which function hangs, by name
            metrics[f"reward/timeouts/{_metric_safe(name)}"] = metrics.get(f"reward/timeouts/{_metric_safe(name)}", 0.0) + float(count)
        metrics[f"reward/{domain}/response_length"] = float(grp["response_token_ids"].map(len).mean())
        if "reward_isolation" in grp.columns:   # which sandbox mode scored this batch's code samples
            for mode, count in grp["reward_isolation"].dropna().value_counts().items():
                metrics[f"reward/{domain}/isolation_{mode}"] = float(count)
    solved = df.groupby("group_id")["reward"].agg(["min", "max"])
    metrics["reward/groups_all_equal_frac"] = float((solved["min"] == solved["max"]).mean())
    return metrics

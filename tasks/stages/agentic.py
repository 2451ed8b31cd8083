"""Agentic stages: episodes in environments instead of single-turn prompts.

`rollout_episodes` runs many multi-turn episodes (token-in/token-out: the training sequence is
exactly what the policy saw and produced, environment tokens masked out of the loss): lock-step in
the generation actors (one batched generate per turn across episodes), or with env.workers > 0 each
episode its own loop against the env worker pool (engines/agentic/async_env_manager.py), which also serves
dynamic sampling and env.extra_groups; `score_episodes` turns environment returns into the `reward`
column; `evaluate_episodes` plays the fixed held-out seeds (greedy unless env.eval_temperature).
Reference forward, training and weight sync are the RLVR tasks, unchanged.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import ray
from flytekit import task

from engines.agentic.async_env_manager import run_groups
from engines.agentic.env_manager import episode_metrics
from engines.agentic.env_workers import EnvSpec
from engines.agentic.envs import ENVIRONMENTS
from engines.generation.router import BatchingRouter
from infra import tracking
from infra.env_pool import RayEnvPool
from infra.ray_cluster import ray_job
from infra.resources import env_worker_memory_bytes, task_resources
from tasks.run.common import check_columns, config_of, stage
from tasks.actors.pools import generation_pool, rollout_sampling
from tasks.loop.streams import ActorStreams
from tasks.run.types import PolicyRef, RunSpec
from tasks.run.seeds import EVAL_ENV_SEED0, rollout_seed, train_env_seeds

EVAL_SAMPLING_OFFSET = 99_991  # sampled evaluation: the same sampling seed for every checkpoint


def _params(cfg, greedy: bool, iteration: int = 0, temperature: float | None = None):
    """The rollout's sampling (tasks/actors/pools.py `rollout_sampling`) for one reply per episode turn:
    n=1, a newline stop when `rollout.stop` is empty, greedy (unseeded) or at `temperature`
    (default `rollout.temperature`) seeded by the iteration. An environment with its own `stop` strings
    (tool_table) gets no newline stop: its calls span lines; the managers add its strings."""
    r = cfg.rollout
    own_stop = cfg.env is not None and getattr(ENVIRONMENTS[cfg.env.name], "stop", ())
    line = () if own_stop else ("\n",)  # an env's own stop strings replace it
    return rollout_sampling(cfg, None if greedy else rollout_seed(cfg.run.seed, iteration), n=1, stop=tuple(r.stop) or line,
                            temperature=0.0 if greedy else (r.temperature if temperature is None else temperature))


def _has_signal(group: list) -> bool:
    """Dynamic sampling's filter (DAPO): a group whose episode returns are all equal has zero advantage."""
    return len({ep.episode_return for ep in group}) > 1


def _play(spec: RunSpec, policy: PolicyRef, seeds: list[int], group_size: int, greedy: bool, iteration: int = 0,
          temperature: float | None = None, groups_wanted: int | None = None, keep=None,
          spare: int | None = None) -> tuple[list, dict[str, float]]:
    """(episodes, manager metrics): lock-step in the generation actors, or (env.workers > 0) the
    asynchronous manager against the env worker pool, keeping the first `groups_wanted` groups (default:
    all) to complete that pass `keep`, with `spare` groups in flight beyond those still needed (the
    manager's default: every seed at once without `keep`; the config check allows `keep` and
    env.extra_groups with env.workers > 0 only)."""
    cfg = config_of(spec)
    e = cfg.env
    workers = generation_pool(spec, policy)
    params = _params(cfg, greedy, iteration, temperature)
    if e.workers:
        return _play_async(cfg, workers, policy.version, seeds, group_size, params, groups_wanted, keep, spare)
    if keep is not None or groups_wanted not in (None, len(seeds)) or spare:
        raise ValueError("the lock-step manager plays every seed's group: group filtering and env.extra_groups "
                         "need env.workers > 0")
    shards = [s for s in np.array_split(np.asarray(seeds), len(workers)) if len(s)]
    futures = [w.episodes.remote(e.name, [int(x) for x in shard], group_size, e.max_turns, e.max_context_tokens,
                                 params, dict(e.kwargs), cfg.model.apply_chat_template)
               for w, shard in zip(workers, shards)]
    episodes = []
    for shard_index, eps in enumerate(ray.get(futures)):
        offset = sum(len(s) for s in shards[:shard_index])
        for ep in eps:
            ep.group_id += offset
            episodes.append(ep)
    return episodes, {}


class _RemoteEngine:
    """A generation actor as the router's engine: one `generate` call per batch the router forms."""

    def __init__(self, actor):
        self.actor = actor

    def generate(self, prompt_token_ids, params):
        return ray.get(self.actor.generate.remote(prompt_token_ids, params))


def _play_async(cfg, workers: list, version: int, seeds: list[int], group_size: int, params, groups_wanted: int | None,
                keep, spare: int | None) -> tuple[list, dict[str, float]]:
    """Every episode its own loop (engines/agentic/async_env_manager.py): environments in the env worker
    pool's actors (infra/env_pool.py), generation requests batched across episodes onto `workers`:
    by each actor's continuous-batching engine when all can stream (vLLM, tasks/loop/streams.py), else in
    `generate` calls of up to `rollout.micro_batch` requests (BatchingRouter)."""
    e = cfg.env
    tokenizer = ray.get(workers[0].tokenizer_copy.remote())
    if all(ray.get([w.can_stream.remote() for w in workers])):   # vLLM: continuous batching inside each actor
        router = ActorStreams(workers)
    else:
        router = BatchingRouter([_RemoteEngine(w) for w in workers], max_batch=cfg.rollout.micro_batch,
                                policy_version=version)
    pool = None
    try:
        pool = RayEnvPool(EnvSpec(e.name, dict(e.kwargs)), workers=e.workers, cpus=e.worker_cpus,
                          concurrency=e.worker_concurrency, memory_bytes=env_worker_memory_bytes(cfg))
        out = run_groups(router, pool, tokenizer, e.name, seeds, group_size=group_size, max_turns=e.max_turns,
                         max_context_tokens=e.max_context_tokens, sampling=params, chat=cfg.model.apply_chat_template,
                         step_timeout_s=e.step_timeout_s, max_retries=e.max_retries, groups_wanted=groups_wanted, keep=keep,
                         spare=spare)
    finally:
        router.close()
        if pool is not None:
            pool.shutdown()
    return out.episodes, out.metrics


def _finish_reason(ep) -> str:
    return "env_error" if ep.env_error else "truncated" if ep.truncated else "done" if ep.done else "max_turns"


def episode_rows(episodes: list, iteration: int, domain: str, version: int) -> pd.DataFrame:
    """The rollout table of `episodes` (engines/agentic/env_manager.py Episode): one row per episode, the
    RLVR rollout columns plus the agentic ones (tasks/run/types.py COLUMNS). policy_version: the oldest
    policy among the episode's turns where the asynchronous manager recorded them, else `version`."""
    return pd.DataFrame([{
        "prompt_id": f"seed-{ep.seed}", "group_id": f"{iteration}:{ep.group_id}", "sample_id": ep.sample_id,
        "domain": domain, "prompt": ep.prompt, "answer": None, "tests": None, "metadata": None,
        "prompt_token_ids": ep.prompt_token_ids, "response": ep.transcript, "response_token_ids": ep.response_token_ids,
        "behaviour_logprobs": ep.behaviour_logprobs, "loss_mask": ep.loss_mask, "turn_index": ep.turn_index,
        "turn_rewards": ep.turn_rewards, "state_keys": json.dumps(ep.state_keys), "finish_reason": _finish_reason(ep),
        "policy_version": min(ep.policy_versions, default=version), "env_return": ep.episode_return, "success": bool(ep.success),
        "turns": ep.turns, "num_effective": ep.num_effective, "num_invalid": ep.num_invalid,
        "env_error": ep.env_error,
    } for ep in episodes])


def scored_episodes(batch: pd.DataFrame) -> pd.DataFrame:
    """`batch` with reward = the episode's return and reward_error = the environment's error."""
    df = batch.copy()
    df["reward"] = df["env_return"].astype(float)
    df["reward_error"] = df["env_error"]
    return df


def rollout_seeds(cfg, iteration: int) -> tuple[list[int], int]:
    """(the training seeds iteration `iteration` may play, the manager's `spare`): B = prompts_per_iteration
    seeds; with algorithm.filter_groups B x max_generation_rounds (the rest refill rejected groups), with
    env.extra_groups k B + k (k groups in flight beyond those still needed). Iterations take consecutive,
    disjoint blocks from run.seed's start, never a held-out or bootstrap seed (tasks/run/seeds.py)."""
    B, extra = cfg.rollout.prompts_per_iteration, cfg.env.extra_groups
    n = B * cfg.algorithm.max_generation_rounds if cfg.algorithm.filter_groups else B + extra
    return train_env_seeds(cfg.run.seed, iteration, n), extra


@task(task_config=ray_job("rollout"), **task_resources("rollout"))
def rollout_episodes(spec: RunSpec, policy: PolicyRef, iteration: int) -> pd.DataFrame:
    """B environments (seeds) x G episodes each, played by `policy` (with pipeline.off_policy_steps an
    older version than the one iteration `iteration` trains) -> one row per episode (prompt +
    interleaved turns). With algorithm.filter_groups or env.extra_groups more seeds' groups are played
    and the first B to complete (that carry signal) are kept."""
    cfg = config_of(spec)
    B, G = cfg.rollout.prompts_per_iteration, cfg.rollout.samples_per_prompt
    metrics: dict[str, float] = {}
    with stage(spec, "rollout", iteration, metrics):
        seeds, spare = rollout_seeds(cfg, iteration)
        episodes, manager = _play(spec, policy, seeds, G, greedy=False, iteration=iteration, groups_wanted=B,
                                  keep=_has_signal if cfg.algorithm.filter_groups else None, spare=spare)
        df = episode_rows(episodes, iteration, cfg.env.name, policy.version)
        check_columns(df, "rollout", at="leaving rollout_episodes")
        metrics.update(manager)
        metrics.update(episode_metrics(episodes, prefix="env"))
        metrics["rollout/response_length"] = float(df["response_token_ids"].map(len).mean())
        metrics["rollout/policy_tokens"] = float(df["loss_mask"].map(sum).sum())
        metrics["rollout/staleness"] = float(iteration - 1 - policy.version)  # updates behind the trainer (off_policy_steps)
    return df


@task(task_config=ray_job("scoring"), **task_resources("scoring"))
def score_episodes(spec: RunSpec, batch: pd.DataFrame, iteration: int) -> pd.DataFrame:
    """reward = the episode's return (environment rewards + invalid-action penalties); an environment
    that raised is flagged in reward_error (its episode already ended with what it had)."""
    check_columns(batch, "rollout", at="entering score_episodes")
    metrics: dict[str, float] = {}
    with stage(spec, "scoring", iteration, metrics):
        df = scored_episodes(batch)
        check_columns(df, "rollout", "scoring", at="leaving score_episodes")
        metrics.update({"reward/mean": float(df["reward"].mean()), "reward/errors": float(df["env_error"].notna().sum()),
                        "reward/accuracy": float(df["success"].mean())})
        solved = df.groupby("group_id")["reward"].agg(["min", "max"])
        metrics["reward/groups_all_equal_frac"] = float((solved["min"] == solved["max"]).mean())
    return df


@task(task_config=ray_job("evaluation"), **task_resources("evaluation"))
def evaluate_episodes(spec: RunSpec, policy: PolicyRef) -> float:
    """Episodes on the fixed held-out seeds: greedy, or (env.eval_temperature > 0) sampled with one fixed
    sampling seed, plus the greedy ones as eval/greedy/*. eval/success_rate (= eval/accuracy),
    effective- and invalid-action rates, turns, return; transcripts of the first episodes as an MLflow artifact."""
    cfg = config_of(spec)
    e = cfg.env
    metrics: dict[str, float] = {}
    with stage(spec, "evaluation", policy.version, metrics):
        seeds = [EVAL_ENV_SEED0 + i for i in range(e.eval_episodes)]
        if e.eval_temperature > 0:
            episodes, _ = _play(spec, policy, seeds, e.eval_samples_per_seed, greedy=False, iteration=EVAL_SAMPLING_OFFSET,
                                temperature=e.eval_temperature)
            metrics.update(episode_metrics(_play(spec, policy, seeds, 1, greedy=True)[0], prefix="eval/greedy"))
        else:
            episodes, _ = _play(spec, policy, seeds, 1, greedy=True)
        m = episode_metrics(episodes, prefix="eval")
        metrics.update(m)
        metrics["eval/accuracy"] = m["eval/success_rate"]
        text = "\n\n".join(f"# {ep.transcript}" for ep in episodes[:8])   # its first line: seed, success, return, turns
        tracking.log_text(spec.tracking_uri, spec.mlflow_run_id, text, f"eval/transcripts_v{policy.version:04d}.txt")
    return float(metrics["eval/accuracy"])

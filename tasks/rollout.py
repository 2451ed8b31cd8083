"""Rollout: sample G responses for each of B prompts with the current policy, in generation actors.

With dynamic sampling (`algorithm.filter_groups`, DAPO) this task runs the rollout scheduler
(engines/scheduler.py, through tasks/scoring.py `dynamic_sampling`): chunks of prompts go to the
generation actors (`RayGeneration`), each generated group to the reward workers at once, and the
batch fills with groups that pass the filters. That needs the generation actors, and they live
here, on the Ray cluster sized for them (infra/resources.py `hosted_roles`). The table then leaves
this task scored, and the scoring task passes it through. `rollout.score_while_generating` takes the
same path without filters: the batch is the rollout's own B prompts, in chunks of
`rollout.chunk_prompts`, each group scored while later chunks generate."""

from __future__ import annotations

import numpy as np
import pandas as pd
import ray
from flytekit import task

from infra.ray_session import actor_pool, shared_local_ray
from infra.ray_cluster import ray_job
from infra.resources import actor_options_for, task_resources
from tasks.common import check_columns, config_of, fetch_cached, stage
from tasks.types import DatasetRef, PolicyRef, RunSpec
from tasks.workers import GenerationWorker, generation_worker_kwargs


def generation_actors(spec: RunSpec) -> list:
    """The run's generation actors (created on first use, placed as `placement.actor_infer`), serving
    whatever they last loaded."""
    cfg = config_of(spec)
    return actor_pool(GenerationWorker, "generation", cfg.rollout.num_workers, spec.run_id, generation_worker_kwargs(cfg),
                      actor_options_for(cfg, "actor_infer", shared_local_ray()))


def generation_pool(spec: RunSpec, policy: PolicyRef) -> list:
    """The run's generation actors, serving `policy` (first load or in-place weight update)."""
    workers = generation_actors(spec)
    ray.get([w.load.remote(spec, policy.key) for w in workers])
    return workers


def rollout_sampling(cfg, seed: int | None = None, **overrides):
    """The rollout's SamplingParams from `cfg.rollout` (G samples, temperature, top_p, max_new_tokens,
    stop), seeded by `seed`; `overrides` replace fields (the agentic tasks: n=1, greedy). The one
    place sampling settings are read from the config: the rollout, the DAPO scheduler's chunks
    (`RayGeneration`) and the agentic episodes (tasks/agentic.py) all sample through it."""
    from dataclasses import replace

    from engines.generation import SamplingParams

    r = cfg.rollout
    params = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                            max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), seed=seed)
    return replace(params, **overrides) if overrides else params


def sample_groups(spec: RunSpec, workers: list, prompts: pd.DataFrame, version: int, iteration: int, seed: int) -> pd.DataFrame:
    """G samples for each prompt from `workers`, one row per sample (the ROLLOUT_COLUMNS of
    tasks/types.py, plus the prompt table's `answer`, `tests`, `metadata`); group id
    `<iteration>:<prompt_id>`. The rollout and the DAPO refills both sample through it."""
    from engines.datasets import encode_nested

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
    """engines/scheduler.py `GenerationSide` over the generation actors: each chunk goes to an idle
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
        from dataclasses import replace

        w = self.idle.pop(0)  # the scheduler keeps at most len(workers) chunks in flight
        ids = w.encode.remote([p["prompt"] for p in prompts], self.chat)
        request = f"{self.iteration}-{self.seed}-{self.chunks}"
        ref = w.generate.remote(ids, replace(self.params, seed=self.seed + 50_021 * self.chunks), request)
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


def read_table(spec: RunSpec, key: str) -> pd.DataFrame:
    """A published prompt table (train or eval split), nested columns decoded."""
    import glob

    from engines.datasets import decode_nested

    (path,) = glob.glob(f"{fetch_cached(spec, key)}/*.parquet")
    df = pd.read_parquet(path)
    for col in ("answer", "tests", "metadata"):
        if col not in df.columns:
            df[col] = None
    return decode_nested(df)


def iteration_prompts(train: pd.DataFrame, batch: int, iteration: int, seed: int) -> pd.DataFrame:
    """Prompts of iteration `iteration` (1-based): consecutive slices of a per-epoch shuffle, so every
    prompt is used once per epoch and the choice is reproducible from (seed, iteration)."""
    return stream_prompts(train, (iteration - 1) * batch, batch, seed)


def stream_prompts(train: pd.DataFrame, start: int, count: int, seed: int) -> pd.DataFrame:
    """Positions start..start+count-1 of the prompt stream: per-epoch shuffles of `train`, one after
    another (epoch e is permutation seed * 1_000_003 + e)."""
    rows = []
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, len(train))
        order = np.random.default_rng(seed * 1_000_003 + epoch).permutation(len(train))
        rows.append(int(order[offset]))
    return train.iloc[rows].reset_index(drop=True)


@task(task_config=ray_job("rollout"), **task_resources("rollout"))
def rollout(spec: RunSpec, policy: PolicyRef, dataset: DatasetRef, iteration: int) -> pd.DataFrame:
    """B prompts x G samples -> one row per sample with token ids and behaviour log-probs; with
    `algorithm.filter_groups` also scored (reward, reward_error), B groups that pass the filters
    (fewer when the prompt budget runs out; see tasks/scoring.py `dynamic_sampling`); with
    `rollout.score_while_generating` the B groups, scored; with `rollout.partial_rollout_max_split` > 1
    the B oldest complete groups of the pool carried from iteration-1 and new prompts, generated in
    segments (tasks/partial_rollout.py)."""
    cfg = config_of(spec)
    r = cfg.rollout
    metrics: dict[str, float] = {}
    with stage(spec, "rollout", iteration, metrics):
        metrics["rollout/staleness"] = float(iteration - 1 - policy.version)  # updates behind the trainer's policy
        train = read_table(spec, dataset.train_key)
        if cfg.data.domain_weights:  # per-domain quotas every batch (ROLL's domain_interleave_probs)
            from engines.datasets import mix_domains, split_by_domain

            prompts = mix_domains(split_by_domain(train), dict(cfg.data.domain_weights), r.prompts_per_iteration,
                                  seed=cfg.run.seed * 1_000_003 + iteration).reset_index(drop=True)
        elif r.partial_rollout_max_split == 1:
            prompts = iteration_prompts(train, r.prompts_per_iteration, iteration, cfg.run.seed)
        workers = generation_pool(spec, policy)
        if r.partial_rollout_max_split > 1:  # carried samples + the prompt stream, in segments (tasks/partial_rollout.py)
            from tasks.partial_rollout import partial_batch

            df, m = partial_batch(spec, workers, policy, train, iteration)
            metrics.update(m)
        elif cfg.scores_in_rollout:  # DAPO, or score_while_generating: the scheduler over these actors and the reward workers
            from tasks.scoring import dynamic_sampling

            df, m = dynamic_sampling(spec, RayGeneration(spec, workers, policy.version, iteration,
                                                         cfg.run.seed * 100_003 + iteration), prompts, train, iteration)
            metrics.update(m)
        else:
            df = sample_groups(spec, workers, prompts, policy.version, iteration, cfg.run.seed * 100_003 + iteration)
        ray.get([w.sleep.remote() for w in workers])  # free generation memory for the next stages (vLLM on GPU)
        check_columns(df, "rollout", *(("scoring",) if cfg.scores_in_rollout else ()), at="leaving rollout")
        lengths = df["response_token_ids"].map(len)
        metrics.update({
            "rollout/samples": float(len(df)), "rollout/response_length": float(lengths.mean()),
            "rollout/truncated_frac": float((df["finish_reason"] == "length").mean()),
            "rollout/tokens": float(lengths.sum()),
            **{f"rollout/mix/{k}": v for k, v in df["domain"].value_counts(normalize=True).items()},
        })
    metrics_tps = metrics["rollout/tokens"] / max(metrics["timing/rollout_s"], 1e-9)
    from infra import tracking

    tracking.log_metrics(spec.tracking_uri, spec.mlflow_run_id, {"rollout/tokens_per_s": metrics_tps}, step=iteration)
    return df

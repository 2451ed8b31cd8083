"""Not a benchmark by itself: one condition of benchmarks/contention.py's stage measurement, in a fresh
process. The default run's RL stages -- rollout, scoring, reference forward, training step -- on the
tiny preset's policy, inside real Ray actors created as the stage tasks create them (tasks/actors/
`role_actors`, `generation_pool`, `score_table`: the same options, runtime_env and thread count) on a
local Ray started as a local run starts it (infra/ray_session.py `ensure_ray`, in a local Flyte
execution context, so the actors are the shared mode's).

    python -m benchmarks.contention_stages --iterations 3 [--load torch:2]

The policy is configs/tiny.yaml's bootstrap shape, untrained (seed 0), published as v0000; every
iteration samples a fresh prompt batch with it and trains on it (the weights are not synced back, so
each iteration's rollout runs the same model: equal work per iteration). The first iteration is a
warm-up (actor start, model loads). Prints a JSON line per iteration as it ends, then one with the
median seconds per stage over the timed ones, and per actor kind its niceness and torch threads as
seen inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import yaml
from flytekit.core.context_manager import ExecutionState, FlyteContextManager

from benchmarks.contention import competitor
from configs.schema import parse_config
from engines.data.rollout_table import batch_from_table
from engines.data.sources import synthetic_source
from engines.models.modeling import build_tiny_policy, save_policy
from infra.ray_session import ensure_ray, shutdown
from infra.store import ArtifactStore
from tasks.actors.hybrid import role_actors
from tasks.actors.pools import generation_pool, sample_groups, score_table, with_rewards
from tasks.run.replay import update_args
from tasks.run.types import PolicyRef, RunSpec
from tasks.stages.reference import with_logprobs

REPO = Path(__file__).resolve().parents[1]
STAGES = ("rollout", "scoring", "reference", "training")


def _inside(actor) -> dict:
    """An actor's niceness and torch threads, seen inside it."""
    def look(_self):
        import os as os_
        import torch

        return {"nice": os_.getpriority(os_.PRIO_PROCESS, 0), "torch_threads": torch.get_num_threads()}
    return ray.get(actor.__ray_call__.remote(look))


def one_iteration(spec: RunSpec, cfg, policy: PolicyRef, prompts, iteration: int, out_dir: str) -> dict[str, float]:
    """Seconds of each stage's actor work for one iteration, the calls the stage tasks make."""
    seconds = {}
    t0 = time.perf_counter()
    workers = generation_pool(spec, policy)
    df = sample_groups(spec, workers, prompts, policy.version, iteration, seed=iteration)
    seconds["rollout"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rewards, errors = score_table(spec, df)
    df = with_rewards(df, rewards, errors)
    seconds["scoring"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    (ref,) = role_actors(cfg, spec.run_id, "reference")
    ray.get([ref.load.remote(which, spec, policy.key) for which in ("reference", "policy")])
    batch = batch_from_table(df, int(ray.get(ref.pad_id.remote())))
    width = batch.input_ids.shape[1] - batch.responses.shape[1] + int(batch.response_lengths.max())   # as the stage sizes
    mb, rows, args = max(1, cfg.training.max_tokens_per_micro_batch // max(1, width)), ray.put(batch), update_args(cfg, iteration)
    ref_lp, old_lp = ray.get([ref.logprobs.remote(which, rows, mb, args["temperature"]) for which in ("reference", "policy")])
    df = with_logprobs(df, ref_lp, old_lp)
    seconds["reference"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    (trainer,) = role_actors(cfg, spec.run_id, "actor_train")
    ray.get(trainer.load.remote(spec, policy.key, cfg.training, cfg.algorithm))
    here = (ray.get_runtime_context().get_node_id(), out_dir)
    # next key = the same version: the actor keeps its (updated) engine for the next iteration, as a run's does
    ray.get(trainer.step.remote(df, cfg.algorithm, cfg.training, args["temperature"], args["seed"], policy.key,
                                args["train_actor"], here, False, False, True))
    seconds["training"] = time.perf_counter() - t0
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.contention_stages", description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=3, help="timed iterations, after one warm-up")
    p.add_argument("--load", default="", help="KIND:THREADS: benchmarks/contention.py's competitor, from the end of the "
                                              "warm-up to the end (the steady state a run's reused actors see)")
    a = p.parse_args(argv)
    raw = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    with tempfile.TemporaryDirectory(prefix="flyroll-contention-stages-") as d:
        raw["run"]["output_dir"] = os.path.join(d, "runs")
        cfg = parse_config(raw)
        os.environ["FLYROLL_CACHE_DIR"] = os.path.join(d, "cache")   # the actors inherit it (local Ray)
        b, run_id = cfg.model.bootstrap, "contention"
        model, tok = build_tiny_policy(b.hidden_size, b.num_layers, b.num_heads, max_positions=b.max_positions, seed=cfg.run.seed)
        store = ArtifactStore(os.path.join(d, "store"))
        policy = PolicyRef(key=f"runs/{run_id}/policy/v0000", version=0)
        store.publish(save_policy(model, tok, os.path.join(d, "v0")), policy.key, kind="checkpoint", producer="benchmark")
        del model
        spec = RunSpec(cfg.to_json(), cfg.hash(), run_id, store.root, "", "")
        n = cfg.rollout.prompts_per_iteration
        table = synthetic_source("train", n * (a.iterations + 1), domains=tuple(cfg.data.domains), seed=cfg.run.seed)
        table.insert(0, "prompt_id", [f"p{i}" for i in range(len(table))])
        times: dict[str, list[float]] = {s: [] for s in STAGES}
        ctx = FlyteContextManager.current_context()
        local = ctx.with_execution_state(ctx.execution_state.with_params(mode=ExecutionState.Mode.LOCAL_TASK_EXECUTION))
        load = None
        with FlyteContextManager.with_context(local):
            ensure_ray()
            try:
                for it in range(1, a.iterations + 2):
                    prompts = table.iloc[(it - 1) * n: it * n].reset_index(drop=True)
                    seconds = one_iteration(spec, cfg, policy, prompts, it, tempfile.mkdtemp(dir=d))
                    print(json.dumps({"iteration": it, "seconds": seconds}), flush=True)   # iteration 1: the warm-up
                    if it > 1:
                        for s in STAGES:
                            times[s].append(seconds[s])
                    elif a.load:
                        kind, threads = a.load.split(":")
                        load = competitor(kind, int(threads), limit=3600)
                        time.sleep(1.0)   # its torch import and first matmuls
                actors = {role: role_actors(cfg, run_id, role)[0] for role in ("actor_infer", "reference", "actor_train")}
                seen = {role: _inside(actor) for role, actor in actors.items()}
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
                shutdown()
    print(json.dumps({"stages": {s: statistics.median(v) for s, v in times.items()}, "actors": seen,
                      "driver_nice": os.getpriority(os.PRIO_PROCESS, 0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Resident memory of one real env worker (infra/env_pool.py ``RayEnvPool``, one Ray actor) holding
``--envs`` environments: what `env.worker_memory` (configs/schema.py) has to cover.

Starts a local Ray, one env worker actor, resets ``--envs`` environments of ``--env`` on it (seeds
0..envs-1), plays ``--steps`` turns in each with the environment's own solver moves (falling back to a
fixed action when it has none), and reads the actor process's ``VmRSS`` and peak ``VmHWM`` from
/proc before any env, after the resets and after the steps. Prints one line per stage. Asserts nothing.

    python -m benchmarks.env_worker_memory --env webshop --envs 16 [--steps 6] [--kwargs '{"page_size": 3}']
"""

from __future__ import annotations

import argparse
import json
import os

import ray

from engines.agentic.env_workers import EnvSpec
from engines.agentic.envs import make_env
from infra.env_pool import RayEnvPool


def _proc_memory(_actor_self) -> dict[str, float]:
    """VmRSS / VmHWM of the calling process in MiB (run inside the actor through ``__ray_call__``)."""
    out = {"pid": float(os.getpid())}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="webshop")
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kwargs", default="{}", help="environment options as JSON")
    args = ap.parse_args()
    kwargs = json.loads(args.kwargs)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = RayEnvPool(EnvSpec(args.env, kwargs), workers=1, cpus=1, concurrency=4)
    actor = pool.workers[0].actor

    def measure(stage: str) -> None:
        m = ray.get(actor.__ray_call__.remote(_proc_memory))
        print(f"{args.env} x{args.envs} {stage:<14} pid {int(m['pid'])}  VmRSS {m['VmRSS']:7.1f} MiB  "
              f"VmHWM {m['VmHWM']:7.1f} MiB", flush=True)

    try:
        measure("no env")
        ids = [f"env-{i}" for i in range(args.envs)]
        for i, env_id in enumerate(ids):
            pool.reset(env_id, i).result(timeout=120)
        measure("after resets")
        plans = []
        for i in range(args.envs):   # the same moves, planned on a local copy of each environment
            local = make_env(args.env, **kwargs)
            local.reset(i)
            plans.append(local.solve() or [])
        for turn in range(args.steps):
            futures = [pool.step(env_id, plan[turn] if turn < len(plan) else "look")
                       for env_id, plan in zip(ids, plans)]
            for f in futures:
                f.result(timeout=120)
        measure(f"after {args.steps} steps")
    finally:
        pool.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

"""Agentic rollout throughput: the lock-step manager vs the asynchronous one, same run, side by side.

Both play the same episodes (same seeds, same tiny policy, same sampling) of FrozenLake wrapped so
that each environment step costs time:
  - ``lognormal``: the step sleeps a long-tailed latency, lognormal with median ``--median-ms`` and
    shape ``--sigma`` (sigma 1.5: mean 3.1x the median, p99 33x), drawn from (seed, sample, turn) so
    both managers wait the same;
  - ``sandbox``: the step first runs ``print(1+1)`` in the real sandbox (engines/sandbox/runner.py,
    bubblewrap), as a Python tool call would.
Lock-step (engines/agentic/env_manager.py) steps the live episodes one after another inside its turn loop,
then generates once for all; async (engines/agentic/async_env_manager.py) steps them on ``--env-threads``
threads (``ThreadEnvPool``) while the router batches whatever requests are pending. The engine
(``--engines``, each in turn): ``hf`` (engines/generation/engine.py, behind a ``BatchingRouter`` when
async) or ``vllm`` (engines/generation/vllm_engine.py on the same tiny policy saved to a folder, behind a
``ContinuousRouter`` when async: requests join vLLM's running batch as they arrive; needs the
vllm extra, ``bash infra/vllm_venv.sh`` makes its venv). Printed per side: episodes/s and the
generation engine's busy share (seconds inside ``generate``, or inside vLLM's engine steps, /
wall seconds). With ``--extra-groups k`` (default 2) a third side, ``async +k groups``, is the async
manager over-provisioned as ``env.extra_groups: k`` runs it: ``--seeds`` + k groups at once, the batch
the first ``--seeds`` to complete, the rest cancelled; its episodes/s counts the batch's episodes only
(the cancelled ones' work is wasted). Sides alternate, ``--repeats`` times each. Asserts nothing.

    python -m benchmarks.agentic_throughput [--seeds 8] [--group-size 4] [--max-turns 6] [--env-threads 16] [--extra-groups 2]
    .venv-vllm/bin/python -m benchmarks.agentic_throughput --engines hf,vllm
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time

import torch

from engines.agentic.async_env_manager import run_groups
from engines.agentic.env_manager import run_episodes
from engines.agentic.env_workers import EnvSpec, ThreadEnvPool
from engines.agentic.envs import ENVIRONMENTS, make_env
from engines.generation.engine import HFGenerationEngine, SamplingParams
from engines.generation.router import BatchingRouter, ContinuousRouter, is_streaming
from engines.models.modeling import build_tiny_policy, save_policy
from engines.sandbox.runner import run_program


class SlowFrozenLake:
    """FrozenLake whose every step first waits: a lognormal sleep (``latency="lognormal"``) or a
    sandboxed ``print(1+1)`` (``latency="sandbox"``)."""
    name, invalid_penalty = "slow_frozenlake", -0.1
    counter = 0   # tells apart the G episodes of a seed (same seed, different latency draws)

    def __init__(self, latency: str = "lognormal", median_ms: float = 10.0, sigma: float = 1.5):
        self.env = make_env("frozenlake", size=4)
        self.instructions = self.env.instructions
        self.latency, self.median_ms, self.sigma = latency, median_ms, sigma

    def reset(self, seed: int) -> str:
        SlowFrozenLake.counter += 1
        self.rng = random.Random(seed * 1000 + SlowFrozenLake.counter % 1000)
        return self.env.reset(seed)

    def step(self, action_text: str):
        if self.latency == "sandbox":
            verdict = run_program("print(1+1)", timeout_s=10)
            if verdict.stdout.strip() != "2":
                raise RuntimeError(f"sandbox: {verdict.verdict} {verdict.stderr[-200:]}")
        else:
            time.sleep(self.median_ms / 1000 * math.exp(self.sigma * self.rng.gauss(0.0, 1.0)))
        return self.env.step(action_text)

    def state_key(self) -> str:
        return self.env.state_key()

    def solve(self):
        return None


class TimedEngine:
    """An engine that adds up the seconds spent in ``generate`` (lock-step's busy share)."""

    def __init__(self, inner):
        self.inner, self.busy_s, self.calls = inner, 0.0, 0

    def generate(self, prompt_token_ids, params, abort=None):
        start = time.perf_counter()
        try:
            return self.inner.generate(prompt_token_ids, params)
        finally:
            self.busy_s += time.perf_counter() - start
            self.calls += 1


def lockstep_side(engine, tok, seeds, args, env_kwargs):
    timed = TimedEngine(engine)
    SlowFrozenLake.counter = 0
    start = time.perf_counter()
    eps = run_episodes(timed, tok, "slow_frozenlake", seeds, group_size=args.group_size, max_turns=args.max_turns,
                       max_context_tokens=args.max_context, sampling=sampling(args), env_kwargs=env_kwargs)
    wall = time.perf_counter() - start
    turns = sum(e.turns for e in eps)
    return len(eps) / wall, timed.busy_s / wall, timed.calls, turns / max(timed.calls, 1), wall


def async_side(engine, tok, seeds, args, env_kwargs, extra=0):
    if is_streaming(engine):   # vLLM: continuous batching, one request at a time into its running batch
        router = ContinuousRouter(engine)
    else:
        router = BatchingRouter([engine], max_batch=args.max_batch, max_wait_s=args.max_wait_ms / 1000)
    pool = ThreadEnvPool(EnvSpec("slow_frozenlake", env_kwargs), threads=args.env_threads)
    SlowFrozenLake.counter = 0
    try:
        out = run_groups(router, pool, tok, "slow_frozenlake", seeds + [max(seeds) + 1 + i for i in range(extra)],
                         group_size=args.group_size, max_turns=args.max_turns, max_context_tokens=args.max_context,
                         sampling=sampling(args), step_timeout_s=60.0, groups_wanted=len(seeds), spare=extra)
    finally:
        router.close()
        pool.shutdown()
    m = out.metrics
    return (m["env_manager/episodes_per_s"], m["env_manager/engine_busy_share"], int(m["env_manager/generate_calls"]),
            m["env_manager/mean_batch_size"], m["env_manager/seconds"])


def sampling(args) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=6, stop=("\n",), seed=0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-context", type=int, default=400)
    p.add_argument("--median-ms", type=float, default=10.0)
    p.add_argument("--sigma", type=float, default=1.5)
    p.add_argument("--env-threads", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=20.0)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scenarios", default="lognormal,sandbox")
    p.add_argument("--extra-groups", type=int, default=2, help="the third side's spare groups (0: no third side)")
    p.add_argument("--engines", default="hf", help="comma-separated, each in turn: hf, vllm (the vllm extra)")
    args = p.parse_args(argv)
    engine_names = args.engines.split(",")
    unknown = sorted(set(engine_names) - {"hf", "vllm"})
    if unknown:
        p.error(f"--engines: unknown {unknown}; choose from hf, vllm")
    torch.set_num_threads(args.torch_threads)
    ENVIRONMENTS["slow_frozenlake"] = SlowFrozenLake   # the benchmark's own environment, by name for both managers
    model, tok = build_tiny_policy(hidden_size=64, num_layers=2, num_heads=2, max_positions=512, seed=0)
    seeds = list(range(args.seeds))
    print(f"{args.seeds} seeds x G={args.group_size} = {args.seeds * args.group_size} episodes, <= {args.max_turns} turns; "
          f"tiny policy (64 hidden, 2 layers); engines {engine_names}; torch threads {torch.get_num_threads()}, env "
          f"threads (async) {args.env_threads}, HF router max_batch {args.max_batch} max_wait {args.max_wait_ms} ms; "
          f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    sides = [("lock-step", lockstep_side), ("async", async_side)]
    if args.extra_groups > 0:
        sides.append((f"async +{args.extra_groups} groups",
                       lambda *a: async_side(*a, extra=args.extra_groups)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine_name in engine_names:
            engine = make_engine(engine_name, model, tok, tmp, args)
            engine.generate([tok.encode("warm-up", add_special_tokens=False)] * 4, sampling(args))   # untimed: first-call costs
            try:
                for scenario in args.scenarios.split(","):
                    kw = {"latency": scenario, "median_ms": args.median_ms, "sigma": args.sigma}
                    for r in range(args.repeats):
                        for name, side in sides:
                            eps_s, busy, calls, batch, wall = side(engine, tok, seeds, args, kw)
                            rows.append((engine_name, scenario, name, r, eps_s, busy, calls, batch, wall))
                            print(f"  {engine_name:4} {scenario:9} {name:16} repeat {r}: {eps_s:6.2f} episodes/s, "
                                  f"busy {busy:5.1%}, {wall:6.2f} s", flush=True)
            finally:
                if hasattr(engine, "close"):
                    engine.close()
    print()
    print("| engine | step latency | manager | episodes/s | engine busy share | generate calls (async vLLM: engine steps) | mean batch "
          "| wall s | env threads |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for engine_name in engine_names:
        for scenario in args.scenarios.split(","):
            for name, _ in sides:
                mine = [row for row in rows if row[:3] == (engine_name, scenario, name)]
                mean = [sum(row[k] for row in mine) / len(mine) for k in range(4, 9)]
                threads = "0 (in the loop)" if name == "lock-step" else str(args.env_threads)
                label = (f"lognormal median {args.median_ms:g} ms, sigma {args.sigma:g}" if scenario == "lognormal"
                         else "sandbox print(1+1)")
                print(f"| {engine_name} | {label} | {name} | {mean[0]:.2f} | {mean[1]:.1%} | {mean[2]:.0f} | {mean[3]:.1f} "
                      f"| {mean[4]:.2f} | {threads} |")


def make_engine(name: str, model, tok, tmp: str, args):
    """The HF engine on the tiny policy in memory, or vLLM on the same weights saved to a folder
    (float32, as the HF engine; one request seed per call)."""
    if name == "hf":
        return HFGenerationEngine(model.eval(), tok)
    from engines.generation.vllm_engine import VLLMGenerationEngine

    path = save_policy(model, tok, os.path.join(tmp, "policy"))
    return VLLMGenerationEngine(path, max_model_len=args.max_context + 16, kv_cache_gb=1, seed=0)


if __name__ == "__main__":
    main()

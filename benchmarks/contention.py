"""The default run beside another job: wall time alone and beside a fixed competing CPU load, with
OpenMP's default spinning wait ("before") and flyroll's passive wait ("after", engines/models/threads.py).

    python -m benchmarks.contention                                   # bootstrap steps + a shortened default run
    python -m benchmarks.contention --iterations 2 --bootstrap-steps 60 --timeout 1200
    python -m benchmarks.contention --skip-run                        # only the bootstrap's seconds per step

Two measurements, each in fresh processes, in the four conditions {alone, loaded} x {before, after}:

1. the bootstrap's seconds per step (engines/training/pretrain.py `supervised_finetune` on configs/tiny.yaml's
   tiny policy, the step tasks/stages/prepare.py's bootstrap runs) at 1 and 2 torch threads: median of
   `--steps` steps after 2 warm-up steps. "before" runs it with no OpenMP variable set (libgomp's
   default: a thread spins ~300k rounds before it sleeps); "after" sets the policy first.
2. the default run (`pyflyte run workflows/rlvr.py rlvr --config configs/tiny.yaml`), shortened
   by `--iterations` and `--bootstrap-steps` (the full run takes ~4 min on an idle 2-core box), in a
   fresh folder and HOME (no cache), its wall time. "before" sets GOMP_SPINCOUNT=300000 and
   KMP_BLOCKTIME=200 -- the runtimes' default spinning, made explicit so flyroll keeps it; "after"
   is the run as it comes. Its torch threads: the preset's run.torch_threads (2).

The competing load is `--load-procs` processes (default 1) each running a pure-Python busy loop,
started before and killed after each measurement (bounded by it): one other job on the box, the
same in every condition and free of OpenMP. Prints a side-by-side table and one JSON line; asserts
nothing. Results: docs/benchmarks.md ("Contention").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SPIN_ENV = {"GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}   # libgomp's / LLVM OpenMP's defaults, explicit
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "FLYROLL_MAX_TORCH_THREADS")

BUSY = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"

STEP = """
import json, random, statistics, sys, time
if sys.argv[1] == "after":
    from engines.models.threads import set_wait_policy
    set_wait_policy()
import torch
torch.set_num_threads(int(sys.argv[2]))
from configs.schema import load_config
from engines.models.modeling import build_tiny_policy
from engines.training.pretrain import supervised_finetune
from engines.data.synthetic import make_problems, teacher_demonstration
b = load_config("configs/tiny.yaml").model.bootstrap  # the default run's bootstrap
model, tok = build_tiny_policy(b.hidden_size, b.num_layers, b.num_heads, max_positions=b.max_positions, seed=0)
rng = random.Random(0)
pairs = [(p.prompt, teacher_demonstration(p, rng, b.teacher_accuracy)) for p in make_problems("bootstrap", 2000, seed=0)]
stamps = []
supervised_finetune(model, tok, pairs, steps=int(sys.argv[3]) + 2, batch_size=b.batch_size, lr=b.lr, seed=0,
                    on_step=lambda s, loss: stamps.append(time.perf_counter()))
steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
print(json.dumps({"s_per_step": statistics.median(steps), "threads": torch.get_num_threads()}))

"""


def _clean_env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env["PYTHONPATH"] = str(REPO)
    if policy == "before":
        env.update(SPIN_ENV)
    return env


def _with_load(procs: int, limit: float, fn):
    """Run `fn()` beside `procs` busy-loop processes (each ends by itself after `limit` s at the latest)."""
    load = [subprocess.Popen([sys.executable, "-c", BUSY.format(limit=limit)]) for _ in range(procs)]
    try:
        time.sleep(0.5 if procs else 0)
        return fn()
    finally:
        for p in load:
            p.kill()
            p.wait()


def bootstrap_step(policy: str, threads: int, steps: int, timeout: float) -> float | None:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}  # "before": nothing set, libgomp's default
    env["PYTHONPATH"] = str(REPO)
    try:
        out = subprocess.run([sys.executable, "-c", STEP, policy, str(threads), str(steps)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["s_per_step"]


def default_run(policy: str, iterations: int, bootstrap_steps: int, timeout: float) -> float | None:
    """Seconds of one shortened default run in a fresh folder; None when it took longer than `timeout`."""
    cfg = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    with tempfile.TemporaryDirectory(prefix="flyroll-contention-") as d:
        cfg["run"]["output_dir"] = os.path.join(d, "runs")
        cfg["loop"].update(iterations=iterations, eval_every=iterations)
        cfg["model"]["bootstrap"]["steps"] = bootstrap_steps
        path = os.path.join(d, "config.yaml")
        Path(path).write_text(yaml.safe_dump(cfg))
        os.makedirs(os.path.join(d, "home"))
        env = {**_clean_env(policy), "HOME": os.path.join(d, "home"), "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("MLFLOW_TRACKING_URI", None)
        pyflyte = str(Path(sys.executable).with_name("pyflyte"))
        t0 = time.perf_counter()
        proc = subprocess.Popen([pyflyte, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", path], cwd=d, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return None
        if proc.returncode != 0:
            raise RuntimeError(out[-3000:])
        return time.perf_counter() - t0


def _fmt(x: float | None, unit: str, timeout: float) -> str:
    return f"> {timeout:.0f} s" if x is None else f"{x:.3f} {unit}" if unit == "s/step" else f"{x:.0f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.contention", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="bootstrap steps measured per condition (after 2 warm-up steps)")
    p.add_argument("--iterations", type=int, default=2, help="loop.iterations of the shortened default run (preset: 20)")
    p.add_argument("--bootstrap-steps", type=int, default=60, help="model.bootstrap.steps of the shortened run (preset: 1500)")
    p.add_argument("--load-procs", type=int, default=1, help="competing busy-loop processes")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before a measurement is given up (reported as > timeout)")
    p.add_argument("--skip-run", action="store_true", help="only the bootstrap's seconds per step")
    a = p.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; competing load: {a.load_procs} busy-loop process(es)", flush=True)
    results: dict[str, float | None] = {}
    rows = []
    for threads in (1, 2):
        for policy in ("before", "after"):
            for load in (0, a.load_procs):
                r = _with_load(load, a.timeout + 60, lambda pol=policy, t=threads: bootstrap_step(pol, t, a.steps, a.timeout))
                results[f"bootstrap/{threads}t/{policy}/{'loaded' if load else 'alone'}"] = r
                print(f"  bootstrap {threads} thread(s) {policy:<6} {'loaded' if load else 'alone':<6} {_fmt(r, 's/step', a.timeout)}", flush=True)
        rows.append((f"bootstrap s/step, {threads} thread(s)", *(results[f"bootstrap/{threads}t/{pol}/{ld}"]
                                                                 for pol in ("before", "after") for ld in ("alone", "loaded")), "s/step"))
    if not a.skip_run:
        for policy in ("before", "after"):
            for load in (0, a.load_procs):
                r = _with_load(load, a.timeout + 60, lambda pol=policy: default_run(pol, a.iterations, a.bootstrap_steps, a.timeout))
                results[f"run/{policy}/{'loaded' if load else 'alone'}"] = r
                print(f"  default run {policy:<6} {'loaded' if load else 'alone':<6} {_fmt(r, 's', a.timeout)}", flush=True)
        rows.append((f"default run ({a.iterations} it., {a.bootstrap_steps} bootstrap steps), wall", *(
            results[f"run/{pol}/{ld}"] for pol in ("before", "after") for ld in ("alone", "loaded")), "s"))
    print("\n| measurement | before alone | before loaded | before ratio | after alone | after loaded | after ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, ba, bl, aa, al, unit in rows:
        ratio = lambda x, y: "-" if x is None or y is None else f"{y / x:.2f}x"
        print(f"| {name} | {_fmt(ba, unit, a.timeout)} | {_fmt(bl, unit, a.timeout)} | {ratio(ba, bl)} | "
              f"{_fmt(aa, unit, a.timeout)} | {_fmt(al, unit, a.timeout)} | {ratio(aa, al)} |")
    print(json.dumps({"results": results, "args": vars(a), "load_after": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

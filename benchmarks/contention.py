"""The default run beside another job: per-stage seconds in the Ray actors and wall time, alone and
beside a competing job, under the thread policy before and after flyroll's (engines/models/threads.py).

    python -m benchmarks.contention                                   # bootstrap steps, RL stages, a shortened default run
    python -m benchmarks.contention --skip-run --repeats 3            # the bootstrap's steps and the stages only
    python -m benchmarks.contention --skip-bootstrap --skip-stages --preset --timeout 3000   # the whole default run
    python -m benchmarks.contention --load-only 1800                  # only the competitor (this process becomes it)

The competitor (`--competitor`, default `torch`): a 2-thread torch matrix-multiply loop (1024 x 1024,
`--load-threads`) in a separate process with OpenMP's defaults (its threads spin between matmuls),
as another user's training would be; `busy` is a pure-Python busy loop (one core, no OpenMP). It
runs in this process's session, as the measured processes do (the default run too: its own process
group, not its own session): one scheduling group, as one container, pod or cgroup is, or a box
where the kernel does not group processes by session (autogroup). In separate sessions on a desktop
kernel with autogroup, Ray's worker niceness does not show.

The policies (`--policies`), set in the measured process's environment (it starts Ray, so its actors
get them too):

- `spin`: OpenMP's spinning wait made explicit (GOMP_SPINCOUNT=300000, KMP_BLOCKTIME=200), plus `passive`'s;
- `passive`: the passive wait, with what came before this policy: Ray's default worker niceness
  (RAY_worker_niceness=15: every actor 15 nice levels below the workflow process) and the preset's
  run.torch_threads (2) in every process (OMP_NUM_THREADS=2);
- `fair`: the run as it comes: passive wait, actors at the workflow process's niceness, one torch
  thread for the tiny model (`model_threads`) in the actors and the bootstrap;
- `fair-2t`: `fair` with the preset's 2 threads everywhere (OMP_NUM_THREADS=2, which `model_threads` obeys):
  what the thread count adds to the niceness.

Three measurements, each condition in a fresh process, alone then loaded, the policies interleaved,
`--repeats` times (medians reported, every value in the JSON line). Loaded, the competitor runs for
the whole measurement (the stages: from the end of their warm-up), started and killed by it:

1. the bootstrap's seconds per step (engines/training/pretrain.py `supervised_finetune`, configs/tiny.yaml's
   bootstrap at hidden size `--widths`, the passive wait) at 1 and 2 torch threads: median of `--steps`
   steps after 2 warm-up ones. Where a second thread pays, by op size (engines/models/threads.py SMALL_WIDTH).
2. the RL stages in real Ray actors (benchmarks/contention_stages.py): rollout, scoring, reference
   forward and training step on the tiny policy, median seconds per stage over `--stage-iterations`
   after a warm-up iteration (the actors' start and model loads, which a run pays once); loaded, the
   competitor starts when the warm-up ends (`--stage-timeout` bounds the whole; past it the iterations
   done so far count).
3. the default run (`pyflyte run workflows/rlvr.py rlvr --config configs/tiny.yaml`), shortened by
   `--iterations` and `--bootstrap-steps` (or whole, `--preset`: ~4 min on an idle 2-core box), in a
   fresh folder and HOME (no cache), its wall time.

Prints side-by-side tables and one JSON line; asserts nothing. Results: docs/benchmarks.md ("Current figures").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SPIN_ENV = {"GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}   # libgomp's / LLVM OpenMP's defaults, explicit
BEFORE = {"RAY_worker_niceness": "15", "OMP_NUM_THREADS": "2"}    # Ray's default; the preset's torch_threads everywhere
POLICIES = {"spin": {**SPIN_ENV, **BEFORE}, "passive": BEFORE, "fair": {}, "fair-2t": {"OMP_NUM_THREADS": "2"}}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "FLYROLL_MAX_TORCH_THREADS",
            "RAY_worker_niceness", "FLYROLL_NICENESS")
STAGES = ("rollout", "scoring", "reference", "training")

BUSY = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"
TORCH_LOAD = """
import time, torch
torch.set_num_threads({threads})
a, b, c = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.empty(1024, 1024)
end = time.monotonic() + {limit}
while time.monotonic() < end:
    torch.mm(a, b, out=c)
"""

STEP = """
import json, random, statistics, sys, time
from engines.models.threads import set_wait_policy
set_wait_policy()
import torch
torch.set_num_threads(int(sys.argv[1]))
from configs.schema import load_config
from engines.models.modeling import build_tiny_policy
from engines.training.pretrain import supervised_finetune
from engines.data.synthetic import make_problems, teacher_demonstration
b = load_config("configs/tiny.yaml").model.bootstrap  # the default run's bootstrap, at width argv[3]
model, tok = build_tiny_policy(int(sys.argv[3]), b.num_layers, b.num_heads, max_positions=b.max_positions, seed=0)
rng = random.Random(0)
pairs = [(p.prompt, teacher_demonstration(p, rng, b.teacher_accuracy)) for p in make_problems("bootstrap", 2000, seed=0)]
stamps = []
supervised_finetune(model, tok, pairs, steps=int(sys.argv[2]) + 2, batch_size=b.batch_size, lr=b.lr, seed=0,
                    on_step=lambda s, loss: stamps.append(time.perf_counter()))
steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
print(json.dumps({"s_per_step": statistics.median(steps), "threads": torch.get_num_threads()}))
"""


def clean_env(policy: str) -> dict[str, str]:
    """This process's environment without any thread, wait or niceness setting, then `policy`'s."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", **POLICIES[policy])
    return env


def competitor_command(kind: str, threads: int, limit: float) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the competing job: OpenMP's defaults (none of flyroll's settings); it ends by
    itself after `limit` s at the latest."""
    code = TORCH_LOAD.format(threads=threads, limit=limit) if kind == "torch" else BUSY.format(limit=limit)
    return [sys.executable, "-c", code], {k: v for k, v in os.environ.items() if k not in OMP_VARS}


def competitor(kind: str, threads: int, limit: float) -> subprocess.Popen:
    """The competing job, started in this session (`competitor_command`)."""
    argv, env = competitor_command(kind, threads, limit)
    return subprocess.Popen(argv, env=env)


def with_load(load: dict | None, fn):
    """Run `fn()` beside the competitor `load` ({kind, threads, limit}; None: alone)."""
    proc = competitor(**load) if load else None
    try:
        time.sleep(1.0 if proc else 0)   # its torch import and first matmuls
        return fn()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def _python(args: list[str], env: dict, timeout: float) -> tuple[list[dict], bool]:
    """The JSON lines `python args` printed, and whether it finished within `timeout` (else its process
    group, Ray's processes included, is killed, and the lines so far are returned)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, process_group=0)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        return [json.loads(x) for x in out.splitlines() if x.startswith("{")], False
    if proc.returncode != 0:
        raise RuntimeError(err[-3000:])
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")], True


def bootstrap_step(width: int, threads: int, steps: int, timeout: float) -> float | None:
    lines, done = _python(["-c", STEP, str(threads), str(steps), str(width)], clean_env("fair"), timeout)
    return lines[-1]["s_per_step"] if done else None


def stage_seconds(policy: str, iterations: int, timeout: float, load: dict | None) -> dict:
    """benchmarks/contention_stages.py in `policy`, beside `load` from its warm-up's end: {"stages": {stage:
    median s or None}, "actors": {role: {nice, torch_threads}}, "done": iterations timed (fewer when it ran
    past `timeout`: the medians of those)}."""
    args = ["-m", "benchmarks.contention_stages", "--iterations", str(iterations)]
    lines, done = _python(args + (["--load", f"{load['kind']}:{load['threads']}"] if load else []), clean_env(policy), timeout)
    if done:
        return {**lines[-1], "done": iterations}
    timed = [x["seconds"] for x in lines if x.get("iteration", 1) > 1]
    return {"stages": {s: statistics.median([t[s] for t in timed]) if timed else None for s in STAGES}, "actors": {},
            "done": len(timed)}


def default_run(policy: str, iterations: int | None, bootstrap_steps: int | None, timeout: float) -> float | None:
    """Seconds of one default run in a fresh folder (shortened unless `iterations` is None); None past `timeout`."""
    cfg = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    with tempfile.TemporaryDirectory(prefix="flyroll-contention-") as d:
        cfg["run"]["output_dir"] = os.path.join(d, "runs")
        if iterations is not None:
            cfg["loop"].update(iterations=iterations, eval_every=iterations)
            cfg["model"]["bootstrap"]["steps"] = bootstrap_steps
        path = os.path.join(d, "config.yaml")
        Path(path).write_text(yaml.safe_dump(cfg))
        os.makedirs(os.path.join(d, "home"))
        env = {**clean_env(policy), "HOME": os.path.join(d, "home")}
        env.pop("MLFLOW_TRACKING_URI", None)
        pyflyte = str(Path(sys.executable).with_name("pyflyte"))
        t0 = time.perf_counter()
        # its own process group (killed whole on timeout), in this session: the competitor's scheduling group
        proc = subprocess.Popen([pyflyte, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", path], cwd=d, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return None
        if proc.returncode != 0:
            raise RuntimeError(out[-3000:])
        return time.perf_counter() - t0


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, timeout: float, digits: int = 2) -> str:
    return f"> {timeout:.0f} s" if x is None else f"{x:.{digits}f}"


def _sec(x: float | None, timeout: float) -> str:
    return f"> {timeout:.0f} s" if x is None else f"{x:.2f} s"


def _ratio(alone: float | None, loaded: float | None) -> str:
    return "-" if alone is None or loaded is None else f"{loaded / alone:.2f}x"


def _policy_table(rows: list[tuple[str, dict]], policies: list[str], timeout: float, digits: int) -> None:
    """One row per measurement: per policy, alone | loaded | loaded/alone."""
    print("\n| measurement | " + " | ".join(f"{p} alone | {p} loaded | {p} ratio" for p in policies) + " |")
    print("|---|" + "---|---|---|" * len(policies))
    for name, got in rows:
        cells = []
        for p in policies:
            alone, loaded = _med(got[p]["alone"]), _med(got[p]["loaded"])
            cells += [_fmt(alone, timeout, digits), _fmt(loaded, timeout, digits), _ratio(alone, loaded)]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.contention", description=__doc__.split("\n")[0])
    p.add_argument("--competitor", choices=("torch", "busy"), default="torch", help="the competing job (module docstring)")
    p.add_argument("--load-threads", type=int, default=2, help="torch threads of the `torch` competitor")
    p.add_argument("--load-only", type=float, default=0, help="only run the competitor for this many seconds, in the foreground")
    p.add_argument("--policies", default="passive,fair", help="comma-separated: spin, passive, fair (module docstring)")
    p.add_argument("--repeats", type=int, default=2, help="times each condition is measured, interleaved")
    p.add_argument("--widths", default="128,576", help="bootstrap hidden sizes (configs/tiny.yaml: 128; SmolLM2: 576)")
    p.add_argument("--steps", type=int, default=6, help="bootstrap steps measured per condition (after 2 warm-up steps)")
    p.add_argument("--stage-iterations", type=int, default=3, help="timed RL iterations in the actors (after one warm-up)")
    p.add_argument("--iterations", type=int, default=2, help="loop.iterations of the shortened default run (preset: 20)")
    p.add_argument("--bootstrap-steps", type=int, default=60, help="model.bootstrap.steps of the shortened run (preset: 1500)")
    p.add_argument("--preset", action="store_true", help="the default run as the preset is, not shortened")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before a measurement is given up (reported as > timeout)")
    p.add_argument("--stage-timeout", type=float, default=600,
                   help="seconds for one stage measurement; past it, the iterations done so far count (reported), none: > timeout")
    for what in ("bootstrap", "stages", "run"):
        p.add_argument(f"--skip-{what}", action="store_true", help=f"leave out the {what} measurement")
    a = p.parse_args(argv)
    load = {"kind": a.competitor, "threads": a.load_threads, "limit": a.timeout + 60}
    if a.load_only:   # this process becomes the competitor (its pid is the competitor's: `kill` ends it)
        argv, env = competitor_command(**{**load, "limit": a.load_only})
        os.execve(argv[0], argv, env)
    policies = [x for x in a.policies.split(",") if x]
    what = f"a {a.load_threads}-thread torch matmul loop" if a.competitor == "torch" else "a pure-Python busy loop"
    print(f"machine: {os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; competitor: {what}, in this session", flush=True)
    results: dict = {"bootstrap": {}, "stages": {}, "actors": {}, "run": {}}
    conditions = [(pol, ld) for pol in policies for ld in ("alone", "loaded")]
    for rep in range(a.repeats):
        if not a.skip_bootstrap:
            for width in map(int, a.widths.split(",")):
                for threads in (1, 2):
                    for ld in ("alone", "loaded"):
                        r = with_load(load if ld == "loaded" else None, lambda: bootstrap_step(width, threads, a.steps, a.timeout))
                        results["bootstrap"].setdefault(f"{width}/{threads}", {"alone": [], "loaded": []})[ld].append(r)
                        print(f"  [{rep + 1}] bootstrap width {width} {threads} thread(s) {ld:<6} {_fmt(r, a.timeout, 3)} s/step", flush=True)
        if not a.skip_stages:
            for pol, ld in conditions:
                r = stage_seconds(pol, a.stage_iterations, a.stage_timeout, load if ld == "loaded" else None)
                for s in STAGES:
                    results["stages"].setdefault(s, {q: {"alone": [], "loaded": []} for q in policies})[pol][ld].append(r["stages"][s])
                results["actors"][pol] = r["actors"] or results["actors"].get(pol, {})
                late = "" if r["done"] == a.stage_iterations else f"  ({r['done']} of {a.stage_iterations} iterations within {a.stage_timeout:.0f} s)"
                print(f"  [{rep + 1}] stages {pol:<7} {ld:<6} " + ", ".join(f"{s} {_sec(r['stages'][s], a.stage_timeout)}" for s in STAGES)
                      + late + (f"  (actors: {r['actors']})" if r["actors"] else ""), flush=True)
        if not a.skip_run:
            for pol, ld in conditions:
                its, steps = (None, None) if a.preset else (a.iterations, a.bootstrap_steps)
                r = with_load(load if ld == "loaded" else None, lambda: default_run(pol, its, steps, a.timeout))
                results["run"].setdefault(pol, {"alone": [], "loaded": []})[ld].append(r)
                print(f"  [{rep + 1}] default run {pol:<7} {ld:<6} {_fmt(r, a.timeout, 0)} s", flush=True)
    if results["bootstrap"]:
        print("\n| bootstrap s/step (passive wait) | alone | loaded | ratio |\n|---|---|---|---|")
        for key, got in results["bootstrap"].items():
            width, threads = key.split("/")
            alone, loaded = _med(got["alone"]), _med(got["loaded"])
            print(f"| width {width}, {threads} thread(s) | {_fmt(alone, a.timeout, 3)} | {_fmt(loaded, a.timeout, 3)} | {_ratio(alone, loaded)} |")
    if results["stages"]:
        _policy_table([(f"{s} s (in its Ray actor)", results["stages"][s]) for s in STAGES], policies, a.timeout, 2)
        print("actors (niceness, torch threads):", json.dumps(results["actors"]))
    if results["run"]:
        name = "default run, wall s" + ("" if a.preset else f" ({a.iterations} it., {a.bootstrap_steps} bootstrap steps)")
        _policy_table([(name, results["run"])], policies, a.timeout, 0)
    print(json.dumps({"results": results, "args": vars(a), "load_after": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`flyroll bench --pipeline N`: the real workflow's per-stage breakdown, orchestration included.

Runs `pyflyte run workflows/rlvr.py rlvr --config <generated>` (local Flyte execution, local Ray,
SQLite MLflow) on the benchmark's model with the same batch (B x G), max new tokens and learning
rate, for N iterations, with HOME and the run folder in a temporary directory; then reads the
per-iteration stage timings back from MLflow.

Every stage task logs `timing/<stage>_s` (tasks/run/common.py `stage()`: the task body, its Ray actor
calls and its artifact reads/writes) at step=iteration, at the moment the stage ends; MLflow keeps
that moment as the point's timestamp. So an iteration's wall time is the time between the end of
the previous iteration's weight sync (or of the evaluation that followed it) and the end of its own,
and

    orchestration = iteration wall - (rollout + scoring + reference + training + weight sync)

is what lies outside the stage bodies: Flyte task dispatch and type conversion (the rollout table
through parquet between tasks, FlyteDirectory checkpoints), Ray init per task, MLflow logging and
model registration. Iteration 1 (actor start, first model loads) is shown apart from the mean.

Modes (`--pipeline-modes`, default all three, run one after the other on the same config and
threads): `shared` (FLYROLL_RAY=shared: one local Ray for the run, engine actors reused),
`per-task` (FLYROLL_RAY=per-task: each stage task starts and stops its own cluster,
infra/ray_cluster.py) and `fused` (`loop.fuse: N`, all N iterations in one task, tasks/stages/fused.py,
with FLYROLL_RAY=per-task so that its one cluster has the per-task shape and it compares with
`per-task`); opt-in `async` is `fused` with `pipeline.off_policy_steps: 1` (the next rollout runs in
a thread beside the update, so stage seconds overlap and orchestration can come out negative;
compare its wall and samples/s with `fused`); opt-in `fused-live` is `fused` with `sync.method: live`
(the trainer sends each policy to the generation actors, tasks/loop/live_sync.py; compare with `fused`);
opt-in `fused-live-lean` is `fused-live` with `checkpoint.publish_every: 4` (compare with `fused-live`). A second table puts them side by side, per mode for iteration 1, the mean of 2..N and
the mean of 1..N: wall, compute (the five stage bodies), orchestration (wall - compute) and, within
orchestration, the Ray cluster start seconds on that iteration's clock (`timing/<stage>_ray_start_s`,
logged in per-task mode; 0 in shared mode; a fused chunk's one start is counted once, on the chunk's
first iteration, so the 1..N row spreads it over the chunk), and the rest of orchestration (Flyte
dispatch and type conversion between tasks, MLflow outside the stage bodies). Engine actor start and
the policy's load from the store happen inside a stage's body (tasks/stages/rollout.py, tasks/stages/training.py),
so they count as compute here and are not timed apart: iteration 1 vs 2..N, and per-task (actors
made in every task) vs shared/fused (actors kept), shows them as a difference in compute.

`--pipeline-as-step` runs the workflow at the `flyroll bench` step's settings, so the two compare
(docs/benchmarks.md, 2026-12-04): no KL (`algorithm.kl_coef: 0`; with one on-policy pass the
reference stage then runs no forward, as the step runs none), the step's reward (`--reward`,
benchmarks/bench_reward.py) for the synthetic domains, and in the cluster-shaped modes each engine
actor reserving `--threads` CPUs (`placement.<role>.cpu`), since an actor's torch threads are capped
by its Ray CPU reservation (engines/models/threads.py) and the cpu profile reserves 1 CPU per actor. What
stays different is what the pipeline does beyond the step: a checkpoint per version (weights and
optimizer state), its publish to the store with lineage, MLflow, the table between stages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO, TRL_SYSTEM, fmt, ratio

STAGES = ("rollout", "scoring", "reference", "training", "weight_sync")
# --pipeline-modes: mode -> (FLYROLL_RAY, fused, pipeline.off_policy_steps). `fused` runs every
# iteration in one task (loop.fuse: N) on the per-task cluster shape, so it is compared with
# `per-task`; `async` is `fused` with off_policy_steps 1 (and algorithm.tis_cap 2.0): the next
# iteration's rollout runs beside the update (tasks/stages/fused.py), so it is compared with `fused`.
MODES = {"shared": ("shared", False, 0), "per-task": ("per-task", False, 0), "fused": ("per-task", True, 0),
         "async": ("per-task", True, 1), "fused-live": ("per-task", True, 0), "fused-live-lean": ("per-task", True, 0)}
# `fused-live` is `fused` with sync.method live: the trainer sends each policy to the generators
# (tasks/loop/live_sync.py) instead of their fetching and loading the published checkpoint; compare with `fused`.
# `fused-live-lean` is `fused-live` with checkpoint.publish_every LEAN_EVERY (tasks/loop/publish_plan.py):
# most versions are neither written nor uploaded; compare with `fused-live`
LIVE = {"fused-live", "fused-live-lean"}
# the synthetic domains the bench step's prompts come from (engines/data/synthetic.py DOMAINS, the data default)
STEP_DOMAINS = ("arithmetic", "reverse")
STEP_ROLES = ("actor_train", "actor_infer", "reference")  # the engine actors a bench step's work runs on
LEAN_EVERY = 4


def cluster_starts(points: dict[str, dict[int, tuple[float, float]]], iterations: list[int]) -> dict[int, float]:
    """Ray cluster start seconds on each iteration's clock, from `<stage>_ray_start` points.

    points: as `iteration_breakdown` takes, with `<stage>_ray_start` -> {step: (timestamp_s, seconds)}
    for the stages (tasks/run/common.py `stage()` logs `timing/<stage>_ray_start_s` when its task runs on
    its own cluster, FLYROLL_RAY=per-task). A cluster is known by its start seconds: every stage of a
    fused chunk (one task, one cluster) logs the same value in every iteration of the chunk, so within
    an iteration equal values are one cluster, and a stage that logs the value it logged in the
    previous iteration is on that same cluster, already counted: a fused chunk's start is counted
    once, on its first iteration (whose wall holds it). Separate per-task clusters log a value each,
    all counted. No points (shared mode): 0 per iteration."""
    prev, out = {}, {}
    for i in iterations:
        now = {s: points[f"{s}_ray_start"][i][1] for s in STAGES if i in points.get(f"{s}_ray_start", {})}
        out[i] = sum({v for s, v in now.items() if prev.get(s) != v})
        prev = now
    return out


def iteration_breakdown(points: dict[str, dict[int, tuple[float, float]]]) -> list[dict]:
    """Per-iteration wall time, stage seconds, compute (their sum), orchestration and Ray cluster start.

    points: stage name (STAGES and "evaluation") -> {step: (timestamp_s at the stage's end, seconds)},
    optionally `<stage>_ray_start` (see `cluster_starts`). An iteration i starts when the latest of
    weight_sync(i-1) and evaluation(i-1) ended (evaluation at step 0 is the run's initial one);
    iterations without a start or a complete set of stages are skipped. `ray_start_s` is part of
    `orchestration_s` (a per-task cluster starts before its stage's body)."""
    ws, ev = points.get("weight_sync", {}), points.get("evaluation", {})
    out = []
    for i in sorted(ws):
        starts = [p[0] for p in (ws.get(i - 1), ev.get(i - 1)) if p is not None]
        if not starts or any(i not in points.get(s, {}) for s in STAGES):
            continue
        wall = ws[i][0] - max(starts)
        stages = {s: points[s][i][1] for s in STAGES}
        out.append({"iteration": i, "wall_s": wall, **{f"{s}_s": v for s, v in stages.items()},
                    "compute_s": sum(stages.values()), "orchestration_s": wall - sum(stages.values())})
    ray = cluster_starts(points, [it["iteration"] for it in out])
    for it in out:
        it["ray_start_s"] = ray[it["iteration"]]
    return out


def mean_breakdown(iterations: list[dict], samples: int) -> dict:
    """Mean over the given iterations: seconds per stage, compute, orchestration and Ray start, the
    share of the wall of each stage and of orchestration, samples/s."""
    n = len(iterations)
    keys = [f"{s}_s" for s in STAGES] + ["orchestration_s"]
    mean = {k: sum(it.get(k, 0.0) for it in iterations) / n for k in ["wall_s", "compute_s", "ray_start_s"] + keys}
    return {"iterations": [it["iteration"] for it in iterations], **mean,
            **{k[:-2] + "_share": mean[k] / mean["wall_s"] for k in keys},
            "samples_per_s": samples / mean["wall_s"]}


def mode_rows(results: list[dict]) -> list[dict]:
    """The side-by-side rows of `--pipeline-modes`: per result (a `run_pipeline` answer with its
    `per_iteration`), iteration 1 (actor start, first model loads, a fused chunk's cluster start),
    the mean of iterations 2.. and the mean of all iterations (where a fused chunk's one cluster start
    is spread over its iterations). Each row: model, engine, mode, iterations ("1", "2-3", "1-3"),
    wall_s, compute_s, orchestration_s, ray_start_s, other_s (orchestration less Ray start: Flyte
    dispatch and I/O between tasks, MLflow outside the stage bodies). A
    result without iterations gives one row with its error."""
    keys = ("wall_s", "compute_s", "orchestration_s", "ray_start_s")
    rows = []
    for r in results:
        head = {"model": r["model"], "engine": r["engine"], "mode": r.get("mode", "shared")}
        its = r.get("per_iteration") or []
        if not its:
            rows.append({**head, "error": r.get("error", "no complete iteration")})
            continue
        first, later = [it for it in its if it["iteration"] == 1], [it for it in its if it["iteration"] > 1]
        groups = [g for g in (first, later, its if first and later else []) if g]
        for g in groups:
            n = [it["iteration"] for it in g]
            mean = {k: sum(it.get(k, 0.0) for it in g) / len(g) for k in keys}
            rows.append({**head, "iterations": str(n[0]) if len(n) == 1 else f"{n[0]}-{n[-1]}", **mean,
                         "other_s": mean["orchestration_s"] - mean["ray_start_s"]})
    return rows


def read_points(tracking_uri: str) -> dict[str, dict[int, tuple[float, float]]]:
    """timing/<stage>_s (and timing/<stage>_ray_start_s, per-task Ray) of the (only) parent run in a
    fresh MLflow store, as iteration_breakdown wants."""
    from infra import tracking

    c = tracking.client(tracking_uri)
    exp = c.get_experiment_by_name("flyroll")
    runs = [r for r in c.search_runs([exp.experiment_id], max_results=1000) if "mlflow.parentRunId" not in r.data.tags]
    run_id = runs[0].info.run_id
    keys = {s: f"timing/{s}_s" for s in (*STAGES, "evaluation")} | {f"{s}_ray_start": f"timing/{s}_ray_start_s" for s in STAGES}
    return {name: {m.step: (m.timestamp / 1000, m.value) for m in c.get_metric_history(run_id, key)}
            for name, key in keys.items()}


def pipeline_config(name: str, model_dir: str, chat: bool, engine: str, args, out: str, mode: str = "shared") -> dict:
    b, g = args.prompts, args.samples
    fuse = max(2, args.pipeline) if MODES[mode][1] else 1  # fused: all N iterations in one chunk (fuse 1 is unfused)
    as_step = getattr(args, "pipeline_as_step", False)
    return {
        "run": {"name": f"bench-{name}-{engine}-{mode}", "seed": 0, "output_dir": out, "tracking_uri": f"sqlite:///{out}/mlflow.db",
                "torch_threads": args.threads},
        "model": {"path": model_dir, "apply_chat_template": chat},
        "data": {"train_size": 256, "eval_size": 8},
        "rollout": {"engine": engine, "prompts_per_iteration": b, "samples_per_prompt": g, "temperature": 1.0,
                    "max_new_tokens": args.max_new, "micro_batch": b * g},
        # the preset's KL: the reference stage does its real work; --pipeline-as-step: none, as the bench step
        "algorithm": {"advantage": "grpo", "kl_coef": 0.0 if as_step else 0.001,
                      **({"tis_cap": 2.0} if MODES[mode][2] else {})},
        # --pipeline-as-step: the bench step's reward (--reward, benchmarks/bench_reward.py) for every domain
        **({"reward": {"functions": {d: f"benchmarks.bench_reward:{args.reward}_reward" for d in STEP_DOMAINS}}}
           if as_step else {}),
        "training": {"lr": args.lr, "mini_batch_size": b * g, "max_tokens_per_micro_batch": args.micro_tokens},
        "loop": {"iterations": args.pipeline, "eval_every": 1_000_000, "fuse": fuse},  # evaluate at the start and the end only
        "pipeline": {"off_policy_steps": MODES[mode][2]},
        "sync": {"method": "live" if mode in LIVE else "store"},
        **({"checkpoint": {"publish_every": LEAN_EVERY}} if mode == "fused-live-lean" else {}),
        # --pipeline-as-step: every engine actor reserves --threads CPUs, so it runs --threads torch threads
        # as the bench step's one process does (an actor's threads are capped by its Ray CPU reservation,
        # engines/models/threads.py, and the cpu profile's actors reserve 1 CPU each on a cluster-shaped run)
        **({"placement": {role: {"cpu": float(args.threads)} for role in STEP_ROLES}}
           if as_step and MODES[mode][0] == "per-task" else {}),
    }


def workflow_command(cfg: dict, root: str, **env_vars: str) -> tuple[list[str], dict]:
    """(command, environment) of `pyflyte run workflows/rlvr.py rlvr` on `cfg`, written to
    root/config.yaml, with HOME = root/home (Flyte's local cache stays in the run) and no inherited
    MLflow tracking URI; `env_vars` are added to the environment."""
    import yaml

    home = os.path.join(root, "home")
    os.makedirs(home, exist_ok=True)
    cfg_path = os.path.join(root, "config.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    cmd = [str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/rlvr.py", "rlvr", "--config", cfg_path]
    env = {**os.environ, "HOME": home, "PYTHONPATH": str(REPO), **env_vars}
    env.pop("MLFLOW_TRACKING_URI", None)
    return cmd, env


def run_pipeline(name: str, model_dir: str, chat: bool, engine: str, args, workdir: str, mode: str = "shared") -> dict:
    root = os.path.join(workdir, f"pipeline-{name}-{engine}-{mode}")
    cfg = pipeline_config(name, model_dir, chat, engine, args, os.path.join(root, "runs"), mode)
    cmd, env = workflow_command(cfg, root, FLYROLL_RAY=MODES[mode][0])
    print(f"[{name}] pipeline, engine {engine}, mode {mode} (FLYROLL_RAY={MODES[mode][0]}, loop.fuse "
          f"{cfg['loop']['fuse']}): {' '.join(cmd)}  (HOME={env['HOME']}; log {root}/pyflyte.log)", flush=True)
    t0 = time.time()
    with open(os.path.join(root, "pyflyte.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if "▸" in line:  # the stage lines of tasks/run/common.py
                print(f"[{name}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    total = time.time() - t0
    row = {"model": name, "engine": engine, "mode": mode, "iterations_run": args.pipeline, "command_s": total, "config": cfg}
    if rc:
        tail = Path(root, "pyflyte.log").read_text()[-3000:]
        print(f"[{name}] pipeline failed (exit {rc}):\n{tail}", file=sys.stderr)
        return {**row, "error": f"pyflyte exited {rc} (log {root}/pyflyte.log)"}
    per_iter = iteration_breakdown(read_points(cfg["run"]["tracking_uri"]))
    steady = [it for it in per_iter if it["iteration"] > 1] or per_iter
    return {**row, "per_iteration": per_iter, "mean": mean_breakdown(steady, args.prompts * args.samples) if steady else None}


def print_pipeline(results: list[dict], comparison: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    trl = {r["model"]: r.get("samples_per_s") for r in comparison if r["system"] == TRL_SYSTEM}
    t = Table(title="Flyte pipeline (pyflyte run workflows/rlvr.py rlvr): mean seconds per iteration (share of the "
                    "iteration), iterations 2.. (1 includes actor start and first loads)")
    for col in ("model", "engine", "mode", "iter s", "samples/s", "vs TRL*", *STAGES, "orchestration"):
        t.add_column(col, justify="left" if col in ("model", "engine", "mode") else "right")
    for r in results:
        m = r.get("mean")
        if not m:
            t.add_row(r["model"], r["engine"], r.get("mode", "shared"), f"[red]{r.get('error', 'no complete iteration')[:60]}[/]",
                      *[""] * (3 + len(STAGES)))
            continue
        cells = [f"{m[f'{s}_s']:.2f} ({100 * m[f'{s}_share']:.0f}%)" for s in (*STAGES, "orchestration")]
        t.add_row(r["model"], r["engine"], r.get("mode", "shared"), f"{m['wall_s']:.2f}", fmt(m["samples_per_s"], ".2f"),
                  fmt(ratio(m["samples_per_s"], trl.get(r["model"])), ".2f", "x"), *cells)
    Console(width=max(190, shutil.get_terminal_size().columns)).print(t)
    print("* against TRL's steps earlier in this run: not alternated with the pipeline, and the pipeline does more "
          "per iteration (reference forward, KL, evaluation-ready checkpoints)")
    for r in results:
        for it in r.get("per_iteration", []):
            print(f"  {r['model']} {r['engine']} {r.get('mode', 'shared')} iteration {it['iteration']}: wall {it['wall_s']:.2f} s, "
                  f"orchestration {it['orchestration_s']:.2f} s ({100 * it['orchestration_s'] / it['wall_s']:.0f}%), "
                  f"of which Ray cluster start {it.get('ray_start_s', 0.0):.2f} s")
    print_modes(results)


def print_modes(results: list[dict]) -> None:
    """The modes side by side (`mode_rows`): mean seconds per iteration."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Ray modes side by side: mean seconds per iteration (compute = the five stage bodies; orchestration = "
                    "wall - compute; Ray start = cluster starts on that iteration's clock, within orchestration)")
    for col in ("model", "engine", "mode", "iterations", "wall", "compute", "orchestration", "Ray start", "other orch."):
        t.add_column(col, justify="left" if col in ("model", "engine", "mode", "iterations") else "right")
    for r in mode_rows(results):
        if "error" in r:
            t.add_row(r["model"], r["engine"], r["mode"], f"[red]{r['error'][:60]}[/]", *[""] * 5)
            continue
        t.add_row(r["model"], r["engine"], r["mode"], r["iterations"],
                  *(f"{r[k]:.2f}" for k in ("wall_s", "compute_s", "orchestration_s", "ray_start_s", "other_s")))
    Console(width=max(150, shutil.get_terminal_size().columns)).print(t)
    print("modes: shared = one local Ray for the run; per-task = each stage task starts and stops its own cluster; "
          "fused = loop.fuse: N (all iterations in one task) on the per-task cluster shape, one cluster start, counted "
          "on iteration 1 (the 1-N row spreads it over the chunk); async = fused with pipeline.off_policy_steps 1: the "
          "next rollout runs beside the update, so its stage seconds overlap and orchestration (wall - their sum) can "
          "be negative")

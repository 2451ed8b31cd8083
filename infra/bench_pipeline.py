"""`flyroll bench --pipeline N`: the real workflow's per-stage breakdown, orchestration included.

Runs `pyflyte run workflows/rlvr.py rlvr --config <generated>` (local Flyte execution, local Ray,
SQLite MLflow) on the benchmark's model with the same batch (B x G), max new tokens and learning
rate, for N iterations, with HOME and the run folder in a temporary directory; then reads the
per-iteration stage timings back from MLflow.

Every stage task logs `timing/<stage>_s` (tasks/common.py `stage()`: the task body, its Ray actor
calls and its artifact reads/writes) at step=iteration, at the moment the stage ends; MLflow keeps
that moment as the point's timestamp. So an iteration's wall time is the time between the end of
the previous iteration's weight sync (or of the evaluation that followed it) and the end of its own,
and

    orchestration = iteration wall - (rollout + scoring + reference + training + weight sync)

is what lies outside the stage bodies: Flyte task dispatch and type conversion (the rollout table
through parquet between tasks, FlyteDirectory checkpoints), Ray init per task, MLflow logging and
model registration. Iteration 1 (actor start, first model loads) is shown apart from the mean.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("rollout", "scoring", "reference", "training", "weight_sync")


def iteration_breakdown(points: dict[str, dict[int, tuple[float, float]]]) -> list[dict]:
    """Per-iteration wall time, stage seconds and orchestration.

    points: stage name (STAGES and "evaluation") -> {step: (timestamp_s at the stage's end, seconds)}.
    An iteration i starts when the latest of weight_sync(i-1) and evaluation(i-1) ended (evaluation
    at step 0 is the run's initial one); iterations without a start or a complete set of stages are
    skipped."""
    ws, ev = points.get("weight_sync", {}), points.get("evaluation", {})
    out = []
    for i in sorted(ws):
        starts = [p[0] for p in (ws.get(i - 1), ev.get(i - 1)) if p is not None]
        if not starts or any(i not in points.get(s, {}) for s in STAGES):
            continue
        wall = ws[i][0] - max(starts)
        stages = {s: points[s][i][1] for s in STAGES}
        out.append({"iteration": i, "wall_s": wall, **{f"{s}_s": v for s, v in stages.items()},
                    "orchestration_s": wall - sum(stages.values())})
    return out


def mean_breakdown(iterations: list[dict], samples: int) -> dict:
    """Mean over the given iterations: seconds per stage, share of the wall, samples/s."""
    n = len(iterations)
    keys = [f"{s}_s" for s in STAGES] + ["orchestration_s"]
    mean = {k: sum(it[k] for it in iterations) / n for k in ["wall_s"] + keys}
    return {"iterations": [it["iteration"] for it in iterations], **mean,
            **{k[:-2] + "_share": mean[k] / mean["wall_s"] for k in keys},
            "samples_per_s": samples / mean["wall_s"]}


def read_points(tracking_uri: str) -> dict[str, dict[int, tuple[float, float]]]:
    """timing/<stage>_s of the (only) parent run in a fresh MLflow store, as iteration_breakdown wants."""
    from infra import tracking

    c = tracking.client(tracking_uri)
    exp = c.get_experiment_by_name("flyroll")
    runs = [r for r in c.search_runs([exp.experiment_id], max_results=1000) if "mlflow.parentRunId" not in r.data.tags]
    run_id = runs[0].info.run_id
    return {s: {m.step: (m.timestamp / 1000, m.value) for m in c.get_metric_history(run_id, f"timing/{s}_s")}
            for s in (*STAGES, "evaluation")}


def pipeline_config(name: str, model_dir: str, chat: bool, engine: str, args, out: str) -> dict:
    b, g = args.prompts, args.samples
    return {
        "run": {"name": f"bench-{name}-{engine}", "seed": 0, "output_dir": out, "tracking_uri": f"sqlite:///{out}/mlflow.db",
                "torch_threads": args.threads},
        "model": {"path": model_dir, "apply_chat_template": chat},
        "data": {"train_size": 256, "eval_size": 8},
        "rollout": {"engine": engine, "prompts_per_iteration": b, "samples_per_prompt": g, "temperature": 1.0,
                    "max_new_tokens": args.max_new, "micro_batch": b * g},
        "algorithm": {"advantage": "grpo", "kl_coef": 0.001},  # the preset's KL: the reference stage does its real work
        "training": {"lr": args.lr, "mini_batch_size": b * g, "max_tokens_per_micro_batch": args.micro_tokens},
        "loop": {"iterations": args.pipeline, "eval_every": 1_000_000},  # evaluate at the start and the end only
    }


def run_pipeline(name: str, model_dir: str, chat: bool, engine: str, args, workdir: str) -> dict:
    import yaml

    repo = Path(__file__).resolve().parent.parent
    root = os.path.join(workdir, f"pipeline-{name}-{engine}")
    home = os.path.join(root, "home")
    os.makedirs(home, exist_ok=True)
    cfg = pipeline_config(name, model_dir, chat, engine, args, os.path.join(root, "runs"))
    cfg_path = os.path.join(root, "config.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    pyflyte = str(Path(sys.executable).parent / "pyflyte")
    cmd = [pyflyte, "run", "workflows/rlvr.py", "rlvr", "--config", cfg_path]
    env = {**os.environ, "HOME": home, "PYTHONPATH": str(repo)}
    env.pop("MLFLOW_TRACKING_URI", None)
    print(f"[{name}] pipeline, engine {engine}: {' '.join(cmd)}  (HOME={home}; log {root}/pyflyte.log)", flush=True)
    t0 = time.time()
    with open(os.path.join(root, "pyflyte.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(repo), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if "▸" in line:  # the stage lines of tasks/common.py
                print(f"[{name}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    total = time.time() - t0
    row = {"model": name, "engine": engine, "iterations_run": args.pipeline, "command_s": total, "config": cfg}
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

    from infra.bench import TRL_SYSTEM, fmt, ratio

    trl = {r["model"]: r.get("samples_per_s") for r in comparison if r["system"] == TRL_SYSTEM}
    t = Table(title="Flyte pipeline (pyflyte run workflows/rlvr.py rlvr): mean seconds per iteration (share of the "
                    "iteration), iterations 2.. (1 includes actor start and first loads)")
    for col in ("model", "engine", "iter s", "samples/s", "vs TRL*", *STAGES, "orchestration"):
        t.add_column(col, justify="left" if col in ("model", "engine") else "right")
    for r in results:
        m = r.get("mean")
        if not m:
            t.add_row(r["model"], r["engine"], f"[red]{r.get('error', 'no complete iteration')[:60]}[/]", *[""] * (3 + len(STAGES)))
            continue
        cells = [f"{m[f'{s}_s']:.2f} ({100 * m[f'{s}_share']:.0f}%)" for s in (*STAGES, "orchestration")]
        t.add_row(r["model"], r["engine"], f"{m['wall_s']:.2f}", fmt(m["samples_per_s"], ".2f"),
                  fmt(ratio(m["samples_per_s"], trl.get(r["model"])), ".2f", "x"), *cells)
    Console(width=max(190, shutil.get_terminal_size().columns)).print(t)
    print("* against TRL's steps earlier in this run: not alternated with the pipeline, and the pipeline does more "
          "per iteration (reference forward, KL, evaluation-ready checkpoints)")
    for r in results:
        for it in r.get("per_iteration", []):
            print(f"  {r['model']} {r['engine']} iteration {it['iteration']}: wall {it['wall_s']:.2f} s, orchestration "
                  f"{it['orchestration_s']:.2f} s ({100 * it['orchestration_s'] / it['wall_s']:.0f}%)")

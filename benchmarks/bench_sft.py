"""SFT side by side: flyroll's `sft` workflow and TRL's SFTTrainer, same model, data, steps and optimizer.

    python -m benchmarks.bench_sft --config configs/sft_smollm2.yaml --steps 120
    python -m benchmarks.bench_sft --config configs/sft_tiny.yaml --steps 20 --no-trl --json /tmp/sft.json

What it compares: CONFIG's `sft` run for --steps optimizer steps of sft.batch_size rows, one after the
other on the same box, flyroll first:
- flyroll: the real workflow, `pyflyte run workflows/sft.py sft` on CONFIG with sft.steps = --steps (one
  published version, sft.eval_every 0: the workflow's own reward-based eval at the start and the end),
  run.torch_threads = --threads, local Flyte, local Ray, SQLite MLflow, HOME and run folder under --root.
  Its wall time is the whole process (Ray start, the model's import into its store, the two evaluations,
  the publish); its training time is the training stage's own (`timing/training_s`, which includes loading the
  model into the training actor).
- TRL: benchmarks/trl_sft.py in `.venv-trl` (TRL 1.16, created on first use) on the rows flyroll trained
  on (its dataset version's train table, read back from its store: the same held-out split) from the same
  base model folder (the one flyroll imported, fetched from its store), with the same batch size, steps,
  lr, weight decay, gradient clip, warmup and cosine decay to 0.1 × lr, and loss on the completion only.
  Its training time is `trainer.train()`; its wall time the whole process (imports, model load, save).
Then the base model and both results are evaluated by the same code, engines/rewards/evaluation.py
`evaluate` (greedy, CONFIG's rewards, max new tokens and stop strings) on the dataset's eval prompts.
Peak memory per side: the largest sum of RSS over the side's process tree (its Ray workers included),
sampled every 0.5 s. Mean loss: the training loss averaged over the steps (flyroll logs one mean per
published version; TRL one value per step). Printed: one table; --json writes the numbers. Threads: --threads for both sides
(torch intra-op; OMP_NUM_THREADS is set to it).

Caveats: not alternated (box drift between the runs lands on one side; the box probe before and after
shows how much); flyroll's wall time carries its workflow and evaluation costs, which is why its
training time is shown apart; the two trainers draw rows in different orders.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from benchmarks.harness import REPO, box_probe, ensure_trl_venv, fmt

PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))


def run_measured(cmd: list[str], env: dict, log_path: str, cwd: str) -> dict:
    """Runs `cmd` to the end; its wall time, exit code and peak memory: the largest sum of RSS over its
    process tree and over the Ray processes started meanwhile (a local Ray instance's daemons and workers
    are not the driver's children), each process counted once, sampled every 0.5 s."""
    import psutil

    before = set(psutil.pids())
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        peak, done = 0, threading.Event()

        def sample():
            nonlocal peak
            while not done.is_set():
                procs = {}
                try:
                    root = psutil.Process(proc.pid)
                    procs = {p.pid: p for p in (root, *root.children(recursive=True))}
                except psutil.NoSuchProcess:
                    pass
                for p in psutil.process_iter(["cmdline"]):
                    if p.pid not in before and p.pid not in procs and "ray" in " ".join(p.info["cmdline"] or []):
                        procs[p.pid] = p
                total = 0
                for p in procs.values():
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak = max(peak, total)
                done.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
    return {"wall_s": time.time() - t0, "rc": rc, "peak_rss_gb": peak / 2**30}


def flyroll_side(raw: dict, steps: int, threads: int, root: str) -> dict:
    cfg = json.loads(json.dumps(raw))
    cfg.setdefault("run", {}).update(output_dir=os.path.join(root, "runs"), name="bench-sft", torch_threads=threads)
    cfg["sft"].update(steps=steps, steps_per_version=steps, eval_every=0)
    cfg["sft"].pop("epochs", None)
    path = os.path.join(root, "flyroll.yaml")
    Path(path).write_text(yaml.safe_dump(cfg))
    home = os.path.join(root, "home")
    os.makedirs(home, exist_ok=True)
    env = {**os.environ, "HOME": home, "OMP_NUM_THREADS": str(threads), "FLYROLL_MAX_TORCH_THREADS": str(threads)}
    print(f"flyroll: pyflyte run workflows/sft.py sft --config {path} (log {root}/flyroll.log)", flush=True)
    res = run_measured([PYFLYTE, "run", str(REPO / "workflows/sft.py"), "sft", "--config", path], env,
                       os.path.join(root, "flyroll.log"), cwd=str(REPO))
    if res["rc"] != 0:
        raise RuntimeError(f"the flyroll run failed (exit {res['rc']}): see {root}/flyroll.log")
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{root}/runs/mlflow.db")
    exp = c.get_experiment_by_name(cfg["run"].get("experiment", "flyroll"))
    run = next(r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags)
    metric = {k: sorted(c.get_metric_history(run.info.run_id, k), key=lambda m: m.step)
              for k in ("sft/loss", "eval/accuracy", "timing/training_s")}
    store = os.path.join(root, "runs", "store")
    final = run.data.tags["flyroll.final_policy"]
    manifest = json.loads(Path(store, final, "MANIFEST.json").read_text())
    res.update(final=final, base=manifest["parents"][0], dataset=manifest["metadata"]["dataset"].rsplit("/", 1)[0],
               train_s=sum(m.value for m in metric["timing/training_s"]) or None,
               loss_mean=sum(m.value for m in metric["sft/loss"]) / len(metric["sft/loss"]) if metric["sft/loss"] else None,
               in_run_accuracy=[m.value for m in metric["eval/accuracy"]], store=store)
    return res


def _table(store: str, key: str):
    import pandas as pd

    return pd.concat([pd.read_parquet(p) for p in sorted(glob.glob(os.path.join(store, key, "*.parquet")))], ignore_index=True)


def _fetch(store: str, key: str, to: str) -> str:
    from infra.store import ArtifactStore

    ArtifactStore(store).fetch(key, to)
    return to


def trl_side(python: str, raw: dict, fly: dict, steps: int, threads: int, root: str) -> dict:
    train = _table(fly["store"], fly["dataset"] + "/train")
    if "messages" in train.columns and train["messages"].notna().any():
        raise SystemExit("bench_sft: chat-message rows are not passed to TRL here; use prompt/response rows")
    tr = raw.get("training", {})
    spec = {"model_dir": fly["base_dir"], "out_dir": os.path.join(root, "trl_out"), "seed": raw.get("run", {}).get("seed", 0),
            "rows": [{"prompt": p, "completion": r} for p, r in zip(train["prompt"], train["response"])],
            "chat": bool(raw.get("model", {}).get("apply_chat_template", False)), "steps": steps,
            "batch_size": raw["sft"].get("batch_size", 16), "lr": tr.get("lr", 1e-5), "weight_decay": tr.get("weight_decay", 0.0),
            "grad_clip": tr.get("grad_clip", 1.0), "warmup_steps": tr.get("warmup_steps", 0), "min_lr_ratio": 0.1,
            "max_length": raw["sft"].get("max_tokens", 2048), "threads": threads}
    path = os.path.join(root, "trl_spec.json")
    Path(path).write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"TRL: {python} benchmarks/trl_sft.py {path} (log {root}/trl.log)", flush=True)
    res = run_measured([python, str(REPO / "benchmarks/trl_sft.py"), path], env, os.path.join(root, "trl.log"), cwd=root)
    if res["rc"] != 0:
        raise RuntimeError(f"the TRL run failed (exit {res['rc']}): see {root}/trl.log")
    last = [json.loads(line) for line in Path(root, "trl.log").read_text().splitlines() if line.startswith('{"train_s"')][-1]
    res.update(train_s=last["train_s"], loss_mean=last["loss_mean"], steps=last["steps"], dir=spec["out_dir"])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a preset with an `sft` section")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps on each side")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on each side")
    ap.add_argument("--no-trl", action="store_true", help="flyroll only")
    ap.add_argument("--trl-venv", default=str(REPO / ".venv-trl"), help="TRL's environment, created here when missing")
    ap.add_argument("--root", default=None, help="working folder (default: a new temporary one, kept)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    raw = yaml.safe_load(Path(args.config).read_text())
    if not raw.get("sft"):
        raise SystemExit(f"bench_sft: {args.config} has no sft section")
    for key in ("train_uri", "eval_uri"):   # relative to the repository, where the workflow runs
        if raw["sft"].get(key) and "://" not in raw["sft"][key]:
            raw["sft"][key] = str((REPO / raw["sft"][key]).resolve())
    root = args.root or tempfile.mkdtemp(prefix="flyroll-bench-sft-")
    os.makedirs(root, exist_ok=True)
    python = None if args.no_trl else str(ensure_trl_venv(Path(args.trl_venv)))
    probes = [box_probe(args.threads, "before")]
    fly = flyroll_side(raw, args.steps, args.threads, root)
    fly["base_dir"] = _fetch(fly["store"], fly["base"], os.path.join(root, "base"))
    fly["dir"] = _fetch(fly["store"], fly["final"], os.path.join(root, "flyroll_out"))
    trl = None if args.no_trl else trl_side(python, raw, fly, args.steps, args.threads, root)
    probes.append(box_probe(args.threads, "after"))

    from benchmarks.bench_learning_report import evaluate_points
    from configs.schema import load_config

    cfg = load_config(os.path.join(root, "flyroll.yaml"))
    table = _table(fly["store"], fly["dataset"] + "/eval_prompts")
    points = [{"system": "base", "t": 0.0, "dir": fly["base_dir"]}, {"system": "flyroll", "t": fly["wall_s"], "dir": fly["dir"]}]
    if trl:
        points.append({"system": "TRL", "t": trl["wall_s"], "dir": trl["dir"]})
    print(f"evaluating {len(points)} models on {len(table)} eval prompts ...", flush=True)
    evaluate_points(points, table, cfg, args.threads, 0)
    acc = {p["system"]: p["metrics"]["accuracy"] for p in points}
    print(f"\nSFT, {args.steps} steps of {raw['sft'].get('batch_size', 16)} rows, {args.threads} torch threads each "
          f"(config {args.config}; base accuracy {acc['base']:.3f} on {len(table)} eval prompts)")
    print(f"{'system':10} {'wall s':>8} {'train s':>8} {'peak RSS GB':>12} {'mean loss':>10} {'accuracy':>9}")
    for name, side in (("flyroll", fly), ("TRL 1.16", trl)):
        if side:
            print(f"{name:10} {fmt(side['wall_s']):>8} {fmt(side['train_s']):>8} {fmt(side['peak_rss_gb'], '.2f'):>12} "
                  f"{fmt(side['loss_mean'], '.3f'):>10} {acc['flyroll' if side is fly else 'TRL']:>9.3f}")
    print(f"flyroll's own eval/accuracy in the run (start, end): {fly['in_run_accuracy']}")
    if args.json:
        out = {"config": args.config, "steps": args.steps, "threads": args.threads, "accuracy": acc, "probes": probes,
               "flyroll": {k: v for k, v in fly.items() if k not in ("store",)}, "trl": trl, "root": root}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# longer than 400 lines: the `flyroll bench --learning` harness, both sides and their comparison
"""`flyroll bench --learning`: flyroll and TRL's GRPOTrainer, accuracy against wall time.

    flyroll bench --learning --config configs/smollm2_reasoning.yaml --budget-min 30
    flyroll bench --learning --config C.yaml --budget-min 5 --generators leg_counting 'chain_sum:{"max_terms": 2}'
    flyroll bench --learning --config C.yaml --budget-min 2 --no-trl --json /tmp/learn.json

What it compares: both systems train the same base model (CONFIG's `model`, built once as the
workflow builds it: benchmarks/learning_prep.py) on the same train table (CONFIG's data section
through tasks/run/splits.py `build_splits`, the workflow's own tables, built once; `--generators
NAME[:{json}]` replaces the generators of CONFIG's reasoning_gym source, so the comparison can run on
tasks neither side was tuned on) with the same reward, group size G, prompts per step B, samples per optimizer step
(training.mini_batch_size), max new tokens, temperature, top_p, learning rate (constant after
training.warmup_steps), KL coefficient and torch threads, each for the same wall-clock budget
counted from its process start. They run one after the other on the same box, flyroll first:
- flyroll: the real workflow, `pyflyte run workflows/rlvr.py rlvr --config <derived>` (local Flyte,
  local Ray, SQLite MLflow, HOME and run folder in a temporary directory), its `run.torch_threads` =
  --threads, `loop.iterations` large, and as data a file source holding the prepared train table
  and a one-row eval table (so the workflow's own start-of-run evaluation costs one prompt);
  terminated at the budget. Every policy version it published is
  kept in its store; a version's time is its MANIFEST's `created_at` less the process start.
- TRL: benchmarks/trl_grpo_learn.py in `.venv-trl` (TRL 1.16, plus reasoning-gym for the reward,
  benchmarks/learn_reward.py), saving checkpoints on a wall-clock schedule (the saving itself is
  not counted), stopped at the budget.
Then up to --eval-points checkpoints per system, spread over the budget (the latest one at or before
each of evenly spaced times, always the last one), and the base model once at t=0, are evaluated by
the same code: engines/rewards/evaluation.py `evaluate` (greedy accuracy, overall, per domain and per
reasoning-gym generator; with the rollout's stop strings and --pass-k sampled pass@k when that
evaluate() accepts them) on CONFIG's eval split (less any prompt that is also a train prompt:
counted and printed), one at a time after both runs. Printed: the time -> accuracy table per system, the
time each needs to reach a few accuracy levels both reached (first checkpoint at or above it, and
linearly interpolated) with the ratio TRL / flyroll, and the box probe before and after. Written:
--json, and --report (HTML: the curves as an SVG plot and the tables).

Caveats: the two runs are not alternated, so box drift between them lands on one side (the probes
show how much); flyroll's budget includes what the workflow does besides training (Flyte, Ray start,
the base model's copy into its store, checkpoint publishing, its one-prompt evaluation); TRL's loss
is its default (`loss_type`), not flyroll's `algorithm` choices (clip ranges, normalisation, and
dynamic sampling: with `algorithm.filter_groups` flyroll refills its batch with groups whose rewards
differ, TRL trains on the batch it drew);
TRL's gradient checkpointing is set to training.gradient_checkpointing (TRL's own default is on);
TRL stops at stop strings only where they lie inside one token (benchmarks/trl_grpo_learn.py);
the TRL side scores only rows that flyroll routes to the reasoning_gym or an exact-match reward
(learn_reward.py; others are refused before either run starts, use --no-trl). A checkpoint's
evaluation is not timed into the budget, but it is slow for real models (SmolLM2, 17 few-shot
prompts, greedy plus pass@4: 110 s on a busy 2-core box), so size --eval-points and the eval split.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_learning_report import evaluate_points, print_tables, report_html
from benchmarks.bench_pipeline import workflow_command
from benchmarks.harness import BENCH_DIR, REPO, _version, box_probe, ensure_trl_venv
from tasks.run.keys import parse_policy_key



# ---- pure functions (tests/benchmarks/test_bench_learning.py) -----------------------------------------------------

def parse_generators(specs: list[str], known) -> tuple[list[str], dict[str, dict]]:
    """`NAME` or `NAME:{json kwargs}` specs -> (names, settings per name); ValueError naming the bad ones."""
    names, settings, bad = [], {}, []
    for spec in specs:
        name, sep, kw = spec.partition(":")
        name = name.strip()
        if sep:
            try:
                kwargs = json.loads(kw)
            except json.JSONDecodeError as e:
                raise ValueError(f"--generators {spec!r}: the settings after ':' are not JSON ({e}); "
                                 "expected NAME:{\"key\": value, ...}") from None
            if not isinstance(kwargs, dict):
                raise ValueError(f"--generators {spec!r}: the settings after ':' are a {type(kwargs).__name__}; expected a JSON object")
            settings[name] = kwargs
        if name in names:
            raise ValueError(f"--generators: {name!r} is given twice")
        names.append(name)
        if name not in known:
            bad.append(name)
    if bad:
        raise ValueError(f"--generators: unknown reasoning-gym generator(s) {bad}; expected names from "
                         "reasoning_gym.factory.DATASETS (e.g. basic_arithmetic, chain_sum, leg_counting)")
    if not names:
        raise ValueError("--generators: no generator given")
    return names, settings


def with_generators(cfg: dict, names: list[str], settings: dict[str, dict]) -> dict:
    """A copy of config `cfg` whose one reasoning_gym data source has generators `names` and `settings`."""
    out = copy.deepcopy(cfg)
    sources = (out.get("data") or {}).get("sources") or []
    rg = [s for s in sources if s.get("kind") == "reasoning_gym"]
    if len(rg) != 1:
        raise ValueError(f"--generators: the config has {len(rg)} data.sources of kind 'reasoning_gym'; "
                         "expected exactly one, whose generators --generators replaces")
    rg[0]["names"], rg[0]["settings"] = list(names), dict(settings)
    return out


def flyroll_config(cfg: dict, *, model_dir: str, threads: int, out_dir: str, train_uri: str, eval_uri: str,
                   train_rows: int) -> dict:
    """The workflow config of the timed flyroll run: `cfg` with the prepared base model, the
    benchmark's threads, a fresh run folder, an open-ended loop, and as data one file source: the
    prepared train table (`train_uri`, `train_rows` rows: exactly what TRL trains on) and a
    one-row eval table (`eval_uri`), so the workflow's own start-of-run evaluation costs one prompt."""
    out = copy.deepcopy(cfg)
    out.setdefault("run", {}).update({"name": "bench-learning", "output_dir": out_dir, "store_uri": None,
                                      "tracking_uri": f"sqlite:///{out_dir}/mlflow.db", "torch_threads": threads})
    out.setdefault("model", {})["path"] = model_dir
    out["model"].pop("bootstrap", None)
    data = out.setdefault("data", {})
    data.update({"train_size": train_rows, "eval_size": 1,
                 "sources": [{"kind": "file", "uri": train_uri, "eval_uri": eval_uri, "train_size": train_rows}]})
    out.setdefault("loop", {}).update({"iterations": 100_000, "eval_every": 100_000})
    return out


def pick_checkpoints(points: list[dict], budget_s: float, n: int) -> list[dict]:
    """Up to `n` of `points` ({"t": seconds, ...}), spread over the budget: for each of the times
    budget*i/n (i = 1..n) the latest point at or before it, always the last point within the
    budget; each point once, in time order. Points past the budget are never picked."""
    inside = sorted((p for p in points if p["t"] <= budget_s), key=lambda p: p["t"])
    if not inside or n < 1:
        return []
    picked = []
    for i in range(1, n + 1):  # i = n: the budget itself, so the last point inside it is always picked
        before = [p for p in inside if p["t"] <= budget_s * i / n]
        if before and before[-1] not in picked:
            picked.append(before[-1])
    return picked


def time_to_accuracy(curve: list[tuple[float, float]], level: float) -> tuple[float | None, float | None]:
    """(first, interpolated) seconds at which the curve [(t, accuracy)] reaches `level`: the time of
    the first point at or above it, and the time where the line between it and the point before
    crosses the level. (None, None) when never reached."""
    curve = sorted(curve)
    for i, (t, acc) in enumerate(curve):
        if acc >= level:
            if i == 0:
                return t, t
            t0, a0 = curve[i - 1]
            return t, t0 + (t - t0) * (level - a0) / (acc - a0)
    return None, None


def comparison_levels(curves: dict[str, list[tuple[float, float]]], base: float, n: int = 3) -> list[float]:
    """`n` accuracy levels above `base`, evenly up to the lowest of the systems' best accuracies
    (so every system reached all of them); [] when some system never beat the base."""
    top = min(max(a for _, a in c) for c in curves.values())
    if top <= base:
        return []
    return [round(base + (top - base) * i / n, 6) for i in range(1, n + 1)]


def level_rows(curves: dict[str, list[tuple[float, float]]], levels: list[float]) -> list[dict]:
    """Per level: each system's (first, interpolated) time to reach it and TRL / flyroll of both."""
    rows = []
    for level in levels:
        row = {"accuracy": level}
        for system, curve in curves.items():
            row[f"{system}_first_s"], row[f"{system}_interp_s"] = time_to_accuracy(curve, level)
        for kind in ("first", "interp"):
            f, t = row.get(f"flyroll_{kind}_s"), row.get(f"TRL_{kind}_s")
            row[f"ratio_{kind}"] = t / f if f and t is not None else None
        rows.append(row)
    return rows


# ---- the runs ------------------------------------------------------------------------------------------

def reward_rows(train, routes: dict[str, str]) -> list[dict]:
    """What TRL's worker needs to score each train prompt (benchmarks/learn_reward.py), by flyroll's
    own routing (config reward.functions, the row's metadata.reward_fn, its domain)."""
    from engines.rewards.routing import reward_name

    rows, bad = [], set()
    for domain, answer, meta in zip(train["domain"], train["answer"], train["metadata"]):
        meta = meta if isinstance(meta, dict) else {}
        name = reward_name(str(domain), {"metadata": meta}, routes)
        if name == "reasoning_gym":
            rows.append({"reward": "reasoning_gym", "rg_dataset": meta["rg_dataset"], "rg_config": meta.get("rg_config") or {},
                         "rg_entry": meta["rg_entry"]})
        elif name in ("arithmetic", "reverse", "exact_match"):
            rows.append({"reward": "exact_match", "answer": str(answer)})
        else:
            bad.add(f"{domain} -> {name}")
    if bad:
        raise ValueError(f"the TRL side scores reasoning_gym and exact-match rewards only; the config routes {sorted(bad)} "
                         "(run with --no-trl, or use a reasoning_gym / synthetic data source)")
    return rows


def _stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the child's process group (its own session), SIGKILL after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


def _run_until(cmd: list[str], env: dict, log_path: str, budget_s: float, extra_s: float) -> tuple[float, int | None]:
    """Run `cmd` in its own session; stop it at `budget_s + extra_s`. Returns (t0 epoch, exit code or None)."""
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s + extra_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _stop_group(proc)
    return t0, rc


def run_flyroll(cfg: dict, budget_s: float, threads: int, root: str) -> dict:
    """The workflow under `cfg` for `budget_s` seconds; its published policy versions with their times."""
    from datetime import datetime

    from infra.store import ArtifactStore

    cmd, env = workflow_command(cfg, root, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop("FLYROLL_STORE_URI", None)
    print(f"flyroll: {' '.join(cmd)} for {budget_s:.0f} s (log {root}/pyflyte.log)", flush=True)
    t0, rc = _run_until(cmd, env, os.path.join(root, "pyflyte.log"), budget_s, 0)
    store_root = os.path.join(cfg["run"]["output_dir"], "store")
    store = ArtifactStore(store_root)
    points = []
    for key in store.list("runs/") if os.path.isdir(os.path.join(store_root, "runs")) else []:
        policy = parse_policy_key(key)
        if policy is None:
            continue
        created = datetime.fromisoformat(store.manifest(key).created_at).timestamp()
        points.append({"t": created - t0, "version": policy.version, "dir": os.path.join(store_root, key)})
    out = {"points": sorted(points, key=lambda p: p["t"]), "exit": rc, "log": os.path.join(root, "pyflyte.log")}
    if rc not in (None, 0) or not points:
        out["error"] = f"pyflyte exited {rc} with {len(points)} policy versions (log {out['log']})"
    return out


def trl_spec(cfg, train, rows: list[dict], model_dir: str, budget_s: float, eval_points: int, threads: int, root: str) -> dict:
    """benchmarks/trl_grpo_learn.py's SPEC: the config's batch shape, sampling and optimisation settings."""
    r, t, a = cfg.rollout, cfg.training, cfg.algorithm
    return {"model_dir": model_dir, "chat": cfg.model.apply_chat_template, "prompts": list(train["prompt"]), "rows": rows,
            "samples": r.samples_per_prompt, "prompts_per_step": r.prompts_per_iteration, "mini_batch": t.mini_batch_size,
            "max_new": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p, "stop": list(r.stop), "lr": t.lr,
            "beta": a.kl_coef, "warmup_steps": t.warmup_steps, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
            "gradient_checkpointing": t.gradient_checkpointing, "threads": threads, "seed": cfg.run.seed, "budget_s": budget_s,
            "save_at": [budget_s * i / eval_points for i in range(1, eval_points + 1)], "out_dir": os.path.join(root, "out")}


def run_trl(python: str, spec: dict, root: str) -> dict:
    """TRL's worker for the budget (plus 10 min for its last step to end); its checkpoints with their times."""
    spec_path = os.path.join(root, "spec.json")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [python, str(BENCH_DIR / "trl_grpo_learn.py"), spec_path]
    print(f"TRL: {' '.join(cmd)} for {spec['budget_s']:.0f} s (log {root}/trl.log)", flush=True)
    with open(spec_path, "w") as f:  # t0 is set just before the start, as for flyroll
        json.dump({**spec, "t0": time.time()}, f, default=str)
    _, rc = _run_until(cmd, env, os.path.join(root, "trl.log"), spec["budget_s"], 600)
    ckpts = os.path.join(spec["out_dir"], "checkpoints.jsonl")
    points = [json.loads(line) for line in open(ckpts)] if os.path.exists(ckpts) else []
    out = {"points": points, "exit": rc, "log": os.path.join(root, "trl.log")}
    if rc not in (None, 0) or not points:
        out["error"] = f"TRL worker exited {rc} with {len(points)} checkpoints (log {out['log']})"
    return out


# ---- command -------------------------------------------------------------------------------------------

def parse_args(argv: list[str]):
    import argparse

    ap = argparse.ArgumentParser(prog="flyroll bench --learning", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a flyroll run config (YAML) whose data the workflow can build")
    ap.add_argument("--budget-min", type=float, required=True, help="wall-clock minutes per system, from its process start")
    ap.add_argument("--generators", nargs="+", default=None, metavar="NAME[:{json}]",
                    help="reasoning-gym generators replacing those of the config's reasoning_gym source, each with optional "
                         "settings, e.g. leg_counting 'chain_sum:{\"max_terms\": 2}'")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of both systems (and of the evaluation)")
    ap.add_argument("--eval-points", type=int, default=5, help="checkpoints evaluated per system, spread over the budget")
    ap.add_argument("--pass-k", type=int, default=None,
                    help="also sampled pass@k with k samples per eval prompt (0: off; default: the config's loop.eval_samples)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--report", default=None, help="write the HTML report (plot + tables) here")
    ap.add_argument("--no-trl", action="store_true", help="flyroll only (no TRL environment needed)")
    ap.add_argument("--trl-venv", default=str(REPO / ".venv-trl"), help="TRL's environment, created here when missing")
    ap.add_argument("--keep-workdir", action="store_true", help="keep the temporary folder (models, runs, logs)")
    args = ap.parse_args(argv)
    for name in ("budget_min", "threads", "eval_points"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}: {getattr(args, name)} (expected > 0)")
    if args.pass_k is not None and args.pass_k < 0:
        ap.error(f"--pass-k: {args.pass_k} (expected >= 0)")
    return args


def load_raw_config(path: str, generators: list[str] | None) -> dict:
    """CONFIG as a dict with --generators applied, validated by the schema (ValueError on bad input)."""
    import yaml

    from configs.schema import parse_config
    from infra.resources import check_placement

    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: no such file (expected a flyroll YAML config)")
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path!r}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path!r}: holds a {type(raw).__name__}; expected a mapping of config sections")
    if generators:
        import reasoning_gym

        raw = with_generators(raw, *parse_generators(generators, reasoning_gym.factory.DATASETS))
    check_placement(parse_config(raw, path))  # ConfigError (a ValueError) naming the field
    return raw


def ensure_trl_python(venv: Path) -> str:
    """`.venv-trl`'s python (benchmarks/bench.py ensure_trl_venv) with this environment's reasoning-gym added."""
    from importlib.metadata import version

    python = ensure_trl_venv(venv)
    want = version("reasoning_gym")
    if _version(python, "reasoning_gym") is None:
        subprocess.run([str(venv / "bin" / "pip"), "install", "--progress-bar", "off", f"reasoning-gym=={want}"], check=True)
    return str(python)


def cli_main(argv: list[str]) -> int:
    import shutil
    import tempfile

    import pandas as pd
    import yaml

    from configs.schema import parse_config

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the child runs are stopped
    try:
        raw = load_raw_config(args.config, args.generators)
    except ValueError as e:
        print(f"flyroll bench --learning: {e}", file=sys.stderr)
        return 2
    budget_s = args.budget_min * 60
    trl_python = None if args.no_trl else ensure_trl_python(Path(args.trl_venv))
    work = tempfile.mkdtemp(prefix="flyroll-learn-")
    print(f"workdir {work}", flush=True)
    prep = os.path.join(work, "prep")
    os.makedirs(prep)
    with open(os.path.join(prep, "config.yaml"), "w") as f:
        yaml.safe_dump(raw, f)
    r = subprocess.run([sys.executable, str(BENCH_DIR / "learning_prep.py"), os.path.join(prep, "config.yaml"), prep],
                       cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if r.returncode:
        print(f"preparing the base model and the tables failed:\n{r.stderr[-3000:]}", file=sys.stderr)
        return 1
    info = json.loads(r.stdout.strip().splitlines()[-1])
    train, evals = pd.read_pickle(os.path.join(prep, "train.pkl")), pd.read_pickle(os.path.join(prep, "eval.pkl"))
    cfg = parse_config(raw)
    print(f"base model {info['model_dir']}; {info['train_rows']} train prompts, {info['eval_rows']} eval prompts "
          f"({info['eval_dropped']} eval prompts that are also train prompts dropped)", flush=True)
    try:
        rows = None if args.no_trl else reward_rows(train, dict(cfg.reward.functions))
    except ValueError as e:
        print(f"flyroll bench --learning: {e}", file=sys.stderr)
        return 2

    result = {"settings": {**vars(args), "generators": args.generators}, "data": info, "box": {}, "runs": {}}
    result["box"]["start"] = box_probe(args.threads, "start")
    fly_cfg = flyroll_config(raw, model_dir=info["model_dir"], threads=args.threads, out_dir=os.path.join(work, "flyroll", "runs"),
                             train_uri=os.path.join(prep, "train.jsonl"), eval_uri=os.path.join(prep, "eval1.jsonl"),
                             train_rows=info["train_rows"])
    result["runs"]["flyroll"] = run_flyroll(fly_cfg, budget_s, args.threads, os.path.join(work, "flyroll"))
    if trl_python:
        os.makedirs(os.path.join(work, "trl"))
        spec = trl_spec(cfg, train, rows, info["model_dir"], budget_s, args.eval_points, args.threads, os.path.join(work, "trl"))
        result["runs"]["TRL"] = run_trl(trl_python, spec, os.path.join(work, "trl"))
    result["box"]["end"] = box_probe(args.threads, "end")

    base = {"system": "base", "t": 0.0, "dir": info["model_dir"]}
    picks = {s: [{**p, "system": s} for p in pick_checkpoints(run["points"], budget_s, args.eval_points)]
             for s, run in result["runs"].items()}
    print(f"evaluating {1 + sum(map(len, picks.values()))} checkpoints on {len(evals)} eval prompts ...", flush=True)
    pass_k = getattr(cfg.loop, "eval_samples", 0) if args.pass_k is None else args.pass_k
    evaluate_points([base, *(p for ps in picks.values() for p in ps)], evals, cfg, args.threads, pass_k)
    result["curves"] = {s: [base, *ps] for s, ps in picks.items()}
    curves = {s: [(p["t"], p["metrics"]["accuracy"]) for p in ps] for s, ps in result["curves"].items()}
    result["levels"] = level_rows(curves, comparison_levels(curves, base["metrics"]["accuracy"])) if len(curves) > 1 else []
    for s, run in result["runs"].items():
        print(f"{s}: {len(run['points'])} checkpoints within the budget{'; ' + run['error'] if 'error' in run else ''}")
    print_tables(result["curves"], result["levels"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.report:
        Path(args.report).write_text(report_html(result, curves))
        print(f"wrote {args.report}")
    failed = any("error" in run for run in result["runs"].values())
    if args.keep_workdir or failed:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0

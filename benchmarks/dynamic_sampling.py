"""Dynamic sampling (DAPO, `algorithm.filter_groups`) in whole-batch rounds against smaller chunks of
the rollout scheduler: rollout seconds and generated tokens per kept sample, the same iterations
side by side.

    python benchmarks/dynamic_sampling.py                                  # SmolLM2 reasoning preset
    python benchmarks/dynamic_sampling.py --config configs/dapo.yaml --chunk 16 --iterations 2

Both sides run the real rollout task (tasks/rollout.py `rollout`, the scheduler over the Ray
generation actors and reward workers) in this process on one local Ray instance, on `--config`
with `algorithm.filter_groups: true` and `max_generation_rounds: --rounds`, from the config's
starting policy, for iterations 1..`--iterations` (each iteration its own prompts; the policy is
not trained, so every iteration is a fresh draw at the base model's pass rates):
- `rounds`: `rollout.chunk_prompts` = prompts_per_iteration, one chunk in flight: the batch is
  generated whole, scored, and refilled by whole batches until enough groups pass (DAPO's refill
  rounds, what flyroll did before the scheduler);
- `chunked-N`: `rollout.chunk_prompts` = N (`--chunk`, several values allowed): generation stops
  as soon as the batch holds prompts_per_iteration kept groups.
The sides alternate within each iteration. Printed per side and iteration: the rollout stage's
seconds (`timing/rollout_s`), `rollout/generated_tokens_per_kept_sample`,
`dynamic_sampling/generation_rounds` (prompts drawn / B) and kept groups; then the means and the
chunked / rounds ratios. Torch threads: the config's run.torch_threads unless `--threads`. Run folder:
a temporary directory (HOME, caches, store, MLflow). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KEYS = {"rollout_s": "timing/rollout_s", "tokens_per_kept_sample": "rollout/generated_tokens_per_kept_sample",
        "rounds": "dynamic_sampling/generation_rounds", "kept_groups": "dynamic_sampling/kept_groups"}


def side_config(raw: dict, name: str, chunk: int, args, out: str) -> dict:
    import copy

    cfg = copy.deepcopy(raw)
    cfg.setdefault("run", {}).update(name=f"dapo-bench-{name}", output_dir=out)
    cfg.setdefault("loop", {})["iterations"] = max(args.iterations, 1)
    if args.threads:
        cfg["run"]["torch_threads"] = args.threads
    cfg.setdefault("algorithm", {}).update(filter_groups=True, max_generation_rounds=args.rounds)
    cfg.setdefault("rollout", {})["chunk_prompts"] = chunk
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/smollm2_reasoning.yaml"))
    p.add_argument("--chunk", default="2,4", help="prompts per chunk, one chunked side per value (comma-separated)")
    p.add_argument("--rounds", type=int, default=4, help="algorithm.max_generation_rounds (the prompt budget, in batches)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="run.torch_threads (0 = the config's)")
    args = p.parse_args(argv)

    import yaml

    raw = yaml.safe_load(Path(args.config).read_text())
    b = raw.get("rollout", {}).get("prompts_per_iteration", 64)
    work = tempfile.mkdtemp(prefix="flyroll-dapo-bench-")
    os.environ.update(HOME=os.path.join(work, "home"), FLYROLL_CACHE_DIR=os.path.join(work, "cache"),
                      RAY_USAGE_STATS_ENABLED="0")
    os.makedirs(os.environ["HOME"], exist_ok=True)
    os.environ.pop("MLFLOW_TRACKING_URI", None)

    import tasks.rollout
    from infra import tracking
    from infra.ray_session import shutdown
    from tasks.prepare import build_base_policy, make_dataset, prepare_run

    sides = {"rounds": b, **{f"chunked-{c}": int(c) for c in args.chunk.split(",")}}
    runs = {}
    for name, chunk in sides.items():
        path = os.path.join(work, f"{name}.yaml")
        Path(path).write_text(yaml.safe_dump(side_config(raw, name, chunk, args, os.path.join(work, "runs"))))
        spec, model_spec = prepare_run(config=path, restart=False)
        runs[name] = (spec, build_base_policy(model_spec), make_dataset(spec=spec))
    rows: dict[str, list[dict]] = {k: [] for k in sides}
    try:
        for it in range(1, args.iterations + 1):
            for name in sides:
                spec, policy, dataset = runs[name]
                tasks.rollout.rollout(spec=spec, policy=policy, dataset=dataset, iteration=it)
                client = tracking.client(spec.tracking_uri)
                row = {k: client.get_metric_history(spec.mlflow_run_id, key)[-1].value for k, key in KEYS.items()}
                rows[name].append(row)
                print(f"iteration {it} {name:10s} rollout {row['rollout_s']:6.1f} s  tokens/kept sample "
                      f"{row['tokens_per_kept_sample']:6.2f}  rounds {row['rounds']:.2f}  kept {row['kept_groups']:.0f}", flush=True)
    finally:
        shutdown()
    print(f"\n{args.config}: B={b}, max_generation_rounds {args.rounds}, {args.iterations} iterations (means)")
    print(f"{'side':10s} {'chunk':>5s} {'rollout s':>9s} {'tokens/kept sample':>18s} {'rounds':>6s} {'kept groups':>11s}")
    mean = {k: {f: statistics.mean(r[f] for r in v) for f in KEYS} for k, v in rows.items()}
    for name, chunk in sides.items():
        m = mean[name]
        print(f"{name:10s} {chunk:5d} {m['rollout_s']:9.1f} {m['tokens_per_kept_sample']:18.2f} {m['rounds']:6.2f} {m['kept_groups']:11.1f}")
    for name in list(sides)[1:]:
        for f in ("rollout_s", "tokens_per_kept_sample"):
            print(f"{name} / rounds {f}: {mean[name][f] / mean['rounds'][f]:.2f}")
    print(f"run folder (delete when done): {work}")


if __name__ == "__main__":
    main()

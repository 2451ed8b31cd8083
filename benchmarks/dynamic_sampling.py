"""Dynamic sampling (DAPO, `algorithm.filter_groups`) in whole-batch rounds against smaller chunks of
the rollout scheduler: rollout seconds and generated tokens per kept sample, the same iterations
side by side.

    python benchmarks/dynamic_sampling.py                                  # SmolLM2 reasoning preset
    python benchmarks/dynamic_sampling.py --config configs/dapo.yaml --chunk 16 --iterations 2

Both sides run the real rollout task (tasks/stages/rollout.py `rollout`, the scheduler over the Ray
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
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KEYS = {"rollout_s": "timing/rollout_s", "tokens_per_kept_sample": "rollout/generated_tokens_per_kept_sample",
        "rounds": "dynamic_sampling/generation_rounds", "kept_groups": "dynamic_sampling/kept_groups"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/smollm2_reasoning.yaml"))
    p.add_argument("--chunk", default="2,4", help="prompts per chunk, one chunked side per value (comma-separated)")
    p.add_argument("--rounds", type=int, default=4, help="algorithm.max_generation_rounds (the prompt budget, in batches)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="run.torch_threads (0 = the config's)")
    args = p.parse_args(argv)

    import yaml

    from benchmarks.rollout_sides import isolated_workdir, run_sides

    raw = yaml.safe_load(Path(args.config).read_text())
    b = raw.get("rollout", {}).get("prompts_per_iteration", 64)
    work = isolated_workdir("flyroll-dapo-bench-")
    sides = {"rounds": b, **{f"chunked-{c}": int(c) for c in args.chunk.split(",")}}
    changes = {name: {"algorithm": {"filter_groups": True, "max_generation_rounds": args.rounds}, "rollout": {"chunk_prompts": chunk}}
               for name, chunk in sides.items()}

    def report(it: int, name: str, row: dict) -> None:
        print(f"iteration {it} {name:10s} rollout {row['rollout_s']:6.1f} s  tokens/kept sample "
              f"{row['tokens_per_kept_sample']:6.2f}  rounds {row['rounds']:.2f}  kept {row['kept_groups']:.0f}", flush=True)

    rows = run_sides(raw, changes, work=work, prefix="dapo-bench", iterations=args.iterations, threads=args.threads,
                     metrics=lambda name: KEYS, report=report)
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

"""Partial rollout (`rollout.partial_rollout_max_split`) against whole-sample generation on a long-tailed
length distribution: rollout seconds and generated tokens per iteration, the same iterations side by side.

    python benchmarks/partial_rollout.py                                    # SmolLM2 reasoning preset, 128 new tokens
    python benchmarks/partial_rollout.py --split 4,8 --max-new 256 --iterations 4

Why it can win: the HF engine decodes a batch until its longest sample ends, so with most answers a
few tokens long ("Answer: 42" then the stop string "\\n") and a few running to max_new_tokens, every
iteration pays max_new_tokens decode steps for the whole batch. With max_split N a round decodes at
most ceil(max_new_tokens / N) steps; samples still running when B groups are complete are carried
into the next iteration and continued there.

Every side runs the real rollout task (tasks/stages/rollout.py `rollout`: the Ray generation actors, and
for N > 1 tasks/loop/partial_rollout.py with its carry published in the run's store) in this process on
one local Ray instance, on `--config` with `rollout.max_new_tokens` = `--max-new` and
`algorithm.tis_cap` 2.0 (partial rollout requires it) and `algorithm.filter_groups` off (partial
rollout refuses dynamic sampling; the SmolLM2 preset has it on), from the config's starting policy, for
iterations 1..`--iterations`. The policy is not trained between iterations, so this measures the
generation side only: carried samples are continued by the same weights (in a training run they are
off-policy, corrected by tis_cap; `rollout/partial_stale_samples` counts them). Sides:
- `whole`: max_split 1 (every sample generated whole in its iteration);
- `split-N`: max_split N (`--split`, several values allowed).
The sides alternate within each iteration. Printed per side and iteration: the rollout stage's
seconds (`timing/rollout_s`), tokens generated in the iteration (partial: `rollout/partial_generated_tokens`,
whole: `rollout/tokens`), the batch's mean response length, its truncated fraction and, for
partial sides, rounds, carried groups and stale samples; then the means and the split / whole
ratios of rollout seconds. Iteration 1 includes each side's actor start and first policy load.
Torch threads: the config's run.torch_threads unless `--threads`. Run folder: a temporary directory
(HOME, caches, store, MLflow). Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KEYS = {"rollout_s": "timing/rollout_s", "response_length": "rollout/response_length",
        "truncated": "rollout/truncated_frac", "batch_tokens": "rollout/tokens"}
PARTIAL = {"generated": "rollout/partial_generated_tokens", "rounds": "rollout/partial_rounds",
           "carried_groups": "rollout/partial_carried_groups", "stale": "rollout/partial_stale_samples"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/smollm2_reasoning.yaml"))
    p.add_argument("--split", default="8", help="rollout.partial_rollout_max_split, one side per value (comma-separated)")
    p.add_argument("--max-new", type=int, default=128, help="rollout.max_new_tokens of every side")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="run.torch_threads (0 = the config's)")
    args = p.parse_args(argv)

    import yaml

    from benchmarks.rollout_sides import isolated_workdir, run_sides

    raw = yaml.safe_load(Path(args.config).read_text())
    work = isolated_workdir("flyroll-partial-bench-")
    sides = {"whole": 1, **{f"split-{n}": int(n) for n in args.split.split(",")}}
    changes = {name: {"algorithm": {"tis_cap": 2.0, "filter_groups": False}, "rollout": {"max_new_tokens": args.max_new, "partial_rollout_max_split": split}}
               for name, split in sides.items()}

    def report(it: int, name: str, row: dict) -> None:
        if sides[name] == 1:  # whole-sample generation: every token of the batch was generated this iteration
            row.update(generated=row["batch_tokens"], rounds=1.0, carried_groups=0.0, stale=0.0)
        print(f"iteration {it} {name:9s} rollout {row['rollout_s']:6.1f} s  generated tokens {row['generated']:6.0f}  "
              f"response length {row['response_length']:5.1f}  truncated {row['truncated']:.3f}  rounds "
              f"{row['rounds']:.0f}  carried groups {row['carried_groups']:.0f}  stale samples {row['stale']:.0f}",
              flush=True)

    rows = run_sides(raw, changes, work=work, prefix="partial-bench", iterations=args.iterations, threads=args.threads,
                     metrics=lambda name: KEYS if sides[name] == 1 else {**KEYS, **PARTIAL}, report=report)
    r = raw.get("rollout", {})
    print(f"\n{args.config}: B={r.get('prompts_per_iteration')} x G={r.get('samples_per_prompt')}, max_new_tokens "
          f"{args.max_new}, {args.iterations} iterations; means over iterations 2..{args.iterations} (1 starts the actors)")
    later = {k: v[1:] or v for k, v in rows.items()}
    fields = ("rollout_s", "generated", "response_length", "truncated", "rounds", "carried_groups", "stale")
    mean = {k: {f: statistics.mean(x[f] for x in v) for f in fields} for k, v in later.items()}
    print(f"{'side':9s} " + " ".join(f"{f:>15s}" for f in fields))
    for name in sides:
        print(f"{name:9s} " + " ".join(f"{mean[name][f]:15.2f}" for f in fields))
    for name in list(sides)[1:]:
        print(f"{name} / whole rollout seconds: {mean[name]['rollout_s'] / mean['whole']['rollout_s']:.2f}, "
              f"generated tokens: {mean[name]['generated'] / max(mean['whole']['generated'], 1):.2f}")
    print(f"run folder (delete when done): {work}")


if __name__ == "__main__":
    main()

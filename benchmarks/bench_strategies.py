"""Step time of each training strategy on the same tiny policy and synthetic RL batch.

    python benchmarks/bench_strategies.py                         # all strategies, 2 processes, 1 thread each
    python benchmarks/bench_strategies.py --strategies torch ddp --hidden 128 --layers 4 --rows 64

Each strategy runs `--steps` actor updates (one optimizer step each: the whole batch is one
mini-batch, split into micro-batches of `--max-tokens` padded tokens) in `--world` processes
(torch.multiprocessing, gloo); prints the median step time after the first step, the losses'
largest difference from the one-process run, and the first step (warm-up, incl. DeepSpeed's lazy
init). Numbers depend on the machine: a 2-core box is CPU-bound and gains nothing from 2 processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engines.training.strategies import STRATEGIES  # noqa: E402
from tests.support.strategy_ranks import run_strategy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    a = ap.parse_args()
    opts = dict(threads=a.threads, hidden=a.hidden, layers=a.layers, rows=a.rows, mini_batch_size=a.rows, max_tokens=a.max_tokens)
    print(f"tiny Qwen2 hidden={a.hidden} layers={a.layers}, {a.rows} rows, micro-batches of <= {a.max_tokens} tokens, "
          f"{a.world} processes x {a.threads} torch threads, {a.steps} steps")
    ref = None
    print(f"{'strategy':<17} {'step s (median)':>15} {'first step s':>12} {'max |dloss|':>12} {'wall s':>7}")
    for name in a.strategies:
        t0 = time.perf_counter()
        r = run_strategy(name, world=a.world, steps=a.steps, **opts)
        wall = time.perf_counter() - t0
        ref = ref or (r if name == "torch" else run_strategy("torch", steps=a.steps, **opts))
        dloss = max(abs(x - y) for x, y in zip(r["losses"], ref["losses"]))
        print(f"{name:<17} {statistics.median(r['step_s'][1:]):>15.4f} {r['step_s'][0]:>12.3f} {dloss:>12.2e} {wall:>7.1f}")


if __name__ == "__main__":
    main()

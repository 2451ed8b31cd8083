"""The per-step CPU costs flyroll removed from a GRPO step, old way vs new way, side by side.

  PYTHONPATH=. .venv/bin/python benchmarks/cpu_step_costs.py --threads 2 --reps 5

SmolLM2-135M's shapes (vocabulary 49152, 64 rollout rows, 32 x 32 response tokens per micro-batch,
134.5M parameters), random tensors, no model. Each line times the same work both ways, alternating
A/B each rep, median of `--reps` after one warm-up:
- `sample`: one decode step's draw from softmax(logits [64, V]): `torch.multinomial` (what
  transformers' `generate` does; an exponential per vocabulary entry) vs `InverseCDFSampler`
  (engines/generation/engine.py: one uniform per row, a cumulative sum and a binary search);
- `logp+entropy`: per-token log-probs and entropies of a [32, 32, V] micro-batch, forward +
  backward: log_softmax + gather + -(p log p).sum vs `token_logprobs_and_entropy`
  (engines/models/batching.py);
- `adamw`: one AdamW step over 134.5M float32 parameters: torch's default (foreach) vs `fused=True`.
The whole table runs twice, in two child processes: with glibc's malloc defaults and with
`keep_freed_memory()` (engines/models/host_memory.py), the setting flyroll's engine actors use. Asserts
nothing; prints seconds per call and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def measure(threads: int, reps: int, keep: bool) -> dict:
    import torch

    from engines.models.batching import token_logprobs_and_entropy
    from engines.generation.engine import InverseCDFSampler
    from engines.models.host_memory import keep_freed_memory

    torch.set_num_threads(threads)
    if keep:
        keep_freed_memory()
    torch.manual_seed(0)
    V = 49152
    step_logits = torch.randn(64, V) * 3
    mb_logits, targets = torch.randn(32, 32, V), torch.randint(0, V, (32, 32))
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(V, 576)]

    def adamw(**kw):
        params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-6, **kw)
        return opt.step

    def old_logp():
        z = mb_logits.clone().requires_grad_()
        ls = torch.log_softmax(z, -1)
        lp, _h = ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(ls.exp() * ls).sum(-1)
        lp.sum().backward()

    def new_logp():
        z = mb_logits.clone().requires_grad_()
        lp, h = token_logprobs_and_entropy(z, targets)
        lp.sum().backward()

    sampler = InverseCDFSampler()
    pairs = {
        "sample": (lambda: torch.multinomial(torch.softmax(step_logits, -1), 1),
                   lambda: sampler(None, step_logits).argmax(-1)),
        "logp+entropy": (old_logp, new_logp),
        "adamw": (adamw(), adamw(fused=True)),
    }
    out = {}
    for name, (a, b) in pairs.items():
        a(), b()
        ta, tb = [], []
        for _ in range(reps):
            for f, ts in ((a, ta), (b, tb)):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
        out[name] = (statistics.median(ta), statistics.median(tb))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", choices=["default", "keep"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads, args.reps, args.child == "keep")))
        return
    results = {}
    for malloc in ("default", "keep"):
        r = subprocess.run([sys.executable, __file__, "--child", malloc, "--threads", str(args.threads),
                            "--reps", str(args.reps)], capture_output=True, text=True, check=True)
        results[malloc] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"threads={args.threads} reps={args.reps} (median seconds per call; old = the library default way)")
    print(f"{'cost':<14} {'malloc':<8} {'old s':>8} {'new s':>8} {'speed-up':>9}")
    for name in results["default"]:
        for malloc in ("default", "keep"):
            old, new = results[malloc][name]
            print(f"{name:<14} {malloc:<8} {old:8.4f} {new:8.4f} {old / new:8.2f}x")
    for name in results["default"]:
        old_default, new_keep = results["default"][name][0], results["keep"][name][1]
        print(f"{name:<14} old+default malloc -> new+keep: {old_default / new_keep:.2f}x")


if __name__ == "__main__":
    main()

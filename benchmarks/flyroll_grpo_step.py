"""flyroll's side of `flyroll bench`: GRPO steps at engine level (no Flyte/Ray/MLflow), served one
at a time so the benchmark can alternate them with TRL's.

  python benchmarks/flyroll_grpo_step.py SPEC.json      # from the repository root (PYTHONPATH=.)

SPEC.json (written by benchmarks/bench.py): engine ("hf" | "vllm"), model_dir, chat, problems
[{prompt, answer}], samples, max_new, threads, lr, micro_tokens, kv_cache_gb, release_memory, reward
("shaped" | "exact", benchmarks/bench_reward.py), sync ("memory" | "files"; default "files").

One step = rollout (len(problems) x samples completions, temperature 1, per-token log-probs)
+ scoring (the reward, rollout table, GRPO advantages, collation) + training (one AdamW
update, token-mean, no KL; one on-policy pass, so π_old is the update's own forward, detached, as
with flyroll's default `algorithm.old_logprobs: auto` and TRL with beta=0 and one iteration) +
weight sync: `sync` "files" saves the policy (safetensors + tokenizer) and the engine loads it
(`engine.load_weights`: what a generator in another process does, short of the object store);
"memory" copies the trainer's parameters into the engine in place (`update_weights`: a trainer and
an HF generator colocated in one process; TRL's own HF path generates with the training model
itself and has no sync at all). vLLM runs its model in its own process: files only.

Protocol (stdout carries only these lines; everything else the process prints goes to stderr):
  -> READY {json}      after loading and one warm-up step. Freed memory is kept for reuse within and
                       between steps, as in flyroll's engine actors (engines/models/host_memory.py); with
                       release_memory it is returned to the OS after each step instead (outside the
                       timed step), so the idle worker holds only its model and optimizer
  <- STEP <i>          run timed step i (sampling seed 2001+i)
  -> RESULT {json}     s, gen_s, score_s, train_s, sync_s, samples, tokens, trained_rows (rows the
                       update ran: those with zero advantage carry no gradient and are skipped,
                       engines/training/update.py), rss_gb, peak_rss_gb (resident memory between steps and
                       the peak so far)
  <- EXIT              close the engine and exit
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

from bench_reward import bench_reward  # benchmarks/, next to this script
from worker_memory import release_memory, rss_gb


def build(spec: dict):
    """A `step(seed) -> dict` closure over the loaded policy, engine and trainer; and a closer."""
    import pandas as pd
    import torch

    from engines.algorithms.config import AlgorithmConfig
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.models.host_memory import keep_freed_memory
    from engines.models.modeling import encode_prompts, load_policy, save_policy
    from engines.training.rl_step import prepare_update
    from engines.data.rollout_table import batch_from_table
    from engines.training.update import TorchTrainEngine

    torch.set_num_threads(spec["threads"])
    keep_freed_memory()  # as flyroll's engine actors do (tasks/actors/process.py)
    model_dir, problems = spec["model_dir"], spec["problems"]
    policy, tok = load_policy(model_dir)
    if spec["engine"] == "hf":
        rollout_model, _ = load_policy(model_dir)
        engine = HFGenerationEngine(rollout_model, tok, micro_batch=len(problems))
    else:
        from engines.generation.vllm_engine import VLLMGenerationEngine

        engine = VLLMGenerationEngine(model_dir, max_model_len=None, kv_cache_gb=spec["kv_cache_gb"], seed=0,
                                      cpu_bind="0" if spec["threads"] == 1 else f"0-{spec['threads'] - 1}")
    # with chat: the template as text, then plain encoding (as TRL does for conversational prompts)
    ids = encode_prompts(tok, [p["prompt"] for p in problems], spec["chat"])
    params = SamplingParams(n=spec["samples"], temperature=1.0, max_new_tokens=spec["max_new"])
    cfg = AlgorithmConfig(advantage="grpo", use_kl_loss=False, kl_coef=0.0)
    trainer = TorchTrainEngine(policy, lr=spec["lr"])
    sync_dir = tempfile.mkdtemp(prefix=f"bench-sync-{spec['engine']}-")
    in_memory = spec.get("sync", "files") == "memory"
    if in_memory and spec["engine"] != "hf":
        raise ValueError(f"sync 'memory' needs the hf engine ({spec['engine']} runs its model in its own process)")

    def step(seed: int) -> dict:
        t0 = time.perf_counter()
        out = engine.generate(ids, dataclasses.replace(params, seed=seed))
        t1 = time.perf_counter()
        df = pd.DataFrame({
            "prompt_token_ids": [ids[c.prompt_index] for c in out],
            "response_token_ids": [c.token_ids for c in out],
            "reward": [bench_reward(spec["reward"], c.text, problems[c.prompt_index]["answer"]) for c in out],
            "group_id": [c.prompt_index for c in out],
            "finish_reason": [c.finish_reason for c in out],
        })
        batch = batch_from_table(df, tok.pad_token_id)
        upd = prepare_update(batch, cfg)
        assert cfg.old_logprobs_in_update(len(df), len(df))
        t2 = time.perf_counter()
        m = trainer.train_step(batch.tokens(), upd.advantages, None, None, cfg, mini_batch_size=len(df),
                               max_tokens_per_micro_batch=spec["micro_tokens"])
        t3 = time.perf_counter()
        if in_memory:
            engine.update_weights(policy.named_parameters())
        else:
            save_policy(policy, tok, sync_dir)
            engine.load_weights(sync_dir)
        t4 = time.perf_counter()
        return {"s": t4 - t0, "gen_s": t1 - t0, "score_s": t2 - t1, "train_s": t3 - t2, "sync_s": t4 - t3,
                "samples": len(out), "tokens": sum(len(c.token_ids) for c in out),
                "trained_rows": round(len(out) * (1 - m["actor/skipped_rows"]))}

    def close() -> None:
        getattr(engine, "close", lambda: None)()
        shutil.rmtree(sync_dir, ignore_errors=True)

    return step, close


def main(spec_path: str) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel; fd 1 itself now goes to stderr
    os.dup2(2, 1)
    spec = json.load(open(spec_path))
    try:
        t0 = time.perf_counter()
        step, close = build(spec)
        between_steps = release_memory if spec.get("release_memory") else (lambda: None)
        warm = step(seed=2000)
        between_steps()
        proto.write("READY " + json.dumps({"load_and_warmup_s": time.perf_counter() - t0, "warmup": warm | rss_gb()}) + "\n")
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "EXIT":
                break
            result = step(seed=2001 + int(cmd[1]))
            between_steps()
            proto.write("RESULT " + json.dumps(result | rss_gb()) + "\n")
        close()
    except Exception as e:  # noqa: BLE001 -- reported to the driver, which shows the log tail
        proto.write("ERROR " + json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        raise


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])

"""TRL's side of `flyroll bench`: GRPOTrainer steps on the same model, prompts, batch, reward,
learning rate and thread count, in TRL's own environment (no flyroll import), served one at a time
so the benchmark can alternate them with flyroll's.

  .venv-trl/bin/python benchmarks/trl_grpo_step.py SPEC.json

SPEC.json (written by benchmarks/bench.py): model_dir, chat, problems [{prompt, answer}], samples,
max_new, batches, threads, lr, reward. One GRPO step = generation of len(problems) x samples
completions with transformers (temperature 1), the reward (benchmarks/bench_reward.py), beta=0
(no reference model), one optimizer step. The trainer runs `batches + 1` steps; the first is the warm-up.

Protocol (as benchmarks/flyroll_grpo_step.py; stdout carries only these lines):
  -> READY {json}      after loading and the warm-up step (after each step, freed heap memory is
                       returned to the OS: glibc's own trimming aside, TRL's idle process holds only
                       its model and optimizer)
  <- STEP <i>          run the next step (the trainer waits for it in on_step_begin)
  -> RESULT {json}     s, samples, tokens (completion tokens counted in the reward function), rss_gb,
                       peak_rss_gb
  <- EXIT              stop
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from bench_reward import bench_reward  # benchmarks/, next to this script
from worker_memory import release_memory, rss_gb


def main(spec_path: str) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel; fd 1 itself now goes to stderr
    os.dup2(2, 1)
    t_start = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.load(open(spec_path))
    torch.set_num_threads(spec["threads"])
    model_dir, chat, problems = spec["model_dir"], spec["chat"], spec["problems"]
    B, G = len(problems), spec["samples"]

    if chat:
        tok = None  # TRL loads the model's own tokenizer and chat template
        prompts = [[{"role": "user", "content": p["prompt"]}] for p in problems]
    else:  # the char-level tokenizer as saved (AutoTokenizer would rebuild a Qwen2Tokenizer for model_type qwen2)
        tok = PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left")
        prompts = [p["prompt"] for p in problems]
    n_rows = B * (spec["batches"] + 2)
    data = Dataset.from_dict({"prompt": (prompts * (spec["batches"] + 2))[:n_rows],
                              "answer": ([p["answer"] for p in problems] * (spec["batches"] + 2))[:n_rows]})
    step_tokens = [0]

    def reward(completions, answer, completion_ids=None, **_):
        step_tokens[0] += sum(len(c) for c in completion_ids or [])
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [bench_reward(spec["reward"], t, a) for t, a in zip(texts, answer)]

    class Serve(TrainerCallback):
        """Step 0 runs at once (warm-up); each later step waits for STEP on stdin."""

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step > 0:
                line = sys.stdin.readline().split()
                if not line or line[0] == "EXIT":
                    proto.close()
                    os._exit(0)  # mid-training: nothing to save
            step_tokens[0] = 0
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            r = {"s": time.perf_counter() - self.t0, "samples": B * G, "tokens": step_tokens[0]}
            release_memory()
            r |= rss_gb()
            if state.global_step == 1:
                proto.write("READY " + json.dumps({"load_and_warmup_s": time.perf_counter() - t_start, "warmup": r}) + "\n")
            else:
                proto.write("RESULT " + json.dumps(r) + "\n")

    output_dir = tempfile.mkdtemp(prefix="trl-bench-")  # nothing is saved there (save_strategy "no"); removed at the end
    cfg = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=B * G,
        num_generations=G,
        max_completion_length=spec["max_new"],
        temperature=1.0,
        learning_rate=spec["lr"],
        beta=0.0,
        max_steps=spec["batches"] + 1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    try:
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=cfg, train_dataset=data,
                              processing_class=tok, callbacks=[Serve()])
        trainer.train()
    except Exception as e:  # noqa: BLE001 -- reported to the driver, which shows the log tail
        proto.write("ERROR " + json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        raise
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    sys.stdin.readline()  # the driver's EXIT


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])

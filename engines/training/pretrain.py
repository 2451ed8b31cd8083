"""Supervised bootstrap: a few hundred steps of next-token training on (prompt, response) pairs.

Used to make the embedded tiny policy from nothing (and to pre-train it on solved episodes for
agentic presets). Loss only on response tokens (the prompt is context), EOS appended.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from engines.models.batching import collate, response_logprobs


def supervised_finetune(
    model,
    tokenizer,
    pairs: list[tuple[str, str | list[tuple[str, bool]]]],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, float]:
    """Train `model` in place on `pairs` for `steps` AdamW steps (warmup, then cosine LR); returns final metrics.
    A response is a string (every token trained) or a list of (text, trained) segments, each
    tokenised on its own as the environment manager tokenises turns; only the tokens of trained
    segments carry loss (the EOS when the last segment is trained), e.g. a policy's actions and not
    the environment's replies."""
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def encode(response):
        segments = [(response, True)] if isinstance(response, str) else response
        ids, mask = [], []
        for text, trained in segments:
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += seg
            mask += [int(trained)] * len(seg)
        return ids + [tokenizer.eos_token_id], mask + [mask[-1] if mask else 1]   # the EOS goes with the last segment

    encoded = [(tokenizer(p, add_special_tokens=False)["input_ids"], *encode(r)) for p, r in pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # warm up over the first 10% of the steps (at least two: OneCycleLR divides by a phase's length, so with
    # 10 steps or fewer a 10% warmup is an empty phase), then cosine down; under 3 steps the LR stays at `lr`
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=max(0.1, 2 / steps)) \
        if steps >= 3 else None
    device = next(model.parameters()).device  # the batches are built on CPU; a CUDA model needs them moved
    model.train()
    t0, loss_ema = time.perf_counter(), None
    for step in range(steps):
        rows = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        batch = collate([r[0] for r in rows], [r[1] for r in rows], tokenizer.pad_token_id, [r[2] for r in rows]).to(device)
        logp, _ = response_logprobs(model, batch)
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        value = loss.item()
        loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
        if on_step is not None:
            on_step(step, value)
    model.eval()
    return {"bootstrap/loss": loss_ema or 0.0, "bootstrap/steps": float(steps), "bootstrap/seconds": time.perf_counter() - t0}

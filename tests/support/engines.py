"""The tiny policy's inputs and parameters (tests/engines/generation/test_engine.py, tests/engines/models/test_modeling.py, tests/engines/models/test_batching.py,
tests/engines/training/test_update.py, tests/engines/training/test_lora.py, tests/engines/models/test_devices.py): prompts, their token ids,
a copy of the parameters, a rollout-like batch for the training step."""

from __future__ import annotations

import random

import torch

from engines.models.batching import batched_logprobs, collate
from engines.models.modeling import SPECIAL_TOKENS
from engines.data.synthetic import make_problems

PROMPTS = ["1+2=", "rev abc=", "9-3+4-1="]


def encode(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def rl_batch(tok, model, seed: int = 0, long_row: int = 0):
    """A rollout-like batch: synthetic prompts, random responses of varying length, some tokens
    masked out of the loss, on-policy old log-probs, a reference, ±1 advantages."""
    rng = random.Random(seed)
    probs = make_problems("train", 8, seed=seed)
    prompts = encode(tok, [p.prompt for p in probs])
    vocab = list(range(len(SPECIAL_TOKENS), len(tok)))
    responses = [[rng.choice(vocab) for _ in range(rng.randint(2, 9))] for _ in probs]
    if long_row:
        responses[0] = [rng.choice(vocab) for _ in range(long_row)]
    masks = [[0 if rng.random() < 0.3 else 1 for _ in r] for r in responses]
    masks[1] = [1] * len(masks[1])
    batch = collate(prompts, responses, tok.pad_token_id, loss_masks=masks)
    old = batched_logprobs(model, batch)
    g = torch.Generator().manual_seed(seed)
    ref = (old - 0.05 * torch.rand(old.shape, generator=g)) * batch.response_mask
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(probs))])[:, None] * batch.response_mask
    return batch, adv, old, ref

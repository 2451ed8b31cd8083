"""Rows of a rollout table -> padded tensors, and per-token log-probs of a model on them.

Layout (verl style): prompts left-padded to P, responses right-padded to T, so the response of
every row sits in columns [P, P+T) and the log-prob of response token t comes from the logits at
position P+t-1. Notation: B rows, P prompt width, T response width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    input_ids: torch.Tensor       # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    position_ids: torch.Tensor    # [B, P+T]
    responses: torch.Tensor       # [B, T]
    response_mask: torch.Tensor   # [B, T] float, 1 on response tokens the loss sees

    def select(self, idx) -> "TokenBatch":
        return TokenBatch(*(t[idx] for t in (self.input_ids, self.attention_mask, self.position_ids, self.responses, self.response_mask)))

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]


def collate(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, loss_masks: list[list[int]] | None = None) -> TokenBatch:
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attention[i, P - len(p) : P] = 1
        if r:
            input_ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            attention[i, P : P + len(r)] = 1
            m = loss_masks[i] if loss_masks is not None else [1] * len(r)
            response_mask[i, : len(r)] = torch.tensor(m, dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(input_ids, attention, position_ids, input_ids[:, P:].clone(), response_mask)


def response_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs [B, T] of the responses under `model` (and entropy [B, T] if asked)."""
    P, T = batch.prompt_width, batch.responses.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
    logits = out.logits[:, P - 1 : P + T - 1].float()                      # [B, T, V]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logsm = torch.log_softmax(logits, dim=-1)                              # [B, T, V]
    logp = logsm.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)     # [B, T]
    if not with_entropy:
        return logp, None
    entropy = -(logsm.exp() * logsm).sum(-1)                               # [B, T]
    return logp, entropy


@torch.no_grad()
def batched_logprobs(model, batch: TokenBatch, micro_batch: int = 64, temperature: float = 1.0) -> torch.Tensor:
    """`response_logprobs` in micro-batches without grad; [B, T]."""
    model.eval()
    parts = []
    for s in range(0, batch.input_ids.shape[0], micro_batch):
        logp, _ = response_logprobs(model, batch.select(slice(s, s + micro_batch)), temperature)
        parts.append(logp)
    return torch.cat(parts) * batch.response_mask

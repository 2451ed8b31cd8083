"""Rows of a rollout table -> padded tensors, and per-token log-probs of a model on them.

Layout (verl style): prompts left-padded to P, responses right-padded to T, so the response of
every row sits in columns [P, P+T) and the log-prob of response token t comes from the logits at
position P+t-1. Notation: B rows, P prompt width, T response width, V vocabulary, U distinct prompts.

Two savings in `response_logprobs`, both exact (same numbers up to float summation order):
- the LM head runs only on the T positions whose logits are used (`logits_to_keep`), not on the
  prompt: for SmolLM2 the head is ~1/5 of a token's FLOPs and the [B, P+T, V] float logits dominate
  the activation memory;
- **shared prefixes**: GRPO-style batches hold G samples of each prompt. When rows repeat a prompt,
  each distinct prompt but its last token is run once (U rows, with its KV cache), the cache is
  indexed out to the B rows, and only the last prompt token and the response run per row.
  Gradients flow back through the indexed cache into the one prompt forward, so training sees the
  same gradient for (U·(P-1) + B·(T+1)) tokens of compute instead of B·(P+T).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
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

    def to(self, device: torch.device) -> "TokenBatch":
        """The same batch on `device` (itself when it is there already)."""
        if self.input_ids.device == device:
            return self
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids, self.responses, self.response_mask)))

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
    return TokenBatch(input_ids, attention, positions(attention), input_ids[:, P:].clone(), response_mask)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token (padding: 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _distinct_prompts(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([U, P] the distinct prompts, -1 on padding; [B] which one each row has)."""
    P = batch.prompt_width
    key = torch.where(batch.attention_mask[:, :P].bool(), batch.input_ids[:, :P], -1)
    return torch.unique(key, dim=0, return_inverse=True)


def prompt_groups(batch: TokenBatch) -> torch.Tensor:
    """[B] id of each row's prompt (rows with equal ids have the same prompt tokens)."""
    return _distinct_prompts(batch)[1]


@functools.cache
def cache_kwarg(cls) -> str:
    """The KV-cache keyword of a model class: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, str, object]:
    """Left-padded prompts through `model` with the KV cache on: (logits of the last position
    [U, 1, V], the model's cache keyword, the cache), for a forward that continues from it. A row
    with no token at all (all padding) attends to its last pad, so its cache holds finite values
    (the continuing forward masks those positions out; its logits here mean nothing)."""
    empty = attention_mask.sum(-1) == 0
    if bool(empty.any()):
        attention_mask = attention_mask.clone()
        attention_mask[empty, -1] = 1
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask),
                use_cache=True, logits_to_keep=1)
    arg = cache_kwarg(type(model))
    return out.logits, arg, getattr(out, arg)


@contextlib.contextmanager
def native_gqa(device: torch.device):
    """On CPU, let transformers' SDPA attention run grouped-query attention natively for the
    forwards inside (`scaled_dot_product_attention(enable_gqa=True)`, which transformers' own
    `TRANSFORMERS_SDPA_FORCE_GQA=1` switches on) instead of copying every key/value head out to its
    query heads (`repeat_kv`) in each forward with more than one query position and summing the
    copies back in the backward. transformers keeps the copy whenever there is a mask because
    CUDA's fast kernels refuse masked GQA; torch's CPU kernel takes it. Same numbers up to float
    summation order; SmolLM2's update (3 query heads per key/value head) 9.53 -> 9.01 s
    (docs/engines.md). Decoding (one query position) keeps transformers' own path, and a value the
    user set is left alone."""
    key = "TRANSFORMERS_SDPA_FORCE_GQA"
    if device.type != "cpu" or key in os.environ:
        yield
        return
    os.environ[key] = "1"
    try:
        yield
    finally:
        os.environ.pop(key, None)


def response_logits(model, batch: TokenBatch, shared_prefix: bool = True) -> torch.Tensor:
    """Logits [B, T, V] that predict the response tokens (positions P-1 .. P+T-2), contiguous. Shared
    prefix: the distinct prompts but their last token run once; each row then runs its last prompt
    token and its response on the indexed cache, so the logits come out of one forward (no [B, T, V]
    concatenation, forward or backward). On CPU, attention runs grouped-query natively (`native_gqa`)."""
    with native_gqa(batch.input_ids.device):
        return _response_logits(model, batch, shared_prefix)


def _response_logits(model, batch: TokenBatch, shared_prefix: bool) -> torch.Tensor:
    P, T = batch.prompt_width, batch.responses.shape[1]
    if shared_prefix and P > 1:
        prompts, inverse = _distinct_prompts(batch)                              # [U, P], [B]
        if prompts.shape[0] < inverse.shape[0]:
            head = prompts[:, :-1]                                               # [U, P-1]
            _, arg, cache = prefill(model, head.clamp(min=0), (head >= 0).long())
            cache.batch_select_indices(inverse)                                  # [U, ...] -> [B, ...], differentiable
            out = model(input_ids=batch.input_ids[:, P - 1 : P + T - 1], attention_mask=batch.attention_mask[:, : P + T - 1],
                        position_ids=batch.position_ids[:, P - 1 : P + T - 1], use_cache=True, **{arg: cache})
            return out.logits
    keep = torch.arange(P - 1, P + T - 1, device=batch.input_ids.device)          # positions P-1 .. P+T-2
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False, logits_to_keep=keep)
    return out.logits


def response_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False,
                      shared_prefix: bool = True, autocast_dtype: torch.dtype | None = None):
    """Per-token log-probs [B, T] of the responses under `model` (and entropy [B, T] if asked, else
    None), always float32: a bf16 model's logits are cast to float32 before the log-softmax (as verl
    does). `autocast_dtype` (bf16 training, engines/models/devices.py): the model's forward runs under
    torch.autocast in it, the log-softmax outside. `shared_prefix=False` runs every row's prompt (for
    wrappers that allow one forward per backward). The [B, T, V] logits are the model's own output
    (or their float32 copy) and nobody else holds them, so the log-softmax (and later its gradient)
    is written over them (`token_logprobs_and_entropy`'s `overwrite`)."""
    from engines.models.devices import mixed_precision

    with mixed_precision(batch.input_ids.device, autocast_dtype):
        logits = response_logits(model, batch, shared_prefix)
    logits = logits.float()                                                   # [B, T, V]
    return token_logprobs_and_entropy(logits, batch.responses, temperature, with_entropy, overwrite=True)


_CHUNK_ELEMENTS = 1 << 20  # ~4 MB float32: each pass over the vocabulary takes this many logits at a time


def _row_chunks(n_rows: int, vocab: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, vocab))
    return (slice(s, min(n_rows, s + step)) for s in range(0, n_rows, step))


class _LogProbsAndEntropy(torch.autograd.Function):
    """log softmax(z / τ)[target] and the entropy of softmax(z / τ) per position, in passes of
    `_CHUNK_ELEMENTS` logits: the only [B, T, V] tensor is the one holding the log-softmax (with
    `overwrite`: the logits' own storage, so none is allocated at all), and the backward writes the
    gradient into that same tensor, d logp/dz = (onehot - p)/τ, d H/dz = -p (log p + H)/τ.

    Why: every fresh [B, T, V] float tensor is 200 MB for a 32 x 32 SmolLM2 micro-batch, and a
    fresh one is faulted in page by page (~0.05 s, and ~0.4 s where the pages had gone back to the
    host); the straightforward version allocated five (log-softmax, exp, p, coefficient, grad)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, overwrite):
        V = logits.shape[-1]
        z = logits.detach()
        if not (overwrite and z.is_contiguous()):
            z = z.clone(memory_format=torch.contiguous_format)
        flat, tgt = z.view(-1, V), targets.reshape(-1)
        entropy = torch.empty(flat.shape[0], dtype=z.dtype, device=z.device) if with_entropy else None
        scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else None
        for c in _row_chunks(flat.shape[0], V):
            zc = flat[c]
            if scale is not None:
                zc.mul_(scale)
            zc.sub_(torch.logsumexp(zc, -1, keepdim=True))                           # log-softmax, in place
            if with_entropy:
                entropy[c] = -torch.exp(zc).mul_(zc).sum(-1)
        logp = flat.gather(-1, tgt.unsqueeze(-1)).view(targets.shape)
        ctx.save_for_backward(z, targets, entropy)
        ctx.scale, ctx.overwrite, ctx.used = scale, overwrite, False
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logp, entropy.view(targets.shape)
        return logp, None

    @staticmethod
    def backward(ctx, g_logp, g_entropy, *_):
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None
        if ctx.used:  # overwrite: the saved log-softmax has become the gradient
            raise RuntimeError("token_logprobs_and_entropy(overwrite=True): backward ran twice through the "
                               "same graph (retain_graph); it writes the gradient over its saved log-softmax")
        logsm, targets, entropy = ctx.saved_tensors
        if ctx.overwrite:
            ctx.used = True
        else:
            logsm = logsm.clone()
        V = logsm.shape[-1]
        grad = logsm.view(-1, V)
        gl = None if g_logp is None else g_logp.reshape(-1, 1)
        gh = None if g_entropy is None else g_entropy.reshape(-1, 1)
        h = None if gh is None else entropy.view(-1, 1)
        for c in _row_chunks(grad.shape[0], V):
            lc = grad[c]
            p = torch.exp(lc)
            if gh is None:
                lc.copy_(p).mul_(-gl[c])
            else:
                lc.add_(h[c]).mul_(gh[c])
                if gl is not None:
                    lc.add_(gl[c])
                lc.mul_(p).neg_()
        if gl is not None:
            grad.scatter_add_(-1, targets.reshape(-1, 1), gl)
        if ctx.scale is not None:
            grad.mul_(ctx.scale)
        return logsm, None, None, None, None


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               with_entropy: bool = True, overwrite: bool = False):
    """(log-probs [B, T] of `targets` under softmax(logits [B, T, V] / temperature), entropies [B, T]
    or None), differentiable. `overwrite=True`: the caller hands over `logits` -- its storage then
    holds the log-softmax and, in backward, the gradient (no [B, T, V] tensor is allocated; a
    non-contiguous `logits` is copied anyway) and the backward may run only once; without it,
    one [B, T, V] tensor is allocated in forward and one per backward."""
    return _LogProbsAndEntropy.apply(logits, targets, temperature, with_entropy, overwrite)


@torch.no_grad()
def batched_logprobs(model, batch: TokenBatch, micro_batch: int = 64, temperature: float = 1.0) -> torch.Tensor:
    """`response_logprobs` in micro-batches without grad; [B, T] float32 on the batch's device. Each
    micro-batch runs on the model's device (a bf16 model on CUDA: float32 log-probs back on CPU).
    (Rows of one prompt are adjacent in a rollout table, so a micro-batch usually holds whole groups
    and shares their prefix.)"""
    model.eval()
    device = next(model.parameters()).device
    parts = []
    for s in range(0, batch.input_ids.shape[0], micro_batch):
        logp, _ = response_logprobs(model, batch.select(slice(s, s + micro_batch)).to(device), temperature)
        parts.append(logp.to(batch.input_ids.device))
    return torch.cat(parts) * batch.response_mask

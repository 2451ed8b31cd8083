"""The plain-PyTorch training engines: one PPO-style update of the actor, and of the critic (PPO
with GAE), on a scored rollout batch.

`TorchTrainEngine.train_step` takes plain tensors (already collated) plus advantages, and does
`ppo_epochs` passes of mini-batches; each mini-batch is split into micro-batches by token count
(gradient accumulation), and the loss of each micro-batch is normalised by the *global* token /
sequence count of its mini-batch, so the update does not depend on the micro-batch size.
`TorchCriticEngine.train_step` does the same for the clipped value loss against the GAE returns,
with its own AdamW and learning rate.
"""

from __future__ import annotations

import math
import time

import torch

from configs.algorithm import AlgorithmConfig
from engines.algorithms.aggregate import global_counts
from engines.algorithms.aggregate import masked_mean
from engines.algorithms.objective import actor_loss, critic_loss
from engines.batching import TokenBatch, response_logprobs


_SHARE_METRICS = {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss"}


def split_by_tokens(lengths: list[int], max_tokens: int, response_lengths: list[int] | None = None) -> list[list[int]]:
    """Greedy split of row indices into micro-batches of at most `max_tokens` padded tokens each.

    With `response_lengths`, `lengths` are prompt lengths and a micro-batch costs
    rows x (max prompt + max response), the width `train_step` trims it to."""
    resp = response_lengths or [0] * len(lengths)
    groups, cur, mp, mr = [], [], 0, 0
    for i, (p, r) in enumerate(zip(lengths, resp)):
        np_, nr = max(mp, p), max(mr, r)
        if cur and (np_ + nr) * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur, np_, nr = [], p, r
        cur.append(i)
        mp, mr = np_, nr
    if cur:
        groups.append(cur)
    return groups


def _trim(sub: TokenBatch) -> tuple[TokenBatch, int]:
    """Drop the columns that are padding in every row of `sub`; (trimmed batch, response width)."""
    P = sub.prompt_width
    first = int(sub.attention_mask[:, :P].any(0).float().argmax())
    t = max(1, int(sub.attention_mask[:, P:].sum(-1).max()))
    cols = slice(first, P + t)
    return TokenBatch(sub.input_ids[:, cols], sub.attention_mask[:, cols], sub.position_ids[:, cols],
                      sub.responses[:, :t], sub.response_mask[:, :t]), t


def _adamw(params, lr, weight_decay, betas, warmup_steps, total_steps, min_lr_ratio):
    """AdamW + LR schedule: linear warmup, then cosine to min_lr_ratio (or constant)."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)

    def schedule(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if not total_steps:
            return 1.0
        prog = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class TorchTrainEngine:
    def __init__(
        self,
        model,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ):
        self.model = model
        self.grad_clip = grad_clip
        self.optimizer, self.scheduler = _adamw(model.parameters(), lr, weight_decay, betas, warmup_steps,
                                                total_steps, min_lr_ratio)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def train_step(
        self,
        batch: TokenBatch,
        advantages: torch.Tensor,          # [B, T]
        old_logprobs: torch.Tensor,        # [B, T]
        ref_logprobs: torch.Tensor | None, # [B, T]
        cfg: AlgorithmConfig,
        *,
        mini_batch_size: int,
        max_tokens_per_micro_batch: int,
        temperature: float = 1.0,
        seed: int = 0,
        rollout_logprobs: torch.Tensor | None = None,  # [B, T] behaviour log-probs, for TIS
        kl_coef: float | None = None,
    ) -> dict[str, float]:
        """`cfg.ppo_epochs` passes over shuffled mini-batches; returns averaged `actor/*` metrics.
        `rollout_logprobs` turn on truncated importance sampling when `cfg.tis_cap` is set;
        `kl_coef` is the KL controller's current β (None = `cfg.kl_coef`)."""
        self.model.train()
        B = batch.input_ids.shape[0]
        P = batch.prompt_width
        prompt_lens = batch.attention_mask[:, :P].sum(-1).tolist()
        resp_lens = batch.attention_mask[:, P:].sum(-1).tolist()
        g = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        n_updates, t0, tokens = 0, time.perf_counter(), 0
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(B, generator=g).tolist()
            for ms in range(0, B, mini_batch_size):
                mini = order[ms : ms + mini_batch_size]
                num_tokens, num_seqs = global_counts(batch.response_mask[mini])
                self.optimizer.zero_grad(set_to_none=True)
                micro = split_by_tokens([prompt_lens[i] for i in mini], max_tokens_per_micro_batch,
                                        [resp_lens[i] for i in mini])
                for mb in micro:
                    idx = [mini[j] for j in mb]
                    sub, t = _trim(batch.select(idx))
                    logp, entropy = response_logprobs(self.model, sub, temperature, with_entropy=True)
                    loss, m = actor_loss(
                        cfg,
                        logp,
                        old_logprobs[idx, :t],
                        None if ref_logprobs is None else ref_logprobs[idx, :t],
                        advantages[idx, :t],
                        sub.response_mask,
                        entropy=entropy,
                        num_tokens=num_tokens,
                        num_seqs=num_seqs,
                        rollout_logprobs=None if rollout_logprobs is None else rollout_logprobs[idx, :t],
                        kl_coef=kl_coef,
                    )
                    loss.backward()
                    w = len(idx) / len(mini)
                    for k, v in m.items():  # loss terms are already this micro-batch's share; rates are local means
                        sums[k] = sums.get(k, 0.0) + (float(v) if k in _SHARE_METRICS else w * float(v))
                    tokens += int(sub.attention_mask.sum())
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + float(grad_norm)
                self.scheduler.step()
                n_updates += 1
        elapsed = time.perf_counter() - t0
        metrics = {k: v / max(1, n_updates) for k, v in sums.items()}
        metrics.update(
            {
                "actor/lr": self.scheduler.get_last_lr()[0],
                "actor/updates": float(n_updates),
                "training/tokens_per_s": tokens / max(elapsed, 1e-9),
            }
        )
        return metrics


class TorchCriticEngine:
    """The critic's update: clipped value loss (`objective.critic_loss`) against the returns, with
    its own AdamW; same mini-batch order and token-count micro-batching as the actor."""

    def __init__(self, critic, lr: float = 1e-3, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 grad_clip: float = 1.0, warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.1):
        self.critic = critic
        self.grad_clip = grad_clip
        self.optimizer, self.scheduler = _adamw(critic.parameters(), lr, weight_decay, betas, warmup_steps,
                                                total_steps, min_lr_ratio)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def train_step(
        self,
        batch: TokenBatch,
        returns: torch.Tensor,        # [B, T] GAE returns (targets)
        old_values: torch.Tensor,     # [B, T] values of the critic that produced the advantages
        cfg: AlgorithmConfig,
        *,
        mini_batch_size: int,
        max_tokens_per_micro_batch: int,
        seed: int = 0,
    ) -> dict[str, float]:
        """`cfg.ppo_epochs` passes over shuffled mini-batches; returns averaged `critic/*` metrics."""
        from engines.critic_model import response_values

        self.critic.train()
        B, P = batch.input_ids.shape[0], batch.prompt_width
        prompt_lens = batch.attention_mask[:, :P].sum(-1).tolist()
        resp_lens = batch.attention_mask[:, P:].sum(-1).tolist()
        g = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        n_updates = 0
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(B, generator=g).tolist()
            for ms in range(0, B, mini_batch_size):
                mini = order[ms : ms + mini_batch_size]
                num_tokens, num_seqs = global_counts(batch.response_mask[mini])
                self.optimizer.zero_grad(set_to_none=True)
                for mb in split_by_tokens([prompt_lens[i] for i in mini], max_tokens_per_micro_batch,
                                          [resp_lens[i] for i in mini]):
                    idx = [mini[j] for j in mb]
                    sub, t = _trim(batch.select(idx))
                    values = response_values(self.critic, sub)                          # [b, t]
                    loss, m = critic_loss(cfg, values, old_values[idx, :t], returns[idx, :t], sub.response_mask,
                                          num_tokens=num_tokens, num_seqs=num_seqs)
                    loss.backward()
                    w = len(idx) / len(mini)
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + (float(v) if k in _SHARE_METRICS else w * float(v))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                sums["critic/grad_norm"] = sums.get("critic/grad_norm", 0.0) + float(grad_norm)
                self.scheduler.step()
                n_updates += 1
        metrics = {k: v / max(1, n_updates) for k, v in sums.items()}
        mask = batch.response_mask.float()
        metrics.update({
            "critic/values_mean": float(masked_mean(old_values, mask)),
            "critic/returns_mean": float(masked_mean(returns, mask)),
            "critic/lr": self.scheduler.get_last_lr()[0],
        })
        return metrics

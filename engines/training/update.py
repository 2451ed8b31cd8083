# longer than 400 lines: the actor and critic update engines and the micro-batching they share
"""The plain-PyTorch training engines: one PPO-style update of the actor, and of the critic (PPO
with GAE), on a scored rollout batch.

`TorchTrainEngine.train_step` takes plain tensors (already collated) plus advantages, and does
`ppo_epochs` passes of mini-batches; each mini-batch is split into micro-batches by token count
(gradient accumulation), and the loss of each micro-batch is normalised by the *global* token /
sequence count of its mini-batch, so the update does not depend on the micro-batch size.
`TorchCriticEngine.train_step` does the same for the clipped value loss against the GAE returns,
with its own AdamW and learning rate.

Both engines run on any training strategy (`engines/training/strategies.py`: torch, ddp, fsdp2, DeepSpeed
ZeRO-2/3): the strategy wraps the model and optimizer; with N ranks each rank trains on its shard of
every mini-batch with the same global normalisers, so the update equals the single-process one.

LoRA (config `training.lora`, engines/training/lora.py): the actor's model is wrapped by peft, only the
adapters train and hold AdamW state; `checkpoint_state_dict` gives the merged plain weights to publish
and `state_dict` carries the adapter weights for an exact resume. `gradient_checkpointing`: the
actor's decoder layers are recomputed in the backward (less activation memory, ~one more forward).

Precision (`compute_dtype`, config `placement.actor_train.dtype` / `placement.critic.dtype`): the
model's parameters stay as given (float32: the master weights, and AdamW's state with them) and
with bfloat16 each forward runs under torch.autocast (engines/models/devices.py); log-probs, the loss and
the values are float32.
"""

from __future__ import annotations

import math
import time
import typing

import torch

from engines.algorithms.aggregate import agg_loss, global_counts, masked_mean
from engines.algorithms.objective import actor_loss, critic_loss
from engines.algorithms.policy_losses import ZERO_AT_ZERO_ADVANTAGE
from engines.algorithms.registry import get_policy_loss
from engines.models.batching import TokenBatch, prompt_groups, response_logprobs
from engines.training.model_patches import compile_decoder_layers, tied_embedding_grad_in_place
from engines.training.strategies import TorchStrategy, TrainStrategy, micro_batches, shard

if typing.TYPE_CHECKING:  # annotations only: the engine runs without pydantic (a GPU box may not have it)
    from engines.algorithms.config import AlgorithmConfig



# non-reentrant (frozen LoRA inputs need no requires_grad trick); the recompute's metadata check is off: the
# 4-D attention mask a layer saves is a broadcast view whose recomputed twin differs in stride/shape
# ([b, 1, T, T] vs [b, heads, T, T]) though its values are the same (tests/engines/training/test_lora.py: same update)
_CHECKPOINT_KWARGS = {"use_reentrant": False, "determinism_check": "none"}

_SHARE_METRICS = {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss"}


def zero_advantage_skippable(cfg: AlgorithmConfig, kl_loss: bool) -> bool:
    """Whether rows with all-zero advantages may be left out of the actor's update without changing it:
    the policy loss is -A·f(...) per token (the built-in ones), and no KL loss term (`kl_loss`: one
    with a non-zero β is in the loss) or entropy bonus gives those rows a gradient of their own."""
    return (cfg.skip_zero_advantage and get_policy_loss(cfg.policy_loss) in ZERO_AT_ZERO_ADVANTAGE
            and not kl_loss and cfg.entropy_coef == 0.0)


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


def balance_split(lengths: list[int], max_tokens: int, response_lengths: list[int] | None = None,
                  prompt_ids: list[int] | None = None) -> list[list[int]]:
    """`split_by_tokens`'s number of micro-batches, with the rows spread evenly over them: contiguous
    runs of about equal row counts, each cut moved to the nearest change of prompt (`prompt_ids`,
    rows ordered by prompt) when that keeps every run under the cap, so runs hold whole groups and
    share their prefix. Falls back to the greedy split when no even split fits the cap.

    The greedy split fills the first micro-batches to the cap and leaves a small remainder (the
    benchmark's SmolLM2 8 x 8 GRPO batch: 58 + 6 rows, one group cut in two); the peak activation
    memory follows the largest micro-batch, and memory the machine must fault in again costs time
    (docs/benchmarks.md: that update 11.2-12.1 -> 9.3-10.2 s, peak resident memory 7.5 -> 6.0 GiB)."""
    greedy = split_by_tokens(lengths, max_tokens, response_lengths)
    k, n = len(greedy), len(lengths)
    if k <= 1:
        return greedy
    resp = response_lengths or [0] * n
    fits = lambda run: len(run) == 1 or len(run) * (max(lengths[i] for i in run) + max(resp[i] for i in run)) <= max_tokens
    even = [round(j * n / k) for j in range(k + 1)]
    candidates = [even]
    if prompt_ids is not None:
        changes = [i for i in range(1, n) if prompt_ids[i] != prompt_ids[i - 1]]
        if changes:
            snapped = [0] + [min(changes, key=lambda c: abs(c - cut)) for cut in even[1:-1]] + [n]
            candidates.insert(0, snapped)
    for cuts in candidates:
        runs = [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]
        if all(runs) and all(fits(r) for r in runs):
            return runs
    return greedy


def _trim(sub: TokenBatch) -> tuple[TokenBatch, int]:
    """Drop the columns that are padding in every row of `sub`; (trimmed batch, response width)."""
    P = sub.prompt_width
    first = int(sub.attention_mask[:, :P].any(0).float().argmax())
    t = max(1, int(sub.attention_mask[:, P:].sum(-1).max()))
    cols = slice(first, P + t)
    return TokenBatch(sub.input_ids[:, cols], sub.attention_mask[:, cols], sub.position_ids[:, cols],
                      sub.responses[:, :t], sub.response_mask[:, :t]), t


def _micro_steps(strategy: TrainStrategy, mini: list[int], prompt_lens: list[int], resp_lens: list[int],
                 max_tokens: int, groups: list[int] | None = None) -> list[tuple[list[int], float]]:
    """(row indices, weight) of each forward/backward this rank runs for mini-batch `mini`: its
    shard split by token count into evenly sized micro-batches (`balance_split`), padded with
    zero-weighted rows to the busiest rank's count. With `groups` (prompt id per row) the
    mini-batch's rows are ordered by prompt first, so a micro-batch holds whole groups and shares
    their prefix (same rows, same sum: the update is unchanged)."""
    if groups is not None:
        mini = sorted(mini, key=lambda i: groups[i])  # stable: the shuffled order stays within a group
    splits = []
    for r in range(strategy.world_size):
        rows = shard(mini, r, strategy.world_size)
        runs = balance_split([prompt_lens[i] for i in rows], max_tokens, [resp_lens[i] for i in rows],
                             None if groups is None else [int(groups[i]) for i in rows])
        splits.append([[rows[j] for j in mb] for mb in runs])
    return micro_batches(splits, strategy.rank, mini[:1])


def _to(device: torch.device, sub: TokenBatch, *tensors):
    """`sub` and `tensors` (None allowed) on `device` (no copies on CPU)."""
    if device.type == "cpu":
        return (sub, *tensors)
    return (TokenBatch(*(x.to(device) for x in (sub.input_ids, sub.attention_mask, sub.position_ids, sub.responses,
                                                sub.response_mask))),
            *(None if x is None else x.to(device) for x in tensors))


def _adamw(lr, weight_decay, betas):
    """The optimizer factory a strategy calls on its (possibly sharded) parameters: torch's fused
    AdamW (one kernel over all parameters; 0.07 s instead of 0.34 s a step for SmolLM2 on two CPU
    cores) on plain tensors, the default implementation on sharded (DTensor) ones."""
    from torch.distributed.tensor import DTensor

    def make(params):
        params = [p for p in params if p.requires_grad]  # LoRA: the adapters only (the frozen base gets no state)
        fused = all(type(p) is not DTensor and p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused or None)

    return make


def _lr_schedule(optimizer, warmup_steps, total_steps, min_lr_ratio):
    """LR schedule: linear warmup, then cosine to min_lr_ratio (or constant)."""

    def schedule(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if not total_steps:
            return 1.0
        prog = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class NonFiniteUpdate(RuntimeError):
    """A loss, a loss term or the gradient norm of an update is inf or NaN: the step is not taken (an update
    that silently did nothing, or wrote NaN into the weights, would look like training)."""


class _PPOEngine:
    """What the actor's and the critic's engines share: the strategy-wrapped module, its AdamW and
    LR schedule (and their state), and the update loop — `ppo_epochs` passes over shuffled
    mini-batches, each split into micro-batches by token count, one optimizer step per mini-batch. A
    loss or gradient norm that is not finite raises `NonFiniteUpdate` before that step."""

    role = "actor"   # the metrics' prefix

    def __init__(self, module, lr: float, weight_decay: float, betas: tuple[float, float], grad_clip: float,
                 warmup_steps: int, total_steps: int | None, min_lr_ratio: float, strategy: TrainStrategy | None,
                 compute_dtype: torch.dtype | None = None):
        from engines.models.devices import autocast_dtype

        self.grad_clip = grad_clip
        self.autocast_dtype = None if compute_dtype is None else autocast_dtype(compute_dtype)  # None: plain forwards
        self.strategy = strategy or TorchStrategy()
        self.module, self.optimizer = self.strategy.prepare(module, _adamw(lr, weight_decay, betas), grad_clip)
        self.scheduler = _lr_schedule(self.optimizer, warmup_steps, total_steps, min_lr_ratio)

    def state_dict(self) -> dict:
        """Collective under multi-process strategies; complete on rank 0."""
        return {"optimizer": self.strategy.optimizer_state_dict(self.optimizer), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_optimizer_state_dict(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def _updates(self, batch: TokenBatch, ppo_epochs: int, mini_batch_size: int, max_tokens_per_micro_batch: int,
                 seed: int, micro_loss, groups: list[int] | None = None,
                 run_rows: list[bool] | None = None, unit: int = 1,
                 share_metrics: frozenset[str] = frozenset()) -> tuple[dict[str, float], int, float, float, int]:
        """Run the update loop; `micro_loss(sub, idx, t, num_tokens, num_seqs, ran) -> (loss, metrics)` on
        each trimmed micro-batch `sub` (rows `idx`, response width `t`), inside the strategy's
        micro-batch context. `run_rows` [B]: the rows that need a forward and backward (None: all);
        the others are left out, but `num_tokens` / `num_seqs` still count the whole mini-batch (the
        loss's normalisers), and `ran` = (tokens, sequences) of the rows that run. Returns (metric means
        over updates, summed over ranks; number of updates; mean grad norm; padded tokens processed,
        summed over ranks; rows left out, summed over updates).

        `unit` > 1: the rows come in units of `unit` consecutive rows that stay together (a preference
        pair: chosen, rejected), in one rank's micro-batch and in their order; `mini_batch_size` then
        counts units, and a micro-batch's token cap is shared by its unit's rows. `share_metrics`: metric
        keys that are, like the loss terms of `_SHARE_METRICS`, each micro-batch's share of its
        mini-batch's value (summed over micro-batches, not averaged)."""
        shares = _SHARE_METRICS | share_metrics
        if unit > 1 and (groups is not None or run_rows is not None or batch.input_ids.shape[0] % unit):
            raise ValueError(f"unit={unit}: needs a whole number of units and neither groups nor run_rows")
        strategy = self.strategy
        self.module.train()
        B, P = batch.input_ids.shape[0], batch.prompt_width
        U = B // unit
        rows_of = (lambda units: units) if unit == 1 else (lambda units: [u * unit + k for u in units for k in range(unit)])
        # a unit's length is its longest row's: the micro-batch split sees units, each `unit` rows wide
        prompt_lens = batch.attention_mask[:, :P].sum(-1).view(U, unit).amax(-1).tolist()
        resp_lens = batch.attention_mask[:, P:].sum(-1).view(U, unit).amax(-1).tolist()
        g = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        n_updates, tokens, norms, skipped = 0, 0, 0.0, 0
        for _epoch in range(ppo_epochs):
            order = torch.randperm(U, generator=g).tolist()
            for ms in range(0, U, mini_batch_size):
                units = order[ms : ms + mini_batch_size]
                mini = rows_of(units)
                num_tokens, num_seqs = global_counts(batch.response_mask[mini])
                # at least one row runs, so every parameter gets a (zero) gradient and the step is the same
                run = mini if run_rows is None else ([i for i in mini if run_rows[i]] or mini[:1])
                skipped += len(mini) - len(run)
                ran = global_counts(batch.response_mask[run])
                strategy.zero_grad(self.optimizer)
                micro = _micro_steps(strategy, run, prompt_lens, resp_lens, max_tokens_per_micro_batch, groups) if unit == 1 \
                    else [(rows_of(idx), w) for idx, w in _micro_steps(strategy, units, prompt_lens, resp_lens,
                                                                         max(1, max_tokens_per_micro_batch // unit))]
                bad: tuple[str, float] | None = None   # this rank's first loss or loss term that is not finite
                for n, (idx, weight) in enumerate(micro):  # weight 0: padding to the busiest rank's count
                    sub, t = _trim(batch.select(idx))
                    with strategy.micro_batch(last=n == len(micro) - 1):
                        loss, m = micro_loss(sub, idx, t, num_tokens, num_seqs, ran)
                        strategy.backward(loss * weight)
                    w = weight * len(idx) / len(run)
                    for k, v in m.items():  # loss terms are already this micro-batch's share; rates are local means
                        sums[k] = sums.get(k, 0.0) + (weight * float(v) if k in shares else w * float(v))
                        if bad is None and weight and k in shares and not math.isfinite(float(v)):
                            bad = (k, float(v))
                    if bad is None and weight and not math.isfinite(float(loss.detach())):
                        bad = (f"{self.role}/loss", float(loss))
                    tokens += int(weight * sub.attention_mask.sum())
                # decided alike on every rank (a collective), before any step: a non-finite loss anywhere stops here
                if strategy.all_reduce_sum([float(bad is not None)])[0]:
                    strategy.zero_grad(self.optimizer)
                    what = f"{bad[0]} is {bad[1]}" if bad else "a loss on another rank is not finite"
                    raise NonFiniteUpdate(f"{what} at update {n_updates + 1} (epoch {_epoch + 1}, mini-batch "
                                          f"{ms // mini_batch_size + 1}): the optimizer step was not taken")
                norm = strategy.step(self.optimizer)   # skips the step when the global norm is not finite
                if not math.isfinite(norm):
                    raise NonFiniteUpdate(f"{self.role}/grad_norm is {norm} at update {n_updates + 1} (epoch {_epoch + 1}, "
                                          f"mini-batch {ms // mini_batch_size + 1}): the optimizer step was not taken")
                norms += norm
                self.scheduler.step()
                n_updates += 1
        keys = sorted(sums)  # every rank ran the same micro-batches, so the same keys
        *values, tokens = strategy.all_reduce_sum([sums[k] for k in keys] + [tokens])
        return ({k: v / max(1, n_updates) for k, v in zip(keys, values)}, n_updates, norms / max(1, n_updates), tokens,
                skipped)


class TorchTrainEngine(_PPOEngine):
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
        strategy: TrainStrategy | None = None,
        compile: bool = False,
        compute_dtype: torch.dtype | None = None,
        lora: dict | None = None,
        gradient_checkpointing: bool = False,
    ):
        """`model` is the plain module, already on its device; `self.model` is it or, with `lora`
        ({rank, alpha, dropout, target_modules}, rank > 0), its peft wrapper (engines/training/lora.py: only the
        adapters train, AdamW holds their state only); `self.module` is what the strategy wrapped that
        into (forward goes through it); `checkpoint_state_dict` is what to save. `compile`:
        `compile_decoder_layers` first. `compute_dtype` bfloat16/float16: forwards under autocast in
        it, parameters and optimizer state left in their dtype (float32 master weights).
        `gradient_checkpointing`: each decoder layer recomputed in the backward (non-reentrant)."""
        if lora and lora.get("rank", 0) > 0:
            from engines.training.lora import apply_lora

            model = apply_lora(model, lora["rank"], lora["alpha"], lora.get("dropout", 0.0), tuple(lora["target_modules"]))
        if gradient_checkpointing:
            from engines.training.lora import plain_model

            hf = plain_model(model)
            if hasattr(hf, "activation_checkpointing_enable"):  # its name from transformers 5.2x
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs=_CHECKPOINT_KWARGS)
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=_CHECKPOINT_KWARGS)
        self.model, self.gradient_checkpointing = model, gradient_checkpointing
        self.compiled = compile_decoder_layers(model) if compile else []
        super().__init__(model, lr, weight_decay, betas, grad_clip, warmup_steps, total_steps, min_lr_ratio, strategy,
                         compute_dtype)
        # the tied embedding's gradient added into .grad in place, where the strategy lets a backward do that
        self.tied_embedding_in_place = self.strategy.grads_in_place and tied_embedding_grad_in_place(model)
        # a KV cache through compiled layers recompiles per layer, and checkpointed layers build none: plain forwards then
        self.shared_prefix = self.strategy.shared_prefix and not compile and not gradient_checkpointing

    @property
    def lora(self) -> bool:
        from engines.training.lora import is_lora

        return is_lora(self.model)

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. The weights to publish as the plain Hugging Face model (save with
        `engines.training.lora.plain_model(self.model)`): with LoRA the merged W + (alpha/r)·B@A per target
        (engines/training/lora.py), else the strategy's full state dict (None: the module's own is complete)."""
        if self.lora:
            from engines.training.lora import merged_state_dict

            return merged_state_dict(self.model)
        return self.strategy.full_state_dict()

    def state_dict(self) -> dict:
        """Optimizer and LR schedule and, with LoRA, the adapter weights (`lora_adapter`)."""
        state = super().state_dict()
        if self.lora:
            from engines.training.lora import adapter_state_dict

            state["lora_adapter"] = adapter_state_dict(self.model)
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.lora and "lora_adapter" in state:
            from engines.training.lora import load_adapter_state_dict

            load_adapter_state_dict(self.model, state["lora_adapter"])
        super().load_state_dict(state)

    def train_step(
        self,
        batch: TokenBatch,
        advantages: torch.Tensor,          # [B, T]
        old_logprobs: torch.Tensor | None, # [B, T]; None: the forward's own log-probs, detached
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
        `old_logprobs` None: π_old is each micro-batch's own log-probs, detached (the ratio is
        exactly 1; valid only for one on-policy pass, `AlgorithmConfig.old_logprobs_in_update`),
        and with `rollout_logprobs` given, `actor/behaviour_logprob_mae` = mean |π_old − behaviour|
        per token (what the reference stage measures when it recomputes π_old).
        `rollout_logprobs` turn on truncated importance sampling when `cfg.tis_cap` is set;
        `kl_coef` is the KL controller's current β (None = `cfg.kl_coef`). Rows with zero advantage
        are skipped where that leaves the update unchanged (`zero_advantage_skippable`)."""
        shared = self.shared_prefix
        run_rows = None
        beta = cfg.kl_coef if kl_coef is None else kl_coef
        if zero_advantage_skippable(cfg, cfg.use_kl_loss and ref_logprobs is not None and beta != 0):
            run_rows = ((advantages != 0) & (batch.response_mask > 0)).any(-1).tolist()  # [B]

        def micro_loss(sub, idx, t, num_tokens, num_seqs, ran):
            sub, old, ref, adv, behaviour = _to(
                self.strategy.device, sub, None if old_logprobs is None else old_logprobs[idx, :t],
                None if ref_logprobs is None else ref_logprobs[idx, :t],
                advantages[idx, :t], None if rollout_logprobs is None else rollout_logprobs[idx, :t])
            logp, entropy = response_logprobs(self.module, sub, temperature, with_entropy=True, shared_prefix=shared,
                                              autocast_dtype=self.autocast_dtype)
            if old is None:
                old = logp.detach()
            loss, m = actor_loss(cfg, logp, old, ref, adv, sub.response_mask, entropy=entropy, num_tokens=num_tokens,
                                 num_seqs=num_seqs, rollout_logprobs=behaviour, kl_coef=kl_coef)
            if old_logprobs is None and behaviour is not None:  # the mismatch the skipped recompute would have shown
                m["actor/behaviour_logprob_mae"] = float(masked_mean((old - behaviour).abs(), sub.response_mask.float()))
            if run_rows is not None:  # the entropy metric over the rows that ran (the loss keeps the global counts)
                m["actor/entropy"] = float(agg_loss(entropy.detach(), sub.response_mask, cfg.loss_agg_mode, num_tokens=ran[0],
                                                    num_seqs=ran[1], loss_scale_factor=cfg.loss_scale_factor))
            return loss, m

        t0 = time.perf_counter()
        metrics, n_updates, grad_norm, tokens, skipped = self._updates(
            batch, cfg.ppo_epochs, mini_batch_size, max_tokens_per_micro_batch, seed, micro_loss,
            groups=prompt_groups(batch).tolist() if shared else None, run_rows=run_rows)
        elapsed = time.perf_counter() - t0
        metrics.update({
            "actor/skipped_rows": skipped / max(1, cfg.ppo_epochs * batch.input_ids.shape[0]),
            "actor/grad_norm": grad_norm,
            "actor/lr": self.scheduler.get_last_lr()[0],
            "actor/updates": float(n_updates),
            "training/tokens_per_s": tokens / max(elapsed, 1e-9),
        })
        return metrics


class TorchCriticEngine(_PPOEngine):
    """The critic's update: clipped value loss (`objective.critic_loss`) against the returns, with
    its own AdamW; same mini-batch order and token-count micro-batching as the actor."""

    role = "critic"

    def __init__(self, critic, lr: float = 1e-3, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 grad_clip: float = 1.0, warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.1,
                 strategy: TrainStrategy | None = None, compute_dtype: torch.dtype | None = None):
        self.critic = critic
        super().__init__(critic, lr, weight_decay, betas, grad_clip, warmup_steps, total_steps, min_lr_ratio, strategy,
                         compute_dtype)

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
        from engines.training.critic_model import response_values

        def micro_loss(sub, idx, t, num_tokens, num_seqs, _ran):
            sub, old, ret = _to(self.strategy.device, sub, old_values[idx, :t], returns[idx, :t])
            values = response_values(self.module, sub, self.autocast_dtype)  # [b, t]
            return critic_loss(cfg, values, old, ret, sub.response_mask, num_tokens=num_tokens, num_seqs=num_seqs)

        metrics, _, grad_norm, _, _ = self._updates(batch, cfg.ppo_epochs, mini_batch_size, max_tokens_per_micro_batch,
                                                 seed, micro_loss)
        mask = batch.response_mask.float()
        metrics.update({
            "critic/grad_norm": grad_norm,
            "critic/values_mean": float(masked_mean(old_values, mask)),
            "critic/returns_mean": float(masked_mean(returns, mask)),
            "critic/lr": self.scheduler.get_last_lr()[0],
        })
        return metrics

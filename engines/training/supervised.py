"""Supervised, preference and distillation updates on the RL trainer's engine: SFT steps (masked
next-token loss), DPO-family steps (engines/algorithms/preference.py) and logit distillation on a
teacher's top-k (engines/algorithms/distill.py), on any training strategy and with LoRA.

Both run `TorchTrainEngine`'s update loop (engines/training/update.py `_updates`): its strategy-wrapped
model and AdamW, its LR schedule, micro-batches by token count (gradient accumulation: each
micro-batch's loss is normalised by its mini-batch's global count, so the step does not depend on
the micro-batch size) and its refusal of a non-finite loss or gradient norm. Preference pairs travel
as units of two rows (chosen, rejected) that stay in one micro-batch.

Tokenising (`encode_demonstration`, `encode_pair`): the prompt as the run's generation renders it
(engines/models/modeling.py `encode_prompts`; a conversation through the chat template), the response
tokenised on its own with the EOS appended, so the model learns to stop where the generation stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.algorithms.preference import get_preference_loss, preference_metrics
from engines.models.batching import TokenBatch, collate, response_logprobs
from engines.models.modeling import encode_prompts


@dataclass(frozen=True)
class Encoded:
    """One tokenised example: prompt ids, response ids, and the loss mask over the response ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def prompt_ids(tokenizer, prompt: str, messages: list[dict] | None, chat: bool) -> list[int]:
    """The prompt's token ids: a conversation (`messages`) through the chat template with the
    generation prompt; a plain prompt as `encode_prompts` gives it (with `chat`, one user message)."""
    if messages is not None and (len(messages) != 1 or messages[0].get("role") != "user" or not chat):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("a conversation row (messages) needs a chat template, and this model's tokenizer has "
                             "none: give prompt/response rows, or a model with a chat template")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return encode_prompts(tokenizer, [prompt if messages is None else messages[0]["content"]], chat)[0]


def response_ids(tokenizer, response: str) -> list[int]:
    """The response's token ids with the EOS appended."""
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def encode_demonstration(tokenizer, prompt: str, messages: list[dict] | None, response: str, *, chat: bool,
                         prompt_loss: bool = False) -> Encoded:
    """A demonstration's tokens; the loss covers the response (and its EOS), or with `prompt_loss`
    every token after the first (the whole sequence is laid out as response then)."""
    p, r = prompt_ids(tokenizer, prompt, messages, chat), response_ids(tokenizer, response)
    if prompt_loss:
        whole = p + r
        return Encoded(whole[:1], whole[1:], [1] * (len(whole) - 1))
    return Encoded(p, r, [1] * len(r))


def encode_pair(tokenizer, prompt: str, messages: list[dict] | None, chosen: str, rejected: str, *,
                chat: bool) -> tuple[Encoded, Encoded]:
    """A preference pair's two sequences (same prompt ids), the loss over each response."""
    p = prompt_ids(tokenizer, prompt, messages, chat)
    c, r = response_ids(tokenizer, chosen), response_ids(tokenizer, rejected)
    return Encoded(p, c, [1] * len(c)), Encoded(p, r, [1] * len(r))


def batch_of(examples: list[Encoded], pad_id: int) -> TokenBatch:
    """The examples as one left-padded prompt / right-padded response batch."""
    return collate([e.prompt_ids for e in examples], [e.response_ids for e in examples], pad_id,
                   [e.loss_mask for e in examples])


def sft_update(engine, batch: TokenBatch, *, mini_batch_size: int, max_tokens_per_micro_batch: int,
               seed: int = 0) -> dict[str, float]:
    """Optimizer steps of `engine` (a TorchTrainEngine) on `batch`, one per `mini_batch_size` rows:
    the mean negative log-likelihood of the masked tokens of the mini-batch (token mean, as TRL's
    SFTTrainer and torchtune). Returns `sft/loss` (mean over steps), `sft/tokens`, grad norm, LR."""
    def micro_loss(sub, idx, t, num_tokens, num_seqs, ran):
        logp, _ = response_logprobs(engine.module, sub, autocast_dtype=engine.autocast_dtype,
                                    shared_prefix=engine.shared_prefix)
        nll = -(logp * sub.response_mask).sum()
        loss = nll / max(num_tokens, 1.0)
        return loss, {"sft/loss": float(loss.detach())}

    metrics, n, grad_norm, tokens, _ = _run(engine, batch, mini_batch_size, max_tokens_per_micro_batch, seed, micro_loss)
    return {**metrics, "sft/grad_norm": grad_norm, "sft/lr": engine.scheduler.get_last_lr()[0], "sft/updates": float(n),
            "sft/tokens": float(batch.response_mask.sum()), "sft/padded_tokens": tokens}


def _run(engine, batch, mini_batch_size, max_tokens, seed, micro_loss, unit: int = 1):
    """`engine._updates` for one pass, the loss key summed over micro-batches (it is each one's share)."""
    return engine._updates(batch, 1, mini_batch_size, max_tokens, seed, micro_loss, unit=unit,
                           share_metrics=frozenset({"sft/loss", "dpo/loss"}))


@torch.no_grad()
def token_nll(model, batch: TokenBatch, max_tokens: int) -> tuple[float, float]:
    """(summed negative log-likelihood, tokens) of `batch`'s masked tokens under `model`, in chunks of
    about `max_tokens` padded tokens: the eval loss is their ratio."""
    was = model.training
    model.eval()
    rows = max(1, max_tokens // max(1, batch.input_ids.shape[1]))
    nll = count = 0.0
    for i in range(0, batch.input_ids.shape[0], rows):
        sub = batch.select(slice(i, i + rows))
        logp, _ = response_logprobs(model, sub, shared_prefix=False)
        nll -= float((logp * sub.response_mask).sum())
        count += float(sub.response_mask.sum())
    model.train(was)
    return nll, count


def pair_batch(pairs: list[tuple[Encoded, Encoded]], pad_id: int) -> TokenBatch:
    """Pairs as rows chosen_0, rejected_0, chosen_1, ... (units of two)."""
    return batch_of([e for pair in pairs for e in pair], pad_id)


def sequence_sums(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed [B], token-mean [B]) of per-token log-probs over the mask."""
    summed = (logp * mask).sum(-1)
    return summed, summed / mask.sum(-1).clamp(min=1)


@torch.no_grad()
def reference_sequence_logps(model, batch: TokenBatch, max_tokens: int) -> tuple[list[float], list[float]]:
    """(summed, token-mean) response log-probs of every row of `batch` under a frozen `model`."""
    model.eval()
    rows = max(1, max_tokens // max(1, batch.input_ids.shape[1]))
    sums, means = [], []
    for i in range(0, batch.input_ids.shape[0], rows):
        sub = batch.select(slice(i, i + rows))
        logp, _ = response_logprobs(model, sub, shared_prefix=False)
        s, m = sequence_sums(logp, sub.response_mask)
        sums += s.tolist()
        means += m.tolist()
    return sums, means


def preference_update(engine, batch: TokenBatch, ref_sum: torch.Tensor, ref_mean: torch.Tensor, *, loss: str,
                      beta: float, label_smoothing: float = 0.0, mini_batch_size: int, max_tokens_per_micro_batch: int,
                      seed: int = 0) -> dict[str, float]:
    """Optimizer steps on preference pairs (`batch` from `pair_batch`, `ref_sum` / `ref_mean` [2N] the
    reference's summed and token-mean log-probs of its rows), one per `mini_batch_size` pairs, with the
    preference loss `loss` (engines/algorithms/preference.py: `ipo` on token-mean log-probs, the others
    on sums), averaged over the mini-batch's pairs. Returns `dpo/loss` and TRL's `rewards/*` and
    `logps/*` (means over steps), grad norm, LR."""
    fn = get_preference_loss(loss)
    use_mean = loss == "ipo"
    ref = ref_mean if use_mean else ref_sum

    def micro_loss(sub, idx, t, num_tokens, num_seqs, ran):
        logp, _ = response_logprobs(engine.module, sub, autocast_dtype=engine.autocast_dtype,
                                    shared_prefix=engine.shared_prefix)
        summed, mean = sequence_sums(logp, sub.response_mask)
        pol = (mean if use_mean else summed).view(-1, 2)
        r = ref[idx].to(pol.device).view(-1, 2)
        losses, _ = fn(pol[:, 0], pol[:, 1], r[:, 0], r[:, 1], beta=beta, label_smoothing=label_smoothing)
        pairs_in_mini = num_seqs / 2   # every row has response tokens (refused before otherwise)
        out = losses.sum() / max(pairs_in_mini, 1.0)
        m = preference_metrics(summed.view(-1, 2)[:, 0], summed.view(-1, 2)[:, 1], ref_sum[idx].view(-1, 2)[:, 0],
                               ref_sum[idx].view(-1, 2)[:, 1], beta=beta)
        m["dpo/loss"] = float(out.detach())
        return out, m

    metrics, n, grad_norm, tokens, _ = _run(engine, batch, mini_batch_size, max_tokens_per_micro_batch, seed, micro_loss,
                                            unit=2)
    return {**metrics, "dpo/grad_norm": grad_norm, "dpo/lr": engine.scheduler.get_last_lr()[0], "dpo/updates": float(n),
            "dpo/padded_tokens": tokens}


@torch.no_grad()
def preference_eval(model, batch: TokenBatch, ref_sum: torch.Tensor, ref_mean: torch.Tensor, max_tokens: int, *,
                    loss: str, beta: float, label_smoothing: float = 0.0) -> dict[str, float]:
    """The preference loss and TRL's reward metrics of held-out pairs (`pair_batch`) under `model`, as
    `eval/dpo_loss`, `eval/rewards/accuracies`, `eval/rewards/margins`, `eval/rewards/chosen`, `eval/rewards/rejected`."""
    summed, mean = (torch.tensor(x) for x in reference_sequence_logps(model, batch, max_tokens))
    use_mean = loss == "ipo"
    pol, ref = (mean, ref_mean) if use_mean else (summed, ref_sum)
    losses, _ = get_preference_loss(loss)(pol[0::2], pol[1::2], ref[0::2], ref[1::2], beta=beta,
                                          label_smoothing=label_smoothing)
    m = preference_metrics(summed[0::2], summed[1::2], ref_sum[0::2], ref_sum[1::2], beta=beta)
    return {"eval/dpo_loss": float(losses.mean()), **{f"eval/{k}": v for k, v in m.items() if k.startswith("rewards/")}}


# --- distillation on a teacher's top-k (engines/algorithms/distill.py) ---------------------------
def _student_logits(engine_or_model, sub: TokenBatch, autocast_dtype=None, shared_prefix: bool = False) -> torch.Tensor:
    from engines.models.batching import response_logits
    from engines.models.devices import mixed_precision

    with mixed_precision(sub.input_ids.device, autocast_dtype):
        logits = response_logits(engine_or_model, sub, shared_prefix)
    return logits.float()                                                     # [b, t, V]


@torch.no_grad()
def teacher_topk(model, batch: TokenBatch, k: int, max_tokens: int) -> list[tuple[list[list[int]], list[list[float]]]]:
    """The teacher's k most likely next tokens and their log-probs (temperature 1) at each response
    position of every row of `batch`: per row (ids [n][k], log-probs [n][k]), n its response length."""
    model.eval()
    rows = max(1, max_tokens // max(1, batch.input_ids.shape[1]))
    out = []
    for i in range(0, batch.input_ids.shape[0], rows):
        sub = batch.select(slice(i, i + rows))
        logps = torch.log_softmax(_student_logits(model, sub), dim=-1)        # [b, t, V]
        values, ids = logps.topk(min(k, logps.shape[-1]), dim=-1)             # [b, t, k]
        n = sub.attention_mask[:, sub.prompt_width:].sum(-1).tolist()
        out += [(ids[j, :n[j]].tolist(), values[j, :n[j]].tolist()) for j in range(len(n))]
    return out


def topk_tensors(rows: list[tuple[list, list]], width: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row teacher top-k (from `teacher_topk`) as [B, width, k] ids and log-probs, padded past each
    row's response with ids 0..k−1 and log-prob 0 (finite: a masked position's divergence is computed
    and multiplied by 0)."""
    ids = torch.arange(k).expand(len(rows), width, k).clone()
    logps = torch.zeros(len(rows), width, k)
    for i, (row_ids, row_logps) in enumerate(rows):
        if row_ids:
            ids[i, :len(row_ids)] = torch.tensor(row_ids)
            logps[i, :len(row_logps)] = torch.tensor(row_logps)
    return ids, logps


def distill_update(engine, batch: TokenBatch, topk_ids: torch.Tensor, topk_logps: torch.Tensor, *, divergence: str,
                   divergence_weight: float, student_temperature: float = 1.0, teacher_temperature: float = 1.0,
                   options: dict | None = None, mini_batch_size: int, max_tokens_per_micro_batch: int,
                   seed: int = 0) -> dict[str, float]:
    """Optimizer steps on demonstrations `batch` against the teacher's top-k (`topk_tensors`, aligned with
    the response tokens): loss = w·D + (1 − w)·S per token mean over the mini-batch (engines/algorithms/distill.py
    `distill_loss`: D the divergence on the top-k, S the SFT NLL of the demonstration). Returns
    `distill/loss`, `distill/divergence`, `distill/sft_nll` (means over steps), grad norm, LR."""
    from engines.algorithms.distill import distill_loss, sft_token_nll, topk_token_divergence

    def micro_loss(sub, idx, t, num_tokens, num_seqs, ran):
        logits = _student_logits(engine.module, sub, engine.autocast_dtype, engine.shared_prefix)
        div = topk_token_divergence(logits, topk_ids[idx, :t].to(logits.device), topk_logps[idx, :t].to(logits.device),
                                    divergence=divergence, student_temperature=student_temperature,
                                    teacher_temperature=teacher_temperature, **(options or {}))
        nll = sft_token_nll(logits, sub.responses) if divergence_weight < 1.0 else None
        return distill_loss(div, sub.response_mask, token_nll=nll, distill_loss_weight=divergence_weight,
                            num_tokens=num_tokens)

    metrics, n, grad_norm, tokens, _ = engine._updates(
        batch, 1, mini_batch_size, max_tokens_per_micro_batch, seed, micro_loss,
        share_metrics=frozenset({"distill/loss", "distill/divergence", "distill/sft_nll"}))
    return {**metrics, "distill/grad_norm": grad_norm, "distill/lr": engine.scheduler.get_last_lr()[0],
            "distill/updates": float(n), "distill/padded_tokens": tokens}


@torch.no_grad()
def distill_eval(model, batch: TokenBatch, topk_ids: torch.Tensor, topk_logps: torch.Tensor, max_tokens: int, *,
                 divergence: str, student_temperature: float = 1.0, teacher_temperature: float = 1.0,
                 options: dict | None = None) -> dict[str, float]:
    """Held-out `eval/loss` (the student's token-mean NLL of the demonstrations) and `eval/divergence`
    (token mean of the divergence to the teacher's top-k)."""
    from engines.algorithms.distill import sft_token_nll, topk_token_divergence

    model.eval()
    rows = max(1, max_tokens // max(1, batch.input_ids.shape[1]))
    nll = div = count = 0.0
    for i in range(0, batch.input_ids.shape[0], rows):
        sub = batch.select(slice(i, i + rows))
        t = sub.responses.shape[1]
        logits = _student_logits(model, sub)
        mask = sub.response_mask
        d = topk_token_divergence(logits, topk_ids[i:i + rows, :t], topk_logps[i:i + rows, :t], divergence=divergence,
                                  student_temperature=student_temperature, teacher_temperature=teacher_temperature,
                                  **(options or {}))
        div += float((d * mask).sum())
        nll += float((sft_token_nll(logits, sub.responses) * mask).sum())
        count += float(mask.sum())
    return {"eval/loss": nll / max(count, 1.0), "eval/divergence": div / max(count, 1.0)}

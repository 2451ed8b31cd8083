# longer than 400 lines: the engine Protocol and the HF engine with the logits processors only it uses
"""Generation engines behind one small Protocol.

`hf` (transformers `generate`, KV cache, batched, left padding) is the embedded default and runs
anywhere. With n > 1 samples per prompt it prefills each prompt once and hands `generate` the
cache repeated n times (transformers' own `num_return_sequences` would run the prompt n times).
It samples by inverse CDF (`InverseCDFSampler`): one uniform per row instead of transformers'
`torch.multinomial`, which draws an exponential per vocabulary entry (70 ms a step for 64 rows x
49k tokens on two cores, a quarter of SmolLM2's rollout). An engine takes token ids in and gives
token ids + per-token behaviour log-probs out, so the training sequence is exactly what the policy
produced (no re-tokenisation drift).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                      # samples per prompt (G)
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()      # stop strings, in addition to EOS
    seed: int | None = None


@dataclass
class Completion:
    prompt_index: int               # which prompt of the batch
    sample_index: int               # 0..n-1
    token_ids: list[int]            # response tokens, EOS included when generated
    logprobs: list[float]           # behaviour log-prob of each token, under the sampling distribution
    finish_reason: str              # "stop" (EOS or stop string) | "length" | "abort" (cut by an abort event)
    text: str = field(default="")


class GenerationEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 abort: threading.Event | None = None) -> list[Completion]: ...  # abort: stop early once set

    def load_weights(self, model_dir: str) -> None: ...

    # Sleep / wake (both engines): `sleep(1)` frees what the engine caches between calls (the KV cache
    # and generation buffers) and keeps the weights; `sleep(2)` frees the weights too. `wake_up(tags)`
    # brings back "weights" and/or "kv_cache" (None: both). Weights woken after `sleep(2)` hold no
    # policy until an update fills them (`update_weights` / `load_weights`); `generate` refuses until then.
    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


def check_sleep_level(level: int, engine: str) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"{engine}.sleep(level={level!r}): expected 1 (free the KV cache) or 2 (free the weights too)")


def check_wake_tags(tags, engine: str) -> tuple[str, ...]:
    """`tags` as a tuple, in WAKE_TAGS; None = every tag."""
    tags = WAKE_TAGS if tags is None else tuple(tags)
    bad = [t for t in tags if t not in WAKE_TAGS]
    if bad or not tags:
        raise ValueError(f"{engine}.wake_up(tags={list(tags)!r}): expected a non-empty subset of {list(WAKE_TAGS)}")
    return tags


class AbortOnEvent(StoppingCriteria):
    """Stops every row of a `generate` call once `event` is set, checked between decode steps, so an
    aborted request frees its engine after at most one more step (engines/generation/scheduler.py aborts the
    requests it no longer needs this way)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class InverseCDFSampler(LogitsProcessor):
    """Draws each row's next token from softmax(scores) with one uniform (a cumulative sum and a
    binary search) and returns scores that are 0 at the drawn token and -inf elsewhere, so greedy
    decoding emits it. Put it last, after the temperature / top-k / top-p warpers; the draws come
    from torch's global generator (seeded by `SamplingParams.seed`). The float32 sum is exact to
    ~1e-7 per token interval (float64 would cost 10 ms a step at 64 x 49k). With a `recorder` it
    also records each row's log-prob of its drawn token (`StepLogprobs.record`)."""

    def __init__(self, recorder: "StepLogprobs | None" = None):
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        cdf = torch.softmax(scores.float(), dim=-1).cumsum_(-1)                            # [B, V]
        u = torch.rand(cdf.shape[0], 1, device=cdf.device) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)     # first cdf > u
        if self.recorder is not None:
            self.recorder.record(scores, token)
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


class StepLogprobs(LogitsProcessor):
    """The behaviour log-probs of a `generate` call, one [B] column per step, without keeping any
    step's [B, V] logits (`output_logits` would hold B x T x V floats: 12.9 GB for 64 rows x 1024
    tokens x 49k). As a processor it notes the log-normaliser of the scores it sees and passes them
    on unchanged; put it right after the temperature warper, so the log-prob is log softmax(logits /
    temperature) of the token (the distribution training recomputes; top-k / top-p only mask
    entries, so the drawn token's score is the same after them). The draw calls `record` with the
    chosen tokens: `InverseCDFSampler(recorder)` when sampling, `GreedyDraw(recorder)` when greedy.
    (Processors that transformers would add from a model's own generation config run before this
    one; the engine generates under `policy_only_generation_config`, so there are none.)"""

    def __init__(self):
        self.columns: list[torch.Tensor] = []
        self._lse: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._lse = torch.logsumexp(scores.float(), dim=-1, keepdim=True)               # [B, 1]
        return scores

    def record(self, scores: torch.Tensor, token: torch.Tensor) -> None:
        """Log-prob of `token` [B, 1] given this step's `scores` [B, V] (the draw's input)."""
        self.columns.append((scores.gather(1, token).float() - self._lse).squeeze(1))

    def stacked(self, steps: int) -> torch.Tensor:
        """[B, steps] log-probs of the first `steps` generated tokens."""
        return torch.stack(self.columns[:steps], dim=1)


class GreedyDraw(LogitsProcessor):
    """Greedy decoding's last processor: records the log-prob of each row's argmax token and
    returns the scores unchanged (so `generate` picks the same token)."""

    def __init__(self, recorder: StepLogprobs):
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.recorder.record(scores, scores.argmax(-1, keepdim=True))
        return scores


def sampling_processors(params: SamplingParams, recorder: StepLogprobs | None = None) -> LogitsProcessorList:
    """transformers' own warpers for temperature, top-k and top-p, then the inverse-CDF draw; with a
    `recorder`, it notes the normaliser after the temperature and the draw records the log-probs
    (greedy: the recorder and `GreedyDraw` only)."""
    if params.temperature <= 0:
        return LogitsProcessorList([recorder, GreedyDraw(recorder)] if recorder is not None else [])
    warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    if recorder is not None:
        warpers.append(recorder)
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return LogitsProcessorList([*warpers, InverseCDFSampler(recorder)])


@contextlib.contextmanager
def policy_only_generation_config(model):
    """While generating, `model.generation_config` holds only its special-token ids. transformers
    fills every generation setting a call leaves unset from the model's own generation config, and
    some add logits processors that change the distribution even in greedy decoding (Qwen2.5-Instruct
    ships `repetition_penalty: 1.05`), so rollouts would not be samples of the policy that training
    scores. The engine's distribution is its `SamplingParams` only, as with vLLM given explicit
    sampling params."""
    own = model.generation_config
    ids = {k: getattr(own, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")}
    model.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
    try:
        yield
    finally:
        model.generation_config = own


CACHE_BUCKET = 128  # compiled decode: static-cache lengths rounded up to a multiple of this
PACK_MIN_NEW_TOKENS = 8  # packing SmolLM2's linears costs ~0.2 s, what ~7 decode steps save


@functools.cache
def mkl_packing_available() -> bool:
    """torch's MKL packed-GEMM ops (the ones inductor's CPU freezing uses) are in this build."""
    try:
        return torch.backends.mkl.is_available() and callable(torch.ops.mkl._mkl_linear) and callable(torch.ops.mkl._mkl_reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


def _packed_linear(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)  # plain F.linear when x has another row count


@contextlib.contextmanager
def packed_decode_linears(model, rows: int, cache: dict):
    """While decoding `rows` sequences on CPU, every float32 `nn.Linear` of `model` multiplies with
    its weight in MKL's packed layout (`cblas_sgemm_pack`, packed for exactly `rows` rows): a decode
    step runs the same weights on the same small row count 30 layers x max_new_tokens times, and MKL
    packs an unpacked weight on every call. SmolLM2, 64 rows: the MLP's GEMM 700 -> 370 us, the LM
    head 20 -> 16 ms, ~30 ms of a 190 ms decode step. The products equal plain `F.linear`'s to float
    rounding (bitwise in a microbenchmark; in SmolLM2's rollout the recorded log-probs then matched
    the training forward exactly, where the plain small-row kernel's differ by ~2e-5). A call with
    another row count (the prefill) is plain `F.linear`. `cache` holds each module's packed weight
    and the row count it was packed for, for its owner's lifetime (the engine's: one `generate`
    call, so its chunks share it and no copy outlives the weights it was made from); a chunk with
    another row count repacks. The modules' own `forward` comes back on exit."""
    patched = []
    try:
        for module in model.modules():
            w = module.weight if type(module) is torch.nn.Linear else None
            if w is None or w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            if cache.get(module, (None,))[0] != rows:
                cache.pop(module, None)  # the other row count's copy goes before the new one is made
                cache[module] = (rows, torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows))
            module.forward = functools.partial(_packed_linear, cache[module][1], w, module.bias, rows)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


class HFGenerationEngine:
    """transformers `generate` on one process; `micro_batch` prompts × n samples per call.

    `compile_decode`: transformers' compiled decode (torch.compile, CUDA graphs) over the static KV
    cache of group sampling (n > 1 with `shared_prefill`). transformers compiles on GPUs only, so it
    changes nothing on CPU. Each new shape (rows, cache length rounded up to CACHE_BUCKET) compiles
    once: ~25-30 s for Qwen2.5-0.5B's shape on an H200, then decode ran 3.9x faster there
    (docs/benchmarks.md, GPU section).

    `pack_weights` (off by default): on CPU, decode with MKL-packed float32 weights
    (`packed_decode_linears`) when a call generates at least PACK_MIN_NEW_TOKENS tokens. The packed
    copies live for one `generate` call (shared by its chunks of the same row count): one more copy
    of the linear weights while decoding (+540 MB for SmolLM2), nothing kept between calls. SmolLM2's
    8 x 8 x 32-token rollout took 5.54 -> 4.77 s with it, but in `flyroll bench`'s step (new weights
    every step, memory handed back between steps) the rollout gained 0.55 s and the update that
    followed lost ~0.8 s, for a reason not yet found (docs/engines.md)."""

    def __init__(self, model, tokenizer, micro_batch: int = 64, shared_prefill: bool = True, compile_decode: bool = False,
                 pack_weights: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.micro_batch = micro_batch
        self.shared_prefill = shared_prefill
        self.compile_decode = compile_decode
        self.pack_weights = pack_weights
        self.version: int | None = None   # the policy version served, set by whoever updates the weights
        self.torn: str | None = None      # a partial update (a live sync cut short): generate refuses
        self.asleep: set[str] = set()     # what `sleep` freed and no `wake_up` brought back: "weights", "kv_cache"
        self.unfilled = False             # weights woken after sleep(2), no update since: generate refuses
        self._shapes: dict[torch.nn.Parameter, tuple[torch.Size, torch.dtype, torch.device]] = {}

    def sleep(self, level: int = 1) -> None:
        """Free memory until the next rollout (a colocated trainer needs it meanwhile).

        Level 1: the KV cache and generation buffers. This engine keeps none between calls (each
        `generate` builds its cache and packed weights and drops them when it returns), but the
        allocator keeps their blocks: CUDA's caching allocator, or on CPU glibc's heap, which
        engines/models/host_memory.py tells to keep freed memory. Level 1 hands those back to the device /
        the OS (`torch.cuda.empty_cache`, `malloc_trim`). Level 2 also frees every parameter's
        storage (each parameter then holds an empty tensor; buffers, a few KB of rotary tables,
        stay), so the engine holds no policy until `wake_up(["weights"])` and an update."""
        check_sleep_level(level, "HFGenerationEngine")
        if level == 2 and "weights" not in self.asleep:
            for p in self.model.parameters():  # tied weights are one Parameter, freed once
                self._shapes[p] = (p.shape, p.dtype, p.device)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.asleep.add("weights")
            self.version, self.unfilled = None, False
        self.asleep.add("kv_cache")
        from engines.models.host_memory import release_allocator_caches

        release_allocator_caches()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` freed, in stages: `["weights"]` allocates every parameter again
        (uninitialised: the engine refuses to generate until `update_weights`/`load_weights` fills
        them), `["kv_cache"]` lets `generate` build its cache again (nothing to allocate ahead here).
        None: both. Waking what is not asleep does nothing."""
        tags = check_wake_tags(tags, "HFGenerationEngine")
        if "weights" in tags and "weights" in self.asleep:
            for p, (shape, dtype, device) in self._shapes.items():
                p.data = torch.empty(shape, dtype=dtype, device=device)
            self._shapes.clear()
            self.asleep.discard("weights")
            self.unfilled = True
        if "kv_cache" in tags:
            self.asleep.discard("kv_cache")

    def load_weights(self, model_dir: str, version: int | None = None) -> None:
        """In-place weight update from a model directory (same architecture), no engine restart.
        `version`: the policy version the directory holds (reported by `self.version`)."""
        from safetensors.torch import load_file
        import glob
        import os

        state = {}
        for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
            state.update(load_file(f))
        self.update_weights(list(state.items()), source=model_dir)
        self.finish_weight_update(version)

    @torch.no_grad()
    def update_weights(self, named_tensors, source: str = "the given tensors", partial: bool = False,
                       version: int | None = None) -> None:
        """In-place weight update from (name, tensor) pairs in memory, e.g. a trainer's
        `named_parameters()` in the same process (a colocated trainer and generator): one copy per
        tensor (dtype and device converted), no files, no engine restart. Every weight of the
        engine's model must be given (a tied LM head may be left out), under the same names; they
        are all checked before the first copy, so a refused update leaves the weights as they were.

        `partial=True` (a live sync's bucket, engines/weight_sync/update_group.py): `named_tensors` is consumed one
        pair at a time (views into the bucket buffer: nothing else is copied), each checked before its
        copy, and the engine is marked torn (`generate` refuses, `version` is None) until
        `finish_weight_update(version)` says every bucket arrived. A full update serves `version`."""
        if "weights" in self.asleep:
            raise RuntimeError(f"HFGenerationEngine is asleep with its weights freed (sleep(2)); wake_up(['weights']) "
                               f"before updating them from {source}")
        own = self.model.state_dict()
        if partial:
            self.torn, self.version = source, None
            for name, tensor in named_tensors:
                if name not in own or own[name].shape != tensor.shape:
                    raise ValueError(f"weights in {source} do not match the engine's model: "
                                     f"{name} {tuple(tensor.shape)} != {tuple(own[name].shape) if name in own else 'not in the model'}")
                own[name].copy_(tensor)
            return
        pairs = list(named_tensors)
        unexpected = [name if name not in own else f"{name} {tuple(t.shape)} != {tuple(own[name].shape)}"
                      for name, t in pairs if name not in own or own[name].shape != t.shape]
        given = {name for name, _ in pairs}
        missing = [k for k in own if k not in given and not k.endswith("lm_head.weight")]  # tied embeddings
        if missing or unexpected:  # checked first: a refused update leaves the engine's weights as they were
            raise ValueError(f"weights in {source} do not match the engine's model: missing={missing[:5]} unexpected={unexpected[:5]}")
        for name, tensor in pairs:
            own[name].copy_(tensor)
        self.finish_weight_update(version)

    def finish_weight_update(self, version: int | None) -> None:
        """Every weight of `version` is in place: serve it (clears a partial update's mark, and the
        mark of weights woken from sleep(2) and not yet filled)."""
        self.torn, self.version, self.unfilled = None, version, False

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """name -> (shape, required) of every weight an update may give; a tied LM head is not required."""
        if "weights" in self.asleep:
            raise RuntimeError("HFGenerationEngine is asleep with its weights freed (sleep(2)); wake_up(['weights']) first")
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        tied = head is not None and head.weight is embed.weight
        return {k: (tuple(t.shape), not (tied and k.endswith("lm_head.weight"))) for k, t in self.model.state_dict().items()}

    def weight_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 abort: threading.Event | None = None) -> list[Completion]:
        """Completions of every prompt. `abort`: once set (from another thread), decoding stops after the
        current step and the micro-batches not started are skipped; the rows cut short end with
        finish_reason "abort" (the caller discards them). An engine left with a partial weight update
        (a live sync cut short) refuses: it would serve a mix of two policies."""
        if self.torn:
            raise RuntimeError(f"HFGenerationEngine holds a partial weight update (last: {self.torn}); it serves no "
                               "policy until a full update (a new sync, or load_weights of the last good version)")
        if "weights" in self.asleep or self.unfilled:
            raise RuntimeError("HFGenerationEngine holds no weights to generate from: they were freed by sleep(2)"
                               + (" and woken but not filled" if self.unfilled else "") + "; wake_up(['weights']) "
                               "then fill them (a live sync's update_weights, or load_weights from the store)")
        self.asleep.discard("kv_cache")  # a call builds its own cache: generating wakes it
        out: list[Completion] = []
        packed: dict = {}  # MKL-packed weights for this call's chunks; freed when it returns
        for start in range(0, len(prompt_token_ids), self.micro_batch):
            if abort is not None and abort.is_set():
                break
            chunk = prompt_token_ids[start : start + self.micro_batch]
            out.extend(self._generate_chunk(chunk, params, offset=start, packed=packed, abort=abort))
        return out

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, offset: int, packed: dict,
                        abort: threading.Event | None = None) -> list[Completion]:
        tok = self.tokenizer
        pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(self.model.device), attention.to(self.model.device)
        n_return, cache = params.n, {}
        if params.n > 1 and self.shared_prefill and width > 1:
            cache = self._prefill(input_ids[:, :-1], attention[:, :-1], params.n, params.max_new_tokens)  # generate runs the last token
        if cache or params.n > 1:  # (transformers refuses num_return_sequences > 1 in greedy decoding)
            input_ids = input_ids.repeat_interleave(params.n, dim=0)
            attention = attention.repeat_interleave(params.n, dim=0)
            n_return = 1
        if params.seed is not None:
            torch.manual_seed(params.seed + offset)
        recorder = StepLogprobs()
        packing = contextlib.nullcontext()
        if (self.pack_weights and params.max_new_tokens >= PACK_MIN_NEW_TOKENS and self.model.device.type == "cpu"
                and mkl_packing_available()):
            packing = packed_decode_linears(self.model, input_ids.shape[0], packed)
        with policy_only_generation_config(self.model), packing:
            seqs = self.model.generate(
                **cache,
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=False,  # greedy over the sampler's output when sampling
                logits_processor=sampling_processors(params, recorder),
                temperature=None, top_p=None, top_k=None,
                max_new_tokens=params.max_new_tokens,
                num_return_sequences=n_return,
                pad_token_id=pad_id,
                eos_token_id=eos_id,
                stop_strings=list(params.stop) or None,
                tokenizer=tok if params.stop else None,
                disable_compile=not self.compile_decode,  # (else transformers compiles the forward on GPUs for a static cache)
                stopping_criteria=StoppingCriteriaList([AbortOnEvent(abort)]) if abort is not None else None,
            )[:, width:]                                                      # [B*n, T]
        logp = recorder.stacked(seqs.shape[1])                                # [B*n, T]
        completions = []
        for row in range(seqs.shape[0]):
            ids = seqs[row].tolist()
            finish, end = "length", len(ids)
            if eos_id in ids:
                end, finish = ids.index(eos_id) + 1, "stop"
            if params.stop:  # a stop string ends the response at the token that completed it
                for k in range(1, end + 1):
                    if any(s in tok.decode(ids[:k], skip_special_tokens=True) for s in params.stop):
                        end, finish = k, "stop"
                        break
            if finish == "length" and end < params.max_new_tokens and abort is not None and abort.is_set():
                finish = "abort"
            text = tok.decode(ids[:end], skip_special_tokens=True)
            completions.append(
                Completion(
                    prompt_index=offset + row // params.n,
                    sample_index=row % params.n,
                    token_ids=ids[:end],
                    logprobs=logp[row, :end].tolist(),
                    finish_reason=finish,
                    text=text,
                )
            )
        return completions

    def _prefill(self, input_ids: torch.Tensor, attention: torch.Tensor, n: int, max_new_tokens: int) -> dict:
        """{cache keyword: a static KV cache holding the prompts' first width-1 tokens, each row
        repeated n times, with room for the last prompt token and `max_new_tokens` more}. Static: a
        dynamic cache concatenates every layer's keys and values at each step (0.7 s of SmolLM2's
        8 x 8 x 32-token rollout on two cores)."""
        from transformers import StaticCache

        from engines.models.batching import prefill

        _, arg, prompt_cache = prefill(self.model, input_ids, attention)
        length = input_ids.shape[1] + 1 + max_new_tokens
        if self.compile_decode:  # prompt widths of one bucket share a compiled graph
            length = -(-length // CACHE_BUCKET) * CACHE_BUCKET
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        for i, layer in enumerate(prompt_cache.layers):
            cache.update(layer.keys.repeat_interleave(n, dim=0), layer.values.repeat_interleave(n, dim=0), i)
        return {arg: cache}

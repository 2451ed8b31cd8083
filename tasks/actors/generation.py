"""The generation actor: `GenerationWorker` hosts a generation engine (HF or vLLM) inside a stage's Ray cluster.

Each actor holds one engine and the policy version it has loaded; asked for another version it
updates its weights in place (no restart). On a local run the actors are named per run and reused
by every task (see infra/ray_session.py); on a cluster they live as long as the task's Ray cluster.
"""

from __future__ import annotations

import os
import threading

import ray

from tasks.actors.process import actor_threads, engine_process, placed
from tasks.actors.sync_roles import GroupMember

# Everything else is imported inside the actor's methods, on purpose: an actor's process sets its torch
# threads (`engine_process`) before torch and the engines load, and a driver importing this module
# (to create the actor) loads none of them.


def generation_worker_kwargs(cfg) -> dict:
    """GenerationWorker's constructor arguments from a FlyrollConfig (the same for every task that
    creates the run's generation actors)."""
    from infra.resources import role_devices

    r, devices = cfg.rollout, role_devices(cfg, "actor_infer")
    return {"threads": actor_threads(cfg), "micro_batch": r.micro_batch, "engine": r.engine, "compile_decode": r.hf_compile_decode,
            "pack_weights": r.hf_pack_weights, "devices": devices,
            "vllm_options": {"kv_cache_gb": r.vllm_kv_cache_gb, "seed": cfg.run.seed, "dtype": devices["actor_infer"][1]}
            if r.engine == "vllm" else {}}


@ray.remote(concurrency_groups={"abort": 1, "stream": 4})
class GenerationWorker:
    """A generation engine (config `rollout.engine`: `hf` or `vllm`) for rollouts and evaluation.

    vLLM runs its engine core inside this actor (VLLM_ENABLE_V1_MULTIPROCESSING=0: no process outside
    Ray's accounting) and gets the tokenizer every other stage loads, so prompt token ids agree.

    Every method runs one at a time, in call order, except `abort`, which has its own concurrency
    group so it reaches a `generate` call that is running: the engine then stops after its current
    decode step (HF: stops the batch; vLLM: aborts the call's requests in its engine, KV blocks freed;
    rows cut short end with finish_reason "abort"), and the actor is free for the next call at once
    instead of after the whole discarded chunk.

    With a continuous-batching engine (vLLM) the agentic rollout opens a request stream
    (`stream_open` .. `stream_close`, engines/generation/request_stream.py): single requests by id, in the
    `stream` concurrency group, batched by the engine step by step; while it is open, every method
    that would use the engine directly refuses."""

    def __init__(self, threads: int = 1, micro_batch: int = 256, engine: str = "hf", vllm_options: dict | None = None,
                 compile_decode: bool = False, pack_weights: bool = False, devices: dict | None = None):
        """`devices`: {"actor_infer": (device, dtype)} (hf: the weights are cast to the dtype and moved
        to the device; vllm gets the dtype through `vllm_options`); None = cpu, float32."""
        engine_process(threads)
        self.devices = devices
        self.engine, self.tokenizer, self.key, self.micro_batch = None, None, None, micro_batch
        self.compile_decode, self.pack_weights = compile_decode, pack_weights
        self.engine_name, self.vllm_options = engine, dict(vllm_options or {})
        self.aborts: dict[str, threading.Event] = {}  # request id -> its abort event, while it may still run
        # called with i after bucket i of a live sync is applied (engines/weight_sync/update_group.py `receive`): None in
        # a run; tests/tasks/loop/test_live_sync.py sets it to stop this actor in the middle of a sync
        self.on_bucket = None
        self.stream = None   # engines/generation/request_stream.py RequestStream, while the agentic rollout has one open
        self.sync = GroupMember()  # its place in a model update group (tasks/loop/live_sync.py)

    def _engine_free(self, what: str) -> None:
        if self.stream is not None:
            raise RuntimeError(f"generation actor {ray.get_runtime_context().get_actor_name()}: {what} while a request "
                               "stream is open (the agentic rollout's; it owns the engine until stream_close)")

    def can_stream(self) -> bool:
        """Whether the engine takes single requests into a running batch (a `StreamingEngine`: vLLM)."""
        from engines.generation.router import is_streaming

        return self.engine is not None and is_streaming(self.engine)

    def stream_open(self) -> int:
        """Open the request stream over the engine; returns the policy version its requests are tagged with."""
        from engines.generation.request_stream import RequestStream

        self._engine_free("stream_open")
        if not self.can_stream():
            raise ValueError(f"generation actor {ray.get_runtime_context().get_actor_name()}: engine {self.engine_name!r} "
                             "takes no single requests (hf batches whole calls: the caller's BatchingRouter)")
        self.stream = RequestStream(self.engine, policy_version=self.engine.version,
                                    name=f"generation actor {ray.get_runtime_context().get_actor_name()}")
        return self.engine.version

    @ray.method(concurrency_group="stream")
    def stream_submit(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        self._stream().submit(request_id, prompt_token_ids, params)

    @ray.method(concurrency_group="stream")
    def stream_cancel(self, request_ids: list[str]) -> None:
        self._stream().cancel(request_ids)

    @ray.method(concurrency_group="stream")
    def stream_collect(self, timeout_s: float) -> list:
        return self._stream().collect(timeout_s)

    @ray.method(concurrency_group="stream")
    def stream_stats(self):
        return self._stream().stats()

    def stream_close(self):
        """Close the stream (requests still in the engine fail, aborted); its final router statistics."""
        stream, self.stream = self.stream, None
        return None if stream is None else stream.close()

    def _stream(self):
        stream = self.stream
        if stream is None:
            raise RuntimeError(f"generation actor {ray.get_runtime_context().get_actor_name()} has no open request stream")
        return stream

    def load(self, spec, key: str, version: int) -> tuple[str, int | None]:
        """Make `key`, policy version `version`, the served policy: first load, or an in-place weight
        update. Returns (how: "cached" / "loaded" / "updated in place", the version the engine reports
        it now serves); tasks/actors/pools.py `generation_pool` refuses a report other than `version`."""
        self._engine_free(f"load {key}")
        if self.key == key:
            self._wake(["kv_cache"])
            return "cached", self.engine.version     # as the last load or live sync left it
        from tasks.run.common import TRAINING_ONLY, fetch_cached

        model_dir = fetch_cached(spec, key, skip=TRAINING_ONLY)

        self.key = None                               # until the engine holds it in full
        if self.engine is None:
            self.engine, self.tokenizer = self._build(model_dir)
            self.engine.version = version             # a new engine serves the directory it was built from
            how = "loaded"
        else:
            self._wake(["weights"])  # after sleep(2): allocated, unfilled until the load
            self.engine.load_weights(model_dir, version=version)  # vLLM: reload_weights + prefix-cache reset
            self._wake(["kv_cache"])
            how = "updated in place"
        self.key = key
        return how, self.engine.version

    def join_update_group(self, address: str, port: int, world_size: int, rank: int, token: str, timeout_s: float,
                          transport: str = "broadcast") -> str:
        """Join the model update group `token` as receiver `rank` (engines/weight_sync/update_group.py; tasks/loop/live_sync.py)."""
        return self.sync.join(address, port, world_size, rank, token, timeout_s, transport,
                              f"generation actor {ray.get_runtime_context().get_actor_name()}")

    def update_group_state(self) -> dict:
        """{"token": the usable update group this actor is in (None: none, or broken by a failed sync),
        "transport": its transport, "node": this actor's Ray node id}."""
        return self.sync.state(ready=self.engine is not None)

    def receive_weights(self, key: str) -> int | None:
        """Take the next live sync into the engine in place; it then serves `key`. Returns the version the engine reports."""
        return self.fill_weights(key, f"receive_weights {key}",
                                 lambda engine: self.sync.group.receive(engine, on_bucket=self.on_bucket))

    def fill_weights(self, key: str, what: str, fill):
        """A live sync into the engine in place: weights woken (after sleep(2): allocated, unfilled),
        `fill(engine)` (the update group's buckets, or a hybrid worker's in-process copy), then the cache;
        the engine serves `key` once it returns, no key while torn. Returns what `fill` returns."""
        self._engine_free(what)
        if self.engine is None:
            raise RuntimeError(f"generation actor {ray.get_runtime_context().get_actor_name()} holds no policy to update "
                               f"(a new actor, started after the last rollout), so it cannot take {key} in place")
        self.key = None
        self._wake(["weights"])
        out = fill(self.engine)
        self._wake(["kv_cache"])
        self.key = key
        return out

    def _build(self, model_dir: str):
        if self.engine_name == "vllm":
            from engines.models.modeling import load_tokenizer
            from engines.generation.vllm_engine import VLLMGenerationEngine

            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            tokenizer = load_tokenizer(model_dir)
            return VLLMGenerationEngine(model_dir, tokenizer=tokenizer, **self.vllm_options), tokenizer
        from engines.models.devices import place_model
        from engines.generation.engine import HFGenerationEngine
        from engines.models.modeling import load_policy

        device, dtype = placed(self.devices, "actor_infer")
        model, tokenizer = load_policy(model_dir, dtype=dtype)
        model = place_model(model, device, dtype)  # later in-place updates cast to it (update_weights)
        return HFGenerationEngine(model, tokenizer, micro_batch=self.micro_batch, compile_decode=self.compile_decode,
                                  pack_weights=self.pack_weights), tokenizer

    def sleep(self, level: int = 1, setting: str | None = None) -> None:
        """Free the engine's memory until its next use (engines/generation/engine.py `GenerationEngine.sleep`):
        level 1 the KV cache and generation buffers, level 2 the weights too; the next `load` or
        `receive_weights` wakes it (weights, filled, then the cache). `setting`: the config option
        that asked (placement.offload_generation); vLLM on CPU, whose sleep is a no-op, then refuses."""
        if self.engine is None:
            return
        self._engine_free("sleep")
        if setting is not None and getattr(self.engine, "on_cpu", False):
            raise ValueError(f"{setting}: vLLM's sleep mode is GPU only and this vLLM install runs on CPU, so the "
                             "engine would keep its memory; set placement.offload_generation: none, or rollout.engine: hf")
        self.engine.sleep(level)
        if "weights" in self.engine.asleep and level == 2:
            self.key = None  # the weights are gone: the next load fills them again, even with the same key

    def _wake(self, tags: list[str]) -> None:
        self.engine.wake_up(tags)

    def encode(self, prompts: list[str], chat: bool) -> list[list[int]]:
        from engines.models.modeling import encode_prompts

        return encode_prompts(self.tokenizer, prompts, chat)

    def tokenizer_copy(self):
        """The served policy's tokenizer (the agentic task's asynchronous manager encodes and decodes
        turns beside the engines with it, tasks/stages/agentic.py)."""
        return self.tokenizer

    def decode(self, token_lists: list[list[int]]) -> list[str]:
        """Texts of token id lists, as the engines decode a response (special tokens skipped)."""
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in token_lists]

    def generate(self, prompt_token_ids: list[list[int]], params, request_id: str | None = None):
        """Completions of every prompt. `request_id`: a name `abort` can stop this call by (both
        engines check the abort event between decode steps)."""
        self._engine_free("generate")
        if request_id is None:
            return self.engine.generate(prompt_token_ids, params)
        event = self.aborts.setdefault(request_id, threading.Event())  # set already if the abort came first
        try:
            return self.engine.generate(prompt_token_ids, params, abort=event)
        finally:
            self.aborts.pop(request_id, None)

    @ray.method(concurrency_group="abort")
    def abort(self, request_id: str) -> bool:
        """Stop generate call `request_id` (running, or queued behind another call: it then returns
        at once with nothing generated). False when no such call is running; an abort that arrives
        before its call starts is remembered until the call starts."""
        running = request_id in self.aborts
        self.aborts.setdefault(request_id, threading.Event()).set()
        while len(self.aborts) > 256:  # aborts of calls that had already finished: keep a bounded few
            self.aborts.pop(next(iter(self.aborts)))
        return running

    def episodes(self, env_name: str, seeds: list[int], group_size: int, max_turns: int, max_context_tokens: int, params, env_kwargs: dict,
                 chat: bool = False):
        """Multi-turn episodes with this engine (engines/agentic/env_manager.py), one batched generate per turn."""
        self._engine_free("episodes")
        from engines.agentic.env_manager import run_episodes

        return run_episodes(self.engine, self.tokenizer, env_name, seeds, group_size=group_size, max_turns=max_turns,
                            max_context_tokens=max_context_tokens, sampling=params, env_kwargs=env_kwargs, chat=chat)

    def eval_responses(self, table, max_new_tokens: int, chat: bool, stop: tuple[str, ...] = (), samples: int = 0,
                       temperature: float = 1.0, seed: int = 0):
        """Responses to the eval table, greedy or `samples` per prompt (engines/rewards/evaluation.py
        generate_responses); the eval task scores them."""
        self._engine_free("eval_responses")
        from engines.rewards.evaluation import generate_responses

        return generate_responses(self.engine, self.tokenizer, table, max_new_tokens=max_new_tokens, apply_chat_template=chat,
                                  stop=stop, samples=samples, temperature=temperature, seed=seed)

"""Ray actors that host the engines inside a stage's Ray cluster.

Each actor holds one engine and the policy version it has loaded; asked for another version it
updates its weights in place (no restart). On a local run the actors are named per run and reused
by every task (see infra/ray_session.py); on a cluster they live as long as the task's Ray cluster.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import typing

import ray

from engines.threads import thread_count  # os only at import time (torch inside its functions)

# Everything else is imported inside the actors' methods, on purpose: an actor's process sets its torch
# threads (`_engine_process`) before torch and the engines load, and a driver importing this module
# (to create the actors) loads none of them.

if typing.TYPE_CHECKING:  # annotations only (the actors import at run time, inside their methods)
    from configs.schema import TrainingConfig
    from engines.algorithms.config import AlgorithmConfig
    from engines.rollout_batch import RolloutBatch


def capped_threads(n: int, ray_cpus: float | None = None) -> int:
    """`n`, capped by the cores this process may use (affinity, cgroup quota, `ray_cpus`), a user's
    OMP_NUM_THREADS and FLYROLL_MAX_TORCH_THREADS when set (engines/threads.py `thread_count`)."""
    return thread_count(n, ray_cpus)


def _engine_process(n: int) -> None:
    """An engine actor's process set-up: `n` torch threads, capped by its cores and Ray CPU reservation
    (and FLYROLL_MAX_TORCH_THREADS when set: several runs sharing a box, e.g. the test suite's
    workers, would otherwise oversubscribe its cores) -- its OpenMP threads already wait passively
    (infra/ray_session.py `actor_pool` starts it so) -- and freed memory kept for reuse
    (engines/host_memory.py: no page faults on every large tensor of every step)."""
    import torch

    from engines.host_memory import keep_freed_memory

    ctx = ray.get_runtime_context() if ray.is_initialized() else None
    in_actor = ctx is not None and ctx.worker.mode == ray.WORKER_MODE   # a driver (an engine built in-process) has no reservation
    cpus = ctx.get_assigned_resources().get("CPU") if in_actor else None
    torch.set_num_threads(capped_threads(n, cpus))
    keep_freed_memory()


def _placed(devices: dict | None, role: str):
    """(torch device, torch dtype) of placement role `role` from the resolved `devices`
    ({role: (device, dtype)}, infra.resources.role_devices); cpu / float32 when not given."""
    from engines.devices import torch_device, torch_dtype

    device, dtype = (devices or {}).get(role, ("cpu", "float32"))
    return torch_device(device, role), torch_dtype(dtype)


def generation_worker_kwargs(cfg) -> dict:
    """GenerationWorker's constructor arguments from a FlyrollConfig (the same for every task that
    creates the run's generation actors)."""
    from infra.resources import role_devices

    r, devices = cfg.rollout, role_devices(cfg, "actor_infer")
    return {"threads": cfg.run.torch_threads, "micro_batch": r.micro_batch, "engine": r.engine, "compile_decode": r.hf_compile_decode,
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
    (`stream_open` .. `stream_close`, engines/request_stream.py): single requests by id, in the
    `stream` concurrency group, batched by the engine step by step; while it is open, every method
    that would use the engine directly refuses."""

    def __init__(self, threads: int = 1, micro_batch: int = 256, engine: str = "hf", vllm_options: dict | None = None,
                 compile_decode: bool = False, pack_weights: bool = False, devices: dict | None = None):
        """`devices`: {"actor_infer": (device, dtype)} (hf: the weights are cast to the dtype and moved
        to the device; vllm gets the dtype through `vllm_options`); None = cpu, float32."""
        _engine_process(threads)
        self.devices = devices
        self.engine, self.tokenizer, self.key, self.micro_batch = None, None, None, micro_batch
        self.compile_decode, self.pack_weights = compile_decode, pack_weights
        self.engine_name, self.vllm_options = engine, dict(vllm_options or {})
        self.aborts: dict[str, threading.Event] = {}  # request id -> its abort event, while it may still run
        # called with i after bucket i of a live sync is applied (engines/weight_update.py `receive`): None in
        # a run; tests/test_live_sync.py sets it to stop this actor in the middle of a sync
        self.on_bucket = None
        self.stream = None   # engines/request_stream.py RequestStream, while the agentic rollout has one open

    def _engine_free(self, what: str) -> None:
        if self.stream is not None:
            raise RuntimeError(f"generation actor {ray.get_runtime_context().get_actor_name()}: {what} while a request "
                               "stream is open (the agentic rollout's; it owns the engine until stream_close)")

    def can_stream(self) -> bool:
        """Whether the engine takes single requests into a running batch (a `StreamingEngine`: vLLM)."""
        from engines.generation_router import is_streaming

        return self.engine is not None and is_streaming(self.engine)

    def stream_open(self) -> int:
        """Open the request stream over the engine; returns the policy version its requests are tagged with."""
        from engines.request_stream import RequestStream

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
        it now serves); tasks/pools.py `generation_pool` refuses a report other than `version`."""
        self._engine_free(f"load {key}")
        if self.key == key:
            self._wake(["kv_cache"])
            return "cached", self.engine.version     # as the last load or live sync left it
        from tasks.common import TRAINING_ONLY, fetch_cached

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
        """Join the model update group `token` as receiver `rank` (engines/weight_update.py; tasks/live_sync.py)."""
        from engines.weight_update import ModelUpdateGroup

        if getattr(self, "update_group", None) is not None:
            self.update_group.close()
        self.update_group = None
        group = ModelUpdateGroup(address, port, world_size, rank, transport=transport, timeout_s=timeout_s,
                                 member=f"generation actor {ray.get_runtime_context().get_actor_name()}")
        self.update_group, self.update_token = group, token
        return token

    def update_group_state(self) -> dict:
        """{"token": the usable update group this actor is in (None: none, or broken by a failed sync),
        "transport": its transport, "node": this actor's Ray node id}."""
        group = getattr(self, "update_group", None)
        usable = group is not None and not group.broken and self.engine is not None
        return {"token": self.update_token if usable else None, "transport": group.transport if usable else None,
                "node": ray.get_runtime_context().get_node_id()}

    def receive_weights(self, key: str) -> int | None:
        """Take the next live sync into the engine in place; it then serves `key`. Returns the version the engine reports."""
        self._engine_free(f"receive_weights {key}")
        if self.engine is None:
            raise RuntimeError(f"generation actor {ray.get_runtime_context().get_actor_name()} holds no policy to update "
                               f"(a new actor, started after the last rollout), so it cannot take {key} in place")
        self.key = None  # until every bucket is in: a torn engine serves no key
        self._wake(["weights"])  # after sleep(2): allocated here, filled by the sync's buckets
        version = self.update_group.receive(self.engine, on_bucket=self.on_bucket)
        self._wake(["kv_cache"])
        self.key = key
        return version

    def _build(self, model_dir: str):
        if self.engine_name == "vllm":
            from engines.modeling import load_tokenizer
            from engines.vllm_engine import VLLMGenerationEngine

            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            tokenizer = load_tokenizer(model_dir)
            return VLLMGenerationEngine(model_dir, tokenizer=tokenizer, **self.vllm_options), tokenizer
        from engines.devices import place_model
        from engines.generation import HFGenerationEngine
        from engines.modeling import load_policy

        device, dtype = _placed(self.devices, "actor_infer")
        model, tokenizer = load_policy(model_dir, dtype=dtype)
        model = place_model(model, device, dtype)  # later in-place updates cast to it (update_weights)
        return HFGenerationEngine(model, tokenizer, micro_batch=self.micro_batch, compile_decode=self.compile_decode,
                                  pack_weights=self.pack_weights), tokenizer

    def sleep(self, level: int = 1, setting: str | None = None) -> None:
        """Free the engine's memory until its next use (engines/generation.py `GenerationEngine.sleep`):
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
        from engines.modeling import encode_prompts

        return encode_prompts(self.tokenizer, prompts, chat)

    def tokenizer_copy(self):
        """The served policy's tokenizer (the agentic task's asynchronous manager encodes and decodes
        turns beside the engines with it, tasks/agentic.py)."""
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
        """Multi-turn episodes with this engine (engines/env_manager.py), one batched generate per turn."""
        self._engine_free("episodes")
        from engines.env_manager import run_episodes

        return run_episodes(self.engine, self.tokenizer, env_name, seeds, group_size=group_size, max_turns=max_turns,
                            max_context_tokens=max_context_tokens, sampling=params, env_kwargs=env_kwargs, chat=chat)

    def eval_responses(self, table, max_new_tokens: int, chat: bool, stop: tuple[str, ...] = (), samples: int = 0,
                       temperature: float = 1.0, seed: int = 0):
        """Responses to the eval table, greedy or `samples` per prompt (engines/evaluation.py
        generate_responses); the eval task scores them."""
        self._engine_free("eval_responses")
        from engines.evaluation import generate_responses

        return generate_responses(self.engine, self.tokenizer, table, max_new_tokens=max_new_tokens, apply_chat_template=chat,
                                  stop=stop, samples=samples, temperature=temperature, seed=seed)


@ray.remote
class RewardWorker:
    """Scores samples with the reward routed to them (engines/rewards/routing.py: reward.functions,
    metadata.reward_fn, the domain), each call isolated (timeout, exceptions). Domains routed to a
    model reward (`judge`, `reward_model`) are scored in batches by a model this actor builds once,
    on first use, and keeps (engines/rewards/models.py)."""

    def __init__(self, threads: int = 4):
        from engines.rewards.models import ModelRewards

        self.pool = cf.ThreadPoolExecutor(max_workers=threads)
        self.model_rewards = ModelRewards(self.pool)

    def score(self, items: list[tuple[str, str, dict]], timeout_s: float, routes: dict[str, str] | None = None,
              models: dict[str, dict] | None = None) -> tuple[list[tuple[float, str | None]], bool]:
        """items: (domain, response, sample) -> ([(reward, error)], hung). hung = a call is still stuck.
        routes: domain -> reward function name (config `reward.functions`); models: model reward
        name -> its options (config `reward.judge` / `reward.reward_model`, as dicts)."""
        from engines.rewards.routing import score_samples

        return score_samples(items, timeout_s, routes, models, self.pool, self.model_rewards)

    def model_stats(self) -> dict[str, dict[str, int]]:
        """Per model reward: builds (model loads), calls (batched calls) and samples scored so far."""
        return self.model_rewards.stats


@ray.remote
class ReferenceWorker:
    """Reference-model log-probs, the current policy's (old) log-probs and, for PPO with GAE, the
    current critic's values, on the rollout tokens."""

    def __init__(self, threads: int = 1, devices: dict | None = None):
        """`devices`: {"reference": (device, dtype), "critic": (device, dtype)}: the policy and
        reference models are cast to the reference role's dtype on its device; the critic keeps its
        float32 weights there and runs under autocast in the critic's dtype, as it trains. None = cpu, float32."""
        _engine_process(threads)
        self.devices = devices
        self.models: dict[str, tuple] = {}  # which ("reference"/"policy"/"critic") -> (key, model)
        self.pad = 0  # the tokenizer's pad id once a policy is loaded (padding is masked: any id works)

    def load(self, which: str, spec, key: str) -> None:
        """which="critic": the critic published with policy checkpoint `key` (fresh from its
        backbone when it has none: the first iteration)."""
        if which in self.models and self.models[which][0] == key:
            return
        from engines.modeling import load_policy
        from tasks.common import TRAINER_STATE, TRAINING_ONLY, fetch_cached

        if which == "critic":  # its weights (and the policy's, for a fresh one), not the optimizer state
            from engines.critic_model import critic_for_checkpoint

            device, _ = _placed(self.devices, "reference")
            critic = critic_for_checkpoint(fetch_cached(spec, key, skip=(TRAINER_STATE,)))
            self.models[which] = (key, critic.to(device).eval())
            return
        from engines.devices import place_model

        device, dtype = _placed(self.devices, "reference")
        model, tok = load_policy(fetch_cached(spec, key, skip=TRAINING_ONLY), dtype=dtype)
        self.models[which] = (key, place_model(model, device, dtype).eval())
        self.pad = tok.pad_token_id

    def pad_id(self) -> int:
        return self.pad

    def release(self) -> None:
        """Drop every model and hand their memory back (placement.offload_reference); the next `load`
        reads them again from the local checkpoint cache (frozen or published: the same bits)."""
        from engines.host_memory import release_allocator_caches

        self.models.clear()
        release_allocator_caches()

    def logprobs(self, which: str, batch: RolloutBatch, micro_batch: int) -> list[list[float]]:
        """Log-probs of model `which` on every response token of `batch` (a RolloutBatch), one list per row."""
        from engines.batching import batched_logprobs

        lp = batched_logprobs(self.models[which][1], batch.tokens(loss_mask=False), micro_batch=micro_batch)
        return [lp[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]

    def values(self, batch: RolloutBatch, micro_batch: int) -> list[list[float]]:
        """Critic values V(s_t), one per response token of `batch` (a RolloutBatch)."""
        from engines.critic_model import batched_values
        from engines.devices import autocast_dtype, torch_dtype

        critic_dtype = torch_dtype((self.devices or {}).get("critic", ("cpu", "float32"))[1])  # on the reference device
        v = batched_values(self.models["critic"][1], batch.tokens(loss_mask=False), micro_batch=micro_batch,
                           autocast_dtype=autocast_dtype(critic_dtype))
        return [v[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]


@ray.remote
class TrainWorker:
    """The actor's training engine (model + optimizer state), the critic's for PPO with GAE, and the
    objective's state across iterations (KL controller, EMA baseline, running reward statistics);
    one update per call. All of it is saved in the checkpoint and restored from it.

    With `training.strategy` other than torch, N of these form one torch.distributed group
    (`rendezvous` on rank 0, then `join_group` on all) and every call below is made on all N with
    the same arguments: each trains on its shard of every mini-batch, rank 0 returns the checkpoint."""

    def __init__(self, threads: int = 1, devices: dict | None = None):
        """`devices`: {"actor_train": (device, dtype), "critic": (device, dtype)}: float32 weights and
        AdamW state on the device, forwards under autocast in the dtype (engines/devices.py). None = cpu, float32."""
        _engine_process(threads)
        self.devices = devices
        self.key, self.model, self.tokenizer, self.engine = None, None, None, None
        self.critic_engine, self.algo_state = None, None
        self.rank, self.world_size, self.address = 0, 1, None
        self.sync_kept, self.sync_weights = False, None  # what the last step kept for `send_weights`
        self.every_rank_keeps = False  # a hybrid worker's trainer (tasks/hybrid.py): each rank fills its own engine
        self.offload = None  # engines/offload.py TrainStateOffload while placement.offload_train has state away

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) for the process group's store, on rank 0's node (the one it already has)."""
        if self.address is None:
            import socket

            with socket.socket() as s:
                s.bind(("", 0))
                self.address = (ray.util.get_node_ip_address(), s.getsockname()[1])
        return self.address

    def join_group(self, rank: int, world_size: int, address: tuple[str, int]) -> str:
        """Join the training process group (once per actor); returns the backend (gloo / nccl)."""
        from engines.strategies import init_distributed

        backend = init_distributed(rank, world_size, address[0], address[1])
        self.rank, self.world_size, self.address = rank, world_size, address
        return backend

    def load(self, spec, key: str, training: TrainingConfig, algorithm: AlgorithmConfig | None = None) -> str:
        """Make `key` the policy this actor trains: "cached" when it holds it (it trained it, so it has
        its optimizer and objective state too), else loaded from the store with its trainer_state.pt.
        A version of this run published without one (checkpoint.optimizer_every) is rebuilt by
        replaying the updates since the newest one that has it (tasks/replay.py). `training`,
        `algorithm`: the config's TrainingConfig and AlgorithmConfig sections."""
        if self.key == key:
            return "cached"
        from tasks.common import store_of
        from tasks.replay import deferred_chain, replay

        base, chain = deferred_chain(store_of(spec), spec.run_id, key)
        if chain:
            return replay(self, spec, key, base, chain, training, algorithm)
        return self._load(spec, key, training, algorithm)

    def _load(self, spec, key: str, training: TrainingConfig, algorithm: AlgorithmConfig | None = None,
              state: dict | None = None) -> str:
        """Build the engines from version `key`'s weights and its trainer_state.pt, or `state` when
        given (a replayed one: tasks/replay.py)."""
        import torch

        from engines.modeling import load_policy
        from engines.rl_step import AlgorithmState
        from engines.strategies import make_strategy
        from engines.training import TorchCriticEngine, TorchTrainEngine
        from tasks.common import TRAINER_STATE, TRAINING_ONLY, fetch_cached
        from tasks.keys import is_run_key

        model_dir = fetch_cached(spec, key)
        device, dtype = _placed(self.devices, "actor_train")
        if self.offload is not None:  # the engines it holds state of are replaced
            self.offload.discard()
            self.offload = None
        path = os.path.join(model_dir, TRAINER_STATE)
        if state is None:
            state = torch.load(path, weights_only=True, map_location="cpu") if os.path.exists(path) else {}
        lora = training.lora.model_dump()
        resume_lora = bool(training.lora.rank) and "lora_adapter" in state and "lora_base" in state
        # LoRA: the adapters sit on the frozen base they started from (the merged checkpoint is for generation)
        self.lora_base = state["lora_base"] if resume_lora else key
        base_dir = fetch_cached(spec, self.lora_base, skip=TRAINING_ONLY) if resume_lora else model_dir
        self.model, self.tokenizer = load_policy(base_dir)  # float32: the master weights
        self.model.to(device)
        strategy, zero = training.strategy, dict(training.zero_optimization)
        strategy_options = {"config_overrides": {"zero_optimization": zero}} if strategy.startswith("deepspeed") else {}
        opt = dict(weight_decay=training.weight_decay, grad_clip=training.grad_clip, warmup_steps=training.warmup_steps)
        self.engine = TorchTrainEngine(self.model, lr=training.lr, strategy=make_strategy(strategy, **strategy_options),
                                       compile=training.compile, compute_dtype=dtype, lora=lora,
                                       gradient_checkpointing=training.gradient_checkpointing, **opt)
        if not state and is_run_key(key):  # a run's own version without it: pruned
            print(f"flyroll: policy {key} has no {TRAINER_STATE} (only the newest run.keep_trainer_states versions that "
                  "hold one keep it): the optimizer moments, LR schedule and objective state start afresh", flush=True)
        if state and self.engine.lora != ("lora_adapter" in state):  # the other mode's optimizer state does not fit
            print(f"flyroll: policy {key}'s {TRAINER_STATE} was written {'with' if 'lora_adapter' in state else 'without'} "
                  "LoRA and training.lora says otherwise: the optimizer moments and LR schedule start afresh", flush=True)
        elif state:  # resume optimizer moments and LR schedule (and the LoRA adapters)
            self.engine.load_state_dict(state)
        self.algo_state = AlgorithmState.from_dict(state.get("algorithm"))
        self.critic_engine = None
        if algorithm is not None and algorithm.advantage == "gae":
            from engines.critic_model import critic_for_checkpoint

            critic_device, critic_dtype = _placed(self.devices, "critic")
            self.critic_engine = TorchCriticEngine(critic_for_checkpoint(model_dir).to(critic_device), lr=algorithm.critic_lr,
                                                   strategy=make_strategy(strategy, **strategy_options), compute_dtype=critic_dtype, **opt)
            if "critic" in state:
                self.critic_engine.load_state_dict(state["critic"])
        self.key = key
        return "loaded"

    def release_memory(self, offload: str = "none", keep_params: bool = False) -> int:
        """Hand the memory freed after a step back (glibc's heap, which this process keeps between steps,
        engines/host_memory.py; CUDA's caching allocator on a GPU): asked when the generation engines
        colocated with this trainer sleep between rollouts (placement.offload_generation), so the
        rollout beside it finds the step's transient memory free. The next step pays the page faults.
        `offload` (placement.offload_train): first move that state off the device (engines/offload.py),
        the parameters not while `keep_params` (a live sync still reads them); the next call that
        needs it (`update`, `trainer_state`, `send_weights`) brings it back. Returns the bytes moved."""
        from engines.host_memory import release_allocator_caches
        from engines.offload import offload_engines

        self.offload, moved = offload_engines(self.offload, {"actor": self.engine, "critic": self.critic_engine},
                                              offload, keep_params)
        release_allocator_caches()
        return moved

    def _resident(self) -> None:
        if self.offload is not None:
            self.offload.reload()

    def step(self, table, algorithm: AlgorithmConfig, training: TrainingConfig, temperature: float, seed: int, next_key: str,
             train_actor: bool = True, out: tuple[str, str] | None = None,
             trainer_state: bool = True, keep_weights: bool = False, write: bool = True) -> tuple[dict, dict[str, bytes]]:
        """One update (`update`) on a scored table; returns (metrics, checkpoint files as bytes, the
        critic under critic/). Under a multi-process strategy every rank returns the same metrics and
        only rank 0 the files. `trainer_state`: False leaves trainer_state.pt out of the checkpoint
        (checkpoint.optimizer_every; this actor keeps it in memory). `write`: False writes no checkpoint
        at all (checkpoint.publish_every: a version not published; this actor keeps weights and state).

        `out` = (the caller's Ray node id, a folder there): when this actor runs on that node, or sees
        the folder (a local cluster-shaped run starts several Ray nodes on one machine, and the
        folder's name is the caller's unique mkdtemp one, so seeing it means sharing its filesystem),
        the checkpoint is written straight into the folder and no bytes come back (SmolLM2's 1.6 GB
        otherwise cost a read-back, two copies through the object store and the caller's write:
        ~5 s of each iteration's training stage on a shared local Ray, 22.6 s of SmolLM2's 59 s in a local
        cluster-shaped run, docs/benchmarks.md); on another machine the bytes do."""
        import tempfile

        import torch

        from engines.critic_model import CRITIC_SUBDIR, save_critic
        from engines.lora import plain_model
        from engines.modeling import save_policy
        from engines.weight_update import is_shard
        from tasks.common import TRAINER_STATE

        t0 = time.perf_counter()
        metrics = self.update(table, algorithm, training, temperature, seed, train_actor)
        metrics["training/update_s"] = time.perf_counter() - t0  # the stage's rest: load, gather, checkpoint write
        self.key = next_key  # what weight_sync will publish these weights as
        # a sharded trainer's live sync of a version it does not write gathers per bucket in `send_weights`:
        # no rank gathers the whole model here (decided alike on every rank: same arguments, same strategy)
        self.sync_kept = keep_weights and (write or not any(is_shard(p) for p in self.engine.model.parameters()))
        # gathered on every rank (collectives), written by rank 0: the same checkpoint as one process
        state = self.trainer_state() if trainer_state else None
        weights = self.engine.checkpoint_state_dict() if write or self.sync_kept else None  # LoRA: merged into plain weights
        critic_weights = None
        if self.critic_engine is not None and write:
            critic_weights = self.critic_engine.strategy.full_state_dict()
        # sync.method=live: the weights just gathered are what `send_weights` sends next (kept until then;
        # on rank 0 only, unless every rank fills an engine of its own: a hybrid worker)
        kept = (weights if weights is not None else plain_model(self.engine.model).state_dict()) if self.sync_kept else None
        if self.rank != 0:
            self.sync_weights = kept if self.every_rank_keeps else None
            return metrics, {}
        self.sync_weights = kept
        if not write:
            return metrics, {}

        def save(d: str) -> None:
            save_policy(plain_model(self.engine.model), self.tokenizer, d, state_dict=weights)
            if self.critic_engine is not None:
                save_critic(self.critic_engine.critic, os.path.join(d, CRITIC_SUBDIR), state_dict=critic_weights)
            if state is not None:
                torch.save(state, os.path.join(d, TRAINER_STATE))

        if out is not None and (out[0] == ray.get_runtime_context().get_node_id() or os.path.isdir(out[1])):
            t0 = time.perf_counter()
            save(out[1])
            metrics["training/checkpoint_write_s"] = time.perf_counter() - t0
            return metrics, {}
        with tempfile.TemporaryDirectory() as d:
            save(d)
            files = {}
            for root, _, names in os.walk(d):
                for n in names:
                    p = os.path.join(root, n)
                    with open(p, "rb") as f:
                        files[os.path.relpath(p, d)] = f.read()
        return metrics, files

    def free_port(self) -> tuple[str, int]:
        """(address, a free port) on this actor's node, for a model update group's store (tasks/live_sync.py)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def join_update_group(self, address: str, port: int, world_size: int, token: str, timeout_s: float,
                          transport: str = "broadcast") -> str:
        """Rank 0 (the sender) of the model update group `token` (engines/weight_update.py)."""
        from engines.weight_update import ModelUpdateGroup

        if getattr(self, "update_group", None) is not None:
            self.update_group.close()
        self.update_group = None
        self.update_group = ModelUpdateGroup(address, port, world_size, 0, transport=transport, timeout_s=timeout_s,
                                             member="trainer rank 0")
        self.update_token = token
        return token

    def update_group_state(self) -> dict:
        """As GenerationWorker.update_group_state: the usable group's token and transport, and this actor's node."""
        group = getattr(self, "update_group", None)
        usable = group is not None and not group.broken
        return {"token": self.update_token if usable else None, "transport": group.transport if usable else None,
                "node": ray.get_runtime_context().get_node_id()}

    def send_weights(self, version: int, dtype: str, bucket_bytes: int) -> dict | None:
        """Called on every training rank at once. Rank 0 sends the weights of the last
        `step(keep_weights=True)` -- or, with none kept, its current weights, a sharded trainer's gathered
        one parameter at a time as each bucket fills while ranks > 0 take part in those gathers
        (`gather_only`) -- to the group's engines as `version`; it returns the sync's report
        (engines/weight_update.py `SyncReport`, plus `kept_bytes`: the bytes of the copies the step kept
        for it) once every engine verified it. Ranks > 0 return None."""
        import dataclasses

        from engines.lora import plain_model
        from engines.weight_update import gather_only, is_shard

        self._resident()  # placement.offload_train: the weights back before they are read
        kept, self.sync_kept = self.sync_kept, False
        params = list(plain_model(self.engine.model).named_parameters())
        sharded = any(is_shard(p) for _, p in params)
        if self.rank != 0:
            if sharded and not kept:
                gather_only(params)
            return None
        weights, self.sync_weights = self.sync_weights, None
        if weights is None and not sharded and self.world_size > 1:
            raise RuntimeError(f"send_weights(v{version}): no weights kept by the last step (keep_weights=False) and "
                               f"the {self.engine.strategy.name} trainer's rank 0 does not gather them per bucket")
        if weights is None and not sharded:  # one process: its own weights (LoRA merged)
            weights = self.engine.checkpoint_state_dict() or plain_model(self.engine.model).state_dict()
        named = list(weights.items()) if weights is not None else params
        report = self.update_group.send(named, version=version, dtype=dtype, bucket_bytes=bucket_bytes)
        own = {p.data_ptr() for _, p in params}  # a one-process trainer keeps its own tensors: no copy held
        held = sum(t.numel() * t.element_size() for t in weights.values() if t.data_ptr() not in own) if kept else 0
        return {**dataclasses.asdict(report), "kept_bytes": held}

    def update(self, table, algorithm: AlgorithmConfig, training: TrainingConfig, temperature: float, seed: int,
               train_actor: bool = True) -> dict:
        """The update itself (engines/rl_step.py `train_update`: critic, then actor unless `train_actor`
        is False: critic warmup) on a scored table, objective state included; returns its metrics.
        `algorithm`, `training`: the config's AlgorithmConfig and TrainingConfig. Writes nothing."""
        from engines.rl_step import train_update
        from engines.rollout_batch import RolloutBatch

        self._resident()
        batch = RolloutBatch.from_table(table, self.tokenizer.pad_token_id)  # the one conversion
        metrics, self.algo_state = train_update(
            self.engine, self.critic_engine, batch, algorithm, self.algo_state, temperature=temperature,
            mini_batch_size=training.mini_batch_size, max_tokens_per_micro_batch=training.max_tokens_per_micro_batch,
            seed=seed, train_actor=train_actor)
        return metrics

    def trainer_state(self) -> dict:
        """Collective. What trainer_state.pt holds: optimizer moments and LR schedule (with LoRA the
        adapters and the frozen base's key), the objective state, the critic's optimizer state."""
        self._resident()
        state = {**self.engine.state_dict(), "algorithm": self.algo_state.to_dict()}
        if self.engine.lora:  # the frozen base's key: a resume loads it and puts the adapters back on it
            state["lora_base"] = self.lora_base
        if self.critic_engine is not None:
            state["critic"] = self.critic_engine.state_dict()
        return state

"""The training actor (`TrainWorker`): the policy's training engine, the critic's, and the objective's
state across iterations, in a stage's Ray cluster (tasks/stages/training.py makes the pool; with
placement.hybrid a tasks/actors/hybrid.py worker hosts it)."""

from __future__ import annotations

import os
import time
import typing

import ray

from tasks.actors.process import engine_process, placed
from tasks.actors.sync_roles import GroupMember, KeptWeights

# Everything else is imported inside the methods, on purpose (see tasks/actors/generation.py).

if typing.TYPE_CHECKING:  # annotations only (the actor imports at run time, inside its methods)
    from configs.schema import TrainingConfig
    from engines.algorithms.config import AlgorithmConfig


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
        AdamW state on the device, forwards under autocast in the dtype (engines/models/devices.py). None = cpu, float32."""
        engine_process(threads)
        from engines.training.offload import EngineOffload  # torch loads after engine_process set the threads

        self.devices = devices
        self.key, self.model, self.tokenizer, self.engine = None, None, None, None
        self.critic_engine, self.algo_state = None, None
        self.rank, self.world_size, self.address = 0, 1, None
        self.kept = KeptWeights()                  # what the last step kept for `send_weights`
        self.sync = GroupMember()                  # its place in a model update group (rank 0 only)
        self.offload = EngineOffload()             # placement.offload_train: the state moved off the device

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
        from engines.training.strategies import init_distributed

        backend = init_distributed(rank, world_size, address[0], address[1])
        self.rank, self.world_size, self.address = rank, world_size, address
        return backend

    def load(self, spec, key: str, training: TrainingConfig, algorithm: AlgorithmConfig | None = None,
             total_steps: int | None = None) -> str:
        """Make `key` the policy this actor trains: "cached" when it holds it (it trained it, so it has
        its optimizer and objective state too), else loaded from the store, with its trainer_state.pt
        when `key` is this run's own version (a resume). Another run's version (`model.path`) gives its
        weights only: this run's `training` and `algorithm` settings start afresh, since a loaded
        optimizer state would bring back that run's learning rate and schedule. A version of this run
        published without one (checkpoint.optimizer_every) is rebuilt by replaying the updates since the
        newest one that has it (tasks/run/replay.py). `training`, `algorithm`: the config's TrainingConfig
        and AlgorithmConfig sections. `total_steps`: the LR schedule's length (warmup, then cosine to
        0.1 of training.lr; SFT and DPO runs know it), None = constant after the warmup (RL)."""
        self.total_steps = total_steps
        if self.key == key:
            return "cached"
        from tasks.run.common import store_of
        from tasks.run.replay import deferred_chain, replay

        base, chain = deferred_chain(store_of(spec), spec.run_id, key)
        if chain:
            return replay(self, spec, key, base, chain, training, algorithm)
        return self._load(spec, key, training, algorithm)

    def _load(self, spec, key: str, training: TrainingConfig, algorithm: AlgorithmConfig | None = None,
              state: dict | None = None) -> str:
        """Build the engines from version `key`'s weights and its trainer_state.pt, or `state` when
        given (a replayed one: tasks/run/replay.py)."""
        import torch

        from engines.models.modeling import load_policy
        from engines.training.rl_step import AlgorithmState
        from engines.training.strategies import make_strategy
        from engines.training.update import TorchCriticEngine, TorchTrainEngine
        from tasks.run.common import TRAINER_STATE, TRAINING_ONLY, fetch_cached
        from tasks.run.keys import is_policy_of

        model_dir = fetch_cached(spec, key)
        device, dtype = placed(self.devices, "actor_train")
        self.offload.discard()  # the engines it holds state of are replaced
        path, own = os.path.join(model_dir, TRAINER_STATE), is_policy_of(spec.run_id, key)
        if state is None:
            held = os.path.exists(path)
            state = torch.load(path, weights_only=True, map_location="cpu") if own and held else {}
            if held and not own:
                print(f"flyroll: policy {key} is another run's version: this run starts from its weights, and its "
                      f"{TRAINER_STATE} (that run's optimizer moments, learning rate, LR schedule and objective state) "
                      "is left out, so this run's training and algorithm settings apply", flush=True)
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
                                       gradient_checkpointing=training.gradient_checkpointing,
                                       total_steps=getattr(self, "total_steps", None), **opt)
        if not state and own:  # a run's own version without it: pruned
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
            from engines.training.critic_model import critic_for_checkpoint

            critic_device, critic_dtype = placed(self.devices, "critic")
            self.critic_engine = TorchCriticEngine(critic_for_checkpoint(model_dir).to(critic_device), lr=algorithm.critic_lr,
                                                   strategy=make_strategy(strategy, **strategy_options), compute_dtype=critic_dtype, **opt)
            if "critic" in state:
                self.critic_engine.load_state_dict(state["critic"])
        self.key = key
        return "loaded"

    def release_memory(self, offload: str = "none", keep_params: bool = False) -> int:
        """Hand the memory freed after a step back (glibc's heap, which this process keeps between steps,
        engines/models/host_memory.py; CUDA's caching allocator on a GPU): asked when the generation engines
        colocated with this trainer sleep between rollouts (placement.offload_generation), so the
        rollout beside it finds the step's transient memory free. The next step pays the page faults.
        `offload` (placement.offload_train): first move that state off the device (engines/training/offload.py),
        the parameters not while `keep_params` (a live sync still reads them); the next call that
        needs it (`update`, `trainer_state`, `send_weights`) brings it back. Returns the bytes moved."""
        from engines.models.host_memory import release_allocator_caches

        moved = self.offload.release({"actor": self.engine, "critic": self.critic_engine}, offload, keep_params)
        release_allocator_caches()
        return moved

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
        from engines.training.lora import plain_model
        from engines.weight_sync.gather import is_shard

        from engines.training.update import NonFiniteUpdate

        t0 = time.perf_counter()
        try:
            metrics = self.update(table, algorithm, training, temperature, seed, train_actor)
        except NonFiniteUpdate as e:
            raise NonFiniteUpdate(f"{e}, training {next_key} from {self.key} (the last good version; nothing of the new "
                                  "one was written). Look at this batch's reward/* metrics and the advantages: lower "
                                  "training.lr or training.grad_clip, or bound the reward (reward.bounds)") from None
        metrics["training/update_s"] = time.perf_counter() - t0  # the stage's rest: load, gather, checkpoint write
        self.key = next_key  # what weight_sync will publish these weights as
        # a sharded trainer's live sync of a version it does not write gathers per bucket in `send_weights`:
        # no rank gathers the whole model here (decided alike on every rank: same arguments, same strategy)
        sync_kept = keep_weights and (write or not any(is_shard(p) for p in self.engine.model.parameters()))
        # gathered on every rank (collectives), written by rank 0: the same checkpoint as one process
        state = self.trainer_state() if trainer_state else None
        weights = self.engine.checkpoint_state_dict() if write or sync_kept else None  # LoRA: merged into plain weights
        critic_weights = None
        if self.critic_engine is not None and write:
            critic_weights = self.critic_engine.strategy.full_state_dict()
        # sync.method=live: the weights just gathered are what `send_weights` sends next (kept until then;
        # on rank 0 only, unless every rank fills an engine of its own: a hybrid worker)
        kept = (weights if weights is not None else plain_model(self.engine.model).state_dict()) if sync_kept else None
        self.kept.keep(sync_kept, kept, self.rank)
        if self.rank != 0 or not write:
            return metrics, {}
        return metrics, self._write_checkpoint(out, weights, critic_weights, state, metrics)

    def _write_checkpoint(self, out: tuple[str, str] | None, weights: dict | None, critic_weights: dict | None,
                          state: dict | None, metrics: dict) -> dict[str, bytes]:
        """Rank 0: the checkpoint (weights, tokenizer, the critic under critic/, trainer_state.pt when
        `state`) written into `out`'s folder when this actor sees it, else returned as bytes (`step`)."""
        import tempfile

        import torch

        from engines.models.modeling import save_policy
        from engines.training.critic_model import CRITIC_SUBDIR, save_critic
        from engines.training.lora import plain_model
        from tasks.run.common import TRAINER_STATE

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
            return {}
        with tempfile.TemporaryDirectory() as d:
            save(d)
            files = {}
            for root, _, names in os.walk(d):
                for n in names:
                    p = os.path.join(root, n)
                    with open(p, "rb") as f:
                        files[os.path.relpath(p, d)] = f.read()
        return files

    def post_train(self, kind: str, examples: list, steps: list[list[int]], settings: dict, training: TrainingConfig,
                   seed: int, next_key: str, out: tuple[str, str] | None = None, eval_examples: list | None = None,
                   reference: dict | None = None) -> tuple[dict, dict[str, bytes]]:
        """SFT (`kind` "sft"), preference ("dpo") or distillation ("distill") optimizer steps on the loaded
        policy, one per entry of `steps` (indices into `examples`: engines/training/supervised.py
        `Encoded`, or pairs of them), then the eval split's loss, then the checkpoint (as `step` writes
        it, trainer state included). `settings`: dpo: loss, beta, label_smoothing; distill: divergence,
        divergence_weight, temperatures, options, top_k. `reference`: dpo: {"train": (sums, means) per
        row of `examples` flattened chosen/rejected, "eval": the same for `eval_examples`}; distill:
        {"train": the teacher's top-k per example, "eval": per eval example}. Every rank is called
        alike; rank 0 returns the files. Returns (metrics averaged over the steps, files)."""
        import torch

        from engines.training.supervised import (batch_of, distill_eval, distill_update, pair_batch, preference_eval,
                                                 preference_update, sft_update, token_nll, topk_tensors)
        from engines.training.update import NonFiniteUpdate

        self.offload.reload()
        pad, cap = self.tokenizer.pad_token_id, training.max_tokens_per_micro_batch
        sums: dict[str, float] = {}
        t0 = time.perf_counter()
        ref = {k: tuple(torch.tensor(x, dtype=torch.float32) for x in v) for k, v in (reference or {}).items()} \
            if kind == "dpo" else {}
        distill = {k: v for k, v in settings.items() if k != "top_k"} if kind == "distill" else {}
        try:
            for i, rows in enumerate(steps):
                if kind == "sft":
                    m = sft_update(self.engine, batch_of([examples[j] for j in rows], pad), mini_batch_size=len(rows),
                                   max_tokens_per_micro_batch=cap, seed=seed + i)
                elif kind == "distill":
                    batch = batch_of([examples[j] for j in rows], pad)
                    ids, logps = topk_tensors([reference["train"][j] for j in rows], batch.responses.shape[1],
                                              settings["top_k"])
                    m = distill_update(self.engine, batch, ids, logps, mini_batch_size=len(rows),
                                       max_tokens_per_micro_batch=cap, seed=seed + i, **distill)
                else:
                    idx = torch.tensor([2 * j + k for j in rows for k in (0, 1)])
                    m = preference_update(self.engine, pair_batch([examples[j] for j in rows], pad), ref["train"][0][idx],
                                          ref["train"][1][idx], mini_batch_size=len(rows), max_tokens_per_micro_batch=cap,
                                          seed=seed + i, **settings)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v / len(steps)
        except NonFiniteUpdate as e:
            raise NonFiniteUpdate(f"{e}, training {next_key} from {self.key} (the last good version; nothing of the new "
                                  "one was written): lower training.lr or training.grad_clip") from None
        sums["training/update_s"] = time.perf_counter() - t0
        if eval_examples:
            if kind == "sft":
                nll, n = token_nll(self.engine.module, batch_of(eval_examples, pad), cap)
                sums["eval/loss"] = nll / max(n, 1.0)
            elif kind == "distill":
                batch = batch_of(eval_examples, pad)
                ids, logps = topk_tensors(reference["eval"], batch.responses.shape[1], settings["top_k"])
                sums.update(distill_eval(self.engine.module, batch, ids, logps, cap,
                                         **{k: v for k, v in distill.items() if k != "divergence_weight"}))
            else:
                sums.update(preference_eval(self.engine.module, pair_batch(eval_examples, pad), *ref["eval"], cap,
                                            **settings))
        self.key = next_key
        state = self.trainer_state()
        weights = self.engine.checkpoint_state_dict()
        if self.rank != 0:
            return sums, {}
        return sums, self._write_checkpoint(out, weights, None, state, sums)

    def free_port(self) -> tuple[str, int]:
        """(address, a free port) on this actor's node, for a model update group's store (tasks/loop/live_sync.py)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def join_update_group(self, address: str, port: int, world_size: int, token: str, timeout_s: float,
                          transport: str = "broadcast") -> str:
        """Rank 0 (the sender) of the model update group `token` (engines/weight_sync/update_group.py)."""
        return self.sync.join(address, port, world_size, 0, token, timeout_s, transport, "trainer rank 0")

    def update_group_state(self) -> dict:
        """As GenerationWorker.update_group_state: the usable group's token and transport, and this actor's node."""
        return self.sync.state()

    def send_weights(self, version: int, dtype: str, bucket_bytes: int) -> dict | None:
        """Called on every training rank at once. Rank 0 sends the weights of the last
        `step(keep_weights=True)` -- or, with none kept, its current weights, a sharded trainer's gathered
        one parameter at a time as each bucket fills while ranks > 0 take part in those gathers
        (`gather_only`) -- to the group's engines as `version`; it returns the sync's report
        (engines/weight_sync/gather.py `SyncReport`, plus `kept_bytes`: the bytes of the copies the step kept
        for it) once every engine verified it. Ranks > 0 return None."""
        import dataclasses

        from engines.weight_sync.gather import gather_only

        kept, weights, params, sharded = self.take_sync_weights()
        if self.rank != 0:
            if sharded and not kept:
                gather_only(params)
            return None
        if weights is None and not sharded and self.world_size > 1:
            raise RuntimeError(f"send_weights(v{version}): no weights kept by the last step (keep_weights=False) and "
                               f"the {self.engine.strategy.name} trainer's rank 0 does not gather them per bucket")
        if weights is None and not sharded:
            weights = self.own_weights()
        named = list(weights.items()) if weights is not None else params
        report = self.sync.group.send(named, version=version, dtype=dtype, bucket_bytes=bucket_bytes)
        own = {p.data_ptr() for _, p in params}  # a one-process trainer keeps its own tensors: no copy held
        held = sum(t.numel() * t.element_size() for t in weights.values() if t.data_ptr() not in own) if kept else 0
        return {**dataclasses.asdict(report), "kept_bytes": held}

    def take_sync_weights(self) -> tuple[bool, dict | None, list, bool]:
        """What a live sync of the last step reads, taken once (`send_weights`; a hybrid worker's
        `sync_in_process`, tasks/actors/hybrid.py): (whether the step kept weights for it, the weights this rank
        kept or None, the model's named parameters, resident again after placement.offload_train,
        whether they are shards)."""
        self.offload.reload()  # placement.offload_train: the weights back before they are read
        return self.kept.take(self.engine.model)

    def own_weights(self) -> dict:
        """This process's whole weights as the plain model's (LoRA merged): a trainer whose parameters
        are not shards."""
        from engines.training.lora import plain_model

        return self.engine.checkpoint_state_dict() or plain_model(self.engine.model).state_dict()

    def update(self, table, algorithm: AlgorithmConfig, training: TrainingConfig, temperature: float, seed: int,
               train_actor: bool = True) -> dict:
        """The update itself (engines/training/rl_step.py `train_update`: critic, then actor unless `train_actor`
        is False: critic warmup) on a scored table, objective state included; returns its metrics.
        `algorithm`, `training`: the config's AlgorithmConfig and TrainingConfig. Writes nothing."""
        from engines.training.rl_step import train_update
        from engines.data.rollout_table import batch_from_table

        self.offload.reload()
        batch = batch_from_table(table, self.tokenizer.pad_token_id)  # the one conversion
        metrics, self.algo_state = train_update(
            self.engine, self.critic_engine, batch, algorithm, self.algo_state, temperature=temperature,
            mini_batch_size=training.mini_batch_size, max_tokens_per_micro_batch=training.max_tokens_per_micro_batch,
            seed=seed, train_actor=train_actor)
        return metrics

    def trainer_state(self) -> dict:
        """Collective. What trainer_state.pt holds: optimizer moments and LR schedule (with LoRA the
        adapters and the frozen base's key), the objective state, the critic's optimizer state."""
        self.offload.reload()
        state = {**self.engine.state_dict(), "algorithm": self.algo_state.to_dict()}
        if self.engine.lora:  # the frozen base's key: a resume loads it and puts the adapters back on it
            state["lora_base"] = self.lora_base
        if self.critic_engine is not None:
            state["critic"] = self.critic_engine.state_dict()
        return state

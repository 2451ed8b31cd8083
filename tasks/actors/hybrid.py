"""placement.hybrid: the roles of actor_train's colocate group in one process per training worker
(verl's hybrid engine), instead of one Ray actor per role.

A `HybridWorker` hosts a TrainWorker (actor_train, and the critic it carries), a GenerationWorker
(actor_infer) and, when reference is in the same colocate group, a ReferenceWorker (on worker 0
only), each built on its first call with the arguments its own actor would get (`role_kwargs`). The
stage tasks get these roles' pools from `role_actors`: the role's own actors, or a `RoleView` per
hybrid worker, whose `view.method.remote(...)` runs that role's method inside the hybrid worker, in
the method's own concurrency group (a generation `abort` still reaches a running `generate`). So the
stages run unchanged, and:

- one process holds the trainer and the generator: one Python, torch and transformers runtime
  instead of two or three, and one heap, so the memory the training step frees is what the rollout
  reuses (engines/models/host_memory.py keeps freed memory in the process), the colocated peak going
  toward max(train, generate) rather than their sum (docs/placement.md has the measured figures);
- with sync.method=live the new weights go from the trainer's tensors into its own engine in the
  same process (`HybridWorker.sync_in_process`, engines/weight_sync/gather.py `copy_in_process`): no
  update group, no wire buffer. Each training rank fills its own worker's engine (a sharded trainer's
  parameters are gathered one at a time on every rank).

The checks that make it safe (a colocate group with actor_train and actor_infer, as many generation
as training workers, the hf engine, actors that outlive their task) are configs/hand_off.py
`hybrid_check`'s, at config load.
"""

from __future__ import annotations

import dataclasses
import threading

import ray

from infra.ray_session import actor_pool, shared_local_ray
from infra.resources import actor_options_for, role_devices
from tasks.actors.train import TrainWorker
from tasks.actors.generation import GenerationWorker, generation_worker_kwargs
from tasks.actors.process import actor_threads
from tasks.actors.reference import ReferenceWorker

HOSTED = {"actor_train": TrainWorker, "actor_infer": GenerationWorker, "reference": ReferenceWorker}


def hybrid_roles(cfg) -> tuple[str, ...]:
    """The roles a hybrid worker hosts (actor_train, actor_infer and reference when it is in their
    colocate group); () without placement.hybrid."""
    if not cfg.placement.hybrid:
        return ()
    group = next(g for g in cfg.placement.colocate if {"actor_train", "actor_infer"} <= set(g))
    return tuple(r for r in HOSTED if r in group)


POOLS = {"actor_train": "training", "actor_infer": "generation", "reference": "reference"}  # role -> its own pool's name


def role_kwargs(cfg, role: str) -> dict:
    """The constructor arguments of `role`'s worker (actor_train, actor_infer or reference), the same
    for its own actor and for its part of a hybrid worker."""
    if role == "actor_infer":
        return generation_worker_kwargs(cfg)
    return {"threads": actor_threads(cfg), "devices": role_devices(cfg, role, "critic")}


def part_kwargs(cfg) -> dict[str, dict]:
    """Each hosted role's constructor arguments (`role_kwargs`)."""
    return {r: role_kwargs(cfg, r) for r in hybrid_roles(cfg)}


def hybrid_workers(cfg, run_id: str) -> list:
    """The run's HybridWorker actors, one per training worker; each reserves the shares of the devices
    its hosted roles would have reserved apart (infra/resources.py `actor_options_for`)."""
    local = shared_local_ray()
    options = [actor_options_for(cfg, r, local) for r in hybrid_roles(cfg)]
    merged = {k: sum(o.get(k, 0) for o in options) for k in ("num_cpus", "num_gpus") if any(k in o for o in options)}
    return actor_pool(HybridWorker, "hybrid", cfg.training.num_workers, run_id,
                      {"threads": actor_threads(cfg), "parts": part_kwargs(cfg)}, merged)


def role_actors(cfg, run_id: str, role: str) -> list:
    """The actors serving placement role `role` (actor_train, actor_infer or reference; created on first
    use, reused by every task of a local run): with placement.hybrid and the role in actor_train's
    group, RoleViews of the hybrid workers (the reference: worker 0's alone); else the role's own
    pool (training.num_workers, rollout.num_workers or one reference actor, placed as its role)."""
    if role in hybrid_roles(cfg):
        workers = hybrid_workers(cfg, run_id)
        return [RoleView(w, role) for w in (workers[:1] if role == "reference" else workers)]
    count = {"actor_train": cfg.training.num_workers, "actor_infer": cfg.rollout.num_workers, "reference": 1}[role]
    return actor_pool(HOSTED[role], POOLS[role], count, run_id, role_kwargs(cfg, role),
                      actor_options_for(cfg, role, shared_local_ray()))


class RoleView:
    """One hosted role of a hybrid worker, called like that role's own actor: `view.load.remote(...)`
    runs the role's `load` in the worker. Picklable (a Ray actor handle and a role name)."""

    def __init__(self, handle, role: str):
        if role not in HOSTED:
            raise ValueError(f"a hybrid worker hosts {list(HOSTED)}, not {role!r}")
        self.handle, self.role = handle, role

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(HOSTED[self.role].__ray_actor_class__, name, None)
        if not callable(method):
            raise AttributeError(f"{HOSTED[self.role].__ray_actor_class__.__name__} has no method {name!r}")
        return _RoleMethod(self.handle, self.role, name, getattr(method, "__ray_concurrency_group__", None))

    def __eq__(self, other) -> bool:
        return isinstance(other, RoleView) and (self.role, self.handle._actor_id) == (other.role, other.handle._actor_id)

    def __hash__(self) -> int:
        return hash((self.role, self.handle._actor_id))

    def __repr__(self) -> str:
        return f"RoleView({self.role} in {self.handle})"


@dataclasses.dataclass(frozen=True)
class _RoleMethod:
    handle: object
    role: str
    name: str
    group: str | None

    def remote(self, *args, **kwargs):
        call = getattr(self.handle, f"call_{self.group}") if self.group else self.handle.call
        return call.remote(self.role, self.name, *args, **kwargs)  # object refs stay top-level: Ray resolves them


@ray.remote(concurrency_groups={"abort": 1, "stream": 4})
class HybridWorker:
    """The hosted roles' workers in one process (see the module docstring). Calls run one at a time
    in call order, except each role method's own concurrency group (GenerationWorker's `abort` and
    request-stream methods), as on the role's own actor."""

    def __init__(self, threads: int = 1, parts: dict[str, dict] | None = None):
        self.kwargs, self.parts, self.lock = dict(parts or {}), {}, threading.Lock()

    def _part(self, role: str):
        with self.lock:
            if role not in self.parts:
                if role not in self.kwargs:
                    raise ValueError(f"hybrid worker {ray.get_runtime_context().get_actor_name()} hosts {sorted(self.kwargs)}, "
                                     f"not {role} (placement.colocate decides which roles placement.hybrid puts in it)")
                part = HOSTED[role].__ray_actor_class__(**self.kwargs[role])
                if role == "actor_train":
                    part.kept.every_rank = True  # each rank fills its own worker's engine (sync_in_process)
                self.parts[role] = part
            return self.parts[role]

    def call(self, role: str, method: str, *args, **kwargs):
        return getattr(self._part(role), method)(*args, **kwargs)

    @ray.method(concurrency_group="abort")
    def call_abort(self, role: str, method: str, *args, **kwargs):
        return getattr(self._part(role), method)(*args, **kwargs)

    @ray.method(concurrency_group="stream")
    def call_stream(self, role: str, method: str, *args, **kwargs):
        return getattr(self._part(role), method)(*args, **kwargs)

    def hosted(self) -> dict:
        """{"roles": the roles built so far, "pid": this process} (tests and the memory benchmark)."""
        import os

        return {"roles": sorted(self.parts), "pid": os.getpid()}

    def sync_in_process(self, version: int, key: str) -> dict:
        """sync.method=live in a hybrid worker: the trainer's weights of its last step into this worker's
        generation engine, which then serves `key` as `version` (engines/weight_sync/update_group.py
        `copy_in_process`). Called on every training rank at once (a sharded trainer's gathers are
        collectives). Returns the report with the version the engine now serves."""
        from engines.weight_sync.gather import copy_in_process

        train, gen = self._part("actor_train"), self._part("actor_infer")
        _, weights, params, sharded = train.take_sync_weights()
        if weights is None and not sharded:
            weights = train.own_weights()
        named = list(weights.items()) if weights is not None else params
        report = gen.fill_weights(key, f"sync_in_process {key}", lambda engine: copy_in_process(named, engine, version))
        return {**dataclasses.asdict(report), "served": gen.engine.version}


def train_workers(cfg, run_id: str) -> list:
    """The run's TrainWorker actors (with placement.hybrid the training roles of the hybrid workers,
    tasks/actors/hybrid.py); with a distributed strategy, joined into one process group."""
    t = cfg.training
    workers = role_actors(cfg, run_id, "actor_train")
    if t.strategy != "torch":
        address = ray.get(workers[0].rendezvous.remote())
        ray.get([w.join_group.remote(rank, len(workers), address) for rank, w in enumerate(workers)])
    return workers

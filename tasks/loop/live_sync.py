"""sync.method=live: the trainer actor sends each new policy version straight to the generation
actors through a model update group (engines/weight_sync/update_group.py), instead of the generators fetching
the published checkpoint from the store.

Called by the training stage right after its step (tasks/stages/training.py), where the trainer and the
generators are alive together: a fused task (tasks/stages/fused.py) or a local run on one shared Ray
instance (infra/ray_session.py). The group (rank 0 = training actor rank 0, ranks 1..N = the
generation actors) is built once and reused while every member reports the same usable group over
`sync.transport`; a new or restarted actor, a failed sync or another transport makes the next sync
build a new one on a new port. The same-node transports (shm, cuda_ipc) are checked against the node
each actor reports when a group is built: members on more than one node are refused, naming them,
never sent another way. The checkpoint is still published by weight_sync for lineage and resume; the
generators then already serve its key, so the next rollout loads nothing.
"""

from __future__ import annotations

import uuid

import ray

from infra.ray_session import shared_local_ray
from infra.resources import check_sync_transport, role_devices
from tasks.actors.pools import generation_actors
from tasks.run.types import RunSpec


class LiveSyncError(RuntimeError):
    """A live sync that did not leave every generation engine serving the new version."""


def check_live_sync(cfg, fused: bool) -> None:
    """Refuse live sync where the training cluster is gone by the time the rollout starts."""
    if not (fused or shared_local_ray()):
        raise LiveSyncError("sync.method=live needs the trainer and the generation actors alive together (loop.fuse > 1, "
                            "or a local run with FLYROLL_RAY=shared); in per-task mode (one Ray cluster per stage) the "
                            "store is the hand-off, because the training cluster is gone when the rollout starts: set "
                            "sync.method: store")
    check_sync_transport(cfg)   # cuda_ipc: trainer and generators on cuda


def live_sync(spec: RunSpec, cfg, trainers: list, version: int, key: str) -> dict:
    """Send the training actors' weights of their last step (`trainers`: every training rank, rank 0
    first) to every generation actor as `version` (published as `key`); returns rank 0's report of the
    sync, with each engine's reported version. Every rank enters the sync: a sharded trainer's are
    gathered one parameter at a time as rank 0 fills each bucket (`TrainWorker.send_weights`). Raises
    LiveSyncError naming every engine (or training rank) that failed or reports another version."""
    if cfg.placement.hybrid:
        return _in_process(spec, trainers, version, key)
    gens = generation_actors(spec)
    names = [f"flyroll/{spec.run_id}/generation/{i}" for i in range(len(gens))]
    _ensure_group(trainers[0], gens, names, cfg.sync.transport, cfg.sync.timeout_s, version)
    dtype = role_devices(cfg, "actor_infer")["actor_infer"][1]
    sent = [t.send_weights.remote(version, dtype, cfg.sync.bucket_mb << 20) for t in trainers]
    got = [g.receive_weights.remote(key) for g in gens]
    problems, report = [], None
    for rank, ref in enumerate(sent):  # rank 0 reports the sync; ranks > 0 (their gathers) return None
        try:
            answer = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - reported with the engines' own errors below
            problems.append(f"trainer rank {rank}: {_short(e)}")
            continue
        if rank == 0:
            report = answer
    for name, ref in zip(names, got):
        try:
            served = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a dead actor (RayActorError) or the engine's WeightSyncError
            problems.append(f"generation engine {name}: {_short(e)}")
            continue
        if served != version:
            problems.append(f"generation engine {name} serves v{served}, expected v{version}")
    if problems:
        raise LiveSyncError(f"live weight sync of policy v{version} ({key}) failed: " + "; ".join(problems))
    return {**report, "engines": len(gens)}


def _in_process(spec: RunSpec, trainers: list, version: int, key: str) -> dict:
    """placement.hybrid: every hybrid worker copies its trainer rank's weights into its own engine
    (tasks/actors/hybrid.py `HybridWorker.sync_in_process`), all at once (a sharded trainer gathers on every
    rank); LiveSyncError naming each worker that failed or serves another version."""
    names = [f"flyroll/{spec.run_id}/hybrid/{i}" for i in range(len(trainers))]
    refs = [t.handle.sync_in_process.remote(version, key) for t in trainers]
    problems, reports = [], []
    for name, ref in zip(names, refs):
        try:
            reports.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - a dead worker (RayActorError) or a refused copy
            problems.append(f"hybrid worker {name}: {_short(e)}")
            continue
        if reports[-1]["served"] != version:
            problems.append(f"hybrid worker {name}'s engine serves v{reports[-1]['served']}, expected v{version}")
    if problems:
        raise LiveSyncError(f"live weight sync of policy v{version} ({key}) failed: " + "; ".join(problems))
    return {**reports[0], "engines": len(reports)}


def _ensure_group(trainer, gens: list, names: list[str], transport: str, timeout_s: float, version: int) -> None:
    """The trainer and every generation actor in one usable update group over `transport`; a new one
    when not (a same-node transport only when every actor reports the same Ray node)."""
    members, states, problems = ["trainer", *[f"generation engine {n}" for n in names]], [], []
    for who, actor in zip(members, [trainer, *gens]):
        try:
            states.append(ray.get(actor.update_group_state.remote()))
        except Exception as e:  # noqa: BLE001 - a dead actor
            problems.append(f"{who}: {_short(e)}")
    if problems:
        raise LiveSyncError(f"live weight sync of policy v{version}: not started: " + "; ".join(problems))
    first = states[0]
    if first["token"] is not None and first["transport"] == transport and all(s["token"] == first["token"] for s in states):
        return
    nodes = {who: s["node"] for who, s in zip(members, states)}
    if transport != "broadcast" and len(set(nodes.values())) > 1:
        raise LiveSyncError(f"live weight sync of policy v{version}: sync.transport={transport} needs the training actor "
                            "and every generation actor on one Ray node, and they are on " + ", ".join(
                                f"{who} on node {node}" for who, node in nodes.items()) +
                            "; set sync.transport: broadcast (any node), or place the roles on one node")
    token = uuid.uuid4().hex
    address, port = ray.get(trainer.free_port.remote())
    world = len(gens) + 1
    ray.get([trainer.join_update_group.remote(address, port, world, token, timeout_s, transport),
             *[g.join_update_group.remote(address, port, world, rank, token, timeout_s, transport)
               for rank, g in enumerate(gens, 1)]])


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1][:400] if text else ''}"

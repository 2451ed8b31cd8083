"""What every engine actor's process does first (tasks/actors/ (generation.py, reference.py, train.py)): the
CPU priority of the process that created it, its torch thread count (chosen for the model's size by
the creator, `actor_threads`, capped by its cores and Ray CPU reservation), and freed memory kept for
reuse; and where a placement role's models live."""

from __future__ import annotations

import json
import os
import typing

import ray

from engines.models.threads import adopt_niceness, model_threads, thread_count  # os only at import time (torch inside its functions)

if typing.TYPE_CHECKING:  # annotations only: an actor's process imports this module before it loads torch
    from configs.schema import FlyrollConfig


def policy_width(cfg: FlyrollConfig) -> int | None:
    """Hidden size of the run's policy: model.bootstrap's for the tiny model (model.path unset), a local
    model folder's config.json; None where it is known only once the model loads (a store key, a GGUF
    file, a package)."""
    if cfg.model.path is None:
        return cfg.model.bootstrap.hidden_size
    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return int(json.load(f)["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def actor_threads(cfg: FlyrollConfig) -> int:
    """The torch threads of the run's engine actors (generation, reference, training, hybrid):
    run.torch_threads, or 1 for a policy narrower than engines/models/threads.py SMALL_WIDTH
    (`model_threads`; a user's OMP_NUM_THREADS decides instead, FLYROLL_MAX_TORCH_THREADS caps).
    Decided here, in the process that creates the actors, where the environment is the user's, and
    handed to each actor before it loads torch (infra/ray_session.py `actor_pool` puts it in its
    OMP_NUM_THREADS; `engine_process` sets it, capped by the actor's cores and reservation)."""
    return model_threads(cfg.run.torch_threads, policy_width(cfg))


def capped_threads(n: int, ray_cpus: float | None = None) -> int:
    """`n`, capped by the cores this process may use (affinity, cgroup quota, `ray_cpus`), a user's
    OMP_NUM_THREADS and FLYROLL_MAX_TORCH_THREADS when set (engines/models/threads.py `thread_count`)."""
    return thread_count(n, ray_cpus)


def actor_process() -> None:
    """What every actor's process does first, an engine's or not: the niceness of the process that
    created it (engines/models/threads.py `adopt_niceness`; a Ray worker starts 15 levels below its
    raylet where the cluster was not started with RAY_worker_niceness=0). No torch."""
    adopt_niceness()


def engine_process(n: int) -> None:
    """An engine actor's process set-up: its creator's niceness (`actor_process`), `n` torch threads
    (`actor_threads`), capped by its cores and Ray CPU reservation (and FLYROLL_MAX_TORCH_THREADS when
    set: several runs sharing a box, e.g. the test suite's workers, would otherwise oversubscribe its
    cores) -- its OpenMP threads already wait passively (infra/ray_session.py `actor_pool` starts it
    so) -- and freed memory kept for reuse (engines/models/host_memory.py: no page faults on every
    large tensor of every step)."""
    actor_process()
    import torch

    from engines.models.host_memory import keep_freed_memory

    ctx = ray.get_runtime_context() if ray.is_initialized() else None
    in_actor = ctx is not None and ctx.worker.mode == ray.WORKER_MODE   # a driver (an engine built in-process) has no reservation
    cpus = ctx.get_assigned_resources().get("CPU") if in_actor else None
    torch.set_num_threads(capped_threads(n, cpus))
    keep_freed_memory()


def placed(devices: dict | None, role: str):
    """(torch device, torch dtype) of placement role `role` from the resolved `devices`
    ({role: (device, dtype)}, infra.resources.role_devices); cpu / float32 when not given."""
    from engines.models.devices import torch_device, torch_dtype

    device, dtype = (devices or {}).get(role, ("cpu", "float32"))
    return torch_device(device, role), torch_dtype(dtype)

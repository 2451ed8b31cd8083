"""What every engine actor's process does first (tasks/actors/ (generation.py, reference.py, train.py)): its
torch thread count, capped by its cores and Ray CPU reservation, and freed memory kept for reuse;
and where a placement role's models live."""

from __future__ import annotations

import ray

from engines.models.threads import thread_count  # os only at import time (torch inside its functions)


def capped_threads(n: int, ray_cpus: float | None = None) -> int:
    """`n`, capped by the cores this process may use (affinity, cgroup quota, `ray_cpus`), a user's
    OMP_NUM_THREADS and FLYROLL_MAX_TORCH_THREADS when set (engines/models/threads.py `thread_count`)."""
    return thread_count(n, ray_cpus)


def engine_process(n: int) -> None:
    """An engine actor's process set-up: `n` torch threads, capped by its cores and Ray CPU reservation
    (and FLYROLL_MAX_TORCH_THREADS when set: several runs sharing a box, e.g. the test suite's
    workers, would otherwise oversubscribe its cores) -- its OpenMP threads already wait passively
    (infra/ray_session.py `actor_pool` starts it so) -- and freed memory kept for reuse
    (engines/models/host_memory.py: no page faults on every large tensor of every step)."""
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

"""Compute per role, declared once: Flyte `Resources`, accelerator, Ray cluster spec, actor options.

Tasks import these by role. The profile is chosen when the workflow module is imported
(`FLYROLL_PROFILE=cpu|gpu`, default cpu) so `pyflyte package` compiles the resources into the
tasks; on a local run Flyte ignores task resources and Ray actors reserve no CPUs (stages run one
after another on the same few cores).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flytekit import Resources
from flytekit.extras.accelerators import A100, BaseAccelerator
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

ROLES = ("rollout", "scoring", "reference", "training", "weight_sync", "evaluation", "bootstrap")


@dataclass(frozen=True)
class RoleSpec:
    requests: Resources
    limits: Resources
    accelerator: BaseAccelerator | None
    ray_workers: int          # Ray worker pods besides the head (0 = everything on the head)
    actor_cpus: float         # CPUs each engine actor reserves on a real cluster
    actor_gpus: float         # GPUs each engine actor reserves on a real cluster


_CPU = {
    "rollout": RoleSpec(Resources(cpu="2", mem="4Gi"), Resources(cpu="2", mem="8Gi"), None, 0, 1, 0),
    "scoring": RoleSpec(Resources(cpu="2", mem="2Gi"), Resources(cpu="2", mem="4Gi"), None, 0, 0.5, 0),
    "reference": RoleSpec(Resources(cpu="2", mem="4Gi"), Resources(cpu="2", mem="8Gi"), None, 0, 1, 0),
    "training": RoleSpec(Resources(cpu="2", mem="6Gi"), Resources(cpu="2", mem="12Gi"), None, 0, 1, 0),
    "weight_sync": RoleSpec(Resources(cpu="1", mem="2Gi"), Resources(cpu="1", mem="4Gi"), None, 0, 0, 0),
    "evaluation": RoleSpec(Resources(cpu="2", mem="4Gi"), Resources(cpu="2", mem="8Gi"), None, 0, 1, 0),
    "bootstrap": RoleSpec(Resources(cpu="2", mem="4Gi"), Resources(cpu="2", mem="8Gi"), None, 0, 1, 0),
}
_GPU = {
    "rollout": RoleSpec(Resources(cpu="8", mem="64Gi", gpu="1"), Resources(cpu="8", mem="64Gi", gpu="1"), A100, 1, 4, 1),
    "scoring": RoleSpec(Resources(cpu="8", mem="16Gi"), Resources(cpu="8", mem="32Gi"), None, 1, 1, 0),
    "reference": RoleSpec(Resources(cpu="8", mem="64Gi", gpu="1"), Resources(cpu="8", mem="64Gi", gpu="1"), A100, 1, 4, 1),
    "training": RoleSpec(Resources(cpu="8", mem="96Gi", gpu="1"), Resources(cpu="8", mem="96Gi", gpu="1"), A100, 1, 4, 1),
    "weight_sync": RoleSpec(Resources(cpu="2", mem="8Gi"), Resources(cpu="2", mem="16Gi"), None, 0, 0, 0),
    "evaluation": RoleSpec(Resources(cpu="8", mem="64Gi", gpu="1"), Resources(cpu="8", mem="64Gi", gpu="1"), A100, 1, 4, 1),
    "bootstrap": RoleSpec(Resources(cpu="8", mem="32Gi", gpu="1"), Resources(cpu="8", mem="32Gi", gpu="1"), A100, 0, 4, 1),
}
PROFILES = {"cpu": _CPU, "gpu": _GPU}


def profile() -> str:
    name = os.environ.get("FLYROLL_PROFILE", "cpu")
    if name not in PROFILES:
        raise ValueError(f"FLYROLL_PROFILE={name!r}; expected one of {sorted(PROFILES)}")
    return name


def role(name: str) -> RoleSpec:
    return PROFILES[profile()][name]


def task_resources(name: str) -> dict:
    """Keyword arguments for `@task(...)`: requests, limits, accelerator."""
    spec = role(name)
    kw = {"requests": spec.requests, "limits": spec.limits}
    if spec.accelerator is not None:
        kw["accelerator"] = spec.accelerator
    return kw


def ray_job(name: str) -> RayJobConfig:
    """The ephemeral Ray cluster of a role's task (KubeRay on Kubernetes; a local Ray instance locally)."""
    spec = role(name)
    workers = []
    if spec.ray_workers:
        workers.append(WorkerNodeConfig(group_name=f"{name}-workers", replicas=spec.ray_workers, requests=spec.requests, limits=spec.limits))
    return RayJobConfig(
        head_node_config=HeadNodeConfig(requests=spec.requests, limits=spec.limits, ray_start_params={"num-cpus": spec.requests.cpu or "1"}),
        worker_node_config=workers,
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=120,
    )


def actor_options(name: str, local: bool) -> dict:
    """`.options(...)` for a role's engine actors. Local runs reserve nothing (stages are sequential)."""
    spec = role(name)
    if local:
        return {"num_cpus": 0}
    return {"num_cpus": spec.actor_cpus, "num_gpus": spec.actor_gpus}

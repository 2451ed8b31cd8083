# longer than 400 lines: compute declared once: per-role resources, Ray clusters, actor options, placement
"""Compute per role, declared once: Flyte `Resources`, accelerator, task image (infra/images.py), Ray cluster spec, actor options.

Tasks import these by role. The profile is chosen when the workflow module is imported
(`FLYROLL_PROFILE=cpu|gpu`, default cpu) so `pyflyte package` compiles the resources into the
tasks; on a local run Flyte ignores task resources and Ray actors reserve no CPUs (stages run one
after another on the same few cores).

Per-role placement (config `placement:`): `placement_plan(cfg)` resolves, per role (actor_train,
actor_infer, reference, critic, reward), its engine, worker count, per-worker resources and the
device and dtype its models use (`resolve_device`: 'auto' = cuda when its worker requests a GPU);
`task_resources_for` / `ray_job_for` / `actor_options_for` turn that into the hosting stage's
Flyte resources, its Ray cluster (one pod per worker) and the actors' reservations (colocated roles
reserve fractions of the same devices, separate roles whole ones). With `placement` left at its
defaults they return exactly the profile values above. `hosted_roles` / `task_actors` declare which
actors each stage task creates (what its Ray cluster must have room for; tests/infra/test_resources_placement.py).
The agentic rollout and evaluation tasks with `env.workers > 0` also start the env worker pool
(infra/env_pool.py): their cluster gets one more CPU-only pod of ceil(env.workers x env.worker_cpus)
CPUs (`env_pool_cpus`) and env.workers x env.worker_memory + 1Gi (`env_pool_memory_gi`) for it.
`pyflyte package` with FLYROLL_CONFIG=<preset> compiles a preset's placement into the tasks'
resources. `check_placement(cfg)` refuses, before any cluster starts, a role placed on cuda whose
worker requests no GPU, and a `sync.transport: cuda_ipc` whose trainer or generators are not on cuda.

This module only describes compute; infra/ray_cluster.py starts the clusters it describes (and
declares a stage's Ray task, `ray_job`), infra/ray_session.py runs the actors in them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, replace

from flytekit import Resources
from flytekit.extras.accelerators import A100, BaseAccelerator
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from configs.schema import ConfigError, load_config
from engines.models.devices import resolve_device
from infra.images import image_spec

ROLES = ("rollout", "scoring", "reference", "training", "weight_sync", "evaluation", "bootstrap")
# The tasks without a Ray cluster that are no weight sync, each with a role of its own so that each is sized
# (and shows in the Flyte UI) as what it is. Today each asks for what weight_sync asks for: one CPU and little
# memory (none of them loads a model but reference_policy, which imports model.reference_path once).
BOOKKEEPING_ROLES = (
    "setup",        # tasks/stages/prepare.py prepare_run, resume_point, reference_policy: the run's config, lock and start
    "dataset",      # make_dataset, env_dataset: a dataset version's splits, written to the store
    "controller",   # the @dynamic loops (workflows/) and loop_bounds: they only schedule other tasks
    "report",       # tasks/stages/evaluation.py finalize: the final report and MLflow close
    "promotion",    # workflows/schedules.py current_champion, promote: the champion alias
)


@dataclass
class FlyrollRayJobConfig(RayJobConfig):
    """A RayJobConfig that names the stage role it was made for (ROLES, or "fused"). Declare a Ray
    task with infra/ray_cluster.py `ray_job`: that module holds the Flyte task plugin that runs it."""

    role: str = ""


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
    **{name: RoleSpec(Resources(cpu="1", mem="2Gi"), Resources(cpu="1", mem="4Gi"), None, 0, 0, 0) for name in BOOKKEEPING_ROLES},
}
_GPU = {
    "rollout": RoleSpec(Resources(cpu="8", mem="64Gi", gpu="1"), Resources(cpu="8", mem="64Gi", gpu="1"), A100, 1, 4, 1),
    "scoring": RoleSpec(Resources(cpu="8", mem="16Gi"), Resources(cpu="8", mem="32Gi"), None, 1, 1, 0),
    "reference": RoleSpec(Resources(cpu="8", mem="64Gi", gpu="1"), Resources(cpu="8", mem="64Gi", gpu="1"), A100, 1, 4, 1),
    "training": RoleSpec(Resources(cpu="8", mem="96Gi", gpu="1"), Resources(cpu="8", mem="96Gi", gpu="1"), A100, 1, 4, 1),
    "weight_sync": RoleSpec(Resources(cpu="2", mem="8Gi"), Resources(cpu="2", mem="16Gi"), None, 0, 0, 0),
    "evaluation": RoleSpec(Resources(cpu="8", mem="64Gi", gpu="1"), Resources(cpu="8", mem="64Gi", gpu="1"), A100, 1, 4, 1),
    "bootstrap": RoleSpec(Resources(cpu="8", mem="32Gi", gpu="1"), Resources(cpu="8", mem="32Gi", gpu="1"), A100, 0, 4, 1),
    **{name: RoleSpec(Resources(cpu="2", mem="8Gi"), Resources(cpu="2", mem="16Gi"), None, 0, 0, 0) for name in BOOKKEEPING_ROLES},
}
PROFILES = {"cpu": _CPU, "gpu": _GPU}


def profile() -> str:
    name = os.environ.get("FLYROLL_PROFILE", "cpu")
    if name not in PROFILES:
        raise ValueError(f"FLYROLL_PROFILE={name!r}; expected one of {sorted(PROFILES)}")
    return name


def role(name: str) -> RoleSpec:
    return PROFILES[profile()][name]


def packaged_config():
    """The config named by FLYROLL_CONFIG at import/package time, or None."""
    path = os.environ.get("FLYROLL_CONFIG")
    if not path:
        return None
    cfg = load_config(path)
    check_placement(cfg)
    return cfg


def task_resources(name: str) -> dict:
    """Keyword arguments for `@task(...)`: requests, limits, accelerator."""
    if name == "fused":  # its pod is the head of its cluster, training's head
        name = "training"
    cfg = packaged_config()
    if cfg is not None and name in _POOLS:
        return task_resources_for(cfg, name)
    return _profile_task_resources(name)


def _profile_task_resources(name: str) -> dict:
    spec = role(name)
    kw = {"requests": spec.requests, "limits": spec.limits, "container_image": image_spec(profile())}
    if spec.accelerator is not None:
        kw["accelerator"] = spec.accelerator
    return kw


def stage_ray_job(cfg, name: str) -> RayJobConfig:
    """Stage `name`'s Ray cluster (KubeRay on Kubernetes; a local Ray instance locally) for `cfg`
    (None: the profile's): `ray_job_for` for the stages that
    host engine pools, `fused_ray_job` for the fused task, else the profile's."""
    if name == "fused":
        return fused_ray_job(cfg)
    if cfg is not None and name in _POOLS:
        return _with_env_workers(cfg, name, ray_job_for(cfg, name))
    return _profile_ray_job(name)


ENV_POOL_TASKS = ("rollout", "evaluation")  # tasks/stages/agentic.py starts RayEnvPool in rollout_episodes and evaluate_episodes


def env_pool_cpus(cfg, task: str) -> int:
    """CPUs the env worker pool (infra/env_pool.py: env.workers actors of env.worker_cpus each) needs in
    stage `task`'s Ray cluster: 0 unless the task is an agentic one that starts it (env.workers > 0).
    Rounded up to whole CPUs: a Ray node's num-cpus is an integer."""
    e = getattr(cfg, "env", None)
    if e is None or not e.workers or task not in ENV_POOL_TASKS:
        return 0
    return math.ceil(e.workers * e.worker_cpus - 1e-9)


ENV_POD_RAY_GI = 1.0         # the env workers' pod beyond its actors: Ray's own processes (raylet, agents)...
ENV_POD_OBJECT_STORE_GI = 0.5  # ...of which this is the object store (env calls pass short strings)


def env_worker_memory_bytes(cfg) -> int:
    """`env.worker_memory` in bytes: what each env worker actor reserves (Ray's `memory`)."""
    return int(_gi(cfg.env.worker_memory) * 2**30)


def env_pool_memory_gi(cfg, task: str) -> float:
    """Memory (Gi) of the env workers' pod: env.workers x env.worker_memory for the actors plus
    ENV_POD_RAY_GI for the Ray node itself; 0 where the task starts no pool."""
    if not env_pool_cpus(cfg, task):
        return 0.0
    return cfg.env.workers * _gi(cfg.env.worker_memory) + ENV_POD_RAY_GI


def _with_env_workers(cfg, task: str, job: RayJobConfig) -> RayJobConfig:
    """`job` plus one CPU-only pod of `env_pool_cpus` CPUs and `env_pool_memory_gi` memory for the env
    worker actors, so they run on CPUs of their own instead of taking the generation actors'
    (RayEnvPool refuses a pool larger than the cluster). Its Ray node offers exactly the actors'
    memory (`memory`), the object store taking part of the headroom, so the actors' reservations
    fit whatever Ray's default split of the pod would be."""
    cpus = env_pool_cpus(cfg, task)
    if not cpus:
        return job
    mem = f"{env_pool_memory_gi(cfg, task):g}Gi"
    req, lim = Resources(cpu=str(cpus), mem=mem), Resources(cpu=str(cpus), mem=mem)
    params = {"num-cpus": str(cpus), "memory": str(cfg.env.workers * env_worker_memory_bytes(cfg)),
              "object-store-memory": str(int(ENV_POD_OBJECT_STORE_GI * 2**30))}
    group = WorkerNodeConfig(group_name=f"{task}-env-workers", replicas=1, requests=req, limits=lim,
                             ray_start_params=params)
    return dataclasses.replace(job, worker_node_config=[*job.worker_node_config, group])


FUSED_STAGES = ("training", "rollout", "reference", "scoring")  # evaluation uses rollout's and scoring's actors


def fused_ray_job(cfg) -> RayJobConfig:
    """The Ray cluster of `loop.fuse` (tasks/stages/fused.py): the four stage clusters in one -- training's
    head pod as head, every other node of the four as worker groups -- so each actor the fused
    iterations create has the room its own stage's cluster gives it."""
    jobs = [stage_ray_job(cfg, s) for s in FUSED_STAGES]
    groups = list(jobs[0].worker_node_config)
    for stage, job in zip(FUSED_STAGES[1:], jobs[1:]):
        head = job.head_node_config
        groups.append(WorkerNodeConfig(group_name=f"fused-{stage}-head", replicas=1, requests=head.requests,
                                       limits=head.limits, ray_start_params=head.ray_start_params))
        groups += [replace(g, group_name=f"fused-{stage}-{g.group_name}") for g in job.worker_node_config]
    return FlyrollRayJobConfig(role="fused", head_node_config=jobs[0].head_node_config, worker_node_config=groups,
                               shutdown_after_job_finishes=True, ttl_seconds_after_finished=120)


def _profile_ray_job(name: str) -> RayJobConfig:
    spec = role(name)
    workers = []
    if spec.ray_workers:
        workers.append(WorkerNodeConfig(group_name=f"{name}-workers", replicas=spec.ray_workers, requests=spec.requests, limits=spec.limits))
    return FlyrollRayJobConfig(
        role=name,
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


# --- per-role placement (config `placement:`) ------------------------------------------------------

# placement role -> (the stage task that hosts it, the actor pool that runs it; critic rides in the
# training workers)
HOSTS = {"actor_infer": ("rollout", "generation"), "reward": ("scoring", "reward"), "reference": ("reference", "reference"),
         "actor_train": ("training", "training"), "critic": ("training", "training")}
_POOLS = {task: pool for task, pool in HOSTS.values()}  # stage task -> its actor pool
_POOLS["evaluation"] = "generation"  # the eval task serves the policy with actor_infer's generation actors


def hosted_roles(cfg, task: str) -> tuple[str, ...]:
    """The placement roles whose actors stage task `task` creates on its own Ray cluster (the critic
    rides inside the training actors). Under dynamic sampling (`algorithm.filter_groups`) and with
    `rollout.score_while_generating` the rollout task also hosts the reward workers: it scores its
    samples (and refills the batch with its own generation actors, tasks/stages/rollout.py), so no
    generation actor is ever created in a cluster declared without room for one (the scoring task's
    has no GPU on the gpu profile). A DPO run's training task (tasks/stages/post_training.py
    `post_train`) also hosts the reference."""
    roles = {task_: (role,) for role, (task_, _) in HOSTS.items() if role != "critic"}
    roles["evaluation"] = ("actor_infer", "reward")  # greedy responses, scored by the run's reward workers
    if cfg.scores_in_rollout:
        roles["rollout"] += ("reward",)
    if getattr(cfg, "dpo", None) is not None:  # DPO's training task asks the reference actor for the pairs' log-probs
        roles["training"] += ("reference",)
    roles["fused"] = tuple(dict.fromkeys(r for s in FUSED_STAGES for r in roles[s]))  # every stage, one cluster
    return roles.get(task, ())


def task_actors(cfg, task: str) -> list[tuple[str, dict]]:
    """(placement role, Ray `.options(...)` on a cluster) of every actor stage task `task` can hold
    at once: `num_workers` per hosted role, and ("env", ...) per env worker actor in the agentic
    rollout and evaluation tasks (env.workers > 0). What its RayJobConfig (`stage_ray_job`) must have room for."""
    plan = placement_plan(cfg)
    actors = [(r, actor_options_for(cfg, r, local=False)) for r in hosted_roles(cfg, task) for _ in range(plan[r].num_workers)]
    if env_pool_cpus(cfg, task):  # the env worker pool's actors (infra/env_pool.py RayEnvPool)
        actors += [("env", {"num_cpus": cfg.env.worker_cpus, "memory": env_worker_memory_bytes(cfg)})] * cfg.env.workers
    return actors


@dataclass(frozen=True)
class RolePlan:
    """One role, resolved: engine and worker count from its config section, per-worker resources
    from `placement` (or the profile), the roles it shares devices with (itself included)."""

    role: str
    task: str
    pool: str
    engine: str
    num_workers: int
    cpu: float
    gpu: float
    memory_gi: float
    group: tuple[str, ...]
    custom: bool  # placement sets something for it (else the profile's values apply unchanged)
    device: str = "cpu"      # where its models live: "cpu" / "cuda" (`placement.<role>.device`, resolved)
    dtype: str = "float32"   # "float32" / "bfloat16" / "float16" (`placement.<role>.dtype`, resolved)


def _gi(mem: str) -> float:
    units = {"Ki": 1 / 2**20, "Mi": 1 / 2**10, "Gi": 1.0, "Ti": 2**10}
    return float(mem[:-2]) * units[mem[-2:]]


def placement_plan(cfg) -> dict[str, RolePlan]:
    """role -> RolePlan for the five placement roles of a FlyrollConfig."""
    p, gae = cfg.placement, cfg.algorithm.advantage == "gae"
    groups = [tuple(g) for g in p.colocate]
    if not any("critic" in g for g in groups):  # the critic always shares the training workers
        groups = [g + ("critic",) if "actor_train" in g else g for g in groups]
    engines = {"actor_infer": (cfg.rollout.engine, cfg.rollout.num_workers), "reward": ("reward_fn", cfg.reward.num_workers),
               "reference": ("torch", 1), "actor_train": (cfg.training.strategy, cfg.training.num_workers),
               "critic": (cfg.training.strategy if gae else "none", cfg.training.num_workers if gae else 0)}
    plan = {}
    for name, (task, pool) in HOSTS.items():
        spec, res = role(task), getattr(p, name)
        extra = name == "critic"  # the critic's resources come on top of actor_train's, default none
        group = next((g for g in groups if name in g), (name,))
        plan[name] = RolePlan(
            role=name, task=task, pool=pool, engine=engines[name][0], num_workers=engines[name][1],
            cpu=res.cpu if res.cpu is not None else (0.0 if extra else float(spec.actor_cpus)),
            gpu=res.gpu if res.gpu is not None else (0.0 if extra else float(spec.actor_gpus)),
            memory_gi=_gi(res.memory) if res.memory else (0.0 if extra else _gi(spec.requests.mem)),
            group=group, custom=(res.cpu, res.gpu, res.memory) != (None, None, None) or len(group) > 1)
    for name, r in plan.items():  # device/dtype: 'auto' follows the GPUs of the worker the role runs in
        res = getattr(p, name)
        device, dtype = resolve_device(res.device, res.dtype, _pool_footprint(plan, r.pool)[1])
        plan[name] = replace(r, device=device, dtype=dtype)
    return plan


def check_placement(cfg) -> None:
    """Refuse (ConfigError) a placement that asks for `device: cuda` in a role whose worker requests
    no GPU. Called where a run's config is loaded, before any cluster starts (tasks/stages/prepare.py
    `prepare_run`, the eval and bench CLIs, `pyflyte package` with FLYROLL_CONFIG): the check needs
    the profile's GPU requests, which are compute, not config (so configs/schema.py cannot make it)."""
    check_sync_transport(cfg)
    gpu_roles = [r for r in ("actor_train", "actor_infer", "reference", "critic", "reward")
                 if getattr(cfg.placement, r).device == "cuda"]
    if not gpu_roles:
        return
    plan = placement_plan(cfg)
    for r in gpu_roles:
        gpus = sum(p.gpu for p in plan.values() if p.pool == plan[r].pool)  # the critic rides in actor_train's workers
        if gpus <= 0:
            raise ConfigError(
                f"placement.{r}.device='cuda' but role {r!r} requests no GPU under FLYROLL_PROFILE={profile()} "
                f"(its worker's GPUs: {gpus:g}; placement.{r}.gpu={getattr(cfg.placement, r).gpu}, None = the "
                "profile's default: 0 on cpu, 1 on gpu except reward); expected a GPU request: set "
                f"placement.{'actor_train' if r == 'critic' else r}.gpu (e.g. 1)"
                f"{' or run with FLYROLL_PROFILE=gpu' if profile() == 'cpu' else ''}, or set placement.{r}.device "
                "to 'auto' or 'cpu'")


def check_sync_transport(cfg) -> None:
    """Refuse (ConfigError) `sync.transport: cuda_ipc` unless actor_train and actor_infer both resolve to
    cuda: the trainer fills a CUDA buffer and the generation engines map it by its IPC handle, so both
    processes need a GPU. (That every member sits on one node is checked where the actors are known,
    tasks/loop/live_sync.py.)"""
    if cfg.sync.method != "live" or cfg.sync.transport != "cuda_ipc":
        return
    plan = placement_plan(cfg)
    off = [f"{r} on {plan[r].device}" for r in ("actor_train", "actor_infer") if plan[r].device != "cuda"]
    if off:
        raise ConfigError(
            f"sync.transport='cuda_ipc' shares each bucket as a CUDA buffer between the training actor and the generation "
            f"actors, but placement resolves {', '.join(off)} (FLYROLL_PROFILE={profile()}); expected actor_train and "
            "actor_infer on cuda (placement.<role>.gpu, or FLYROLL_PROFILE=gpu): set sync.transport to 'shm' (one node, "
            "CPU memory) or 'broadcast'")


def role_devices(cfg, *roles: str) -> dict[str, tuple[str, str]]:
    """role -> its resolved (device, dtype), what the engine actors of tasks/actors/ and tasks/actors/train.py take."""
    plan = placement_plan(cfg)
    return {r: (plan[r].device, plan[r].dtype) for r in roles}


def _pool_footprint(plan: dict[str, RolePlan], pool: str) -> tuple[float, float, float, bool]:
    """(cpu, gpu, memory Gi, custom) one worker of `pool` needs: the sum over the roles it hosts."""
    roles = [r for r in plan.values() if r.pool == pool and (r.num_workers or r.role != "critic")]
    return (sum(r.cpu for r in roles), sum(r.gpu for r in roles), sum(r.memory_gi for r in roles),
            any(r.custom for r in roles))


def task_resources_for(cfg, task: str) -> dict:
    """`@task(...)` resources of the stage hosting a placement role: one pod = one worker (at least
    the profile's pod CPUs and memory, which leave room for the task's own process)."""
    cpu, gpu, mem, custom = _pool_footprint(placement_plan(cfg), _POOLS[task])
    if not custom:
        return _profile_task_resources(task)
    pod = role(task).requests
    cpu, mem = max(cpu, float(pod.cpu)), max(mem, _gi(pod.mem))
    res = Resources(cpu=f"{cpu:g}", mem=f"{mem:g}Gi", gpu=str(math.ceil(gpu)) if gpu else None)
    kw = {"requests": res, "limits": res, "container_image": image_spec(profile())}
    if gpu:
        kw["accelerator"] = role(task).accelerator or A100
    return kw


def ray_job_for(cfg, task: str) -> RayJobConfig:
    """The stage's Ray cluster sized for its role's workers: the head pod hosts worker 0, a worker
    group of `num_workers - 1` pods the rest, each pod with one worker's resources."""
    plan = placement_plan(cfg)
    pool = _POOLS[task]
    cpu, gpu, mem, custom = _pool_footprint(plan, pool)
    if not custom:
        return _with_guest_workers(cfg, task, _profile_ray_job(task))
    n = max(r.num_workers for r in plan.values() if r.pool == pool)
    kw = task_resources_for(cfg, task)
    params = {"num-cpus": kw["requests"].cpu, **({"num-gpus": f"{math.ceil(gpu)}"} if gpu else {})}
    workers = [WorkerNodeConfig(group_name=f"{task}-workers", replicas=n - 1, requests=kw["requests"], limits=kw["limits"],
                                ray_start_params=params)] if n > 1 else []
    return _with_guest_workers(cfg, task, FlyrollRayJobConfig(
        role=task,
        head_node_config=HeadNodeConfig(requests=kw["requests"], limits=kw["limits"], ray_start_params=params),
        worker_node_config=workers,
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=120,
    ))


def _with_guest_workers(cfg, task: str, job: RayJobConfig) -> RayJobConfig:
    """`job` plus, per role the task hosts besides its own pool (reward workers in the evaluation
    task, and in the rollout task under dynamic sampling), a worker group of one pod per worker
    sized as that role's own stage sizes its pods (the scoring task's) -- when `placement` sets
    either pool's resources. With both at the profile's, the profile's pods hold them beside the
    engines (1 reward CPU next to 4 of 8 engine CPUs on gpu; tests/infra/test_resources_placement.py checks every preset)."""
    plan = placement_plan(cfg)
    groups = list(job.worker_node_config)
    own_custom = _pool_footprint(plan, _POOLS[task])[3]
    for r in hosted_roles(cfg, task):
        home = plan[r].task
        if plan[r].pool == _POOLS[task] or not plan[r].num_workers:
            continue
        if not (own_custom or _pool_footprint(plan, plan[r].pool)[3]):
            continue
        kw = task_resources_for(cfg, home)
        params = {"num-cpus": kw["requests"].cpu, **({"num-gpus": kw["requests"].gpu} if kw["requests"].gpu else {})}
        groups.append(WorkerNodeConfig(group_name=f"{task}-{plan[r].pool}-workers", replicas=plan[r].num_workers,
                                       requests=kw["requests"], limits=kw["limits"], ray_start_params=params))
    return job if groups == list(job.worker_node_config) else dataclasses.replace(job, worker_node_config=groups)


def actor_options_for(cfg, role_name: str, local: bool) -> dict:
    """`.options(...)` for a placement role's actors. Colocated roles whose actors share a Ray
    cluster (all of them on a local run, the stage's own on a cluster) each reserve 1/k of their
    worker's CPUs and GPUs, so Ray packs them onto the same devices; a separate role reserves whole
    ones. Local runs reserve no CPUs (stages are sequential), only GPUs a role asks for."""
    plan = placement_plan(cfg)
    me = plan[role_name]
    cpu, gpu, _, custom = _pool_footprint(plan, me.pool)
    if not custom:
        return actor_options(me.task, local)
    sharing = {plan[r].pool for r in me.group if local or plan[r].task == me.task}
    share = max(1, len(sharing))
    if local:
        return {"num_cpus": 0, **({"num_gpus": gpu / share} if gpu else {})}
    return {"num_cpus": cpu / share, "num_gpus": gpu / share}

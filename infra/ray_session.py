"""Ray inside a Flyte task: the cluster the task's RayJobConfig brought up, and its engine actors.

Remote: each task has its own ephemeral Ray cluster (KubeRay), so actors are created per task.
Local (`pyflyte run` without --remote), `FLYROLL_RAY=shared` (default): the Ray plugin starts one
local Ray instance for the first Ray task and every later task reuses it; engine actors are named
per run and role and reused too, so a model is loaded once per process and then only updated in
place. `shutdown()` ends it at the end of the run. `FLYROLL_RAY=per-task`: each Ray task starts and
stops its own local cluster, as on Kubernetes (infra/ray_cluster.py).
"""

from __future__ import annotations

import logging
import os

from engines.models.threads import NICE_ENV, child_env, niceness

MODES = ("shared", "per-task")  # FLYROLL_RAY: one local Ray instance for the run, or a cluster per task
WORKER_NICENESS = "RAY_worker_niceness"  # how many nice levels below its raylet Ray starts a worker (default 15)


def ray_mode() -> str:
    mode = os.environ.get("FLYROLL_RAY", "shared")
    if mode not in MODES:
        raise ValueError(f"FLYROLL_RAY={mode!r}; expected one of {list(MODES)}")
    return mode


class _QuietReinit(logging.Filter):
    """Every Ray task of a local run calls ray.init() on the shared instance; Ray logs each at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Calling ray.init() again" not in record.getMessage()


for _name in ("ray", "ray._private.worker", "ray.worker"):
    logging.getLogger(_name).addFilter(_QuietReinit())

# Handles of the actors this process created, by name. A named Ray actor that is not detached is
# still garbage-collected once no handle to it exists, so a local run keeps its handles here.
_HANDLES: dict[str, object] = {}


def is_local_execution() -> bool:
    from flytekit.core.context_manager import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    return bool(state and state.is_local_execution())


def shared_local_ray() -> bool:
    """A local run whose Ray tasks share one Ray instance, and its named actors, across tasks
    (`FLYROLL_RAY=shared`). False on a cluster and in the local per-task mode: there each task's
    actors live and die with its own Ray cluster, reserve what they would on a cluster, and load
    their weights from the store."""
    return is_local_execution() and ray_mode() == "shared"


def equal_worker_priority() -> None:
    """Give the workers of a Ray that this process starts (local runs: the shared instance, a per-task
    cluster) this process's CPU priority: Ray starts every worker, so every actor, RAY_worker_niceness
    (default 15) nice levels below its raylet, and beside a nice-0 job sharing its cores a nice-15
    actor gets 36/1060 of a core (the tiny run's stages were 13-20x slower beside one 2-thread torch
    job, the bootstrap in this process 1.5x; engines/models/threads.py). Sets RAY_worker_niceness=0 in
    this process's environment, which the raylet it starts reads; a user's own value is kept. Call it
    before ray.init() starts Ray (connecting to a running one is unaffected: there each actor lowers
    its own, `adopt_niceness`)."""
    os.environ.setdefault(WORKER_NICENESS, "0")


def actor_priority_env() -> dict[str, str]:
    """FLYROLL_NICENESS for an actor's environment: this process's niceness, which the actor takes when
    Ray started it at a higher one (engines/models/threads.py `adopt_niceness`: a cluster started
    without RAY_worker_niceness=0) -- none when the user set RAY_worker_niceness to something else,
    asking for Ray's workers to run below this process."""
    return {NICE_ENV: str(niceness())} if os.environ.get(WORKER_NICENESS, "0") == "0" else {}


def ensure_ray() -> None:
    """Start/connect Ray when a task body runs outside the Ray plugin (e.g. unit tests)."""
    import ray

    if not ray.is_initialized():
        equal_worker_priority()
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=True)


def actor_pool(actor_cls, role: str, count: int, run_id: str, init_kwargs: dict, options: dict) -> list:
    """`count` actors of `actor_cls` for `role`; reused across tasks of a local run (named, per run).
    Each actor process starts with the passive OpenMP wait policy, its torch thread count
    (`init_kwargs["threads"]`, when it takes one; engines/models/threads.py `child_env`) and this
    process's niceness (`actor_priority_env`) in its environment, set before it loads torch; the
    engine actors take the niceness and the threads first thing (tasks/actors/process.py `engine_process`)."""

    ensure_ray()
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**child_env(init_kwargs.get("threads"), options.get("num_cpus")), **actor_priority_env(),
                               **runtime_env.get("env_vars", {})}
    options = {**options, "runtime_env": runtime_env}
    actors = []
    for i in range(count):
        name = f"flyroll/{run_id}/{role}/{i}"
        # detached: a local run's actors outlive the task that made them (the local Ray instance, and
        # they with it, ends with the run); on a cluster the task's Ray cluster ends them anyway
        handle = actor_cls.options(name=name, namespace="flyroll", get_if_exists=True, lifetime="detached", max_concurrency=1, **options).remote(**init_kwargs)
        _HANDLES[name] = handle
        actors.append(handle)
    return actors


def kill_pool(role: str, count: int, run_id: str) -> None:
    import ray

    for i in range(count):
        name = f"flyroll/{run_id}/{role}/{i}"
        _HANDLES.pop(name, None)
        try:
            ray.kill(ray.get_actor(name, namespace="flyroll"))
        except ValueError:
            pass


def shutdown() -> None:
    """End the local Ray instance of this process (a no-op when none runs)."""
    import ray

    _HANDLES.clear()
    if ray.is_initialized():
        ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)

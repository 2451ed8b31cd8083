"""Which Ray cluster a stage task runs on, and the local per-task mode that mirrors KubeRay.

Every Ray stage task is declared with `ray_job(stage)`: a `FlyrollRayJobConfig` (infra/resources.py,
a flytekitplugins-ray `RayJobConfig` that also names the stage's role), which this module's task
plugin runs -- so a task declared with it always finds the plugin registered. On a Flyte cluster it compiles to the same RayJob as the plugin's
own config: KubeRay brings up the head and worker pods for the task and tears them down after it.

Locally there are two modes (`FLYROLL_RAY`, infra/ray_session.py `ray_mode`):

- `shared` (default): the Ray plugin starts one local Ray instance for the first Ray task and every
  later task reuses it, with its named engine actors (a model is loaded once, then updated in place).
- `per-task`: each Ray task starts its own Ray cluster -- a head node plus one Ray node per worker
  replica of the RayJobConfig the run's config gives that stage (`infra.resources.ray_job_for`),
  each node with the CPUs/GPUs its pod would request -- creates its actors there with the
  reservations they would make on a cluster, and shuts the cluster down when the task ends, as
  KubeRay does. So actors are created per task and load their weights from the store, and an actor
  that does not fit its task's cluster waits there as it would on Kubernetes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from unittest import mock

from flytekit.core.context_manager import ExecutionParameters
from flytekit.extend import TaskPlugins
from flytekitplugins.ray import RayJobConfig
from flytekitplugins.ray.task import RayFunctionTask
from rich.console import Console

from configs.schema import FlyrollConfig
from infra.ray_session import equal_worker_priority, is_local_execution, ray_mode, shutdown
from infra.resources import FlyrollRayJobConfig, packaged_config, stage_ray_job

_OBJECT_STORE_MB = {"head": 512, "worker": 256}   # per local node (memory-backed /dev/shm)

console = Console(stderr=True, highlight=False, soft_wrap=True)

# the cluster of the Ray task running now in this process (per-task mode), for stage metrics
CURRENT: dict[str, float] = {}


def ray_job(name: str) -> RayJobConfig:
    """`@task(task_config=ray_job(stage))`: the stage's ephemeral Ray cluster (KubeRay on Kubernetes;
    a local Ray instance, or its own cluster under FLYROLL_RAY=per-task, locally), sized for the
    config named by FLYROLL_CONFIG at package time, else by the profile."""
    return stage_ray_job(packaged_config(), name)


def _cpus_gpus(params: dict | None, requests) -> tuple[float, float]:
    params = params or {}
    cpu = params.get("num-cpus") or (requests.cpu if requests is not None else None) or 1
    gpu = params.get("num-gpus") or (requests.gpu if requests is not None else None) or 0
    return float(cpu), float(gpu)


def node_shapes(job: RayJobConfig) -> list[tuple[str, float, float]]:
    """(node name, CPUs, GPUs) of every Ray node `job` declares: the head, then each worker replica."""
    head = job.head_node_config
    shapes = [("head", *_cpus_gpus(head.ray_start_params if head else None, head.requests if head else None))]
    for group in job.worker_node_config:
        cpu, gpu = _cpus_gpus(group.ray_start_params, group.requests)
        shapes += [(f"{group.group_name}-{i}", cpu, gpu) for i in range(group.replicas)]
    return shapes


TEMP_PREFIX = "flyroll-ray-"
OWNER_FILE = "owner.pid"   # in a cluster's temp dir: the pid of the process that started it


def _users(path: str) -> list[int]:
    """Pids of the running processes that name `path` on their command line (Ray's GCS, raylets,
    monitors and workers are started with their session folder under it)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if path.encode() in f.read():
                    pids.append(int(pid))
        except OSError:   # gone meanwhile, or not ours to read
            continue
    return pids


def reap_orphan_clusters(parent: str, wait_s: float = 10.0) -> list[str]:
    """Stop and remove the per-task clusters under `parent` whose starting process is gone.

    A task killed with SIGKILL skips `task_cluster`'s cleanup: its Ray processes (GCS, raylets,
    monitors) exit on their own once their driver is gone, but its temp dir (session files, logs)
    stays. Such a cluster is found by its dir's owner file naming a pid that no longer exists. Any
    process whose command line still names that dir is killed, then the dir is removed. A dir without
    an owner file (one being created now, or not ours) is left alone. Returns the dirs removed."""
    import signal

    removed = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        path = os.path.join(parent, name)
        if not name.startswith(TEMP_PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = int(f.read())
        except (OSError, ValueError):
            continue
        if os.path.exists(f"/proc/{owner}"):
            continue
        for pid in _users(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while _users(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def start_local_cluster(nodes: list[dict], temp_dir: str, log_to_driver: bool = True):
    """A `ray.cluster_utils.Cluster` with one node per `nodes` entry (`add_node` keyword arguments,
    e.g. num_cpus, num_gpus, resources, object_store_memory), its session files in `temp_dir`, this
    process connected to it. The caller shuts it down (`shutdown()`, then `cluster.shutdown()`)."""
    import ray
    from ray._private.authentication.authentication_token_setup import (enable_token_auth_by_default,
                                                                        ensure_token_if_auth_enabled)
    from ray.cluster_utils import Cluster

    # token authentication as ray.init() sets it up for a new cluster (on unless RAY_AUTH_MODE says
    # otherwise; a token in ~/.ray created when missing): `Cluster` does neither, and with
    # RAY_AUTH_MODE=token in the environment (any earlier ray.init() in this process sets it) but no
    # token, its GCS never came up ("Timed out waiting for file .../gcs_server_port_...")
    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)
    equal_worker_priority()   # its raylets start the actors at this process's priority, not 15 nice levels below
    cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
    try:
        # no entry in /tmp/ray/ray_current_cluster: `Cluster` writes its head's address there "for unit
        # testing", and any `ray.init()` without an address on this machine would then join this cluster
        # (another run's shared instance, a test's ray.init(num_cpus=...)), and fail once it is gone
        with mock.patch.object(ray._private.utils, "write_ray_address", lambda *a, **k: None):
            for node in nodes:
                # no autoscaler monitor (no_monitor): the cluster's shape is fixed, as a RayJob's without
                # autoscaling is; the monitor is one more Python process to start and stop per task (about
                # 1.4 CPU-s and 1 s of shutdown on 2 cores)
                cluster.add_node(include_dashboard=False, no_monitor=True, temp_dir=temp_dir, **node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=log_to_driver)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


@contextmanager
def task_cluster(job: RayJobConfig, role: str):
    """A fresh local Ray cluster shaped like `job` (one Ray node per pod), connected for the body and
    shut down after it, whatever the body does."""
    shutdown()
    shapes = node_shapes(job)
    t0 = time.perf_counter()
    # its own Ray temp dir (session files and logs, removed after)
    parent = os.environ.get("RAY_TMPDIR") or "/tmp"
    for path in reap_orphan_clusters(parent):
        console.print(f"[dim]ray per-task: stopped and removed {path}, a cluster whose task process was killed[/]")
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    with open(os.path.join(temp_dir, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    nodes = [{"num_cpus": cpu, "num_gpus": gpu, "object_store_memory": _OBJECT_STORE_MB["head" if name == "head" else "worker"] << 20}
             for name, cpu, gpu in shapes]
    cluster = None
    try:
        cluster = start_local_cluster(nodes, temp_dir, log_to_driver=True)
        started = time.perf_counter() - t0
        CURRENT.update(start_s=started, nodes=float(len(shapes)))
        console.print(f"[dim]ray per-task: {role} cluster, {len(shapes)} node(s) "
                      f"({', '.join(f'{n} {c:g} CPU' + (f' {g:g} GPU' if g else '') for n, c, g in shapes)}), "
                      f"started in {started:.1f}s[/]")
        yield cluster
    finally:
        t1 = time.perf_counter()
        shutdown()  # disconnect, forget this process's actor handles and RAY_ADDRESS
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        CURRENT.clear()
        console.print(f"[dim]ray per-task: {role} cluster shut down in {time.perf_counter() - t1:.1f}s[/]")


def stage_job(task_config: RayJobConfig, role: str, spec) -> RayJobConfig:
    """The Ray cluster a stage needs for this run: sized from the run's config (its `placement`),
    else (no RunSpec among the inputs) the config the task was compiled with."""
    if spec is None:
        return task_config
    return stage_ray_job(FlyrollConfig.model_validate_json(spec.config_json), role)


class FlyrollRayTask(RayFunctionTask):
    """The Ray plugin's task, plus the local per-task mode (see the module docstring)."""

    def _per_task(self) -> bool:
        return ray_mode() == "per-task" and is_local_execution()

    def pre_execute(self, user_params: ExecutionParameters) -> ExecutionParameters:
        if self._per_task():
            return user_params          # the cluster starts in execute(), where the run's config is known
        if is_local_execution():
            equal_worker_priority()     # the plugin's ray.init() starts the run's local Ray: actors at our priority
        return super().pre_execute(user_params)

    def execute(self, **kwargs):
        if not self._per_task():
            return super().execute(**kwargs)
        role = self.task_config.role or self.name.rsplit(".", 1)[-1]
        with task_cluster(stage_job(self.task_config, role, kwargs.get("spec")), role):
            return super().execute(**kwargs)


TaskPlugins.register_pythontask_plugin(FlyrollRayJobConfig, FlyrollRayTask)

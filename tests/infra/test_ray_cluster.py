"""infra/ray_cluster.py: the local per-task Ray cluster (FLYROLL_RAY=per-task) has the nodes its
RayJobConfig declares, is gone after the task, and is never found by another `ray.init()` on the
machine (a concurrent run's shared instance, a test's `ray.init(num_cpus=...)`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flytekit import Resources
from flytekitplugins.ray import HeadNodeConfig, WorkerNodeConfig

from infra.ray_cluster import OWNER_FILE, TEMP_PREFIX, node_shapes, _users, reap_orphan_clusters, task_cluster
from infra.ray_session import ray_mode
from infra.resources import FlyrollRayJobConfig

REPO = Path(__file__).resolve().parents[2]


def _job() -> FlyrollRayJobConfig:
    pod = Resources(cpu="1", mem="1Gi")
    return FlyrollRayJobConfig(role="training", head_node_config=HeadNodeConfig(requests=pod, ray_start_params={"num-cpus": "2"}),
                               worker_node_config=[WorkerNodeConfig(group_name="w", replicas=2, requests=pod)])


def _cmdlines(path: str) -> list[bytes]:
    """The command lines of the running processes that name `path` (a cluster's temp dir)."""
    out = []
    for pid in _users(path):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read())
        except OSError:   # gone meanwhile
            continue
    return out


def test_node_shapes_follow_the_job():
    assert node_shapes(_job()) == [("head", 2.0, 0.0), ("w-0", 1.0, 0.0), ("w-1", 1.0, 0.0)]


def test_ray_mode_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setenv("FLYROLL_RAY", "fused")
    with pytest.raises(ValueError, match=r"FLYROLL_RAY='fused'; expected one of \['shared', 'per-task'\]"):
        ray_mode()


@pytest.mark.timeout(300)
def test_task_cluster_has_the_declared_nodes_and_cannot_be_found_by_another_init(tmp_path):
    import ray

    from ray._private.services import find_bootstrap_address

    with task_cluster(_job(), "training") as cluster:
        assert ray.is_initialized()
        assert sorted(n["Resources"].get("CPU") for n in ray.nodes() if n["Alive"]) == [1.0, 1.0, 2.0]
        assert ray.cluster_resources()["CPU"] == 4.0
        assert find_bootstrap_address(None) != cluster.address   # the default temp dir does not name it
        # and no autoscaler monitor among its processes: the shape is fixed (one process less per task)
        procs = _cmdlines(cluster.head_node.get_temp_dir_path())
        assert any(b"gcs_server" in c for c in procs) and not any(b"autoscaler/_private/monitor.py" in c for c in procs)
        # another process's plain ray.init() starts its own instance instead of joining this cluster
        probe = ("import ray; ray.init(num_cpus=1, include_dashboard=False); "
                 "print(len(ray.nodes()), ray.cluster_resources()['CPU']); ray.shutdown()")
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == ["1", "1.0"], out.stdout
    assert not ray.is_initialized() and "RAY_ADDRESS" not in os.environ


@pytest.mark.timeout(300)
@pytest.mark.parametrize("auth_mode", ["token", None])
def test_task_cluster_starts_with_or_without_token_auth_and_no_token_yet(tmp_path, auth_mode):
    """RAY_AUTH_MODE=token in the environment (what any earlier ray.init() in a process leaves there)
    with a fresh HOME (no ~/.ray token): the cluster still starts, as ray.init() would."""
    probe = ("import ray\nfrom tests.infra.test_ray_cluster import _job\nfrom infra.ray_cluster import task_cluster\n"
             "with task_cluster(_job(), 'training'):\n    print('cpus', ray.cluster_resources()['CPU'])\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "HOME": str(tmp_path),
           "RAY_gcs_server_port_wait_time_s": "15"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)
    if auth_mode:
        env["RAY_AUTH_MODE"] = auth_mode
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "cpus 4.0" in out.stdout, out.stderr[-3000:]


def _cluster_dir(parent: Path, name: str, owner: int | None) -> Path:
    d = parent / f"{TEMP_PREFIX}{name}"
    (d / "session_x").mkdir(parents=True)
    if owner is not None:
        (d / OWNER_FILE).write_text(str(owner))
    return d


def test_reap_removes_only_clusters_whose_owner_is_gone(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    gone = _cluster_dir(tmp_path, "gone", int(dead))
    live = _cluster_dir(tmp_path, "live", os.getpid())
    unowned = _cluster_dir(tmp_path, "unowned", None)   # being created, or not flyroll's
    other = tmp_path / "not-flyroll"
    other.mkdir()
    (other / OWNER_FILE).write_text(dead)
    # a process still naming the dead owner's dir (a straggling raylet) is stopped before the removal
    straggler = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(120)", str(gone / "session_x")])
    try:
        # until its exec, the child's command line is still this process's: wait until it names the dir
        # (a loaded box took long enough that the reap ran first and found nobody to stop)
        for _ in range(1000):
            if straggler.pid in _users(str(gone)):
                break
            time.sleep(0.01)
        assert straggler.pid in _users(str(gone))
        assert reap_orphan_clusters(str(tmp_path)) == [str(gone)]
        assert straggler.wait(timeout=10) == -9
    finally:
        straggler.kill()
    assert not gone.exists() and live.exists() and unowned.exists() and other.exists()


@pytest.mark.timeout(300)
def test_a_killed_task_leaves_a_cluster_dir_that_the_next_cluster_removes(monkeypatch):
    import signal
    import tempfile
    import time

    parent = Path(tempfile.mkdtemp(prefix="frk", dir="/tmp"))   # short: Ray's socket paths are length-limited
    probe = ("import time\nfrom tests.infra.test_ray_cluster import _job\nfrom infra.ray_cluster import task_cluster\n"
             "with task_cluster(_job(), 'training'):\n    print('ready', flush=True)\n    time.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(parent)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        (left,) = parent.glob(f"{TEMP_PREFIX}*")
        proc.send_signal(signal.SIGKILL)   # no finally, no atexit: the task's own cleanup never runs
        proc.wait(timeout=30)
        time.sleep(1)
        assert left.exists()
        monkeypatch.setenv("RAY_TMPDIR", str(parent))
        with task_cluster(_job(), "training"):
            assert not left.exists()
            assert not _users(str(left))
            (mine,) = parent.glob(f"{TEMP_PREFIX}*")
            assert (mine / OWNER_FILE).read_text() == str(os.getpid())
        assert not list(parent.glob(f"{TEMP_PREFIX}*"))
    finally:
        proc.kill()
        shutil.rmtree(parent, ignore_errors=True)


"""Every actor kind the stages create gets the workflow process's CPU policy, in every Ray mode
(tasks/actors/process.py, engines/models/threads.py, infra/ray_session.py): the passive OpenMP wait in
its environment from its first instruction (so before torch loads), the workflow process's niceness
(Ray alone starts workers 15 nice levels below), and for the engine actors one torch thread for the
tiny policy (the preset asks for 2: `model_threads`). Each actor is created through the stages' own
code (`role_actors`, `RayRewards`) on a real Ray started as the mode starts it, and looked at from
inside (`__ray_call__`). Untimed: speed is benchmarks/contention.py's."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import yaml
from flytekit.core.context_manager import ExecutionState, FlyteContextManager

from configs.schema import parse_config
from engines.models.threads import PASSIVE
from tests.support.thread_probe import look_inside as look
from tests.support.workflow import REPO

ENGINES = ("actor_infer", "reference", "actor_train")
RUN = "policy"


def niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def _tiny(**overrides):
    raw = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())   # run.torch_threads: 2
    return parse_config({**raw, **overrides})


def seen_in_every_kind(cfg, hybrid_cfg=None) -> dict[str, dict]:
    """{kind: `look`} for the generation, reference, training and reward actors (and the hybrid worker)."""
    from tasks.actors.hybrid import role_actors
    from tasks.actors.pools import RayRewards
    from tasks.run.types import RunSpec

    seen = {role: ray.get(role_actors(cfg, RUN, role)[0].__ray_call__.remote(look)) for role in ENGINES}
    spec = RunSpec(cfg.to_json(), cfg.hash(), RUN, "", "", "")
    seen["reward"] = ray.get(RayRewards(spec).workers[0].__ray_call__.remote(look))
    if hybrid_cfg is not None:
        (view, *_) = role_actors(hybrid_cfg, "hybrid-" + RUN, "reference")
        ray.get(view.pad_id.remote())                          # builds the hosted reference part
        seen["hybrid"] = ray.get(view.handle.__ray_call__.remote(look))
    return seen


def policy_failures(seen: dict[str, dict], nice: int) -> list[str]:
    """What each actor lacks of the policy (empty: all of it)."""
    wrong = []
    for kind, s in seen.items():
        start = {k: s["start"].get(k) for k in (*PASSIVE, "OMP_NUM_THREADS")}
        if any(start[k] != v for k, v in PASSIVE.items()):
            wrong.append(f"{kind}: started without the passive wait ({start})")
        if s["nice"] != nice:
            wrong.append(f"{kind}: runs at nice {s['nice']}, the workflow process at {nice}")
        if kind != "reward" and (start["OMP_NUM_THREADS"], s["torch_threads"]) != ("1", 1):
            wrong.append(f"{kind}: OMP_NUM_THREADS={start['OMP_NUM_THREADS']} at start, {s['torch_threads']} torch "
                         "threads (the tiny policy: 1)")
    return wrong


def test_actor_threads_by_the_policy_width(tmp_path, monkeypatch):
    """The engine actors' torch threads: one for the tiny policy (the preset asks for 2), as asked for a
    wider one (a local model folder's config.json) or one whose width is not known before it loads; a
    user's OMP_NUM_THREADS decides instead."""
    from tasks.actors.process import actor_threads, policy_width

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (policy_width(_tiny()), actor_threads(_tiny())) == (128, 1)
    (tmp_path / "config.json").write_text('{"hidden_size": 576}')
    assert (policy_width(_tiny(model={"path": str(tmp_path)})), actor_threads(_tiny(model={"path": str(tmp_path)}))) == (576, 2)
    assert (policy_width(_tiny(model={"path": "runs/other/policy/v0003"})), actor_threads(_tiny(model={"path": "runs/other/policy/v0003"}))) == (None, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert actor_threads(_tiny()) == 2


@contextlib.contextmanager
def local_run(monkeypatch, mode: str):
    """A local Flyte execution (what `pyflyte run` gives a task) with FLYROLL_RAY=`mode`, the driver's
    environment as a run's: no thread or niceness setting of the user's, the repo on the workers' path."""
    for k in ("OMP_NUM_THREADS", "FLYROLL_MAX_TORCH_THREADS", "RAY_worker_niceness"):
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)                  # restored (absent, or the value it had) after the test
    monkeypatch.setenv("FLYROLL_RAY", mode)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("FLYROLL_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "flyroll-process-test-cache"))
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_execution_state(
            ctx.execution_state.with_params(mode=ExecutionState.Mode.LOCAL_TASK_EXECUTION))):
        yield


def test_shared_local_ray_actors_get_the_policy(monkeypatch):
    """FLYROLL_RAY=shared (the default run): Ray started by a stage task's own pre_execute (the Ray plugin's
    ray.init), as the first Ray task of a local run starts it."""
    from infra.ray_session import shutdown
    from tasks.stages.reference import reference_forward

    assert not ray.is_initialized(), "a Ray instance left running by an earlier test"
    with local_run(monkeypatch, "shared"):
        reference_forward.pre_execute(FlyteContextManager.current_context().user_space_params)
        try:
            seen = seen_in_every_kind(_tiny(), _tiny(placement={"colocate": [list(ENGINES)], "hybrid": True}))
        finally:
            shutdown()
    assert not policy_failures(seen, niceness()), policy_failures(seen, niceness())


@pytest.mark.slow
def test_per_task_cluster_actors_get_the_policy(monkeypatch):
    """FLYROLL_RAY=per-task: the fused task's own cluster (infra/ray_cluster.py `task_cluster`, a Ray node
    per pod), the actors reserving what they would on Kubernetes."""
    from infra.ray_cluster import task_cluster
    from infra.resources import stage_ray_job

    cfg = _tiny()
    with local_run(monkeypatch, "per-task"), task_cluster(stage_ray_job(cfg, "fused"), "fused"):
        seen = seen_in_every_kind(cfg)
    assert not policy_failures(seen, niceness()), policy_failures(seen, niceness())


@pytest.fixture(scope="module")
def started_cluster():
    """A Ray cluster started beforehand with `ray start` and none of flyroll's settings (Ray's default
    worker niceness, no wait policy in its environment), as a user or a node's entrypoint starts one;
    yields its address. Stopped (its process group killed) and its folder removed after the module."""
    temp = Path(tempfile.mkdtemp(prefix="fr-ray-", dir="/tmp"))   # short: Ray's unix socket paths are length-limited
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}
    log = temp / "start.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
                                 "--port", "0", "--num-cpus", "8", "--temp-dir", str(temp), "--include-dashboard=false",
                                 "--disable-usage-stats"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "ray start --address=" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield log.read_text().split("ray start --address='", 1)[1].split("'", 1)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):   # the address `ray start` left for plain ray.init() calls
            os.remove("/tmp/ray/ray_current_cluster")


def may_lower_niceness() -> bool:
    """Whether a process here may lower its niceness again (root, CAP_SYS_NICE or RLIMIT_NICE)."""
    probe = "import os\nos.nice(1)\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)\n" \
            "    print(1)\nexcept OSError:\n    print(0)\n"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "1"


@pytest.mark.nightly   # `ray start` writes /tmp/ray/ray_current_cluster, which every plain ray.init() on the box then
# connects to: beside other tests (CI's two workers) their Ray failed to start ("Failed to start GCS")
def test_actors_on_a_started_cluster_get_the_policy(monkeypatch, started_cluster):
    """RAY_ADDRESS of a running cluster (FLYROLL_RAY=shared connects to it): nothing of flyroll's in the
    raylet's environment, its workers 15 nice levels below it: every actor still starts with the wait
    policy (the engine actors with their thread count), and takes the workflow process's niceness where
    the system allows (tasks/actors/process.py `actor_process`)."""
    from infra.ray_session import shutdown
    from tasks.stages.reference import reference_forward

    monkeypatch.setenv("RAY_ADDRESS", started_cluster)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with local_run(monkeypatch, "shared"):
        reference_forward.pre_execute(FlyteContextManager.current_context().user_space_params)
        try:
            seen = seen_in_every_kind(_tiny())
        finally:
            shutdown()
    if not may_lower_niceness():
        pytest.skip(f"this system lets no process lower its niceness: the actors stay at nice {seen['reference']['nice']}")
    assert not policy_failures(seen, niceness()), policy_failures(seen, niceness())

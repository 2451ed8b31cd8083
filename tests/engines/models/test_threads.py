"""engines/models/threads.py: a passive OpenMP wait policy set before torch loads, and thread counts capped by
the cores a process may use (affinity, cgroup quota, Ray reservation), in every flyroll process."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.models import threads
from tests.support.thread_probe import ThreadProbe

REPO = Path(__file__).resolve().parents[3]
CLEAN = {k: v for k, v in os.environ.items() if k not in (*threads.PASSIVE, "OMP_NUM_THREADS", threads.MAX_ENV)}


def test_passive_wait_policy_unless_the_user_chose_one():
    assert threads.wait_policy_env({}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
    assert threads.wait_policy_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}         # the user's choice, whole
    assert threads.wait_policy_env({"GOMP_SPINCOUNT": "1000"}) == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    env = {"PATH": "/bin"}
    assert threads.set_wait_policy(env) == threads.PASSIVE and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert threads.set_wait_policy(env) == {}                                  # idempotent


@pytest.mark.parametrize("requested, ray_cpus, affinity, quota, environ, expected", [
    (4, None, 2, None, {}, 2),             # two CPUs in the affinity mask
    (None, None, 8, None, {}, 8),          # no request: all it may use
    (None, None, 8, 1.5, {}, 2),           # cgroup quota 150000/100000 -> 2 (rounded up)
    (None, None, 8, 0.5, {}, 1),
    (8, 3.0, 16, None, {}, 3),             # Ray reserved 3 CPUs for the actor
    (2, 0, 16, None, {}, 2),               # a local actor reserves none: no cap from Ray
    (8, None, 16, None, {"OMP_NUM_THREADS": "3"}, 3),             # the user's OMP_NUM_THREADS
    (8, None, 16, None, {"FLYROLL_MAX_TORCH_THREADS": "1"}, 1),   # the operator's cap
    (8, None, 16, None, {"OMP_NUM_THREADS": "junk"}, 8),
    (0, None, 16, None, {}, 1),            # never below 1
])
def test_thread_count_caps(requested, ray_cpus, affinity, quota, environ, expected):
    assert threads.thread_count(requested, ray_cpus, affinity=affinity, quota=quota, environ=environ) == expected


@pytest.mark.parametrize("requested, width, environ, expected", [
    (2, 128, {}, 1),                            # the tiny preset's policy: one thread, whatever run.torch_threads asks
    (2, threads.SMALL_WIDTH - 1, {}, 1),
    (2, threads.SMALL_WIDTH, {}, 2),            # from SMALL_WIDTH on: as asked
    (4, 576, {}, 4),                            # SmolLM2
    (None, 128, {}, 1),
    (None, 576, {}, None),                      # as many as the process may use (`thread_count` decides)
    (2, None, {}, 2),                           # width not known before the model loads: as asked
    (2, 128, {"OMP_NUM_THREADS": "2"}, 2),      # the user's explicit count decides, not the width
    (2, 128, {"OMP_NUM_THREADS": "junk"}, 1),
    (2, 128, {"FLYROLL_MAX_TORCH_THREADS": "4"}, 1),   # a cap asks for nothing
])
def test_model_threads_one_for_a_small_model_unless_the_user_chose(requested, width, environ, expected):
    assert threads.model_threads(requested, width, environ) == expected


def test_model_threads_stay_under_every_cap():
    """What the callers do with it (`thread_count`, `child_env`): the operator's and the user's caps still hold."""
    caps = {"FLYROLL_MAX_TORCH_THREADS": "1"}
    assert threads.thread_count(threads.model_threads(4, 576, caps), affinity=8, quota=None, environ=caps) == 1
    user = {"OMP_NUM_THREADS": "4"}
    assert threads.thread_count(threads.model_threads(2, 128, user), affinity=8, quota=None, environ=user) == 2
    assert threads.thread_count(threads.model_threads(8, 128, user), affinity=2, quota=None, environ=user) == 2


def test_adopt_niceness_lowers_to_the_starters_never_raises_and_says_when_it_may_not():
    """In a child process (a niceness, once raised, may not come back down without the privilege): raised by
    2, it takes its starter's back, or -- where the system refuses (no root, CAP_SYS_NICE or RLIMIT_NICE) --
    keeps its own and warns, naming the fix."""
    probe = ("import os, warnings\n"
             "from engines.models.threads import adopt_niceness\n"
             "base = os.getpriority(os.PRIO_PROCESS, 0)\n"
             "unasked = adopt_niceness({})\n"
             "higher = adopt_niceness({'FLYROLL_NICENESS': str(base + 5)})\n"
             "os.nice(2)\n"
             "with warnings.catch_warnings(record=True) as w:\n"
             "    warnings.simplefilter('always')\n"
             "    now = adopt_niceness({'FLYROLL_NICENESS': str(base)})\n"
             "print([base, unasked, higher, now, [str(x.message) for x in w]])\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**CLEAN, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    base, unasked, higher, now, said = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert unasked is None and higher == base            # nothing asked; never raised to a starter's higher one
    if now == base:                                      # lowered (root, CAP_SYS_NICE or RLIMIT_NICE)
        assert not said
    else:
        assert now == base + 2 and len(said) == 1 and "RAY_worker_niceness=0" in said[0], said


def test_adopt_niceness_refused_keeps_the_process_as_it_is_and_names_the_fix(monkeypatch):
    """An unprivileged actor on a cluster started with Ray's default worker niceness (15)."""
    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(threads, "niceness", lambda: 15)
    monkeypatch.setattr(threads.os, "setpriority", refuse)
    with pytest.warns(UserWarning, match=r"nice 15 .* its starter's 0 \(Operation not permitted\).*RAY_worker_niceness=0"):
        assert threads.adopt_niceness({threads.NICE_ENV: "0"}) == 15


def test_cgroup_quota_files(tmp_path):
    v2 = tmp_path / "cpu.max"
    none = (str(tmp_path / "q"), str(tmp_path / "p"))
    v2.write_text("150000 100000\n")
    assert threads.cgroup_cpus(str(v2), none) == 1.5
    v2.write_text("max 100000\n")
    assert threads.cgroup_cpus(str(v2), none) is None
    (tmp_path / "q").write_text("200000\n")
    (tmp_path / "p").write_text("100000\n")
    assert threads.cgroup_cpus(str(tmp_path / "absent"), none) == 2.0       # cgroup v1
    (tmp_path / "q").write_text("-1\n")
    assert threads.cgroup_cpus(str(tmp_path / "absent"), none) is None


def test_child_env_carries_the_policy_and_the_capped_request(monkeypatch):
    for k in (*threads.PASSIVE, "OMP_NUM_THREADS", threads.MAX_ENV):
        monkeypatch.delenv(k, raising=False)
    assert threads.child_env() == threads.PASSIVE
    assert threads.child_env(4, 2.0)["OMP_NUM_THREADS"] == "2"
    assert threads.child_env(2, 0)["OMP_NUM_THREADS"] == "2"     # a local actor: Ray would set 1
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv(threads.MAX_ENV, "1")
    assert threads.child_env(2) == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("entry", ["workflows.rlvr", "infra.cli", "infra.eval_cli", "tasks.stages.rollout", "benchmarks.bench"])
def test_entry_modules_set_the_wait_policy_before_torch_loads(entry):
    """Each entry module, imported in a fresh interpreter, has the policy in os.environ -- and torch,
    if the import loaded it, was loaded after (libgomp reads it once, at load)."""
    probe = ("import builtins, os, sys\n"
             "seen = {}\n"
             "real = builtins.__import__\n"
             "def spy(name, *a, **k):\n"
             "    if name.split('.')[0] == 'torch' and 'torch' not in sys.modules and 'at' not in seen:\n"
             "        seen['at'] = os.environ.get('OMP_WAIT_POLICY')\n"
             "    return real(name, *a, **k)\n"
             "builtins.__import__ = spy\n"
             f"import {entry}\n"
             "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), seen.get('at', 'none'))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**CLEAN, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    policy, spin, at_torch = out.stdout.split()[-3:]
    assert (policy, spin) == ("PASSIVE", "0")
    assert at_torch in ("PASSIVE", "none"), f"torch loaded before the policy was set ({at_torch})"


def test_ray_actor_starts_with_the_passive_policy_and_capped_threads(tmp_path):
    """An engine actor made by `actor_pool` (a local run's: it reserves no CPU, so Ray alone would set
    OMP_NUM_THREADS=1) has the policy in its environment from its first instruction, and torch uses
    its requested threads capped by its cores."""
    import ray

    from infra.ray_session import actor_pool, kill_pool

    env = {k: os.environ.pop(k) for k in (*threads.PASSIVE, "OMP_NUM_THREADS", threads.MAX_ENV) if k in os.environ}
    started = not ray.is_initialized()
    try:
        if started:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        (actor,) = actor_pool(ray.remote(ThreadProbe), "probe", 1, f"threads-{tmp_path.name}", {"threads": 2}, {"num_cpus": 0})
        seen = ray.get(actor.seen.remote())
        kill_pool("probe", 1, f"threads-{tmp_path.name}")
    finally:
        os.environ.update(env)
        if started:
            ray.shutdown()
    assert seen["OMP_WAIT_POLICY"] == "PASSIVE" and seen["GOMP_SPINCOUNT"] == "0" and seen["KMP_BLOCKTIME"] == "0", seen
    expected = min(2, threads.affinity_cpus())
    assert seen["OMP_NUM_THREADS"] == "2" and seen["torch_threads"] == expected, seen


def test_router_threads_run_with_the_engine_threads_count():
    """vLLM's CPU worker sets its OpenMP thread count on the thread that built the engine (not through
    torch); a router's thread is new and would start from OMP_NUM_THREADS, and vLLM's CPU attention
    refuses a step planned with one count and run with another (CI: "thread_num == thread_num (2 vs. 1)").
    Here libgomp's own omp_set_num_threads(2) under OMP_NUM_THREADS=1 and `torch.set_num_threads`
    made a no-op, as vLLM leaves them: a plain new thread sees 1; both routers' threads
    (`inherit_threads`) see 2."""
    probe = (
        "import ctypes, threading, torch\n"
        "from engines.generation.engine import Completion, SamplingParams\n"
        "from engines.generation.router import BatchingRouter, ContinuousRouter\n"
        "from tests.support.streaming import ScriptedStreamingEngine\n"
        "torch.get_num_threads()\n"
        "gomp = next(p for p in open('/proc/self/maps').read().split() if 'libgomp' in p)\n"
        "ctypes.CDLL(gomp).omp_set_num_threads(2)\n"
        "torch.set_num_threads = lambda n: None\n"     # what vLLM's CPU worker leaves after its binding
        "seen = {'main': torch.get_num_threads()}\n"
        "t = threading.Thread(target=lambda: seen.update(plain=torch.get_num_threads())); t.start(); t.join()\n"
        "class Batch:\n"
        "    def generate(self, prompts, params, abort=None):\n"
        "        seen['batching'] = torch.get_num_threads()\n"
        "        return [Completion(i, 0, [1], [0.0], 'length') for i in range(len(prompts))]\n"
        "class Stream(ScriptedStreamingEngine):\n"
        "    def step_deltas(self):\n"
        "        seen['continuous'] = torch.get_num_threads()\n"
        "        return super().step_deltas()\n"
        "p = SamplingParams(temperature=0.0, max_new_tokens=2)\n"
        "for r in (BatchingRouter([Batch()]), ContinuousRouter(Stream())):\n"
        "    r.submit([2, 5], p).result(timeout=60)\n"
        "    r.close()\n"
        "print(seen)\n")
    env = {**CLEAN, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert seen["main"] == 2 and seen["plain"] == 1, seen     # the trap, in this torch build
    assert seen["batching"] == 2 and seen["continuous"] == 2, seen

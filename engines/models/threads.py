"""CPU threads that do not collapse when another job shares the cores.

torch's CPU kernels run on an OpenMP thread pool (GNU libgomp in the Linux wheels:
`torch.__config__.parallel_info()`). By default a libgomp thread that finishes its share of a
parallel region spins for a while before it sleeps. On an idle box that saves a wake-up; beside a
second busy process the spinning threads burn the cores the other process needs and wait for
threads that are not scheduled: on the 2-core box the tiny bootstrap's step took 2.83 s at two
threads beside one other job, against 0.42 s with a passive wait policy (docs/benchmarks.md,
"Contention"). So every flyroll process

1. sets a passive wait policy (`wait_policy_env`: OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=0 for
   libgomp, KMP_BLOCKTIME=0 for LLVM/Intel OpenMP) *before torch loads* -- libgomp reads them once,
   when the library is loaded, so the entry modules call `set_wait_policy()` first thing and Ray
   actors get them in their runtime_env; and
2. uses at most as many threads as it has cores (`thread_count`): the request, capped by the CPUs
   it may run on (`os.sched_getaffinity`), its cgroup CPU quota (`/sys/fs/cgroup/cpu.max`, or
   cgroup v1's cfs quota), its Ray CPU reservation, a user's OMP_NUM_THREADS and
   FLYROLL_MAX_TORCH_THREADS.

A user's explicit OMP_WAIT_POLICY (then none of ours is set), GOMP_SPINCOUNT or KMP_BLOCKTIME is kept. Plain
Python and os only, so it can run before anything else is imported.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping, MutableMapping

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
MAX_ENV = "FLYROLL_MAX_TORCH_THREADS"  # an operator's cap for every process of a run (e.g. a shared CI box)
CPU_MAX = "/sys/fs/cgroup/cpu.max"                                                    # cgroup v2
CFS = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")  # cgroup v1


def wait_policy_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to `environ` (default os.environ) for a passive wait: those of PASSIVE
    not set there, or none when the user chose a policy (OMP_WAIT_POLICY set: an ACTIVE stays whole)."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ:
        return {}
    return {k: v for k, v in PASSIVE.items() if k not in environ}


def set_wait_policy(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put the passive wait policy into `environ` (default os.environ, so child processes inherit it);
    returns what it set. Warns when torch is already imported in this process (too late for it)."""
    target = os.environ if environ is None else environ
    added = wait_policy_env(target)
    target.update(added)
    if added and environ is None and "torch" in sys.modules:
        warnings.warn("engines.models.threads.set_wait_policy: torch was imported before the OpenMP wait policy was set; "
                      "this process keeps spinning threads (call it before importing torch)", stacklevel=2)
    return added


def cgroup_cpus(cpu_max: str = CPU_MAX, cfs: tuple[str, str] = CFS) -> float | None:
    """CPUs the cgroup's quota allows (quota / period, e.g. 1.5), or None when unlimited or unknown."""
    try:
        with open(cpu_max) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(cfs[0]) as q, open(cfs[1]) as p:
            quota, period = int(q.read()), int(p.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def affinity_cpus() -> int:
    """CPUs this process may run on (`os.sched_getaffinity`; os.cpu_count() where that does not exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(environ.get(name, ""))
    except ValueError:
        return None
    return value if value >= 1 else None


def thread_count(requested: int | None = None, ray_cpus: float | None = None, *, affinity: int | None = None,
                 quota: float | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Threads for this process: `requested` (None: as many as it may use), capped by the CPUs of
    its affinity mask (`affinity`, default `affinity_cpus()`), its cgroup quota rounded up (`quota`,
    default `cgroup_cpus()`; 1.5 CPUs -> 2), its Ray CPU reservation (`ray_cpus`; 0 or None = none,
    e.g. a local run's actors, which reserve nothing because stages run one after another), and
    OMP_NUM_THREADS and FLYROLL_MAX_TORCH_THREADS from `environ` when set. At least 1."""
    environ = os.environ if environ is None else environ
    caps = [affinity if affinity is not None else affinity_cpus()]
    quota = cgroup_cpus() if quota is None else quota
    if quota:
        caps.append(math.ceil(quota - 1e-9))
    if ray_cpus:
        caps.append(math.ceil(ray_cpus - 1e-9))
    caps += [c for c in (_env_int(environ, "OMP_NUM_THREADS"), _env_int(environ, MAX_ENV)) if c]
    n = min(caps) if requested is None else min([requested, *caps])
    return max(1, int(n))


def set_torch_threads(requested: int | None = None, ray_cpus: float | None = None) -> int:
    """`torch.set_num_threads(thread_count(requested, ray_cpus))`; returns the count. Imports torch:
    call `set_wait_policy()` (the entry modules do) before the process first imports it."""
    import torch

    n = thread_count(requested, ray_cpus)
    torch.set_num_threads(n)
    return n


def inherit_threads() -> Callable[[], None]:
    """A function that gives the thread calling it the torch (OpenMP) thread count of the thread
    calling this one: for a thread that is about to run an engine another thread set up. OpenMP keeps
    the count per thread, and a new thread starts from OMP_NUM_THREADS (which Ray sets per actor), not
    from what the engine's thread was set to -- vLLM's CPU worker sets one OpenMP thread per core it
    binds, and its CPU attention refuses a step run with another count than the one its metadata was
    planned with. It sets the count through `torch._C.set_num_threads`, torch's own binding: vLLM's CPU
    worker replaces `torch.set_num_threads` with a function that only warns. A no-op function when this
    process has not imported torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return lambda: None
    n = torch.get_num_threads()
    return lambda: torch._C.set_num_threads(n)


def child_env(requested: int | None = None, ray_cpus: float | None = None) -> dict[str, str]:
    """Variables for a process this one starts (a Ray actor's runtime_env env_vars, where the node's
    environment need not be ours): the wait policy this process runs with (a user's choice, else
    PASSIVE), and with `requested`, OMP_NUM_THREADS = `requested` capped by `ray_cpus`, a user's
    OMP_NUM_THREADS and FLYROLL_MAX_TORCH_THREADS -- not by this process's cores: the child may run on
    another node, and caps by its own (`thread_count` there). Without it Ray sets OMP_NUM_THREADS to
    the actor's CPU reservation, 1 for a local actor that reserves none."""
    env = {**{k: os.environ[k] for k in PASSIVE if k in os.environ}, **wait_policy_env()}
    if requested is not None:
        env["OMP_NUM_THREADS"] = str(thread_count(requested, ray_cpus, affinity=requested, quota=0))
    return env

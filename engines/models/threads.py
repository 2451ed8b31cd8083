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
   FLYROLL_MAX_TORCH_THREADS;
3. asks for one thread when its model is small (`model_threads`: hidden size under SMALL_WIDTH): a
   tiny model's ops are too small to split, and each of the thousands of parallel regions of its step
   waits at a barrier for its slowest thread, which on cores another job shares is often not running
   (the Ray actors decide it where they are created, tasks/actors/process.py `actor_threads`);
4. runs at the CPU priority (niceness) of the process that started the run (`adopt_niceness`): Ray
   starts every worker process, so every actor, 15 nice levels below its raylet (RAY_worker_niceness),
   and at nice 15 a process gets 36/1060 of a core that a nice-0 process also wants (the kernel's
   weights): the tiny run's stages in Ray actors were 13-20x slower beside one other job while the
   bootstrap, in the workflow's own process, was 1.5x (docs/benchmarks.md, "Contention"). A local
   Ray that flyroll starts gives its workers the raylet's niceness (infra/ray_session.py
   `equal_worker_priority`); an actor on a cluster started elsewhere lowers its own here when allowed.

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
NICE_ENV = "FLYROLL_NICENESS"  # the niceness of the process that started this one (`adopt_niceness`)
# Below this hidden size a model's ops are too small to split over threads: the tiny preset's 128 ran its
# RL stages at least as fast on one thread as on two, idle and beside a 2-thread torch job (rollout 0.31
# against 0.47 s idle, 0.53 against 0.92 s beside it; benchmarks/contention.py). From it on the run's
# run.torch_threads is kept: SmolLM2 (576) and wider models split their matmuls well.
SMALL_WIDTH = 512
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


def model_threads(requested: int | None, hidden_size: int | None, environ: Mapping[str, str] | None = None) -> int | None:
    """The torch threads to ask for in a process whose work is a model of width `hidden_size`: 1 when
    it is under SMALL_WIDTH, else `requested` (None: as many as the process may use). Small ops gain
    nothing from a second thread and lose most to it when the cores are shared: every parallel region
    ends at a barrier that waits for the slowest thread, and beside another busy job that thread is
    often not running (the tiny policy, width 128: see SMALL_WIDTH). A user's OMP_NUM_THREADS in `environ`
    (default os.environ) decides instead of the width (`requested` then, capped by it), and
    FLYROLL_MAX_TORCH_THREADS still caps whatever is asked: the caller caps the result by the cores
    (`thread_count` here, `child_env` for a Ray actor). `hidden_size` None (not known before the model
    loads): `requested`. Call it where the user's environment is the process's own (the driver that
    creates the actors; an actor's OMP_NUM_THREADS is flyroll's)."""
    environ = os.environ if environ is None else environ
    if hidden_size is not None and hidden_size < SMALL_WIDTH and _env_int(environ, "OMP_NUM_THREADS") is None:
        return 1
    return requested


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


def niceness() -> int:
    """This process's niceness (0 = the default priority; 19 = the lowest)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def adopt_niceness(environ: Mapping[str, str] | None = None) -> int | None:
    """Lower this process's niceness to FLYROLL_NICENESS in `environ` (default os.environ; a Ray actor's
    creator sets it to its own, infra/ray_session.py `actor_pool`) when it runs at a higher one: a Ray worker on a cluster started without
    RAY_worker_niceness=0 runs 15 levels below its raylet, and beside a nice-0 job on its cores gets a
    sliver of them. Lowering needs the privilege (root, CAP_SYS_NICE or RLIMIT_NICE): without it this
    warns, naming the fix, and the process keeps its niceness. Returns the niceness now; None when
    FLYROLL_NICENESS is not set (nothing asked)."""
    environ = os.environ if environ is None else environ
    try:
        wanted = int(environ[NICE_ENV])
    except (KeyError, ValueError):
        return None
    now = niceness()
    if now > wanted:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, wanted)
        except OSError as e:
            warnings.warn(f"engines.models.threads.adopt_niceness: this process runs at nice {now} (a Ray worker: "
                          f"RAY_worker_niceness) and may not take its starter's {wanted} ({e.strerror}): beside another "
                          "job on its cores it gets a fraction of them. Start the Ray cluster with RAY_worker_niceness=0 "
                          "in its environment", stacklevel=2)
        now = niceness()
    return now


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

"""Reward-function calls in worker processes, so a call that hangs is ended, not abandoned.

`RewardCalls` runs every per-sample reward call (`fn(response, sample) -> float`) in a pool of worker
processes (`pebble.ProcessPool`, forked from a fork server: neither the caller's threads, such as a
Ray actor's, nor its imports are copied into them). `RewardCalls.run` submits a batch of calls at once
and collects them, the pool's processes running them in parallel:

- each call has a timeout (`reward.timeout_s`): past it, its process is killed (and a fresh one
  started) and the sample scores 0 with an error that names the reward function;
- a call that kills its process (`os._exit`, a segfault, the kernel's OOM killer) costs only its
  sample, flagged with the exit code;
- the batch has a budget (`reward.budget_s`): past it, the calls still running are killed and those
  not started are not run, each flagged -- scoring a batch never takes longer than the budget;
- once a function has failed on more than `reward.max_error_rate` of its calls in the batch, its
  calls not yet started are not run (flagged): this batch is already over the error-rate limit for
  it (engines/rewards/routing.py `check_error_rate` fails the run; when a scoring call is split over
  several reward workers the limit is checked on the whole table, which a worker's share can exceed
  alone), so a function that always hangs costs about max_error_rate x its calls / processes
  timeouts, not all of them;
- a reward is a real, finite number within the declared bounds (`check_value`): `inf`, NaN, a
  string, None or anything else is the sample's error, never a score.

The function travels to the worker pickled by cloudpickle: a registered or importable function by
reference, a lambda or closure by value (so it must not hold a lock, an open file or a thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import hashlib
import math
import multiprocessing
import numbers
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import cloudpickle
import pebble

from engines.rewards import RewardResult
from engines.sandbox.isolation import SandboxUnavailable

RewardFn = Callable[[str, dict], float]
NOT_RUN = "not run, it already failed on"   # the start of a call's error when the error-rate stop skipped it
MAX_ABS = 1e6   # reward.max_abs's default: a larger reward is a bug (1e30 overflows the advantage's float32 std)


@dataclass(frozen=True)
class Call:
    """One reward call: `name` says which function it is in errors (a registered name or module:function)."""

    name: str
    fn: RewardFn
    response: str
    sample: dict


@dataclass(frozen=True)
class Limits:
    """What a batch of calls may take and return (the config's `reward` section)."""

    timeout_s: float = 5.0                       # one call
    budget_s: float = 600.0                      # the whole batch
    bounds: tuple[float, float] = (-MAX_ABS, MAX_ABS)
    sandbox: dict = field(default_factory=dict)  # engines.sandbox.runner.configure's keyword arguments
    max_error_rate: float = 1.0                  # a function failed on more of its calls: the rest are not run


def check_value(raw, bounds: tuple[float, float] = (-MAX_ABS, MAX_ABS)) -> float:
    """`raw` as a float, or ValueError / TypeError saying why it is not a reward: it must be a real
    number (int, float, bool, numpy scalar; not a string, None, a tensor or a list), finite, and
    within `bounds` (inclusive)."""
    if not isinstance(raw, numbers.Real):
        shown = repr(raw)[:80]
        raise TypeError(f"reward is {type(raw).__name__} {shown}, expected a finite number")
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"reward is {value}, expected a finite number")
    lo, hi = bounds
    if not lo <= value <= hi:
        raise ValueError(f"reward {value:g} is outside [{lo:g}, {hi:g}] (reward.max_abs / reward.bounds)")
    return value


# -- the worker process side ----------------------------------------------------------------------

_FUNCTIONS: dict[bytes, RewardFn] = {}   # a worker's unpickled functions, by the digest of their pickle
_DEADLINE: list[float] = []              # time.monotonic() at which the running call is killed


def call_time_left() -> float | None:
    """Seconds before the running reward call is killed, in a `RewardCalls` worker; None elsewhere. A
    reward that runs its own timed work (the code reward's sandbox) keeps inside it."""
    return _DEADLINE[0] - time.monotonic() if _DEADLINE else None


def _worker_init() -> None:
    """Die with the fork server, which exits when the pool's process does (even one killed by SIGKILL,
    as a replaced Ray actor is): a worker stuck in a reward call would otherwise outlive its pool. The
    server exits once every holder of its "alive" pipe's write end is gone, and multiprocessing hands
    that end to each child it forks, so the worker closes its copy. SIGTERM (the pool ending a call)
    raises SystemExit, so `finally` blocks below -- the sandbox's kill of its process tree -- still run."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))


def _call(blob: bytes, response: str, sample: dict, limits: Limits) -> tuple[str, object, str | None]:
    """In a worker: ("ok", value, isolation) or ("error", text, None). Raises only SandboxUnavailable."""
    from engines.sandbox.runner import configure

    key = hashlib.sha256(blob).digest()
    try:
        fn = _FUNCTIONS.get(key) or _FUNCTIONS.setdefault(key, cloudpickle.loads(blob))
    except Exception as e:  # noqa: BLE001 -- a function that cannot be rebuilt here costs its samples
        return "error", f"cannot load the reward function in a worker process ({type(e).__name__}: {e})"[:500], None
    configure(**limits.sandbox)
    _DEADLINE[:] = [time.monotonic() + limits.timeout_s]
    try:
        raw = fn(response, sample)
        return "ok", check_value(raw, limits.bounds), getattr(raw, "isolation", None)
    except SandboxUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 -- any reward bug costs only this sample
        return "error", f"{type(e).__name__}: {e}"[:500], None
    except SystemExit:   # the pool's SIGTERM, once the call's `finally` blocks have run: end now, not in 3 s
        os._exit(143)
    finally:
        _DEADLINE.clear()


# -- the caller's side ----------------------------------------------------------------------------

# a unix socket's path is at most 107 bytes; the fork server's is <temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX
_MAX_TEMP_DIR = 60


def _short_socket_dir() -> None:
    """multiprocessing's fork server listens on a unix socket in its temp dir, under TMPDIR; under a
    deep TMPDIR (a job's scratch folder, a test's) the path is too long to bind ("AF_UNIX path too
    long") and every reward call failed. Then this process's multiprocessing temp dir is made under
    /tmp instead, removed at exit as multiprocessing removes its own."""
    import shutil
    import tempfile
    from multiprocessing import process, util

    current = process.current_process()._config.get("tempdir")
    if len(current or tempfile.gettempdir()) <= _MAX_TEMP_DIR or not os.access("/tmp", os.W_OK):
        return
    short = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    util.Finalize(None, shutil.rmtree, args=(short, True), exitpriority=-100)
    process.current_process()._config["tempdir"] = short


class RewardCalls:
    """A pool of `processes` worker processes that run reward calls (module docstring). Started on
    first use; `close` ends it."""

    def __init__(self, processes: int = 2):
        self.processes = processes
        self._pool: pebble.ProcessPool | None = None
        self._blobs: dict[RewardFn, bytes] = {}
        self._lock = threading.Lock()   # callers in several threads (the rollout scheduler's reward side) share one pool

    def _started(self) -> pebble.ProcessPool:
        with self._lock:
            if self._pool is None or not self._pool.active:
                _short_socket_dir()
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(["__main__", "engines.rewards.calls"])   # main once, in the server
                self._pool = pebble.ProcessPool(max_workers=self.processes, initializer=_worker_init, context=ctx)
            return self._pool

    def _blob(self, fn: RewardFn) -> bytes:
        if fn not in self._blobs:
            self._blobs[fn] = cloudpickle.dumps(fn)
        return self._blobs[fn]

    def run(self, calls: list[Call], limits: Limits = Limits()) -> list[RewardResult]:
        """One `RewardResult` per call, in order; never raises, except `SandboxUnavailable` (model code
        must not run here at all: the whole scoring fails with the reason and the fix)."""
        if not calls:
            return []
        pool, t0 = self._started(), time.perf_counter()
        futures, out = [], [None] * len(calls)
        for i, c in enumerate(calls):
            try:
                blob = self._blob(c.fn)
            except Exception as e:  # noqa: BLE001 -- e.g. a closure over a lock
                out[i] = RewardResult(0.0, f"reward function {c.name!r} cannot be sent to a worker process "
                                           f"({type(e).__name__}: {e}); define it at module level"[:500], 0.0)
                futures.append(None)
                continue
            futures.append(pool.schedule(_call, args=(blob, c.response, c.sample, limits), timeout=limits.timeout_s))
        late, given_up = self._wait(calls, futures, limits)
        for i, (c, f) in enumerate(zip(calls, futures)):
            if f is None:
                continue
            if f in given_up:
                out[i] = RewardResult(0.0, f"reward function {c.name!r}: {NOT_RUN} {given_up[f]} of this batch's "
                                           "calls (over reward.max_error_rate)", 0.0)
            elif f in late:
                out[i] = RewardResult(0.0, f"reward function {c.name!r}: not scored within the batch budget of "
                                           f"{limits.budget_s:g}s (reward.budget_s)", time.perf_counter() - t0)
            else:
                out[i] = self._result(c, f, limits)
        return out

    def _wait(self, calls: list[Call], futures: list, limits: Limits) -> tuple[set, dict]:
        """Wait for `futures` within the budget: (those still unfinished at its end, killed or never started;
        {future: "N of M"} of a function's calls not run because it had already failed on more than
        `limits.max_error_rate` of its M calls -- no more time is spent on it)."""
        deadline = time.monotonic() + limits.budget_s
        per_fn: dict[str, list] = {}
        for c, f in zip(calls, futures):
            if f is not None:
                per_fn.setdefault(c.name, []).append(f)
        failed = dict.fromkeys(per_fn, 0)
        name_of = {f: c.name for c, f in zip(calls, futures) if f is not None}
        pending, given_up = set(name_of), {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_COMPLETED)
            for f in done:
                if f in given_up or not self._failed(f):
                    continue
                name = name_of[f]
                failed[name] += 1
                total = len(per_fn[name])
                if failed[name] > limits.max_error_rate * total:
                    for other in per_fn[name]:
                        if other in pending and other.cancel():   # a queued call never starts
                            given_up[other] = f"{failed[name]} of {total}"
                    pending -= set(given_up)
        for f in pending:
            f.cancel()   # past the budget: a running call's process is killed; a queued one never starts
        return pending, given_up

    @staticmethod
    def _failed(f: cf.Future) -> bool:
        if f.cancelled() or f.exception() is not None:
            return True
        return f.result()[0] == "error"

    @staticmethod
    def _result(c: Call, f: cf.Future, limits: Limits) -> RewardResult:
        try:
            status, value, isolation = f.result()
        except SandboxUnavailable:
            raise
        except cf.TimeoutError:
            return RewardResult(0.0, f"timeout after {limits.timeout_s:g}s in reward function {c.name!r} "
                                     "(reward.timeout_s; its process was killed)", limits.timeout_s)
        except pebble.ProcessExpired as e:
            return RewardResult(0.0, f"reward function {c.name!r} killed its worker process (exit code {e.exitcode})", 0.0)
        except cf.CancelledError:
            return RewardResult(0.0, f"reward function {c.name!r}: call cancelled", 0.0)
        except Exception as e:  # noqa: BLE001 -- e.g. arguments or a result that do not pickle
            return RewardResult(0.0, f"reward function {c.name!r}: {type(e).__name__}: {e}"[:500], 0.0)
        if status == "error":
            return RewardResult(0.0, value, 0.0)
        return RewardResult(value, None, 0.0, isolation)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None

    def __enter__(self) -> "RewardCalls":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Environment worker pools: where the asynchronous manager's environments live and step.

An ``EnvWorkerPool`` holds many environments, each named by an ``env_id`` the manager chooses,
and answers ``reset(env_id, seed)`` / ``step(env_id, action)`` with ``concurrent.futures.Future``s,
so the manager never waits on one environment while others could run. The work on the environment
side is ``EnvHost`` (a dict of environments and the two calls); a pool is ``EnvHost``s plus a way
to run them concurrently:

- ``ThreadEnvPool``: one ``EnvHost`` in this process, steps on a thread pool. Cheap; a step that
  hangs keeps its thread until it returns (the manager has already given up on it at its timeout).
- ``ProcessEnvPool``: ``workers`` processes, each one ``EnvHost`` holding many environments (an
  environment stays on the worker that reset it). A worker that dies fails every pending call of
  its environments with ``EnvWorkerLost`` and is replaced; closing an environment whose step is
  still running (a hung step, past the manager's timeout) kills its worker the same way.
- A Ray pool (tasks/, later) is ``EnvHost`` as a Ray actor, several of them on their own CPUs:
  ``actor.step.remote(env_id, action).future()`` is already the future this Protocol returns, and a
  dead actor's ``RayActorError`` maps to ``EnvWorkerLost``.

An environment's own exception in ``step`` is not an error of the pool: it comes back as
``StepResult.error`` (``"Type: message"``, the lock-step manager's ``env_error``) and ends that
episode only. An exception in ``reset`` is a configuration error and fails the future.
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from engines.agentic.env_manager import FAILED_STEP_INFO, EnvTurns, env_error_text
from engines.agentic.envs.base import TextEnv
from engines.agentic.envs import make_env


@dataclass(frozen=True)
class EnvSpec:
    """A picklable environment factory: ``EnvSpec("frozenlake", {"size": 4})()`` is ``make_env``'s env."""
    name: str
    kwargs: dict = field(default_factory=dict)

    def __call__(self) -> TextEnv:
        return make_env(self.name, **self.kwargs)


@dataclass(frozen=True)
class ResetResult:
    observation: str      # the first observation
    instructions: str     # the environment's system text
    state_key: str        # the start state (GiGPO anchor of the first action)
    turns: EnvTurns = EnvTurns()   # the env's stop strings and tools (engines/agentic/env_manager.py EnvTurns)


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict
    state_key: str        # the state after the step ("" after an error)
    error: str | None = None   # the environment raised: "Type: message"; the episode ends


class EnvWorkerLost(RuntimeError):
    """The worker holding an environment died (or was killed): the environment's state is gone."""


class EnvWorkerPool(Protocol):
    def reset(self, env_id: str, seed: int) -> Future[ResetResult]: ...   # makes the env on first use
    def step(self, env_id: str, action: str) -> Future[StepResult]: ...
    def close(self, env_id: str) -> None: ...          # forget the env; a step still running is abandoned
    def metrics(self) -> dict[str, float]: ...         # counters since the pool started
    def shutdown(self) -> None: ...


class EnvHost:
    """Many environments of one factory, by id: the environment side of every pool."""

    def __init__(self, factory: Callable[[], TextEnv]):
        self.factory, self.envs = factory, {}

    def reset(self, env_id: str, seed: int) -> ResetResult:
        env = self.envs.get(env_id) or self.factory()
        self.envs[env_id] = env
        observation = env.reset(seed)
        return ResetResult(observation, env.instructions, env.state_key(), EnvTurns.of(env))

    def step(self, env_id: str, action: str) -> StepResult:
        env = self.envs[env_id]
        try:
            observation, reward, done, info = env.step(action)
        except Exception as e:  # noqa: BLE001 -- the environment's failure costs its episode only
            return StepResult("", 0.0, True, dict(FAILED_STEP_INFO), "", error=env_error_text(e))
        return StepResult(observation, float(reward), bool(done), dict(info), env.state_key())

    def close(self, env_id: str) -> None:
        self.envs.pop(env_id, None)


class ThreadEnvPool:
    """One ``EnvHost`` in this process; resets and steps run on ``threads`` threads."""

    def __init__(self, factory: Callable[[], TextEnv], threads: int = 8):
        self.host, self.threads = EnvHost(factory), threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="env")

    def reset(self, env_id: str, seed: int) -> Future[ResetResult]:
        return self._executor.submit(self.host.reset, env_id, seed)

    def step(self, env_id: str, action: str) -> Future[StepResult]:
        return self._executor.submit(self.host.step, env_id, action)

    def close(self, env_id: str) -> None:
        self.host.close(env_id)

    def metrics(self) -> dict[str, float]:
        return {"env_workers/threads": float(self.threads)}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _serve_envs(conn, factory) -> None:
    """A process worker's loop: (request id, op, env id, argument) in, (request id, ok, result) out."""
    host = EnvHost(factory)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        req, op, env_id, arg = msg
        if op == "close":
            host.close(env_id)
            continue
        try:
            conn.send((req, True, getattr(host, op)(env_id, arg)))
        except Exception as e:  # noqa: BLE001 -- reset failed: a configuration error, reported to the caller
            conn.send((req, False, env_error_text(e)))


@dataclass(eq=False)
class _Worker:
    process: multiprocessing.Process
    conn: object
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict = field(default_factory=dict)     # request id -> (future, env id)
    envs: set = field(default_factory=set)
    alive: bool = True


class ProcessEnvPool:
    """``workers`` processes, each an ``EnvHost`` holding many environments. An environment lives on
    the worker its first ``reset`` went to (the one holding fewest). A dead worker fails its pending
    calls and every later call on its environments with ``EnvWorkerLost`` and is replaced by a fresh
    one; ``close`` on an environment whose call is still running kills its worker (the only way to
    stop a hung step). Forked workers (``mp_context="fork"``) see the parent's registry and test
    classes; "spawn" or "forkserver" need a factory importable by name."""

    def __init__(self, factory: Callable[[], TextEnv], workers: int = 2, mp_context: str = "fork"):
        self.factory, self._ctx = factory, multiprocessing.get_context(mp_context)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._where: dict[str, _Worker] = {}
        self.workers_lost = 0
        self._closed = False
        self.workers = [self._start() for _ in range(workers)]

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_serve_envs, args=(child, self.factory), daemon=True, name="env-worker")
        process.start()
        child.close()
        worker = _Worker(process, parent)
        threading.Thread(target=self._read, args=(worker,), daemon=True, name="env-worker-reader").start()
        return worker

    def _read(self, worker: _Worker) -> None:
        while True:
            try:
                req, ok, result = worker.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future, _ = worker.pending.pop(req, (None, None))
            if future is not None:
                future.set_result(result) if ok else future.set_exception(RuntimeError(f"environment reset failed: {result}"))
        self._lost(worker)

    def _lost(self, worker: _Worker) -> None:
        """The worker is gone: fail what it held, forget its environments, start a replacement."""
        with self._lock:
            if not worker.alive:
                return
            worker.alive = False
            pending, worker.pending = worker.pending, {}
            for env_id in worker.envs:
                self._where.pop(env_id, None)
            if not self._closed:
                self.workers_lost += 1
                self.workers[self.workers.index(worker)] = self._start()
        worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        for future, env_id in pending.values():
            future.set_exception(EnvWorkerLost(f"the worker holding environment {env_id!r} died "
                                               f"(exit code {worker.process.exitcode})"))

    def _call(self, op: str, env_id: str, arg) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()  # a caller giving up cannot cancel it under the reader's feet
        with self._lock:
            worker = self._where.get(env_id)
            if worker is None and op == "reset":
                worker = min((w for w in self.workers if w.alive), key=lambda w: len(w.envs))
                self._where[env_id] = worker
                worker.envs.add(env_id)
            if worker is None or not worker.alive:
                future.set_exception(EnvWorkerLost(f"environment {env_id!r} was on a worker that died"))
                return future
            req = next(self._ids)
            worker.pending[req] = (future, env_id)
        try:
            with worker.send_lock:
                worker.conn.send((req, op, env_id, arg))
        except OSError:
            self._lost(worker)
        return future

    def reset(self, env_id: str, seed: int) -> Future[ResetResult]:
        return self._call("reset", env_id, seed)

    def step(self, env_id: str, action: str) -> Future[StepResult]:
        return self._call("step", env_id, action)

    def close(self, env_id: str) -> None:
        with self._lock:
            worker = self._where.pop(env_id, None)
            if worker is None:
                return
            worker.envs.discard(env_id)
            hung = any(e == env_id for _, e in worker.pending.values())
        if hung:  # its step is still running past the manager's timeout: only killing the worker stops it
            self._lost(worker)
            return
        try:
            with worker.send_lock:
                worker.conn.send((None, "close", env_id, None))
        except OSError:
            pass  # the reader notices the death

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` (fault drills); its environments are lost at once."""
        self._lost(self.workers[index])

    def metrics(self) -> dict[str, float]:
        return {"env_workers/processes": float(len(self.workers)), "env_workers/lost": float(self.workers_lost)}

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self.workers)
        for w in workers:
            try:
                with w.send_lock:
                    w.conn.send(None)
            except OSError:
                pass
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()

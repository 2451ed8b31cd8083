"""The environment worker pool on Ray: ``workers`` actors, each an ``EnvHost`` holding many environments.

It is the ``EnvWorkerPool`` the asynchronous manager (engines/agentic/async_env_manager.py) drives, with the
environments out of the generation actors and on CPUs of their own (``env.workers``,
``env.worker_cpus``, ``env.worker_memory``, ``env.worker_concurrency``; docs/agentic.md). Same contract as
engines/agentic/env_workers.py ``ProcessEnvPool``:

- an environment lives on the actor its first ``reset`` went to (the one holding fewest);
- each actor runs up to ``concurrency`` calls at once (a threaded actor), so one slow or hung step
  does not hold the other environments of its actor;
- an actor that dies (``RayActorError``: killed, out of memory, node lost) fails its pending calls and
  every later call on its environments with ``EnvWorkerLost`` (the manager restarts those episodes
  from their reset on another actor, or drops and counts them) and is replaced by a fresh actor;
- ``close`` on an environment whose call is still running (a hung step, past the manager's timeout)
  kills its actor the same way: the only way to stop a hung step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from engines.agentic.env_workers import EnvHost, EnvWorkerLost, ResetResult, StepResult
from engines.agentic.envs.base import TextEnv


class EnvWorkerActor:
    """One ``EnvHost`` as a Ray actor (wrapped with ``ray.remote`` by ``RayEnvPool``)."""

    def __init__(self, factory: Callable[[], TextEnv]):
        self.host = EnvHost(factory)

    def reset(self, env_id: str, seed: int) -> ResetResult:
        return self.host.reset(env_id, seed)

    def step(self, env_id: str, action: str) -> StepResult:
        return self.host.step(env_id, action)

    def close(self, env_id: str) -> None:
        self.host.close(env_id)

    def ready(self) -> bool:
        return True


_Actor = ray.remote(EnvWorkerActor)


@dataclass(eq=False)
class _Worker:
    actor: object
    envs: set = field(default_factory=set)
    running: dict = field(default_factory=dict)   # env id -> calls in flight
    alive: bool = True


class RayEnvPool:
    """``workers`` Ray actors of ``cpus`` CPUs each, running ``concurrency`` calls at once, holding the
    environments ``factory`` makes (picklable: engines/agentic/env_workers.py ``EnvSpec``). Needs a connected
    Ray (``ray.init`` or a Flyte Ray task)."""

    def __init__(self, factory: Callable[[], TextEnv], workers: int = 2, cpus: float = 1.0, concurrency: int = 16,
                 ready_timeout_s: float = 120.0, memory_bytes: int = 0):
        if workers < 1 or cpus <= 0 or concurrency < 1:
            raise ValueError(f"RayEnvPool needs workers >= 1, cpus > 0 and concurrency >= 1; got workers={workers}, "
                             f"cpus={cpus}, concurrency={concurrency}")
        total = ray.cluster_resources().get("CPU", 0.0)
        if workers * cpus > total:
            raise ValueError(f"env.workers={workers} x env.worker_cpus={cpus:g} = {workers * cpus:g} CPUs, but the Ray "
                             f"cluster has {total:g}: lower env.workers or env.worker_cpus, or give the stage more CPUs")
        if memory_bytes < 0:
            raise ValueError(f"RayEnvPool needs memory_bytes >= 0; got {memory_bytes}")
        free_mem = ray.cluster_resources().get("memory", 0.0)
        if memory_bytes and workers * memory_bytes > free_mem:
            raise ValueError(f"env.workers={workers} x env.worker_memory={memory_bytes / 2**20:g}Mi = "
                             f"{workers * memory_bytes / 2**30:.2f}Gi, but the Ray cluster offers {free_mem / 2**30:.2f}Gi "
                             "of actor memory: lower env.workers or env.worker_memory, or give the stage more memory")
        self.factory, self.cpus, self.concurrency, self.memory_bytes = factory, cpus, concurrency, memory_bytes
        self._lock = threading.Lock()
        self._where: dict[str, _Worker] = {}
        self.workers_lost = 0
        self._closed = False
        self.workers = [self._start() for _ in range(workers)]
        try:
            ray.get([w.actor.ready.remote() for w in self.workers], timeout=ready_timeout_s)
        except GetTimeoutError:
            self.shutdown()
            raise RuntimeError(f"{workers} env worker actor(s) of {cpus:g} CPUs did not start within {ready_timeout_s:g} s; "
                               f"free on the Ray cluster: {ray.available_resources().get('CPU', 0.0):g} CPUs (others hold "
                               "the rest): lower env.workers or env.worker_cpus") from None

    def _start(self) -> _Worker:
        memory = {"memory": self.memory_bytes} if self.memory_bytes else {}   # 0: no memory reservation
        actor = _Actor.options(num_cpus=self.cpus, max_concurrency=self.concurrency, max_restarts=0,
                               **memory).remote(self.factory)
        return _Worker(actor)

    def _lost(self, worker: _Worker, kill: bool) -> None:
        """The actor is gone (or must go): forget its environments, start a replacement."""
        with self._lock:
            if not worker.alive:
                return
            worker.alive = False
            for env_id in worker.envs:
                self._where.pop(env_id, None)
            if not self._closed:
                self.workers_lost += 1
                self.workers[self.workers.index(worker)] = self._start()
        if kill:
            ray.kill(worker.actor, no_restart=True)   # its pending calls fail with RayActorError

    def _call(self, op: str, env_id: str, *args) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()  # a caller giving up cannot cancel it under the callback's feet
        with self._lock:
            worker = self._where.get(env_id)
            if worker is None and op == "reset":
                worker = min((w for w in self.workers if w.alive), key=lambda w: len(w.envs))
                self._where[env_id] = worker
                worker.envs.add(env_id)
            if worker is None or not worker.alive:
                future.set_exception(EnvWorkerLost(f"environment {env_id!r} was on an env worker that died"))
                return future
            worker.running[env_id] = worker.running.get(env_id, 0) + 1
        remote = getattr(worker.actor, op).remote(env_id, *args).future()
        remote.add_done_callback(lambda r: self._done(worker, env_id, r, future))
        return future

    def _done(self, worker: _Worker, env_id: str, remote: Future, future: Future) -> None:
        with self._lock:
            left = worker.running.get(env_id, 1) - 1
            worker.running.pop(env_id) if left <= 0 else worker.running.__setitem__(env_id, left)
        error = remote.exception()
        if error is None:
            future.set_result(remote.result())
        elif isinstance(error, RayActorError):
            self._lost(worker, kill=False)
            future.set_exception(EnvWorkerLost(f"the env worker holding environment {env_id!r} died: "
                                               f"{type(error).__name__}"))
        elif isinstance(error, RayTaskError):  # reset raised: a configuration error, as ProcessEnvPool reports it
            future.set_exception(RuntimeError(f"environment reset failed: {error.cause!r}"))
        else:
            future.set_exception(error)

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
            hung = worker.running.get(env_id, 0) > 0
        if hung:  # its call is still running past the manager's timeout: only killing the actor stops it
            self._lost(worker, kill=True)
            return
        worker.actor.close.remote(env_id)

    def kill_worker(self, index: int) -> None:
        """Kill actor ``index`` as a crash would (fault drills): its pending calls fail with
        ``RayActorError``, which the pool turns into ``EnvWorkerLost``."""
        ray.kill(self.workers[index].actor, no_restart=True)

    def metrics(self) -> dict[str, float]:
        return {"env_workers/actors": float(len(self.workers)), "env_workers/lost": float(self.workers_lost)}

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers, self.workers = list(self.workers), []
        for w in workers:
            ray.kill(w.actor, no_restart=True)

"""One router for the generation requests of many independent episodes.

Each episode of the asynchronous manager asks for one completion at a time
(``submit(prompt_token_ids, params)`` → a ``Future[Generated]``). A ``GenerationRouter`` decides how
those single requests reach the engines:

- ``BatchingRouter`` (HF engines, which take a whole batch per ``generate`` call): one thread per
  engine takes whatever requests are pending, up to ``max_batch``, waiting at most ``max_wait_s``
  after the oldest one arrived for more to join; requests with equal ``SamplingParams`` share a
  call. Requests cancelled before their batch starts are dropped unsent.
- A continuous-batching engine (vLLM's ``AsyncLLMEngine``) needs no batching here: its router
  forwards each ``submit`` as its own request and the engine merges them step by step. It only has
  to return the same ``Future[Generated]`` (not built yet).

Policy versions: each engine has the version of the weights it holds; a completion is tagged with
its engine's version when its batch started. ``publish(version, load)`` applies ``load(engine)``
to each engine between two of its batches and sets its version, so an episode's turns record which
policy produced them (``Episode.policy_versions``).

Sampling seeds: a request's ``params.seed`` (when set) is offset by the router's call count
(``seed + 1009 * call``), so calls do not repeat each other's draws; which rows share a call
depends on timing, so sampled async rollouts are not reproducible row by row (greedy ones are).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from engines.generation import Completion, GenerationEngine, SamplingParams


@dataclass(frozen=True)
class Generated:
    completion: Completion      # prompt_index / sample_index are 0: one request, one completion
    policy_version: int         # the engine's version when the batch started


class GenerationRouter(Protocol):
    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Future[Generated]: ...  # n must be 1
    def stats(self) -> RouterStats: ...
    @property
    def policy_version(self) -> int: ...    # the newest version any engine holds


@dataclass
class RouterStats:
    calls: int = 0                  # engine.generate calls
    requests: int = 0               # requests answered
    busy_s: float = 0.0             # seconds inside engine.generate, summed over engines
    engines: int = 1                # engines behind the router (busy share = busy_s / (wall × engines))
    batch_sizes: list[int] = field(default_factory=list)


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: Future
    arrived: float


class BatchingRouter:
    """Requests from many episodes batched into ``generate`` calls over ``engines`` (one thread each)."""

    def __init__(self, engines: list[GenerationEngine], *, max_batch: int = 64, max_wait_s: float = 0.01,
                 policy_version: int = 0):
        if not engines or max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"BatchingRouter needs engines, max_batch >= 1 and max_wait_s >= 0; got "
                             f"{len(engines)} engines, max_batch={max_batch}, max_wait_s={max_wait_s}")
        self.engines, self.max_batch, self.max_wait_s = list(engines), max_batch, max_wait_s
        self.versions = [policy_version] * len(engines)
        self._engine_locks = [threading.Lock() for _ in engines]
        self._queue: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._stats = RouterStats(engines=len(self.engines))
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, args=(k,), daemon=True, name=f"router-{k}")
                         for k in range(len(engines))]
        for t in self._threads:
            t.start()

    @property
    def policy_version(self) -> int:
        return max(self.versions)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Future[Generated]:
        if params.n != 1:
            raise ValueError(f"a routed request asks for one completion; got SamplingParams.n={params.n}")
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the router is closed")
            self._queue.append(_Request(list(prompt_token_ids), params, future, time.monotonic()))
            self._cond.notify()
        return future

    def publish(self, version: int, load: Callable[[GenerationEngine], None] | None = None) -> None:
        """New weights: ``load(engine)`` on each engine between its batches, then its version is ``version``."""
        for k, engine in enumerate(self.engines):
            with self._engine_locks[k]:
                if load is not None:
                    load(engine)
                self.versions[k] = version

    def stats(self) -> RouterStats:
        with self._cond:
            return dataclasses.replace(self._stats, batch_sizes=list(self._stats.batch_sizes))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for r in self._queue:
                r.future.cancel()
            self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=30)

    def _take_batch(self) -> list[_Request] | None:
        """Block until a batch is due; the batch (possibly empty when all were cancelled), or None when closed."""
        with self._cond:
            while not self._closed and not self._queue:
                self._cond.wait()
            if self._closed:
                return None
            deadline = self._queue[0].arrived + self.max_wait_s
            while not self._closed and self._queue and len(self._queue) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._closed or not self._queue:
                return None if self._closed else []
            params, batch, rest = self._queue[0].params, [], deque()
            while self._queue:
                r = self._queue.popleft()
                if len(batch) < self.max_batch and r.params == params:
                    if r.future.set_running_or_notify_cancel():   # False: the episode was aborted
                        batch.append(r)
                else:
                    rest.append(r)
            self._queue = rest
            if self._queue:
                self._cond.notify()   # another engine may take the rest
            return batch

    def _serve(self, k: int) -> None:
        engine = self.engines[k]
        while (batch := self._take_batch()) is not None:
            if not batch:
                continue
            params = batch[0].params
            with self._engine_locks[k]:
                with self._cond:
                    call = self._stats.calls
                    self._stats.calls += 1
                if params.seed is not None:
                    params = dataclasses.replace(params, seed=params.seed + 1009 * call)
                version = self.versions[k]
                start = time.perf_counter()
                try:
                    completions = engine.generate([r.prompt for r in batch], params)
                except BaseException as e:  # noqa: BLE001 -- the engine failed: every request of the batch learns why
                    for r in batch:
                        r.future.set_exception(e)
                    continue
                finally:
                    with self._cond:
                        self._stats.busy_s += time.perf_counter() - start
            with self._cond:
                self._stats.requests += len(batch)
                self._stats.batch_sizes.append(len(batch))
            for c in completions:
                batch[c.prompt_index].future.set_result(Generated(dataclasses.replace(c, prompt_index=0), version))
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(RuntimeError("the engine returned no completion for this request"))

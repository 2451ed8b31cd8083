"""One router for the generation requests of many independent episodes.

Each episode of the asynchronous manager asks for one completion at a time
(``submit(prompt_token_ids, params)`` → a ``Future[Generated]``). A ``GenerationRouter`` decides how
those single requests reach the engines:

- ``BatchingRouter`` (HF engines, which take a whole batch per ``generate`` call): one thread per
  engine takes whatever requests are pending, up to ``max_batch``, waiting at most ``max_wait_s``
  after the oldest one arrived for more to join; requests with equal ``SamplingParams`` share a
  call. Requests cancelled before their batch starts are dropped unsent.
- ``ContinuousRouter`` (a ``StreamingEngine``: vLLM's, engines/generation/vllm_engine.py): one thread adds each
  request to the engine as it arrives (``add_request``) and steps the engine (``step_deltas``); vLLM's
  scheduler merges new requests into the running batch step by step (continuous batching), and a
  request's future is resolved the step it finishes, whatever else is still running. A request
  cancelled while in the engine is aborted there (its KV blocks freed) at the next step.

Policy versions: each engine has the version of the weights it holds; a completion is tagged with
its engine's version when its batch started (``ContinuousRouter``: when the request entered the
engine). ``publish(version, load)`` applies ``load(engine)`` to each engine between two of its
batches (``ContinuousRouter``: once the requests in the engine have finished, new ones held back
meanwhile, so no request spans two policies) and sets its version, so an episode's turns record
which policy produced them (``Episode.policy_versions``).

Sampling seeds: ``BatchingRouter`` offsets a request's ``params.seed`` (when set) by the router's call
count (``seed + 1009 * call``; row i of a call draws ``seed + i`` inside the engine), so calls do not
repeat each other's draws; which rows share a call depends on timing, so sampled async rollouts are
not reproducible row by row (greedy ones are). ``ContinuousRouter`` gives request k (the k-th it
admits, from 0) the seed ``seed + 1009 * k``: its draws are its own, whatever runs beside it.
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

from engines.generation.engine import Completion, GenerationEngine, SamplingParams
from engines.models.threads import inherit_threads

SEED_STRIDE = 1009  # seed offset between two calls (BatchingRouter) or two requests (ContinuousRouter)


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
    calls: int = 0                  # engine.generate calls (ContinuousRouter: engine steps)
    requests: int = 0               # requests answered
    busy_s: float = 0.0             # seconds inside engine.generate (steps), summed over engines
    engines: int = 1                # engines behind the router (busy share = busy_s / (wall × engines))
    batch_sizes: list[int] = field(default_factory=list)   # rows per call (ContinuousRouter: requests in the engine per step)


@dataclass(frozen=True)
class RequestDelta:
    """What one engine step added to one request: its new tokens and their log-probs, and its finish
    reason ("stop", "length", "abort") once it has finished (None while it runs)."""
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


class StreamingEngine(Protocol):
    """An engine that takes single requests into a running batch and is stepped by its caller
    (engines/generation/vllm_engine.py ``VLLMGenerationEngine``)."""
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def step_deltas(self) -> list[RequestDelta]: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def decode(self, token_ids: list[int]) -> str: ...


def is_streaming(engine) -> bool:
    """Whether `engine` takes single requests into a running batch (a `StreamingEngine`: vLLM), so a
    ``ContinuousRouter`` serves it; otherwise it batches whole calls (a ``BatchingRouter``)."""
    return hasattr(engine, "add_request")


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
        self._thread_setup = inherit_threads()   # the engines' torch thread count, on the router's threads
        self._threads = [threading.Thread(target=self._serve, args=(k,), daemon=True, name=f"router-{k}")
                         for k in range(len(engines))]
        for t in self._threads:
            t.start()

    @property
    def policy_version(self) -> int:
        return max(self.versions)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Future[Generated]:
        return _enqueue(self, prompt_token_ids, params)

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
        self._thread_setup()
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
                    params = dataclasses.replace(params, seed=params.seed + SEED_STRIDE * call)
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


@dataclass(eq=False)
class _Running:
    request: _Request
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class ContinuousRouter:
    """Requests from many episodes added one by one to a continuous-batching ``engine`` (vLLM), which
    one thread steps; each request is answered the step it finishes."""

    def __init__(self, engine: StreamingEngine, *, policy_version: int = 0):
        self.engine, self.version = engine, policy_version
        self._queue: deque[_Request] = deque()
        self._running: dict[str, _Running] = {}
        self._idle_jobs: deque[tuple[Callable, Future]] = deque()   # run on the engine once it is empty
        self._cond = threading.Condition()
        self._stats = RouterStats(engines=1)
        self._admitted = 0
        self._closed = False
        self._thread_setup = inherit_threads()   # the engine's torch thread count, on the router's thread
        self._thread = threading.Thread(target=self._serve, daemon=True, name="router-continuous")
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self.version

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Future[Generated]:
        return _enqueue(self, prompt_token_ids, params)

    def run_idle(self, fn: Callable[[StreamingEngine], object]) -> object:
        """``fn(engine)`` once no request is in the engine (new ones wait meanwhile), on the router's
        thread, which owns the engine; its result (or exception). For weight loads and sleep/wake."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the router is closed")
            self._idle_jobs.append((fn, future))
            self._cond.notify()
        return future.result()

    def publish(self, version: int, load: Callable[[StreamingEngine], None] | None = None) -> None:
        """New weights: ``load(engine)`` once the requests in the engine have finished (no request spans
        two policies), then requests admitted from now on are tagged ``version``."""
        def swap(engine):
            if load is not None:
                load(engine)
            self.version = version
        self.run_idle(swap)

    def stats(self) -> RouterStats:
        with self._cond:
            return dataclasses.replace(self._stats, batch_sizes=list(self._stats.batch_sizes))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for r in self._queue:
                r.future.cancel()
            self._queue.clear()
            for _, job in self._idle_jobs:
                job.set_exception(RuntimeError("the router was closed"))
            self._idle_jobs.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # --- the router's thread: the only one that touches the engine ---------------------------------
    def _serve(self) -> None:
        self._thread_setup()
        while True:
            with self._cond:
                while not (self._closed or self._queue or self._running or self._idle_jobs):
                    self._cond.wait()
                if self._closed:
                    break
                job = self._idle_jobs.popleft() if self._idle_jobs and not self._running else None
                admit = [] if self._idle_jobs else list(self._queue)   # a pending idle job holds new requests back
                if not self._idle_jobs:
                    self._queue.clear()
            if job is not None:
                self._run_job(*job)
                continue
            self._admit(admit)
            self._abort_cancelled()
            if self._running:
                self._step()
        self._fail_running(RuntimeError("the router was closed"))

    def _run_job(self, fn, future: Future) -> None:
        try:
            future.set_result(fn(self.engine))
        except BaseException as e:  # noqa: BLE001 -- the caller of run_idle learns why
            future.set_exception(e)

    def _admit(self, requests: list[_Request]) -> None:
        for r in requests:
            if r.future.cancelled():   # the episode was aborted before its request reached the engine
                continue
            params = r.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + SEED_STRIDE * self._admitted)
            rid = f"route-{self._admitted}"
            self._admitted += 1
            try:
                self.engine.add_request(rid, r.prompt, params)
            except BaseException as e:  # noqa: BLE001 -- e.g. the engine holds no policy: this request learns why
                if r.future.set_running_or_notify_cancel():
                    r.future.set_exception(e)
                continue
            self._running[rid] = _Running(r, self.version)

    def _abort_cancelled(self) -> None:
        """Requests whose future was cancelled (the episode's group was aborted) leave the engine now.
        A running request's future stays pending until it finishes, so ``cancel()`` reaches it here."""
        gone = [rid for rid, run in self._running.items() if run.request.future.cancelled()]
        if gone:
            self.engine.abort_requests(gone)
            for rid in gone:
                del self._running[rid]

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            deltas = self.engine.step_deltas()
        except BaseException as e:  # noqa: BLE001 -- the engine failed: every request in it learns why
            self._fail_running(e)
            return
        finally:
            with self._cond:
                self._stats.calls += 1
                self._stats.busy_s += time.perf_counter() - start
                self._stats.batch_sizes.append(len(self._running))
        for d in deltas:
            run = self._running.get(d.request_id)
            if run is None:  # aborted meanwhile
                continue
            run.tokens.extend(d.token_ids)
            run.logprobs.extend(d.logprobs)
            if d.finish_reason is None:
                continue
            del self._running[d.request_id]
            with self._cond:
                self._stats.requests += 1
            if run.request.future.set_running_or_notify_cancel():
                run.request.future.set_result(Generated(Completion(
                    prompt_index=0, sample_index=0, token_ids=run.tokens, logprobs=run.logprobs,
                    finish_reason=d.finish_reason, text=self.engine.decode(run.tokens)), run.version))

    def _fail_running(self, error: BaseException) -> None:
        running, self._running = list(self._running.items()), {}
        try:
            self.engine.abort_requests([rid for rid, _ in running])
        except Exception:  # noqa: BLE001 -- the engine is already broken; the requests' error says why
            pass
        for _, run in running:
            if run.request.future.set_running_or_notify_cancel():
                run.request.future.set_exception(error)


def check_single(params: SamplingParams) -> None:
    """A routed request asks for one completion (every router's `submit`, tasks/loop/streams.py's too)."""
    if params.n != 1:
        raise ValueError(f"a routed request asks for one completion; got SamplingParams.n={params.n}")


def _enqueue(router, prompt_token_ids: list[int], params: SamplingParams) -> Future:
    """`submit` of both routers: one completion per request, queued under the router's condition
    (`_cond`, `_queue`, `_closed`) for its serving thread."""
    check_single(params)
    future: Future = Future()
    with router._cond:
        if router._closed:
            raise RuntimeError("the router is closed")
        router._queue.append(_Request(list(prompt_token_ids), params, future, time.monotonic()))
        router._cond.notify()
    return future

"""The caller's side of the generation actors' request streams (engines/generation/request_stream.py).

``ActorStreams`` is a ``GenerationRouter`` (engines/generation/router.py) over generation actors whose
engine batches continuously (vLLM): each request goes to the actor with the fewest requests in
flight (``stream_submit``, one Ray message), a thread per actor fetches what finished
(``stream_collect``), and a cancelled future is aborted in its actor's engine (``stream_cancel``). The
batch is formed inside each actor, by its ``ContinuousRouter``, step by step. The agentic rollout
(tasks/stages/agentic.py) uses it when every generation actor can stream, the ``BatchingRouter`` otherwise.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

import ray

from engines.generation.engine import SamplingParams
from engines.generation.router import Generated, RouterStats, check_single

COLLECT_WAIT_S = 0.5   # how long one stream_collect call waits for a finished request


class ActorStreams:
    """One router over the request streams of ``actors`` (GenerationWorker handles, or any actor with
    ``stream_open``/``stream_submit``/``stream_cancel``/``stream_collect``/``stream_stats``/``stream_close``)."""

    def __init__(self, actors: list):
        if not actors:
            raise ValueError("ActorStreams needs at least one generation actor")
        self.actors = list(actors)
        versions, refused = [], None
        for ref in [a.stream_open.remote() for a in self.actors]:   # every open answered before any close is sent
            try:
                versions.append(ray.get(ref))
            except ray.exceptions.RayError as e:
                refused = refused or e
        if refused is not None:   # an actor refused: close the streams that did open, so their engines serve again
            for a in self.actors:
                try:
                    ray.get(a.stream_close.remote())
                except ray.exceptions.RayError:
                    pass
            raise refused
        self._version = min(versions)
        self._lock = threading.Lock()
        self._pending: list[dict[str, Future]] = [{} for _ in self.actors]   # per actor: request id -> future
        self._ids = itertools.count()
        self._closed = threading.Event()
        self._final: list[RouterStats] | None = None
        self._dead: set[int] = set()               # actors whose stream failed: no new requests
        self._sizes: list[int] = []                # batch sizes, append-only across stats() calls (as one router's)
        self._seen = [0] * len(self.actors)        # per actor: how many of its batch sizes are in _sizes
        self._last = [RouterStats(engines=1) for _ in self.actors]   # per actor: its statistics when last read
        self._threads = [threading.Thread(target=self._collect, args=(i,), daemon=True, name=f"streams-collect-{i}")
                         for i in range(len(self.actors))]
        for t in self._threads:
            t.start()

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Future[Generated]:
        check_single(params)
        future: Future = Future()
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the router is closed")
            live = [k for k in range(len(self.actors)) if k not in self._dead]
            if not live:
                raise RuntimeError(f"every generation actor of the request streams has failed ({len(self.actors)})")
            i = min(live, key=lambda k: len(self._pending[k]))
            rid = f"s{next(self._ids)}"
            self._pending[i][rid] = future
        future.add_done_callback(lambda f: self._cancelled(i, rid) if f.cancelled() else None)
        self.actors[i].stream_submit.remote(rid, list(prompt_token_ids), params)
        return future

    def stats(self) -> RouterStats:
        if self._final is not None:
            per_actor = self._final
        else:
            per_actor = [self._last[i] if i in self._dead else ray.get(a.stream_stats.remote())
                         for i, a in enumerate(self.actors)]   # a dead actor: as last read
            self._last = per_actor
        with self._lock:
            for i, s in enumerate(per_actor):
                if len(s.batch_sizes) > self._seen[i]:
                    self._sizes.extend(s.batch_sizes[self._seen[i]:])
                    self._seen[i] = len(s.batch_sizes)
            sizes = list(self._sizes)
        return RouterStats(engines=len(self.actors), calls=sum(s.calls for s in per_actor),
                           requests=sum(s.requests for s in per_actor), busy_s=sum(s.busy_s for s in per_actor),
                           batch_sizes=sizes)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for t in self._threads:
            t.join(timeout=COLLECT_WAIT_S * 4)
        final = []
        for i, a in enumerate(self.actors):
            try:
                final.append((ray.get(a.stream_close.remote()) or self._last[i]) if i not in self._dead else self._last[i])
            except ray.exceptions.RayError:   # a dead actor: its requests have failed already; its statistics as last read
                final.append(self._last[i])
                self._dead.add(i)
        self._final = final
        with self._lock:
            left = [f for pending in self._pending for f in pending.values()]
            for pending in self._pending:
                pending.clear()
        for f in left:
            f.cancel()

    def _cancelled(self, i: int, rid: str) -> None:
        with self._lock:
            if self._pending[i].pop(rid, None) is None or self._closed.is_set():
                return
        self.actors[i].stream_cancel.remote([rid])

    def _collect(self, i: int) -> None:
        actor = self.actors[i]
        while not self._closed.is_set():
            try:
                done = ray.get(actor.stream_collect.remote(COLLECT_WAIT_S))
            except ray.exceptions.RayError as e:   # the actor died (or its stream broke): its requests learn why
                with self._lock:
                    self._dead.add(i)
                    failed = list(self._pending[i].values())
                    self._pending[i].clear()
                for f in failed:
                    if f.set_running_or_notify_cancel():
                        f.set_exception(RuntimeError(f"generation actor {i} of the request streams failed: {e}"))
                return
            for rid, generated, error in done:
                with self._lock:
                    future = self._pending[i].pop(rid, None)
                if future is None or not future.set_running_or_notify_cancel():
                    continue
                if error is None:
                    future.set_result(generated)
                else:
                    future.set_exception(RuntimeError(error))

"""A ``ContinuousRouter`` reached by request ids, for a caller in another process.

The asynchronous environment manager runs where the rollout task runs; a continuous-batching engine
(vLLM's, a ``StreamingEngine``) runs inside a generation actor. ``RequestStream`` lives beside the
engine, in the actor: the caller sends each request under an id of its own (``submit``), cancels ids
(``cancel``) and fetches what finished (``collect``, which waits until something has), so one
request costs one message each way and the engine's batch is formed in the actor, step by step, by
the router (engines/generation/router.py). tasks/loop/streams.py is the caller's side.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from engines.generation.engine import SamplingParams
from engines.generation.router import (
    ContinuousRouter,
    Generated,
    RouterStats,
    StreamingEngine,
)


class RequestStream:
    """``ContinuousRouter(engine)`` addressed by caller-chosen request ids; thread-safe."""

    def __init__(self, engine: StreamingEngine, *, policy_version: int = 0, name: str = "engine"):
        self.router = ContinuousRouter(engine, policy_version=policy_version)
        self.name = name
        self._cond = threading.Condition()
        self._futures: dict[str, Future] = {}      # submitted, unfinished
        self._done: list[tuple[str, Generated | None, str | None]] = []   # finished, not yet collected
        self._cancelled: set[str] = set()          # cancels that arrived before their submit
        self._closed = False

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue the request; a refusal (closed stream, an id already running, bad params) is collected
        as its failure, not raised: the caller sends without waiting for an answer."""
        with self._cond:
            if request_id in self._cancelled:     # cancelled on its way here: never reaches the engine
                self._cancelled.discard(request_id)
                return
            try:
                if self._closed:
                    raise RuntimeError("the request stream is closed")
                if request_id in self._futures:
                    raise ValueError(f"request id {request_id!r} is already running")
                future = self.router.submit(prompt_token_ids, params)
            except (RuntimeError, ValueError) as e:
                self._fail(request_id, e)
                return
            self._futures[request_id] = future
        future.add_done_callback(lambda f, rid=request_id: self._finished(rid, f))

    def cancel(self, request_ids: list[str]) -> None:
        """Leave the engine (aborted at its next step) or never enter it; a cancelled id is not collected."""
        with self._cond:
            for rid in request_ids:
                future = self._futures.pop(rid, None)
                if future is None:
                    self._cancelled.add(rid)
                else:
                    future.cancel()

    def collect(self, timeout_s: float) -> list[tuple[str, Generated | None, str | None]]:
        """Every request finished since the last call, waiting up to ``timeout_s`` for the first one:
        (id, the completion, None) or (id, None, why it failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._closed, timeout=timeout_s)
            done, self._done = self._done, []
        return done

    def stats(self) -> RouterStats:
        return self.router.stats()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._futures)

    def close(self) -> RouterStats:
        """Stop the router (requests still running fail); its final statistics."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.router.close()
        return self.router.stats()

    def _finished(self, request_id: str, future: Future) -> None:
        if future.cancelled():
            return
        error = future.exception()
        with self._cond:
            if self._futures.pop(request_id, None) is None:   # cancelled meanwhile
                return
            if error is not None:
                self._fail(request_id, error)
                return
            self._done.append((request_id, future.result(), None))
            self._cond.notify_all()

    def _fail(self, request_id: str, error: BaseException) -> None:
        """Record `request_id`'s failure for `collect`, naming this stream; the caller holds `_cond`."""
        self._done.append((request_id, None, f"{self.name}: {type(error).__name__}: {error}"))
        self._cond.notify_all()

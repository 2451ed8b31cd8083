"""Rollout scheduler: the per-group lifecycle of a dynamic-sampling rollout (ROLL's rollout scheduler,
DAPO's dynamic sampling, arXiv 2503.14476).

It pulls prompts from a stream, sends them to the generation side in chunks (up to
`max_chunks_in_flight` at once), hands each group (one prompt's G samples) to the reward side as
soon as its chunk is generated, so rewards overlap the generation of other chunks, runs the group
filters on the scored group, and stops once it holds `want` kept groups, aborting the generation
chunks and reward calls still in flight. It never keeps more than `want` groups: groups that pass
after the batch is full are dropped as "surplus", in completion order (ties within one poll go by
submission order). The prompt budget `max_prompts` bounds the work when too few groups pass.

Where it departs from DAPO: DAPO regenerates whole batches until enough groups pass; here the unit
is a chunk of prompts, so the batch fills as soon as enough groups pass and the rest is aborted.

Pure Python over two small Protocols (no Ray, no Flyte): tasks/ adapts Ray actors to them
(tasks/actors/pools.py `RayGeneration`, `RayRewards`); `ThreadedSide` runs either side
in this process (tests, local use). Determinism: given the seeds, the kept groups are the same
from run to run when each side finishes its requests in submission order (one engine thread and one
reward thread, as in tests/engines/generation/test_scheduler.py); with several parallel workers, which groups fill
the batch depends on which finish first.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

Row = dict  # one sample; the filters read "finish_reason", the rest is the caller's
Handle = Any  # a side's request (Ray ObjectRef, `ThreadedSide` request); hashable

QUEUED, GENERATING, SCORING, KEPT, DROPPED, ABORTED = "queued", "generating", "scoring", "kept", "dropped", "aborted"


class GenerationSide(Protocol):
    def submit(self, prompts: list) -> Handle: ...                       # a chunk of prompts
    def ready(self, handles: list, timeout: float) -> list: ...          # the finished ones, within `timeout` s
    def result(self, handle: Handle) -> list[list[Row]]: ...             # G rows per prompt, in chunk order
    def abort(self, handle: Handle) -> None: ...                         # stop it; its result is never asked for


class RewardSide(Protocol):
    def submit(self, rows: list[Row]) -> Handle: ...                     # one group
    def ready(self, handles: list, timeout: float) -> list: ...
    def result(self, handle: Handle) -> list[tuple[float, str | None]]: ...  # (reward, error) per row
    def abort(self, handle: Handle) -> None: ...


# Group filters: (rewards [G], rows [G]) -> keep?  Chosen from the algorithm config by `group_filters`.
GroupFilter = Callable[[list[float], list[Row]], bool]
FILTERS: dict[str, Callable[..., bool]] = {}


def register_filter(name: str):
    def deco(fn):
        FILTERS[name] = fn
        return fn
    return deco


@register_filter("all_equal")
def rewards_differ(rewards: list[float], rows: list[Row]) -> bool:
    """DAPO: a group whose rewards are all equal has zero group-relative advantage (size 1 included)."""
    return len(rewards) > 1 and max(rewards) > min(rewards)


@register_filter("all_truncated")
def not_all_truncated(rewards: list[float], rows: list[Row]) -> bool:
    """With `mask_truncated`, a group cut at the length limit in every sample has no loss tokens left."""
    return any(r.get("finish_reason") != "length" for r in rows)


@register_filter("difficulty")
def within_difficulty(rewards: list[float], rows: list[Row], *, low: float, high: float) -> bool:
    """ROLL's difficulty band: the group's mean reward (pass rate) lies in [low, high]."""
    mean = sum(rewards) / max(len(rewards), 1)
    return low <= mean <= high


def group_filters(algorithm) -> list[tuple[str, GroupFilter]]:
    """The filters an `AlgorithmConfig` asks for, in order: all_equal (`filter_groups`), all_truncated
    (`mask_truncated`), difficulty (`difficulty_low` / `difficulty_high` narrower than [0, 1])."""
    out: list[tuple[str, GroupFilter]] = []
    if algorithm.filter_groups:
        out.append(("all_equal", FILTERS["all_equal"]))
    if algorithm.mask_truncated:
        out.append(("all_truncated", FILTERS["all_truncated"]))
    if algorithm.difficulty_low > 0.0 or algorithm.difficulty_high < 1.0:
        out.append(("difficulty", functools.partial(FILTERS["difficulty"], low=algorithm.difficulty_low,
                                                    high=algorithm.difficulty_high)))
    return out


@dataclass
class Group:
    """One prompt's lifecycle: queued -> generating -> scoring -> kept | dropped(reason) | aborted."""
    index: int                         # position in the prompt stream (submission order)
    prompt: Any
    status: str = QUEUED
    reason: str | None = None          # dropped: the failing filter's name, or "surplus"
    rows: list[Row] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)  # time.monotonic() at "submitted", "generated", "scored"


@dataclass
class RolloutResult:
    kept: list[Group]                  # at most `want`, in the order they were kept
    groups: list[Group]                # every prompt taken from the stream, in submission order
    chunks: int                        # generation requests submitted
    aborted: int                       # groups whose generation or scoring was aborted

    def metrics(self, want: int) -> dict[str, float]:
        scored = [g for g in self.groups if g.status in (KEPT, DROPPED)]
        kept_samples = sum(len(g.rows) for g in self.kept)
        tokens = sum(len(r.get("response_token_ids", ())) for g in scored for r in g.rows)
        generated = [g.times["generated"] for g in scored]
        gen_end = max(generated, default=0.0)
        return {
            # handed to the reward side while a later chunk was still generating (0 = scoring waited for all of it)
            "rollout/groups_scored_during_generation": sum(t < gen_end for t in generated) / len(scored) if scored else 0.0,
            # reward time not hidden behind generation: last score in, less last generation out
            "rollout/reward_tail_s": max(0.0, max((g.times["scored"] for g in scored), default=0.0) - gen_end),
            "dynamic_sampling/kept_groups": float(len(self.kept)),
            "dynamic_sampling/dropped_groups": float(sum(g.status == DROPPED for g in self.groups)),
            "dynamic_sampling/generation_rounds": len(self.groups) / max(want, 1),  # prompts used / batch size
            "dynamic_sampling/samples": float(kept_samples),
            "rollout/generation_chunks": float(self.chunks),
            "rollout/aborted_requests": float(self.aborted),
            "rollout/generated_tokens_per_kept_sample": tokens / kept_samples if kept_samples else 0.0,
        }


class RolloutScheduler:
    """See the module doc. `chunk_size` prompts per generation request; `poll_s` the longest wait on
    one side while the other has work in flight."""

    def __init__(self, generation: GenerationSide, rewards: RewardSide, filters: list[tuple[str, GroupFilter]], want: int,
                 max_prompts: int, chunk_size: int, max_chunks_in_flight: int = 1, poll_s: float = 0.02):
        for name, value, lo in (("want", want, 1), ("max_prompts", max_prompts, 1), ("chunk_size", chunk_size, 1),
                                ("max_chunks_in_flight", max_chunks_in_flight, 1)):
            if value < lo:
                raise ValueError(f"RolloutScheduler {name} = {value}: expected an integer >= {lo}")
        self.generation, self.rewards, self.filters = generation, rewards, filters
        self.want, self.max_prompts, self.chunk_size = want, max_prompts, chunk_size
        self.max_chunks_in_flight, self.poll_s = max_chunks_in_flight, poll_s

    def run(self, prompts: Iterable) -> RolloutResult:
        stream = iter(prompts)
        groups: list[Group] = []
        kept: list[Group] = []
        generating: dict[Handle, list[Group]] = {}
        scoring: dict[Handle, Group] = {}
        chunks, exhausted = 0, False
        try:
            while len(kept) < self.want:
                while not exhausted and len(generating) < self.max_chunks_in_flight and len(groups) < self.max_prompts:
                    take = list(itertools.islice(stream, min(self.chunk_size, self.max_prompts - len(groups))))
                    if not take:
                        exhausted = True
                        break
                    now = time.monotonic()
                    chunk = [Group(len(groups) + i, p, status=GENERATING, times={"submitted": now}) for i, p in enumerate(take)]
                    groups.extend(chunk)
                    generating[self.generation.submit([g.prompt for g in chunk])] = chunk
                    chunks += 1
                if not generating and not scoring:
                    break
                done = self.generation.ready(list(generating), 0.0 if scoring else self.poll_s) if generating else []
                for h in sorted(done, key=lambda h: generating[h][0].index):
                    chunk, results = generating.pop(h), self.generation.result(h)
                    now = time.monotonic()  # one time per chunk: its groups finished together
                    for g, rows in zip(chunk, results, strict=True):
                        g.rows, g.status, g.times["generated"] = rows, SCORING, now
                        scoring[self.rewards.submit(rows)] = g
                if scoring:
                    finished = self.rewards.ready(list(scoring), 0.0 if done or generating else self.poll_s)
                    if not finished and not done and generating:  # nothing moved: wait on the rewards a little
                        finished = self.rewards.ready(list(scoring), self.poll_s)
                    for h in sorted(finished, key=lambda h: scoring[h].index):
                        self._decide(scoring.pop(h), self.rewards.result(h), kept)
        finally:  # done, out of budget, or an error: nothing stays in flight
            aborted = 0
            for h, chunk in generating.items():
                self.generation.abort(h)
                for g in chunk:
                    g.status = ABORTED
                aborted += len(chunk)
            for h, g in scoring.items():
                self.rewards.abort(h)
                g.status = ABORTED
                aborted += 1
        return RolloutResult(kept=kept, groups=groups, chunks=chunks, aborted=aborted)

    def _decide(self, g: Group, scored: list[tuple[float, str | None]], kept: list[Group]) -> None:
        g.rewards = [float(r) for r, _ in scored]
        g.errors = [e for _, e in scored]
        g.times["scored"] = time.monotonic()
        failed = next((name for name, keep in self.filters if not keep(g.rewards, g.rows)), None)
        if failed is not None:
            g.status, g.reason = DROPPED, failed
        elif len(kept) >= self.want:
            g.status, g.reason = DROPPED, "surplus"
        else:
            g.status = KEPT
            kept.append(g)


@dataclass(eq=False)
class _Request:
    future: cf.Future
    abort: threading.Event


class ThreadedSide:
    """Either side of the scheduler in this process: each request runs `fn(payload, abort_event)` in a
    thread pool of `threads`. `abort` sets the request's event (an engine that checks it, such as
    `HFGenerationEngine.generate(..., abort=event)`, stops early) and cancels it if not started."""

    def __init__(self, fn: Callable[[Any, threading.Event], Any], threads: int = 1):
        self.fn = fn
        self.pool = cf.ThreadPoolExecutor(max_workers=threads)
        self.requests: list[_Request] = []

    def submit(self, payload) -> _Request:
        event = threading.Event()
        req = _Request(self.pool.submit(self.fn, payload, event), event)
        self.requests.append(req)
        return req

    def ready(self, handles: list[_Request], timeout: float) -> list[_Request]:
        done, _ = cf.wait([h.future for h in handles], timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return [h for h in handles if h.future in done]

    def result(self, handle: _Request):
        return handle.future.result()

    def abort(self, handle: _Request) -> None:
        handle.abort.set()
        handle.future.cancel()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (an aborted one counts until its thread lets go)."""
        return sum(not r.future.done() for r in self.requests)

    def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight, waiting at most `timeout` s."""
        end = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < end:
            time.sleep(0.01)
        return self.in_flight == 0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

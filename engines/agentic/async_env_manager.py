"""The asynchronous environment manager: every episode runs its own loop; groups finish on their own.

ROLL's env manager + rollout scheduler, at engine level. Each episode is an asyncio task running
    reset → (prompt → generate → parse → step)* → end
on its own: its generation request goes to a ``GenerationRouter`` (engines/generation/router.py),
which batches whatever requests of all episodes are pending; its environment lives in an
``EnvWorkerPool`` (engines/agentic/env_workers.py) and steps there, off the generation thread. A slow step
delays its own episode, not the others, and the engine keeps generating for the episodes that are
ready. The episodes are built by the lock-step manager's own rules (engines/agentic/env_manager.py:
``record_action`` / ``record_reply``, chat framing, the env's stop strings and tools
(``EnvTurns``, carried in the pool's ``ResetResult``), truncation), so with a deterministic engine both
managers give identical episodes for the same seeds (tests/engines/agentic/test_async_env_manager.py).

Groups: ``len(seeds)`` groups of ``group_size`` episodes are launched (launch more than you need);
a group is complete when all its episodes are. The batch is the first ``groups_wanted`` complete
groups; the rest are cancelled (their pending generation requests dropped unsent) and counted.
With a ``keep`` predicate (dynamic sampling) only ``groups_wanted`` groups run at a time and a
rejected group is replaced by the next seed's; ``spare`` bounds the groups in flight to those still
needed plus ``spare`` (``rollout_groups``).

Failures, each costing what it must and counted in the metrics:
- the environment raises in ``step``: that episode ends, ``env_error`` set (as in lock-step);
- a step (or reset) runs past ``step_timeout_s``: that episode ends, ``env_timeout = True``,
  ``env_error = "EnvTimeout: ..."``; the pool abandons the environment (a process pool kills the
  worker running it, whose other episodes are then retried);
- the worker holding the environment dies (``EnvWorkerLost``): the episode restarts from its reset on
  another worker, up to ``max_retries`` times; past that it is dropped with its whole group (a lost
  worker is the infrastructure's failure, not the policy's, so it is not scored as a failed sample).

Policy versions: each turn records the router's version of the engine that generated it
(``Episode.policy_versions``); ``staleness(ep, current) = current − min(ep.policy_versions)``.

Notation: G = group_size episodes per seed; a group = the G episodes of one seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engines.agentic.env_manager import (
    FAILED_STEP_INFO,
    ChatFormat,
    Episode,
    EnvTurns,
    _encode,
    check_first_prompt,
    first_prompt,
    record_action,
    record_reply,
)
from engines.agentic.env_workers import EnvWorkerLost, EnvWorkerPool, ResetResult, StepResult
from engines.generation.engine import SamplingParams
from engines.generation.router import Generated, GenerationRouter

_RUNS = itertools.count()


class _Dropped(Exception):
    """An episode lost its worker more than ``max_retries`` times: its group cannot complete."""


class _StepTimeout(Exception):
    """A reset or step ran past ``step_timeout_s``."""


@dataclass
class AsyncRollout:
    episodes: list[Episode]        # the kept groups' episodes, ordered by (group_id, sample_id)
    groups: list[int]              # kept group ids, in the order they completed
    policy_version: int            # the router's version when the batch was cut (for staleness)
    metrics: dict[str, float]


def staleness(ep: Episode, current_version: int) -> int:
    """How many versions behind ``current_version`` the oldest policy of the episode's turns is."""
    return current_version - min(ep.policy_versions) if ep.policy_versions else 0


@dataclass
class _Run:
    router: GenerationRouter
    pool: EnvWorkerPool
    tokenizer: object
    env_name: str
    seeds: list[int]
    group_size: int
    max_turns: int
    max_context_tokens: int
    sampling: SamplingParams
    fmt: ChatFormat | None
    step_timeout_s: float
    max_retries: int
    tag: str
    counts: Counter

    async def _env(self, future, what: str) -> ResetResult | StepResult:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.step_timeout_s)
        except asyncio.TimeoutError:
            raise _StepTimeout(f"EnvTimeout: {what} took longer than step_timeout_s={self.step_timeout_s}") from None

    async def play(self, env_id: str, g: int, s: int) -> Episode:
        """One attempt at episode (g, s) on environment ``env_id``; the lock-step manager's turn rules."""
        seed = self.seeds[g]
        try:
            start = await self._env(self.pool.reset(env_id, seed), "reset")
        except _StepTimeout:
            raise EnvWorkerLost(f"reset of {env_id!r} timed out") from None  # no prompt yet: retried like a lost worker
        turns: EnvTurns = start.turns
        first = first_prompt(self.fmt, start.instructions, start.observation, turns)
        ids = _encode(self.tokenizer, first)
        check_first_prompt(ids, self.env_name, seed, self.sampling.max_new_tokens, self.max_context_tokens)
        ep = Episode(seed=seed, group_id=g, sample_id=s, prompt=first, prompt_token_ids=ids)
        params = turns.sampling(dataclasses.replace(self.sampling, n=1))   # the env's own stop strings too
        state_key = start.state_key
        for turn in range(self.max_turns):
            generated: Generated = await asyncio.wrap_future(
                self.router.submit(ep.prompt_token_ids + ep.response_token_ids, params))
            comp = generated.completion
            ep.policy_versions.append(generated.policy_version)
            action = record_action(ep, comp.token_ids, comp.logprobs, turn, state_key, self.tokenizer)
            try:
                result = await self._env(self.pool.step(env_id, action), f"step {turn} of {env_id!r}")
            except _StepTimeout as e:
                result = StepResult("", 0.0, True, dict(FAILED_STEP_INFO), "", error=str(e))
                ep.env_timeout = True
            ep.env_error = result.error
            self.counts["env_steps"] += 1
            if not record_reply(ep, comp.token_ids, action, result.observation, result.reward, result.done, result.info,
                                last_turn=turn == self.max_turns - 1, tokenizer=self.tokenizer, fmt=self.fmt,
                                max_new_tokens=self.sampling.max_new_tokens, max_context_tokens=self.max_context_tokens):
                break
            state_key = result.state_key
        return ep

    async def episode(self, g: int, s: int) -> Episode:
        """Episode (g, s), restarted from its reset on another worker when its worker dies."""
        for attempt in range(self.max_retries + 1):
            env_id = f"{self.tag}/g{g}/s{s}/a{attempt}"
            try:
                return await self.play(env_id, g, s)
            except EnvWorkerLost:
                self.counts["episodes_retried" if attempt < self.max_retries else "episodes_dropped"] += 1
            finally:
                self.pool.close(env_id)
        raise _Dropped(f"group {g} sample {s}")

    async def group(self, g: int) -> list[Episode] | None:
        """The G episodes of seed ``g``, or None when one of them was dropped (the rest are cancelled)."""
        tasks = [asyncio.create_task(self.episode(g, s)) for s in range(self.group_size)]
        try:
            return list(await asyncio.gather(*tasks))
        except _Dropped:
            return None
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def rollout_groups(router: GenerationRouter, pool: EnvWorkerPool, tokenizer, env_name: str, seeds: list[int], *,
                         group_size: int, max_turns: int, max_context_tokens: int, sampling: SamplingParams,
                         groups_wanted: int | None = None, chat: bool = False, step_timeout_s: float = 60.0,
                         max_retries: int = 1, keep: Callable[[list[Episode]], bool] | None = None,
                         spare: int | None = None) -> AsyncRollout:
    """Launch one group of ``group_size`` episodes per seed (``group_id`` = position in ``seeds``), keep
    the first ``groups_wanted`` (default: all) that complete, cancel the rest. ``env_name`` names the
    pool's environment in error messages; the pool decides what it runs. Everything else is
    ``run_episodes``'s meaning. Raises what a reset raises (a configuration error) and what the
    engine raises.

    ``keep`` (dynamic sampling, DAPO): only ``groups_wanted`` groups run at a time; a complete group
    ``keep`` rejects (e.g. all returns equal: no advantage) is counted in ``groups_filtered`` and, like a
    dropped group, replaced by the next seed's, until ``seeds`` is spent; then the batch is the groups
    kept so far (possibly fewer than wanted), or, when none passed, the first ``groups_wanted``
    rejected ones, unfiltered (as the RLVR rollout does, tasks/loop/prompts.py; ``filter_fallback`` = 1).

    ``spare``: groups run beyond those the batch still needs (over-provisioning, ROLL's rollout
    scheduler): at most ``groups_wanted - kept + spare`` groups are in flight, so a group that is
    rejected or dropped is replaced by the next seed's while seeds are left, and one that is kept is
    not. Default: without ``keep`` every seed's group at once (``len(seeds) - groups_wanted``), with
    ``keep`` 0."""
    if group_size < 1 or max_turns < 1:
        raise ValueError(f"group_size and max_turns must be >= 1, got {group_size} and {max_turns}")
    wanted = len(seeds) if groups_wanted is None else groups_wanted
    if not 1 <= wanted <= len(seeds):
        raise ValueError(f"groups_wanted={groups_wanted} must be between 1 and len(seeds)={len(seeds)}")
    run = _Run(router, pool, tokenizer, env_name, list(seeds), group_size, max_turns, max_context_tokens, sampling,
               ChatFormat.of(tokenizer) if chat else None, step_timeout_s, max_retries, f"run{next(_RUNS)}", Counter())
    spare = (0 if keep is not None else len(seeds) - wanted) if spare is None else spare
    if spare < 0:
        raise ValueError(f"spare={spare} must be >= 0")
    before, t0 = router.stats(), time.perf_counter()
    tasks: dict[asyncio.Task, int] = {}
    kept: list[tuple[int, list[Episode]]] = []
    rejected_groups: list[tuple[int, list[Episode]]] = []
    pending: set[asyncio.Task] = set()
    launched = 0

    def launch() -> None:   # the next seeds' groups, up to what the batch still needs plus `spare`
        nonlocal launched
        while launched < len(seeds) and len(pending) < wanted - len(kept) + spare:
            t = asyncio.create_task(run.group(launched))
            tasks[t], launched = launched, launched + 1
            pending.add(t)

    launch()
    try:
        while pending and len(kept) < wanted:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=tasks.get):
                group = t.result()
                rejected = group is not None and keep is not None and len(kept) < wanted and not keep(group)
                if group is None or rejected:
                    run.counts["groups_dropped" if group is None else "groups_filtered"] += 1
                    if rejected:
                        rejected_groups.append((tasks[t], group))
                elif len(kept) < wanted:
                    kept.append((tasks[t], group))
                else:
                    pending.add(t)   # complete but not needed: counted with the aborted ones
            if len(kept) < wanted:
                launch()   # replace what was rejected or dropped
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    fallback = keep is not None and not kept and bool(rejected_groups)
    if fallback:  # no group passed within the seeds: train on the first rejected ones rather than nothing
        kept = rejected_groups[:wanted]
    seconds = time.perf_counter() - t0
    after = router.stats()
    version = router.policy_version
    episodes = sorted((ep for _, group in kept for ep in group), key=lambda e: (e.group_id, e.sample_id))
    sizes = after.batch_sizes[len(before.batch_sizes):]
    lags = [staleness(ep, version) for ep in episodes]
    # every complete group's episodes, filtered ones included (with the fallback, the kept are rejected ones)
    played = (len(rejected_groups) + (0 if fallback else len(kept))) * group_size
    c = run.counts
    metrics = {
        "env_manager/groups_launched": float(launched),
        "env_manager/groups_filtered": float(c["groups_filtered"]),
        "env_manager/filter_fallback": float(fallback),
        "env_manager/groups_kept": float(len(kept)),
        "env_manager/groups_aborted": float(len(pending)),
        "env_manager/groups_dropped": float(c["groups_dropped"]),
        "env_manager/episodes_aborted": float(len(pending) * group_size),
        "env_manager/episodes_retried": float(c["episodes_retried"]),
        "env_manager/episodes_dropped": float(c["episodes_dropped"]),
        "env_manager/env_timeouts": float(sum(ep.env_timeout for ep in episodes)),
        "env_manager/env_errors": float(sum(ep.env_error is not None and not ep.env_timeout for ep in episodes)),
        "env_manager/env_steps": float(c["env_steps"]),
        "env_manager/generate_calls": float(len(sizes)),
        "env_manager/mean_batch_size": statistics.fmean(sizes) if sizes else 0.0,
        "env_manager/engine_busy_s": after.busy_s - before.busy_s,
        "env_manager/engine_busy_share": (after.busy_s - before.busy_s) / (seconds * after.engines) if seconds > 0 else 0.0,
        "env_manager/seconds": seconds,
        "env_manager/episodes_per_s": len(episodes) / seconds if seconds > 0 else 0.0,
        "env_manager/episodes_played": float(played),
        "env_manager/episodes_played_per_s": played / seconds if seconds > 0 else 0.0,
        "env_manager/staleness_mean": statistics.fmean(lags) if lags else 0.0,
        "env_manager/staleness_max": float(max(lags, default=0)),
        **pool.metrics(),
    }
    return AsyncRollout(episodes, [g for g, _ in kept], version, metrics)


def run_groups(router: GenerationRouter, pool: EnvWorkerPool, tokenizer, env_name: str, seeds: list[int],
               **kwargs) -> AsyncRollout:
    """``rollout_groups`` from synchronous code (its own event loop; not from inside a running one)."""
    return asyncio.run(rollout_groups(router, pool, tokenizer, env_name, seeds, **kwargs))

"""The rollout scheduler (engines/generation/scheduler.py) over a real tiny HF engine and the real isolated reward
path (engines/rewards/routing.py `score_samples`, its reward calls in worker processes), both sides in thread
pools (`ThreadedSide`)."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest

from engines.generation.engine import HFGenerationEngine, SamplingParams
from engines.generation.scheduler import ABORTED, DROPPED, KEPT, FILTERS, RolloutScheduler, ThreadedSide

G = 2


@pytest.fixture(scope="module", autouse=True)
def reward_calls():
    """The reward functions' worker processes, shared by this module's tests (started once): more than a hung
    group's samples, so a hang holds none of the other groups' calls."""
    from engines.rewards.calls import RewardCalls

    with RewardCalls(6) as calls:
        _CALLS[:] = [calls]
        yield calls
    _CALLS.clear()


_CALLS: list = []


def _sides(tiny_policy, max_new_tokens=6, seed=0, timeout_s=5.0, reward_threads=1, reward_delay=0.0, reward_wait=None,
           wrap_abort=None):
    from engines.rewards.config import RewardConfig
    from engines.rewards.models import ModelRewards
    from engines.rewards.routing import score_samples

    model, tok = tiny_policy
    reward = RewardConfig(functions={"parity": "tests.support.rewards:parity"}, timeout_s=timeout_s)
    engine = HFGenerationEngine(model, tok, micro_batch=64)
    seen = {"chunks": 0, "completions": []}

    def generate(prompts, abort):
        seen["chunks"] += 1
        abort = wrap_abort(prompts, abort) if wrap_abort else abort
        params = SamplingParams(n=G, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed + 1000 * prompts[0][0])
        out = engine.generate([tok.encode(p) for _, p in prompts], params, abort=abort)
        seen["completions"].extend(out)
        rows = [[] for _ in prompts]
        for c in out:
            rows[c.prompt_index].append({"prompt": prompts[c.prompt_index][1], "response": c.text, "domain": "parity",
                                         "response_token_ids": c.token_ids, "finish_reason": c.finish_reason})
        return rows

    iso = cf.ThreadPoolExecutor(max_workers=8)

    def score(rows, abort):
        time.sleep(reward_delay)
        if reward_wait is not None:
            reward_wait.wait(30.0)
        items = [(r["domain"], r["response"], {"prompt": r["prompt"]}) for r in rows]
        results, _ = score_samples(items, reward, _CALLS[0], ModelRewards(iso))
        return results

    return ThreadedSide(generate, 1), ThreadedSide(score, reward_threads), seen


def _prompts(n, special=()):
    return [(i, special[i] if i < len(special) else f"{i}+{i}=") for i in range(n)]


def test_exactly_want_kept_groups_under_a_filter_that_drops_many(tiny_policy):
    gen, rew, _ = _sides(tiny_policy)
    sched = RolloutScheduler(gen, rew, [("all_equal", FILTERS["all_equal"])], want=3, max_prompts=40, chunk_size=2,
                             max_chunks_in_flight=2)
    res = sched.run(_prompts(40))
    assert len(res.kept) == 3 and sum(g.status == KEPT for g in res.groups) == 3
    assert all(len(set(g.rewards)) > 1 and len(g.rows) == G for g in res.kept)
    assert any(g.status == DROPPED and g.reason == "all_equal" for g in res.groups)
    assert len(res.groups) < 40  # stopped when full, not at the budget
    # a chunk that finishes with more passing groups than missing: still exactly `want`
    gen, rew, _ = _sides(tiny_policy)
    res = RolloutScheduler(gen, rew, [], want=1, max_prompts=16, chunk_size=8).run(_prompts(16))
    assert len(res.kept) == 1 and [g.status for g in res.groups].count(KEPT) == 1
    assert {g.status for g in res.groups[1:8]} <= {DROPPED, ABORTED}
    m = res.metrics(want=1)
    assert m["dynamic_sampling/kept_groups"] == 1.0 and m["rollout/generation_chunks"] >= 1.0


def test_budget_caps_the_prompts_and_returns_fewer_groups(tiny_policy):
    gen, rew, _ = _sides(tiny_policy)
    never = [("never", lambda rewards, rows: False)]
    res = RolloutScheduler(gen, rew, never, want=2, max_prompts=5, chunk_size=2).run(_prompts(100))
    assert res.kept == [] and len(res.groups) == 5 and res.chunks == 3 and res.aborted == 0
    assert res.metrics(want=2)["dynamic_sampling/generation_rounds"] == 2.5


class _CountingAbort(threading.Event):
    """An abort event that the engine polls once per decode step: set by itself after `after` polls
    (None: never), and `decoding` is set at the `mark`-th poll, so a test knows generation is under
    way without guessing how long a step takes."""

    def __init__(self, after=None, inner=None, decoding=None, mark=3):
        super().__init__()
        self.after, self.inner, self.decoding, self.mark, self.polls = after, inner, decoding, mark, 0

    def is_set(self):
        self.polls += 1
        if self.decoding is not None and self.polls >= self.mark:
            self.decoding.set()
        if self.after is not None and self.polls > self.after:
            return True
        return super().is_set() or (self.inner is not None and self.inner.is_set())


def test_aborted_requests_release_their_engine(tiny_policy):
    model, tok = tiny_policy
    engine = HFGenerationEngine(model, tok)
    abort = _CountingAbort(after=5)  # aborted 5 decode steps in, whatever the speed of the box
    out = engine.generate([tok.encode("1+1="), tok.encode("22")], SamplingParams(n=2, max_new_tokens=100, seed=0), abort=abort)
    assert len(out) == 4 and all(len(c.token_ids) < 100 and c.finish_reason in ("abort", "stop") for c in out)
    assert any(c.finish_reason == "abort" for c in out)
    # through the scheduler: the batch is full after the first chunk, the long second one (started while
    # the first chunk's groups are scored) is aborted mid-generation: scoring returns only once the
    # second chunk is decoding
    decoding = threading.Event()
    gen, rew, seen = _sides(tiny_policy, max_new_tokens=100, reward_wait=decoding,
                            wrap_abort=lambda prompts, ev: _CountingAbort(inner=ev, decoding=decoding) if prompts[0][0] > 0 else ev)
    res = RolloutScheduler(gen, rew, [], want=2, max_prompts=64, chunk_size=2, max_chunks_in_flight=2).run(_prompts(64))
    assert decoding.is_set() and len(res.kept) == 2 and res.aborted >= 1
    assert gen.wait_idle(10.0) and rew.wait_idle(10.0)  # the engine's in-flight count is back to 0
    assert any(c.finish_reason == "abort" and len(c.token_ids) < 100 for c in seen["completions"])


def test_a_raising_or_hanging_reward_neither_delays_nor_loses_the_other_groups(tiny_policy):
    gen, rew, _ = _sides(tiny_policy, timeout_s=2.0, reward_threads=4)
    res = RolloutScheduler(gen, rew, [], want=5, max_prompts=6, chunk_size=6).run(_prompts(6, special=("hang", "boom")))
    # every group but the hung one (want=5: with want=4 the kept ones depended on which reward thread
    # finished first, and a raising reward's error path is not always the fastest on a busy box)
    kept = {g.index for g in res.kept}
    assert kept == {1, 2, 3, 4, 5}  # the raising group is scored 0 and flagged, not lost
    boom = res.groups[1]
    assert boom.rewards == [0.0] * G and all("broken reward" in e for e in boom.errors)
    assert res.groups[0].status == ABORTED  # returned without waiting for the hung reward's timeout
    # with a budget that needs it, the hung group is scored (0, timeout) and the others are all kept
    gen, rew, _ = _sides(tiny_policy, timeout_s=1.0, reward_threads=4)
    res = RolloutScheduler(gen, rew, [], want=6, max_prompts=6, chunk_size=6).run(_prompts(6, special=("hang",)))
    assert len(res.kept) == 6 and all(e and "timeout" in e for e in res.groups[0].errors)


def test_deterministic_given_the_seed(tiny_policy):
    def run(seed):
        gen, rew, _ = _sides(tiny_policy, seed=seed)
        res = RolloutScheduler(gen, rew, [("all_equal", FILTERS["all_equal"])], want=3, max_prompts=30, chunk_size=2,
                               max_chunks_in_flight=2).run(_prompts(30))
        gen.wait_idle(10.0)
        return [(g.index, [r["response"] for r in g.rows]) for g in res.kept]

    assert run(1) == run(1)


def test_group_filters_follow_the_algorithm_config():
    from configs.schema import parse_config
    from engines.generation.scheduler import group_filters

    cfg = parse_config({"algorithm": {"filter_groups": True, "mask_truncated": True, "difficulty_low": 0.2,
                                      "difficulty_high": 0.8}})
    filters = dict(group_filters(cfg.algorithm))
    assert list(filters) == ["all_equal", "all_truncated", "difficulty"]
    rows = [{"finish_reason": "length"}, {"finish_reason": "stop"}]
    assert filters["all_equal"]([0.0, 1.0], rows) and not filters["all_equal"]([1.0, 1.0], rows)
    assert not filters["all_truncated"]([0.0, 1.0], [{"finish_reason": "length"}] * 2)
    assert filters["difficulty"]([0.0, 1.0], rows) and not filters["difficulty"]([1.0] * 9 + [0.0], rows * 5)
    assert group_filters(parse_config({}).algorithm) == []
    with pytest.raises(ValueError, match="want = 0"):
        RolloutScheduler(None, None, [], want=0, max_prompts=1, chunk_size=1)


def test_groups_are_scored_while_later_chunks_generate_and_the_tail_is_reported(tiny_policy):
    """No filter (rollout.score_while_generating): every group is kept; with chunks of one prompt each
    group goes to the reward side before the next chunk is generated, and a slow reward leaves only
    the last groups' scoring after generation (`rollout/reward_tail_s`). One chunk for the whole
    batch: no group is scored during generation."""
    gen, rew, _ = _sides(tiny_policy, reward_threads=4, reward_delay=0.3)
    res = RolloutScheduler(gen, rew, [], want=4, max_prompts=4, chunk_size=1).run(_prompts(4))
    assert [g.status for g in res.groups] == [KEPT] * 4 and res.chunks == 4
    times = [g.times for g in res.groups]
    assert all(t["submitted"] <= t["generated"] <= t["scored"] for t in times)
    assert [t["generated"] for t in times] == sorted(t["generated"] for t in times)
    m = res.metrics(want=4)
    assert m["rollout/groups_scored_during_generation"] == 0.75   # all but the last chunk's group
    assert 0.3 <= m["rollout/reward_tail_s"]                        # the last group's own reward, at least
    gen, rew, _ = _sides(tiny_policy, reward_threads=4, reward_delay=0.3)
    res = RolloutScheduler(gen, rew, [], want=4, max_prompts=4, chunk_size=4).run(_prompts(4))
    m = res.metrics(want=4)
    assert res.chunks == 1 and m["rollout/groups_scored_during_generation"] == 0.0
    assert m["rollout/reward_tail_s"] >= 0.3

"""The asynchronous environment manager against the lock-step reference: identical episodes with a
deterministic engine; an environment that raises, hangs or kills its worker costs only its own
episode (or is retried / dropped and counted); the batch holds exactly the groups asked for; the
router batches concurrent requests; policy versions are recorded per turn."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch

from engines.agentic.async_env_manager import run_groups, staleness
from engines.agentic.env_workers import EnvSpec, ProcessEnvPool, ThreadEnvPool
from engines.agentic.envs import ENVIRONMENTS
from engines.generation.engine import HFGenerationEngine, SamplingParams
from engines.generation.router import BatchingRouter
from engines.models.modeling import build_char_tokenizer, build_tiny_policy
from tests.support.async_envs import (
    SAMPLING,
    PromptHashEngine,
    fields,
    lockstep,
    run_async,
)
from tests.support.env_faults import FaultyLake

torch.set_num_threads(1)

def both(env_name, seeds, **kwargs):
    """(lock-step episodes, async rollout) for the same seeds and engine kind."""
    pool = kwargs.pop("pool", None)
    ref = lockstep(env_name, seeds, **kwargs)
    return ref, run_async(env_name, seeds, pool=pool, **kwargs)


@pytest.mark.parametrize("env_name,env_kwargs", [("frozenlake", {"size": 4}), ("sokoban", {}), ("tool_math", {})])
def test_async_and_lockstep_give_identical_episodes(env_name, env_kwargs):
    ref, out = both(env_name, [0, 1, 2, 3], env_kwargs=env_kwargs)
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]       # token ids, masks, rewards, flags
    assert out.groups and sorted(out.groups) == [0, 1, 2, 3]
    assert any(e.turns > 1 for e in ref)                                       # the script exercises several turns
    assert all(e.policy_versions == [0] * e.turns for e in out.episodes)
    assert out.metrics["env_manager/groups_kept"] == 4 and out.metrics["env_manager/episodes_retried"] == 0


def test_identical_in_worker_processes_and_with_the_chat_template():
    ref, out = both("sokoban", [5, 6], pool=ProcessEnvPool(EnvSpec("sokoban"), workers=2))
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}{{ eos_token }}\n{% else %}(end)\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>\n{% endif %}")
    factory = lambda: PromptHashEngine(tok)
    factory.tok = tok
    ref, out = both("frozenlake", [3, 4], engine_factory=factory, chat=True)
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref] and "<user>" in out.episodes[0].prompt


def test_identical_with_the_tiny_policy_greedy():
    """The HF engine, greedy: rows batched differently still give the same tokens (log-probs to rounding)."""
    model, tok = build_tiny_policy(hidden_size=32, num_layers=2, num_heads=2, max_positions=512, seed=0)

    def factory():
        return HFGenerationEngine(model.eval(), tok)
    factory.tok = tok
    ref, out = both("frozenlake", [0, 1, 2], engine_factory=factory, env_kwargs={"size": 4}, max_turns=4,
                    max_context_tokens=500, sampling=SamplingParams(temperature=0.0, max_new_tokens=6, stop=("\n",)))
    for a, b in zip(out.episodes, ref):
        fa, fb = fields(a), fields(b)
        la, lb = fa.pop("behaviour_logprobs"), fb.pop("behaviour_logprobs")
        assert fa == fb
        assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-4)


class _Scripted(FaultyLake):
    """FaultyLake with class-level ``behaviour`` and ``marker`` (set by each test), whose ``hang`` blocks
    on ``release`` (set at the test's end) instead of sleeping."""
    name = "scripted"
    behaviour: ClassVar[dict[int, str]] = {}
    release = threading.Event()
    marker: ClassVar[str] = ""

    def _hang(self) -> None:
        self.release.wait(30)


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    monkeypatch.setitem(ENVIRONMENTS, "scripted", _Scripted)
    monkeypatch.setattr(_Scripted, "behaviour", {})
    monkeypatch.setattr(_Scripted, "marker", str(tmp_path / "killed"))
    _Scripted.release.clear()
    yield _Scripted
    _Scripted.release.set()


def test_a_raising_environment_ends_only_its_episode(scripted):
    scripted.behaviour = {1: "raise"}
    ref, out = both("scripted", [0, 1, 2])
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]       # as lock-step: env_error, that episode only
    broken = [e for e in out.episodes if e.env_error]
    assert [e.seed for e in broken] == [1, 1] and all(e.env_error == "RuntimeError: boom" and e.turns == 1 for e in broken)
    assert out.metrics["env_manager/env_errors"] == 2 and out.metrics["env_manager/env_timeouts"] == 0


@pytest.mark.parametrize("pool_kind", ["threads", "processes"])
def test_a_hanging_environment_ends_only_its_episode(scripted, pool_kind):
    ref = [e for e in lockstep("scripted", [0, 1, 2], G=1) if e.seed != 1]
    scripted.behaviour = {1: "hang"}   # from here on (forked workers copy it at their start)
    pool = (ThreadEnvPool(EnvSpec("scripted"), threads=4) if pool_kind == "threads"
            else ProcessEnvPool(EnvSpec("scripted"), workers=2))
    out = run_async("scripted", [0, 1, 2], G=1, pool=pool, step_timeout_s=1.0)
    hung = out.episodes[1]
    assert hung.env_timeout and hung.env_error.startswith("EnvTimeout: step 0") and hung.turns == 1 and not hung.done
    others = [e for e in out.episodes if e.seed != 1]
    assert [fields(e) for e in others] == [fields(e) for e in ref]             # unaffected (retried if they shared the worker)
    assert out.metrics["env_manager/env_timeouts"] == 1 and out.metrics["env_manager/groups_kept"] == 3
    if pool_kind == "processes":                                               # the hung worker was killed and replaced
        assert out.metrics["env_workers/lost"] == 1


def test_a_killed_worker_s_episodes_are_retried_on_another(scripted):
    ref = lockstep("scripted", [0, 1, 2])
    scripted.behaviour = {1: "kill_once"}
    out = run_async("scripted", [0, 1, 2], pool=ProcessEnvPool(EnvSpec("scripted"), workers=2))
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]       # nothing lost, nothing changed
    assert out.metrics["env_workers/lost"] == 1 and out.metrics["env_manager/episodes_retried"] >= 1
    assert out.metrics["env_manager/episodes_dropped"] == 0 and out.metrics["env_manager/groups_dropped"] == 0


def test_an_episode_that_keeps_killing_its_worker_is_dropped_with_its_group_and_counted(scripted):
    """One environment per worker: seed 1 kills its worker, is retried on the fresh replacement (the
    worker holding fewest), kills that too and is dropped; the other groups are untouched."""
    scripted.behaviour = {1: "kill"}
    out = run_async("scripted", [0, 1, 2], G=1, pool=ProcessEnvPool(EnvSpec("scripted"), workers=3), max_retries=1)
    assert sorted(out.groups) == [0, 2] and [e.seed for e in out.episodes] == [0, 2]
    m = out.metrics
    assert (m["env_manager/groups_dropped"], m["env_manager/episodes_dropped"], m["env_manager/episodes_retried"]) == (1, 1, 1)
    assert m["env_workers/lost"] == 2 and m["env_manager/groups_kept"] == 2 and m["env_manager/groups_aborted"] == 0


def test_the_batch_is_the_first_complete_groups_and_the_rest_are_aborted(scripted):
    scripted.behaviour = {s: "slow" for s in (0, 1, 4, 5)}                     # seeds 2 and 3 finish first
    tok = build_char_tokenizer()
    engine = PromptHashEngine(tok)
    router = BatchingRouter([engine], max_batch=32, max_wait_s=0.005)
    pool = ThreadEnvPool(EnvSpec("scripted"), threads=16)
    try:
        out = run_groups(router, pool, tok, "scripted", [0, 1, 2, 3, 4, 5], group_size=2, groups_wanted=2,
                         max_turns=6, max_context_tokens=1500, sampling=SamplingParams(max_new_tokens=8, stop=("\n",)))
        answered = router.stats().requests
    finally:
        router.close()
        pool.shutdown()
    assert sorted(out.groups) == [2, 3] and len(out.episodes) == 4
    assert [(e.group_id, e.sample_id) for e in out.episodes] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    m = out.metrics
    assert (m["env_manager/groups_kept"], m["env_manager/groups_aborted"], m["env_manager/episodes_aborted"]) == (2, 4, 8)
    assert answered < sum(e.turns for e in out.episodes) + 8 * 6                # the aborted episodes stopped early


def test_a_spare_group_keeps_a_hung_environment_from_holding_the_batch(scripted):
    """Over-provisioning (env.extra_groups): 2 groups wanted + 1 spare in flight, out of 6 seeds. Seed 0's
    environment hangs; the batch is the next two groups to complete, the hung group is aborted and
    counted, and seeds 3-5 never start (a completed group is replaced only while the batch still needs
    one). Without the spare the batch would wait for seed 0 until env.step_timeout_s."""
    scripted.behaviour = {0: "hang"}
    tok = build_char_tokenizer()
    router = BatchingRouter([PromptHashEngine(tok)], max_batch=32, max_wait_s=0.005)
    pool = ThreadEnvPool(EnvSpec("scripted"), threads=16)
    try:
        out = run_groups(router, pool, tok, "scripted", [0, 1, 2, 3, 4, 5], group_size=2, groups_wanted=2, spare=1,
                         max_turns=6, max_context_tokens=1500, sampling=SamplingParams(max_new_tokens=8, stop=("\n",)))
    finally:
        router.close()
        pool.shutdown()
    m = out.metrics
    assert sorted(out.groups) == [1, 2] and sorted({e.seed for e in out.episodes}) == [1, 2] and len(out.episodes) == 4
    assert (m["env_manager/groups_launched"], m["env_manager/groups_kept"], m["env_manager/groups_aborted"]) == (3, 2, 1)
    assert m["env_manager/episodes_aborted"] == 2 and m["env_manager/env_timeouts"] == 0


def test_spare_with_keep_runs_that_many_more_at_a_time():
    """Dynamic sampling with a spare: 2 wanted + 1 spare run at once, rejected groups are refilled from the
    next seeds, the kept groups are the lock-step reference's episodes for their seeds; a negative spare
    is refused."""
    ref = {(e.seed, e.sample_id): e for e in lockstep("frozenlake", list(range(8)), env_kwargs={"size": 4})}
    keep = lambda g: g[0].seed % 3 == 0   # noqa: E731 -- seeds 0, 3, 6 pass
    out = run_async("frozenlake", list(range(8)), env_kwargs={"size": 4}, groups_wanted=2, keep=keep, spare=1)
    seeds = sorted({e.seed for e in out.episodes})
    assert len(seeds) == 2 and set(seeds) <= {0, 3, 6} and len(out.episodes) == 4
    assert all(fields(e) == fields(ref[(e.seed, e.sample_id)]) | {"group_id": e.group_id} for e in out.episodes)
    m = out.metrics
    assert m["env_manager/groups_filtered"] >= 1 and m["env_manager/groups_kept"] == 2 and m["env_manager/filter_fallback"] == 0
    assert m["env_manager/groups_kept"] + m["env_manager/groups_filtered"] + m["env_manager/groups_aborted"] \
        == m["env_manager/groups_launched"] >= 4                                       # seeds 0-2 at once, then refills
    with pytest.raises(ValueError, match="spare=-1"):
        run_async("frozenlake", [0, 1], env_kwargs={"size": 4}, groups_wanted=1, spare=-1)


def test_the_router_batches_concurrent_requests_across_engines():
    tok = build_char_tokenizer()
    engines = [PromptHashEngine(tok, delay_s=0.02), PromptHashEngine(tok, delay_s=0.02)]
    router = BatchingRouter(engines, max_batch=4, max_wait_s=0.05)
    pool = ThreadEnvPool(EnvSpec("frozenlake", {"size": 4}), threads=4)
    try:
        out = run_groups(router, pool, tok, "frozenlake", [0, 1, 2, 3], group_size=4, max_turns=3,
                         max_context_tokens=1500, sampling=SamplingParams(max_new_tokens=8, stop=("\n",)))
    finally:
        router.close()
        pool.shutdown()
    sizes = engines[0].batch_sizes + engines[1].batch_sizes
    turns = sum(e.turns for e in out.episodes)
    assert sum(sizes) == turns and max(sizes) == 4 and len(sizes) < turns / 2    # 16 episodes, batches of up to 4
    assert engines[0].batch_sizes and engines[1].batch_sizes                   # both engines served
    assert out.metrics["env_manager/generate_calls"] == len(sizes)
    assert out.metrics["env_manager/mean_batch_size"] == pytest.approx(turns / len(sizes))
    assert 0 < out.metrics["env_manager/engine_busy_share"] <= 1


class _Endless:
    """Never ends; its second step (turn 1) of seed 0 calls ``hook`` (set by the test) before answering."""
    name, instructions, invalid_penalty = "endless", "endless\n", -0.1
    hook = None

    def reset(self, seed):
        self.seed, self.turn = seed, 0
        return "move: "

    def step(self, action_text):
        if self.seed == 0 and self.turn == 1:
            _Endless.hook()
        self.turn += 1
        return "move: ", 0.0, False, {"valid_action": True, "effective": True, "success": False}

    def state_key(self):
        return str(self.turn)

    def solve(self):
        return None


def test_policy_versions_are_recorded_per_turn(monkeypatch):
    """A version published while episodes run (from seed 0's second step) shows in later turns;
    staleness = current version − oldest version of the episode."""
    tok = build_char_tokenizer()
    router = BatchingRouter([PromptHashEngine(tok)], max_batch=8, max_wait_s=0.005)
    monkeypatch.setitem(ENVIRONMENTS, "endless", _Endless)
    monkeypatch.setattr(_Endless, "hook", staticmethod(lambda: router.publish(1)))
    pool = ThreadEnvPool(EnvSpec("endless"), threads=8)
    try:
        out = run_groups(router, pool, tok, "endless", [0, 1], group_size=2, max_turns=4, max_context_tokens=1500,
                         sampling=SAMPLING)
    finally:
        router.close()
        pool.shutdown()
    assert out.policy_version == 1 and all(ep.turns == 4 for ep in out.episodes)
    for ep in out.episodes:
        assert len(ep.policy_versions) == 4 and ep.policy_versions == sorted(ep.policy_versions)
    # the first seed-0 episode to reach its turn-1 step generated turns 0 and 1 before it published
    assert [0, 0, 1, 1] in [ep.policy_versions for ep in out.episodes if ep.seed == 0]
    assert out.metrics["env_manager/staleness_max"] == max(staleness(ep, 1) for ep in out.episodes) == 1


def test_keep_filters_groups_and_refills_from_the_next_seeds():
    """Dynamic sampling: `wanted` groups run at a time; a rejected group is counted and replaced by the
    next seed's group; the kept groups are the lock-step reference's episodes for their seeds."""
    ref = {(e.seed, e.sample_id): e for e in lockstep("frozenlake", list(range(6)), env_kwargs={"size": 4})}
    out = run_async("frozenlake", list(range(6)), env_kwargs={"size": 4}, groups_wanted=2, keep=lambda g: g[0].seed % 2 == 0)
    assert sorted({e.seed for e in out.episodes}) == [0, 2] and len(out.episodes) == 4
    assert all(fields(e) == fields(ref[(e.seed, e.sample_id)]) | {"group_id": e.group_id} for e in out.episodes)
    m = out.metrics
    assert m["env_manager/groups_filtered"] >= 1 and m["env_manager/groups_kept"] == 2
    assert m["env_manager/groups_launched"] < 6                                        # refills only as needed
    assert m["env_manager/groups_kept"] + m["env_manager/groups_filtered"] + m["env_manager/groups_aborted"] \
        == m["env_manager/groups_launched"]
    assert m["env_manager/episodes_played"] == 2 * (2 + m["env_manager/groups_filtered"])      # groups of 2
    assert m["env_manager/episodes_played_per_s"] > m["env_manager/episodes_per_s"]


def test_keep_with_the_seeds_spent_keeps_fewer_groups():
    out = run_async("frozenlake", [0, 1, 2], env_kwargs={"size": 4}, groups_wanted=2, keep=lambda g: g[0].seed == 0)
    assert {e.seed for e in out.episodes} == {0}
    assert out.metrics["env_manager/groups_filtered"] == 2 and out.metrics["env_manager/groups_launched"] == 3
    assert out.metrics["env_manager/filter_fallback"] == 0


def test_keep_rejecting_every_group_falls_back_to_the_first_rejected():
    out = run_async("frozenlake", [0, 1, 2], env_kwargs={"size": 4}, groups_wanted=2, keep=lambda g: False)
    assert len({e.seed for e in out.episodes}) == 2 and out.metrics["env_manager/filter_fallback"] == 1
    assert out.metrics["env_manager/groups_filtered"] == 3 and out.metrics["env_manager/groups_launched"] == 3
    assert len(out.episodes) == 4 and out.metrics["env_manager/episodes_played"] == 6    # the kept are 2 of the 3 rejected

"""The Ray environment worker pool (infra/env_pool.py) under the asynchronous manager, on a real local
Ray: the same episodes as the in-process lock-step reference for the same seeds with deterministic
engines (a prompt-hash script, the tiny policy greedy, a scripted tool caller on tool_table); a killed env worker's episodes are retried
and counted; an environment that raises or hangs ends only its own episode."""

from __future__ import annotations

import functools

import pytest
import torch

from engines.agentic.env_workers import EnvSpec
from engines.agentic.envs import ENVIRONMENTS
from engines.generation.engine import HFGenerationEngine, SamplingParams
from engines.models.modeling import build_tiny_policy
from tests.support.async_envs import fields, lockstep, run_async
from tests.support.env_faults import FaultyLake

pytestmark = pytest.mark.slow


def _pool(factory, workers=2):
    from infra.env_pool import RayEnvPool

    return RayEnvPool(factory, workers=workers, cpus=0.5, concurrency=8)


@pytest.fixture
def faulty(monkeypatch, tmp_path):
    """The lock-step reference needs the environment by name in this process."""
    monkeypatch.setitem(ENVIRONMENTS, "faulty", FaultyLake)
    return lambda behaviour: functools.partial(FaultyLake, behaviour, str(tmp_path / "killed"))


def test_ray_pool_gives_the_lockstep_episodes(ray_local):
    seeds = [0, 1, 2, 3]
    for name in ("sokoban",):
        ref = lockstep(name, seeds)
        out = run_async(name, seeds, pool=_pool(EnvSpec(name)))
        assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]
        assert out.metrics["env_workers/actors"] == 2 and out.metrics["env_workers/lost"] == 0


def test_ray_pool_carries_the_env_stop_strings_and_tools(ray_local):
    """tool_table through the Ray actors: its stop strings and tool specs reach the manager in the
    reset's EnvTurns (tests/engines/agentic/test_tool_calls_episodes.py has the in-process cases)."""
    from tests.support.tool_episodes import CALL, QWEN25_TEMPLATE, SAMPLING, ScriptedToolEngine, char_tokenizer

    tok = char_tokenizer(QWEN25_TEMPLATE)

    def factory():
        return ScriptedToolEngine(tok)
    factory.tok = tok
    common = dict(engine_factory=factory, chat=True, max_turns=5, max_context_tokens=4000, sampling=SAMPLING)
    ref = lockstep("tool_table", [0, 1], **common)
    out = run_async("tool_table", [0, 1], pool=_pool(EnvSpec("tool_table")), **common)
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]
    assert all(e.actions[1] == CALL and "<tool_response>" in e.env_replies[1] for e in out.episodes)


def test_ray_pool_with_the_tiny_policy_greedy(ray_local):
    model, tok = build_tiny_policy(hidden_size=32, num_layers=2, num_heads=2, max_positions=512, seed=0)

    def factory():
        return HFGenerationEngine(model.eval(), tok)
    factory.tok = tok
    kw = {"engine_factory": factory, "env_kwargs": {"size": 4}, "max_turns": 4, "max_context_tokens": 500,
          "sampling": SamplingParams(temperature=0.0, max_new_tokens=6, stop=("\n",))}
    ref = lockstep("frozenlake", [0, 1, 2], **kw)
    out = run_async("frozenlake", [0, 1, 2], pool=_pool(EnvSpec("frozenlake", {"size": 4})), **kw)
    assert len(out.episodes) == len(ref) == 6
    for a, b in zip(out.episodes, ref):
        fa, fb = fields(a), fields(b)
        la, lb = fa.pop("behaviour_logprobs"), fb.pop("behaviour_logprobs")
        assert fa == fb
        assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-4)


def test_a_killed_env_worker_is_retried_and_counted(ray_local, faulty):
    ref = lockstep("faulty", [0, 1, 2], env_kwargs={"behaviour": {}})
    out = run_async("faulty", [0, 1, 2], pool=_pool(faulty({1: "kill_once"})))
    assert [fields(e) for e in out.episodes] == [fields(e) for e in ref]       # every episode, as if nothing died
    assert out.metrics["env_workers/lost"] == 1
    assert out.metrics["env_manager/episodes_retried"] >= 1                    # seed 1's and its worker-mates'
    assert out.metrics["env_manager/episodes_dropped"] == 0 and out.metrics["env_manager/groups_kept"] == 3


def test_an_env_worker_dying_every_time_drops_its_group_and_counts_it(ray_local, faulty):
    ref = {e.seed: e for e in lockstep("faulty", [0, 1, 2], G=1, env_kwargs={"behaviour": {}})}
    out = run_async("faulty", [0, 1, 2], G=1, pool=_pool(faulty({1: "kill"})), max_retries=1)
    m = out.metrics
    assert 1 not in [e.seed for e in out.episodes] and m["env_workers/lost"] >= 2    # both attempts killed their worker
    assert m["env_manager/groups_dropped"] >= 1 and m["env_manager/episodes_dropped"] >= 1
    assert m["env_manager/groups_kept"] + m["env_manager/groups_dropped"] == 3        # none lost silently
    assert all(fields(e) == fields(ref[e.seed]) for e in out.episodes)


def test_a_raising_or_hanging_environment_ends_only_its_episode(ray_local, faulty):
    ref = {e.seed: e for e in lockstep("faulty", [0, 1, 2, 3], G=1, env_kwargs={"behaviour": {}})}
    out = run_async("faulty", [0, 1, 2, 3], G=1, pool=_pool(faulty({1: "raise", 2: "hang"})), step_timeout_s=2.0)
    by_seed = {e.seed: e for e in out.episodes}
    assert by_seed[1].env_error == "RuntimeError: boom" and by_seed[1].turns == 1 and not by_seed[1].env_timeout
    assert by_seed[2].env_timeout and by_seed[2].env_error.startswith("EnvTimeout: step 0") and by_seed[2].turns == 1
    assert fields(by_seed[0]) == fields(ref[0]) and fields(by_seed[3]) == fields(ref[3])
    assert out.metrics["env_manager/env_errors"] == 1 and out.metrics["env_manager/env_timeouts"] == 1
    assert out.metrics["env_workers/lost"] == 1                                 # the hung step's actor was killed

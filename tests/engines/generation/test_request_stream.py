"""Request streams (engines/generation/request_stream.py, tasks/loop/streams.py): the continuous router addressed by
request ids inside a generation actor, and the caller's router over several such actors. A scripted
streaming engine stands in for vLLM here (tests/support/streaming.py); the GenerationWorker over
vLLM itself is tests/engines/generation/test_vllm_engine.py's `test_generation_worker_streams_requests_with_vllm`."""

from __future__ import annotations

import time

import pytest

from engines.generation.engine import SamplingParams
from engines.generation.request_stream import RequestStream
from tests.support.streaming import ScriptedStreamingEngine, StreamActor

PARAMS = SamplingParams(max_new_tokens=16)


def _collect_all(stream: RequestStream, n: int, timeout_s: float = 10.0) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += stream.collect(0.5)
    return out


def test_a_late_short_request_is_collected_before_an_early_long_one():
    engine = ScriptedStreamingEngine(version=3, step_s=0.01)
    stream = RequestStream(engine, policy_version=3, name="actor-a")
    try:
        stream.submit("long", [12], PARAMS)
        time.sleep(0.03)
        stream.submit("short", [2], PARAMS)
        done = _collect_all(stream, 2)
    finally:
        stats = stream.close()
    assert [rid for rid, _, _ in done] == ["short", "long"]
    by_id = {rid: (gen, err) for rid, gen, err in done}
    assert by_id["short"][1] is None and by_id["short"][0].completion.token_ids == [101, 102]
    assert by_id["long"][0].completion.token_ids == [100 + k for k in range(1, 13)]
    assert {gen.policy_version for gen, _ in by_id.values()} == {3}
    assert stats.requests == 2 and stats.calls >= 12 and max(stats.batch_sizes) == 2


def test_cancel_aborts_in_the_engine_and_a_cancel_that_arrives_first_keeps_the_request_out():
    engine = ScriptedStreamingEngine(step_s=0.01)
    stream = RequestStream(engine, name="actor-a")
    try:
        stream.cancel(["early-cancel"])          # the cancel overtook its submit
        stream.submit("early-cancel", [3], PARAMS)
        stream.submit("long", [400], PARAMS)
        stream.submit("short", [2], PARAMS)
        deadline = time.monotonic() + 5
        while engine.steps < 3 and time.monotonic() < deadline:   # both in the engine; "short" done after 2 steps
            time.sleep(0.01)
        stream.cancel(["long"])
        done = _collect_all(stream, 1)
        time.sleep(0.1)
        done += stream.collect(0.1)
    finally:
        stream.close()
    assert [rid for rid, _, _ in done] == ["short"]
    assert engine.added == [400, 2]             # "early-cancel" (first token 3) never reached the engine
    assert len(engine.aborted) == 1             # "long", aborted while running
    assert stream.in_flight == 0


def test_an_engine_failure_and_refused_requests_are_collected_as_errors_naming_the_actor():
    engine = ScriptedStreamingEngine(step_s=0.01)
    stream = RequestStream(engine, name="generation actor g0")
    stream.submit("ok", [50], PARAMS)
    stream.submit("bad", [0], PARAMS)           # the scripted engine fails the step it is in
    done = _collect_all(stream, 2)
    assert sorted(rid for rid, _, _ in done) == ["bad", "ok"]
    assert all(gen is None and err.startswith("generation actor g0: RuntimeError: scripted engine failure")
               for _, gen, err in done), done
    stream.submit("twice", [50], PARAMS)
    stream.submit("twice", [50], PARAMS)
    stream.submit("many", [5], SamplingParams(n=2))
    refused = _collect_all(stream, 2)
    assert {rid: err for rid, _, err in refused} == {
        "twice": "generation actor g0: ValueError: request id 'twice' is already running",
        "many": "generation actor g0: ValueError: a routed request asks for one completion; got SamplingParams.n=2"}
    stream.close()
    stream.submit("late", [5], PARAMS)
    (late,) = stream.collect(1.0)
    assert late[0] == "late" and late[2] == "generation actor g0: RuntimeError: the request stream is closed"


# --- the caller's side over real Ray actors -----------------------------------------------------------

@pytest.mark.slow
def test_actor_streams_route_collect_cancel_and_survive_a_killed_actor(ray_local):
    from tasks.loop.streams import ActorStreams

    ray = ray_local
    Actor = ray.remote(max_concurrency=4)(StreamActor)
    actors = [Actor.remote("actor-a", 5, 0.01), Actor.remote("actor-b", 4, 0.01)]
    with pytest.raises(ray.exceptions.RayTaskError, match="actor-c refuses to stream"):
        ActorStreams([actors[0], Actor.remote("actor-c", 4, 0.01, refuse=True)])
    assert ray.get(actors[0].is_open.remote()) is False     # the stream that did open was closed again
    router = ActorStreams(actors)
    try:
        assert router.policy_version == 4                      # the oldest policy the actors serve
        futures = [router.submit([n], PARAMS) for n in (6, 3, 5, 2)]
        results = [f.result(timeout=30) for f in futures]
        assert [len(g.completion.token_ids) for g in results] == [6, 3, 5, 2]
        assert sorted(g.policy_version for g in results) == [4, 4, 5, 5]   # two requests per actor (fewest in flight)
        stats = router.stats()
        assert stats.engines == 2 and stats.requests == 4 and stats.calls >= 6 and stats.busy_s > 0

        doomed = router.submit([10_000], PARAMS)               # runs until cancelled
        time.sleep(0.3)
        assert doomed.cancel()
        deadline = time.monotonic() + 10
        while not any(ray.get([a.aborted.remote() for a in actors])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(len(x) for x in ray.get([a.aborted.remote() for a in actors])) == 1   # aborted in its engine

        stuck = [router.submit([10_000], PARAMS) for _ in range(2)]   # one per actor
        time.sleep(0.3)
        ray.kill(actors[0])
        import concurrent.futures as cf

        done, survivor = cf.wait(stuck, timeout=15, return_when=cf.FIRST_COMPLETED)
        assert len(done) == 1 and len(survivor) == 1, (done, survivor)   # the killed actor's request only
        with pytest.raises(RuntimeError, match="(?s)generation actor 0 of the request streams failed.*killed"):
            done.pop().result()
        survivor = list(survivor)
        after = router.submit([2], PARAMS).result(timeout=30)  # new requests go to the live actor only
        assert after.policy_version == 4 and len(after.completion.token_ids) == 2
        survivor[0].cancel()
    finally:
        router.close()
    assert router.stats().requests >= 5
    with pytest.raises(RuntimeError, match="the router is closed"):
        router.submit([2], PARAMS)

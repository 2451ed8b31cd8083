"""A GenerationWorker Ray actor's abort, checked the same way on the HF engine
(tests/tasks/actors/test_generation_abort.py) and on vLLM (tests/engines/generation/test_vllm_engine.py)."""

from __future__ import annotations

import ray


def abort_then_serve(worker, ids: list[list[int]], long) -> list:
    """On a loaded GenerationWorker actor: start generate r1 (`long` on `ids`) and queue r2 behind it,
    abort r2 (not started: remembered) and then r1 (reached while it runs), check r2 returns [] and the
    actor then serves r3 and a call without request id as before. Returns r1's (aborted) completions."""
    from engines.generation.engine import SamplingParams

    running = worker.generate.remote(ids, long, "r1")
    queued = worker.generate.remote(ids[:2], long, "r2")     # behind r1 in the actor's call order
    ray.wait([running], timeout=0.5)                           # r1 is under way
    assert ray.get(worker.abort.remote("r2")) is False         # not started yet: remembered
    assert ray.get(worker.abort.remote("r1")) is True          # reaches r1 while it runs
    out = ray.get(running)
    assert ray.get(queued) == []                               # its abort came first: nothing generated

    short = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1)
    done = ray.get(worker.generate.remote(ids[:3], short, "r3"))
    assert len(done) == 6 and all(c.finish_reason in ("stop", "length") for c in done)
    plain = ray.get(worker.generate.remote(ids[:3], short))    # no request id: as before
    assert [c.token_ids for c in plain] == [c.token_ids for c in done]
    return out

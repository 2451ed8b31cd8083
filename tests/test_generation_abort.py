"""`GenerationWorker.abort` through Ray: the abort reaches a generate call that is running (its own
concurrency group), the HF engine stops and the actor is free for the next call; an abort that comes
before its call makes the call return at once; other requests run to the end."""

from __future__ import annotations

import ray

from tests.test_workflow import REPO


def test_abort_stops_a_running_generate_and_frees_the_actor(tmp_path, monkeypatch, tiny_model_dir):
    from configs.schema import parse_config
    from engines.generation import SamplingParams
    from infra.store import ArtifactStore
    from tasks.types import RunSpec
    from tasks.workers import GenerationWorker

    root = str(tmp_path / "store")
    ArtifactStore(root).publish(tiny_model_dir, "runs/t/policy/v0000", kind="checkpoint", producer="test")
    cfg = parse_config({"run": {"torch_threads": 1}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), "t", root, "", "")
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))  # the actor inherits the driver's env
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = GenerationWorker.options(num_cpus=0).remote(threads=1, micro_batch=8)
        assert ray.get(worker.load.remote(spec, "runs/t/policy/v0000")) == "loaded"
        ids = ray.get(worker.encode.remote([f"{i}+{i}=" for i in range(64)], False))
        long = SamplingParams(n=8, temperature=1.0, max_new_tokens=120, seed=0)  # 64 micro-batches of 8 rows

        out = abort_then_serve(worker, ids, long)
        assert len(out) < 64 * 8                                   # micro-batches not started were skipped
    finally:
        ray.shutdown()


def abort_then_serve(worker, ids: list[list[int]], long) -> list:
    """On a loaded GenerationWorker actor: start generate r1 (`long` on `ids`) and queue r2 behind it,
    abort r2 (not started: remembered) and then r1 (reached while it runs), check r2 returns [] and the
    actor then serves r3 and a call without request id as before. Returns r1's (aborted) completions."""
    from engines.generation import SamplingParams

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

"""`GenerationWorker.abort` through Ray: the abort reaches a generate call that is running (its own
concurrency group), the HF engine stops and the actor is free for the next call; an abort that comes
before its call makes the call return at once; other requests run to the end."""

from __future__ import annotations

import ray

from tests.support.generation import abort_then_serve
from tests.support.workflow import REPO


def test_abort_stops_a_running_generate_and_frees_the_actor(tmp_path, monkeypatch, tiny_model_dir):
    from configs.schema import parse_config
    from engines.generation.engine import SamplingParams
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec
    from tasks.actors.generation import GenerationWorker

    root = str(tmp_path / "store")
    ArtifactStore(root).publish(tiny_model_dir, "runs/t/policy/v0000", kind="checkpoint", producer="test")
    cfg = parse_config({"run": {"torch_threads": 1}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), "t", root, "", "")
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))  # the actor inherits the driver's env
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = GenerationWorker.options(num_cpus=0).remote(threads=1, micro_batch=8)
        assert ray.get(worker.load.remote(spec, "runs/t/policy/v0000", 0)) == ("loaded", 0)
        ids = ray.get(worker.encode.remote([f"{i}+{i}=" for i in range(64)], False))
        long = SamplingParams(n=8, temperature=1.0, max_new_tokens=120, seed=0)  # 64 micro-batches of 8 rows

        out = abort_then_serve(worker, ids, long)
        assert len(out) < 64 * 8                                   # micro-batches not started were skipped
    finally:
        ray.shutdown()

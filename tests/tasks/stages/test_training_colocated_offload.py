"""placement.offload_generation through real Ray actors: generation actors that sleep after each
rollout (tasks/stages/rollout.py: `GenerationWorker.sleep`, level 2 for 'weights') and wake for the next
use -- weights allocated, filled by the live sync (tasks/loop/live_sync.py) or by a load from the store,
then the cache -- sample exactly what generation actors that never sleep sample. The engine layer is
tests/engines/generation/test_engine_sleep.py; the memory it saves, benchmarks/colocation_memory.py."""

from __future__ import annotations

import pytest
import ray

from tests.support.policies import publish_two_versions
from tests.support.workflow import REPO


def _pass(spec, cfg, run: str, offload: bool) -> list:
    """Samples of v0, of v1 after a live sync, and of v0 again after a load from the store, with the
    generation actors asleep (weights freed) between the samplings when `offload`."""
    from engines.generation.engine import SamplingParams
    from tasks.loop.live_sync import live_sync
    from tasks.actors.pools import generation_pool, generate_sharded
    from tasks.actors.hybrid import train_workers
    from tasks.run.types import PolicyRef

    v0, v1 = f"runs/{run}/policy/v0000", f"runs/{run}/policy/v0001"
    params = SamplingParams(n=2, max_new_tokens=6, seed=1, temperature=1.0)

    def sample(gens):
        ids = ray.get(gens[0].encode.remote(["1+2=", "rev abc=", "9-3+4-1=", "7+1="], False))
        return [[(c.token_ids, c.logprobs) for c in done] for _, done in generate_sharded(gens, ids, params)]

    def sleep(gens):  # what the rollout stage does at its end
        if offload:
            ray.get([g.sleep.remote(2, "placement.offload_generation=weights") for g in gens])
            held = ray.get([g.__ray_call__.remote(lambda w: sum(p.numel() for p in w.engine.model.parameters())) for g in gens])
            assert held == [0] * len(gens)   # the weights are freed, not just marked

    gens = generation_pool(spec, PolicyRef(key=v0, version=0))
    samples = [sample(gens)]
    sleep(gens)
    (trainer,) = train_workers(cfg, run)
    ray.get(trainer.load.remote(spec, v1, cfg.training, cfg.algorithm))
    assert live_sync(spec, cfg, [trainer], 1, v1)["version"] == 1   # wakes the weights, fills them, wakes the cache
    samples.append(sample(generation_pool(spec, PolicyRef(key=v1, version=1))))   # served already: nothing loaded
    sleep(gens)
    samples.append(sample(generation_pool(spec, PolicyRef(key=v0, version=0))))   # the store path fills them
    return samples


@pytest.mark.slow
def test_sleeping_colocated_generators_sample_what_awake_ones_do(tmp_path, monkeypatch, tiny_model_dir):
    from configs.schema import parse_config
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec

    root = str(tmp_path / "store")
    colocated = {"colocate": [["actor_train", "actor_infer"]]}
    base = {"run": {"torch_threads": 1}, "rollout": {"num_workers": 1}, "sync": {"method": "live", "bucket_mb": 1, "timeout_s": 60}}
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))  # the actors inherit the driver's env
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        results = {}
        for run, offload in (("awake", "none"), ("asleep", "weights")):
            publish_two_versions(ArtifactStore(root), tiny_model_dir, tmp_path / run, run)
            cfg = parse_config({**base, "placement": {**colocated, "offload_generation": offload}})
            results[run] = _pass(RunSpec(cfg.to_json(), cfg.hash(), run, root, "", ""), cfg, run, offload == "weights")
    finally:
        ray.shutdown()
    awake, asleep = results["awake"], results["asleep"]
    assert asleep == awake                      # tokens and log-probs, every sampling
    assert awake[0] == awake[2] != awake[1]     # v0 again after the reload; v1 samples differently


def test_offload_that_cannot_take_effect_is_refused_naming_the_field(monkeypatch):
    from configs.schema import ConfigError, load_config, parse_config

    both = {"colocate": [["actor_train", "actor_infer"]]}
    for placement in ({"offload_generation": "cache"},
                      {"offload_generation": "weights", "colocate": [["actor_train", "reference"], ["actor_infer"]]}):
        with pytest.raises(ValueError, match=r"placement.offload_generation='\w+' needs actor_train and actor_infer in one "
                                             r"placement.colocate group"):
            parse_config({"placement": placement})
    on = parse_config({"placement": {**both, "offload_generation": "weights"}})
    assert on.placement.offload_generation == "weights"
    assert on.hash() == parse_config({"placement": both}).hash()   # changes no result: resumable either way
    with pytest.raises((ConfigError, ValueError), match=r"placement.offload_generation \(the agentic rollout"):
        load_config(REPO / "configs" / "frozenlake.yaml", ['placement.colocate=[["actor_train", "actor_infer"]]',
                                                             "placement.offload_generation=cache"])
    monkeypatch.setenv("FLYROLL_RAY", "per-task")
    with pytest.raises(ValueError, match=r"placement.offload_generation='cache' with FLYROLL_RAY=per-task and loop.fuse=1"):
        parse_config({"placement": {**both, "offload_generation": "cache"}})
    assert parse_config({"placement": {**both, "offload_generation": "cache"}, "loop": {"fuse": 2}}).loop.fuse == 2


@pytest.mark.slow
def test_a_trainer_actor_that_offloads_its_state_trains_what_a_resident_one_does(tmp_path, monkeypatch, tiny_model_dir,
                                                                                    tiny_policy):
    """placement.offload_train=all through a real TrainWorker actor (tasks/actors/train.py `release_memory`,
    engines/training/offload.py): two updates, the state moved to a file after each and back for the next, give
    the same metrics, checkpoint weights and trainer state, bit for bit, as an actor that kept it."""
    import torch
    from safetensors.torch import load_file

    from configs.schema import parse_config
    from infra.store import ArtifactStore
    from tasks.actors.hybrid import train_workers
    from tasks.run.types import RunSpec
    from tests.support.training import _scored_table

    root = str(tmp_path / "store")
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    table = _scored_table(*tiny_policy)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        runs = {}
        for run, mode in (("resident", "none"), ("offloaded", "all")):
            publish_two_versions(ArtifactStore(root), tiny_model_dir, tmp_path / run, run)
            cfg = parse_config({"run": {"torch_threads": 1}, "training": {"mini_batch_size": 8},
                                "placement": {"colocate": [["actor_train", "actor_infer"]], "offload_train": mode}})
            spec = RunSpec(cfg.to_json(), cfg.hash(), run, root, "", "")
            (trainer,) = train_workers(cfg, run)
            ray.get(trainer.load.remote(spec, f"runs/{run}/policy/v0000", cfg.training, cfg.algorithm))
            here = ray.get_runtime_context().get_node_id()
            steps = []
            for it in (1, 2):
                out = str(tmp_path / run / f"v{it}")
                metrics, _ = ray.get(trainer.step.remote(table, cfg.algorithm, cfg.training, 1.0, it, f"runs/{run}/policy/v{it:04d}",
                                                         True, (here, out), True, False, True))
                moved = ray.get(trainer.release_memory.remote(mode))
                held = ray.get(trainer.__ray_call__.remote(lambda w: sum(p.numel() for p in w.engine.module.parameters())))
                assert (moved > 0, held == 0) == ((True, True) if mode == "all" else (False, False))
                metrics = {k: v for k, v in metrics.items() if not k.endswith(("_s", "_per_s"))}  # timings
                steps.append((metrics, load_file(f"{out}/model.safetensors"),
                              torch.load(f"{out}/trainer_state.pt", weights_only=True)["optimizer"]["state"]))
            runs[run] = steps
            ray.kill(trainer)
    finally:
        ray.shutdown()
    for (m_res, w_res, s_res), (m_off, w_off, s_off) in zip(runs["resident"], runs["offloaded"]):
        assert m_res == m_off
        assert w_res.keys() == w_off.keys() and all(torch.equal(w_res[k], w_off[k]) for k in w_res)
        assert s_res.keys() == s_off.keys()
        assert all(torch.equal(s_res[i][k], s_off[i][k]) for i in s_res for k in s_res[i])

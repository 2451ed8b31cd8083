"""sync.method=live through real Ray actors (tasks/loop/live_sync.py): the training actor sends its weights
to the generation actors over a gloo model update group; every engine then holds the trainer's
weights bit for bit (float32), reports the new version and serves the new key, so the next rollout
loads nothing; a generation actor killed before the sync, or in its middle (over shm), is an error
naming it and the version, and the resumed iteration (the last good version from the store, then a new
group) leaves every engine on the trainer's weights again.
The whole run with live sync is tests/e2e/test_workflow.py `test_live_weight_sync_gives_the_same_run`."""

from __future__ import annotations

import os

import pytest
import ray
import torch

from tests.support.policies import publish_two_versions
from tests.support.workflow import REPO


@pytest.mark.slow
def test_live_sync_gives_every_engine_the_trainers_weights_and_names_a_dead_one(tmp_path, monkeypatch, tiny_model_dir):
    from safetensors.torch import load_file

    from configs.schema import parse_config
    from infra.store import ArtifactStore
    from tasks.loop.live_sync import LiveSyncError, live_sync
    from tasks.actors.pools import EngineVersionError, generation_pool
    from tasks.actors.hybrid import train_workers
    from tasks.run.types import PolicyRef, RunSpec

    root, run = str(tmp_path / "store"), "live"
    v1_dir = publish_two_versions(ArtifactStore(root), tiny_model_dir, tmp_path, run)
    cfg = parse_config({"run": {"torch_threads": 1}, "rollout": {"num_workers": 2},
                        "sync": {"method": "live", "bucket_mb": 1, "timeout_s": 5}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), run, root, "", "")
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))  # the actors inherit the driver's env
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        gens = generation_pool(spec, PolicyRef(key=f"runs/{run}/policy/v0000", version=0))   # as after a rollout
        (trainer,) = train_workers(cfg, run)
        ray.get(trainer.load.remote(spec, f"runs/{run}/policy/v0001", cfg.training, cfg.algorithm))

        report = live_sync(spec, cfg, [trainer], 1, f"runs/{run}/policy/v0001")
        assert report["version"] == 1 and report["engines"] == 2 and report["dtype"] == "float32"
        assert report["buckets"] >= 1 and report["bytes"] > 0

        sent = ray.get(trainer.__ray_call__.remote(lambda w: {k: v.clone() for k, v in w.model.state_dict().items()}))
        published = load_file(f"{v1_dir}/model.safetensors")
        for g in gens:
            key, version, held = ray.get(g.__ray_call__.remote(
                lambda w: (w.key, w.engine.version, {k: v.clone() for k, v in w.engine.model.state_dict().items()})))
            assert (key, version) == (f"runs/{run}/policy/v0001", 1)
            assert held.keys() == sent.keys()
            assert all(torch.equal(held[k], sent[k]) for k in sent)              # bitwise, float32
            assert all(torch.equal(held[k], published[k]) for k in published)    # = the published checkpoint
            # the next rollout finds the key already served: nothing fetched, nothing loaded
            assert ray.get(g.load.remote(spec, f"runs/{run}/policy/v0001", 1)) == ("cached", 1)
        # an engine that serves the key as another version than the one asked is refused, naming it
        with pytest.raises(EngineVersionError, match=rf"v0001 as v2: flyroll/{run}/generation/0 serves v1 \(cached\); "
                                                     rf"flyroll/{run}/generation/1 serves v1"):
            generation_pool(spec, PolicyRef(key=f"runs/{run}/policy/v0001", version=2))

        # a second sync reuses the group
        assert live_sync(spec, cfg, [trainer], 2, f"runs/{run}/policy/v0002")["version"] == 2

        ray.kill(gens[1], no_restart=True)
        with pytest.raises(LiveSyncError, match=rf"policy v3 .*generation engine flyroll/{run}/generation/1") as err:
            live_sync(spec, cfg, [trainer], 3, f"runs/{run}/policy/v0003")
        assert "holds no policy to update" in str(err.value)   # the actor started in its place
    finally:
        ray.shutdown()


def _hold_after_first_bucket(queue):
    """A GenerationWorker.on_bucket hook: after bucket 0 is applied, tell the test (`queue`) and hold
    there, so the test kills the actor in the middle of the sync at a known point (no timing guess)."""
    import threading

    def hook(i: int) -> None:
        if i == 0:
            queue.put(i)
            threading.Event().wait(120)     # until the test kills this actor
    return hook


def _state(actor) -> tuple:
    return ray.get(actor.__ray_call__.remote(
        lambda w: (w.key, w.engine.version, {k: v.clone() for k, v in w.engine.model.state_dict().items()})))


@pytest.mark.slow
def test_a_generation_actor_killed_mid_sync_over_shm_then_a_clean_resume(tmp_path, monkeypatch):
    """sync.transport: shm through Ray actors. Sync v1: both engines hold the trainer's weights bit for
    bit. Sync v2: generation actor 1 is killed by ray.kill after it applied bucket 1 of 4: a
    LiveSyncError naming flyroll/<run>/generation/1 and v2. Resume as the resumed iteration does: the
    rollout's generation_pool loads the last good version v1 from the store (the replacement actor
    builds it, the survivor, left torn, reloads it in place; each reports v1), then the retried sync
    builds a new group and both engines hold the trainer's v2 bit for bit and report v2."""
    from concurrent.futures import ThreadPoolExecutor

    from ray.util.queue import Queue
    from safetensors.torch import load_file

    from configs.schema import parse_config
    from engines.models.modeling import build_tiny_policy, save_policy
    from infra.store import ArtifactStore
    from tasks.loop.live_sync import LiveSyncError, live_sync
    from tasks.actors.pools import generation_pool
    from tasks.actors.hybrid import train_workers
    from tasks.run.types import PolicyRef, RunSpec

    root, run = str(tmp_path / "store"), "midsync"
    model, tok = build_tiny_policy(seed=0)       # 3.2 MB of float32 weights: 4 buckets of 1 MiB
    base = save_policy(model, tok, str(tmp_path / "v0"))
    v1_dir = publish_two_versions(ArtifactStore(root), base, tmp_path, run)
    cfg = parse_config({"run": {"torch_threads": 1}, "rollout": {"num_workers": 2},
                        "sync": {"method": "live", "transport": "shm", "bucket_mb": 1, "timeout_s": 30}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), run, root, "", "")
    key = {v: f"runs/{run}/policy/v{v:04d}" for v in (0, 1, 2)}
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        gens = generation_pool(spec, PolicyRef(key=key[0], version=0))
        (trainer,) = train_workers(cfg, run)
        ray.get(trainer.load.remote(spec, key[1], cfg.training, cfg.algorithm))
        report = live_sync(spec, cfg, [trainer], 1, key[1])
        assert (report["transport"], report["version"], report["buckets"]) == ("shm", 1, 4)
        published = load_file(f"{v1_dir}/model.safetensors")
        for g in gens:
            served, version, held = _state(g)
            assert (served, version) == (key[1], 1) and all(torch.equal(held[k], published[k]) for k in published)
        group = ray.get(trainer.update_group_state.remote())["token"]

        def step(w):  # what a training step leaves in the trainer: new weights (version 2)
            with torch.no_grad():
                for p in w.model.parameters():
                    p.mul_(-0.5)
        ray.get(trainer.__ray_call__.remote(step))
        held_back = Queue()
        ray.get(gens[1].__ray_call__.remote(lambda w, h=_hold_after_first_bucket(held_back): setattr(w, "on_bucket", h)))
        with ThreadPoolExecutor(1) as pool:
            attempt = pool.submit(live_sync, spec, cfg, [trainer], 2, key[2])
            assert held_back.get(timeout=60) == 0            # engine 1 applied bucket 0 of v2 and holds
            ray.kill(gens[1], no_restart=True)
            with pytest.raises(LiveSyncError, match=rf"policy v2 \({key[2]}\) failed") as err:
                attempt.result(timeout=120)
        text = str(err.value)
        assert f"generation engine flyroll/{run}/generation/1: " in text
        assert f"generation actor flyroll/{run}/generation/1, pid" in text and "is dead after applying 1/4 buckets of v2" in text
        pid = ray.get(trainer.__ray_call__.remote(lambda w: __import__("os").getpid()))

        # the resumed iteration: its rollout serves the last good version, from the store
        gens = generation_pool(spec, PolicyRef(key=key[1], version=1))
        for g in gens:
            served, version, held = _state(g)
            assert (served, version) == (key[1], 1) and all(torch.equal(held[k], published[k]) for k in published)
        # ...and its training stage syncs v2 again, through a new group
        report = live_sync(spec, cfg, [trainer], 2, key[2])
        assert (report["transport"], report["version"]) == ("shm", 2)
        assert ray.get(trainer.update_group_state.remote())["token"] not in (None, group)
        sent = ray.get(trainer.__ray_call__.remote(lambda w: {k: v.clone() for k, v in w.model.state_dict().items()}))
        for g in gens:
            served, version, held = _state(g)
            assert (served, version) == (key[2], 2) and held.keys() == sent.keys()
            assert all(torch.equal(held[k], sent[k]) for k in sent)
    finally:
        ray.shutdown()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"flyroll-wsync-{pid}-")]   # every bucket file unlinked


def test_live_sync_is_refused_in_per_task_mode_and_with_a_lag(monkeypatch):
    from configs.schema import parse_config

    monkeypatch.setenv("FLYROLL_RAY", "per-task")
    with pytest.raises(ValueError, match=r"per-task mode .*the store is the hand-off.*training cluster is gone"):
        parse_config({"sync": {"method": "live"}})
    assert parse_config({"sync": {"method": "live"}, "loop": {"fuse": 2}}).sync.method == "live"   # one cluster
    assert parse_config({"sync": {"method": "live", "bucket_mb": 8}, "loop": {"fuse": 2}}).hash() == \
        parse_config({"loop": {"fuse": 2}}).hash()                  # same bits to the generators: same run
    monkeypatch.setenv("FLYROLL_RAY", "shared")
    with pytest.raises(ValueError, match=r"sync.method=live with pipeline.off_policy_steps=1"):
        parse_config({"sync": {"method": "live"}, "pipeline": {"off_policy_steps": 1}, "algorithm": {"tis_cap": 2.0}})


def test_sync_transport_is_refused_where_it_would_do_nothing_or_cannot_run(monkeypatch):
    """shm / cuda_ipc move a live sync's buckets: with sync.method store they would be ignored, so they
    are refused; cuda_ipc needs actor_train and actor_infer on cuda, checked where the profile is known
    (infra/resources.py check_placement, before any cluster; tasks/loop/live_sync.py again at the training
    stage)."""
    from configs.schema import ConfigError, parse_config
    from infra.resources import check_placement
    from tasks.loop.live_sync import check_live_sync

    monkeypatch.delenv("FLYROLL_PROFILE", raising=False)
    monkeypatch.setenv("FLYROLL_RAY", "shared")
    with pytest.raises(ValueError, match=r"sync.transport=shm moves the weights of a live sync; with sync.method=store"):
        parse_config({"sync": {"transport": "shm"}})
    with pytest.raises(ValueError, match=r"sync.transport: got 'nccl' -- Input should be 'broadcast', 'shm' or 'cuda_ipc'"):
        parse_config({"sync": {"method": "live", "transport": "nccl"}})
    check_placement(parse_config({"sync": {"method": "live", "transport": "shm"}}))      # CPU memory: any device
    cuda_ipc = {"method": "live", "transport": "cuda_ipc"}
    cpu = parse_config({"sync": cuda_ipc})
    for check in (lambda: check_placement(cpu), lambda: check_live_sync(cpu, fused=True)):
        with pytest.raises(ConfigError, match=r"sync.transport='cuda_ipc' .*placement resolves actor_train on cpu, "
                                              r"actor_infer on cpu \(FLYROLL_PROFILE=cpu\)"):
            check()
    with pytest.raises(ConfigError, match=r"resolves actor_train on cpu \("):
        check_placement(parse_config({"sync": cuda_ipc, "placement": {"actor_infer": {"gpu": 1}}}))
    check_placement(parse_config({"sync": cuda_ipc, "placement": {"actor_train": {"gpu": 1}, "actor_infer": {"gpu": 1}}}))


def test_live_sync_unfused_on_a_flyte_cluster_is_refused_by_the_first_task():
    from configs.schema import parse_config
    from tasks.stages.prepare import check_remote_sync

    remote = {"FLYTE_INTERNAL_EXECUTION_ID": "f3a9c1d2"}
    with pytest.raises(ValueError, match=r"loop.fuse=1 on a Flyte cluster: in per-task mode .*store is the hand-off"):
        check_remote_sync(parse_config({"sync": {"method": "live"}}), remote)
    check_remote_sync(parse_config({"sync": {"method": "live"}, "loop": {"fuse": 4}}), remote)   # one cluster: allowed
    check_remote_sync(parse_config({"sync": {"method": "live"}}), {})                            # local shared Ray: allowed


def test_a_bucket_below_the_largest_tensor_is_a_clear_error():
    from engines.weight_sync.update_group import plan_buckets

    with pytest.raises(ValueError, match=r"below the largest tensor: big \[1024, 1024\] .*set bucket_bytes >= 4194304"):
        plan_buckets([("small", (4,)), ("big", (1024, 1024))], torch.float32, 1 << 20)

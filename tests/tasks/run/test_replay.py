"""`checkpoint.optimizer_every` (tasks/run/replay.py): which versions hold trainer_state.pt, that the
others are smaller, that pruning keeps the state a replay needs, and that rebuilding a version's
trainer state by replay is exact (bitwise at one torch thread)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.compare import assert_bitwise_equal
from tests.support.workflow import _config, _pyflyte_run

STATE = "trainer_state.pt"


def test_which_iterations_hold_their_trainer_state():
    from tasks.run.replay import trainer_state_due

    # every 3, 8 iterations, actor kept between iterations: multiples of 3 and the last
    assert [i for i in range(1, 9) if trainer_state_due(i, 3, 8, actor_kept=True)] == [3, 6, 8]
    # the actor will not live on (a Ray cluster per task, the last iteration of a fused task): always
    assert all(trainer_state_due(i, 3, 8, actor_kept=False) for i in range(1, 9))
    assert all(trainer_state_due(i, 1, 8, actor_kept=True) for i in range(1, 9))  # 1: every version, as before


def test_optimizer_every_is_left_out_of_the_config_hash():
    from configs.schema import FlyrollConfig, parse_config

    assert parse_config({"checkpoint": {"optimizer_every": 4}}).hash() == FlyrollConfig().hash()
    with pytest.raises(ValueError, match="optimizer_every"):
        parse_config({"checkpoint": {"optimizer_every": 0}})


def test_pruning_keeps_the_newest_held_trainer_state_for_a_replay(tmp_path):
    """keep_trainer_states=1, states in v2 and v4 only (optimizer_every=2), v5 and v6 deferred: v2's
    state goes when v4 is published, v4's stays while v5 and v6 (which a resume rebuilds from it) are
    published. (Pruning version N-keep by iteration number dropped v4's at v5.)"""
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec
    from tasks.stages.weight_sync import prune_trainer_states

    store = ArtifactStore(str(tmp_path / "store"))
    spec = RunSpec(config_json="{}", config_hash="h", run_id="r1", store_uri=str(tmp_path / "store"),
                   tracking_uri="", mlflow_run_id="")
    full, lean = tmp_path / "full", tmp_path / "lean"
    for d, rels in ((full, ("model.safetensors", STATE)), (lean, ("model.safetensors",))):
        d.mkdir()
        for rel in rels:
            (d / rel).write_bytes(rel.encode())
    pruned = {}
    for it in range(1, 7):
        held = it in (2, 4)
        meta = {"iteration": it} if held else {"iteration": it, "trainer_state_deferred": "checkpoint.optimizer_every=2"}
        store.publish(str(full if held else lean), f"runs/r1/policy/v{it:04d}", kind="checkpoint", producer="test",
                      metadata=meta)
        pruned[it] = prune_trainer_states(store, spec, it, keep=1)
    assert pruned == {1: None, 2: None, 3: None, 4: "runs/r1/policy/v0002", 5: None, 6: None}
    assert [v for v in range(1, 7) if STATE in store.manifest(f"runs/r1/policy/v{v:04d}").files] == [4]


def _published(store, key: str, tmp: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    d = store.fetch(key, str(tmp / key.replace("/", "_")))
    return load_file(f"{d}/model.safetensors"), torch.load(f"{d}/{STATE}", weights_only=True)


@pytest.fixture(scope="module")
def lean_run(tmp_path_factory):
    """The e2e config for 4 iterations with checkpoint.optimizer_every: 2, through pyflyte (unfused,
    the shared local Ray instance: the training actor lives on between iterations)."""
    tmp = tmp_path_factory.mktemp("lean")
    config = _config(tmp, checkpoint={"optimizer_every": 2}, loop={"iterations": 4, "eval_every": 4},
                     run={"keep_trainer_states": 2})
    proc = _pyflyte_run(tmp, "--config", str(config))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return tmp, config


def _versions(tmp: Path):
    from infra.store import ArtifactStore

    store = ArtifactStore(str(tmp / "runs" / "store"))
    keys = [k for k in store.list("runs") if "/policy/" in k]
    return store, keys, [store.manifest(k) for k in keys]


@pytest.mark.slow  # a real pyflyte run (~50-90 s): kept out of the default tier
def test_lean_run_publishes_trainer_state_every_n_and_at_the_end(lean_run):
    tmp, _ = lean_run
    store, keys, manifests = _versions(tmp)
    assert [k.rsplit("/", 1)[-1] for k in keys] == ["v0001", "v0002", "v0003", "v0004"]
    assert [m.metadata["iteration"] for m in manifests if STATE in m.files] == [2, 4]  # every 2nd (4: also the last)
    for m in manifests:  # the others: deferred (a resume replays them), not pruned
        assert ("trainer_state_deferred" in m.metadata) == (STATE not in m.files)
        assert "pruned" not in m.metadata and {"model.safetensors", "tokenizer.json"} <= set(m.files)
    size = [sum(f.size for f in m.files.values()) for m in manifests]
    state = manifests[1].files[STATE].size
    assert size[0] == size[2] == size[1] - state > 0 and size[1] == size[3]
    print(f"\nbytes per version: {size}; trainer_state.pt {state}; optimizer_every=1 would publish "
          f"{sum(size) + 2 * state} in all, this run {sum(size)}")


@pytest.mark.slow  # a real pyflyte run (~50-90 s): kept out of the default tier
@pytest.mark.parametrize("deferred", [3, 1])
def test_replay_rebuilds_a_deferred_version_exactly(lean_run, tmp_path, monkeypatch, deferred):
    """A fresh TrainWorker (as after a resume) loads v0003 (v0001), which has no trainer state: it
    replays that iteration's update from v0002's state (the run's starting policy, optimizer afresh as
    iteration 1 starts) on the stored rollout table, and one more update on the next iteration's stored
    table then gives the next version's weights and trainer_state.pt bit for bit (one torch thread).
    Loading the version without the replay (optimizer afresh) does not."""
    import io

    import pandas as pd
    from safetensors.torch import load as load_safetensors

    from configs.schema import load_config
    from tasks.run.keys import rollout_table_key
    from tasks.run.replay import update_args
    from tasks.run.types import RunSpec
    from tasks.actors.train import TrainWorker

    tmp, config = lean_run
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    store, keys, manifests = _versions(tmp)
    cfg = load_config(config)
    run_id = keys[0].split("/")[1]
    spec = RunSpec(cfg.to_json(), cfg.hash(), run_id, str(tmp / "runs" / "store"), "", "")
    tcfg, acfg = cfg.training, cfg.algorithm
    key, next_key = keys[deferred - 1], keys[deferred]
    base = keys[deferred - 2] if deferred > 1 else manifests[0].parents[0]  # models/tiny-...: the run's start
    table = pd.read_parquet(f"{store.fetch(rollout_table_key(spec, deferred + 1), str(tmp_path / 't'))}/rollout.parquet")
    a = update_args(cfg, deferred + 1)
    want_w, want_state = _published(store, next_key, tmp_path)

    def next_version(worker) -> tuple[dict, dict]:
        _, files = worker.step(table, acfg, tcfg, a["temperature"], a["seed"], next_key, a["train_actor"], None, True)
        return load_safetensors(files["model.safetensors"]), torch.load(io.BytesIO(files[STATE]), weights_only=True)

    worker = TrainWorker.__ray_actor_class__(threads=1)
    how = worker.load(spec, key, tcfg, acfg)
    assert how == f"replayed 1 update(s) from {base}", how  # and the weights equal the published ones
    got_w, got_state = next_version(worker)
    assert_bitwise_equal(got_w, want_w, "weights")
    assert_bitwise_equal(got_state, want_state, STATE)

    afresh = TrainWorker.__ray_actor_class__(threads=1)
    afresh._load(spec, key, tcfg, acfg)  # the version's weights, no trainer state: what a load did before
    w, _ = next_version(afresh)
    assert any(not torch.equal(w[k], want_w[k]) for k in want_w)


@pytest.mark.slow  # a real pyflyte run (~50-90 s): kept out of the default tier
def test_replay_that_misses_the_published_weights_keeps_them_and_warns(lean_run, tmp_path, monkeypatch, capsys):
    """A copy of the run's store whose v0003 has other weights (as another thread count's rounding
    would give): the replay differs by 1e-3, so the worker trains on from the published weights with
    the replayed optimizer and objective state, and says so naming the difference."""
    import shutil

    from safetensors.torch import load_file, save_file

    from configs.schema import load_config
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec
    from tasks.actors.train import TrainWorker

    tmp, config = lean_run
    store, keys, manifests = _versions(tmp)
    cfg = load_config(config)
    tcfg, acfg = cfg.training, cfg.algorithm
    run_id = keys[0].split("/")[1]
    copy = tmp_path / "store"
    shutil.copytree(tmp / "runs" / "store", copy)
    shutil.rmtree(copy / keys[2])
    local = store.fetch(keys[2], str(tmp_path / "v3"))
    weights = load_file(f"{local}/model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, f"{local}/model.safetensors", metadata={"format": "pt"})
    m = manifests[2]
    ArtifactStore(str(copy)).publish(local, keys[2], kind="checkpoint", producer="test", parents=m.parents, metadata=m.metadata)

    def loaded(store_dir: Path, cache: str):
        monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / cache))  # per store: the cache is keyed by run id
        worker = TrainWorker.__ray_actor_class__(threads=1)
        how = worker.load(RunSpec(cfg.to_json(), cfg.hash(), run_id, str(store_dir), "", ""), keys[2], tcfg, acfg)
        return worker, how

    exact, _ = loaded(tmp / "runs" / "store", "a")
    capsys.readouterr()
    kept, how = loaded(copy, "b")
    assert how.endswith("difference 0.001: published weights kept"), how
    assert "max abs difference 0.001" in capsys.readouterr().out
    assert_bitwise_equal(dict(kept.engine.model.state_dict())[name], weights[name], name)
    assert_bitwise_equal(kept.trainer_state(), exact.trainer_state(), STATE)


@pytest.mark.slow
def test_fused_run_publishes_trainer_state_at_its_task_ends(tmp_path):
    """loop.fuse: 3 over 4 iterations with optimizer_every: 100: the tasks run iterations 1-3 and 4,
    so v0003 (a task's last) and v0004 (the run's last) hold trainer_state.pt, v0001 and v0002 not."""
    config = _config(tmp_path, checkpoint={"optimizer_every": 100}, loop={"iterations": 4, "eval_every": 4, "fuse": 3},
                     run={"keep_trainer_states": 2})
    proc = _pyflyte_run(tmp_path, "--config", str(config))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    _, _, manifests = _versions(tmp_path)
    assert [m.metadata["iteration"] for m in manifests] == [1, 2, 3, 4]
    assert [m.metadata["iteration"] for m in manifests if STATE in m.files] == [3, 4]

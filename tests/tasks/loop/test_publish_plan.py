"""`checkpoint.publish_every` (tasks/loop/publish_plan.py): which versions are published, the config
refusals, the lineage of skipped versions, and (nightly) a fused live-sync run through `pyflyte run`
SIGKILLed between publishes, before any publish, and in the middle of a publish (files uploaded,
manifest not written) that resumes to the same final weights, bit for bit, as a run never killed (one
torch thread; the three share one unkilled run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.compare import assert_bitwise_equal
from tests.support.processes import run_until_marker_then_kill
from tests.support.store_pause import store_pause_hook
from tests.support.workflow import PYFLYTE, REPO, _config, _env, _pyflyte_run

STATE = "trainer_state.pt"
REWARD = "tests.support.rewards:pausing_starts_with_digit"  # the e2e reward, pausing once when told to
# fused (one task, one Ray cluster), live sync, every 2nd version published, pi_old from the update's own forward
LEAN = dict(loop={"iterations": 4, "eval_every": 4, "fuse": 4}, sync={"method": "live"}, checkpoint={"publish_every": 2},
            training={"mini_batch_size": 16}, reward={"functions": {"arithmetic": REWARD, "reverse": REWARD}, "timeout_s": 120})


def test_which_iterations_are_published():
    from tasks.loop.publish_plan import publish_due

    # every 3, 8 iterations, evaluation every 4, actor kept: multiples of 3, before each evaluation, the last
    assert [i for i in range(1, 9) if publish_due(i, 3, 8, 4, actor_kept=True)] == [3, 4, 6, 8]
    # the actor does not live on (the last iteration of a fused task, a Ray cluster per task): always
    assert all(publish_due(i, 3, 8, 4, actor_kept=False) for i in range(1, 9))
    assert all(publish_due(i, 1, 8, 100, actor_kept=True) for i in range(1, 9))  # 1: every version, as before


def test_publish_every_is_refused_where_a_skipped_version_would_be_read_from_the_store():
    from configs.schema import FlyrollConfig, parse_config

    ok = {"sync": {"method": "live"}, "loop": {"fuse": 2}, "training": {"mini_batch_size": 16},
          "rollout": {"prompts_per_iteration": 4, "samples_per_prompt": 4}, "checkpoint": {"publish_every": 3}}
    cfg = parse_config(ok)
    assert cfg.checkpoint.publish_every == 3
    assert cfg.hash() == parse_config({**ok, "checkpoint": {}}).hash()  # results do not change: not hashed
    assert FlyrollConfig().checkpoint.publish_every == 1
    for change, named in (({"sync": {"method": "store"}}, "sync.method='store'"),
                          ({"checkpoint": {"publish_every": 3, "optimizer_every": 2}}, "checkpoint.optimizer_every=2"),
                          ({"training": {"mini_batch_size": 8}}, "training.mini_batch_size=8"),
                          ({"loop": {"fuse": 1}}, "loop.fuse=1"),
                          ({"algorithm": {"old_logprobs": "recompute"}}, "old_logprobs='recompute'"),
                          ({"algorithm": {"advantage": "gae"}}, "algorithm.advantage=gae")):
        with pytest.raises(ValueError, match="checkpoint.publish_every=3") as e:
            parse_config({**ok, **change})
        assert named in str(e.value), str(e.value)
    parse_config({**ok, "training": {"mini_batch_size": 8}, "algorithm": {"old_logprobs": "behaviour"}})
    with pytest.raises(ValueError, match="publish_every"):
        parse_config({"checkpoint": {"publish_every": 0}})


def test_a_published_version_names_the_skipped_ones_and_pruning_walks_past_them(tmp_path):
    """v0001 published, v0002 and v0003 skipped (their rollout tables published, each sampled by the
    version before), v0004 published: v0004's nearest published ancestor is v0001 and the skipped
    versions are 2 and 3 with their tables; pruning at v0004 (keep 1) reaches v0001 past them."""
    from infra.store import ArtifactStore
    from tasks.loop.publish_plan import unpublished_since
    from tasks.run.types import RunSpec
    from tasks.stages.weight_sync import prune_trainer_states

    store = ArtifactStore(str(tmp_path / "store"))
    spec = RunSpec(config_json="{}", config_hash="h", run_id="r1", store_uri=str(tmp_path / "store"),
                   tracking_uri="", mlflow_run_id="")
    full = tmp_path / "full"
    full.mkdir()
    for rel in ("model.safetensors", STATE):
        (full / rel).write_bytes(rel.encode())
    table = tmp_path / "rollout.parquet"
    table.write_bytes(b"t")
    pol = [f"runs/r1/policy/v{i:04d}" for i in range(5)]
    pol[0] = "models/base"
    for it in (1, 2, 3, 4):
        store.publish_file(str(table), f"runs/r1/rollouts/i{it:04d}", kind="rollout", producer="test", parents=[pol[it - 1]])
    store.publish(str(full), pol[1], kind="checkpoint", producer="test", parents=[pol[0]], metadata={"iteration": 1})
    assert unpublished_since(store, spec, pol[1]) == (pol[1], [])
    assert unpublished_since(store, spec, pol[3]) == (pol[1], [
        {"iteration": 2, "key": pol[2], "rollout_table": "runs/r1/rollouts/i0002"},
        {"iteration": 3, "key": pol[3], "rollout_table": "runs/r1/rollouts/i0003"}])
    assert unpublished_since(store, spec, "models/base") == ("models/base", [])
    store.publish(str(full), pol[4], kind="checkpoint", producer="test", parents=[pol[1]], metadata={"iteration": 4})
    assert prune_trainer_states(store, spec, 4, keep=1) == pol[1]
    assert STATE not in store.manifest(pol[1]).files and STATE in store.manifest(pol[4]).files


def test_background_publish_keeps_one_in_flight_and_names_a_failed_version():
    import threading

    from tasks.loop.publish_plan import BackgroundPublish, BackgroundPublishError
    from tasks.run.types import PolicyRef

    release, running = threading.Event(), []

    def publish(version: int, fail: bool = False) -> PolicyRef:
        running.append(version)
        release.wait(10)
        if fail:
            raise OSError("store unreachable")
        return PolicyRef(key=f"runs/r/policy/v{version:04d}", version=version, model_version=str(version))

    behind = BackgroundPublish()
    behind.submit(2, publish, version=2)
    threading.Timer(0.2, release.set).start()
    behind.submit(4, publish, version=4, fail=True)  # joins v2 first: never two in flight
    assert behind.done[2].model_version == "2"
    with pytest.raises(BackgroundPublishError, match=r"background publish of policy v4 failed: OSError: store unreachable"):
        behind.published(PolicyRef(key="runs/r/policy/v0004", version=4))
    assert running == [2, 4]  # one after the other
    assert behind.published(PolicyRef(key="runs/r/policy/v0002", version=2)).model_version == "2"  # nothing in flight
    behind.close()


def _policies(tmp: Path):
    from infra.store import ArtifactStore

    store = ArtifactStore(str(tmp / "runs" / "store"))
    return store, [k for k in store.list("runs") if "/policy/" in k]


def _final(store, key: str, tmp: Path) -> dict:
    from safetensors.torch import load_file

    d = store.fetch(key, str(tmp / "final"))
    return {"weights": load_file(f"{d}/model.safetensors"), "state": torch.load(f"{d}/{STATE}", weights_only=True)}


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory):
    """The lean config run once through pyflyte, never killed: the final weights to match."""
    tmp = tmp_path_factory.mktemp("unkilled")
    proc = _pyflyte_run(tmp, "--config", str(_config(tmp, **LEAN)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    store, keys = _policies(tmp)
    return store, keys, _final(store, keys[-1], tmp)


def _kill(tmp: Path, pause: dict[str, str]) -> list[str]:
    """Run the lean config until it pauses where the env vars `pause` say (and creates
    $FLYROLL_TEST_PAUSED), SIGKILL the tree; returns the published versions at the kill."""
    config = _config(tmp, **LEAN)
    cmd = [PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(config)]
    paused = tmp / "paused"
    run_until_marker_then_kill(cmd, tmp, {**_env(tmp), "FLYROLL_TEST_PAUSED": str(paused), **pause}, paused, tmp / "first.log")
    return _policies(tmp)[1]


def _resume(tmp: Path, unkilled) -> tuple[list[str], str]:
    """Rerun the lean config (no pause); it ends with the unkilled run's final weights and trainer state
    bit for bit and the same published versions. Returns (versions at the end, rerun output)."""
    import subprocess

    cmd = [PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(tmp / "config.yaml")]
    rerun = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-6000:]
    store, keys = _policies(tmp)
    assert_bitwise_equal(_final(store, keys[-1], tmp), unkilled[2], "final v0004")
    assert [k.rsplit("/", 1)[-1] for k in keys] == [k.rsplit("/", 1)[-1] for k in unkilled[1]]
    return keys, out


def _kill_and_resume(tmp: Path, pause_after: str, unkilled) -> tuple[list[str], list[str], str]:
    """Kill where the reward pauses (its first call once `pause_after`, a glob under the store, exists),
    then rerun (`_resume`). Returns (versions at the kill, versions at the end, rerun output)."""
    at_kill = _kill(tmp, {"FLYROLL_TEST_PAUSE_AFTER": f"{tmp}/runs/store/{pause_after}"})
    return at_kill, *_resume(tmp, unkilled)


@pytest.mark.nightly
def test_killed_after_an_unpublished_iteration_resumes_to_the_same_weights(unkilled, tmp_path):
    """Killed in iteration 4's scoring: iteration 3 trained and was not published (v0002 is the newest
    in the store). The rerun resumes from v0002, runs iterations 3 and 4 again and ends with the
    unkilled run's v0004 bit for bit (weights, optimizer and objective state)."""
    at_kill, keys, out = _kill_and_resume(tmp_path, "runs/*/rollouts/i0003/MANIFEST.json", unkilled)
    assert [k.rsplit("/", 1)[-1] for k in at_kill] == ["v0002"]
    assert "resume from runs/" in out and "/policy/v0002" in out
    store, _ = _policies(tmp_path)
    assert [k.rsplit("/", 1)[-1] for k in keys] == ["v0002", "v0004"]  # every 2nd (4: also the last and evaluated)
    v2, v4 = (store.manifest(k) for k in keys)
    assert v4.parents == [keys[0]] and STATE in v4.files
    assert STATE in v2.metadata["pruned"]  # run.keep_trainer_states: 1 (the e2e config): v0004's publish pruned it
    assert [s["iteration"] for s in v4.metadata["unpublished_iterations"]] == [3]
    assert v4.metadata["unpublished_iterations"][0]["rollout_table"].endswith("/rollouts/i0003")
    assert [s["iteration"] for s in v2.metadata["unpublished_iterations"]] == [1]
    assert not v2.parents[0].startswith("runs/")  # the base policy
    assert [k.rsplit("/", 1)[-1] for k in store.list("runs") if "/rollouts/" in k] == ["i0001", "i0002", "i0003", "i0004"]


@pytest.mark.nightly
def test_killed_before_any_publish_restarts_to_the_same_weights(unkilled, tmp_path):
    """Killed in iteration 2's scoring: iteration 1 trained, nothing published yet. The rerun starts
    from the base policy and ends with the unkilled run's v0004 bit for bit."""
    at_kill, keys, out = _kill_and_resume(tmp_path, "runs/*/rollouts/i0001/MANIFEST.json", unkilled)
    assert at_kill == []
    assert [k.rsplit("/", 1)[-1] for k in keys] == ["v0002", "v0004"]


@pytest.mark.nightly
def test_killed_in_the_middle_of_a_publish_resumes_to_the_same_weights(unkilled, tmp_path):
    """Killed in v0002's publish (the fused task's background publish) with its files uploaded and its
    manifest not yet written: the store pause hook (tests/support/store_pause.py) holds the publish
    there. The partial v0002 is never a version: the store does not list it, has no manifest to read,
    and the rerun starts from the base policy, not from it. The rerun publishes v0002 over the partial
    upload (taking over the dead writer's lease) and ends with the unkilled run's v0004 bit for bit."""
    from infra.store import ArtifactNotFound

    hook = store_pause_hook(tmp_path / "hook")
    at_kill = _kill(tmp_path, {"PYTHONPATH": f"{hook}:{REPO}", "FLYROLL_TEST_PAUSE_MANIFEST": "/policy/v0002"})
    assert at_kill == []                                             # nothing listed: v0002 has no manifest
    (partial,) = (tmp_path / "runs" / "store" / "runs").glob("*/policy/v0002")
    uploaded = sorted(p.name for p in partial.iterdir() if p.is_file())
    assert "model.safetensors" in uploaded and STATE in uploaded and "MANIFEST.json" not in uploaded, uploaded
    store, _ = _policies(tmp_path)
    key = str(partial.relative_to(tmp_path / "runs" / "store"))
    with pytest.raises(ArtifactNotFound):
        store.manifest(key)
    keys, out = _resume(tmp_path, unkilled)
    assert "resume from" not in out and f"from {key}" not in out     # started from the base policy
    assert [k.rsplit("/", 1)[-1] for k in keys] == ["v0002", "v0004"]
    v2 = store.manifest(keys[0])
    assert STATE in v2.files or STATE in v2.metadata.get("pruned", [])
    assert store.verify(keys[0]).key == keys[0]                       # the republished v0002: every file's hash checks

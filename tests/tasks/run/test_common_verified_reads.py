"""Integrity on every read (issue 40): whatever loads weights or tables checks them against the
version's manifest first -- the local fetch cache, `flyroll eval` given a store folder, resume and
the rerun of a finished run -- and a corrupt version is named with the earlier version to go back to.
Each test failed on the code before the checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.store import ArtifactStore, CorruptArtifact
from infra.manifest import sha256_file
from tasks.run.types import PolicyRef, RunSpec


def _flip_byte(path, offset: int = 100) -> None:
    """Corrupt one byte in place, as a bad disk or a stray write would (size unchanged)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _spec(root: str, run_id: str = "r1") -> RunSpec:
    return RunSpec(config_json="{}", config_hash="h", run_id=run_id, store_uri=root, tracking_uri="", mlflow_run_id="")


def _publish_checkpoint(store: ArtifactStore, tmp_path: Path, key: str, seed: int, parents=()) -> dict[str, bytes]:
    files = {"model.safetensors": bytes([seed]) * 4096, "config.json": b'{"h": 8}', "trainer_state.pt": b"o" * 512}
    src = tmp_path / f"src-{seed}"
    src.mkdir()
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    store.publish(str(src), key, kind="checkpoint", producer="test", parents=list(parents))
    return files


def test_corrupt_fetch_cache_is_detected_and_fetched_again(tmp_path, monkeypatch):
    """A byte flipped in a cached model.safetensors: the next fetch_cached sees it (its stat stamp
    changed, so it is re-hashed), drops the copy and serves the store's verified bytes -- before, the
    corrupt cached weights were served (and trained on). Also when a fuller fetch of the version only
    adds files (the lighter copy's weights are checked too)."""
    from tasks.run.common import TRAINING_ONLY, fetch_cached

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    store, spec = ArtifactStore(str(tmp_path / "store")), _spec(str(tmp_path / "store"))
    files = _publish_checkpoint(store, tmp_path, "runs/r1/policy/v0001", seed=1)
    cached = fetch_cached(spec, "runs/r1/policy/v0001")
    _flip_byte(os.path.join(cached, "model.safetensors"))
    again = fetch_cached(spec, "runs/r1/policy/v0001")
    assert Path(again, "model.safetensors").read_bytes() == files["model.safetensors"]

    light = fetch_cached(spec, "runs/r1/policy/v0001", skip=TRAINING_ONLY)  # the cached full copy serves it
    _flip_byte(os.path.join(light, "model.safetensors"), offset=7)
    full = fetch_cached(spec, "runs/r1/policy/v0001", skip=TRAINING_ONLY)
    assert Path(full, "model.safetensors").read_bytes() == files["model.safetensors"]


def test_fetch_cache_partial_copy_is_checked_before_a_fuller_fetch(tmp_path, monkeypatch):
    """Generation actors cache the weights only; a corrupted weight file there is not kept when the
    trainer later asks for the whole version (which fetches only what the copy left out)."""
    from tasks.run.common import TRAINING_ONLY, fetch_cached

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    store, spec = ArtifactStore(str(tmp_path / "store")), _spec(str(tmp_path / "store"))
    files = _publish_checkpoint(store, tmp_path, "runs/r1/policy/v0001", seed=1)
    light = fetch_cached(spec, "runs/r1/policy/v0001", skip=TRAINING_ONLY)
    _flip_byte(os.path.join(light, "model.safetensors"))
    full = fetch_cached(spec, "runs/r1/policy/v0001")
    for rel, data in files.items():
        assert Path(full, rel).read_bytes() == data


def test_unchanged_cached_copy_is_not_rehashed(tmp_path, monkeypatch):
    """The stamp makes a cache hit cheap: an untouched copy is trusted by its (size, inode, mtime,
    ctime) and never read again; a rewrite with the same bytes (new ctime) is re-hashed and kept."""
    import infra.store as store_mod
    from tasks.run.common import fetch_cached

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    store, spec = ArtifactStore(str(tmp_path / "store")), _spec(str(tmp_path / "store"))
    files = _publish_checkpoint(store, tmp_path, "runs/r1/policy/v0001", seed=1)
    cached = fetch_cached(spec, "runs/r1/policy/v0001")
    hashed = []
    monkeypatch.setattr(store_mod, "sha256_file", lambda p, *a: hashed.append(os.path.basename(p)) or sha256_file(p, *a))
    fetch_cached(spec, "runs/r1/policy/v0001")
    assert hashed == []
    Path(cached, "config.json").write_bytes(files["config.json"])  # same bytes, new ctime: re-hashed, still fine
    assert Path(fetch_cached(spec, "runs/r1/policy/v0001"), "config.json").read_bytes() == files["config.json"]
    assert hashed == ["config.json"]


def test_eval_of_a_corrupt_store_folder_is_refused(tiny_model_dir, tmp_path, capsys):
    """`flyroll eval --model <local store>/runs/r1/policy/v0002` with a flipped byte in its weights:
    exit 2 and an error naming the file and the earlier version that verifies (before: evaluated the
    corrupt weights, exit 0). The intact version still evaluates."""
    from infra.eval_cli import main

    store = ArtifactStore(str(tmp_path / "store"))
    for v in (1, 2):
        store.publish(tiny_model_dir, f"runs/r1/policy/v{v:04d}", kind="checkpoint", producer="test")
    folder = tmp_path / "store" / "runs/r1/policy/v0002"
    _flip_byte(folder / "model.safetensors", offset=4096)
    rc = main(["--model", str(folder), "--data", "synthetic:eval", "--limit", "2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "model.safetensors" in err and "does not match its manifest" in err and "runs/r1/policy/v0001" in err
    # the same version by URI and by --store/key: the store's verified fetch refuses it too
    assert main(["--store", str(tmp_path / "store"), "--model", "runs/r1/policy/v0002", "--data", "synthetic:eval",
                 "--limit", "2"]) == 2
    capsys.readouterr()
    assert main(["--model", str(tmp_path / "store" / "runs/r1/policy/v0001"), "--data", "synthetic:eval",
                 "--limit", "2", "--max-new-tokens", "2"]) == 0


def test_resume_from_a_corrupt_version_is_refused_with_a_recovery_hint(tmp_path):
    """The version a run resumes from -- for a finished run, its final policy -- is re-hashed before the
    run starts (`prepare_run` calls verify_resume_policy before it touches the MLflow run,
    tests/tasks/stages/test_prepare_refused_rerun.py): a flipped byte in v0003 raises CorruptArtifact
    naming the file and v0002 (the newest version that verifies) instead of handing v0003 to the loop as
    the parent of v0004 (before: resumed from it). With v0003's manifest removed, as the hint says, it
    resumes from v0002."""
    from tasks.stages.prepare import resume_point, verify_resume_policy

    root = str(tmp_path / "store")
    store, spec = ArtifactStore(root), _spec(root)
    _publish_checkpoint(store, tmp_path, "models/tiny-x/v0000", seed=0)
    for v in (1, 2, 3):
        _publish_checkpoint(store, tmp_path, f"runs/r1/policy/v{v:04d}", seed=v, parents=[f"runs/r1/policy/v{v - 1:04d}"])
    base = PolicyRef(key="models/tiny-x/v0000", version=0)
    verify_resume_policy(store, "r1")
    assert resume_point.task_function(spec, base, "{}").key == "runs/r1/policy/v0003"  # intact: resumes
    _flip_byte(tmp_path / "store" / "runs/r1/policy/v0003" / "model.safetensors")
    _flip_byte(tmp_path / "store" / "runs/r1/policy/v0001" / "trainer_state.pt")  # an older corrupt one is skipped by the hint
    with pytest.raises(CorruptArtifact) as e:
        verify_resume_policy(store, "r1")
    msg = str(e.value)
    assert "runs/r1/policy/v0003" in msg and "model.safetensors" in msg
    assert "newest earlier version whose hashes verify is runs/r1/policy/v0002" in msg
    os.remove(tmp_path / "store" / "runs/r1/policy/v0003" / "MANIFEST.json")
    verify_resume_policy(store, "r1")
    assert resume_point.task_function(spec, base, "{}").key == "runs/r1/policy/v0002"

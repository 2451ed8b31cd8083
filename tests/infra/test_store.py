"""The artifact store: round-trip, hash check, atomic visibility, listing, retries.

Every behaviour runs on a local folder and on a real S3 server (SeaweedFS on loopback).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from infra.manifest import MANIFEST_NAME, Manifest, sha256_file
from infra.store import ArtifactExists, ArtifactNotFound, ArtifactStore, CorruptArtifact, StoreUnavailable
from tests.support.services import s3_server  # noqa: F401  (session fixture)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store"))
    s3 = request.getfixturevalue("s3_server")
    return ArtifactStore(f"s3://{s3.bucket}/t-{request.node.name.replace('[', '-').rstrip(']')}-{time.time_ns()}",
                         storage_options=s3.storage_options)


def make_checkpoint(d, seed: int = 0):
    (d / "tokenizer").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 40 + bytes([seed]))
    (d / "config.json").write_text(json.dumps({"hidden": 64, "seed": seed}))
    (d / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    return d


def write_raw(store: ArtifactStore, key: str, rel: str, data: bytes) -> None:
    """Write bytes into a version behind the store's back (to corrupt it or fake a crash)."""
    store.fs.pipe_file(f"{store._root_path}/{key}/{rel}", data)


def test_round_trip(store, tmp_path):
    src = make_checkpoint(tmp_path / "ckpt")
    m = store.publish(str(src), "runs/r1/policy/v0001", kind="checkpoint", producer="training",
                      parents=["runs/r1/policy/v0000"], execution_id="exec-1",
                      metadata={"iteration": 1, "config_hash": "abc"})
    assert sorted(m.files) == ["config.json", "model.safetensors", "tokenizer/vocab.json"]
    assert m.files["model.safetensors"].sha256 == sha256_file(str(src / "model.safetensors"))
    assert m.files["config.json"].size == os.path.getsize(src / "config.json")

    assert store.exists("runs/r1/policy/v0001")
    assert store.manifest("runs/r1/policy/v0001") == m
    out = store.fetch("runs/r1/policy/v0001", str(tmp_path / "out"))
    for rel in m.files:
        assert (tmp_path / "out" / rel).read_bytes() == (src / rel).read_bytes()
    assert store.uri("runs/r1/policy/v0001").endswith("/runs/r1/policy/v0001")
    assert out == str(tmp_path / "out")


def test_publish_file_round_trip(store, tmp_path):
    table = tmp_path / "rollout.parquet"
    table.write_bytes(b"PAR1" + os.urandom(1000) + b"PAR1")
    m = store.publish_file(str(table), "runs/r1/rollout/it0003", kind="rollout", producer="rollout")
    assert list(m.files) == ["rollout.parquet"]
    store.fetch("runs/r1/rollout/it0003", str(tmp_path / "got"))
    assert (tmp_path / "got" / "rollout.parquet").read_bytes() == table.read_bytes()


def test_corrupted_file_is_detected_on_fetch(store, tmp_path):
    src = make_checkpoint(tmp_path / "ckpt")
    store.publish(str(src), "runs/r1/policy/v0002", kind="checkpoint", producer="training")
    write_raw(store, "runs/r1/policy/v0002", "model.safetensors", b"flipped bits")
    with pytest.raises(CorruptArtifact, match="model.safetensors"):
        store.fetch("runs/r1/policy/v0002", str(tmp_path / "out"))
    # same size, different bytes: only the hash can tell
    data = bytearray((src / "config.json").read_bytes())
    data[0] ^= 1
    write_raw(store, "runs/r1/policy/v0002", "model.safetensors", (src / "model.safetensors").read_bytes())
    write_raw(store, "runs/r1/policy/v0002", "config.json", bytes(data))
    with pytest.raises(CorruptArtifact, match="config.json"):
        store.fetch("runs/r1/policy/v0002", str(tmp_path / "out2"))
    store.fetch("runs/r1/policy/v0002", str(tmp_path / "out3"), verify=False)  # opt-out still downloads


def test_version_without_manifest_is_invisible(store, tmp_path):
    # what an interrupted publish leaves: data files, no manifest
    write_raw(store, "runs/r1/policy/v0009", "model.safetensors", b"half a checkpoint")
    assert not store.exists("runs/r1/policy/v0009")
    assert store.list("runs/r1") == []
    with pytest.raises(ArtifactNotFound, match="v0009"):
        store.manifest("runs/r1/policy/v0009")
    with pytest.raises(ArtifactNotFound):
        store.fetch("runs/r1/policy/v0009", str(tmp_path / "out"))
    # a garbled manifest is not a version either
    write_raw(store, "runs/r1/policy/v0009", MANIFEST_NAME, b"{not json")
    assert not store.exists("runs/r1/policy/v0009")
    with pytest.raises(CorruptArtifact, match="unreadable"):
        store.manifest("runs/r1/policy/v0009")
    # publishing over the debris makes a clean version
    store.publish(str(make_checkpoint(tmp_path / "ckpt")), "runs/r1/policy/v0009", kind="checkpoint", producer="t")
    store.fetch("runs/r1/policy/v0009", str(tmp_path / "out4"))


def test_list_is_sorted_and_only_has_published_versions(store, tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"x")
    for v in ["v0010", "v0002", "v0001"]:
        store.publish_file(str(f), f"runs/r1/policy/{v}", kind="checkpoint", producer="t")
    store.publish_file(str(f), "runs/r1/rollout/it0001", kind="rollout", producer="t")
    store.publish_file(str(f), "runs/r2/policy/v0001", kind="checkpoint", producer="t")
    write_raw(store, "runs/r1/policy/v0011", "x.bin", b"x")  # unpublished
    assert store.list("runs/r1/policy") == ["runs/r1/policy/v0001", "runs/r1/policy/v0002", "runs/r1/policy/v0010"]
    assert store.list("runs/r1/") == ["runs/r1/policy/v0001", "runs/r1/policy/v0002", "runs/r1/policy/v0010",
                                      "runs/r1/rollout/it0001"]
    assert len(store.list("")) == 5
    assert store.list("runs/nope") == []


def test_versions_are_immutable(store, tmp_path):
    src = make_checkpoint(tmp_path / "a")
    m1 = store.publish(str(src), "runs/r1/policy/v0001", kind="checkpoint", producer="training")
    # a retried task that produced the same bytes gets the existing version back
    assert store.publish(str(src), "runs/r1/policy/v0001", kind="checkpoint", producer="training") == m1
    other = make_checkpoint(tmp_path / "b", seed=1)
    with pytest.raises(ArtifactExists, match="v0001"):
        store.publish(str(other), "runs/r1/policy/v0001", kind="checkpoint", producer="training")
    assert store.manifest("runs/r1/policy/v0001") == m1


def test_manifest_json_round_trip_and_validation():
    from infra.manifest import FileEntry

    m = Manifest(key="k/v1", kind="dataset", files={"a.parquet": FileEntry("0" * 64, 3)}, parents=["k/v0"],
                 producer="prep", execution_id=None, created_at="2026-01-01T00:00:00+00:00", metadata={"n": 1})
    assert Manifest.from_json(m.to_json()) == m
    assert json.loads(m.to_json())["format"] == "flyroll-manifest/1"
    bad = json.loads(m.to_json())
    bad["files"]["a.parquet"]["size"] = "3"
    with pytest.raises(ValueError, match="a.parquet"):
        Manifest.from_json(json.dumps(bad))


def test_bad_input_is_rejected_before_writing(tmp_path):
    store = ArtifactStore(str(tmp_path / "s"))
    for key in ["", "/abs", "a/../b", "a//b", f"a/{MANIFEST_NAME}"]:
        with pytest.raises(ValueError, match="artifact key"):
            store.uri(key)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files"):
        store.publish(str(tmp_path / "empty"), "a/v1", kind="dataset", producer="t")
    f = tmp_path / "f"
    f.write_bytes(b"1")
    with pytest.raises(TypeError, match="metadata"):
        store.publish_file(str(f), "a/v1", kind="dataset", producer="t", metadata={"x": object()})
    assert not os.path.exists(tmp_path / "s" / "a")


def test_local_root_as_file_uri(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("hi")
    store = ArtifactStore(f"file://{tmp_path}/s")
    store.publish_file(str(f), "a/v1", kind="dataset", producer="t")
    assert store.uri("a/v1") == f"file://{tmp_path}/s/a/v1"
    assert ArtifactStore(str(tmp_path / "s")).list("a") == ["a/v1"]
    assert not [p for p in os.listdir(tmp_path / "s" / "a" / "v1") if ".tmp-" in p]  # temp manifest renamed


def test_unreachable_s3_retries_then_raises_naming_the_uri(tmp_path):
    from infra.services import free_port

    store = ArtifactStore("s3://bucket/prefix", retries=2, backoff_s=0.01,
                          storage_options={"endpoint_url": f"http://127.0.0.1:{free_port()}",
                                           "key": "k", "secret": "TOPSECRET"})
    assert "TOPSECRET" not in repr(store)
    with pytest.raises(StoreUnavailable, match=r"s3://bucket/prefix/a/v1.*3 attempts") as e:
        store.manifest("a/v1")
    assert "TOPSECRET" not in str(e.value)
    f = tmp_path / "f"
    f.write_bytes(b"1")
    with pytest.raises(StoreUnavailable, match="s3://bucket/prefix"):
        store.publish_file(str(f), "a/v1", kind="dataset", producer="t")


def test_s3_credentials_from_env(s3_server, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    store = ArtifactStore(f"s3://{s3_server.bucket}/env-{time.time_ns()}")
    f = tmp_path / "f"
    f.write_bytes(b"1")
    m = store.publish_file(str(f), "a/v1", kind="dataset", producer="t")
    assert s3_server.secret_key not in m.to_json()
    assert store.list("a") == ["a/v1"]


def test_transient_errors_are_retried_with_backoff(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path / "s"), retries=3, backoff_s=0.5)
    sleeps, calls = [], []
    monkeypatch.setattr("infra.store.time.sleep", sleeps.append)

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("peer reset")
        return "ok"

    assert store._retry("op on x", flaky) == "ok"
    assert sleeps == [0.5, 1.0]  # backoff_s * 2**attempt
    with pytest.raises(FileNotFoundError):  # not transient: raised at once, no sleep
        store._retry("op on x", lambda: (_ for _ in ()).throw(FileNotFoundError("x")))
    assert sleeps == [0.5, 1.0]


def _run_store(tmp_path):
    """(an ArtifactStore at tmp_path/store, the RunSpec of run r1 on it: no config, no tracking)."""
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec

    root = str(tmp_path / "store")
    return ArtifactStore(root), RunSpec(config_json="{}", config_hash="h", run_id="r1", store_uri=root,
                                        tracking_uri="", mlflow_run_id="")


def _checkpoint_dir(tmp_path, files: dict[str, bytes]):
    """tmp_path/src holding `files` (relative path -> bytes), to publish as a checkpoint."""
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return src


def test_fetch_cache_keeps_the_two_newest_versions_of_a_run_series(tmp_path, monkeypatch):
    """tasks/run/common.py fetch_cached: fetching policy v3 deletes the cached v1 (not v2, not the base
    model under models/, not another series); a deleted version is fetched again on demand."""
    from tasks.run.common import fetch_cached

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    store, spec = _run_store(tmp_path)
    src = _checkpoint_dir(tmp_path, {"w.bin": b"x" * 100})
    keys = ["models/base/v0000", "runs/r1/critic/v0001"] + [f"runs/r1/policy/v{i:04d}" for i in (1, 2, 3)]
    for key in keys:
        store.publish(str(src), key, kind="checkpoint", producer="test")
    for key in keys:
        assert open(os.path.join(fetch_cached(spec, key), "w.bin"), "rb").read() == b"x" * 100
    cached = lambda series: sorted(p.name for p in (tmp_path / "cache" / "r1" / series).iterdir())
    assert cached("runs/r1/policy") == ["v0002", "v0003"]
    assert cached("runs/r1/critic") == ["v0001"] and cached("models/base") == ["v0000"]
    again = fetch_cached(spec, "runs/r1/policy/v0001")  # an old version: fetched again (v0003 stays: newer)
    assert open(os.path.join(again, "w.bin"), "rb").read() == b"x" * 100
    assert cached("runs/r1/policy") == ["v0001", "v0002", "v0003"]


def test_eviction_skips_a_version_another_process_is_fetching(tmp_path, monkeypatch):
    """evict_older_versions leaves a cached version whose fetch lock another process holds (it may be
    writing or reading its files) and deletes it once the lock is free."""
    import subprocess
    import sys

    from tasks.run.common import _lock_path, evict_older_versions, fetch_cached

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    store, spec = _run_store(tmp_path)
    src = _checkpoint_dir(tmp_path, {"w.bin": b"x" * 100})
    for i in (1, 2, 3):
        store.publish(str(src), f"runs/r1/policy/v{i:04d}", kind="checkpoint", producer="test")
    v1 = fetch_cached(spec, "runs/r1/policy/v0001")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                               "lock = FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(60)",
                               _lock_path(spec, "runs/r1/policy/v0001")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        fetch_cached(spec, "runs/r1/policy/v0003")   # would evict v0001: its lock is held elsewhere
        assert os.path.exists(os.path.join(v1, "w.bin"))
    finally:
        holder.kill()
        holder.wait()
    assert evict_older_versions(spec, "runs/r1/policy/v0003") == [v1] and not os.path.exists(v1)


def test_weights_only_fetch_leaves_the_training_state_behind(tmp_path, monkeypatch):
    """Generation and log-prob actors fetch a checkpoint without trainer_state.pt and critic/
    (SmolLM2's optimizer state is 1.1 of its 1.6 GB), the critic's values without trainer_state.pt;
    a fuller fetch of the same cached version adds only the missing files; eviction drops every
    kind of cached version."""
    from tasks.run.common import TRAINER_STATE, TRAINING_ONLY, fetch_cached

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    store, spec = _run_store(tmp_path)
    src = _checkpoint_dir(tmp_path, {"model.safetensors": b"w" * 64, "config.json": b"{}", "trainer_state.pt": b"o" * 128,
                                     "critic/model.safetensors": b"c" * 32})
    for v in (1, 2, 3):
        store.publish(str(src), f"runs/r1/policy/v{v:04d}", kind="checkpoint", producer="test")
    files = lambda d: sorted(str(p.relative_to(d)) for p in Path(d).rglob("*") if p.is_file() and not p.name.startswith("."))

    light = fetch_cached(spec, "runs/r1/policy/v0001", skip=TRAINING_ONLY)
    assert files(light) == ["config.json", "model.safetensors"]
    weights = os.stat(Path(light) / "model.safetensors")
    assert fetch_cached(spec, "runs/r1/policy/v0001", skip=TRAINING_ONLY) == light  # cached: nothing fetched again
    models = fetch_cached(spec, "runs/r1/policy/v0001", skip=(TRAINER_STATE,))  # the critic's values: no optimizer state
    assert models == light and files(models) == ["config.json", "critic/model.safetensors", "model.safetensors"]
    full = fetch_cached(spec, "runs/r1/policy/v0001")
    assert full == light and files(full) == ["config.json", "critic/model.safetensors", "model.safetensors", "trainer_state.pt"]
    assert (Path(full) / "trainer_state.pt").read_bytes() == b"o" * 128
    again = os.stat(Path(full) / "model.safetensors")  # the fuller fetches added files, never fetched the weights again
    assert (again.st_ino, again.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)
    assert fetch_cached(spec, "runs/r1/policy/v0001", skip=TRAINING_ONLY) == full  # a fuller copy serves a lighter fetch
    assert files(fetch_cached(spec, "runs/r1/policy/v0002", skip=TRAINING_ONLY)) == ["config.json", "model.safetensors"]
    fetch_cached(spec, "runs/r1/policy/v0003", skip=TRAINING_ONLY)  # evicts v0001 (full) and keeps v0002 (weights only)
    assert sorted(p.name for p in (tmp_path / "cache" / "r1" / "runs/r1/policy").iterdir()) == ["v0002", "v0003"]
    with pytest.raises(ValueError, match="skip must be one of"):
        fetch_cached(spec, "runs/r1/policy/v0003", skip=("config.json",))


def test_prune_drops_files_from_a_version_manifest_first(store, tmp_path):
    """store.prune (local and S3): the manifest no longer lists the file (and records why), the file
    is gone, the version still fetches and verifies, pruning again is a no-op; the other files are
    untouched."""
    from infra.store import ArtifactExists

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w" * 64)
    (src / "trainer_state.pt").write_bytes(b"o" * 128)
    before = store.publish(str(src), "runs/r/policy/v0001", kind="checkpoint", producer="test", metadata={"iteration": 1})
    m = store.prune("runs/r/policy/v0001", ["trainer_state.pt"], reason="run.keep_trainer_states=2")
    assert set(m.files) == {"model.safetensors"} and m.files["model.safetensors"] == before.files["model.safetensors"]
    assert m.metadata == {"iteration": 1, "pruned": {"trainer_state.pt": "run.keep_trainer_states=2"}}
    assert store.manifest("runs/r/policy/v0001") == m
    assert not store.fs.exists(f"{store._root_path}/runs/r/policy/v0001/trainer_state.pt")
    got = store.fetch("runs/r/policy/v0001", str(tmp_path / "got"))  # verified against the new manifest
    assert sorted(os.listdir(got)) == ["model.safetensors"]
    assert store.prune("runs/r/policy/v0001", ["trainer_state.pt"], reason="again") == m  # no-op
    with pytest.raises(ArtifactExists):  # still immutable: the old content is not the version any more
        store.publish(str(src), "runs/r/policy/v0001", kind="checkpoint", producer="test")


def test_weight_sync_keeps_the_trainer_state_of_the_newest_versions_only(tmp_path):
    """tasks/stages/weight_sync.py prune_trainer_states after publishing iteration N with keep=2: version
    N-2 loses trainer_state.pt (weights and critic stay), N-1 and N keep it; a rerun is a no-op."""
    from tasks.stages.weight_sync import prune_trainer_states

    store, spec = _run_store(tmp_path)
    src = _checkpoint_dir(tmp_path, {rel: rel.encode() for rel in ("model.safetensors", "trainer_state.pt",
                                                                    "critic/model.safetensors")})
    files = lambda v: set(store.manifest(f"runs/r1/policy/v{v:04d}").files)
    for it in (1, 2, 3, 4):
        store.publish(str(src), f"runs/r1/policy/v{it:04d}", kind="checkpoint", producer="test")
        pruned = prune_trainer_states(store, spec, it, keep=2)
        assert pruned == (None if it < 3 else f"runs/r1/policy/v{it - 2:04d}")
    assert files(1) == files(2) == {"model.safetensors", "critic/model.safetensors"}
    assert files(3) == files(4) == {"model.safetensors", "trainer_state.pt", "critic/model.safetensors"}
    assert prune_trainer_states(store, spec, 4, keep=2) is None  # resumed iteration 4: already done


def _fetch_and_hash(cache: str, store_root: str, barrier, delay: float) -> str:
    """In a fresh process: fetch_cached `delay` s after the others' common start, then hash what it got."""
    import hashlib
    import time

    os.environ["FLYROLL_CACHE_DIR"] = cache
    from tasks.run.common import fetch_cached
    from tasks.run.types import RunSpec

    spec = RunSpec(config_json="{}", config_hash="h", run_id="r1", store_uri=store_root, tracking_uri="", mlflow_run_id="")
    barrier.wait()
    time.sleep(delay)
    with open(os.path.join(fetch_cached(spec, "runs/r1/policy/v0001"), "w.bin"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_processes_fetching_one_version_at_once_each_read_it_whole(tmp_path):
    """Six processes fetch the same uncached version, starting 0.05 s apart (DDP ranks loading a
    checkpoint): each reads the complete file the moment its fetch_cached returns. Without the
    per-version lock, a rank that found no copy yet rewrote the file while an earlier one was already
    reading it (a JSONDecodeError on tokenizer.json in CI); on the code before the lock this test
    failed."""
    import hashlib
    import multiprocessing as mp

    from infra.store import ArtifactStore

    src, data = tmp_path / "src", os.urandom(128 << 20)
    src.mkdir()
    (src / "w.bin").write_bytes(data)
    ArtifactStore(str(tmp_path / "store")).publish(str(src), "runs/r1/policy/v0001", kind="checkpoint", producer="test")
    ctx = mp.get_context("spawn")
    barrier = ctx.Manager().Barrier(6)
    with ctx.Pool(6) as pool:
        got = pool.starmap(_fetch_and_hash, [(str(tmp_path / "cache"), str(tmp_path / "store"), barrier, 0.05 * i)
                                             for i in range(6)])
    assert got == [hashlib.sha256(data).hexdigest()] * 6


def test_check_writable_refuses_a_read_only_store(tmp_path):
    """Was: nothing checked; the first publish failed 27 s into a run with a bare OSError."""
    from infra.store import StoreError

    from tests.support.folders import read_only_folder

    root = read_only_folder(tmp_path)
    with pytest.raises(StoreError, match="not writable") as e:
        ArtifactStore(root).check_writable()
    assert root in str(e.value)


def test_check_writable_leaves_nothing_behind(store):
    store.check_writable()
    assert not [p for p in store.fs.find(store._root_path) if "write-probe" in p] and store.list() == []

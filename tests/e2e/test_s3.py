"""The workflow against real services: SeaweedFS S3 + an MLflow server on loopback, and S3 faults.

`s3_run` runs `pyflyte run --raw-output-data-prefix s3://... workflows/rlvr.py rlvr` on the e2e config
with `run.store_uri` on the S3 bucket, `MLFLOW_TRACKING_URI` = the MLflow server (its artifacts on the
same S3), and flytekit's own S3 settings (FLYTE_AWS_*) so Flyte's intermediate outputs land there too.
Afterwards everything is checked through the S3 API (boto3) and `MlflowClient` only.

Faults: the S3 server killed in the middle of a publish (unit level, deterministic) and in the middle
of a workflow run; a corrupted checkpoint shard caught by its hash when the next run loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.services import SeaweedS3, pid_alive
from infra.store import ArtifactNotFound, ArtifactStore, StoreUnavailable
from tests.support.services import mlflow_server, s3_server  # noqa: F401  (session fixtures)
from tests.support.workflow import PYFLYTE, REPO, _config, _env

FLYROLL = str(Path(sys.executable).with_name("flyroll"))


def _s3_env(tmp: Path, s3, tracking_uri: str | None) -> dict:
    env = {**_env(tmp), **s3.env, "COLUMNS": "200", "FLYTE_AWS_ENDPOINT": s3.endpoint_url, "FLYTE_AWS_ACCESS_KEY_ID": s3.access_key,
           "FLYTE_AWS_SECRET_ACCESS_KEY": s3.secret_key}
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def _boto(s3):
    import boto3

    return boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name="us-east-1")


def _keys(client, bucket: str, prefix: str) -> list[str]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


@pytest.fixture(scope="module")
def s3_run(tmp_path_factory, s3_server, mlflow_server):  # noqa: F811
    tmp = tmp_path_factory.mktemp("s3e2e")
    prefix = f"e2e-{time.time_ns()}"
    store_uri = f"s3://{s3_server.bucket}/{prefix}/store"
    config = _config(tmp, run={"store_uri": store_uri})
    env = _s3_env(tmp, s3_server, mlflow_server.tracking_uri)
    raw = f"s3://{s3_server.bucket}/{prefix}/flyte-raw"
    proc = subprocess.run([PYFLYTE, "run", "--raw-output-data-prefix", raw, str(REPO / "workflows/rlvr.py"), "rlvr",
                           "--config", str(config)], cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    from configs.schema import load_config

    cfg = load_config(config)
    return {"tmp": tmp, "prefix": prefix, "store_uri": store_uri, "env": env, "config": config,
            "run_id": f"{cfg.run.name}-{cfg.hash()}", "out": proc.stdout + proc.stderr}


def _manifest(client, bucket: str, key: str) -> dict:
    return json.loads(client.get_object(Bucket=bucket, Key=f"{key}/MANIFEST.json")["Body"].read())


@pytest.mark.slow
def test_every_iteration_checkpoint_and_rollout_table_is_on_s3_with_a_valid_manifest(s3_run, s3_server):  # noqa: F811
    c, bucket, root = _boto(s3_server), s3_server.bucket, f"{s3_run['prefix']}/store"
    manifests = sorted(k[: -len("/MANIFEST.json")] for k in _keys(c, bucket, root + "/") if k.endswith("/MANIFEST.json"))
    policies = [k for k in manifests if "/policy/" in k]
    rollouts = [k for k in manifests if "/rollouts/" in k]
    assert [k.rsplit("/", 1)[-1] for k in policies] == ["v0001", "v0002"]
    assert [k.rsplit("/", 1)[-1] for k in rollouts] == ["i0001", "i0002"]
    assert any("/models/tiny-" in k for k in manifests) and any(k.endswith("/eval") for k in manifests)
    for key in manifests:  # every file of every version: present, right size, right sha256
        m = _manifest(c, bucket, key)
        assert m["format"] == "flyroll-manifest/1" and m["key"] == key[len(root) + 1:]
        for rel, entry in m["files"].items():
            body = c.get_object(Bucket=bucket, Key=f"{key}/{rel}")["Body"].read()
            assert len(body) == entry["size"] and hashlib.sha256(body).hexdigest() == entry["sha256"], (key, rel)
    base = _manifest(c, bucket, policies[0])["parents"][0]  # v0001's parent: the base model, also the KL reference
    for i, key in enumerate(rollouts, start=1):  # a rollout table names the policy that sampled it, then the
        m = _manifest(c, bucket, key)             # reference its ref_logprobs came from when that is another model
        assert m["kind"] == "rollout" and m["metadata"]["iteration"] == i
        sampler = base if i == 1 else policies[i - 2][len(root) + 1:]
        assert m["parents"] == [sampler] + ([] if sampler == base else [base])
    m2 = _manifest(c, bucket, policies[1])
    assert m2["parents"] == [policies[0][len(root) + 1:]] and m2["metadata"]["rollout_table"] == rollouts[1][len(root) + 1:]


@pytest.mark.slow
def test_flyte_raw_outputs_went_to_s3(s3_run, s3_server):  # noqa: F811
    raw = _keys(_boto(s3_server), s3_server.bucket, f"{s3_run['prefix']}/flyte-raw/")
    assert len(raw) >= 5, raw  # the rollout tables passed between tasks (StructuredDataset parquet)


@pytest.mark.slow
def test_mlflow_has_one_parent_run_a_child_per_iteration_and_tagged_model_versions(s3_run, mlflow_server):  # noqa: F811
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    exp = c.get_experiment_by_name("flyroll")
    run_id_tag = s3_run["run_id"]
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`flyroll.run_id` = '{run_id_tag}'")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = sorted((r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.info.run_name)
    assert len(parents) == 1
    parent = parents[0]
    assert [r.info.run_name for r in children] == ["iteration-0001", "iteration-0002"]
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    assert sorted(m.step for m in c.get_metric_history(parent.info.run_id, "reward/mean")) == [1, 2]
    versions = {int(v.tags["flyroll.iteration"]): v for v in c.search_model_versions("name='flyroll-policy'")
                if v.tags.get("flyroll.run_id") == run_id_tag}
    assert sorted(versions) == [1, 2]
    for it, child in enumerate(children, start=1):
        t, v = child.data.tags, versions[it]
        assert [m.step for m in c.get_metric_history(child.info.run_id, "reward/mean")] == [it]
        assert {"actor/pg_loss", "timing/rollout_s", "timing/weight_sync_s", "rollout/tokens_per_s"} <= set(child.data.metrics)
        assert t["flyroll.rollout_table"] == f"runs/{run_id_tag}/rollouts/i{it:04d}"
        assert t["flyroll.rollout_table_uri"] == f"{s3_run['store_uri']}/runs/{run_id_tag}/rollouts/i{it:04d}"
        assert t["flyroll.policy_out"] == f"runs/{run_id_tag}/policy/v{it:04d}" and t["flyte.execution_id"]
        assert v.tags["flyroll.child_run_id"] == child.info.run_id and v.run_id == parent.info.run_id
        assert v.source == f"{s3_run['store_uri']}/runs/{run_id_tag}/policy/v{it:04d}"
        assert v.tags["flyroll.key"] == t["flyroll.policy_out"] and v.tags["flyroll.rollout_table"] == t["flyroll.rollout_table"]
        assert v.tags["flyroll.config_hash"] == parent.data.tags["flyroll.config_hash"]
        assert v.tags["flyroll.dataset"].startswith("datasets/") and v.tags["flyte.execution_id"]
        assert v.tags["flyroll.parent"] == t["flyroll.policy_in"]
    assert versions[1].tags["flyroll.parent"].startswith("models/tiny-") and versions[1].tags["flyroll.parent_model_version"] == ""
    assert versions[2].tags["flyroll.parent_model_version"] == str(versions[1].version)
    # MLflow reserves `latest`: models:/flyroll-policy/latest resolves to the newest version without being set
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    newest = max(int(v.version) for v in c.search_model_versions("name='flyroll-policy'"))
    assert get_model_name_and_version(c, "models:/flyroll-policy/latest") == ("flyroll-policy", str(newest))


@pytest.mark.slow
def test_lineage_walks_back_to_the_base_model_over_s3(s3_run, s3_server, mlflow_server):  # noqa: F811
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    final = max((v for v in c.search_model_versions("name='flyroll-policy'") if v.source.startswith(s3_run["store_uri"])),
                key=lambda v: int(v.version))
    proc = subprocess.run([FLYROLL, "lineage", str(final.version), "--json", "--store", s3_run["store_uri"],
                           "--tracking-uri", mlflow_server.tracking_uri], env=s3_run["env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert [v["key"].rsplit("/", 1)[-1] for v in rec["chain"]] == ["v0002", "v0001", "v0000"]
    assert rec["base_model"].startswith("models/tiny-") and str(rec["chain"][0]["mlflow"]["model_version"]) == str(final.version)
    assert rec["datasets"] and rec["datasets"][0]["rows"] == 64


@pytest.mark.slow
def test_corrupted_shard_is_caught_by_its_hash_when_the_next_run_loads_it(s3_run, s3_server, mlflow_server):  # noqa: F811
    """Flip one byte of v0002's model.safetensors behind the store's back (same size), clear the local
    fetch cache, and start a run from that checkpoint: the load fails with CorruptArtifact naming the file."""
    c, bucket = _boto(s3_server), s3_server.bucket
    store = ArtifactStore(s3_run["store_uri"], s3_server.storage_options)
    key = [k for k in store.list("runs") if "/policy/" in k][-1]
    obj = f"{s3_run['prefix']}/store/{key}/model.safetensors"
    data = bytearray(c.get_object(Bucket=bucket, Key=obj)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    c.put_object(Bucket=bucket, Key=obj, Body=bytes(data))
    tmp = s3_run["tmp"] / "corrupt"
    tmp.mkdir()
    config = _config(tmp, run={"store_uri": s3_run["store_uri"], "name": "from-corrupt"}, model={"path": key},
                     loop={"iterations": 1, "eval_every": 1})
    env = {**s3_run["env"], "HOME": str(tmp / "home"), "FLYROLL_CACHE_DIR": str(tmp / "cache")}  # empty fetch cache
    (tmp / "home").mkdir()
    proc = subprocess.run([PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(config)], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=600)
    out = " ".join((proc.stdout + proc.stderr).split())  # the traceback panel wraps long lines
    assert proc.returncode != 0, out[-3000:]
    assert "CorruptArtifact" in out and f"{s3_run['store_uri']}/{key}: file 'model.safetensors' does not match its manifest" in out, out[-5000:]


def _checkpoint(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"hidden": 32}')
    (d / "model.safetensors").write_bytes(os.urandom(1 << 20))
    return d


def test_s3_killed_mid_publish_retries_then_fails_naming_the_uri_and_no_partial_version_is_visible(tmp_path, caplog, monkeypatch):
    """Unit level, deterministic: the first file of a checkpoint lands, then the S3 server is SIGKILLed
    before the second; the store retries with backoff, raises StoreUnavailable naming the version's URI,
    and after a restart (same data) the version does not exist -- its debris is there but invisible --
    and publishing it again succeeds. The server's own log files stay in its data folder."""
    data, tmpdir = tmp_path / "seaweed", tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # where weed's glog would write its files without -logdir
    s3 = SeaweedS3(bucket="flyroll", data_dir=str(data)).start()
    restarted = None
    try:
        assert list(tmpdir.iterdir()) == [] and list(data.glob("weed.*.log.INFO.*"))
        root, key = "s3://flyroll/fault", "runs/r1/policy/v0001"
        store = ArtifactStore(root, s3.storage_options, retries=3, backoff_s=0.05)
        ckpt = _checkpoint(tmp_path / "ckpt")
        real_put = store.fs.put

        def put_then_die(lpaths, rpaths, **kw):
            real_put(lpaths[:1], rpaths[:1], **kw)  # config.json lands
            if pid_alive(s3.pid):
                os.kill(s3.pid, signal.SIGKILL)
                s3.proc.wait(timeout=10)
            return real_put(lpaths[1:], rpaths[1:], **kw)

        store.fs.put = put_then_die
        with caplog.at_level("WARNING", logger="infra.store"):
            with pytest.raises(StoreUnavailable, match=rf"upload to {root}/{key} failed after 4 attempts"):
                store.publish(str(ckpt), key, kind="checkpoint", producer="test")
        retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
        assert [m.split("retry ")[1].split(" in ")[0] for m in retries] == ["1/3", "2/3", "3/3"], retries
        assert all(f"{root}/{key}" in m for m in retries)
        del store.fs.put

        restarted = SeaweedS3(bucket="flyroll", data_dir=str(data), access_key=s3.access_key, secret_key=s3.secret_key).start()
        again = ArtifactStore(root, restarted.storage_options)
        assert again.fs.exists(f"flyroll/fault/{key}/config.json")  # the debris is there ...
        assert not again.exists(key) and again.list("runs") == []  # ... but no version is visible
        with pytest.raises(ArtifactNotFound):
            again.fetch(key, str(tmp_path / "out"))
        again.publish(str(ckpt), key, kind="checkpoint", producer="test")
        assert again.list("runs") == [key]
        assert (Path(again.fetch(key, str(tmp_path / "out"))) / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    finally:
        for server in (restarted, s3):
            if server is not None:
                server.stop()


@pytest.mark.slow
def test_s3_outage_during_a_run_fails_the_task_naming_the_uri_and_leaves_only_complete_versions(tmp_path):
    """Workflow level: kill the S3 server once v0001 is published; the run fails (after the store's
    retries) with StoreUnavailable naming an s3:// URI of this store, and after a restart every
    visible version is complete and verifies."""
    data = tmp_path / "seaweed"
    s3 = SeaweedS3(bucket="flyroll", data_dir=str(data)).start()
    restarted = None
    try:
        store_uri = "s3://flyroll/outage/store"
        config = _config(tmp_path, run={"store_uri": store_uri}, loop={"iterations": 3, "eval_every": 1})
        env = _s3_env(tmp_path, s3, None)  # SQLite MLflow: the outage hits the artifact store only
        store = ArtifactStore(store_uri, s3.storage_options, retries=0)
        log = open(tmp_path / "run.log", "w")
        proc = subprocess.Popen([PYFLYTE, "run", str(REPO / "workflows/rlvr.py"), "rlvr", "--config", str(config)],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 480
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if any(k.endswith("/policy/v0001") for k in store.list("runs")):
                        break
                except Exception:  # noqa: BLE001 -- nothing there yet
                    pass
                time.sleep(0.3)
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            os.kill(s3.pid, signal.SIGKILL)
            s3.proc.wait(timeout=10)
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        out = " ".join((tmp_path / "run.log").read_text().split())  # the traceback panel wraps long lines
        assert rc != 0
        assert "StoreUnavailable" in out and "object store unreachable" in out and store_uri in out, out[-5000:]
        assert "retry 1/4" in out  # the store's backoff, before giving up

        restarted = SeaweedS3(bucket="flyroll", data_dir=str(data), access_key=s3.access_key, secret_key=s3.secret_key).start()
        again = ArtifactStore(store_uri, restarted.storage_options)
        visible = again.list("runs")
        assert any(k.endswith("/policy/v0001") for k in visible)
        for k in visible:  # every visible version is whole
            again.fetch(k, str(tmp_path / "verify" / k))
    finally:
        for server in (restarted, s3):
            if server is not None:
                server.stop()

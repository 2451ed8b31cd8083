"""Issue 39: new data really retrains, small files are not eaten by evaluation.

- engines/data/fingerprint.py: a file, folder or model folder is fingerprinted by its content (sampled for
  big local inputs, ETag for object stores), and tasks/stages/prepare.py puts the fingerprint into the
  dataset version and the imported model's key;
- engines/data/prompt_mix.py hash_split: eval rows by prompt hash, stable when rows are appended, capped at
  20 % of a file (warning naming asked vs used), refused when the train rows would not fill one batch.
The slow test appends rows and reruns the scheduled `retrain` workflow through `pyflyte run`.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.datasets import _config, _dataset, _prompts_file, _rows


def _append(path: str, rows) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


# --- fingerprints ----------------------------------------------------------------------------

def test_a_file_fingerprint_follows_its_content_not_its_name_or_time(tmp_path):
    from engines.data.fingerprint import fingerprint

    uri = _prompts_file(tmp_path, _rows(10))
    first = fingerprint(uri)
    assert first["method"] == "content" and first["files"] == 1
    os.utime(uri, (1, 1))  # touched, same bytes: same fingerprint
    assert fingerprint(uri)["digest"] == first["digest"]
    _append(uri, _rows(1))
    assert fingerprint(uri)["digest"] != first["digest"]


def test_a_big_folder_is_fingerprinted_by_size_mtime_and_samples(tmp_path, monkeypatch):
    from engines.data import fingerprint as fp

    monkeypatch.setattr(fp, "FULL_HASH_BYTES", 1000)      # the rule for big inputs, on a small folder
    monkeypatch.setattr(fp, "SAMPLE_BYTES", 16)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "weights.bin").write_bytes(b"a" * 4000)
    before = fp.fingerprint(str(tmp_path / "m"))
    assert (before["method"], before["bytes"]) == ("sampled", 4000)
    data = bytearray(b"a" * 4000)
    data[-1:] = b"b"                                         # the last bytes are sampled
    (tmp_path / "m" / "weights.bin").write_bytes(bytes(data))
    assert fp.fingerprint(str(tmp_path / "m"))["digest"] != before["digest"]
    with pytest.raises(FileNotFoundError, match="no-such"):
        fp.fingerprint(str(tmp_path / "no-such"))


def test_an_object_store_file_is_fingerprinted_from_its_etag_without_reading_it():
    import fsspec

    from engines.data.fingerprint import fingerprint

    fs = fsspec.filesystem("memory")
    fs.pipe("/bucket/train.jsonl", b'{"prompt": "1+1=", "domain": "math", "answer": "2"}\n')
    first = fingerprint("memory://bucket/train.jsonl")
    assert first["method"] == "etag"
    fs.pipe("/bucket/train.jsonl", b'{"prompt": "1+1=", "domain": "math", "answer": "2"}\n{"prompt": "2+2=", "domain": "math", "answer": "4"}\n')
    assert fingerprint("memory://bucket/train.jsonl")["digest"] != first["digest"]


@pytest.mark.slow
def test_an_s3_object_is_fingerprinted_by_its_etag_on_a_real_s3_server(monkeypatch):
    """SeaweedFS: the same bytes uploaded again keep the fingerprint (the ETag is their MD5), appended
    rows change it; nothing is downloaded to compute it."""
    import s3fs

    from engines.data.fingerprint import fingerprint
    from infra.services import SeaweedS3

    with SeaweedS3(bucket="flyroll") as s3:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)
        rows = b'{"prompt": "1+1=", "domain": "math", "answer": "2"}\n'
        fs.pipe_file("flyroll/data/train.jsonl", rows)
        first = fingerprint("s3://flyroll/data/train.jsonl")
        assert first["method"] == "etag" and first["bytes"] == len(rows)
        fs.pipe_file("flyroll/data/train.jsonl", rows)
        assert fingerprint("s3://flyroll/data/train.jsonl")["digest"] == first["digest"]
        fs.pipe_file("flyroll/data/train.jsonl", rows + b'{"prompt": "2+2=", "domain": "math", "answer": "4"}\n')
        assert fingerprint("s3://flyroll/data/train.jsonl")["digest"] != first["digest"]


# --- eval split by prompt hash ---------------------------------------------------------------

def _table(n, start=0):
    from engines.data.datasets import table_of

    return table_of([{**r, "tests": None, "metadata": {}} for r in _rows(n + start)[start:]])


def test_the_eval_split_is_stable_when_rows_are_appended():
    import pandas as pd

    from engines.data.prompt_mix import hash_split

    old = hash_split(_table(200), 256)
    new = hash_split(pd.concat([_table(200), _table(50, start=200)], ignore_index=True), 256)
    old_eval, old_train = set(old.evals["prompt"]), set(old.train["prompt"])
    assert old_eval and old_eval <= set(new.evals["prompt"])          # old eval rows stay eval
    assert old_train <= set(new.train["prompt"])                      # old train rows stay train
    assert not set(new.evals["prompt"]) & set(new.train["prompt"])
    # past the cap (eval_size decides) growth never moves a train row into eval
    big = hash_split(_table(2000), 100)
    bigger = hash_split(_table(3000), 100)
    assert set(big.train["prompt"]) <= set(bigger.train["prompt"])


def test_a_small_file_keeps_most_rows_for_training_and_warns_with_both_numbers():
    from engines.data.prompt_mix import hash_split

    split = hash_split(_table(200), 256, min_train=64, what="prompts.jsonl")
    assert 0 < len(split.evals) <= 0.2 * 200 + 10 and len(split.train) + len(split.evals) == 200
    assert f"data.eval_size=256 asked, {len(split.evals)} used" in split.note and "200 rows" in split.note
    assert hash_split(_table(2000), 100).note == ""  # eval_size within 20 %: no warning


def test_a_file_too_small_for_one_iteration_is_refused_naming_the_numbers():
    from engines.data.prompt_mix import hash_split

    with pytest.raises(ValueError, match=r"prompts\.jsonl: 50 rows; holding out \d+ for eval \(asked data\.eval_size=256, "
                                         r"at most 20% of the rows\) leaves \d+ train prompts, fewer than one iteration's "
                                         r"rollout\.prompts_per_iteration=64"):
        hash_split(_table(50), 256, min_train=64, what="prompts.jsonl")


# --- through tasks/stages/prepare.py --------------------------------------------------------------

def test_appended_rows_make_a_new_dataset_version_with_its_fingerprint(tmp_path, tiny_model_dir, monkeypatch):
    from infra.store import ArtifactStore

    uri = _prompts_file(tmp_path, _rows(40))
    data = {"sources": [{"kind": "file", "uri": uri}]}
    spec, first = _dataset(tmp_path, tiny_model_dir, monkeypatch, data)
    _, same = _dataset(tmp_path, tiny_model_dir, monkeypatch, data)
    assert same == first                                              # unchanged file: the snapshot is reused
    _append(uri, _rows(50)[40:])
    _, second = _dataset(tmp_path, tiny_model_dir, monkeypatch, data)
    assert second.train_key != first.train_key and second.eval_key != first.eval_key
    store = ArtifactStore(spec.store_uri)
    meta = store.manifest(second.train_key).metadata
    assert meta["inputs"][uri]["digest"] != store.manifest(first.train_key).metadata["inputs"][uri]["digest"]
    assert meta["rows"] + store.manifest(second.eval_key).metadata["rows"] == 50
    assert any("data.eval_size=16 asked" in n for n in meta["eval_split_notes"])   # e2e.yaml's 16 > 20 % of 50
    # the same run resumed on the changed file says so, and keeps the dataset it started on in a tag
    from infra import tracking

    tags = tracking.client(spec.tracking_uri).get_run(spec.mlflow_run_id).data.tags
    assert tags["flyroll.dataset.train"] == second.train_key
    assert tags["flyroll.dataset.train.previous"] == first.train_key


def test_make_dataset_refuses_a_file_whose_eval_split_leaves_less_than_one_batch(tmp_path, tiny_model_dir, monkeypatch):
    uri = _prompts_file(tmp_path, _rows(30))
    with pytest.raises(ValueError, match=r"data\.sources file '.*prompts\.jsonl': 30 rows; holding out \d+ for eval "
                                         r"\(asked data\.eval_size=16.*rollout\.prompts_per_iteration=32"):
        _dataset(tmp_path, tiny_model_dir, monkeypatch, {"sources": [{"kind": "file", "uri": uri}]}, {"prompts_per_iteration": 32})


def test_a_resaved_model_folder_changes_the_imported_model(tmp_path, tiny_model_dir, monkeypatch):
    import shutil

    from tasks.stages.prepare import build_base_policy, prepare_run

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = _config(tmp_path, path=str(model))
    _, spec1 = prepare_run(config=config, restart=False)
    key1 = build_base_policy(spec1).key
    _, spec_again = prepare_run(config=config, restart=False)
    assert spec_again == spec1                                        # same files: same import (and Flyte cache key)
    cfg = json.loads((model / "config.json").read_text())
    cfg["note"] = "re-saved"
    (model / "config.json").write_text(json.dumps(cfg))
    _, spec2 = prepare_run(config=config, restart=False)
    assert spec2 != spec1
    key2 = build_base_policy(spec2).key
    assert key2 != key1
    from infra.store import ArtifactStore

    meta = ArtifactStore(json.loads(spec2)["store_uri"]).manifest(key2).metadata
    assert meta["fingerprint"] == json.loads(spec2)["model_fingerprints"]["path"]


# --- the scheduled retrain, end to end ---------------------------------------------------------

@pytest.mark.slow
def test_a_retrain_after_appending_rows_trains_on_the_new_dataset_version(tmp_path, tiny_model_dir, monkeypatch):
    """Was: the retrain found the snapshot keyed by the data settings alone and trained on the old rows.
    The first snapshot is built in-process (tasks/stages/prepare.py, as the first run's make_dataset would);
    then rows are appended and the `retrain` workflow runs through `pyflyte run`."""
    from infra.lineage import lineage
    from infra.store import ArtifactStore
    from tasks.stages.prepare import build_base_policy, make_dataset, prepare_run
    from tests.support.workflow import _env
    from tests.support.workflow import _client, _retrain, _retrain_run

    uri = _prompts_file(tmp_path, _rows(40, domain="arithmetic"))   # e2e.yaml's test reward for 'arithmetic'
    config = _config(tmp_path, {"sources": [{"kind": "file", "uri": uri}]}, path=tiny_model_dir)  # runs/ in tmp_path
    monkeypatch.setenv("FLYROLL_CACHE_DIR", _env(tmp_path)["FLYROLL_CACHE_DIR"])  # the pyflyte run's
    spec, model_spec = prepare_run(config=config, restart=True)
    before = make_dataset(spec=spec, base=build_base_policy(model_spec))

    _append(uri, _rows(60, domain="arithmetic")[40:])
    proc = _retrain(tmp_path, config, 1)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    run = _retrain_run(_client(tmp_path), 0)
    used = run.data.tags["flyroll.dataset.train"]
    assert used != before.train_key
    store = ArtifactStore(spec.store_uri)
    digest = store.manifest(used).metadata["inputs"][uri]["digest"]
    assert json.loads(run.data.tags["flyroll.dataset.inputs"]) == {uri: digest}
    assert digest != store.manifest(before.train_key).metadata["inputs"][uri]["digest"]
    record = lineage(run.data.tags["flyroll.final_policy"], spec.store_uri, spec.tracking_uri)
    assert {d["key"]: d["inputs"] for d in record["datasets"]} == {used: {uri: digest}}

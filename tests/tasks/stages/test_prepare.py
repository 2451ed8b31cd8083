"""tasks/stages/prepare.py: what is refused before any cluster starts (issue 40), through the real pre-cluster
entry points: `prepare_run` (the model folders, the store) and `make_dataset` (what only the data
tells: its domains, its size, its prompts' lengths)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.support.datasets import _config, _dataset, _prompts_file, _rows


def test_a_model_path_folder_that_is_not_a_model_is_refused(tmp_path):
    """Was: the folder was published into the store as a checkpoint and the run failed 66 s later with a
    tokenizer error (the junk then reused)."""
    from tasks.stages.prepare import prepare_run

    junk = tmp_path / "not-a-model"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"model\.path .*not-a-model.* is not a model: the folder has no config\.json"):
        prepare_run(config=_config(tmp_path, path=str(junk)), restart=False)
    (junk / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match=r"model\.path .*no weights"):
        prepare_run(config=_config(tmp_path, path=str(junk)), restart=False)
    (junk / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model\.path .*model\.safetensors is not a safetensors file"):
        prepare_run(config=_config(tmp_path, path=str(junk)), restart=False)
    (junk / "model.safetensors").unlink()
    (junk / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model\.path .*no tokenizer files"):
        prepare_run(config=_config(tmp_path, path=str(junk)), restart=False)
    assert not list((tmp_path / "runs" / "store").glob("models/*"))  # nothing published


def test_a_missing_model_path_is_refused_naming_it(tmp_path):
    """Was: "artifact key ... is invalid", from the bootstrap task."""
    from tasks.stages.prepare import prepare_run

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match=r"model\.path '.*no-such-model': no such local directory"):
        prepare_run(config=_config(tmp_path, path=missing), restart=False)


def test_a_read_only_store_is_refused_before_the_run_starts(tmp_path):
    """Was: a bare OSError 27 s into the run, at the first publish."""
    from tasks.stages.prepare import prepare_run
    from tests.support.folders import read_only_folder

    root = read_only_folder(tmp_path)
    cfg = yaml.safe_load(open(_config(tmp_path)))
    cfg["run"]["store_uri"] = root
    (tmp_path / "ro.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=r"run\.store_uri: the artifact store .* cannot be written to") as e:
        prepare_run(config=str(tmp_path / "ro.yaml"), restart=False)
    assert root in str(e.value)


def test_a_100000_character_row_never_reaches_the_workers(tmp_path, tiny_model_dir, monkeypatch):
    """Was: the row went to a generation worker, which allocated 5 GB and was OOM-killed. The default
    limit is the policy's context (the tiny model's 256 positions) minus rollout.max_new_tokens."""
    from infra.store import ArtifactStore

    rows = _rows(10)
    rows.insert(3, {"prompt": "1" * 100_000 + "+1=", "domain": "math", "answer": "2"})
    uri = _prompts_file(tmp_path, rows)
    spec, ref = _dataset(tmp_path, tiny_model_dir, monkeypatch,
                         {"sources": [{"kind": "file", "uri": uri, "eval_uri": uri}]})
    store = ArtifactStore(spec.store_uri)
    meta = store.manifest(ref.train_key).metadata
    context = json.load(open(f"{tiny_model_dir}/config.json"))["max_position_embeddings"]
    assert (meta["max_prompt_tokens"], meta["long_prompts"]) == (context - 6, 1)   # e2e.yaml: max_new_tokens 6
    assert "longest: 100003 tokens" in meta["long_prompts_report"]
    import pandas as pd

    train = pd.read_parquet(store.fetch(ref.train_key, str(tmp_path / "t")) + "/train.parquet")
    assert len(train) == 10 and train["prompt"].str.len().max() <= context - 6


def test_a_line_over_max_line_bytes_is_dropped_counted_and_logged(tmp_path, tiny_model_dir, monkeypatch):
    """Was: the file was read whole before any line was measured (one appended 1 GB line took the task
    past 8 GiB); data.max_line_bytes now drops such a line unread, and the run says so like it says
    over-long prompts: the manifest, the skipped-rows report and data/dropped_long_lines."""
    from infra import tracking
    from infra.store import ArtifactStore

    uri = _prompts_file(tmp_path, _rows(10))
    with open(uri, "a") as f:
        f.write(json.dumps({"prompt": "9" * 5000 + "+1=", "domain": "math", "answer": "1"}) + "\n")
    spec, ref = _dataset(tmp_path, tiny_model_dir, monkeypatch,
                         {"sources": [{"kind": "file", "uri": uri, "eval_uri": uri}], "max_line_bytes": 4096})
    meta = ArtifactStore(spec.store_uri).manifest(ref.train_key).metadata
    assert meta["rows"] == 10 and meta["long_lines"] == 2 and meta["long_prompts"] == 0   # the file is read twice: train and eval
    assert "1 line(s) longer than data.max_line_bytes=4096 bytes dropped unread" in meta["long_lines_report"][0]
    assert "line 11" in meta["long_lines_report"][0] and any("data.max_line_bytes" in p for p in meta["skipped_rows"])
    metrics = tracking.client(spec.tracking_uri).get_run(spec.mlflow_run_id).data.metrics
    assert metrics["data/dropped_long_lines"] == 2.0


def test_domain_weights_absent_from_a_file_are_refused_when_the_dataset_is_built(tmp_path, tiny_model_dir, monkeypatch):
    """Was: refused only by mix_domains in the rollout task, after Ray started."""
    uri = _prompts_file(tmp_path, _rows(20))
    with pytest.raises(ValueError, match=r"data\.domain_weights: domain\(s\) \['code'\] are not in the train split"):
        _dataset(tmp_path, tiny_model_dir, monkeypatch,
                 {"sources": [{"kind": "file", "uri": uri, "eval_size": 4}], "domain_weights": {"math": 0.5, "code": 0.5}})


def test_a_file_below_one_batch_is_refused_when_the_dataset_is_built(tmp_path, tiny_model_dir, monkeypatch):
    """Was: a batch drew a prompt twice and its groups merged (one group_id)."""
    uri = _prompts_file(tmp_path, _rows(7))  # its own eval file: a file without one is refused by its eval split
    with pytest.raises(ValueError, match=r"fewer prompts than one batch of rollout\.prompts_per_iteration=8 \(7 prompts"):
        _dataset(tmp_path, tiny_model_dir, monkeypatch, {"sources": [{"kind": "file", "uri": uri, "eval_uri": uri, "eval_size": 4}]},
                 {"prompts_per_iteration": 8})


def test_a_fine_tune_logged_to_a_file_prints_progress_lines(tiny_policy, capsys, monkeypatch):
    """Was: the warm start's rich bar draws nothing where stderr is not a terminal (a pod's log, nohup),
    so a 13-minute SmolLM2 warm start printed no line until it ended. Now one line per `_LOG_EVERY_S`
    and at the first and last step, with the step, the loss and the time left; on the real
    `supervised_finetune`."""
    import copy

    from tasks.stages import prepare

    model, tok = tiny_policy
    pairs = [("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6")]
    for every, expected in ((1e9, ["1/4", "4/4"]), (0.0, ["1/4", "2/4", "3/4", "4/4"])):
        monkeypatch.setattr(prepare, "_LOG_EVERY_S", every)
        metrics = prepare._finetune(copy.deepcopy(model), tok, pairs, "warm start", steps=4, batch_size=2, lr=1e-3)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm start")]
        assert [line.split()[2] for line in lines] == expected
        assert all("loss" in line and "s left)" in line for line in lines)
        assert all(0.0 < float(line.split()[4]) < 10.0 for line in lines)   # the step's loss (char vocabulary)
        assert metrics["bootstrap/steps"] == 4


def test_a_domain_no_reward_can_score_is_refused_before_any_cluster(tmp_path, tiny_model_dir, monkeypatch):
    """Was: its rows trained on reward 0 (each flagged 'no reward function') and the run exited 0 (issue 60)."""
    uri = _prompts_file(tmp_path, _rows(10) + _rows(10, domain="poetry"))
    with pytest.raises(ValueError, match=r"data \(train split .*\): no reward can score domain 'poetry': no reward function "
                                         r"for domain 'poetry'.*reward\.functions"):
        _dataset(tmp_path, tiny_model_dir, monkeypatch, {"sources": [{"kind": "file", "uri": uri, "eval_size": 4}]})

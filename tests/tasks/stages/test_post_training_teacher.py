"""The distillation teacher before any cluster (tasks/stages/post_training.py `teacher_policy`): one
with another tokenizer is refused naming the field and both models; one that is not a model is
refused when the run starts; a student larger than its teacher is warned about on the MLflow run."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import TINY


def _config(tmp_path, student: str, teacher: str) -> str:
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n" for i in range(20)))
    cfg = {"run": {"output_dir": str(tmp_path / "runs"), "name": "distill"}, "model": {"path": student},
           "distill": {"teacher": teacher, "train_uri": str(demos), "eval_size": 4}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(tmp_path, student: str, teacher: str):
    from tasks.stages.post_training import teacher_policy
    from tasks.stages.prepare import build_base_policy, prepare_run

    spec, model_spec = prepare_run(config=_config(tmp_path, student, teacher), restart=False, kind="distill")
    return spec, teacher_policy(spec=spec, base=build_base_policy(model_spec))


def test_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, tiny_model_dir):
    from engines.models.modeling import CHARSET, build_char_tokenizer, build_tiny_policy, save_policy

    model, _ = build_tiny_policy(**TINY, seed=2)
    other = save_policy(model, build_char_tokenizer(CHARSET[::-1]), str(tmp_path / "reversed"))
    with pytest.raises(ValueError, match="another vocabulary") as err:
        _run(tmp_path, tiny_model_dir, other)
    assert "distill.teacher" in str(err.value) and repr(other) in str(err.value) and repr(tiny_model_dir) in str(err.value)


def test_teacher_that_is_not_a_model_is_refused_at_the_start(tmp_path, tiny_model_dir):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    with pytest.raises(Exception, match=r"distill.teacher") as err:
        _run(tmp_path, tiny_model_dir, str(tmp_path / "notes"))
    assert "config.json" in str(err.value) or "model" in str(err.value)
    assert not (tmp_path / "runs" / "mlflow.db").exists()   # before the MLflow run was opened


def test_student_larger_than_its_teacher_is_warned(tmp_path, tiny_model_dir):
    from mlflow.tracking import MlflowClient

    from engines.models.modeling import build_tiny_policy, save_policy

    small, tok = build_tiny_policy(hidden_size=16, num_layers=1, num_heads=2, seed=3)
    teacher = save_policy(small, tok, str(tmp_path / "small_teacher"))
    spec, ref = _run(tmp_path, tiny_model_dir, teacher)
    tags = MlflowClient(spec.tracking_uri).get_run(spec.mlflow_run_id).data.tags
    assert tags["flyroll.warning.student_larger"] == "true" and tags["flyroll.teacher"] == ref.key
    assert ref.key.startswith("models/teacher-")

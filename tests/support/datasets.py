"""Building a run's dataset through the real pre-cluster entry points (`prepare_run`, `make_dataset`)
from a prompts file written by the test (tests/tasks/stages/test_prepare.py, tests/e2e/test_data_identity.py)."""

from __future__ import annotations

import json

import yaml

from tests.support.workflow import REPO


def _config(tmp_path, data: dict | None = None, rollout: dict | None = None, **model) -> str:
    cfg = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    cfg["model"].update(model)
    cfg["data"].update(data or {})
    cfg["rollout"].update(rollout or {})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _prompts_file(tmp_path, rows) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _dataset(tmp_path, tiny_model_dir, monkeypatch, data, rollout=None):
    from tasks.stages.prepare import build_base_policy, make_dataset, prepare_run

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    spec, model_spec = prepare_run(config=_config(tmp_path, data, rollout, path=tiny_model_dir), restart=False)
    base = build_base_policy(model_spec)
    return spec, make_dataset(spec=spec, base=base)


def _rows(n, domain="math"):
    return [{"prompt": f"{i}+{i}=", "domain": domain, "answer": str(2 * i)} for i in range(n)]

"""The real rollout task's inputs for a DAPO-style run on the tiny model (tests/tasks/loop/test_prompts_refill.py,
tests/tasks/loop/test_partial_rollout.py)."""

from __future__ import annotations


def _parity_rollout_run(tmp_path, monkeypatch, tiny_model_dir, name: str, rollout: dict, algorithm: dict | None = None):
    """(spec, base policy, dataset) of the e2e config on the tiny model with B=3 x G=2, 3 new tokens
    and tests/support/rewards.py `parity` as every domain's reward (it varies within groups), plus
    `rollout` / `algorithm` settings; the run folder and cache under tmp_path."""
    import yaml

    from tasks.stages.prepare import build_base_policy, make_dataset, prepare_run
    from tests.support.workflow import REPO

    raw = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    raw["run"]["output_dir"] = str(tmp_path / "runs")
    raw["model"] = {"path": tiny_model_dir}
    raw["rollout"].update(prompts_per_iteration=3, samples_per_prompt=2, max_new_tokens=3, **rollout)
    raw["reward"]["functions"] = {"arithmetic": "tests.support.rewards:parity", "reverse": "tests.support.rewards:parity"}
    if algorithm is not None:
        raw["algorithm"] = algorithm
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    spec, model_spec = prepare_run(config=str(tmp_path / f"{name}.yaml"), restart=False)
    base = build_base_policy(model_spec)
    return spec, base, make_dataset(spec=spec, base=base)

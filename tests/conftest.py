"""Shared fixtures. Heavy imports stay inside the fixtures so test files that need no torch stay fast."""

from __future__ import annotations

import pytest

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_positions=128)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance (2 CPUs, the repo on the workers' PYTHONPATH) for a test module, unless one is
    already running; yields the `ray` module."""
    import ray

    from tests.support.workflow import REPO

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_policy():
    """(model, tokenizer): a randomly initialised 2-layer, 32-wide char-level Qwen2 (seed 0).

    Shared by many tests: do not train it in place (deep-copy it first)."""
    import torch

    from engines.models.modeling import build_tiny_policy

    torch.set_num_threads(1)
    model, tok = build_tiny_policy(**TINY, seed=0)
    return model.eval(), tok


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_policy, tmp_path_factory) -> str:
    """`tiny_policy` saved as a Hugging Face model directory (safetensors + tokenizer + config)."""
    from engines.models.modeling import save_policy

    model, tok = tiny_policy
    return save_policy(model, tok, str(tmp_path_factory.mktemp("tiny_policy")))


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    """One folder (HOME, runs/: store and MLflow) for the slow runs of presets on configs/tiny.yaml's
    model: the first one bootstraps the tiny base (1500 pre-training steps, minutes), the others reuse it
    from the store. tests/e2e/test_presets.py and tests/e2e/test_learning.py's default preset (one xdist group)."""
    return tmp_path_factory.mktemp("tiny-base")


@pytest.fixture(scope="session")
def e2e_run(tmp_path_factory):
    """(folder, config path, completed process): one `pyflyte run` of tests/configs/e2e.yaml (shared
    local Ray), read by tests/e2e/test_workflow.py and tests/e2e/test_lineage.py (one xdist group, so one run).
    Read it, do not change it: the only rerun (test_rerun_resumes_and_redoes_nothing) adds nothing."""
    from tests.support.workflow import _config, _pyflyte_run

    tmp = tmp_path_factory.mktemp("e2e")
    config = _config(tmp)
    proc = _pyflyte_run(tmp, "--config", str(config))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return tmp, config, proc


# `pytest -n 2 --dist loadgroup --no-loadscope-reorder` (infra/test.sh): one xdist group per test
# module, so a module's module-scoped fixtures (one pyflyte run read by several tests, the presets'
# shared base) are built once, by one worker; the modules that load SmolLM2 share a group so that two
# ~8 GB pipelines never run at the same time on the 24 GiB box. The groups holding the longest
# end-to-end runs are handed out first, so the two workers finish close together.
SMOLLM2_MODULES = {"test_multidomain", "test_eval_cli", "test_evaluation_routing"}   # + tests marked xdist_group("smollm2")
# modules that share a session fixture with another module's group: `e2e_run`, `tiny_base_dir`
SAME_GROUP = {"test_lineage": "test_workflow", "test_hybrid": "test_workflow", "test_learning": "test_presets"}
LONGEST_FIRST = ["vllm_workflow", "test_agentic_presets", "smollm2", "test_presets", "test_workflow", "test_post_training_chain", "test_resume", "test_s3",
                 "test_strategies", "test_agentic_workflow", "test_schedules", "test_decks"]


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return mark.args[0] if mark.args else mark.kwargs.get("name", "")
    module = item.module.__name__.rsplit(".", 1)[-1]
    return "smollm2" if module in SMOLLM2_MODULES else SAME_GROUP.get(module, module)


def _suffix_group(item) -> None:
    """Give the node id the `@group` suffix xdist's scheduler groups by. xdist 3.8 adds it by setting
    `item._nodeid`, which pytest 9 no longer reads (a node id is `str(item._id)`), so under pytest 9
    every test would be its own unit; set it where pytest 9 keeps it."""
    if "@" in item.nodeid.rpartition("]")[2]:
        return
    suffixed = f"{item.nodeid}@{_group(item)}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(suffixed)
    else:
        item._nodeid = suffixed


def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers under --dist loadgroup
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
        _suffix_group(item)
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: file order within a rank


"""Starting a run from another run's published policy version (`model.path=runs/<run>/policy/vN`): the
trainer takes its weights and leaves its trainer_state.pt, so this run's training settings apply; a run's
own version (a resume) brings its optimizer moments and LR schedule back (tasks/actors/train.py)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from configs.schema import parse_config


@pytest.fixture
def version_of_run_a(tiny_policy, tmp_path, monkeypatch):
    """(store root, key): run "a"'s version 1, trained one step at lr 1e-3 and published with its
    weights and trainer_state.pt, as the training stage writes them."""
    from engines.models.modeling import save_policy
    from infra.store import ArtifactStore
    from tasks.actors.train import TrainWorker
    from tests.support.training import _scored_table, publish_step

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    model, tok = tiny_policy
    root = str(tmp_path / "store")
    store = ArtifactStore(root)
    store.publish(save_policy(copy.deepcopy(model), tok, str(tmp_path / "base")), "models/base", kind="checkpoint",
                  producer="test")
    cfg, spec = _spec(root, "a", lr=1e-3)
    worker = TrainWorker.__ray_actor_class__(threads=1)
    worker.load(spec, "models/base", cfg.training, cfg.algorithm)
    key = "runs/a/policy/v0001"
    _, files = worker.step(_scored_table(model, tok), cfg.algorithm, cfg.training, 1.0, 1, key)
    assert "trainer_state.pt" in files
    publish_step(store, files, tmp_path / "v1", key)
    return root, key


def _spec(root: str, run_id: str, lr: float):
    from tasks.run.types import RunSpec

    cfg = parse_config({"run": {"torch_threads": 1}, "training": {"lr": lr, "mini_batch_size": 15,
                                                                   "max_tokens_per_micro_batch": 64}})
    return cfg, RunSpec(cfg.to_json(), cfg.hash(), run_id, root, "", "")


def _moments(worker) -> list[torch.Tensor]:
    return [s["exp_avg"] for s in worker.engine.optimizer.state.values() if "exp_avg" in s]


def test_another_runs_version_gives_its_weights_and_this_runs_learning_rate(version_of_run_a, capsys):
    """Run "b" at lr 2e-5 from run "a"'s version (trained at 1e-3): b's optimizer runs at 2e-5 with no
    moments (loading a's state put a's 1e-3 back and ignored training.lr), its weights are a's, and the
    log says why the state was left; run "a" resuming from the same version gets its moments and 1e-3."""
    from safetensors.torch import load_file

    from tasks.run.common import fetch_cached
    from tasks.actors.train import TrainWorker

    root, key = version_of_run_a
    cfg, spec = _spec(root, "b", lr=2e-5)
    b = TrainWorker.__ray_actor_class__(threads=1)
    assert b.load(spec, key, cfg.training, cfg.algorithm) == "loaded"
    assert [g["lr"] for g in b.engine.optimizer.param_groups] == [pytest.approx(2e-5)] * len(b.engine.optimizer.param_groups)
    assert _moments(b) == []
    assert "is another run's version" in capsys.readouterr().out
    published = load_file(os.path.join(fetch_cached(spec, key), "model.safetensors"))
    got = b.model.state_dict()
    assert all(torch.equal(got[name], w) for name, w in published.items())

    cfg_a, spec_a = _spec(root, "a", lr=1e-3)
    a = TrainWorker.__ray_actor_class__(threads=1)
    a.load(spec_a, key, cfg_a.training, cfg_a.algorithm)
    assert _moments(a) and all(m.abs().sum() > 0 for m in _moments(a))
    assert a.engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert "is another run's version" not in capsys.readouterr().out

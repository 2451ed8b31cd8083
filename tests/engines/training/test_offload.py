"""A training engine's state off the device between steps (engines/training/offload.py, placement.offload_train):
offloaded and reloaded, the optimizer state and weights come back bitwise and the next steps match an
engine that never offloaded, bit for bit; offloaded on CPU, the process's RSS drops. The Ray actors'
path is tests/tasks/stages/test_training_colocated_offload.py; the memory it saves, benchmarks/colocation_memory.py."""

from __future__ import annotations

import copy

import pytest
import torch

from engines.algorithms.config import AlgorithmConfig
from engines.models.host_memory import keep_freed_memory, release_allocator_caches
from engines.models.modeling import build_tiny_policy
from engines.training.offload import TrainStateOffload
from engines.training.update import TorchTrainEngine
from tests.support.engines import params_of, rl_batch

torch.set_num_threads(1)


def _step(engine, batch, seed):
    b, adv, old, ref = batch
    return engine.train_step(b, adv, old, ref, AlgorithmConfig(), mini_batch_size=4, max_tokens_per_micro_batch=64, seed=seed)


def _moments(engine) -> dict:
    return {(i, k): v.clone() for i, p in enumerate(engine.module.parameters())
            for k, v in engine.optimizer.state[p].items()}


@pytest.mark.parametrize("mode", ["optimizer", "all"])
def test_offload_and_reload_round_trip_bitwise_and_the_steps_match(tiny_policy, tmp_path, mode):
    from engines.training.offload import PARTS

    model, tok = tiny_policy
    batch = rl_batch(tok, model)
    plain, moved = TorchTrainEngine(copy.deepcopy(model), lr=1e-3), TorchTrainEngine(copy.deepcopy(model), lr=1e-3)
    offload = TrainStateOffload({"actor": moved}, str(tmp_path / "offload"))
    metrics = []
    for it in range(2):
        m_plain, m_moved = _step(plain, batch, it), _step(moved, batch, it)
        metrics.append((m_plain, m_moved))
        held, weights = _moments(moved), params_of(moved.model)
        n = offload.offload(PARTS[mode])
        assert n >= sum(t.numel() * t.element_size() for t in held.values())
        assert offload.offloaded == set(PARTS[mode])
        assert all(p.grad is None for p in moved.module.parameters())
        assert all(v.numel() == 0 for s in moved.optimizer.state.values() for v in s.values())
        if mode == "all":
            assert all(p.numel() == 0 for p in moved.module.parameters())
            with pytest.raises(RuntimeError):   # an offloaded engine cannot step by accident
                _step(moved, batch, 9)
        offload.reload()
        assert offload.offloaded == set() and not list((tmp_path / "offload").iterdir())
        after = _moments(moved)
        assert held.keys() == after.keys() and all(torch.equal(held[k], after[k]) for k in held)
        assert all(torch.equal(weights[k], v) for k, v in params_of(moved.model).items())
    diff = [(k, a[k], b[k]) for a, b in metrics for k in a if a[k] != b[k] and k != "training/tokens_per_s"]  # a timing
    assert all(a.keys() == b.keys() for a, b in metrics) and not diff, diff   # every metric, both iterations
    reference = params_of(plain.model)
    assert all(torch.equal(reference[k], v) for k, v in params_of(moved.model).items())
    assert moved.model.lm_head.weight.data_ptr() == moved.model.model.embed_tokens.weight.data_ptr()  # still tied


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_offload_on_cpu_hands_the_optimizer_memory_back(tmp_path):
    """RSS falls by at least half of the AdamW moments' bytes plus the gradients' (a 4-layer, 512-wide
    model: ~40 MB of float32 weights, so ~120 MB), in a process whose heap keeps freed memory, as an
    engine actor's does (engines/models/host_memory.py)."""
    keep_freed_memory()
    model, tok = build_tiny_policy(hidden_size=512, num_layers=4, num_heads=8, max_positions=128, seed=0)
    engine = TorchTrainEngine(model, lr=1e-3)
    _step(engine, rl_batch(tok, model), 0)
    optimizer_bytes = sum(v.numel() * v.element_size() for s in engine.optimizer.state.values() for v in s.values())
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    release_allocator_caches()   # the step's transient memory: not what this test measures
    before = _rss()
    offload = TrainStateOffload({"actor": engine}, str(tmp_path))
    offload.offload(("optimizer",))
    release_allocator_caches()
    after = _rss()
    assert before - after >= (optimizer_bytes + grad_bytes) / 2, (before, after, optimizer_bytes, grad_bytes)
    offload.reload()
    assert _rss() - after >= optimizer_bytes / 2   # back in memory


def test_train_and_reference_offload_that_cannot_take_effect_is_refused_naming_the_field(monkeypatch):
    from configs.schema import parse_config

    both = {"colocate": [["actor_train", "actor_infer", "reference"]]}
    with pytest.raises(ValueError, match=r"placement.offload_train='optimizer' needs actor_train and actor_infer in one "
                                         r"placement.colocate group"):
        parse_config({"placement": {"offload_train": "optimizer", "colocate": [["actor_train", "reference"]]}})
    with pytest.raises(ValueError, match=r"placement.offload_reference=true needs reference in a placement.colocate group"):
        parse_config({"placement": {"offload_reference": True, "colocate": [["actor_train", "actor_infer"]]}})
    with pytest.raises(ValueError, match=r"placement.offload_train='all' with training.strategy=fsdp2: offloading handles "
                                         r"one process's plain tensors"):
        parse_config({"placement": {**both, "offload_train": "all"}, "training": {"strategy": "fsdp2", "num_workers": 2}})
    on = parse_config({"placement": {**both, "offload_train": "all", "offload_reference": True}})
    assert (on.placement.offload_train, on.placement.offload_reference) == ("all", True)
    assert on.hash() == parse_config({"placement": both}).hash()   # changes no result: resumable either way
    monkeypatch.setenv("FLYROLL_RAY", "per-task")
    for field, value, shown in (("offload_train", "optimizer", "'optimizer'"), ("offload_reference", True, "True")):
        with pytest.raises(ValueError, match=rf"placement.{field}={shown} with FLYROLL_RAY=per-task and loop.fuse=1"):
            parse_config({"placement": {**both, field: value}})
        assert parse_config({"placement": {**both, field: value}, "loop": {"fuse": 2}}).loop.fuse == 2


_KILLED_CHILD = """
import sys, time, torch
from engines.models.modeling import build_tiny_policy
from engines.training.offload import TrainStateOffload
from engines.training.update import TorchTrainEngine
from tests.support.engines import rl_batch
from engines.algorithms.config import AlgorithmConfig
torch.set_num_threads(1)
model, tok = build_tiny_policy(hidden_size=256, num_layers=2, num_heads=4, max_positions=128, seed=0)
engine = TorchTrainEngine(model, lr=1e-3)
b, adv, old, ref = rl_batch(tok, model)
engine.train_step(b, adv, old, ref, AlgorithmConfig(), mini_batch_size=4, max_tokens_per_micro_batch=64, seed=0)
offload = TrainStateOffload({"actor": engine}, sys.argv[1])
print(offload.offload(("optimizer", "params")), flush=True)
time.sleep(600)
"""


def test_state_offloaded_by_a_killed_actor_leaves_no_file_behind(tmp_path):
    """The offloaded state lives in unnamed files: while away it is on disk (the process holds deleted
    files of its size) yet nothing is named in the folder, and a SIGKILLed process (ray.kill, the OOM
    killer) leaves the folder empty: before, each killed SmolLM2 actor left 1.6 GB in the temp dir."""
    import os
    import signal
    import subprocess
    import sys

    from tests.support.workflow import REPO

    folder = tmp_path / "offload"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(folder)], stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        moved = int(child.stdout.readline())
        assert moved > 1_000_000
        held = 0
        for fd in os.listdir(f"/proc/{child.pid}/fd"):
            target = os.readlink(f"/proc/{child.pid}/fd/{fd}")
            if target.startswith(str(folder)):
                held += os.stat(f"/proc/{child.pid}/fd/{fd}").st_size
        assert held >= moved, (held, moved)   # the state is in files of the folder ...
        assert list(folder.iterdir()) == []   # ... that have no name there
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert list(folder.iterdir()) == []

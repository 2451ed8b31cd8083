"""sync.method=live with the trainer and the generation engine on two different Ray nodes: a local
two-node cluster (`ray.cluster_utils.Cluster`, started and shut down by tests/support/multinode_sync.py
in a process of its own, so it never meets the Ray instance other tests share). The engine dials the
group's store at the trainer's node address and ends up with the trainer's weights bit for bit; a sync
over `sync.transport: shm` (one node only) is then refused naming both actors and their nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.workflow import REPO


@pytest.mark.slow
def test_live_sync_between_two_ray_nodes_gives_the_engine_the_trainers_weights(tmp_path, tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLYROLL_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "tests.support.multinode_sync", tiny_model_dir, str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    got = json.loads(lines[-1].removeprefix("RESULT "))
    print("multinode live sync timings:", got["times"])   # shown with pytest -s (docs/weight-sync.md)

    assert got["trainer_node"] != got["gen_node"]                       # really two nodes
    assert got["nodes"][got["trainer_node"]] == ["node_train"] and got["nodes"][got["gen_node"]] == ["node_infer"]
    assert got["store_addr"][0] == got["trainer_ip"]                    # dialled the trainer's node, not a fixed host
    assert got["report"]["version"] == 1 and got["report"]["engines"] == 1 and got["report"]["dtype"] == "float32"
    assert got["report"]["bytes"] > 0
    assert (got["key"], got["version"]) == ("runs/multinode/policy/v0001", 1)
    assert got["same_keys"] and got["dtypes"] == ["torch.float32"]
    assert got["bitwise_equal"] and got["moved"]                        # the new weights, not the ones it had
    assert got["shm_refused"] is not None and "sync.transport=shm needs the training actor and every generation actor on " \
        f"one Ray node, and they are on trainer on node {got['trainer_node']}, generation engine " \
        f"flyroll/multinode/generation/0 on node {got['gen_node']}" in got["shm_refused"]
    assert "policy v2" in got["shm_refused"]

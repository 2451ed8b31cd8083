"""A live weight sync across two Ray nodes, run in a process of its own (tests/tasks/loop/test_live_sync_multinode.py).

`python -m tests.support.multinode_sync <tiny model dir> <work dir>` starts a local two-node Ray
cluster (`ray.cluster_utils.Cluster`: the head with the custom resource `node_train`, one worker
node with `node_infer`, 1 CPU each), puts the training actor on the head and the generation actor on
the worker node, runs `tasks.loop.live_sync.live_sync` over gloo between them, and prints one JSON line
with what the test checks: each actor's node id, the address the group's store used, the sync's
report, the engine's key and version, whether its weights equal the trainer's bit for bit, and what
a second sync with `sync.transport: shm` (one node only) says.

Its own process because `Cluster` must not meet a `ray.init()` the pytest process already did (and
a test started after it must not join this cluster: see infra/ray_cluster.py `task_cluster`, whose
setup this repeats). The placement plan (infra/resources.py) has no way to pin a role to a node,
so the actors' `.options` name the nodes' custom resources directly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import ray
import torch


def _start_cluster(temp_dir: str):
    from infra.ray_cluster import start_local_cluster

    return start_local_cluster([{"num_cpus": 1, "resources": res, "object_store_memory": 256 << 20}
                                for res in ({"node_train": 1}, {"node_infer": 1})], temp_dir, log_to_driver=False)


def main(model_dir: str, work: str) -> dict:
    from configs.schema import parse_config
    from infra.ray_session import actor_pool
    from infra.resources import role_devices
    from infra.store import ArtifactStore
    from tests.support.policies import publish_two_versions
    from tasks.loop.live_sync import LiveSyncError, live_sync
    from tasks.run.types import RunSpec
    from tasks.actors.generation import GenerationWorker, generation_worker_kwargs
    from tasks.actors.train import TrainWorker

    root, run = os.path.join(work, "store"), "multinode"
    publish_two_versions(ArtifactStore(root), model_dir, work, run)
    cfg = parse_config({"run": {"torch_threads": 1}, "rollout": {"num_workers": 1},
                        "sync": {"method": "live", "bucket_mb": 1, "timeout_s": 30}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), run, root, "", "")
    temp_dir = tempfile.mkdtemp(prefix="flyroll-multinode-", dir=os.environ.get("RAY_TMPDIR") or "/tmp")
    t0 = time.perf_counter()
    cluster = _start_cluster(temp_dir)
    times = {"cluster_start_s": time.perf_counter() - t0}
    try:
        # the same names, kwargs and pools as tasks/actors/pools.py and tasks/stages/training.py, pinned to a node each;
        # live_sync() then finds these generation actors by name (get_if_exists)
        (gen,) = actor_pool(GenerationWorker, "generation", 1, run, generation_worker_kwargs(cfg),
                            {"num_cpus": 0, "resources": {"node_infer": 1}})
        (trainer,) = actor_pool(TrainWorker, "training", 1, run,
                                {"threads": cfg.run.torch_threads, "devices": role_devices(cfg, "actor_train", "critic")},
                                {"num_cpus": 0, "resources": {"node_train": 1}})
        ray.get(gen.load.remote(spec, f"runs/{run}/policy/v0000", 0))      # as after a rollout
        ray.get(trainer.load.remote(spec, f"runs/{run}/policy/v0001", cfg.training, cfg.algorithm))

        times["actors_ready_s"] = time.perf_counter() - t0 - times["cluster_start_s"]
        t1 = time.perf_counter()
        report = live_sync(spec, cfg, [trainer], 1, f"runs/{run}/policy/v0001")
        times["live_sync_s"] = time.perf_counter() - t1
        shm = parse_config({**json.loads(cfg.to_json()), "sync": {**cfg.sync.model_dump(), "transport": "shm"}})
        try:                                     # a same-node transport across the two nodes: refused, naming them
            live_sync(spec, shm, [trainer], 2, f"runs/{run}/policy/v0002")
            refused = None
        except LiveSyncError as e:
            refused = str(e)

        def node(w):
            return ray.get_runtime_context().get_node_id()

        sent = ray.get(trainer.__ray_call__.remote(lambda w: {k: v.clone() for k, v in w.model.state_dict().items()}))
        key, version, held = ray.get(gen.__ray_call__.remote(
            lambda w: (w.key, w.engine.version, {k: v.clone() for k, v in w.engine.model.state_dict().items()})))
        # the address the engine dialled for the group's store: the trainer's node (tasks/actors/train.py free_port)
        store_addr = ray.get(gen.__ray_call__.remote(lambda w: (w.sync.group._tcp.host, w.sync.group._tcp.port)))
        nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.startswith("node_")) for n in ray.nodes() if n["Alive"]}
        return {"trainer_node": ray.get(trainer.__ray_call__.remote(node)), "gen_node": ray.get(gen.__ray_call__.remote(node)),
                "nodes": nodes, "store_addr": list(store_addr), "trainer_ip": ray.get(trainer.__ray_call__.remote(
                    lambda w: ray.util.get_node_ip_address())),
                "report": report, "times": times, "shm_refused": refused, "key": key, "version": version,
                "same_keys": held.keys() == sent.keys(), "dtypes": sorted({str(v.dtype) for v in held.values()}),
                "bitwise_equal": all(torch.equal(held[k], sent[k]) for k in sent),
                "moved": any(not torch.equal(held[k], v) for k, v in _v0(model_dir).items())}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _v0(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2]), default=str), flush=True)

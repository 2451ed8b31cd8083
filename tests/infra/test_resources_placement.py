"""Every Ray actor a stage task can create fits the Ray cluster declared for that task.

On a cluster each stage task brings up its own Ray cluster (infra/ray_cluster.py `ray_job`, sized by infra/resources.py), and Ray
waits for ever for an actor whose CPUs/GPUs/memory no node of it has (DAPO's refills once created a
GPU generation actor inside the GPU-less scoring cluster). For each preset in configs/ (and a few
placements), under FLYROLL_PROFILE=gpu, compiled with FLYROLL_CONFIG=<preset> and without it, the
actors of each task (`task_actors`: its hosted roles x their worker counts, with their cluster
`.options`) must pack onto the nodes of its RayJobConfig. The DAPO preset is also compiled by
`pyflyte package` and checked from the task templates in the package.
"""

from __future__ import annotations

import json
import subprocess
import tarfile

import pytest
import yaml

from configs.schema import load_config
from infra.ray_cluster import ray_job
from tests.support.workflow import PYFLYTE, REPO, _env

PRESETS = sorted((REPO / "configs").glob("*.yaml"))
STAGES = ("rollout", "scoring", "reference", "training", "evaluation", "fused")
PLACEMENTS = {  # beyond the presets: pools of several workers with their own per-worker resources
    "dapo-placed": ("dapo.yaml", {"rollout": {"num_workers": 2}, "reward": {"num_workers": 3},
                                  "placement": {"actor_infer": {"cpu": 6, "gpu": 1, "memory": "40Gi"},
                                                "reward": {"cpu": 2, "memory": "4Gi"}}}),
    "two-gpu-engines": ("grpo.yaml", {"rollout": {"num_workers": 2}, "placement": {"actor_infer": {"cpu": 8, "gpu": 2}}}),
    "env-pool": ("frozenlake.yaml", {"env": {"workers": 4, "worker_cpus": 0.5}}),
}


def _gi(mem: str | None) -> float:
    if not mem:
        return 0.0
    units = {"Ki": 1 / 2**20, "Mi": 1 / 2**10, "Gi": 1.0, "Ti": 2**10}
    return float(mem[:-2]) * units[mem[-2:]] if mem[-2:] in units else float(mem) / 2**30


def _node(params: dict | None, cpu, gpu, mem) -> list[float]:
    """[cpu, gpu, memory Gi] a Ray node started in this pod offers (ray start params win)."""
    params = params or {}
    return [float(params.get("num-cpus") or cpu or 0), float(params.get("num-gpus") or gpu or 0), _gi(mem)]


def nodes_of_job(job) -> list[list[float]]:
    """The nodes of a RayJobConfig: the head pod and every replica of every worker group."""
    def pod(cfg):
        r = cfg.requests
        return _node(cfg.ray_start_params, r.cpu, r.gpu or (cfg.limits.gpu if cfg.limits else None), r.mem)

    nodes = [pod(job.head_node_config)]
    for group in job.worker_node_config:
        nodes += [pod(group) for _ in range(group.replicas)]
    return nodes


def nodes_of_template(custom: dict) -> list[list[float]]:
    """The same, from a compiled task template's Ray job (KubeRay spec)."""
    def pod(spec):
        req = spec["k8sPod"]["podSpec"]["containers"][0]["resources"]["requests"]
        return _node(spec.get("rayStartParams"), req.get("cpu"), req.get("nvidia.com/gpu"), req.get("memory"))

    cluster = custom["rayCluster"]
    nodes = [pod(cluster["headGroupSpec"])]
    for group in cluster.get("workerGroupSpec", []):
        nodes += [pod(group) for _ in range(int(group["replicas"]))]
    return nodes


def unplaced(actors: list[tuple[str, dict]], nodes: list[list[float]]) -> list[str]:
    """Actors first-fit (largest first) onto the nodes' free CPU/GPU/memory; those that find no room."""
    free = [list(n) for n in nodes]
    need = sorted(((o.get("num_gpus", 0), o.get("num_cpus", 1), o.get("memory", 0) / 2**30, role) for role, o in actors), reverse=True)
    missing = []
    for gpu, cpu, mem, role in need:
        node = next((n for n in free if n[0] >= cpu - 1e-9 and n[1] >= gpu - 1e-9 and n[2] >= mem - 1e-9), None)
        if node is None:
            missing.append(f"{role} (cpu {cpu:g}, gpu {gpu:g}, memory {mem:g}Gi) on nodes {nodes}")
            continue
        node[0], node[1], node[2] = node[0] - cpu, node[1] - gpu, node[2] - mem
    return missing


def _cases():
    for p in PRESETS:
        yield pytest.param(p, {}, id=p.stem)
    for name, (preset, extra) in PLACEMENTS.items():
        yield pytest.param(REPO / "configs" / preset, extra, id=name)


@pytest.mark.parametrize("packaged", [True, False], ids=["FLYROLL_CONFIG", "profile-only"])
@pytest.mark.parametrize("preset,extra", list(_cases()))
def test_every_actor_fits_the_cluster_of_its_task(monkeypatch, tmp_path, preset, extra, packaged):
    from infra import resources as r

    if packaged is False and extra:
        pytest.skip("a placement is compiled only through FLYROLL_CONFIG")
    raw = yaml.safe_load(preset.read_text())
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    path = tmp_path / preset.name
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("FLYROLL_PROFILE", "gpu")
    if packaged:
        monkeypatch.setenv("FLYROLL_CONFIG", str(path))
    else:
        monkeypatch.delenv("FLYROLL_CONFIG", raising=False)
    cfg = load_config(str(path))
    for stage in STAGES:
        actors = r.task_actors(cfg, stage)
        assert actors, stage
        assert unplaced(actors, nodes_of_job(ray_job(stage))) == [], stage


# compiled task -> the stage whose ray_job() its decorator uses (tasks/*.py `@task(task_config=ray_job(...))`)
COMPILED = {"tasks.stages.rollout.rollout": "rollout", "tasks.stages.scoring.score": "scoring", "tasks.stages.reference.reference_forward": "reference",
            "tasks.stages.training.train": "training", "tasks.stages.evaluation.evaluate": "evaluation",
            "tasks.stages.agentic.rollout_episodes": "rollout", "tasks.stages.agentic.score_episodes": "scoring",
            "tasks.stages.agentic.evaluate_episodes": "evaluation", "tasks.stages.fused.fused_iterations": "fused",
            "tasks.stages.post_training.post_train": "training", "tasks.stages.post_training.teacher_topk": "reference"}


def test_dapo_compiled_for_gpus_gives_every_actor_room(tmp_path, monkeypatch):
    """`pyflyte --pkgs workflows package` with FLYROLL_PROFILE=gpu FLYROLL_CONFIG=configs/dapo.yaml
    compiles, and every actor of each compiled Ray task fits the task's compiled Ray cluster."""
    from flyteidl.admin import task_pb2
    from google.protobuf.json_format import MessageToDict

    from infra import resources as r

    out = tmp_path / "flyte-package.tgz"
    env = {**_env(tmp_path), "FLYROLL_PROFILE": "gpu", "FLYROLL_CONFIG": str(REPO / "configs/dapo.yaml")}
    proc = subprocess.run([PYFLYTE, "--pkgs", "workflows", "package", "--image", "flyroll:test", "-f", "--output", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k in ("FLYROLL_PROFILE", "FLYROLL_CONFIG"):  # the actors' options, as the compiled tasks see them
        monkeypatch.setenv(k, env[k])
    cfg = load_config(env["FLYROLL_CONFIG"])
    checked = set()
    with tarfile.open(out) as tar:
        for n in tar.getnames():
            if not ("tasks." in n and n.endswith(".pb")):
                continue
            spec = task_pb2.TaskSpec()
            spec.ParseFromString(tar.extractfile(n).read())
            t = spec.template
            if t.type != "ray":
                continue
            name = n.split("_", 1)[1].rsplit("_", 1)[0]
            assert name in COMPILED, f"Ray task {name} is not mapped to a stage in this test"
            stage = COMPILED[name]
            custom = MessageToDict(t.custom)
            assert unplaced(r.task_actors(cfg, stage), nodes_of_template(custom)) == [], (name, json.dumps(custom)[:2000])
            checked.add(name)
    assert {"tasks.stages.rollout.rollout", "tasks.stages.scoring.score", "tasks.stages.training.train"} <= checked
    # the rollout task's cluster has the GPU its generation actor asks for, and room for the reward workers
    assert any(a[1].get("num_gpus") for a in r.task_actors(cfg, "rollout"))
    assert {role for role, _ in r.task_actors(cfg, "rollout")} == {"actor_infer", "reward"}


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_env_worker_pool_gets_cpus_of_its_own_in_the_agentic_clusters(monkeypatch, profile):
    """env.workers=4 x env.worker_cpus=0.5: the rollout and evaluation clusters (tasks/stages/agentic.py starts
    RayEnvPool in both) get one more pod of 2 CPUs and the 4 env actors; the other stages, and the same
    config with env.workers=0, are unchanged."""
    from infra import resources as r
    from infra.ray_cluster import node_shapes

    monkeypatch.setenv("FLYROLL_PROFILE", profile)
    preset = REPO / "configs" / "frozenlake.yaml"
    none, pool = load_config(preset, ["env.workers=0"]), load_config(preset, ["env.workers=4", "env.worker_cpus=0.5"])
    assert r.env_pool_cpus(none, "rollout") == 0 and r.env_pool_cpus(pool, "rollout") == 2
    assert r.env_pool_cpus(load_config(preset, ["env.workers=3", "env.worker_cpus=0.5"]), "rollout") == 2  # 1.5, rounded up
    for stage in ("rollout", "evaluation"):
        before, after = node_shapes(r.stage_ray_job(none, stage)), node_shapes(r.stage_ray_job(pool, stage))
        assert after == before + [(f"{stage}-env-workers-0", 2.0, 0.0)], (stage, before, after)
        env_actors = [o for role, o in r.task_actors(pool, stage) if role == "env"]
        assert env_actors == [{"num_cpus": 0.5, "memory": 512 * 2**20}] * 4   # env.worker_memory's default, 512Mi
        group = r.stage_ray_job(pool, stage).worker_node_config[-1]
        assert group.requests.mem == group.limits.mem == "3Gi"                 # 4 x 512Mi + 1Gi for Ray itself
        assert int(group.ray_start_params["memory"]) == 4 * 512 * 2**20
        assert len(r.task_actors(pool, stage)) == len(r.task_actors(none, stage)) + 4
        assert sum(c for _, c, _ in after) - sum(c for _, c, _ in before) == 2.0
        assert unplaced(r.task_actors(pool, stage), nodes_of_job(r.stage_ray_job(pool, stage))) == []
    for stage in ("scoring", "reference", "training"):
        assert node_shapes(r.stage_ray_job(pool, stage)) == node_shapes(r.stage_ray_job(none, stage)), stage
        assert r.task_actors(pool, stage) == r.task_actors(none, stage), stage


def test_env_worker_memory_sizes_the_actors_and_the_env_pod(monkeypatch):
    """env.worker_memory: each env actor's Ray memory reservation and the pod's memory (workers x it + 1Gi)."""
    from infra import resources as r

    monkeypatch.setenv("FLYROLL_PROFILE", "cpu")
    cfg = load_config(REPO / "configs" / "frozenlake.yaml", ["env.workers=3", "env.worker_cpus=0.5", "env.worker_memory=2Gi"])
    assert r.env_worker_memory_bytes(cfg) == 2 * 2**30 and r.env_pool_memory_gi(cfg, "rollout") == 7.0
    assert r.env_pool_memory_gi(cfg, "training") == 0.0
    group = r.stage_ray_job(cfg, "rollout").worker_node_config[-1]
    assert (group.group_name, group.requests.mem, group.limits.mem) == ("rollout-env-workers", "7Gi", "7Gi")
    assert [o["memory"] for role, o in r.task_actors(cfg, "rollout") if role == "env"] == [2 * 2**30] * 3
    assert unplaced(r.task_actors(cfg, "rollout"), nodes_of_job(r.stage_ray_job(cfg, "rollout"))) == []


def test_dpo_training_cluster_has_room_for_the_reference(monkeypatch):
    """A DPO run's training task computes the reference's log-probs of its pairs on the reference actor,
    in its own Ray cluster: that cluster is declared with room for both."""
    from infra import resources as r

    monkeypatch.setenv("FLYROLL_PROFILE", "gpu")
    dpo, rl = load_config(REPO / "configs/dpo_tiny.yaml"), load_config(REPO / "configs/tiny.yaml")
    assert {role for role, _ in r.task_actors(dpo, "training")} == {"actor_train", "reference"}
    assert {role for role, _ in r.task_actors(rl, "training")} == {"actor_train"}
    assert unplaced(r.task_actors(dpo, "training"), nodes_of_job(r.stage_ray_job(dpo, "training"))) == []

"""Training strategies (engines/training/strategies.py) agree with plain PyTorch, and the per-role placement
maps to Flyte resources, Ray clusters and actor options (infra/resources.py).

Equivalence: the same tiny Qwen2 policy, synthetic RL batch and seed, 3 optimizer steps; every
strategy runs 2 real processes in a gloo group and must give the one-process losses, gradient
norms, final weights and AdamW moments up to float summation order. DDP runs through the production
path too: TrainWorker Ray actors joined by tasks/stages/training.py `train_workers`, their checkpoint
files compared with a one-worker run.
"""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path

import pytest
import torch

from configs.schema import ConfigError, parse_config
from tests.support.training import _scored_table

REPO = Path(__file__).resolve().parents[3]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "DeepSpeed is not installed: pip install -e '.[deepspeed]'"


# --- the data-parallel bookkeeping -------------------------------------------------------------

def test_shards_cover_the_mini_batch_once():
    from engines.training.strategies import shard

    mini = [7, 3, 9, 1, 4]
    shards = [shard(mini, r, 2) for r in range(2)]
    assert shards == [[7, 9, 4], [3, 1]]
    assert sorted(shards[0] + shards[1]) == sorted(mini)
    assert shard([5], 1, 2) == []  # a mini-batch smaller than the group leaves a rank empty


def test_micro_batches_pad_to_the_busiest_rank_with_zero_weight():
    from engines.training.strategies import micro_batches

    splits = [[[0, 2], [4]], [[1]], []]  # rank 0: two micro-batches, rank 1: one, rank 2: none
    assert micro_batches(splits, 0, [0]) == [([0, 2], 1.0), ([4], 1.0)]
    assert micro_batches(splits, 1, [0]) == [([1], 1.0), ([0], 0.0)]
    assert micro_batches(splits, 2, [0]) == [([0], 0.0), ([0], 0.0)]


def test_single_process_strategy_is_the_plain_engine(tiny_policy):
    """strategy=None and strategy='torch' give bit-identical updates (the default path is unchanged)."""
    import copy

    from engines.algorithms.config import AlgorithmConfig
    from engines.training.strategies import make_strategy
    from engines.training.update import TorchTrainEngine
    from tests.support.strategy_ranks import synthetic_batch

    base, tok = tiny_policy
    batch, adv, old, ref = synthetic_batch(tok, base)
    out = []
    for strategy in (None, make_strategy("torch")):
        model = copy.deepcopy(base)
        m = TorchTrainEngine(model, lr=1e-2, strategy=strategy).train_step(
            batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=4, max_tokens_per_micro_batch=30)
        out.append((m, model.state_dict()))
    assert out[0][0]["actor/pg_loss"] == out[1][0]["actor/pg_loss"]
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


# --- equivalence across strategies (2 processes, gloo) ---------------------------------------------

@pytest.fixture(scope="module")
def torch_run():
    from tests.support.strategy_ranks import run_strategy

    from engines.models.modeling import build_tiny_policy

    run = run_strategy("torch", steps=3)
    init = build_tiny_policy(32, 2, 2, seed=0)[0].state_dict()
    assert all(not torch.equal(init[k], w) for k, w in run["weights"].items())  # every tensor trained
    return run


def _assert_same_run(ref: dict, got: dict, loss_tol: float = 1e-6, weight_tol: float = 1e-4) -> None:
    assert got["losses"] == pytest.approx(ref["losses"], abs=loss_tol, rel=1e-5)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert set(got["weights"]) == set(ref["weights"])
    for k, w in ref["weights"].items():
        assert torch.allclose(got["weights"][k], w, atol=weight_tol), k
    so, go = ref["optimizer"]["state"], got["optimizer"]["state"]
    assert set(go) == set(so)  # the portable layout: ids in model.parameters() order
    for i in so:
        assert float(go[i]["step"]) == float(so[i]["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(go[i][key], so[i][key], atol=1e-6, rtol=1e-4), (i, key)


@pytest.mark.slow
def test_ddp_matches_torch_with_uneven_shards():
    """7 rows in mini-batches of 3: shards of 2/1 rows and a last mini-batch of 1 row, so one rank
    trains on nothing there and runs only zero-weighted padding."""
    from tests.support.strategy_ranks import run_strategy

    ref = run_strategy("torch", steps=1, rows=7, mini_batch_size=3, max_tokens=20)
    got = run_strategy("ddp", steps=1, rows=7, mini_batch_size=3, max_tokens=20)
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6)
    for k, w in ref["weights"].items():
        assert torch.allclose(got["weights"][k], w, atol=1e-4), k


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    "ddp",
    "fsdp2",
    pytest.param("deepspeed_zero2", marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)),
    pytest.param("deepspeed_zero3", marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)),
])
def test_first_steps_agree_with_torch(torch_run, strategy, tmp_path):
    """3 steps, with a checkpoint + resume into fresh processes' state after step 2 (weights gathered
    to rank 0, optimizer state in the portable layout, loaded back into a fresh engine)."""
    from tests.support.strategy_ranks import run_strategy

    from safetensors.torch import load_file

    got = run_strategy(strategy, world=2, steps=3, resume_at=2, resume_dir=str(tmp_path))
    _assert_same_run(torch_run, got)
    # the wrappers hook the gradients autograd hands them: no backward writes .grad itself there
    assert torch_run["tied_embedding_in_place"] and not got["tied_embedding_in_place"]
    # the checkpoint rank 0 wrote is the one-process format: the tied lm_head is not saved twice
    assert set(load_file(str(tmp_path / "ckpt" / "model.safetensors"))) == set(torch_run["weights"]) - {"lm_head.weight"}


# --- DDP through the production path: TrainWorker Ray actors ---------------------------------------

@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import ray

    cache = tmp_path_factory.mktemp("fetch-cache")
    ray.init(num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "FLYROLL_CACHE_DIR": str(cache)}})
    yield
    ray.shutdown()


def _train_in_process(cfg, spec, key: str, table, iterations: int):
    """The one-worker reference: TrainWorker's own class, in this process."""
    from tasks.actors.train import TrainWorker

    worker = TrainWorker.__ray_actor_class__(threads=1)
    tcfg, acfg = cfg.training, cfg.algorithm
    out = []
    for it in range(1, iterations + 1):
        worker.load(spec, key, tcfg, acfg)
        out.append(worker.step(table, acfg, tcfg, 1.0, it, f"runs/x/policy/v{it:04d}"))
        key = f"runs/x/policy/v{it:04d}"
    return out


def _train_with_workers(cfg, spec, key: str, table, iterations: int):
    import ray

    from infra.ray_session import kill_pool
    from tasks.actors.hybrid import train_workers

    workers = train_workers(cfg, spec.run_id)
    try:
        tcfg, acfg = cfg.training, cfg.algorithm
        out = []
        for it in range(1, iterations + 1):
            ray.get([w.load.remote(spec, key, tcfg, acfg) for w in workers])
            results = ray.get([w.step.remote(ray.put(table), acfg, tcfg, 1.0, it, f"runs/x/policy/v{it:04d}") for w in workers])
            assert all(files == {} for _, files in results[1:])  # only rank 0 writes the checkpoint
            out.append(results[0])
            key = f"runs/x/policy/v{it:04d}"
        return out
    finally:
        kill_pool("training", len(workers), spec.run_id)


def test_ddp_train_workers_on_ray_match_one_worker(ray_cluster, tiny_policy, tmp_path, monkeypatch):
    """PPO with GAE (actor and critic both under DDP). 15 rows in mini-batches of 7 (7, 7, 1): uneven
    shards, and in the last mini-batch rank 1 has no row and runs only zero-weighted padding."""
    from safetensors.torch import load as load_safetensors

    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec

    model, tok = tiny_policy
    from engines.models.modeling import save_policy

    src = save_policy(model, tok, str(tmp_path / "base"))
    ArtifactStore(str(tmp_path / "store")).publish(src, "models/base", kind="checkpoint", producer="test")
    table = _scored_table(model, tok)
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    runs = {}
    for strategy, workers in (("torch", 1), ("ddp", 2)):
        cfg = parse_config({"run": {"torch_threads": 1}, "algorithm": {"advantage": "gae"},
                            "training": {"strategy": strategy, "num_workers": workers, "mini_batch_size": 7,
                                         "max_tokens_per_micro_batch": 40, "lr": 1e-2}})
        spec = RunSpec(cfg.to_json(), cfg.hash(), f"strat-{strategy}-{os.getpid()}", str(tmp_path / "store"), "", "")
        run = _train_in_process if strategy == "torch" else _train_with_workers
        runs[strategy] = run(cfg, spec, "models/base", table, iterations=2)
    for (m1, f1), (m2, f2) in zip(runs["torch"], runs["ddp"]):
        # the loss terms and the norm are exact sums over ranks; rate metrics (clipfrac) are row-weighted
        # means of micro-batch means, so they move with the micro-batch partition, as in one process
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
        assert m2["actor/updates"] == m1["actor/updates"] == 3.0
        assert set(f2) == set(f1)  # the same checkpoint files: safetensors + tokenizer + config + trainer state
        for name in ("model.safetensors", "critic/model.safetensors"):
            w1, w2 = load_safetensors(f1[name]), load_safetensors(f2[name])
            assert set(w1) == set(w2)
            for k in w1:
                assert torch.allclose(w1[k], w2[k], atol=1e-4), (name, k)
        s1, s2 = (torch.load(io.BytesIO(f["trainer_state.pt"]), weights_only=True) for f in (f1, f2))
        assert s1["scheduler"] == s2["scheduler"] and set(s1["optimizer"]["state"]) == set(s2["optimizer"]["state"])
        assert set(s1["critic"]["optimizer"]["state"]) == set(s2["critic"]["optimizer"]["state"])


def test_train_worker_writes_the_checkpoint_itself_on_the_callers_node(ray_cluster, tiny_policy, tmp_path, monkeypatch):
    """tasks/stages/training.py passes (its node id, a folder): a rank 0 on that node, or on another Ray
    node of the same machine (it sees the folder), saves the checkpoint into the folder and returns
    no bytes; on another machine (another node, no such folder) the bytes come back. Same files,
    same bytes (three fresh workers, same data and seed)."""
    import ray
    from safetensors.torch import load as load_safetensors

    from engines.models.modeling import save_policy
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec
    from tasks.actors.train import TrainWorker

    model, tok = tiny_policy
    ArtifactStore(str(tmp_path / "store")).publish(save_policy(model, tok, str(tmp_path / "base")), "models/base",
                                                   kind="checkpoint", producer="test")
    table = _scored_table(model, tok)
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = parse_config({"run": {"torch_threads": 1}, "training": {"mini_batch_size": 15, "max_tokens_per_micro_batch": 40}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), f"direct-{os.getpid()}", str(tmp_path / "store"), "", "")
    tcfg, acfg = cfg.training, cfg.algorithm
    here = ray.get_runtime_context().get_node_id()
    got = {}
    for where, node, shared_fs in (("here", here, True), ("same-machine", "another-node", True),
                                   ("elsewhere", "another-node", False)):
        worker = TrainWorker.__ray_actor_class__(threads=1)
        worker.load(spec, "models/base", tcfg, acfg)
        folder = tmp_path / where
        if shared_fs:  # the caller made it; on another machine the worker does not see it
            folder.mkdir()
        metrics, files = worker.step(table, acfg, tcfg, 1.0, 1, "runs/x/policy/v0001", True, (node, str(folder)))
        written = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()} \
            if folder.is_dir() else {}
        got[where] = (metrics, files, written)
    (m1, f1, w1), (m2, f2, w2), (m3, f3, w3) = got["here"], got["elsewhere"], got["same-machine"]
    assert f1 == {} and w2 == {} and f3 == {}  # written here / returned from elsewhere, never both
    assert set(w3) == set(w1)
    assert "training/checkpoint_write_s" in m1 and "training/checkpoint_write_s" not in m2
    assert set(w1) == set(f2) and {"model.safetensors", "trainer_state.pt", "config.json"} <= set(w1)
    a, b = load_safetensors(w1["model.safetensors"]), load_safetensors(f2["model.safetensors"])
    c = load_safetensors(w3["model.safetensors"])
    assert set(a) == set(b) == set(c) and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert m1["actor/pg_loss"] == m2["actor/pg_loss"] == m3["actor/pg_loss"] and m1["actor/updates"] == 1.0


# --- config and placement ------------------------------------------------------------------------

def test_strategy_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="training.num_workers=2: strategy 'torch' is one process"):
        parse_config({"training": {"num_workers": 2}})
    with pytest.raises(ConfigError, match="training.strategy"):
        parse_config({"training": {"strategy": "horovod"}})
    with pytest.raises(ConfigError, match="critic trains inside the actor_train workers"):
        parse_config({"placement": {"colocate": [["actor_train"], ["critic", "reference"]]}})
    with pytest.raises(ConfigError, match="role 'reward' is in group 0 and group 1"):
        parse_config({"placement": {"colocate": [["reward", "actor_infer"], ["reward"]]}})
    with pytest.raises(ConfigError, match="placement.actor_train.memory"):
        parse_config({"placement": {"actor_train": {"memory": "12GB"}}})


def test_zero_optimization_entries_are_checked_at_load_naming_the_entry():
    """training.zero_optimization: refused with a strategy that is not DeepSpeed, refused for `stage` (the
    strategy names it), and every name and value checked against DeepSpeed's own config model, so a
    misspelt entry is an error at load, not a setting DeepSpeed never reads."""
    with pytest.raises(ConfigError, match=r"training.zero_optimization=\{'reduce_bucket_size': 1000\} is for the deepspeed "
                                          r"strategies; training.strategy is 'fsdp2'"):
        parse_config({"training": {"strategy": "fsdp2", "num_workers": 2, "zero_optimization": {"reduce_bucket_size": 1000}}})
    if not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    ds = {"strategy": "deepspeed_zero3", "num_workers": 2}
    with pytest.raises(ConfigError, match="training.zero_optimization.stage: the ZeRO stage comes from training.strategy"):
        parse_config({"training": {**ds, "zero_optimization": {"stage": 2}}})
    with pytest.raises(ConfigError, match=r"training.zero_optimization.stage3_param_persistence_threshol: Extra inputs are "
                                          r"not permitted \(got 0\)"):
        parse_config({"training": {**ds, "zero_optimization": {"stage3_param_persistence_threshol": 0}}})
    with pytest.raises(ConfigError, match=r"training.zero_optimization.reduce_bucket_size: .* \(got -5\)"):
        parse_config({"training": {**ds, "zero_optimization": {"reduce_bucket_size": -5}}})
    cfg = parse_config({"training": {**ds, "zero_optimization": {"stage3_param_persistence_threshold": 0}}})
    assert cfg.training.zero_optimization == {"stage3_param_persistence_threshold": 0}
    assert cfg.hash() != parse_config({"training": ds}).hash()


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_default_placement_keeps_the_profile(monkeypatch, profile):
    from infra import resources as r
    from infra.ray_cluster import ray_job

    monkeypatch.setenv("FLYROLL_PROFILE", profile)
    cfg = parse_config({})
    for role, (task, _) in r.HOSTS.items():
        assert r.task_resources_for(cfg, task) == r.task_resources(task)
        assert r.ray_job_for(cfg, task) == ray_job(task)
        for local in (True, False):
            assert r.actor_options_for(cfg, role, local) == r.actor_options(task, local)
    plan = r.placement_plan(cfg)
    assert (plan["actor_train"].engine, plan["actor_train"].num_workers) == ("torch", 1)
    assert (plan["critic"].engine, plan["critic"].num_workers) == ("none", 0)  # grpo has no critic


def test_placement_sizes_the_training_cluster_per_worker():
    from flytekit import Resources

    from infra import resources as r

    cfg = parse_config({"training": {"strategy": "fsdp2", "num_workers": 4},
                        "placement": {"actor_train": {"cpu": 8, "gpu": 1, "memory": "48Gi"}}})
    kw = r.task_resources_for(cfg, "training")
    assert kw["requests"] == kw["limits"] == Resources(cpu="8", mem="48Gi", gpu="1")
    assert kw["accelerator"] is not None
    job = r.ray_job_for(cfg, "training")
    assert job.head_node_config.requests == kw["requests"]  # the head pod hosts rank 0
    (group,) = job.worker_node_config
    assert group.replicas == 3 and group.requests == kw["requests"]
    assert group.ray_start_params == {"num-cpus": "8", "num-gpus": "1"}
    assert r.actor_options_for(cfg, "actor_train", local=False) == {"num_cpus": 8.0, "num_gpus": 1.0}
    assert r.actor_options_for(cfg, "actor_train", local=True) == {"num_cpus": 0, "num_gpus": 1.0}
    # the rollout stage is untouched
    assert r.task_resources_for(cfg, "rollout") == r.task_resources("rollout")


def test_critic_adds_to_the_training_worker():
    from flytekit import Resources

    from infra import resources as r

    cfg = parse_config({"algorithm": {"advantage": "gae"}, "training": {"strategy": "ddp", "num_workers": 2},
                        "placement": {"actor_train": {"cpu": 4, "gpu": 1, "memory": "16Gi"},
                                      "critic": {"cpu": 2, "memory": "8Gi"}}})
    plan = r.placement_plan(cfg)
    assert (plan["critic"].engine, plan["critic"].num_workers) == ("ddp", 2)
    assert r.task_resources_for(cfg, "training")["requests"] == Resources(cpu="6", mem="24Gi", gpu="1")
    # a pod never gets less than the profile's (2 CPUs, 6Gi on cpu): room for the task's own process
    small = parse_config({"placement": {"actor_train": {"gpu": 1}}})
    assert r.task_resources_for(small, "training")["requests"] == Resources(cpu="2", mem="6Gi", gpu="1")


def test_colocated_roles_share_devices_separate_ones_do_not():
    from infra import resources as r

    both = {"actor_train": {"gpu": 1}, "actor_infer": {"gpu": 1}}
    shared = parse_config({"placement": {**both, "colocate": [["actor_train", "actor_infer"]]}})
    apart = parse_config({"placement": both})
    # one local Ray instance hosts every stage's actors: colocated roles split each GPU
    assert r.actor_options_for(shared, "actor_train", local=True)["num_gpus"] == 0.5
    assert r.actor_options_for(shared, "actor_infer", local=True)["num_gpus"] == 0.5
    assert r.actor_options_for(apart, "actor_train", local=True)["num_gpus"] == 1.0
    assert r.actor_options_for(apart, "actor_infer", local=True)["num_gpus"] == 1.0
    # on a cluster each stage has its own Ray cluster, so a role of another stage takes no share
    assert r.actor_options_for(shared, "actor_train", local=False)["num_gpus"] == 1.0
    # the critic always rides with actor_train: no split between them
    gae = parse_config({"algorithm": {"advantage": "gae"}, "placement": {"actor_train": {"gpu": 1},
                                                                         "colocate": [["actor_train", "reference"]]}})
    assert r.placement_plan(gae)["critic"].group == ("actor_train", "reference", "critic")
    assert r.actor_options_for(gae, "actor_train", local=True)["num_gpus"] == 0.5  # shared with reference only


def test_packaged_config_compiles_placement_into_task_resources(monkeypatch, tmp_path):
    from flytekit import Resources

    from infra import resources as r
    from infra.ray_cluster import ray_job

    path = tmp_path / "p.yaml"
    path.write_text("training: {strategy: ddp, num_workers: 2}\nplacement: {actor_train: {cpu: 3, memory: 7Gi}}\n")
    monkeypatch.setenv("FLYROLL_CONFIG", str(path))
    assert r.task_resources("training")["requests"] == Resources(cpu="3", mem="7Gi")
    assert ray_job("training").worker_node_config[0].replicas == 1
    assert r.task_resources("weight_sync") == r._profile_task_resources("weight_sync")  # hosts no role


# --- end to end: the workflow through `pyflyte run` with DDP over 2 TrainWorker actors --------------

@pytest.mark.slow
def test_pyflyte_run_trains_with_ddp_on_two_workers(tmp_path):
    from safetensors.torch import load_file

    from infra.store import ArtifactStore
    from tests.support.workflow import _config, _mlflow, _pyflyte_run

    config = _config(tmp_path, training={"strategy": "ddp", "num_workers": 2})
    proc = _pyflyte_run(tmp_path, "--config", str(config))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    store = ArtifactStore(str(tmp_path / "runs" / "store"))
    policies = [k for k in store.list("runs") if "/policy/" in k]
    assert [k.rsplit("/", 1)[-1] for k in policies] == ["v0001", "v0002"]
    base = store.manifest(policies[0]).parents[0]
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt"} <= set(store.manifest(policies[1]).files)
    a = load_file(f"{store.fetch(base, str(tmp_path / 'a'))}/model.safetensors")
    b = load_file(f"{store.fetch(policies[1], str(tmp_path / 'b'))}/model.safetensors")
    assert a.keys() == b.keys() and sum(not torch.equal(a[k], b[k]) for k in a) >= len(a) // 2
    c, run = _mlflow(tmp_path)
    assert [m.value for m in c.get_metric_history(run.info.run_id, "training/workers")] == [2.0, 2.0]
    assert run.data.params["training.strategy"] == "ddp"

"""placement.hybrid (tasks/actors/hybrid.py): actor_train, actor_infer and the reference of one colocate
group in one process per training worker, and the in-process live sync (engines/weight_sync/update_group.py
`copy_in_process`): engine layer (plain and FSDP2-sharded trainers, 2 gloo ranks), the Ray actors
(the same samples as separate actors, one process), and the config checks."""

from __future__ import annotations

import copy

import pytest
import ray
import torch
import torch.multiprocessing as mp

from engines.generation.engine import HFGenerationEngine, SamplingParams
from engines.models.modeling import build_tiny_policy
from engines.weight_sync.gather import copy_in_process
from tests.support.policies import publish_two_versions
from tests.support.workflow import REPO
from tests.support.sync import TINY, WAIT, digests, free_port, moved_tiny_digests, release

# -- engine layer ------------------------------------------------------------------------------


def test_copy_in_process_fills_the_engine_bitwise_or_to_bf16_rounding_and_refuses_a_mismatch_untouched():
    trainer, tok = build_tiny_policy(**TINY, seed=0)
    engine = HFGenerationEngine(build_tiny_policy(**TINY, seed=3)[0], tok)
    report = copy_in_process(trainer.state_dict().items(), engine, 4)
    assert (report.version, report.transport, engine.version) == (4, "in_process", 4)
    assert digests(engine.model) == digests(trainer)
    assert report.bytes == sum(t.numel() * 4 for t in trainer.state_dict().values())
    half = HFGenerationEngine(build_tiny_policy(**TINY, seed=3)[0].to(torch.bfloat16), tok)
    copy_in_process(trainer.state_dict().items(), half, 5)
    assert digests(half.model, torch.bfloat16) == digests(trainer, torch.bfloat16)
    before = digests(engine.model)
    other, _ = build_tiny_policy(**{**TINY, "hidden_size": 48}, seed=1)
    with pytest.raises(ValueError, match=r"weights in the trainer's weights of policy v6 do not match the engine's model"):
        copy_in_process(other.state_dict().items(), engine, 6)
    assert digests(engine.model) == before and engine.version == 4     # checked before the first copy


def sharded_hybrid_rank(rank, dist_port, q, leave):
    """Training rank `rank` of 2, FSDP2 over gloo, with its own fp32 engine (other weights): both ranks
    copy at once, each parameter gathered on both (a collective), and report their engine's digests
    and the trainer's full state dict's (rank 0 holds it)."""
    try:
        from engines.training.strategies import init_distributed, make_strategy
        from tests.support.training import is_half

        torch.set_num_threads(1)
        init_distributed(rank, 2, "127.0.0.1", dist_port, backend="gloo")
        strategy = make_strategy("fsdp2")
        model, tok = build_tiny_policy(**TINY, seed=0)
        strategy.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), 1.0)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(-0.5)
        engine = HFGenerationEngine(build_tiny_policy(**TINY, seed=10 + rank)[0], tok)
        report = copy_in_process(model.named_parameters(), engine, 7)
        full = strategy.full_state_dict()
        q.put((rank, all(is_half(p) for p in model.parameters()), digests(engine.model),
               digests(full), engine.version, report.gathered_peak_bytes))
    except BaseException as e:  # reported at once, not after the test's wait
        q.put((rank, None, f"crashed: {type(e).__name__}: {e}", None, None, None))
        raise
    finally:
        leave.wait(WAIT)


def test_every_rank_of_a_sharded_trainer_fills_its_own_engine_in_process():
    ctx = mp.get_context("spawn")   # as tests/engines/weight_sync/test_update_group.py: no fork of a worker that ran Ray
    q, leave, port = ctx.Queue(), ctx.Event(), free_port()
    procs = [ctx.Process(target=sharded_hybrid_rank, args=(r, port, q, leave), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {r[0]: r for r in (q.get(timeout=WAIT) for _ in procs)}
        want = moved_tiny_digests()
        for rank in (0, 1):
            _, sharded, engine, full, served, peak = got[rank]
            assert sharded is True, got[rank]                      # really sharded
            assert served == 7 and peak > 0
            assert engine == want                                  # bitwise, on both ranks
        assert got[0][3] == got[0][2]                              # = the trainer's full state dict (rank 0's)
    finally:
        release(procs, leave)


# -- the Ray actors ----------------------------------------------------------------------------


def _samples(spec, cfg, run: str) -> tuple[list, dict]:
    """Samples of v0, of v1 after a live sync, and of v0 again after a load from the store, with the
    generation engines asleep (weights freed) between; and which process hosts which role."""
    from tasks.loop.live_sync import live_sync
    from tasks.actors.pools import generate_sharded, generation_pool
    from tasks.actors.hybrid import train_workers
    from tasks.run.types import PolicyRef

    v0, v1 = f"runs/{run}/policy/v0000", f"runs/{run}/policy/v0001"
    params = SamplingParams(n=2, max_new_tokens=6, seed=1, temperature=1.0)

    def sample(gens):
        ids = ray.get(gens[0].encode.remote(["1+2=", "rev abc=", "9-3+4-1=", "7+1="], False))
        return [[(c.token_ids, c.logprobs) for c in done] for _, done in generate_sharded(gens, ids, params)]

    def pid(view):
        return ray.get(getattr(view, "handle", view).__ray_call__.remote(lambda w: __import__("os").getpid()))

    gens = generation_pool(spec, PolicyRef(key=v0, version=0))
    out = [sample(gens)]
    ray.get([g.sleep.remote(2, "placement.offload_generation=weights") for g in gens])
    (trainer,) = train_workers(cfg, run)
    ray.get(trainer.load.remote(spec, v1, cfg.training, cfg.algorithm))
    report = live_sync(spec, cfg, [trainer], 1, v1)
    assert report["version"] == 1
    out.append(sample(generation_pool(spec, PolicyRef(key=v1, version=1))))   # served already: nothing loaded
    ray.get([g.sleep.remote(2, "placement.offload_generation=weights") for g in gens])
    out.append(sample(generation_pool(spec, PolicyRef(key=v0, version=0))))   # the store path fills them
    return out, {"generation": pid(gens[0]), "training": pid(trainer), "transport": report["transport"]}


@pytest.mark.slow
def test_a_hybrid_worker_samples_what_separate_actors_do_in_one_process(tmp_path, monkeypatch, tiny_model_dir):
    from configs.schema import parse_config
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec

    root = str(tmp_path / "store")
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))  # the actors inherit the driver's env
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        results = {}
        for run, hybrid in (("apart", False), ("hybrid", True)):
            publish_two_versions(ArtifactStore(root), tiny_model_dir, tmp_path / run, run)
            cfg = parse_config({"run": {"torch_threads": 1}, "rollout": {"num_workers": 1}, "sync": {"method": "live"},
                                "placement": {"colocate": [["actor_train", "actor_infer"]], "offload_generation": "weights",
                                              "hybrid": hybrid}})
            results[run] = _samples(RunSpec(cfg.to_json(), cfg.hash(), run, root, "", ""), cfg, run)
        hosted = ray.get(ray.get_actor("flyroll/hybrid/hybrid/0", namespace="flyroll").hosted.remote())
    finally:
        ray.shutdown()
    (apart, where_apart), (hybrid, where_hybrid) = results["apart"], results["hybrid"]
    assert hybrid == apart                         # tokens and log-probs, every sampling
    assert apart[0] == apart[2] != apart[1]        # v0 again after the reload; v1 samples differently
    assert where_apart["generation"] != where_apart["training"] and where_apart["transport"] == "broadcast"
    assert where_hybrid["generation"] == where_hybrid["training"] and where_hybrid["transport"] == "in_process"
    assert hosted["roles"] == ["actor_infer", "actor_train"] and hosted["pid"] == where_hybrid["training"]


# -- the config --------------------------------------------------------------------------------


def test_hybrid_that_cannot_take_effect_is_refused_naming_the_field(monkeypatch):
    from configs.schema import parse_config

    both = {"colocate": [["actor_train", "actor_infer", "reference"]], "hybrid": True}
    on = parse_config({"placement": both})
    from tasks.actors.hybrid import hybrid_roles, part_kwargs

    assert hybrid_roles(on) == ("actor_train", "actor_infer", "reference") and set(part_kwargs(on)) == set(hybrid_roles(on))
    assert hybrid_roles(parse_config({"placement": {**both, "hybrid": False}})) == ()
    assert on.hash() == parse_config({"placement": {**both, "hybrid": False}}).hash()   # changes no result: resumable either way
    refused = [
        ({"placement": {"hybrid": True, "colocate": [["actor_train", "reference"]]}},
         r"placement.hybrid=true needs actor_train and actor_infer in one placement.colocate group"),
        ({"placement": both, "rollout": {"num_workers": 2}},
         r"placement.hybrid=true with rollout.num_workers=2 and training.num_workers=1"),
        ({"placement": both, "sync": {"method": "live", "bucket_mb": 8, "transport": "shm"}},
         r"so sync.bucket_mb, sync.transport would do nothing"),
    ]
    for config, message in refused:
        with pytest.raises(ValueError, match=message):
            parse_config(config)
    from configs.hand_off import hybrid_check

    vllm = on.model_copy(update={"rollout": on.rollout.model_copy(update={"engine": "vllm"})})  # (no vllm needed here)
    with pytest.raises(ValueError, match=r"placement.hybrid=true with rollout.engine=vllm: a hybrid worker hosts the hf"):
        hybrid_check(vllm)
    live = parse_config({"placement": both, "sync": {"method": "live"}})
    assert parse_config(live.model_dump()).sync.method == "live"     # a round trip (every field given) is not refused
    monkeypatch.setenv("FLYROLL_RAY", "per-task")
    with pytest.raises(ValueError, match=r"placement.hybrid=true with FLYROLL_RAY=per-task and loop.fuse=1"):
        parse_config({"placement": both})
    assert parse_config({"placement": both, "loop": {"fuse": 2}}).placement.hybrid


def test_a_role_view_calls_the_roles_method_in_its_concurrency_group():
    from tasks.actors.hybrid import RoleView

    class Handle:  # records what a view asks of the actor
        _actor_id = "a1"

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return type("M", (), {"remote": lambda _, *a, **k: (name, a, k)})()

    gen = RoleView(Handle(), "actor_infer")
    assert gen.generate.remote([[1]], "params", request_id="r") == ("call", ("actor_infer", "generate", [[1]], "params"),
                                                                   {"request_id": "r"})
    assert gen.abort.remote("r")[0] == "call_abort" and gen.stream_collect.remote(0.1)[0] == "call_stream"
    with pytest.raises(AttributeError, match="GenerationWorker has no method 'step'"):
        gen.step
    assert copy.deepcopy(gen) == gen and RoleView(gen.handle, "actor_train") != gen
    with pytest.raises(ValueError, match="not 'critic'"):
        RoleView(Handle(), "critic")


# -- the workflow ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hybrid_run_ends_with_the_weights_and_metrics_of_the_run_with_separate_actors(e2e_run, tmp_path):
    """tests/configs/e2e.yaml through `pyflyte run` with the three roles in one hybrid worker, live
    sync in process and the colocation offloads, against the session's run of the same config with one
    actor per role and the store hand-off, from the same starting weights: the same metrics and the same
    final weights, bit for bit."""
    from safetensors.torch import load_file

    from infra.store import ArtifactStore
    from tests.support.compare import assert_bitwise_equal
    from tests.support.workflow import _config, _mlflow, _pyflyte_run

    # the session run's starting policy, imported: the bootstrap's pre-training is not bitwise the same from
    # run to run (2 of 6 e2e runs under pytest started from other weights), and this compares the runs after it
    apart = ArtifactStore(str(e2e_run[0] / "runs" / "store"))
    (start,) = [k for k in apart.list("models") if k.endswith("/v0000")]
    config = _config(tmp_path, model={"path": apart.fetch(start, str(tmp_path / "start"))}, sync={"method": "live"},
                     placement={"colocate": [["actor_train", "actor_infer", "reference"]], "hybrid": True,
                                "offload_generation": "weights", "offload_reference": True})
    proc = _pyflyte_run(tmp_path, "--config", str(config))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]

    def final(tmp):
        store = ArtifactStore(str(tmp / "runs" / "store"))
        key = sorted(k for k in store.list("runs") if "/policy/v" in k)[-1]
        return key.rsplit("/", 1)[-1], load_file(f"{store.fetch(key, str(tmp / ('final-' + tmp.name)))}/model.safetensors")

    (v_apart, w_apart), (v_hybrid, w_hybrid) = final(e2e_run[0]), final(tmp_path)
    assert v_hybrid == v_apart == "v0002"
    assert_bitwise_equal(w_hybrid, w_apart, "final weights")
    (c_apart, r_apart), (c_hybrid, r_hybrid) = _mlflow(e2e_run[0]), _mlflow(tmp_path)

    def history(c, run, key):
        return [(m.step, m.value) for m in sorted(c.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    assert history(c_hybrid, r_hybrid, "weight_sync/live_in_process") == [(1, 1.0), (2, 1.0)]
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "reference/kl_k3", "reward/mean", "eval/reward"):
        assert history(c_hybrid, r_hybrid, key) == history(c_apart, r_apart, key) != [], key


HYBRID_CASES = {  # workflow, entry point, config, --set items of both runs
    "ddp-2-ranks": ("workflows/rlvr.py", "rlvr", "e2e.yaml",
                    ["training.strategy=ddp", "training.num_workers=2", "rollout.num_workers=2"]),
    "agentic": ("workflows/agentic.py", "agentic", "agentic_e2e.yaml", []),
}


@pytest.mark.nightly
@pytest.mark.parametrize("case", sorted(HYBRID_CASES))
def test_hybrid_workers_log_what_separate_actors_log(case, tmp_path):
    """Two hybrid workers over a DDP group (each rank fills its own engine), and the agentic workflow:
    `pyflyte run` with separate actors, then with placement.hybrid from the first run's starting
    weights; every metric but the sync's own is the same, iteration by iteration."""
    import json
    import subprocess

    import yaml
    from mlflow.tracking import MlflowClient

    from infra.store import ArtifactStore
    from tests.support.workflow import PYFLYTE, _env

    workflow, entry, config, sets = HYBRID_CASES[case]
    sets = [*sets, "sync.method=live", 'placement.colocate=[["actor_train","actor_infer","reference"]]']

    def run(tmp, extra):
        tmp.mkdir()
        cfg = yaml.safe_load((REPO / "tests/configs" / config).read_text())
        cfg["run"]["output_dir"] = str(tmp / "runs")
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
        proc = subprocess.run([PYFLYTE, "run", str(REPO / workflow), entry, "--config", str(tmp / "config.yaml"),
                               "--set", json.dumps(sets + extra)], cwd=tmp, env=_env(tmp), capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
        c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
        (r,) = [r for r in c.search_runs([c.get_experiment_by_name("flyroll").experiment_id])
                if "mlflow.parentRunId" not in r.data.tags]
        keys = [k for k in r.data.metrics if not k.startswith(("timing/", "weight_sync/live")) and not k.endswith(("_s", "_per_s"))]
        return {k: [(m.step, m.value) for m in sorted(c.get_metric_history(r.info.run_id, k), key=lambda m: m.step)]
                for k in keys}, c.get_metric_history(r.info.run_id, "weight_sync/live_in_process")

    apart, in_process = run(tmp_path / "apart", [])
    assert [m.value for m in in_process] == [0.0, 0.0]
    store = ArtifactStore(str(tmp_path / "apart" / "runs" / "store"))
    (start,) = [k for k in store.list("models") if k.endswith("/v0000")]   # (the bootstrap is not bitwise reproducible)
    hybrid, in_process = run(tmp_path / "hybrid", ["placement.hybrid=true", f"model.path={store.fetch(start, str(tmp_path / 'start'))}"])
    assert [m.value for m in in_process] == [1.0, 1.0]
    assert hybrid.keys() == apart.keys() and len(apart) > 30
    assert {k: v for k, v in hybrid.items() if v != apart[k]} == {}

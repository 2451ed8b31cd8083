"""Per-role device and dtype (config `placement.<role>.device` / `.dtype`, engines/models/devices.py), on CPU:
'auto' resolution under each FLYROLL_PROFILE, refusal of a CUDA role without a GPU request, and the
bf16 paths the GPU runs use, exercised on CPU (the same code): a bf16 mixed-precision actor update
against the float32 one, bf16 reference log-probs (float32 out), bf16 generation fed float32 weights.

Tolerances, measured on the tiny Qwen2 (2-layer 32-wide and 64-wide, seeds 0-2; SGD lr 0.5, one
mini-batch): bf16 vs float32 pg_loss differed by <= 1.5e-3 relative, grad norm by <= 1.1e-3
relative, the parameter updates' cosine similarity was >= 0.999995. The tests allow 1e-2 relative
and cosine > 0.999, several times the measured gaps and far below what a wrong update gives."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from configs.schema import ConfigError, parse_config
from engines.algorithms.config import AlgorithmConfig

torch.set_num_threads(1)

ROLES = ("actor_train", "actor_infer", "reference", "critic", "reward")


# --- config: resolution and refusal ---------------------------------------------------------------

def _resolved(cfg) -> dict[str, tuple[str, str]]:
    from infra.resources import role_devices

    return role_devices(cfg, *ROLES)


def test_auto_is_cpu_float32_under_the_cpu_profile(monkeypatch):
    monkeypatch.delenv("FLYROLL_PROFILE", raising=False)
    assert _resolved(parse_config({})) == {r: ("cpu", "float32") for r in ROLES}


def test_auto_is_cuda_bfloat16_under_the_gpu_profile(monkeypatch):
    """No CUDA needed: the config resolves from the roles' GPU requests. The reward workers request
    no GPU on the gpu profile, so they stay on CPU; the critic follows the actor_train workers."""
    monkeypatch.setenv("FLYROLL_PROFILE", "gpu")
    got = _resolved(parse_config({"algorithm": {"advantage": "gae"}}))
    assert got == {"actor_train": ("cuda", "bfloat16"), "actor_infer": ("cuda", "bfloat16"), "reference": ("cuda", "bfloat16"),
                   "critic": ("cuda", "bfloat16"), "reward": ("cpu", "float32")}


def test_auto_follows_a_placement_gpu_request_and_explicit_values_win(monkeypatch):
    monkeypatch.delenv("FLYROLL_PROFILE", raising=False)
    cfg = parse_config({"placement": {"actor_train": {"gpu": 1}, "actor_infer": {"dtype": "bfloat16"},
                                      "reference": {"device": "cpu", "dtype": "float16"}}})
    got = _resolved(cfg)
    assert got["actor_train"] == got["critic"] == ("cuda", "bfloat16")
    assert got["actor_infer"] == ("cpu", "bfloat16") and got["reference"] == ("cpu", "float16")
    assert got["reward"] == ("cpu", "float32")


def _checked(data: dict):
    """`data` parsed, then its placement checked as every run's entry point does before any cluster
    (infra/resources.py check_placement)."""
    from infra.resources import check_placement

    cfg = parse_config(data)
    check_placement(cfg)
    return cfg


@pytest.mark.parametrize("role", ROLES)
def test_cuda_without_a_gpu_request_is_refused_naming_the_role(monkeypatch, role):
    monkeypatch.delenv("FLYROLL_PROFILE", raising=False)
    with pytest.raises(ConfigError) as e:
        _checked({"placement": {role: {"device": "cuda"}}})
    msg = str(e.value)
    fix = "actor_train" if role == "critic" else role  # the critic rides in the actor_train workers
    assert f"placement.{role}.device='cuda'" in msg and f"role '{role}'" in msg
    assert f"placement.{fix}.gpu" in msg and "FLYROLL_PROFILE=gpu" in msg


def test_cuda_with_a_gpu_request_is_accepted(monkeypatch):
    monkeypatch.delenv("FLYROLL_PROFILE", raising=False)
    _checked({"placement": {"actor_train": {"device": "cuda", "gpu": 1}, "critic": {"device": "cuda"}}})
    monkeypatch.setenv("FLYROLL_PROFILE", "gpu")
    _checked({"placement": {"actor_infer": {"device": "cuda"}}})
    with pytest.raises(ConfigError, match=r"placement.reward.device='cuda' but role 'reward' requests no GPU under FLYROLL_PROFILE=gpu"):
        _checked({"placement": {"reward": {"device": "cuda"}}})


def test_the_run_entry_points_refuse_a_cuda_role_without_a_gpu_before_any_cluster(monkeypatch, tmp_path):
    """The schema alone accepts it (configs/ knows no profile); the first task of every workflow
    (tasks/stages/prepare.py prepare_run), `pyflyte package` with FLYROLL_CONFIG and `flyroll eval --config`
    refuse it before anything starts."""
    from infra import eval_cli, resources
    from tasks.stages.prepare import prepare_run

    monkeypatch.delenv("FLYROLL_PROFILE", raising=False)
    path = tmp_path / "cuda.yaml"
    path.write_text("placement:\n  reference:\n    device: cuda\n")
    parse_config({"placement": {"reference": {"device": "cuda"}}})  # no error: compute is not config
    expected = r"placement.reference.device='cuda' but role 'reference' requests no GPU under FLYROLL_PROFILE=cpu"
    with pytest.raises(ConfigError, match=expected):
        prepare_run.task_function(config=str(path), restart=False)
    monkeypatch.setenv("FLYROLL_CONFIG", str(path))
    with pytest.raises(ConfigError, match=expected):
        resources.task_resources("reference")
    monkeypatch.delenv("FLYROLL_CONFIG")
    with pytest.raises(eval_cli.EvalError, match=expected):
        eval_cli.load_eval_config(str(path))


@pytest.mark.parametrize("role", ["actor_train", "critic"])
def test_float16_training_is_refused(role):
    with pytest.raises(ConfigError, match=f"placement.{role}.dtype='float16'.*loss scaling"):
        parse_config({"placement": {role: {"dtype": "float16"}}})


def test_device_settings_leave_the_task_resources_alone(monkeypatch):
    """device/dtype choose where the models live, not what the pods request."""
    from infra.resources import actor_options_for, ray_job_for, task_resources_for

    monkeypatch.delenv("FLYROLL_PROFILE", raising=False)
    plain = parse_config({})
    placed = parse_config({"placement": {r: {"device": "cpu", "dtype": "bfloat16"} for r in ("actor_train", "actor_infer", "reference")}})
    for task in ("training", "rollout", "reference"):
        assert task_resources_for(placed, task) == task_resources_for(plain, task)
        assert ray_job_for(placed, task) == ray_job_for(plain, task)
    for r in ROLES:
        assert actor_options_for(placed, r, local=False) == actor_options_for(plain, r, local=False)


def test_a_missing_cuda_device_fails_naming_the_role():
    from engines.models.devices import torch_device

    if torch.cuda.is_available():
        pytest.skip("this process has a CUDA device")
    with pytest.raises(RuntimeError, match=r"placement.reference.device resolved to 'cuda'.*placement.reference.gpu"):
        torch_device("cuda", "reference")


# --- bf16 on CPU: the update, the log-probs, generation --------------------------------------------

def _sgd(engine, model):
    """Plain SGD (updates linear in the gradient: Adam's first step ~lr*sign(g) would hide differences)."""
    engine.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    return engine


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_actor_update_matches_float32_within_tolerance(tiny_policy, seed):
    from engines.training.update import TorchTrainEngine
    from tests.support.engines import rl_batch

    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base, seed=seed)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(base)
        engine = _sgd(TorchTrainEngine(model, compute_dtype=dtype), model)
        m = engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64)
        delta = torch.cat([(p.detach() - q.detach()).flatten() for p, q in zip(model.parameters(), base.parameters())])
        assert all(p.dtype == torch.float32 for p in model.parameters())  # float32 master weights
        runs[dtype] = (m, delta)
    (m32, d32), (m16, d16) = runs[torch.float32], runs[torch.bfloat16]
    assert not torch.equal(d32, d16)  # bf16 compute really ran (float32 twice would be bitwise equal)
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m16[k] == pytest.approx(m32[k], rel=1e-2), k
    assert float(torch.nn.functional.cosine_similarity(d32, d16, dim=0)) > 0.999


def test_bf16_training_keeps_float32_adamw_state(tiny_policy):
    from engines.training.update import TorchTrainEngine
    from tests.support.engines import rl_batch

    model = copy.deepcopy(tiny_policy[0])
    batch, adv, old, ref = rl_batch(tiny_policy[1], model)
    engine = TorchTrainEngine(model, lr=1e-3, compute_dtype=torch.bfloat16)
    engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64)
    moments = [v for s in engine.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(v.dtype == torch.float32 for v in moments)
    assert engine.autocast_dtype == torch.bfloat16


@pytest.fixture
def published(tiny_policy, tmp_path, monkeypatch):
    """(spec, key, model dir) of the tiny policy published in a local artifact store."""
    from engines.models.modeling import save_policy
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec

    model, tok = tiny_policy
    src = save_policy(model, tok, str(tmp_path / "base"))
    ArtifactStore(str(tmp_path / "store")).publish(src, "models/base", kind="checkpoint", producer="test")
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = parse_config({"run": {"torch_threads": 1}, "training": {"mini_batch_size": 15, "max_tokens_per_micro_batch": 64}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), f"devices-{os.getpid()}", str(tmp_path / "store"), "", "")
    return cfg, spec, "models/base", src


def test_train_worker_in_bf16_trains_float32_weights_close_to_float32(tiny_policy, published):
    """TrainWorker (the actor tasks/stages/training.py runs) with devices {actor_train: (cpu, bfloat16)}:
    same update as float32 within the module's tolerances, and a float32 checkpoint."""
    from safetensors.torch import load as load_safetensors

    from tasks.actors.train import TrainWorker
    from tests.support.training import _scored_table

    cfg, spec, key, _ = published
    table = _scored_table(*tiny_policy)
    tcfg, acfg = cfg.training, cfg.algorithm
    got = {}
    for dtype in ("float32", "bfloat16"):
        worker = TrainWorker.__ray_actor_class__(threads=1, devices={"actor_train": ("cpu", dtype), "critic": ("cpu", dtype)})
        worker.load(spec, key, tcfg, acfg)
        assert worker.engine.autocast_dtype == (None if dtype == "float32" else torch.bfloat16)
        got[dtype] = worker.step(table, acfg, tcfg, 1.0, 1, "runs/x/policy/v0001")
    (m32, f32), (m16, f16) = got["float32"], got["bfloat16"]
    assert m16["actor/pg_loss"] == pytest.approx(m32["actor/pg_loss"], rel=1e-2)
    w32, w16 = load_safetensors(f32["model.safetensors"]), load_safetensors(f16["model.safetensors"])
    assert all(w.dtype == torch.float32 for w in w16.values())
    assert any(not torch.equal(w32[k], w16[k]) for k in w32)  # bf16 compute changed the update a little


def test_reference_worker_in_bf16_gives_float32_logprobs(tiny_policy, published):
    """ReferenceWorker with devices {reference: (cpu, bfloat16)}: its model is cast to bf16, the
    log-probs come back float32 (from bf16 logits) and within 0.02 nats of the float32 worker's
    (measured: 1.6e-3 at most on this batch)."""
    from engines.models.batching import batched_logprobs, collate
    from engines.data.rollout_table import batch_from_table
    from tasks.actors.reference import ReferenceWorker
    from tests.support.training import _scored_table

    _, spec, key, _ = published
    table = _scored_table(*tiny_policy)
    prompts, responses = [list(p) for p in table["prompt_token_ids"]], [list(r) for r in table["response_token_ids"]]
    got = {}
    for dtype in ("float32", "bfloat16"):
        worker = ReferenceWorker.__ray_actor_class__(threads=1, devices={"reference": ("cpu", dtype)})
        worker.load("reference", spec, key)
        model = worker.models["reference"][1]
        assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
        got[dtype] = worker.logprobs("reference", batch_from_table(table, worker.pad_id()), micro_batch=4)
        batch = collate(prompts, responses, worker.pad_id())
        assert batched_logprobs(model, batch).dtype == torch.float32
    for a, b in zip(got["float32"], got["bfloat16"]):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 0.02
    assert got["float32"] != got["bfloat16"]



def test_reference_logprobs_are_taken_at_the_sampling_temperature(tiny_policy, published):
    """At rollout.temperature 0.7 the reference stage's π_old and π_ref are log-softmax(logits / 0.7), as the
    update's π_θ and the engine's behaviour log-probs are: at equal weights they agree (the PPO ratio
    starts at 1, the KL at 0). Before, they were taken at temperature 1."""
    import pandas as pd

    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.data.rollout_table import batch_from_table
    from tasks.actors.reference import ReferenceWorker

    model, tok = tiny_policy
    _, spec, key, _ = published
    prompts = [tok.encode(p) for p in ("12+7=", "3*4=", "rev abc=")]
    out = HFGenerationEngine(model, tok).generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=8, seed=3))
    table = pd.DataFrame({"prompt_token_ids": [prompts[c.prompt_index] for c in out],
                          "response_token_ids": [c.token_ids for c in out]})
    worker = ReferenceWorker.__ray_actor_class__(threads=1)
    worker.load("reference", spec, key)
    batch = batch_from_table(table, worker.pad_id())
    at_07, at_1 = worker.logprobs("reference", batch, 4, temperature=0.7), worker.logprobs("reference", batch, 4)
    gap = max(abs(a - b) for c, row in zip(out, at_07) for a, b in zip(c.logprobs, row))
    assert all(len(c.logprobs) == len(row) for c, row in zip(out, at_07)) and gap < 1e-4, gap
    assert max(abs(a - b) for c, row in zip(out, at_1) for a, b in zip(c.logprobs, row)) > 0.05


def test_reference_metrics_count_only_the_policys_tokens():
    """`reference/kl_k3` and `reference/behaviour_logprob_diff` are over the tokens the loss sees: an
    agentic row's environment tokens (loss_mask 0, behaviour log-prob 0.0 by convention) left out; a row
    without `loss_mask` (RLVR) counts every response token."""
    import math

    import pandas as pd

    from tasks.stages.reference import logprob_metrics

    behaviour = [[-1.0, -2.0, 0.0, 0.0, -0.5], [-0.3, 0.0]]
    old = [[-1.0, -2.0, -6.0, -4.0, -0.5], [-0.3, -9.0]]        # the policy forward scores the observations too
    ref = [[-1.0, -2.0, -6.0, -4.0, -0.7], [-0.3, -9.0]]        # one action token differs by 0.2
    agentic = pd.DataFrame({"behaviour_logprobs": behaviour, "loss_mask": [[1, 1, 0, 0, 1], [1, 0]]})
    m = logprob_metrics(agentic, ref, old, policy_forward=True)
    assert m["reference/kl_k3"] == pytest.approx((math.exp(-0.2) + 0.2 - 1) / 4)
    assert m["reference/behaviour_logprob_diff"] == 0.0
    assert "reference/behaviour_logprob_diff" not in logprob_metrics(agentic, ref, old, policy_forward=False)
    rlvr = pd.DataFrame({"behaviour_logprobs": [[-1.0, -2.5]]})
    m = logprob_metrics(rlvr, [[-1.0, -2.0]], [[-1.0, -2.0]], policy_forward=True)
    assert m == {"reference/kl_k3": 0.0, "reference/behaviour_logprob_diff": 0.5}
    nothing = pd.DataFrame({"behaviour_logprobs": [[0.0]], "loss_mask": [[0]]})
    assert logprob_metrics(nothing, [[-3.0]], [[-3.0]], policy_forward=True) == {}

def test_generation_worker_in_bf16_generates_and_takes_float32_weights(tiny_policy, published, tmp_path):
    """GenerationWorker with devices {actor_infer: (cpu, bfloat16)}: bf16 weights, valid tokens and
    float32 log-probs; an in-place update from a float32 checkpoint (the weight-sync path) casts."""
    from engines.generation.engine import SamplingParams
    from engines.models.modeling import save_policy
    from tasks.actors.generation import GenerationWorker

    _, _, _, src = published
    worker = GenerationWorker.__ray_actor_class__(threads=1, devices={"actor_infer": ("cpu", "bfloat16")})
    engine, tok = worker._build(src)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    prompts = [tok("12+3=", add_special_tokens=False)["input_ids"], tok("abc", add_special_tokens=False)["input_ids"]]
    out = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=0))
    assert len(out) == 6
    for c in out:
        assert c.token_ids and all(0 <= t < len(tok) for t in c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) and all(x <= 0.0 and x == x for x in c.logprobs)

    trained = copy.deepcopy(tiny_policy[0])
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    engine.load_weights(save_policy(trained, tiny_policy[1], str(tmp_path / "v1")))  # float32 on disk
    own = dict(engine.model.named_parameters())
    for name, p in trained.named_parameters():
        assert own[name].dtype == torch.bfloat16 and torch.equal(own[name], p.detach().to(torch.bfloat16)), name


def test_resolve_device_is_pure_and_infra_uses_it():
    """Role placement lives in engines/models/devices.py (no flytekit: a GPU box can print it); 'auto'
    follows the worker's GPUs, an explicit value is kept."""
    from engines.models.devices import resolve_device

    assert resolve_device("auto", "auto", 1.0) == ("cuda", "bfloat16")
    assert resolve_device("auto", "auto", 0.5) == ("cuda", "bfloat16")
    assert resolve_device("auto", "auto", 0.0) == ("cpu", "float32")
    assert resolve_device("cpu", "bfloat16", 1.0) == ("cpu", "bfloat16")
    assert resolve_device("cuda", "auto", 0.0) == ("cuda", "bfloat16")
    from infra import resources

    assert resources.resolve_device is resolve_device

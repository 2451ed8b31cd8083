"""LoRA for the actor (engines/training/lora.py, config `training.lora`) and gradient checkpointing
(`training.gradient_checkpointing`) on the tiny char-level Qwen2: only the adapters train, the base
stays bitwise frozen, the published checkpoint is the plain merged model, resume is exact."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from pydantic import ValidationError

from configs.schema import FlyrollConfig
from engines.algorithms.config import AlgorithmConfig
from engines.models.batching import response_logprobs
from engines.training.lora import DEFAULT_TARGETS, plain_model
from engines.models.modeling import load_policy, save_policy
from engines.training.update import TorchTrainEngine
from tests.support.engines import params_of, rl_batch

torch.set_num_threads(1)

LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": DEFAULT_TARGETS}
SIZES = dict(mini_batch_size=4, max_tokens_per_micro_batch=64)


def lora_engine(base, lr: float = 1e-2, **kw) -> TorchTrainEngine:
    torch.manual_seed(0)  # the adapters' A init
    return TorchTrainEngine(copy.deepcopy(base), lr=lr, lora=LORA, **kw)


def frozen_and_adapters(engine) -> tuple[dict, dict]:
    """(plain-named base weights as they sit in the wrapped model, adapter parameters)."""
    named = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    frozen = {n.replace("base_model.model.", "").replace(".base_layer.", "."): t
              for n, t in named.items() if ".lora_" not in n}
    return frozen, {n: t for n, t in named.items() if ".lora_" in n}


def test_lora_trains_only_the_adapters_and_keeps_the_base_bitwise(tiny_policy):
    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    engine = lora_engine(base)
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == set(DEFAULT_TARGETS)
    _, adapters0 = frozen_and_adapters(engine)
    for _ in range(2):
        engine.train_step(batch, adv, old, ref, AlgorithmConfig(), **SIZES)
    frozen, adapters = frozen_and_adapters(engine)
    want = params_of(base)
    assert set(frozen) == set(want)
    for k in want:  # the base: bitwise the starting policy
        assert torch.equal(frozen[k], want[k]), k
    assert all(not torch.equal(adapters[k], adapters0[k]) for k in adapters if ".lora_B." in k)
    # AdamW over the adapters only
    group = engine.optimizer.param_groups[0]["params"]
    assert len(group) == len(trainable) and len(engine.optimizer.state) == len(trainable)
    # the reference = the frozen base: log-probs with the adapters disabled equal the base model's exactly
    engine.model.eval()
    with torch.no_grad():
        want_lp, _ = response_logprobs(base, batch)
        with engine.model.disable_adapter():
            got_lp, _ = response_logprobs(engine.model, batch)
        trained_lp, _ = response_logprobs(engine.model, batch)
    assert torch.equal(got_lp, want_lp)
    assert not torch.allclose(trained_lp, want_lp, atol=1e-4)  # the adapters do change the policy


def test_published_checkpoint_is_the_plain_merged_model(tiny_policy, tmp_path):
    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    engine = lora_engine(base)
    engine.train_step(batch, adv, old, ref, AlgorithmConfig(), **SIZES)
    weights = engine.checkpoint_state_dict()
    assert set(weights) == set(base.state_dict())  # Hugging Face names: no base_layer / lora_ keys
    save_policy(plain_model(engine.model), tok, str(tmp_path), state_dict=weights)
    merged, _ = load_policy(str(tmp_path))
    assert type(merged) is type(base) and set(params_of(merged)) == set(params_of(base))
    engine.model.eval()
    with torch.no_grad():
        want = engine.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        got = merged.eval()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # and it moved away from the base (the delta is in it)
    moved = params_of(merged)["model.layers.0.self_attn.q_proj.weight"] - params_of(base)["model.layers.0.self_attn.q_proj.weight"]
    assert float(moved.abs().max()) > 1e-4
    # the wrapped model still trains on its unmerged base afterwards
    frozen, _ = frozen_and_adapters(engine)
    assert torch.equal(frozen["model.layers.0.self_attn.q_proj.weight"], params_of(base)["model.layers.0.self_attn.q_proj.weight"])


def test_a_lora_update_raises_the_policy_gradient_objective_like_a_full_one(tiny_policy):
    """Advantages +1 on every token: the update raises the responses' log-probs, with LoRA as with
    full fine-tuning."""
    base, tok = tiny_policy
    batch, _, old, ref = rl_batch(tok, base)
    adv = batch.response_mask.float()
    cfg = AlgorithmConfig(kl_coef=0.0)
    with torch.no_grad():
        start = float((response_logprobs(base, batch)[0] * batch.response_mask).sum())
    gains = {}
    for name, engine in (("lora", lora_engine(base)), ("full", TorchTrainEngine(copy.deepcopy(base), lr=1e-3))):
        for _ in range(3):
            engine.train_step(batch, adv, None, ref, cfg, **SIZES)
        engine.model.eval()
        with torch.no_grad():
            gains[name] = float((response_logprobs(engine.model, batch)[0] * batch.response_mask).sum()) - start
    assert gains["lora"] > 1.0 and gains["full"] > 1.0, gains


def test_resume_restores_adapters_and_optimizer_exactly(tiny_policy):
    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    first = lora_engine(base)
    first.train_step(batch, adv, old, ref, AlgorithmConfig(), seed=1, **SIZES)
    state = copy.deepcopy(first.state_dict())
    assert "lora_adapter" in state and set(state["lora_adapter"]) == {n for n, p in first.model.named_parameters() if p.requires_grad}
    first.train_step(batch, adv, old, ref, AlgorithmConfig(), seed=2, **SIZES)

    torch.manual_seed(123)  # another A init: the loaded state must overwrite it
    resumed = TorchTrainEngine(copy.deepcopy(base), lr=1e-2, lora=LORA)
    resumed.load_state_dict(state)
    resumed.train_step(batch, adv, old, ref, AlgorithmConfig(), seed=2, **SIZES)
    want, got = frozen_and_adapters(first)[1], frozen_and_adapters(resumed)[1]
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for a, b in zip(first.optimizer.state.values(), resumed.optimizer.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_gradient_checkpointing_gives_the_same_update(tiny_policy):
    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    runs = {}
    for ckpt in (False, True):
        engine = TorchTrainEngine(copy.deepcopy(base), lr=1e-3, gradient_checkpointing=ckpt)
        m = engine.train_step(batch, adv, old, ref, AlgorithmConfig(), **SIZES)
        runs[ckpt] = (params_of(engine.model), m, engine)
    assert runs[True][2].model.is_activation_checkpointing and not runs[True][2].shared_prefix
    for k, v in runs[False][0].items():
        torch.testing.assert_close(runs[True][0][k], v, atol=1e-5, rtol=0, msg=k)
    assert runs[True][1]["actor/pg_loss"] == pytest.approx(runs[False][1]["actor/pg_loss"], abs=1e-6)


@pytest.mark.parametrize("lora, field", [({"rank": -1}, "training.lora.rank"), ({"rank": 8, "alpha": 0}, "training.lora.alpha"),
                                         ({"rank": 8, "dropout": 1.0}, "training.lora.dropout"),
                                         ({"rank": 8, "target_modules": []}, "training.lora.target_modules")])
def test_config_refuses_bad_lora_values(lora, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        FlyrollConfig.model_validate({"training": {"lora": lora}})


def test_config_refuses_lora_with_a_sharded_strategy():
    with pytest.raises(ValidationError, match=r"training\.lora\.rank=8 is built for strategies 'torch' and 'ddp'"):
        FlyrollConfig.model_validate({"training": {"lora": {"rank": 8}, "strategy": "fsdp2", "num_workers": 2}})
    assert FlyrollConfig.model_validate({"training": {"lora": {"rank": 8}, "gradient_checkpointing": True}}).training.lora.rank == 8


def test_unknown_target_module_is_refused_naming_the_field(tiny_policy):
    with pytest.raises(ValueError, match=r"training\.lora\.target_modules: \['qkv_proj'\] name no Linear module of Qwen2ForCausalLM"):
        TorchTrainEngine(copy.deepcopy(tiny_policy[0]), lora={**LORA, "target_modules": ("q_proj", "qkv_proj")})


def test_train_worker_publishes_a_merged_checkpoint_and_resumes_on_the_frozen_base(tiny_policy, tmp_path, monkeypatch):
    """TrainWorker (what tasks/stages/training.py runs) with training.lora.rank 8: the checkpoint's weights
    are the plain merged model and its trainer state holds the adapters, their AdamW state and the
    base's key; a fresh worker loading that checkpoint (a resume) rebuilds base + adapters and takes
    the next step bitwise like the worker that kept them in memory."""
    import os

    from safetensors.torch import load as load_safetensors

    from configs.schema import parse_config
    from infra.store import ArtifactStore
    from tasks.run.types import RunSpec
    from tasks.actors.train import TrainWorker
    from tests.support.training import _scored_table, publish_step

    model, tok = tiny_policy
    store = ArtifactStore(str(tmp_path / "store"))
    store.publish(save_policy(model, tok, str(tmp_path / "base")), "models/base", kind="checkpoint", producer="test")
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = parse_config({"run": {"torch_threads": 1}, "training": {"mini_batch_size": 8, "max_tokens_per_micro_batch": 64,
                                                                  "lr": 1e-2, "lora": {"rank": 8}}})
    spec = RunSpec(cfg.to_json(), cfg.hash(), f"lora-{os.getpid()}", str(tmp_path / "store"), "", "")
    tcfg, acfg = cfg.training, cfg.algorithm
    table = _scored_table(model, tok)

    torch.manual_seed(0)
    live = TrainWorker.__ray_actor_class__(threads=1)
    live.load(spec, "models/base", tcfg, acfg)
    _, files = live.step(table, acfg, tcfg, 1.0, 1, f"runs/{spec.run_id}/policy/v0001")
    weights = load_safetensors(files["model.safetensors"])
    assert not any("lora" in k or "base_layer" in k for k in weights) and not any("adapter" in f for f in files)
    state = torch.load(io.BytesIO(files["trainer_state.pt"]), weights_only=True)
    assert state["lora_base"] == "models/base" and state["lora_adapter"]
    assert len(state["optimizer"]["state"]) == len(state["lora_adapter"])  # AdamW state for the adapters only
    publish_step(store, files, tmp_path / "v0001", f"runs/{spec.run_id}/policy/v0001")

    torch.manual_seed(99)  # another adapter init: the checkpoint's must replace it
    resumed = TrainWorker.__ray_actor_class__(threads=1)
    resumed.load(spec, f"runs/{spec.run_id}/policy/v0001", tcfg, acfg)
    assert live.load(spec, f"runs/{spec.run_id}/policy/v0001", tcfg, acfg) == "cached"
    frozen, _ = frozen_and_adapters(resumed.engine)
    assert all(torch.equal(frozen[k], v) for k, v in params_of(model).items())  # the base, not the merged weights
    outs = [w.step(table, acfg, tcfg, 1.0, 2, f"runs/{spec.run_id}/policy/v0002")[1] for w in (live, resumed)]
    a, b = (load_safetensors(o["model.safetensors"]) for o in outs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _ddp_rank(rank: int, world: int, port: int, q) -> None:
    """One rank of `test_lora_under_ddp_equals_one_process`: two LoRA updates of the tiny policy."""
    torch.set_num_threads(1)
    from engines.models.modeling import build_tiny_policy
    from engines.training.strategies import init_distributed, make_strategy
    from tests.conftest import TINY
    from tests.support.strategy_ranks import synthetic_batch

    model, tok = build_tiny_policy(**TINY, seed=0)
    batch, adv, old, ref = synthetic_batch(tok, model)
    if world > 1:
        init_distributed(rank, world, "127.0.0.1", port, "gloo")
    torch.manual_seed(rank)  # another adapter init on rank 1: DDP's broadcast from rank 0 must align them
    engine = TorchTrainEngine(model, lr=1e-2, lora=LORA, strategy=make_strategy("ddp" if world > 1 else "torch"))
    for s in range(2):
        engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64, seed=s)
    weights = engine.checkpoint_state_dict()
    if rank == 0:  # as bytes: a shared-memory tensor dies with the process that put it
        buf = io.BytesIO()
        torch.save(weights, buf)
        q.put(buf.getvalue())


def test_lora_under_ddp_equals_one_process():
    """training.strategy ddp with LoRA (two gloo processes): the merged checkpoint equals the
    one-process LoRA run's up to float summation order."""
    import torch.multiprocessing as mp

    from tests.support.strategy_ranks import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    _ddp_rank(0, 1, 0, q)
    single = torch.load(io.BytesIO(q.get()), weights_only=True)
    port = free_port()
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    ddp = torch.load(io.BytesIO(q.get(timeout=300)), weights_only=True)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert set(ddp) == set(single)
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], atol=1e-5, rtol=0, msg=k)

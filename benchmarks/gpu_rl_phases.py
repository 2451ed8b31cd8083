# longer than 400 lines: the GPU check's phases, one function each, run in order by one script
"""The phases of benchmarks/gpu_rl_check.py, one function each (`RUNNERS`): env, learn, mfu, gen,
rl_step, sync, strategies, lora. Each takes the phase context and returns its JSON-able result; the
check's docstring says what each measures and proves.
"""

from __future__ import annotations

import copy
import platform
import random
import socket
import traceback
from pathlib import Path

import torch

from benchmarks.engine_settings import ALGORITHM, algorithm
from benchmarks.gpu_mfu import (
    _IdTokenizer,
    build_model,
    generation_row,
    matmul_tflops,
    n_params,
    peak_tflops,
    time_steps,
    uncompile,
)
from benchmarks.gpu_rl_context import Ctx, bf16_copy, max_diff, model_shape, random_rows, rows_of, timed, train_batch

def phase_env(ctx: Ctx) -> dict:
    import importlib.metadata
    import importlib.util

    from engines.models.devices import resolve_device

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for module, dist in (("transformers", "transformers"), ("peft", "peft"), ("safetensors", "safetensors"), ("numpy", "numpy"),
                         ("pandas", "pandas"), ("tokenizers", "tokenizers"), ("accelerate", "accelerate"), ("pydantic", "pydantic"),
                         ("yaml", "PyYAML"), ("flytekit", "flytekit"), ("ray", "ray"), ("mlflow", "mlflow"), ("vllm", "vllm")):
        try:  # found, not imported (importing flytekit or ray takes seconds)
            versions[module] = importlib.metadata.version(dist) if importlib.util.find_spec(module) else "absent"
        except importlib.metadata.PackageNotFoundError:
            versions[module] = "present (no metadata)"
    out = {"versions": versions, "device": str(ctx.device), "threads": torch.get_num_threads(),
           "cuda_available": torch.cuda.is_available()}
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        out.update(gpu=torch.cuda.get_device_name(ctx.device), capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1), bf16_supported=torch.cuda.is_bf16_supported())
        out["peak_bf16_tflops_datasheet"] = peak_tflops(out["gpu"], None)
    n = 8192 if ctx.cuda and not ctx.smoke else 256
    out["bf16_gemm"] = {"n": n, "tflops": round(matmul_tflops(ctx.device, n=n, reps=10 if ctx.cuda else 3), 3)}
    # role placement as the pipeline resolves 'auto' (engines/models/devices.py): a GPU worker and a CPU one
    out["placement_auto"] = {"worker with 1 GPU": resolve_device("auto", "auto", 1.0),
                             "worker with no GPU": resolve_device("auto", "auto", 0.0)}
    return out


def _greedy_accuracy(engine, tok, problems, max_new_tokens: int) -> float:
    from engines.generation.engine import SamplingParams
    from engines.rewards.exact_match import exact_match_reward

    ids = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    comps = engine.generate(ids, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    return sum(exact_match_reward(c.text, {"answer": problems[c.prompt_index].answer}) for c in comps) / len(problems)


def phase_learn(ctx: Ctx) -> dict:
    from engines.models.batching import batched_logprobs
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.models.modeling import build_tiny_policy
    from engines.training.pretrain import supervised_finetune
    from engines.training.rl_step import AlgorithmState
    from engines.data.synthetic import make_problems, teacher_demonstration
    from engines.rewards.exact_match import exact_match_reward
    from engines.training.update import TorchTrainEngine

    P, dev = ctx.preset, ctx.device
    b, r, t = P["bootstrap"], P["rollout"], P["training"]
    iterations = ctx.iterations or P["loop"]["iterations"]
    cfg = algorithm()
    out: dict = {"preset": {"bootstrap": b, "rollout": r, "training": t, "iterations": iterations}, "algorithm": ALGORITHM}
    # the bootstrap, as tasks/stages/prepare.py build_base_policy does it for configs/tiny.yaml, on the device
    model, tok = build_tiny_policy(b["hidden_size"], b["num_layers"], b["num_heads"], max_positions=b["max_positions"],
                                   seed=P["seed"])
    model.to(dev)
    rng = random.Random(P["seed"])
    problems = make_problems("bootstrap", b["num_examples"], seed=P["seed"])
    pairs = [(p.prompt, teacher_demonstration(p, rng, b["teacher_accuracy"])) for p in problems]
    metrics, out["bootstrap_s"] = timed(ctx, lambda: supervised_finetune(model, tok, pairs, steps=b["steps"],
                                                                            batch_size=b["batch_size"], lr=b["lr"], seed=P["seed"]))
    out["bootstrap_loss"] = round(metrics["bootstrap/loss"], 4)
    out["policy_device"] = str(next(model.parameters()).device)
    # roles: trainer (float32 master + bf16 autocast), generator / π_old / reference in bf16
    reference = bf16_copy(model, dev)
    old_policy = bf16_copy(model, dev)
    generator = HFGenerationEngine(bf16_copy(model, dev), tok, micro_batch=512)
    trainer = TorchTrainEngine(model, lr=t["lr"], weight_decay=t["weight_decay"], grad_clip=t["grad_clip"],
                               compute_dtype=torch.bfloat16)
    evals = make_problems("eval", P["eval_size"])
    train = make_problems("train", r["prompts_per_iteration"] * iterations, seed=P["seed"])
    curve = [{"iteration": 0, "greedy_accuracy": _greedy_accuracy(generator, tok, evals, r["max_new_tokens"])}]
    state, iters = AlgorithmState(), []
    for it in range(iterations):
        row: dict = {"iteration": it + 1}
        batch_problems = train[it * r["prompts_per_iteration"] : (it + 1) * r["prompts_per_iteration"]]
        prompt_ids = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in batch_problems]
        params = SamplingParams(n=r["samples_per_prompt"], temperature=r["temperature"], max_new_tokens=r["max_new_tokens"],
                                seed=P["seed"] * 1000 + it)
        comps, row["rollout_s"] = timed(ctx, lambda: generator.generate(prompt_ids, params))
        rewards = [exact_match_reward(c.text, {"answer": batch_problems[c.prompt_index].answer}) for c in comps]
        rows = rows_of(prompt_ids, comps, rewards)
        (batch, token, upd), row["logprobs_s"] = timed(ctx, lambda: train_batch(
            rows, tok.pad_token_id, cfg, state,
            {"old_logprobs": lambda bt: batched_logprobs(old_policy, bt, micro_batch=128),
             "ref_logprobs": lambda bt: batched_logprobs(reference, bt, micro_batch=128)}))
        state = upd.state
        m, row["update_s"] = timed(ctx, lambda: trainer.train_step(
            batch, upd.advantages, token["old_logprobs"], token["ref_logprobs"], cfg,
            mini_batch_size=t["mini_batch_size"], max_tokens_per_micro_batch=t["max_tokens_per_micro_batch"],
            temperature=r["temperature"], seed=it, rollout_logprobs=token["behaviour_logprobs"], kl_coef=upd.kl_coef))

        def sync():  # in memory: the generator's in-place update, the π_old copy's load_state_dict (both cast to bf16)
            generator.update_weights(model.named_parameters(), source="the trainer")
            old_policy.load_state_dict(model.state_dict())

        _, row["sync_s"] = timed(ctx, sync)
        mask = batch.response_mask
        gap = ((token["behaviour_logprobs"] - token["old_logprobs"]).abs() * mask).sum() / mask.sum()
        row.update(reward=sum(rewards) / len(rewards), pg_loss=m.get("actor/pg_loss"), kl_loss=m.get("actor/kl_loss"),
                   grad_norm=m["actor/grad_norm"], updates=m["actor/updates"], behaviour_vs_old_mae=float(gap))
        iters.append({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()})
        if (it + 1) % P["loop"]["eval_every"] == 0 or it + 1 == iterations:
            curve.append({"iteration": it + 1, "greedy_accuracy": _greedy_accuracy(generator, tok, evals, r["max_new_tokens"])})
        if ctx.budget.left() - ctx.reserve_s < 2 * max(x["rollout_s"] + x["logprobs_s"] + x["update_s"] + x["sync_s"] for x in iters[-1:]):
            out["stopped_early"] = f"budget: {it + 1} of {iterations} iterations"
            if curve[-1]["iteration"] != it + 1:
                curve.append({"iteration": it + 1, "greedy_accuracy": _greedy_accuracy(generator, tok, evals, r["max_new_tokens"])})
            break
    out.update(iterations_run=len(iters), curve=curve, iterations=iters,
               accuracy_before=curve[0]["greedy_accuracy"], accuracy_after=curve[-1]["greedy_accuracy"],
               dtypes={"trainer": str(next(model.parameters()).dtype), "generator": str(next(generator.model.parameters()).dtype),
                       "reference": str(next(reference.parameters()).dtype), "old_policy": str(next(old_policy.parameters()).dtype)},
               generator_minus_bf16_trainer=max_diff({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
                                                      generator.model.state_dict()))
    out["accuracy_rose"] = out["accuracy_after"] > out["accuracy_before"]
    return out


def _grpo_inputs(V: int, B: int, S: int, group: int = 1, seed: int = 0):
    from engines.models.batching import TokenBatch

    P = S // 2
    T = S - P
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V - 1, (B, S), generator=g)
    ids[:, :P] = ids[::group, :P].repeat_interleave(group, dim=0)[:B]
    batch = TokenBatch(ids, torch.ones_like(ids), torch.arange(S).expand(B, S).contiguous(), ids[:, P:].clone(), torch.ones(B, T))
    return batch, torch.randn(B, T, generator=g), -torch.rand(B, T, generator=g) * 10


def phase_mfu(ctx: Ctx) -> dict:
    from engines.training.update import TorchTrainEngine

    cfg = algorithm(use_kl_loss=False, kl_coef=0.0)
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    peak = peak_tflops(gpu, None) if ctx.cuda else None
    B, S = (2, 32) if ctx.smoke else (16, 1024)
    warmup, steps = (1, 1) if ctx.smoke else (2, 3)
    rows, skipped = [], []
    for which in ("0.5b", "1.5b"):
        model = build_model(model_shape(ctx, which), ctx.device, torch.float32)
        N = n_params(model)
        batch, adv, old = _grpo_inputs(model.config.vocab_size, B, S)
        for compiled in (False, True):
            name = f"{which} GRPO step, fp32 master + bf16 autocast" + (", training.compile" if compiled else ", eager")
            if compiled and ctx.smoke and not ctx.cuda:
                skipped.append({"what": name, "skipped": "--smoke on cpu: inductor's C++ build takes minutes"})
                continue
            need = (60 if which == "0.5b" else 80) if compiled else 15
            if not ctx.smoke and ctx.spare() < need:
                skipped.append({"what": name, "skipped": f"budget: {ctx.spare():.0f} s spare < {need} s"})
                continue
            try:
                ctx.reset_peak()
                engine = TorchTrainEngine(model, lr=1e-6, compile=compiled, compute_dtype=torch.bfloat16)

                def step():
                    engine.train_step(batch, adv, old, None, cfg, mini_batch_size=B, max_tokens_per_micro_batch=16384)

                _, first = timed(ctx, step)
                dt = time_steps(step, ctx.device, warmup - 1, steps)
                tflops = 6 * N * B * S / dt / 1e12
                rows.append({"what": name, "shape": f"{B} x {S} tok", "params": N, "s": round(dt, 4), "first_call_s": round(first, 2),
                             "tokens_per_s": round(B * S / dt, 1), "tflops": round(tflops, 3),
                             "mfu": None if peak is None else round(tflops / peak, 4), "peak_gib": ctx.peak_gib(),
                             "param_dtype": str(next(model.parameters()).dtype),
                             "adam_state_dtype": str(next(iter(engine.optimizer.state.values()))["exp_avg"].dtype)})
            except Exception as e:  # noqa: BLE001 - one row's failure keeps the others
                traceback.print_exc()
                rows.append({"what": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            finally:
                engine = None
                uncompile(model)
                ctx.free()
        del model
        ctx.free()
    return {"gpu": gpu, "peak_bf16_tflops": peak, "rows": rows, "skipped": skipped,
            "failed": [r for r in rows if "error" in r]}


def phase_gen(ctx: Ctx) -> dict:
    model = build_model(model_shape(ctx, "0.5b"), ctx.device, torch.bfloat16).eval()
    shape = (2, 2, 8, 8) if ctx.smoke else (16, 8, 128, 128)
    rows, skipped = [], []
    for compiled in (False, True):
        if compiled and not ctx.smoke and ctx.spare() < 45:
            skipped.append({"what": "compiled decode", "skipped": f"budget: {ctx.spare():.0f} s spare"})
            continue
        try:
            row = generation_row(model, shape, ctx.device, 1 if ctx.smoke else 2, compile_decode=compiled)
            row["dtype"] = str(next(model.parameters()).dtype)
            if not ctx.cuda and compiled:
                row["note"] = "transformers compiles decode on GPUs only: on cpu this is the eager path"
            rows.append(row)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"what": "generate" + (", compiled decode" if compiled else ""), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return {"shape": "prompts x samples x prompt+new tokens = " + "x".join(map(str, shape)), "rows": rows, "skipped": skipped,
            "failed": [r for r in rows if "error" in r]}


def phase_rl_step(ctx: Ctx) -> dict:
    from engines.models.batching import batched_logprobs, response_logprobs
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.training.update import TorchTrainEngine

    dev = ctx.device
    prompts, samples, prompt_len, new = (2, 2, 8, 8) if ctx.smoke else (16, 8, 128, 128)
    cfg = algorithm()
    stages, memory = {}, {}
    ctx.reset_peak()
    trainer_model = build_model(model_shape(ctx, "0.5b"), dev, torch.float32)
    V = trainer_model.config.vocab_size
    generator = HFGenerationEngine(bf16_copy(trainer_model, dev), _IdTokenizer(V), micro_batch=prompts)
    reference = bf16_copy(trainer_model, dev)
    trainer = TorchTrainEngine(trainer_model, lr=1e-5, compute_dtype=torch.bfloat16)
    memory["models_gib"] = ctx.peak_gib()
    prompt_ids = random_rows(V, prompts, samples, prompt_len)
    params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=new, seed=0)

    def stage(name, fn):
        ctx.reset_peak()
        result, stages[name] = timed(ctx, fn)
        stages[name] = round(stages[name], 4)
        memory[name] = ctx.peak_gib()
        return result

    comps = stage("rollout_s", lambda: generator.generate(prompt_ids, params))
    rewards = [float(c.token_ids[0] % 2) if c.token_ids else 0.0 for c in comps]  # a fixed rule: most groups get non-zero advantages
    rows = rows_of(prompt_ids, comps, rewards)
    batch, token, upd = stage("old_and_ref_logprobs_s", lambda: train_batch(
        rows, 0, cfg, None, {"old_logprobs": lambda bt: batched_logprobs(generator.model, bt, micro_batch=32),
                             "ref_logprobs": lambda bt: batched_logprobs(reference, bt, micro_batch=32)}))
    with torch.no_grad():  # the trainer's own forward (fp32 master, bf16 autocast) on the same batch, 32 rows at a time
        trainer_lp = torch.cat([response_logprobs(trainer_model, batch.select(slice(i, i + 32)).to(dev),
                                                  autocast_dtype=torch.bfloat16)[0].cpu()
                                for i in range(0, len(rows), 32)]) * batch.response_mask
    m = stage("update_s", lambda: trainer.train_step(batch, upd.advantages, token["old_logprobs"], token["ref_logprobs"], cfg,
                                                      mini_batch_size=len(rows), max_tokens_per_micro_batch=16384,
                                                      rollout_logprobs=token["behaviour_logprobs"], kl_coef=upd.kl_coef))
    stage("sync_s", lambda: generator.update_weights(trainer_model.named_parameters(), source="the trainer"))
    mask = batch.response_mask
    gap = lambda a, b: {"mean_abs": round(float(((a - b).abs() * mask).sum() / mask.sum()), 6),
                        "max_abs": round(float(((a - b).abs() * mask).max()), 6)}
    adam = [s["exp_avg"].dtype for s in trainer.optimizer.state.values()] + [s["exp_avg_sq"].dtype for s in trainer.optimizer.state.values()]
    dtypes = {"trainer_params": sorted({str(p.dtype) for p in trainer_model.parameters()}),
              "adamw_state": sorted({str(d) for d in adam}),
              "generator_params": sorted({str(p.dtype) for p in generator.model.parameters()}),
              "reference_params": sorted({str(p.dtype) for p in reference.parameters()})}
    ok = (dtypes["trainer_params"] == dtypes["adamw_state"] == ["torch.float32"]
          and dtypes["generator_params"] == dtypes["reference_params"] == ["torch.bfloat16"])
    diff = max_diff({k: v.to(torch.bfloat16) for k, v in trainer_model.state_dict().items()}, generator.model.state_dict())
    return {"shape": f"{prompts} prompts x {samples} samples, {prompt_len}+{new} tokens", "params": n_params(trainer_model),
            "stages": stages, "peak_gib": memory, "dtypes": dtypes, "dtypes_ok": ok,
            "generator_minus_bf16_trainer_after_sync": diff,
            "logprob_gap": {"behaviour_vs_bf16_recompute": gap(token["behaviour_logprobs"], token["old_logprobs"]),
                            "behaviour_vs_trainer_autocast": gap(token["behaviour_logprobs"], trainer_lp),
                            "bf16_reference_vs_trainer_autocast": gap(token["ref_logprobs"], trainer_lp)},
            "update": {k: m[k] for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "training/tokens_per_s") if k in m},
            "response_tokens": int(mask.sum())}


def phase_sync(ctx: Ctx) -> dict:
    import tempfile

    from engines.generation.engine import HFGenerationEngine

    trainer_model = build_model(model_shape(ctx, "0.5b"), ctx.device, torch.float32)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(0.01)  # new weights to send
    generator = HFGenerationEngine(build_model(model_shape(ctx, "0.5b"), ctx.device, torch.bfloat16),
                                   _IdTokenizer(trainer_model.config.vocab_size))
    want = {k: v.to(torch.bfloat16) for k, v in trainer_model.state_dict().items()}
    out = {"params": n_params(trainer_model)}
    _, out["in_memory_s"] = timed(ctx, lambda: generator.update_weights(trainer_model.named_parameters()))
    out["in_memory_max_diff"] = max_diff(want, generator.model.state_dict())
    with torch.no_grad():
        for p in generator.model.parameters():
            p.zero_()
    with tempfile.TemporaryDirectory() as d:
        _, out["save_s"] = timed(ctx, lambda: trainer_model.save_pretrained(d, safe_serialization=True))
        out["checkpoint_mib"] = round(sum(f.stat().st_size for f in Path(d).glob("*.safetensors")) / 2**20, 1)
        _, out["load_weights_s"] = timed(ctx, lambda: generator.load_weights(d))
    out["from_checkpoint_max_diff"] = max_diff(want, generator.model.state_dict())
    out["from_checkpoint_s"] = out["save_s"] + out["load_weights_s"]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase_strategies(ctx: Ctx) -> dict:
    import torch.distributed as dist

    from engines.training.strategies import TorchStrategy, init_distributed, make_strategy
    from engines.training.update import TorchTrainEngine

    backend = init_distributed(0, 1, "127.0.0.1", _free_port(), "nccl" if ctx.cuda else "gloo")
    base = build_model(model_shape(ctx, "small"), "cpu", torch.float32)
    B, S = (8, 24) if ctx.smoke else (16, 512)
    batch, adv, old = _grpo_inputs(base.config.vocab_size, B, S)
    cfg = algorithm(use_kl_loss=False, kl_coef=0.0)
    start = {k: v.clone() for k, v in base.state_dict().items()}
    plans = {"torch": lambda: TorchStrategy(), "ddp": lambda: make_strategy("ddp"), "fsdp2": lambda: make_strategy("fsdp2"),
             "fsdp2_bf16_params": lambda: make_strategy("fsdp2", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    rows, updates = {}, {}
    try:
        for name, make in plans.items():
            try:
                model = copy.deepcopy(base).to(ctx.device)
                engine = TorchTrainEngine(model, lr=1e-3, strategy=make(), compute_dtype=torch.bfloat16)
                engine.shared_prefix = False  # every strategy runs plain forwards: the same numbers up to rounding
                ctx.reset_peak()
                metrics, dt = timed(ctx, lambda: engine.train_step(batch, adv, old, None, cfg, mini_batch_size=B // 2,
                                                                    max_tokens_per_micro_batch=B * S // 4))
                full = engine.checkpoint_state_dict()
                state = {k: v.detach().float().cpu() for k, v in (full if full is not None else model.state_dict()).items()}
                state = {k.removeprefix("module."): v for k, v in state.items()}
                updates[name] = {k: state[k] - start[k] for k in start if k in state}
                rows[name] = {"s": round(dt, 4), "grad_norm": round(metrics["actor/grad_norm"], 6),
                              "pg_loss": round(metrics["actor/pg_loss"], 6), "peak_gib": ctx.peak_gib(),
                              "master_dtype": sorted({str(p.dtype) for p in model.parameters()})}
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                engine = model = None
                ctx.free()
    finally:
        dist.destroy_process_group()
    ref = updates.get("torch")
    if ref is not None:
        norm = sum(float(v.pow(2).sum()) for v in ref.values()) ** 0.5
        for name, upd in updates.items():
            if name != "torch" and set(upd) == set(ref):
                d = sum(float((upd[k] - ref[k]).pow(2).sum()) for k in ref) ** 0.5
                rows[name]["update_rel_diff_vs_torch"] = round(d / max(norm, 1e-30), 6)
            elif name != "torch":
                rows[name]["update_rel_diff_vs_torch"] = f"keys differ: {sorted(set(upd) ^ set(ref))[:4]}"
        rows["torch"]["update_norm"] = round(norm, 6)
    return {"backend": backend, "world_size": 1, "batch": f"{B} x {S} tok, 2 mini-batches", "rows": rows,
            "failed": [k for k, v in rows.items() if "error" in v]}


def phase_lora(ctx: Ctx) -> dict:
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.training.lora import DEFAULT_TARGETS, plain_model
    from engines.training.update import TorchTrainEngine

    dev = ctx.device
    model = build_model(model_shape(ctx, "0.5b"), dev, torch.float32)
    V = model.config.vocab_size
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = HFGenerationEngine(bf16_copy(model, dev), _IdTokenizer(V), micro_batch=8)
    B, S = (4, 24) if ctx.smoke else (16, 512)
    batch, adv, old = _grpo_inputs(V, B, S, group=2)
    ctx.reset_peak()
    engine = TorchTrainEngine(model, lr=1e-3, compute_dtype=torch.bfloat16,
                              lora={"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": list(DEFAULT_TARGETS)})
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    m, dt = timed(ctx, lambda: engine.train_step(batch, adv, old, None, algorithm(use_kl_loss=False, kl_coef=0.0),
                                                  mini_batch_size=B, max_tokens_per_micro_batch=16384))
    now = {k.replace(".base_layer.", "."): v for k, v in plain_model(engine.model).state_dict().items() if ".lora_" not in k}
    base_diff = max_diff(base_state, now)
    merged, merge_s = timed(ctx, engine.checkpoint_state_dict)
    targets = [k for k in merged if any(f".{t}." in k for t in DEFAULT_TARGETS)]
    merged_delta = max(float((merged[k].float() - base_state[k].float()).abs().max()) for k in targets)
    _, sync_s = timed(ctx, lambda: generator.update_weights(merged.items(), source="the merged LoRA weights"))
    served = max_diff({k: v.to(torch.bfloat16) for k, v in merged.items()}, generator.model.state_dict())
    comps = generator.generate(random_rows(V, 2, 1, 8), SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0))
    return {"params": n_params(plain_model(engine.model)) - trainable, "trainable": trainable, "update_s": round(dt, 4),
            "peak_gib": ctx.peak_gib(), "grad_norm": m["actor/grad_norm"], "base_max_change": base_diff,
            "merged_max_delta": merged_delta, "merge_s": round(merge_s, 4), "sync_s": round(sync_s, 4),
            "generator_minus_bf16_merged": served, "generated_tokens": sum(len(c.token_ids) for c in comps),
            "ok": base_diff == 0.0 and merged_delta > 0 and served == 0.0}


RUNNERS = {"env": phase_env, "learn": phase_learn, "mfu": phase_mfu, "gen": phase_gen, "rl_step": phase_rl_step,
           "sync": phase_sync, "strategies": phase_strategies, "lora": phase_lora}

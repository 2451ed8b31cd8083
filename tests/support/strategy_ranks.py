"""One training run per rank for tests/engines/training/test_strategies.py and benchmarks/bench_strategies.py.

`run_strategy` starts `world` processes (torch.multiprocessing, spawn), each joins a gloo process
group, builds the same tiny Qwen2 policy and synthetic RL batch from a fixed seed, and runs `steps`
actor updates under one training strategy; rank 0 returns the per-step losses and gradient norms,
the step times, the final weights (gathered) and the optimizer state (portable layout).
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_batch(tok, model, rows: int = 8, seed: int = 0):
    """(batch, advantages, old log-probs, ref log-probs): fixed random prompts/responses of mixed
    lengths, advantages +-1, old = the policy's own log-probs, ref = old minus noise."""
    from engines.models.batching import batched_logprobs, collate

    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(rows)]
    batch = collate(prompts, responses, tok.pad_token_id)
    old = batched_logprobs(model, batch)
    ref = (old - 0.05 * torch.rand(old.shape, generator=g)) * batch.response_mask
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows)])[:, None] * batch.response_mask
    return batch, adv, old, ref


def train_on_rank(rank: int, world: int, port: int, strategy: str, steps: int, opts: dict) -> dict | None:
    """`steps` updates on this rank; rank 0's results (None on the others)."""
    torch.set_num_threads(opts.get("threads", 1))
    from engines.algorithms.config import AlgorithmConfig
    from engines.models.modeling import build_tiny_policy
    from engines.training.strategies import init_distributed, make_strategy
    from engines.training.update import TorchTrainEngine

    if strategy != "torch":
        init_distributed(rank, world, "127.0.0.1", port, backend="gloo")
    model, tok = build_tiny_policy(opts.get("hidden", 32), opts.get("layers", 2), 2, seed=0)
    batch, adv, old, ref = synthetic_batch(tok, model, rows=opts.get("rows", 8))
    kwargs = {"config_overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}} if strategy.startswith("deepspeed") else {}

    def new_engine(model):
        return TorchTrainEngine(model, lr=opts.get("lr", 1e-2), grad_clip=opts.get("grad_clip", 1.0),
                                warmup_steps=2, total_steps=10, strategy=make_strategy(strategy, **kwargs))

    engine = new_engine(model)
    cfg = AlgorithmConfig(entropy_coef=0.01)
    losses, norms, times = [], [], []
    for step in range(steps):
        if step and step == opts.get("resume_at"):  # checkpoint and resume, as a fresh task would
            model, engine = _resume(engine, model, tok, new_engine, rank, opts)
        t0 = time.perf_counter()
        m = engine.train_step(batch, adv, old, ref, cfg, mini_batch_size=opts.get("mini_batch_size", 8),
                              max_tokens_per_micro_batch=opts.get("max_tokens", 40), seed=step)
        times.append(time.perf_counter() - t0)
        losses.append(m["actor/pg_loss"] + m.get("actor/kl_loss", 0.0))
        norms.append(m["actor/grad_norm"])
    full = engine.strategy.full_state_dict()
    optim = engine.state_dict()["optimizer"]
    result = None
    if rank == 0:
        weights = {k: v.detach().cpu().clone() for k, v in (full if full is not None else model.state_dict()).items()}
        result = {"losses": losses, "grad_norms": norms, "step_s": times, "weights": weights, "optimizer": optim,
                  "tied_embedding_in_place": engine.tied_embedding_in_place}
    if strategy != "torch":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


def _resume(engine, model, tok, new_engine, rank: int, opts: dict):
    """Checkpoint as TrainWorker does (weights gathered, rank 0 writes the Hugging Face directory and
    the trainer state), then a fresh model loaded from that directory and a fresh engine resume."""
    from engines.models.modeling import load_policy, save_policy

    full = engine.strategy.full_state_dict()
    state = engine.state_dict()
    path = os.path.join(opts["resume_dir"], "ckpt")
    if rank == 0:
        save_policy(model, tok, path, state_dict=full)
        torch.save(state, os.path.join(path, "trainer_state.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    fresh, _ = load_policy(path)
    engine = new_engine(fresh)
    engine.load_state_dict(torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True))
    return fresh, engine


def _process(rank: int, world: int, port: int, strategy: str, steps: int, opts: dict, out) -> None:
    result = train_on_rank(rank, world, port, strategy, steps, opts)
    if result is not None:
        buf = io.BytesIO()  # bytes, not tensors: a queued tensor lives in this process's shared memory
        torch.save(result, buf)
        out.put(buf.getvalue())


def run_strategy(strategy: str, world: int = 2, steps: int = 3, **opts) -> dict:
    """Rank 0's results of `steps` updates under `strategy` on `world` processes ('torch': this one)."""
    import torch.multiprocessing as mp

    if strategy == "torch":
        return train_on_rank(0, 1, 0, "torch", steps, opts)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/flyroll/torch_extensions"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_process, args=(r, world, port, strategy, steps, opts, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        while True:  # wait for rank 0's result, but not for a rank that died without one
            try:
                result = torch.load(io.BytesIO(out.get(timeout=1)), weights_only=True)
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode]
                if dead or all(not p.is_alive() for p in procs):
                    raise RuntimeError(f"strategy {strategy}: rank processes exited with {[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"strategy {strategy}: rank processes exited with {bad}")
    return result

"""The model update group (engines/weight_sync/update_group.py) with real processes: a trainer (rank 0) and tiny
HF generation engines (ranks 1..N) spawned as their own processes, gloo on CPU, no mocks.

Each engine process reports the sha256 of every weight's bytes after a sync; the test compares them
with the trainer's weights in the engine's dtype, so "equal" is bitwise (fp32), or bitwise to the
trainer's weights rounded to bf16 (a bf16 engine). Every wait is bounded (the group's timeout_s and
the queue's get timeout), so a broken sync fails the test instead of hanging it."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import signal

import pytest
import torch
import torch.multiprocessing as mp

from engines.generation.engine import HFGenerationEngine, SamplingParams
from engines.models.modeling import build_tiny_policy
from engines.weight_sync.update_group import ModelUpdateGroup, WeightSyncError, plan_buckets

from tests.support.sync import TINY, WAIT, digests, free_port, moved_tiny_digests, release

BUCKET = 40 << 10    # 40 KiB: the tiny model's 106 KB of fp32 weights travel in several buckets

pytestmark = pytest.mark.timeout(240)


def engine_process(rank, port, world, q, leave, **kw):
    try:
        serve(rank, port, world, q, **kw)
    except BaseException as e:  # anything unexpected: reported at once, not after the test's wait
        q.put((rank, None, None, f"crashed: {type(e).__name__}: {e}", None))
        raise
    finally:
        leave.wait(WAIT)            # alive until the test is done with it (a dead engine is the killed one)


def serve(rank, port, world, q, transport="broadcast", dtype="float32", syncs=1, die=None, timeout_s=20.0):
    """One generation engine: joins the group, takes `syncs` syncs, reports (rank, version, digests, what
    generate did) after each; on a failed sync reports the error and what the engine does next."""
    torch.set_num_threads(1)
    model, tok = build_tiny_policy(**TINY, seed=10 + rank)     # other weights than the trainer's
    engine = HFGenerationEngine(model.to(getattr(torch, dtype)), tok)
    engine.finish_weight_update(0)                              # serves v0 before any sync
    group = ModelUpdateGroup("127.0.0.1", port, world, rank, transport=transport, timeout_s=timeout_s, member=f"infer-{rank}")
    die_after = (die or {}).get(rank)                          # SIGKILL itself after applying that bucket
    on_bucket = lambda i: os.kill(os.getpid(), signal.SIGKILL) if i == die_after else None
    for _ in range(syncs):
        try:
            version = group.receive(engine, on_bucket=on_bucket)
        except (WeightSyncError, ValueError) as e:
            try:
                engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
                served = "generated"
            except RuntimeError as refused:
                served = f"refused: {refused}"
            q.put((rank, engine.version, None, f"{type(e).__name__}: {e}", served))
            continue
        out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
        q.put((rank, version, digests(engine.model, engine.weight_dtype()), None, f"generated {len(out)}"))
    group.close()


def start_engines(port, world, **kw):
    ctx = mp.get_context("fork")    # fork: no re-import of torch per engine (seconds instead of ~10 s each)
    q, leave = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=engine_process, args=(r, port, world, q, leave), kwargs=kw, daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    procs[0].leave = leave
    return q, procs


def reports(q, n):
    got = [q.get(timeout=WAIT) for _ in range(n)]
    return {r[0]: r for r in got}


def stop(procs):
    procs[0].leave.set()
    for p in procs:
        p.join(timeout=WAIT)
        if p.is_alive():
            p.kill()


@pytest.mark.parametrize("transport", ["broadcast", "shm"])
def test_live_sync_gives_every_engine_the_trainers_weights_bitwise(transport):
    """Two fp32 engines, two syncs (the second after the trainer changed): both engines hold the
    trainer's weights bit for bit after each, report the version, and generate. The shared-memory path
    gives the same bytes as the broadcast."""
    port, world = free_port(), 3
    q, procs = start_engines(port, world, transport=transport, syncs=2)
    trainer, _ = build_tiny_policy(**TINY, seed=0)
    group = ModelUpdateGroup("127.0.0.1", port, world, 0, transport=transport, timeout_s=20)
    try:
        for version in (1, 2):
            report = group.send(trainer.named_parameters(), version=version, bucket_bytes=BUCKET)
            assert report.buckets > 2 and report.bytes == sum(p.numel() * 4 for p in trainer.parameters())
            got, want = reports(q, world - 1), digests(trainer)
            for rank in (1, 2):
                _, served, weights, error, generated = got[rank]
                assert error is None and served == version and generated == "generated 1"
                assert weights == want, [k for k in want if weights[k] != want[k]]
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(-0.5)            # a new policy for the next version
    finally:
        group.close()
        stop(procs)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"flyroll-wsync-{os.getpid()}-")]


def test_bf16_engines_get_the_trainers_weights_rounded_to_bf16():
    port, world = free_port(), 2
    q, procs = start_engines(port, world, dtype="bfloat16")
    trainer, _ = build_tiny_policy(**TINY, seed=0)
    group = ModelUpdateGroup("127.0.0.1", port, world, 0, timeout_s=20)
    try:
        report = group.send(trainer.named_parameters(), version=5, dtype="bfloat16", bucket_bytes=BUCKET)
        _, served, weights, error, _ = reports(q, 1)[1]
        assert error is None and served == 5
        assert report.bytes == sum(p.numel() * 2 for p in trainer.parameters())  # bf16 on the wire
        assert weights == digests(trainer, torch.bfloat16)
    finally:
        group.close()
        stop(procs)


def test_refused_syncs_move_nothing_and_name_the_engine():
    """A dtype the engine does not hold, then an unmerged LoRA adapter: each refused before any byte
    moves, the error naming the engine, the version and the reason; the engine keeps serving what it
    served. The group stays usable: the merged weights then go through."""
    from engines.training.lora import apply_lora, merged_state_dict

    port, world = free_port(), 2
    q, procs = start_engines(port, world, syncs=3)
    trainer, _ = build_tiny_policy(**TINY, seed=0)
    group = ModelUpdateGroup("127.0.0.1", port, world, 0, timeout_s=20)
    try:
        with pytest.raises(ValueError, match=r"v3 refused.*engine rank 1 \(infer-1.*torch.float32 weights and cannot take a torch.bfloat16"):
            group.send(trainer.named_parameters(), version=3, dtype="bfloat16")
        _, served, _, error, generated = reports(q, 1)[1]
        assert served == 0 and "keeps v0" in error and generated == "generated"

        lora = apply_lora(copy.deepcopy(trainer), rank=2, alpha=4.0)
        with torch.no_grad():
            for n, p in lora.named_parameters():
                if "lora_B" in n:
                    p.normal_()             # a non-zero adapter: the merged weights differ from the base
        with pytest.raises(ValueError, match=r"v4 refused.*engine rank 1.*unknown=.*lora_.*merge them"):
            group.send(lora.named_parameters(), version=4)
        assert reports(q, 1)[1][3] is not None

        merged = merged_state_dict(lora)
        group.send(list(merged.items()), version=4)
        _, served, weights, error, _ = reports(q, 1)[1]
        want = {k: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for k, t in merged.items()}
        assert error is None and served == 4 and all(weights[k] == want[k] for k in want)
    finally:
        group.close()
        stop(procs)


def test_a_receiver_killed_mid_sync_is_a_clear_error_not_a_hang():
    """Engine 2 is SIGKILLed after applying bucket 0: the trainer's send raises within the group's
    timeout, naming engine rank 2 and the version; engine 1 fails its sync too and refuses to generate
    (it holds part of v6), until it loads the last good version in full."""
    port, world = free_port(), 3
    q, procs = start_engines(port, world, die={2: 0}, timeout_s=8)
    trainer, _ = build_tiny_policy(**TINY, seed=0)
    group = ModelUpdateGroup("127.0.0.1", port, world, 0, timeout_s=8)
    try:
        with pytest.raises(WeightSyncError, match=r"policy v6 failed.*engine rank 2 \(infer-2, pid \d+ on .*\) is dead") as e:
            group.send(trainer.named_parameters(), version=6, bucket_bytes=BUCKET)
        assert "engine rank 1 " not in str(e.value)
        rank, served, _, error, generated = q.get(timeout=WAIT)
        assert rank == 1 and served is None and "infer-1" in error and "policy v6 failed" in error
        assert generated.startswith("refused: HFGenerationEngine holds a partial weight update")
        with pytest.raises(WeightSyncError, match="unusable after an earlier failure"):
            group.send(trainer.named_parameters(), version=6)
    finally:
        group.close()
        stop(procs)
    assert procs[1].exitcode == -signal.SIGKILL


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded parameter: an FSDP2 DTensor's local tensor, a ZeRO-3 partition."""
    return p.to_local() if hasattr(p, "to_local") else p.ds_tensor


def sharded_trainer(rank, dist_port, group_port, q, leave, refuse_first=False, strategy_name="fsdp2"):
    """Training rank `rank` of 2: the tiny model sharded by one of the project's strategies (`fsdp2`:
    torch `fully_shard`; `deepspeed_zero3`: every parameter partitioned, none kept whole by the
    persistence threshold; gloo on CPU), each rank's shards moved in place (as an optimizer step moves them).
    Rank 0 sends through the update group, rank 1 takes part in its per-parameter gathers
    (`gather_only`); each reports whether every parameter was sharded, rank 0 also the digests of the
    full weights (`full_state_dict`, a collective of both ranks) and the sync's bucket count.
    `refuse_first`: a sync the engine refuses (bf16 to its float32 weights) comes first; rank 0's send
    raises, and still makes the gathers rank 1's `gather_only` waits for, so both go on to the next."""
    try:
        from engines.training.strategies import init_distributed, make_strategy
        from engines.weight_sync.gather import gather_only
        from tests.support.training import is_half

        torch.set_num_threads(1)
        init_distributed(rank, 2, "127.0.0.1", dist_port, backend="gloo")
        kwargs = ({"config_overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
                  if strategy_name.startswith("deepspeed") else {})
        strategy = make_strategy(strategy_name, **kwargs)
        model = build_tiny_policy(**TINY, seed=0)[0]
        strategy.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), 1.0)  # the plain module, as TrainWorker sends
        with torch.no_grad():
            for p in model.parameters():
                local_shard(p).mul_(-0.5)
        sharded = all(is_half(p) for p in model.parameters())
        full = strategy.full_state_dict()
        if rank == 0:
            group = ModelUpdateGroup("127.0.0.1", group_port, 2, 0, timeout_s=20, member=f"{strategy_name} rank 0")
            if refuse_first:
                with pytest.raises(ValueError, match="refused before any byte moved"):
                    group.send(model.named_parameters(), version=6, dtype="bfloat16", bucket_bytes=BUCKET)
            report = group.send(model.named_parameters(), version=7, bucket_bytes=BUCKET)
            group.close()
            q.put((rank, sharded, digests(full), report.buckets))
        else:
            for _ in range(2 if refuse_first else 1):
                gather_only(model.named_parameters())
            q.put((rank, sharded, None, None))
    except BaseException as e:  # reported at once, not after the test's wait
        q.put((rank, None, f"crashed: {type(e).__name__}: {e}", None))
        raise
    finally:
        leave.wait(WAIT)


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize("strategy_name", [
    "fsdp2",
    # slow: DeepSpeed builds its CPU communication op on first use (~90 s, cached in TORCH_EXTENSIONS_DIR)
    pytest.param("deepspeed_zero3", marks=[pytest.mark.slow, pytest.mark.skipif(
        not HAS_DEEPSPEED, reason="DeepSpeed is not installed: pip install -e '.[deepspeed]'")]),
])
@pytest.mark.parametrize("refuse_first", [False, True], ids=["one-sync", "after-a-refused-sync"])
def test_a_sharded_trainer_sends_bucket_by_bucket_and_the_engine_ends_bitwise_equal(refuse_first, strategy_name):
    """Two sharded training ranks (FSDP2: every parameter a DTensor holding half of it; ZeRO-3: every
    parameter an empty placeholder beside its half partition) and one fp32 engine:
    rank 0 sends, gathering one parameter at a time as each bucket fills, while rank 1 joins those
    gathers in the same order (`gather_only`); the engine then holds the full weights bit for bit: the
    trainer's own gathered state dict, and the unsharded model with the same change. After a refused
    sync first, rank 1 is not left in a gather (rank 0's send made them before raising)."""
    port, dist_port, world = free_port(), free_port(), 2
    q, procs = start_engines(port, world, syncs=2 if refuse_first else 1)
    # spawned, not forked: a forked child of a pytest worker that ran Ray tests before (gRPC and
    # Ray threads holding locks at the fork) hung in its process-group start-up in CI
    ctx = mp.get_context("spawn")
    tq, leave = ctx.Queue(), ctx.Event()
    trainers = [ctx.Process(target=sharded_trainer, args=(r, dist_port, port, tq, leave, refuse_first, strategy_name),
                            daemon=True)
                for r in (0, 1)]
    for p in trainers:
        p.start()
    try:
        ranks = {r[0]: r for r in (tq.get(timeout=WAIT) for _ in trainers)}
        if refuse_first:
            _, kept, _, error, generated = q.get(timeout=WAIT)
            assert "refused, the engine keeps v0" in error and kept == 0 and generated == "generated"
        _, served, weights, error, generated = reports(q, 1)[1]
        assert ranks[0][1] is True and ranks[1][1] is True, ranks          # really sharded, on both ranks
        assert ranks[0][3] > 2                                            # several buckets, each gathered as it filled
        assert error is None and served == 7 and generated == "generated 1"
        assert weights == ranks[0][2]                                     # = the trainer's full weights, bitwise
        assert weights == moved_tiny_digests()
    finally:
        release(trainers, leave)
        stop(procs)


def test_a_bucket_below_the_largest_tensor_is_refused_naming_it():
    trainer, _ = build_tiny_policy(**TINY, seed=0)
    shapes = [(n, tuple(p.shape)) for n, p in trainer.named_parameters()]
    name, shape = max(shapes, key=lambda s: s[1][0] * s[1][-1])
    nbytes = shape[0] * shape[-1] * 4
    with pytest.raises(ValueError, match=rf"bucket_bytes=1000 is below the largest tensor: {name} \[{shape[0]}, {shape[1]}\] "
                                         rf"is {nbytes} bytes in torch.float32; set bucket_bytes >= {nbytes}"):
        plan_buckets(shapes, torch.float32, 1000)
    buckets = plan_buckets(shapes, torch.bfloat16, BUCKET)  # every tensor once, in order, offsets aligned
    assert [b[0] for bucket in buckets for b in bucket] == [n for n, _ in shapes]
    assert all(off % 64 == 0 for bucket in buckets for _, _, off in bucket)


def test_a_partial_update_marks_the_engine_torn_until_finished(tiny_policy):
    model, tok = tiny_policy
    engine = HFGenerationEngine(copy.deepcopy(model), tok)
    engine.finish_weight_update(1)
    pairs = iter(list(model.named_parameters())[:3])       # a generator: consumed pair by pair
    engine.update_weights(pairs, source="bucket 0", partial=True)
    assert engine.version is None
    with pytest.raises(RuntimeError, match=r"partial weight update \(last: bucket 0\)"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.finish_weight_update(2)
    assert engine.version == 2 and len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))) == 1

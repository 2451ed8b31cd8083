"""Seconds and bytes per weight sync, trainer -> one HF generation engine in another process, CPU:

  (a) store   today's hand-off: save float32 safetensors, publish to a local ArtifactStore (sha256 +
              copy), fetch (copy + sha256 check), `load_weights` into the engine
  (b) live    the model update group (engines/weight_sync/update_group.py), gloo broadcast over loopback TCP
  (c) shm     the same group, same-node path: one bucket buffer in /dev/shm, gloo only for signals

for the tiny preset model, SmolLM2-135M's shape and random-init Qwen2.5-0.5B / -1.5B shapes, in one
run, side by side. The engine holds bf16 weights (the generation side's dtype), so (b) and (c) move
bf16 bytes; (a) moves what the store holds today, float32. Prints a table; asserts nothing.

    .venv/bin/python -m benchmarks.weight_sync                          # all four shapes
    .venv/bin/python -m benchmarks.weight_sync --models tiny smollm2    # a subset

A shape whose processes would not fit the free memory (trainer fp32 + engine bf16 + the fp32 state
dict `load_weights` reads) is skipped with the reason printed."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from engines.generation.engine import HFGenerationEngine
from engines.models.modeling import build_tiny_policy
from engines.weight_sync.update_group import ModelUpdateGroup
from infra.store import ArtifactStore

SHAPES = {
    "tiny": None,  # engines.models.modeling.build_tiny_policy() defaults (configs/tiny.yaml's bootstrap)
    "smollm2-135m": LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048),
    "qwen2.5-0.5b": Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=2048),
    "qwen2.5-1.5b": Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=2048),
}
ALIASES = {"smollm2": "smollm2-135m", "qwen0.5b": "qwen2.5-0.5b", "qwen1.5b": "qwen2.5-1.5b"}


def build(shape: str, dtype: torch.dtype, seed: int):
    """A random-init model of that shape (weights ~ N(0, 0.02): init is not what is measured)."""
    if SHAPES[shape] is None:
        return build_tiny_policy(seed=seed)[0].to(dtype)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(SHAPES[shape], dtype=dtype)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.tie_weights()
    return model


def engine_process(shape: str, threads: int, conn) -> None:
    """The generation side: one bf16 HF engine; runs the commands the trainer sends, answers seconds."""
    torch.set_num_threads(threads)
    engine = HFGenerationEngine(build(shape, torch.bfloat16, seed=1), tokenizer=None)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            return
        start = time.perf_counter()
        if cmd[0] == "store":
            _, root, key, local = cmd
            ArtifactStore(root).fetch(key, local)
            fetched = time.perf_counter()
            engine.load_weights(local)
            conn.send((fetched - start, time.perf_counter() - fetched))
        else:
            _, port, transport = cmd
            group = ModelUpdateGroup("127.0.0.1", port, 2, 1, transport=transport, timeout_s=600)
            version = group.receive(engine)
            group.close()
            conn.send((version, time.perf_counter() - start))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def measure(shape: str, threads: int, bucket_bytes: int) -> list[dict]:
    trainer = build(shape, torch.float32, seed=0)
    params = sum(p.numel() for p in trainer.parameters())
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=engine_process, args=(shape, threads, there), daemon=True)
    proc.start()
    assert here.recv() == "ready"
    rows, tmp = [], tempfile.mkdtemp(prefix="flyroll-wsync-bench-")
    try:
        # (a) today: save + publish (sha256 + copy) + fetch (copy + sha256) + load_weights
        t0 = time.perf_counter()
        trainer.save_pretrained(os.path.join(tmp, "ckpt"), safe_serialization=True)
        t1 = time.perf_counter()
        ArtifactStore(os.path.join(tmp, "store")).publish(os.path.join(tmp, "ckpt"), "runs/bench/policy/v0001",
                                                          kind="policy", producer="benchmarks/weight_sync.py")
        t2 = time.perf_counter()
        here.send(("store", os.path.join(tmp, "store"), "runs/bench/policy/v0001", os.path.join(tmp, "fetched")))
        fetch_s, load_s = here.recv()
        nbytes = sum(os.path.getsize(os.path.join(tmp, "ckpt", f)) for f in os.listdir(os.path.join(tmp, "ckpt"))
                     if f.endswith(".safetensors"))
        rows.append(dict(path="(a) store", seconds=t2 - t0 + fetch_s + load_s, bytes=nbytes,
                         detail=f"save {t1 - t0:.2f} + publish {t2 - t1:.2f} + fetch {fetch_s:.2f} + load {load_s:.2f}"))
        shutil.rmtree(tmp, ignore_errors=True)
        # (b) live broadcast and (c) same-node shared memory, bf16 on the wire
        for label, transport in (("(b) live gloo", "broadcast"), ("(c) shm", "shm")):
            port = free_port()
            here.send(("live", port, transport))
            group = ModelUpdateGroup("127.0.0.1", port, 2, 0, transport=transport, timeout_s=600)
            report = group.send(trainer.named_parameters(), version=len(rows) + 1, dtype="bfloat16", bucket_bytes=bucket_bytes)
            group.close()
            version, _ = here.recv()
            assert version == report.version
            rows.append(dict(path=label, seconds=report.seconds, bytes=report.bytes, detail=f"{report.buckets} buckets"))
    finally:
        here.send(("quit",))
        proc.join(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    return [dict(model=shape, params=params, **r) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each of the two processes")
    ap.add_argument("--bucket-mb", type=int, default=512, help="bucket size (MiB); must hold the largest tensor")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} torch thread(s) per process, {os.cpu_count()} cores on this box "
          f"(shared with other jobs: figures are indicative), bucket {args.bucket_mb} MiB, engine dtype bf16")
    with tempfile.TemporaryDirectory() as warm:  # first save_pretrained pays one-off imports: not measured
        build("tiny", torch.float32, 0).save_pretrained(warm, safe_serialization=True)
    rows = []
    for name in args.models:
        shape = ALIASES.get(name, name)
        trainer_bytes = 4 * (sum(p.numel() for p in build(shape, torch.float32, 0).parameters()) if shape == "tiny"
                             else _params(SHAPES[shape]))
        need = trainer_bytes * 2 + trainer_bytes // 2 + (args.bucket_mb << 20)   # fp32 trainer + fp32 state dict + bf16 engine
        if need > available_bytes():
            print(f"skipped {shape}: needs ~{need / 1e9:.1f} GB, {available_bytes() / 1e9:.1f} GB available")
            continue
        rows += measure(shape, args.threads, args.bucket_mb << 20)
        for r in rows[-3:]:
            print(f"  {r['model']:>13} {r['path']:<14} {r['seconds']:8.2f} s  {r['bytes'] / 1e9:6.3f} GB  {r['detail']}", flush=True)
    print("\n| model | params | (a) store s | (b) live gloo s | (c) shm s | (a) bytes fp32 | (b)/(c) bytes bf16 | (a)/(b) | (a)/(c) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in dict.fromkeys(r["model"] for r in rows):
        a, b, c = (next(r for r in rows if r["model"] == shape and r["path"].startswith(p)) for p in ("(a)", "(b)", "(c)"))
        print(f"| {shape} | {a['params'] / 1e6:.0f}M | {a['seconds']:.2f} | {b['seconds']:.2f} | {c['seconds']:.2f} | "
              f"{a['bytes'] / 1e9:.3f} GB | {b['bytes'] / 1e9:.3f} GB | {a['seconds'] / b['seconds']:.1f}x | {a['seconds'] / c['seconds']:.1f}x |")


def _params(cfg) -> int:
    h, layers, inter, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    return vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h) + h


if __name__ == "__main__":
    main()

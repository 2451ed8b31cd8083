"""Training-step MFU (bf16) and HF-engine generation throughput on one GPU, for a model with
Qwen2.5-0.5B's shape (random init: no weights to download). Prints a short table; asserts nothing.

    python benchmarks/gpu_mfu.py                     # on a CUDA machine, from the repository root (~2-4 min on an H200)
    python benchmarks/gpu_mfu.py --smoke             # CPU, a shrunk model: checks the script runs (seconds)
    python benchmarks/gpu_mfu.py --peak-tflops 756   # another GPU (here: H100 PCIe dense bf16)

Training: two shapes (sequences x tokens per sequence, half prompt, half response), each timed both
as a plain causal-LM step (HF cross-entropy forward + backward + AdamW) and as flyroll's GRPO actor
step (`engines/training.py TorchTrainEngine.train_step`: response log-probs and entropy in float32,
PPO-clip loss, AdamW), all parameters in bf16. MFU = 6 * N * tokens / step time / peak, with N
the parameter count (tied embedding counted once, so the LM head's matmul is in) and tokens every
token of the batch; attention's quadratic FLOPs are left out (~9% more at 1k tokens for this
shape), so the MFU here is a slight underestimate.

Generation: `engines/generation.py HFGenerationEngine` (transformers `generate`, KV cache, per-token
log-probs over the full vocabulary), 64 random prompts of 128 tokens, 128 new tokens each,
temperature 1, bf16: generated tokens/s.

Peak dense bf16 FLOP/s: H200 and H100 SXM 989 TFLOP/s (NVIDIA's datasheet, without sparsity);
A100 312. Another GPU: --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SMOKE_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
TRAIN_SHAPES = [(16, 1024), (32, 2048)]   # (sequences, tokens per sequence)
GEN_SHAPE = (64, 128, 128)                 # (prompts, prompt tokens, new tokens)
SMOKE_TRAIN_SHAPES, SMOKE_GEN_SHAPE = [(2, 32)], (4, 8, 8)


class _IdTokenizer:
    """What HFGenerationEngine asks of a tokenizer, for a model without one: pad/eos ids, decode."""

    def __init__(self, vocab_size: int):
        self.pad_token_id, self.eos_token_id = 0, vocab_size - 1

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def build_model(shape: dict, device, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, pad_token_id=0, eos_token_id=shape["vocab_size"] - 1, bos_token_id=None)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    return model


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(fn, device, warmup: int, steps: int) -> float:
    """Mean seconds of `fn()` over `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


def train_rows(model, shapes, device, warmup: int, steps: int, micro_tokens: int) -> list[dict]:
    import torch

    from configs.algorithm import AlgorithmConfig
    from engines.batching import TokenBatch
    from engines.training import TorchTrainEngine

    V = model.config.vocab_size
    rows = []
    for B, S in shapes:
        P, T = S // 2, S - S // 2
        g = torch.Generator().manual_seed(B * S)
        ids = torch.randint(1, V - 1, (B, S), generator=g)
        batch = TokenBatch(ids, torch.ones_like(ids), torch.arange(S).expand(B, S).contiguous(), ids[:, P:].clone(),
                           torch.ones(B, T))
        adv = torch.randn(B, T, generator=g)                 # [B, T]
        old = -torch.rand(B, T, generator=g) * 10            # [B, T]
        cfg = AlgorithmConfig(advantage="grpo", use_kl_loss=False, kl_coef=0.0)
        engine = TorchTrainEngine(model, lr=1e-6)

        def grpo_step():
            engine.train_step(batch, adv, old, None, cfg, mini_batch_size=B, max_tokens_per_micro_batch=micro_tokens)

        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        rows_per_micro = max(1, micro_tokens // S)
        dev_ids = ids.to(device)

        def ce_step():
            opt.zero_grad(set_to_none=True)
            for s in range(0, B, rows_per_micro):
                x = dev_ids[s : s + rows_per_micro]
                (model(input_ids=x, labels=x).loss * len(x) / B).backward()
            opt.step()

        for name, fn in (("train: causal-LM CE step", ce_step), ("train: flyroll GRPO step", grpo_step)):
            dt = time_steps(fn, device, warmup, steps)
            rows.append({"what": name, "shape": f"{B} x {S} tok", "s": dt, "tokens": B * S, "tokens_per_s": B * S / dt,
                         "flops": 6 * n_params(model) * B * S})
        if device.type == "cuda":  # the next shape's optimizers replace these (the closures share their names)
            torch.cuda.empty_cache()
    return rows


def generation_row(model, shape, device, steps: int) -> dict:
    import torch

    from engines.generation import HFGenerationEngine, SamplingParams

    n_prompts, prompt_len, new = shape
    V = model.config.vocab_size
    engine = HFGenerationEngine(model, _IdTokenizer(V), micro_batch=n_prompts)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, V - 1, (n_prompts, prompt_len), generator=g).tolist()
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=new, seed=0)
    engine.generate(prompts, params)  # warm-up
    sync(device)
    t0, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(c.token_ids) for c in engine.generate(prompts, params))
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    return {"what": "generate: HF engine", "shape": f"{n_prompts} x {prompt_len}+{new} tok", "s": dt,
            "tokens": tokens / steps, "tokens_per_s": tokens / steps / dt, "flops": 2 * n_params(model) * tokens / steps}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU-capable run on a shrunk model (checks the script, measures nothing useful)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this GPU in TFLOP/s (default: by device name)")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps per shape (after 2 warm-up steps)")
    ap.add_argument("--gen-steps", type=int, default=3, help="timed generate calls (after 1 warm-up)")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="tokens per forward/backward (gradient accumulation above)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    import torch

    if args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shape, train_shapes, gen_shape, warmup, steps, gen_steps = SMOKE_MODEL, SMOKE_TRAIN_SHAPES, SMOKE_GEN_SHAPE, 1, 1, 1
    else:
        if not torch.cuda.is_available():
            print("benchmarks/gpu_mfu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "use --smoke to check the script on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        shape, train_shapes, gen_shape, warmup, steps, gen_steps = QWEN25_05B, TRAIN_SHAPES, GEN_SHAPE, 2, args.steps, args.gen_steps
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(name, args.peak_tflops) if device.type == "cuda" else None
    t_start = time.perf_counter()
    model = build_model(shape, device, dtype)
    N = n_params(model)
    print(f"device {name}, torch {torch.__version__}, {dtype}, model {'Qwen2.5-0.5B shape' if not args.smoke else 'smoke'} "
          f"random init, N = {N / 1e6:.1f}M parameters, peak bf16 {peak or '?'} TFLOP/s", flush=True)
    rows = train_rows(model, train_shapes, device, warmup, steps, args.micro_tokens)
    if device.type == "cuda":
        print(f"peak GPU memory in training: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    rows.append(generation_row(model.eval(), gen_shape, device, gen_steps))
    for r in rows:
        r["tflops"] = r["flops"] / r["s"] / 1e12
        r["mfu"] = r["tflops"] / peak if peak else None
    print(f"\n| what | batch | s | tokens/s | TFLOP/s | MFU (6N/2N, peak {peak or '?'}) |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        mfu = "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"| {r['what']} | {r['shape']} | {r['s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} |")
    print(f"\n(generation MFU uses 2N FLOPs per generated token; total {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "params": N, "peak_tflops": peak, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training-step MFU (bf16) and HF-engine generation throughput on one GPU, for a model with
Qwen2.5-0.5B's shape (random init: no weights to download). Prints a short table; asserts nothing.

    python benchmarks/gpu_mfu.py                     # on a CUDA machine, from the repository root (~2-4 min on an H200)
    python benchmarks/gpu_mfu.py --smoke             # CPU, a shrunk model: checks the script runs (seconds)
    python benchmarks/gpu_mfu.py --peak-tflops 756   # another GPU (here: H100 PCIe dense bf16)
    python benchmarks/gpu_mfu.py --compile           # + the first training shape with training.compile (and variants)
    python benchmarks/gpu_mfu.py --quick             # the first training shape only, no generation (benchmarks/gpu_check.sh)
    python benchmarks/gpu_mfu.py --mixed             # float32 master weights + bf16 autocast, as the pipeline trains

Training: two shapes (sequences x tokens per sequence, half prompt, half response), each timed both
as a plain causal-LM step (HF cross-entropy forward + backward + AdamW) and as flyroll's GRPO actor
step (`engines/training/update.py TorchTrainEngine.train_step`: response log-probs and entropy in float32,
PPO-clip loss, AdamW), all parameters in bf16. MFU = 6 * N * tokens / step time / peak, with N
the parameter count (tied embedding counted once, so the LM head's matmul is in) and tokens every
token of the batch; attention's quadratic FLOPs are left out (~9% more at 1k tokens for this
shape), so the MFU here is a slight underestimate.

Generation: `engines/generation/engine.py HFGenerationEngine` (transformers `generate`, KV cache, per-token
log-probs over the full vocabulary), temperature 1, bf16, generated tokens/s, in two shapes: 64
random prompts of 128 tokens, one sample each, 128 new tokens; and GRPO's shape, 16 prompts x 8
samples (the prompt prefilled once and its KV cache shared by the group), 128 new tokens, once as
is and once with `compile_decode` (transformers' compiled decode; its first call, the compile, is
timed apart, then one call with narrower prompts in the same cache bucket shows the graph reused).

Also measured: this GPU's bf16 matmul rate (8192^3, the mean of 10 after 3 warm-ups), printed
beside the datasheet peak so the MFU can be read against either.

Peak dense bf16 FLOP/s: H200 and H100 SXM 989 TFLOP/s (NVIDIA's datasheet, without sparsity);
A100 312. Another GPU: --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SMOKE_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
TRAIN_SHAPES = [(16, 1024), (32, 2048)]   # (sequences, tokens per sequence)
GEN_SHAPES = [(64, 1, 128, 128), (16, 8, 128, 128)]   # (prompts, samples per prompt, prompt tokens, new tokens)
SMOKE_TRAIN_SHAPES, SMOKE_GEN_SHAPES = [(2, 32)], [(4, 1, 8, 8), (2, 2, 8, 8)]  # the last shape runs again compiled


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


def isolated(what: str, shape: str, measure) -> dict:
    """`measure()`'s row, or a row naming the error (printed with its traceback): one failing
    measurement does not lose the others of a run on a lent GPU."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 (reported in the table and the exit status)
        traceback.print_exc()
        return {"what": what, "shape": shape, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def train_rows(model, shapes, device, warmup: int, steps: int, micro_tokens: int, compile: str = "off",
               group: int = 1, ce: bool = True, shared_prefix: bool = True, prompt_share: float = 0.5,
               compute_dtype=None) -> list[dict]:
    """GRPO step rows (and, with `ce`, the causal-LM CE step) per (sequences, tokens) shape.
    `group` > 1: rows share their prompt in groups of that size, as GRPO's samples do (the update
    then runs each prompt once, engines/models/batching.py shared prefix, unless `shared_prefix` is off).
    `compile`: "layers" = the engine's `training.compile` (engines/training/update.py
    compile_decoder_layers: whole layers, plain forwards); "mlp" = a variant tried and not kept:
    each layer's children but its attention (MLP, norms) compiled here, keeping the shared prefix;
    "off". Compiling is in place. `prompt_share`: the prompt's part of each sequence's tokens."""
    import torch

    from benchmarks.engine_settings import algorithm  # plain values: no pydantic on the GPU box
    from engines.models.batching import TokenBatch
    from engines.models.devices import mixed_precision
    from engines.training.update import TorchTrainEngine

    V = model.config.vocab_size
    suffix = ((f", {group} samples per prompt" if group > 1 else "") + (f", prompt {prompt_share:.0%}" if prompt_share != 0.5 else "")
              + (", shared prefix off" if group > 1 and not shared_prefix and compile != "layers" else "")
              + {"off": "", "layers": ", training.compile", "mlp": ", MLPs + norms compiled"}[compile])
    rows = []
    for B, S in shapes:
        P = int(S * prompt_share)
        T = S - P
        g = torch.Generator().manual_seed(B * S)
        ids = torch.randint(1, V - 1, (B, S), generator=g)
        ids[:, :P] = ids[:: group, :P].repeat_interleave(group, dim=0)[:B]   # prompts shared within each group
        batch = TokenBatch(ids, torch.ones_like(ids), torch.arange(S).expand(B, S).contiguous(), ids[:, P:].clone(),
                           torch.ones(B, T))
        adv = torch.randn(B, T, generator=g)                 # [B, T]
        old = -torch.rand(B, T, generator=g) * 10            # [B, T]
        cfg = algorithm(advantage="grpo", use_kl_loss=False, kl_coef=0.0)
        if compile == "mlp":
            for layer in model.get_decoder().layers:
                for n, child in layer.named_children():
                    if n != "self_attn":
                        child.compile()
        engine = TorchTrainEngine(model, lr=1e-6, compile=compile == "layers", compute_dtype=compute_dtype)
        engine.shared_prefix = engine.shared_prefix and shared_prefix

        def grpo_step():
            engine.train_step(batch, adv, old, None, cfg, mini_batch_size=B, max_tokens_per_micro_batch=micro_tokens)

        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # as the engine's (fused on plain tensors)
        rows_per_micro = max(1, micro_tokens // S)
        dev_ids = ids.to(device)

        def ce_step():
            opt.zero_grad(set_to_none=True)
            for s in range(0, B, rows_per_micro):
                x = dev_ids[s : s + rows_per_micro]
                with mixed_precision(device, compute_dtype):
                    loss = model(input_ids=x, labels=x, use_cache=False).loss
                (loss * len(x) / B).backward()  # no KV cache in training
            opt.step()

        steps_to_time = ([("train: causal-LM CE step" + suffix, ce_step)] if ce else []) + [("train: flyroll GRPO step" + suffix, grpo_step)]
        for name, fn in steps_to_time:
            def row(fn=fn, name=name):
                t0 = time.perf_counter()
                fn()  # the first step (with compile: the compile) timed apart
                sync(device)
                first = time.perf_counter() - t0
                dt = time_steps(fn, device, warmup - 1, steps)
                return {"what": name, "shape": f"{B} x {S} tok", "s": dt, "tokens": B * S, "tokens_per_s": B * S / dt,
                        "flops": 6 * n_params(model) * B * S, "first_call_s": first}
            rows.append(isolated(name, f"{B} x {S} tok", row))
        if device.type == "cuda":  # the next shape's optimizers replace these (the closures share their names)
            torch.cuda.empty_cache()
    return rows


def uncompile(model) -> None:
    """Undo `nn.Module.compile` on every submodule (so the next scope is measured alone)."""
    for m in model.modules():
        m._compiled_call_impl = None


def generation_row(model, shape, device, steps: int, compile_decode: bool = False) -> dict:
    """Generated tokens/s of `steps` generate calls after a warm-up call (timed apart: with
    `compile_decode` it compiles); compiled, one more call with prompts of another width whose
    cache length falls in the same bucket (fast = the compiled graph was reused)."""
    import torch

    from engines.generation.engine import CACHE_BUCKET, HFGenerationEngine, SamplingParams

    n_prompts, n, prompt_len, new = shape
    V = model.config.vocab_size
    engine = HFGenerationEngine(model, _IdTokenizer(V), micro_batch=n_prompts, compile_decode=compile_decode)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, V - 1, (n_prompts, prompt_len), generator=g).tolist()
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, seed=0)
    t0 = time.perf_counter()
    engine.generate(prompts, params)  # warm-up (and compile)
    sync(device)
    first = time.perf_counter() - t0
    t0, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(c.token_ids) for c in engine.generate(prompts, params))
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    row = {"what": "generate: HF engine" + (", compiled decode" if compile_decode else ""),
           "shape": f"{n_prompts} x {n} x {prompt_len}+{new} tok", "s": dt, "first_call_s": first,
           "tokens": tokens / steps, "tokens_per_s": tokens / steps / dt, "flops": 2 * n_params(model) * tokens / steps}
    if compile_decode:
        other = [p[: prompt_len - min(16, prompt_len // 2)] for p in prompts]  # narrower prompts,
        assert (prompt_len + new - 1) // CACHE_BUCKET == (len(other[0]) + new - 1) // CACHE_BUCKET  # same cache bucket
        t0 = time.perf_counter()
        engine.generate(other, params)
        sync(device)
        row["other_width_call_s"] = time.perf_counter() - t0
        row["other_width"] = len(other[0])
    return row


def matmul_tflops(device, n: int = 8192, reps: int = 10) -> float:
    """Measured bf16 GEMM rate of this GPU (n^3 product on random data, mean of `reps` after 3 warm-ups)."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    dt = time_steps(lambda: a @ b, device, 3, reps)
    return 2 * n**3 / dt / 1e12


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
    ap.add_argument("--compile", action="store_true",
                    help="then the first training shape again with training.compile (compiled decoder layers, "
                         "plain forwards) and a variant compiling only MLPs and norms, and with prompts shared by "
                         "groups of 8 samples at 50%% and 75%% prompt (eager with and without the shared prefix, "
                         "the MLP variant, training.compile); first steps (the compile) timed apart")
    ap.add_argument("--quick", action="store_true", help="only the first training shape (both steps), no generation rows")
    ap.add_argument("--mixed", action="store_true",
                    help="float32 parameters and AdamW state with bf16 autocast forwards (what placement.actor_train.dtype "
                         "bfloat16 runs, engines/models/devices.py) instead of all parameters in bf16; generation rows then run float32")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    import torch

    if args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shape, train_shapes, gen_shapes, warmup, steps, gen_steps = SMOKE_MODEL, SMOKE_TRAIN_SHAPES, SMOKE_GEN_SHAPES, 1, 1, 1
    else:
        if not torch.cuda.is_available():
            print("benchmarks/gpu_mfu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "use --smoke to check the script on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        shape, train_shapes, gen_shapes, warmup, steps, gen_steps = QWEN25_05B, TRAIN_SHAPES, GEN_SHAPES, 2, args.steps, args.gen_steps
    if args.quick:
        train_shapes, gen_shapes = train_shapes[:1], []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compute_dtype = None
    if args.mixed:  # the pipeline's training path: float32 weights and AdamW state, bf16 autocast forwards
        dtype, compute_dtype = torch.float32, torch.bfloat16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(name, args.peak_tflops) if device.type == "cuda" else None
    t_start = time.perf_counter()
    measured = matmul_tflops(device) if device.type == "cuda" else None
    model = build_model(shape, device, dtype)
    N = n_params(model)
    import transformers

    precision = f"{dtype} weights" + (f", {compute_dtype} autocast" if compute_dtype is not None else "")
    print(f"device {name}, torch {torch.__version__}, transformers {transformers.__version__}, {precision}, "
          f"model {'Qwen2.5-0.5B shape' if not args.smoke else 'smoke'} random init, N = {N / 1e6:.1f}M parameters, "
          f"peak bf16 {peak or '?'} TFLOP/s (datasheet), measured 8192^3 bf16 matmul "
          f"{f'{measured:.0f}' if measured else '?'} TFLOP/s", flush=True)
    rows = train_rows(model, train_shapes, device, warmup, steps, args.micro_tokens, compute_dtype=compute_dtype)
    if device.type == "cuda":
        print(f"peak GPU memory in training: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    model.eval()
    for gen_shape, compiled in [*((s, False) for s in gen_shapes), *((gen_shapes[-1], True) for _ in gen_shapes[-1:])]:
        rows.append(isolated("generate: HF engine" + (", compiled decode" if compiled else ""), "x".join(map(str, gen_shape)),
                             lambda: generation_row(model, gen_shape, device, gen_steps, compiled)))
    if args.compile:  # last: generation above ran the eager layers
        model.train()
        B, S = train_shapes[0]
        group = 8 if B % 8 == 0 else 1
        plan = [dict(compile="layers", ce=True), dict(compile="mlp"),                 # every row its own prompt
                *(dict(compile=c, group=group, shared_prefix=sp, prompt_share=ps)      # GRPO groups
                  for ps in (0.5, 0.75) for c, sp in (("off", True), ("off", False), ("mlp", True), ("layers", False)))]
        for kw in plan:
            uncompile(model)
            rows += train_rows(model, [(B, S)], device, warmup, steps, args.micro_tokens, ce=kw.pop("ce", False), **kw)
        uncompile(model)
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    for r in rows:
        r["tflops"] = r["flops"] / r["s"] / 1e12
        r["mfu"] = r["tflops"] / peak if peak else None
        r["of_measured"] = r["tflops"] / measured if measured else None
    pct = lambda x: "—" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    print(f"\n| what | batch | s | tokens/s | TFLOP/s | MFU (6N/2N, peak {peak or '?'}) | of measured matmul "
          f"({f'{measured:.0f}' if measured else '?'}) |\n|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['what']} | {r['shape']} | {r['s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
              f"{pct(r['mfu'])} | {pct(r['of_measured'])} |")
    for r in rows:
        if "first_call_s" in r:
            print(f"{r['what']}, {r['shape']}: first call {r['first_call_s']:.1f} s"
                  + (f"; a call with {r['other_width']}-token prompts (same cache bucket) {r['other_width_call_s']:.2f} s"
                     if "other_width" in r else ""))
    for r in failed:
        print(f"| {r['what']} | {r['shape']} | failed: {r['error']} | | | | |")
    print(f"\n(generation MFU uses 2N FLOPs per generated token; total {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "precision": precision, "params": N, "peak_tflops": peak, "measured_matmul_tflops": measured, "rows": rows,
                       "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

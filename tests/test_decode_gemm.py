"""The decode GEMM (oasiskv/kernels/decode_gemm.py) against a float64 product, under Triton's
CPU interpreter (a subprocess, as in test_kernels.py), on random inputs: every split count,
ragged N, bias, rows from 1 to 64, and repeated launches (the arrival counters must come back
to zero). bf16 is checked on the GPU machine (scripts/gpu_check_gemm.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from triton_interpreter import run_under_interpreter

from oasiskv.kernels.decode_gemm import GemmTiling, decode_linear, supports

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}
CASES = {  # id: (M, N, K, dtype, bias, tiling)
    "m1_split4_bias_fp32": (1, 100, 256, torch.float32, True, GemmTiling(block_n=32, block_k=32, split_k=4, stages=2)),
    "m16_split1_fp16": (16, 64, 128, torch.float16, False, GemmTiling(block_n=16, block_k=32, split_k=1, stages=2)),
    "m33_split3_ragged_fp32": (33, 70, 192, torch.float32, False, GemmTiling(block_n=32, block_k=32, split_k=3, stages=2)),
    "m64_split2_bias_fp16": (64, 48, 128, torch.float16, True, GemmTiling(block_n=16, block_k=64, split_k=2, stages=2)),
}


def run_interpreter_cases() -> dict[str, float]:
    errors = {}
    for name, (M, N, K, dtype, bias, tiling) in CASES.items():
        gen = torch.Generator().manual_seed(len(name))
        x = torch.randn(M, K, generator=gen).to(dtype)
        w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
        b = torch.randn(N, generator=gen).to(dtype) if bias else None
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        worst = 0.0
        for _ in range(3):  # a stale counter would skip or repeat the final sum
            y = decode_linear(x, w, b, tiling)
            assert y.dtype == dtype and y.shape == (M, N)
            worst = max(worst, ((y.double() - ref).norm() / ref.norm()).item())
        errors[name] = worst
    return errors


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(__file__)


@pytest.mark.parametrize("name", list(CASES), ids=str)
def test_decode_gemm_interpreter(interpreter_errors, name):
    assert interpreter_errors[name] < TOL[CASES[name][3]]


def test_unsupported_shapes_take_the_reference():
    """Prefill-sized inputs, a K the splits do not divide, and CPU tensors go to F.linear."""
    t = GemmTiling(block_k=64, split_k=4)
    x, w = torch.randn(65, 256), torch.randn(8, 256)
    assert not supports(x, w, t)  # too many rows
    assert not supports(torch.randn(4, 200), torch.randn(8, 200), t)  # 200 % 256 != 0
    assert supports(torch.randn(4, 256), w, t)
    torch.testing.assert_close(decode_linear(x, w, None, t), x @ w.T)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))

"""The decode-batch linear (kernels/skinny_gemm.py) against torch's, under the Triton
interpreter: rows from 1 to 64, K split into slices (a last one cut short), N not a multiple
of the tile, with and without bias, in float32 (the interpreter reads bfloat16 wrongly:
scripts/gpu_skinny_gemm.py checks it on the GPU)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from oasiskv.kernels import skinny_gemm
from triton_interpreter import run_under_interpreter

CASES = {"one_row": (1, 200, 512, False, "float32"), "rows_48_split": (48, 96, 1152, True, "float32"),
         "rows_64_bias": (64, 130, 640, True, "float32")}
TOL = {"float32": 1e-4}


def run_interpreter_cases() -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    errors = {}
    for name, (M, N, K, bias, dtype) in CASES.items():
        dt = getattr(torch, dtype)
        x = torch.randn(M, K, generator=gen).to(dt)
        w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dt)
        b = torch.randn(N, generator=gen).to(dt) if bias else None
        got = skinny_gemm.skinny_linear(x, w, b).float()
        errors[name] = float((got - skinny_gemm.reference(x, w, b).float()).abs().max() / TOL[dtype])
    return errors


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_skinny_linear_matches_torch_interpreter(interpreter_errors, name):
    assert interpreter_errors[name] < 1.0


def test_slices_keep_programs_per_sm():
    assert skinny_gemm.split_k(12288, 64, 132) == 5  # the down projection of Qwen3-8B: 64 tiles
    assert skinny_gemm.split_k(4096, 384, 132) == 1  # gate/up: enough tiles already
    assert skinny_gemm.split_k(512, 4, 132) == 1  # short K: at least 4 steps a slice


def test_disabled_or_on_cpu_it_is_the_module():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    skinny_gemm.ENABLED.add("down")
    try:
        assert torch.equal(skinny_gemm.linear(lin, x, "down"), lin(x))  # CPU tensors: torch
    finally:
        skinny_gemm.ENABLED.discard("down")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(run_interpreter_cases()))

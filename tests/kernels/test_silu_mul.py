"""The prefill SiLU-and-multiply kernel (oasiskv/kernels/silu_mul.py) against torch, under
Triton's CPU interpreter (a subprocess): a width that is not a multiple of the column block,
rows inside a wider buffer, float32 and bfloat16; and the dispatch by row count."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_under_interpreter

from oasiskv.layers import fused


def compare() -> dict:
    from oasiskv.kernels.silu_mul import silu_mul_triton
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, (T, N, dtype) in {"fp32": (3, 1500, torch.float32), "bf16": (5, 2048, torch.bfloat16)}.items():
        wide = (torch.randn(T, 2 * N + 7, generator=gen) * 3).to(dtype)
        x = wide[:, 3:3 + 2 * N]  # rows strided
        ref = (F.silu(x[:, :N].float()) * x[:, N:].float()).to(dtype)
        got = silu_mul_triton(x)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: one rounding step apart at most
        out[name] = (got.shape == ref.shape) and torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
    return out


@pytest.mark.slow
def test_silu_mul_kernel_matches_torch():
    assert run_under_interpreter(__file__) == {"fp32": True, "bf16": True}


def test_only_long_inputs_on_cuda_take_the_kernel(monkeypatch):
    seen = []
    monkeypatch.setattr(fused, "silu_mul_triton", lambda x: seen.append(x.shape) or x[:, :x.shape[1] // 2])
    x = torch.randn(fused.SILU_MUL_KERNEL_ROWS, 8)
    torch.testing.assert_close(fused.silu_mul(x), F.silu(x[:, :4]) * x[:, 4:])  # CPU: torch
    assert not seen


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    print(json.dumps(compare()))

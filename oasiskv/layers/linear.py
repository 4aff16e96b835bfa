"""The decoder's projections: nn.Linear, whose decode-sized products (a few rows) can take the
skinny Triton GEMM (`oasiskv/kernels/decode_gemm.py`) instead of cuBLAS."""
from __future__ import annotations

import torch
from torch import nn

from oasiskv.kernels.decode_gemm import MAX_ROWS, decode_linear

DECODE_GEMMS = ("auto", "triton", "cublas")  # auto: triton on CUDA


class Linear(nn.Linear):
    skinny = False  # set per model by `use_decode_gemm`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return decode_linear(x, self.weight, self.bias)
        return super().forward(x)


def use_decode_gemm(model: nn.Module, choice: str, device: torch.device) -> None:
    """Route the model's decode products to the Triton GEMM (triton; auto on CUDA) or cuBLAS.
    Captured graphs keep the kernels they were captured with: capture after this."""
    if choice not in DECODE_GEMMS:
        raise ValueError(f"decode_gemm must be one of {', '.join(DECODE_GEMMS)}, got {choice!r}")
    skinny = choice == "triton" or (choice == "auto" and device.type == "cuda")
    for m in model.modules():
        if isinstance(m, Linear):
            m.skinny = skinny

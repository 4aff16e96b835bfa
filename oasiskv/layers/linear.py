"""Linear layers whose products over many rows can run in row slices.

On the H200, cuBLAS picks a different tile for a 32K-row bf16 product than for a 4K-row one,
and the 4K-row products of a prefill's linears took 0.613 s against 0.637 s for the same
FLOPs in 32K-row ones (docs/benchmarks.md, "Long-prompt prefill"). `OASISKV_GEMM_MAX_ROWS=N`
runs a product of more than N rows as slices of N rows, each into its part of one output.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = int(os.environ.get("OASISKV_GEMM_MAX_ROWS", "0"))  # 0: one product whatever the rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int | None = None) -> torch.Tensor:
    """F.linear over a 2-D x, in slices of `max_rows` rows (default MAX_ROWS) when it has more."""
    rows = MAX_ROWS if max_rows is None else max_rows
    if not rows or x.dim() != 2 or x.shape[0] <= rows:
        return F.linear(x, weight, bias)
    out = x.new_empty(x.shape[0], weight.shape[0])
    for start in range(0, x.shape[0], rows):
        part = out[start:start + rows]
        if bias is None:
            torch.mm(x[start:start + rows], weight.t(), out=part)
        else:
            torch.addmm(bias, x[start:start + rows], weight.t(), out=part)
    return out


class Linear(nn.Linear):
    """nn.Linear through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

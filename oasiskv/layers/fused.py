"""Elementwise pieces of a decoder layer, fused into one kernel each on CUDA by torch.compile.

A decode step at batch 16 spends as long launching ~50 tiny elementwise kernels per layer
as reading the weights; fusing norm, residual and SiLU cuts that to a handful. On CPU
(tests, the HF reference comparisons) the same functions run eagerly. The per-head q/k norm
and RoPE run inside the qkv epilogue kernel (kernels/qkv_epilogue.py); the norm's math, `rms`,
is shared with that kernel's reference (kernels/reference.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from oasiskv.kernels.reference import rms
from oasiskv.kernels.silu_mul import silu_mul_triton


def cuda_compiled(fn):
    compiled = None

    @functools.wraps(fn)
    def wrapper(x, *args):
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(x, *args)
    return wrapper


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms(x, weight, eps)


@cuda_compiled
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm(x + residual), x + residual): the residual stream stays in the model dtype."""
    s = x + residual
    return rms(s, weight, eps), s


# Rows from which silu_mul takes the Triton kernel (a prefill's chunk) over the compiled one.
SILU_MUL_KERNEL_ROWS = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda and gate_up.dim() == 2 and gate_up.shape[0] >= SILU_MUL_KERNEL_ROWS \
            and gate_up.stride(1) == 1:
        return silu_mul_triton(gate_up)
    return _silu_mul(gate_up)


@cuda_compiled
def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

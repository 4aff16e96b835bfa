"""Skinny matrix products for decode: y = x @ W^T (+ bias) with few rows of x (a decode
batch: M <= 64) and a large weight, so the product only streams W once from HBM.

cuBLAS picks one wave of large tiles for these shapes. Qwen3-8B's qkv (N = 6144) gets 96
tiles for 132 SMs and o_proj 128, so they ran at 70-72% of the copy rate (docs/benchmarks.md);
and a side stream that holds a few SMs (the pipeline's fetch kernel) pushes a tile into a
second wave. Here the weight is cut into many small units, BN output columns x KC of the
reduction each, several resident per SM: the hardware hands out units as SMs free up, so
the last wave is one small unit, whatever the SMs left to it. A unit writes its float32
partial product; the last unit of a column tile to arrive (an arrival counter) sums the
partials in split order, so the result does not depend on the arrival order.

`decode_linear_ref` (F.linear) is the reference; CPU tensors take it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference alone
    triton = None

MAX_ROWS = 64  # more rows than this (prefill) go to cuBLAS


@dataclass(frozen=True, slots=True)
class GemmTiling:
    block_n: int = 64  # output columns a unit
    block_k: int = 128  # reduction a loop iteration
    split_k: int = 4  # units along K per column tile
    stages: int = 4
    warps: int = 4


def default_tiling(n: int, k: int) -> GemmTiling:
    """The fastest tiling measured for the reduction length (scripts/gpu_check_gemm.py, H200),
    fitted to K: the widest step of 128, 64 or 32 that divides it, and the most splits up to
    the target (4; 8 from K = 8192) that divide its steps."""
    block_k = next((b for b in (128, 64, 32) if k % b == 0), 128)
    steps, target = k // block_k, 8 if k >= 8192 else 4
    split = next(s for s in range(min(target, max(steps, 1)), 0, -1) if steps % s == 0)
    return GemmTiling(block_k=block_k, split_k=split)


def decode_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def supports(x: torch.Tensor, weight: torch.Tensor, tiling: GemmTiling) -> bool:
    """Shapes the kernel takes: few rows, K cut evenly into split_k x block_k pieces, both
    operands row-major in one dtype."""
    M, K = x.shape
    return (0 < M <= MAX_ROWS and K % (tiling.split_k * tiling.block_k) == 0 and x.dtype == weight.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiling: GemmTiling | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias[N]) -> [M, N] in x's dtype. The Triton kernel on CUDA
    for the shapes it `supports` (float32 accumulation), F.linear otherwise."""
    tiling = tiling or default_tiling(*weight.shape)
    if triton is None or not (x.is_cuda or _interpreting()) or not supports(x, weight, tiling):
        return decode_linear_ref(x, weight, bias)
    counters = arrival_counters(x.device)
    if counters is None:
        return decode_linear_ref(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    t = tiling
    tiles = triton.cdiv(N, t.block_n)
    if tiles > counters.numel():
        return decode_linear_ref(x, weight, bias)
    block_m = max(16, triton.next_power_of_2(M))  # tl.dot needs >= 16 rows
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    partials = torch.empty(t.split_k if t.split_k > 1 else 0, block_m, N, device=x.device, dtype=torch.float32)
    _decode_gemm_kernel[(tiles, t.split_k)](
        x, weight, bias if bias is not None else weight, y, partials, counters, M, N,
        x.stride(0), weight.stride(0), y.stride(0),
        K // t.split_k, HAS_BIAS=bias is not None, BM=block_m, BN=t.block_n, BK=t.block_k, SPLIT=t.split_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.warps, num_stages=t.stages)
    return y


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


MAX_TILES = 1 << 14  # column tiles the counters cover (N up to 1M at 64 columns a tile)
_counters: dict = {}


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """Zeroed int32 counters, one per column tile, shared by every launch on the device (each
    launch leaves them at zero; launches of one stream run in order). None when they would
    first be made inside a graph capture, whose allocations are not zeroed until a replay:
    that call takes cuBLAS (model runners run eagerly once before they capture)."""
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return buf


if triton is not None:

    @triton.jit
    def _decode_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N,
                            sx_m, sw_n, sy_m, KC,
                            HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            SPLIT: tl.constexpr, PRECISION: tl.constexpr):
        """Unit (column tile, split): columns [tile * BN, +BN) over K range [split * KC, +KC)."""
        tile = tl.program_id(0)
        split = tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = tile * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * sx_m
        w_rows = w_ptr + rn[:, None].to(tl.int64) * sw_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(split * KC, (split + 1) * KC, BK):
            xt = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
            wt = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
        out_mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            part = part_ptr + rm[:, None] * N + rn[None, :]
            tl.store(part + split * BM * N, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is written before the count moves
            # acq_rel: the partials are visible before this unit's count; the last unit sees
            # every other unit's partials after reading it.
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                total = tl.zeros((BM, BN), dtype=tl.float32)
                for s in range(SPLIT):  # split order: deterministic
                    # Past L1 (.cg): other units of this launch wrote them.
                    total += tl.load(part + s * BM * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], total.to(y_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.store(count_ptr + tile, 0)  # ready for the next launch

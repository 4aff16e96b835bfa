"""A mixture-of-experts SwiGLU layer in two grouped GEMM launches, tokens sorted by expert.

Each (token, choice) of the router's top-k is a row. The rows are sorted by expert and each
expert's rows padded to a multiple of BLOCK_M, so the BLOCK_M rows of one program share one
expert. Launch 1 multiplies them by that expert's gate and up rows and stores silu(gate) * up;
launch 2 multiplies that by the expert's down weight and scales each row by its routing weight
(the epilogue). An expert with no tokens gets no programs. The k rows of a token are summed last.
Launch sizes depend on shapes only (the grouping is read on the device), so a decode step can be
captured in a CUDA graph. `fused_moe_ref` (kernels/reference.py) is the semantics; CPU runs it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from oasiskv.kernels.reference import fused_moe_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference alone
    triton = None


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The Triton kernels on CUDA, the torch reference elsewhere. Shapes as in `fused_moe_ref`."""
    if x.is_cuda:
        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids)
    return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids)


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """Rows in expert order, padded per expert to whole blocks of `block_m`."""
    rows: torch.Tensor  # [num_blocks * block_m] int32: row (token * k + choice), or T * k for padding
    experts: torch.Tensor  # [num_blocks] int32: each block's expert, -1 for blocks past the last
    block_m: int


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the rows of `topk_ids` [T, k] by expert, without a host sync: the number of blocks
    is its bound for T * k rows (each expert that has rows adds at most one partial block)."""
    dev = topk_ids.device
    expert = topk_ids.reshape(-1).long()
    n = expert.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.sort(expert, stable=True).indices  # rows in expert order
    sorted_expert = expert[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_expert]  # place within its expert
    num_blocks = n // block_m + min(n, num_experts)
    rows = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    rows[(padded_end - padded)[sorted_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_m
    experts = torch.searchsorted(padded_end, starts, right=True)
    experts = torch.where(experts < num_experts, experts, -1).to(torch.int32)
    return ExpertBlocks(rows, experts, block_m)


def choose_block_m(num_rows: int, num_experts: int) -> int:
    """Rows a program takes: the mean rows per expert, from 16 (tl.dot's least) to 64."""
    return min(64, max(16, triton.next_power_of_2(max(1, num_rows // num_experts))))


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I, k = two_i // 2, topk_ids.shape[1]
    assert w_down.shape == (E, H, I) and x.stride(1) == 1
    assert w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    if T == 0:
        return x.new_zeros(0, H)
    blocks = group_by_expert(topk_ids, E, choose_block_m(T * k, E))
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    upcast = interpret and x.dtype == torch.bfloat16  # the interpreter's tl.dot on bf16 is wrong
    precision = "ieee" if (upcast or x.dtype == torch.float32) else "tf32"
    bm, num_blocks = blocks.block_m, blocks.experts.numel()
    inter = torch.empty(T * k, I, device=x.device, dtype=x.dtype)
    _gate_up_kernel[(num_blocks, triton.cdiv(I, block_n))](
        x, w_gate_up, inter, blocks.rows, blocks.experts, T * k, I, H,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), inter.stride(0),
        TOP_K=k, BM=bm, BN=block_n, BK=block_k, UPCAST=upcast, PRECISION=precision)
    out = torch.empty(T * k, H, device=x.device, dtype=x.dtype)
    _down_kernel[(num_blocks, triton.cdiv(H, block_n))](
        inter, w_down, topk_weights.reshape(-1).float(), out, blocks.rows, blocks.experts, T * k, H, I,
        inter.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0),
        BM=bm, BN=block_n, BK=block_k, UPCAST=upcast, PRECISION=precision)
    return out.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


if triton is not None:
    @triton.jit
    def _block_rows(rows_ptr, experts_ptr, num_rows, BM: tl.constexpr):
        """The block's expert (-1: past the last) and its rows, which are < num_rows if real."""
        pid = tl.program_id(0)
        expert = tl.load(experts_ptr + pid)
        rows = tl.load(rows_ptr + pid * BM + tl.arange(0, BM))
        return expert.to(tl.int64), rows.to(tl.int64), rows < num_rows

    @triton.jit
    def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, experts_ptr, num_rows, N, K,
                        stride_x, stride_we, stride_wn, stride_o,
                        TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """out[row, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for the block's rows;
        w: [E, 2N, K], gate rows first."""
        expert, rows, real = _block_rows(rows_ptr, experts_ptr, num_rows, BM)
        if expert < 0:
            return
        token = rows // TOP_K
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < N
        w_base = w_ptr + expert * stride_we
        gate = tl.zeros((BM, BN), dtype=tl.float32)
        up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < K
            a = tl.load(x_ptr + token[:, None] * stride_x + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_ok, other=0.0)  # [BK, BN]
            wu = tl.load(w_base + (N + cols[None, :]) * stride_wn + ks[:, None], mask=w_ok, other=0.0)
            gate = _dot(a, wg, gate, UPCAST, PRECISION)
            up = _dot(a, wu, up, UPCAST, PRECISION)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=real[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(a_ptr, w_ptr, weights_ptr, out_ptr, rows_ptr, experts_ptr, num_rows, N, K,
                     stride_a, stride_we, stride_wn, stride_o,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """out[row, n] = weights[row] * (a[row] . down[e, n]) for the block's rows; w: [E, N, K]."""
        expert, rows, real = _block_rows(rows_ptr, experts_ptr, num_rows, BM)
        if expert < 0:
            return
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < N
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < K
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            acc = _dot(a, w, acc, UPCAST, PRECISION)
        acc = acc * tl.load(weights_ptr + rows, mask=real, other=0.0)[:, None]  # the routing weight
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=real[:, None] & col_ok[None, :])

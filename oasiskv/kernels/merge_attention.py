"""Two attention parts of the same queries merged by their log-sum-exp, in one pass.

A long prefill chunk attends its prefix and itself in two cuDNN calls (`cudnn_prefill`); each
part comes with its log-sum-exp, and the whole is their weighted sum, as the online softmax
would have it. In torch that is six float32 passes over [Hq, L, D] (a 4,096-token chunk of
Qwen3-8B: 67 MB each, per layer); here one program per (head, block of queries) reads both
parts once and writes the result in the queries' layout [L, Hq, D] and dtype.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: cudnn_prefill merges in torch (it runs on CUDA only)
    triton = None

BLOCK_L = 32  # queries a program takes


def merge_parts_torch(own: torch.Tensor, own_lse: torch.Tensor, pre: torch.Tensor, pre_lse: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """own, pre [Hq, L, D]; own_lse, pre_lse [Hq, L] float32 -> [L, Hq, D] in dtype."""
    top = torch.maximum(own_lse, pre_lse)[..., None]
    w_own, w_pre = torch.exp(own_lse[..., None] - top), torch.exp(pre_lse[..., None] - top)
    out = (own.float() * w_own + pre.float() * w_pre) / (w_own + w_pre)
    return out.transpose(0, 1).to(dtype)


def merge_parts(own: torch.Tensor, own_lse: torch.Tensor, pre: torch.Tensor, pre_lse: torch.Tensor,
                dtype: torch.dtype, kernel: bool | None = None) -> torch.Tensor:
    """As `merge_parts_torch`, in one Triton pass (any strides of the inputs); kernel: take
    the Triton pass (default: for CUDA tensors)."""
    if triton is None or not (own.is_cuda if kernel is None else kernel):
        return merge_parts_torch(own, own_lse, pre, pre_lse, dtype)
    Hq, L, D = own.shape
    out = torch.empty(L, Hq, D, device=own.device, dtype=dtype)
    if L:
        _merge_kernel[(Hq, triton.cdiv(L, BLOCK_L))](
            own, own_lse, pre, pre_lse, out, L, D,
            *own.stride(), *own_lse.stride(), *pre.stride(), *pre_lse.stride(), *out.stride(),
            BLOCK_L=BLOCK_L, DP=triton.next_power_of_2(D), num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _merge_kernel(own_ptr, own_lse_ptr, pre_ptr, pre_lse_ptr, out_ptr, L, D,
                      so_h, so_l, so_d, sol_h, sol_l, sp_h, sp_l, sp_d, spl_h, spl_l, st_l, st_h, st_d,
                      BLOCK_L: tl.constexpr, DP: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        cols = tl.arange(0, DP)
        keep_r = rows < L
        keep = keep_r[:, None] & (cols < D)[None, :]
        r64 = rows.to(tl.int64)
        a_lse = tl.load(own_lse_ptr + h * sol_h + r64 * sol_l, mask=keep_r, other=0.0)
        b_lse = tl.load(pre_lse_ptr + h * spl_h + r64 * spl_l, mask=keep_r, other=0.0)
        top = tl.maximum(a_lse, b_lse)
        wa, wb = tl.exp(a_lse - top), tl.exp(b_lse - top)
        a = tl.load(own_ptr + h * so_h + r64[:, None] * so_l + cols[None, :] * so_d, mask=keep, other=0.0)
        b = tl.load(pre_ptr + h * sp_h + r64[:, None] * sp_l + cols[None, :] * sp_d, mask=keep, other=0.0)
        y = (a.to(tl.float32) * wa[:, None] + b.to(tl.float32) * wb[:, None]) / (wa + wb)[:, None]
        tl.store(out_ptr + r64[:, None] * st_l + h * st_h + cols[None, :] * st_d,
                 y.to(out_ptr.dtype.element_ty), mask=keep)

"""The block summaries' number format and the fold of new keys into them: the torch form of the
qkv epilogue's fold (`qkv_epilogue.SummaryFold`), which CPU runs and the kernel is checked
against. Why fp8 summaries round outward: `sparse/summaries.py`.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_summary(x: torch.Tensor, dtype: torch.dtype, toward: int = 0) -> torch.Tensor:
    """x in the summaries' dtype; fp8 saturates at ±448 (±inf, the padding of a partial block's
    min and max, included) instead of overflowing to NaN, and rounds up (toward +1: a max) or
    down (-1: a min), so the box still holds every key, or to nearest (0)."""
    if dtype != FP8:
        return x.to(dtype)
    x = x.float().clamp(-FP8_MAX, FP8_MAX)
    y = x.to(dtype)
    if not toward:
        return y
    need = y.float() < x if toward > 0 else y.float() > x
    code = y.view(torch.uint8).to(torch.int16)
    step = torch.where(code >= 128, -toward, toward)  # a negative code grows with the magnitude
    return torch.where(need, code + step, code).to(torch.uint8).view(dtype)


def update_block_minmax(kmin: torch.Tensor, kmax: torch.Tensor, block_ids: torch.Tensor,
                        keys: torch.Tensor, first_in_block: torch.Tensor) -> None:
    """Fold new tokens into their (partial) blocks' summaries, in place, as decode fills them.

    kmin, kmax: [total_blocks, Hkv, D]; block_ids: [R] global block id of each token (-1: skip,
    e.g. a padding row of a captured batch); keys: [R, Hkv, D]; first_in_block: [R] bool, the
    token starts a new block, whose old summary (stale, from a block freed earlier) is dropped.
    Several rows may name the same block (a chunk of tokens): if any of them is first, the
    block is reset and then reduced over all of them. No host sync (CUDA-graph safe).
    """
    valid = block_ids >= 0
    idx = block_ids.long().clamp_min(0)  # skipped rows point at block 0 with neutral values
    first = first_in_block & valid
    # Rows of one block must agree on the reset so the index_put below writes one value per
    # block whatever the order among duplicates; R is a batch of tokens, so R x R is small.
    same = idx[:, None] == idx[None, :]
    reset = (same & first[None, :]).any(1)[:, None, None]
    # Reduce in float32 (fp8 has no min on CPU) into each block's first row, then write every
    # row of the block from it: duplicates write equal values.
    lead = same.int().argmax(1)[:, None, None]
    k_lo, k_hi = to_summary(keys, kmin.dtype, -1).float(), to_summary(keys, kmax.dtype, +1).float()
    v = valid[:, None, None]
    inf = torch.full((), float("inf"), device=kmin.device)  # no H2D copy
    lo = torch.where(reset, inf, kmin[idx].float())
    hi = torch.where(reset, -inf, kmax[idx].float())
    at = lead.expand_as(k_lo)
    lo.scatter_reduce_(0, at, torch.where(v, k_lo, inf), "amin", include_self=True)
    hi.scatter_reduce_(0, at, torch.where(v, k_hi, -inf), "amax", include_self=True)
    at = lead[:, 0, 0]
    kmin.index_put_((idx,), to_summary(lo[at], kmin.dtype))
    kmax.index_put_((idx,), to_summary(hi[at], kmax.dtype))

"""Each row's share of a layer's transfer budget (`sparse/fetch_budget.share_budget`) as one
Triton launch."""
from __future__ import annotations

import torch

from oasiskv.kernels.capped_eviction import NO_CANDIDATE

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch sorts
    triton = None


def share_budget_triton(cand_rank: torch.Tensor, cand_score: torch.Tensor, items: torch.Tensor,
                        out: torch.Tensor) -> None:
    """`share_budget` in one launch: each candidate counts the candidates ordered before it (a
    few thousand a layer, so the all-pairs count costs microseconds, where two radix sorts and
    their scatter took ~75 us a layer on the H200)."""
    N, C = cand_rank.shape
    cp = triton.next_power_of_2(max(C, 1))
    rows = max(1, SHARE_TILE_CANDIDATES // cp)
    _share_kernel[(triton.cdiv(N, rows),)](
        cand_rank.contiguous(), cand_score.contiguous(), items, out, N, N * C,
        C=C, CP=cp, ROWS=rows, TILE=max(16, SHARE_PAIRS // (rows * cp)), NONE=NO_CANDIDATE)


# A share program: about this many of its own candidates (fewer programs hold fewer SMs beside the
# foreground, each for longer), compared with others SHARE_PAIRS pairs at a time. 0: the sorts.
SHARE_TILE_CANDIDATES, SHARE_PAIRS = 64, 4096

if triton is not None:

    @triton.jit
    def _share_kernel(rank_ptr, score_ptr, items_ptr, out_ptr, N, total, C: tl.constexpr, CP: tl.constexpr,
                      ROWS: tl.constexpr, TILE: tl.constexpr, NONE: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, CP)
        valid = (r[:, None] < N) & (c[None, :] < C)
        e = r[:, None] * C + c[None, :]  # [ROWS, CP] flat positions
        rank = tl.load(rank_ptr + e, mask=valid, other=NONE)
        rk = rank[:, :, None]
        sc = tl.load(score_ptr + e, mask=valid, other=float("-inf"))[:, :, None]
        e3 = e[:, :, None]
        ahead = tl.zeros([ROWS, CP], dtype=tl.int32)
        for start in range(0, total, TILE):
            f = start + tl.arange(0, TILE)
            f_ok = f < total
            frk = tl.load(rank_ptr + f, mask=f_ok, other=NONE)[None, None, :]
            fsc = tl.load(score_ptr + f, mask=f_ok, other=float("-inf"))[None, None, :]
            f3 = f[None, None, :]
            before = (frk < rk) | ((frk == rk) & ((fsc > sc) | ((fsc == sc) & (f3 < e3))))
            ahead += tl.sum((before & f_ok[None, None, :]).to(tl.int32), axis=2)
        items = tl.load(items_ptr)
        granted = (ahead.to(tl.int64) < items) & (rank < NONE) & valid
        tl.store(out_ptr + r, tl.sum(granted.to(tl.int32), axis=1), mask=r < N)

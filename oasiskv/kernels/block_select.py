"""The pipeline's predict stage in two launches on CUDA: the bounds kernel (`block_bounds`), then
one program per (sequence, kv head) that combines the G heads' bounds and selects the top K in
registers, without a sort (`sparse/block_scores.score_select`).
"""
from __future__ import annotations

import torch

from oasiskv.kernels.block_bounds import RANGE_WEIGHT, head_bounds_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch path
    triton = None


def score_select_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, k, max_blocks,
                        num_sink=0, window_start=None, *, out=None, block_tile=64,
                        range_weight=RANGE_WEIGHT, tiles_per_program=8, stages=3):
    """`score_select`'s fused path: the bounds kernel, then `_select_kernel`."""
    R, Hq, _ = q.shape
    Hkv = kmin.shape[1]
    tiles = triton.cdiv(max_blocks, block_tile)
    u = torch.empty(R, Hq, max_blocks, device=q.device, dtype=torch.float32)
    tile_max = torch.empty(R, Hq, tiles, device=q.device, dtype=torch.float32)
    head_bounds_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, max_blocks, num_sink,
                       window_start, block_tile, out=u, tile_max=tile_max, range_weight=range_weight,
                       tiles_per_program=tiles_per_program, stages=stages)
    if out is None:
        out = (torch.empty(R * Hkv, k, dtype=torch.int32, device=q.device),
               torch.empty(R * Hkv, k, dtype=torch.float32, device=q.device))
    ids, vals = out
    assert ids.stride() == vals.stride() and ids.stride(-1) == 1
    MP = triton.next_power_of_2(max_blocks)
    if R and max_blocks:
        _select_kernel[(R, Hkv)](
            u, tile_max, ids, vals, u.stride(0), u.stride(1), tile_max.stride(0), tile_max.stride(1),
            ids.stride(0), max_blocks, tiles, k,
            G=group_size, MP=MP, TP=triton.next_power_of_2(tiles), KP=triton.next_power_of_2(k),
            BITS=select_digit_bits(MP), num_warps=8 if MP >= 4096 else 4)
    return ids.view(R, Hkv, k), vals.view(R, Hkv, k)


# The select's threshold search takes up to this many bits a pass (1, 2, 4 or 8): 32 / BITS passes
# over the row, each counting against 2^BITS candidates at once. Each pass ends in a reduction
# across the program's warps, so fewer, wider passes may shorten a program that waits on them; a
# pass compares row x 2^BITS keys in registers, at most SELECT_MAX_COMPARES (fewer bits on wide
# rows). On an H100, 2 bits is 7-11% faster than 1; 4 is slower on wide rows, 8 far slower
# (`scripts/gpu_check_sparse.py` times each).
SELECT_DIGIT_BITS, SELECT_MAX_COMPARES = 2, 16384


def select_digit_bits(row: int) -> int:
    bits = SELECT_DIGIT_BITS
    while bits > 1 and row << bits > SELECT_MAX_COMPARES:
        bits //= 2
    return bits


if triton is not None:

    @triton.jit
    def _select_kernel(u_ptr, tmax_ptr, ids_ptr, vals_ptr, stride_ur, stride_uh, stride_tr, stride_th,
                       stride_o, max_blocks, num_tiles, k,
                       G: tl.constexpr, MP: tl.constexpr, TP: tl.constexpr, KP: tl.constexpr,
                       BITS: tl.constexpr):
        """One program per (sequence r, kv head h): shifted-max combine of the G heads' bounds,
        then the k best blocks. The k-th largest score is found BITS bits at a time on an
        order-keeping integer image of the floats (32 / BITS counting passes over the row, in
        registers); blocks above it, then the first ties, are compacted to the output by a
        prefix sum."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.arange(0, MP)
        tt = tl.arange(0, TP)
        s = tl.full((MP,), float("-inf"), dtype=tl.float32)
        for g in tl.static_range(G):
            qh = h * G + g
            u = tl.load(u_ptr + r * stride_ur + qh * stride_uh + b, mask=b < max_blocks, other=float("-inf"))
            best = tl.max(tl.load(tmax_ptr + r * stride_tr + qh * stride_th + tt,
                                  mask=tt < num_tiles, other=float("-inf")), axis=0)
            best = tl.where(best == float("-inf"), 0.0, best)  # nothing scored: stay -inf
            s = tl.maximum(s, u - best)
        # Floats -> int64 keys in [0, 2^32) with the same order: negative floats have their
        # magnitude bits flipped (larger magnitude = smaller), then the sign moves to the top.
        bits = s.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648
        thr = tl.zeros((), dtype=tl.int64)  # the largest t with at least k keys >= t
        digit = tl.arange(0, 1 << BITS).to(tl.int64)
        for i in tl.static_range(32 // BITS):
            # The next BITS bits of t: the largest digit whose candidate still has k keys above
            # (digit 0, t so far, always has: counts fall as the digit grows).
            cand = thr + (digit << (32 - BITS * (i + 1)))
            count = tl.sum((key[:, None] >= cand[None, :]).to(tl.int32), axis=0)
            best = tl.maximum(tl.sum((count >= k).to(tl.int64), axis=0) - 1, 0)  # 0: a row of < k
            thr = thr + (best << (32 - BITS * (i + 1)))
        above = key > thr
        tie = key == thr
        take = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= k - tl.sum(above.to(tl.int32), axis=0)))
        pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
        row = (r * tl.num_programs(1) + h).to(tl.int64) * stride_o
        finite = s > float("-inf")
        tl.store(ids_ptr + row + pos, tl.where(finite, b, -1), mask=take)
        tl.store(vals_ptr + row + pos, s, mask=take)
        n = tl.sum(take.to(tl.int32), axis=0)  # < k only when the row is shorter than k
        c = tl.arange(0, KP)
        pad = (c >= n) & (c < k)
        tl.store(ids_ptr + row + c, tl.full((KP,), -1, tl.int32), mask=pad)
        tl.store(vals_ptr + row + c, tl.full((KP,), float("-inf"), tl.float32), mask=pad)

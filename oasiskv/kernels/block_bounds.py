"""The predict stage's block scores on CUDA (`sparse/block_scores.py` states the scores and holds
their torch forms): the bounds kernel, one pass over the summaries, writes every query head's
bound of every block and each tile's best; the combine kernel makes one score per (block, kv
head) of them.

The bounds kernel loads each (block tile, kv head) of summaries once and computes the G heads'
bounds from it on the tensor cores (2·G·D multiply-adds per 4·D bytes in bf16: bandwidth-bound).
It writes them [R, Hq, M] in float32 with each tile's best bound per head (4·G bytes per (block,
kv head): a few % of the summary bytes at D = 128).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch path
    triton = None

COMBINES = ("shifted_max", "sum")  # how the G per-head scores of a kv group make one score
RANGE_WEIGHT = 0.5  # α: weight of the box's half-range; 1 = the Quest upper bound


if triton is not None:

    @triton.jit
    def _bounds_kernel(q_ptr, kmin_ptr, kmax_ptr, off_ptr, nb_ptr, ws_ptr, out_ptr, tmax_ptr,
                       stride_qr, stride_qh, stride_kb, stride_kh,
                       stride_or, stride_oh, stride_tr, stride_th, max_blocks, num_tiles, num_sink,
                       wide, narrow, G: tl.constexpr, GP: tl.constexpr, NC: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, BB: tl.constexpr, TILES: tl.constexpr,
                       STAGES: tl.constexpr, HAS_WS: tl.constexpr, PRECISION: tl.constexpr,
                       FP8: tl.constexpr, UPCAST: tl.constexpr, SKIP_DEAD: tl.constexpr):
        """One program: (sequence r, kv head h, TILES consecutive tiles of BB blocks), each
        tile's summaries loaded once for all G query heads of the group, the next tiles' loads in
        flight while one is summed (STAGES-deep software pipelining). The sums over D run on the
        tensor cores in the summaries' own dtype. The box weights a = wide·q⁺ + narrow·q⁻ are not
        exact in bf16, but q⁺ = max(q, 0) and q⁻ = min(q, 0) are, so u = wide·X + narrow·Y with
            X = q⁺·kmax + q⁻·kmin,   Y = q⁻·kmax + q⁺·kmin.
        q⁺ and q⁻ of the G heads are stacked as the columns of one [D, NC] matrix [q⁺ | q⁻]
        (each G wide, padded to GP), so each summary tile takes one product per summary,
        whose products are exact and whose sums run in float32: the float32 bounds up to
        summation order.

        fp8 summaries (FP8) go to the tensor cores as loaded, in fp8 products: q⁺ and q⁻ are each
        split into two e4m3 numbers, q ≈ q₁ + q₂ (q₂ the rounding error of q₁, so ~2⁻⁸ relative,
        a bf16's precision; components clamped to ±448), columns [q⁺₁ | q⁺₂ | q⁻₁ | q⁻₂]:
        faster than widening the summaries to float16 in registers.

        SKIP_DEAD: the program's tiles wholly past the row's end are written -inf in a second
        loop, without products (the first loop, software-pipelined, takes the live ones)."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        first = tl.program_id(2) * TILES
        d = tl.arange(0, DP)
        c = tl.arange(0, NC)
        part = c // GP
        cg = c % GP
        gi = tl.arange(0, GP)
        start = tl.load(off_ptr + r).to(tl.int64)
        end = tl.load(nb_ptr + r)
        if HAS_WS:
            end = tl.minimum(end, tl.load(ws_ptr + r))
        NPART: tl.constexpr = 4 if FP8 else 2
        qm = (d[:, None] < D) & ((cg < G) & (part < NPART))[None, :]
        q = tl.load(q_ptr + r * stride_qr + (h * G + cg[None, :]) * stride_qh + d[:, None], mask=qm,
                    other=0.0).to(tl.float32)  # [DP, NC]: each column its head's query
        if FP8:
            pos = tl.minimum(tl.maximum(q, 0.0), 448.0)
            neg = tl.maximum(tl.minimum(q, 0.0), -448.0)
            p1 = pos.to(tl.float8e4nv).to(tl.float32)
            n1 = neg.to(tl.float8e4nv).to(tl.float32)
            p2 = (pos - p1).to(tl.float8e4nv).to(tl.float32)
            n2 = (neg - n1).to(tl.float8e4nv).to(tl.float32)
            w = tl.where(part[None, :] == 0, p1, tl.where(part[None, :] == 1, p2,
                                                          tl.where(part[None, :] == 2, n1, n2)))
            cdt = tl.float8e4nv
        else:
            cdt = kmax_ptr.dtype.element_ty
            w = tl.where(part[None, :] == 0, tl.maximum(q, 0.0), tl.minimum(q, 0.0))
        w = w.to(cdt)  # masked columns loaded q = 0, so every part of them is 0
        if UPCAST:  # the interpreter has no fp8 products: the same exact values in float32
            w = w.to(tl.float32)
        pj = tl.arange(0, NC // GP)[None, :, None]
        is_pos = pj < NPART // 2
        is_neg = (pj >= NPART // 2) & (pj < NPART)
        qh = h * G + gi
        if SKIP_DEAD:
            live = tl.minimum(tl.maximum((end - first * BB + BB - 1) // BB, 0), TILES)
        else:
            live = TILES
        for i in tl.range(0, live, num_stages=STAGES):
            t = first + i
            b = t * BB + tl.arange(0, BB)
            keep = (b >= num_sink) & (b < end)
            ptrs = (start + b)[:, None] * stride_kb + h * stride_kh + d[None, :]
            m = keep[:, None] & (d[None, :] < D)
            hi = tl.load(kmax_ptr + ptrs, mask=m, other=0.0).to(cdt)
            lo = tl.load(kmin_ptr + ptrs, mask=m, other=0.0).to(cdt)
            if UPCAST:
                hi = hi.to(tl.float32)
                lo = lo.to(tl.float32)
            xh = tl.reshape(tl.dot(hi, w, input_precision=PRECISION), [BB, NC // GP, GP])
            xl = tl.reshape(tl.dot(lo, w, input_precision=PRECISION), [BB, NC // GP, GP])
            x = tl.sum(tl.where(is_pos, xh, 0.0) + tl.where(is_neg, xl, 0.0), axis=1)  # q⁺·kmax + q⁻·kmin
            y = tl.sum(tl.where(is_neg, xh, 0.0) + tl.where(is_pos, xl, 0.0), axis=1)  # q⁻·kmax + q⁺·kmin
            u = wide * x + narrow * y  # [BB, GP]
            u = tl.where(keep[:, None], u, float("-inf"))
            tl.store(out_ptr + r * stride_or + qh[None, :] * stride_oh + b[:, None], u,
                     mask=(b[:, None] < max_blocks) & (gi[None, :] < G))
            tl.store(tmax_ptr + r * stride_tr + qh * stride_th + t, tl.max(u, axis=0),
                     mask=(gi < G) & (t < num_tiles))
        if SKIP_DEAD:
            for i in range(live, TILES):
                t = first + i
                b = t * BB + tl.arange(0, BB)
                tl.store(out_ptr + r * stride_or + qh[None, :] * stride_oh + b[:, None],
                         tl.full([BB, GP], float("-inf"), tl.float32),
                         mask=(b[:, None] < max_blocks) & (gi[None, :] < G))
                tl.store(tmax_ptr + r * stride_tr + qh * stride_th + t, tl.full([GP], float("-inf"), tl.float32),
                         mask=(gi < G) & (t < num_tiles))

    @triton.jit
    def _combine_kernel(u_ptr, tmax_ptr, out_ptr, stride_ur, stride_uh, stride_tr, stride_th,
                        stride_or, stride_oh, max_blocks, num_tiles,
                        G: tl.constexpr, BB: tl.constexpr, TP: tl.constexpr, SUM: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        t = tl.program_id(2)
        b = t * BB + tl.arange(0, BB)
        tt = tl.arange(0, TP)
        if SUM:
            s = tl.zeros((BB,), dtype=tl.float32)
        else:
            s = tl.full((BB,), float("-inf"), dtype=tl.float32)
        for g in tl.static_range(G):
            qh = h * G + g
            u = tl.load(u_ptr + r * stride_ur + qh * stride_uh + b, mask=b < max_blocks,
                        other=float("-inf"))
            if SUM:
                s += u
            else:
                best = tl.max(tl.load(tmax_ptr + r * stride_tr + qh * stride_th + tt,
                                      mask=tt < num_tiles, other=float("-inf")), axis=0)
                best = tl.where(best == float("-inf"), 0.0, best)  # nothing scored: stay -inf
                s = tl.maximum(s, u - best)
        tl.store(out_ptr + r * stride_or + h * stride_oh + b, s, mask=b < max_blocks)


def head_bounds_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                       block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                       max_blocks: int, num_sink: int = 0,
                       window_start: torch.Tensor | None = None, block_tile: int = 64,
                       num_warps: int = 4, out: torch.Tensor | None = None,
                       tile_max: torch.Tensor | None = None,
                       range_weight: float = RANGE_WEIGHT, tiles_per_program: int = 8,
                       stages: int = 3) -> torch.Tensor:
    """Per-head bounds [R, Hq, max_blocks] float32 as `block_scores.head_bounds_ref` (and each tile's best
    bound per head into `tile_max` [R, Hq, tiles]). Grid (R, Hkv, tile groups); launch sizes
    come from shapes and the static `max_blocks`, the per-sequence counts are read on device,
    so the launch is CUDA-graph capturable. Tiles past a sequence's end only store -inf (their
    loads are masked off). block_tile >= 16 (a tensor-core product's rows), `tiles_per_program`
    tiles per program, loads `stages` deep (the pipeline sets them: `pipeline.bounds_tiling`)."""
    R, Hq, D = q.shape
    Hkv = kmin.shape[1]
    G = group_size
    assert Hq == G * Hkv and q.stride(-1) == 1 and kmin.stride() == kmax.stride() \
        and kmin.stride(-1) == 1
    tiles = triton.cdiv(max_blocks, block_tile)
    if out is None:
        out = torch.empty(R, Hq, max_blocks, device=q.device, dtype=torch.float32)
    if tile_max is None:
        tile_max = torch.empty(R, Hq, tiles, device=q.device, dtype=torch.float32)
    ws = window_start if window_start is not None else num_blocks
    fp8 = kmin.dtype == torch.float8_e4m3fn
    if R and max_blocks:
        GP = triton.next_power_of_2(G)
        _bounds_kernel[(R, Hkv, triton.cdiv(tiles, tiles_per_program))](
            q, kmin, kmax, block_offsets, num_blocks, ws, out, tile_max,
            q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1),
            out.stride(0), out.stride(1), tile_max.stride(0), tile_max.stride(1),
            max_blocks, tiles, num_sink, (1 + range_weight) / 2, (1 - range_weight) / 2,
            G=G, GP=GP, NC=max(16, (4 if fp8 else 2) * GP), D=D, DP=max(32, triton.next_power_of_2(D)),
            BB=block_tile, TILES=tiles_per_program, STAGES=stages, HAS_WS=window_start is not None,
            PRECISION="ieee" if kmin.dtype == torch.float32 else "tf32", FP8=fp8,
            UPCAST=fp8 and os.environ.get("TRITON_INTERPRET", "0") == "1", SKIP_DEAD=BOUNDS_SKIP_DEAD_TILES,
            num_warps=num_warps)
    return out


# Tiles wholly past a row's end skip their products (`_bounds_kernel`'s SKIP_DEAD): the same
# bounds, 1-3% faster on an H100 with rows 60% of the scan width (`scripts/gpu_check_sparse.py`).
BOUNDS_SKIP_DEAD_TILES = True


def score_blocks_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                        block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                        max_blocks: int, num_sink: int = 0,
                        window_start: torch.Tensor | None = None, block_tile: int = 64,
                        num_warps: int = 4, out: torch.Tensor | None = None,
                        combine: str = "shifted_max",
                        range_weight: float = RANGE_WEIGHT) -> torch.Tensor:
    """Scores [R, Hkv, max_blocks] float32 as `block_scores.score_blocks_ref`: the bounds kernel (one pass
    over the summaries), then a combine kernel over its small outputs (4·G bytes per (block,
    kv head) and the per-tile maxima). Two launches, no host sync, CUDA-graph capturable."""
    if combine not in COMBINES:
        raise ValueError(f"unknown combine {combine!r}; choose one of {', '.join(COMBINES)}")
    R, Hq, _ = q.shape
    Hkv = kmin.shape[1]
    tiles = triton.cdiv(max_blocks, block_tile)
    u = torch.empty(R, Hq, max_blocks, device=q.device, dtype=torch.float32)
    tile_max = torch.empty(R, Hq, tiles, device=q.device, dtype=torch.float32)
    head_bounds_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, max_blocks,
                       num_sink, window_start, block_tile, num_warps, out=u, tile_max=tile_max,
                       range_weight=range_weight)
    if out is None:
        out = torch.empty(R, Hkv, max_blocks, device=q.device, dtype=torch.float32)
    if R and max_blocks:
        _combine_kernel[(R, Hkv, tiles)](
            u, tile_max, out, u.stride(0), u.stride(1), tile_max.stride(0), tile_max.stride(1),
            out.stride(0), out.stride(1), max_blocks, tiles,
            G=group_size, BB=block_tile, TP=triton.next_power_of_2(tiles), SUM=combine == "sum",
            num_warps=num_warps)
    return out

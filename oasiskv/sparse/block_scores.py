"""Block scoring from the compressed keys and per-(sequence, kv head) top-K: the predict stage
of a sparse decode step (docs/design.md, "A decode step of a sparse request").

Each query head g of a kv group h scores block b from its per-dimension key box
[kmin, kmax] = centre c ± half-range r:

    u(b, g) = Σ_i q_gi · c_bhi + α · |q_gi| · r_bhi

With α = 1 this is the Quest upper bound of the head's logit over the block,
Σ_i max(q_gi · kmax_bhi, q_gi · kmin_bhi); α = 0 is the logit of the box's centre. The default
α = 0.5 (`RANGE_WEIGHT`) was chosen on passkey retrieval (docs/accuracy.md, "How a block is
scored"): in D = 64 the range term dominates the bound, so blocks of diverse tokens outrank
the one a head really attends to; at α = 0.5 the needle blocks that the bound misses come
back, and no case that the bound retrieves is lost.

The group's G scores are combined into one score per (block, kv head), by default

    score(b, h) = max_{g in group h} ( u(b, g) - max_b' u(b', g) )     ("shifted_max")

i.e. each head ranks the blocks by how close their bound comes to that head's best block, and
a block counts as much as the head that wants it most. Why not the plain sum Σ_g u(b, g)
("sum", kept for comparison): it adds bounds of very different scales, so broad heads whose
bounds vary a lot from block to block drown out a head that points sharply at one block: on
passkey retrieval that is exactly the needle block (docs/accuracy.md).

Because kmax >= kmin elementwise, each head's score is two D-vectors against the summaries:

    u(b, g) = Σ_i a_gi · kmax_bhi + b_gi · kmin_bhi,
    a = (1+α)/2 · max(q, 0) + (1-α)/2 · min(q, 0),   b = (1-α)/2 · max(q, 0) + (1+α)/2 · min(q, 0)

(at α = 1: max(q, 0) against kmax, min(q, 0) against kmin, i.e. max(q·kmax, q·kmin)).

On CUDA the bounds kernel loads each (block tile, kv head) of summaries once and computes the
G heads' bounds from it on the tensor cores (2·G·D multiply-adds per 4·D bytes in bf16:
bandwidth-bound, one pass over the summaries). It writes them [R, Hq, M] in float32 with each
tile's best bound per head (4·G bytes per (block, kv head): a few % of the summary bytes at
D = 128); a second small kernel takes each head's best over the tiles and combines. The torch
path (CPU) does the same with one batched matmul; the reference spells out the literal max per
head. All agree up to float32 rounding.

Scores are indexed by the sequence's logical block (0 .. num_blocks-1); blocks outside the
scored range are -inf. Optionally the sink blocks (< num_sink) and the local window
(>= window_start) are left out too: they are always on the GPU, so top-K spends its K on the
dynamic blocks only (and the shift is the best *dynamic* block's bound).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch path
    triton = None

NEG_INF = float("-inf")
COMBINES = ("shifted_max", "sum")  # how the G per-head scores of a kv group make one score
RANGE_WEIGHT = 0.5  # α: weight of the box's half-range; 1 = the Quest upper bound


def _scored_range(block_offsets, num_blocks, max_blocks, num_sink, window_start):
    """[R, max_blocks] bool: blocks that get a finite score."""
    b = torch.arange(max_blocks, device=num_blocks.device)
    end = num_blocks.long()
    if window_start is not None:
        end = torch.minimum(end, window_start.long())
    return (b[None, :] >= num_sink) & (b[None, :] < end[:, None])


def combine_heads(bounds: torch.Tensor, group_size: int, combine: str = "shifted_max") -> torch.Tensor:
    """bounds [R, Hq, M] float32 per query head (-inf outside the scored range) -> [R, Hkv, M].

    Pure tensor ops, no host sync (CUDA-graph safe). A row with no scored block stays -inf."""
    R, Hq, M = bounds.shape
    per = bounds.view(R, Hq // group_size, group_size, M)
    if combine == "sum":
        return per.sum(2)
    if combine != "shifted_max":
        raise ValueError(f"unknown combine {combine!r}; choose one of {', '.join(COMBINES)}")
    best = per.amax(-1, keepdim=True)
    best = torch.where(torch.isfinite(best), best, torch.zeros((), device=best.device))
    return (per - best).amax(2)


def box_weights(q: torch.Tensor, range_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The two vectors (a against kmax, b against kmin) of the module docstring."""
    pos, neg = q.clamp_min(0), q.clamp_max(0)
    wide, narrow = (1 + range_weight) / 2, (1 - range_weight) / 2
    return wide * pos + narrow * neg, narrow * pos + wide * neg


def head_bounds_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                    block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                    max_blocks: int | None = None, num_sink: int = 0,
                    window_start: torch.Tensor | None = None,
                    range_weight: float = RANGE_WEIGHT) -> torch.Tensor:
    """Every query head's score of every block, literally (centre and half-range), in float32.

    q: [R, Hq, D] one draft query per sequence; kmin, kmax: [total_blocks, Hkv, D];
    block_offsets, num_blocks: [R] int, where each sequence's blocks start in the global tensor
    and how many it has; max_blocks: width of the output (default: num_blocks.max(), a host sync).
    range_weight: α of the module docstring (1: the Quest bound).
    Returns [R, Hq, max_blocks] float32, -inf for b >= num_blocks, b < num_sink and
    b >= window_start (when given).
    """
    R, Hq, D = q.shape
    Hkv = kmin.shape[1]
    G = group_size
    assert Hq == G * Hkv
    if max_blocks is None:
        max_blocks = int(num_blocks.max()) if R else 0
    keep = _scored_range(block_offsets, num_blocks, max_blocks, num_sink, window_start)
    b = torch.arange(max_blocks, device=q.device)
    idx = (block_offsets.long()[:, None] + b[None, :]).clamp(0, max(kmin.shape[0] - 1, 0))
    lo = kmin[idx].float()  # [R, M, Hkv, D]
    hi = kmax[idx].float()
    qg = q.float().view(R, 1, Hkv, G, D)
    centre, half = ((hi + lo) / 2)[:, :, :, None], ((hi - lo) / 2)[:, :, :, None]
    u = (qg * centre + range_weight * qg.abs() * half).sum(-1)  # [R, M, Hkv, G]
    u = u.reshape(R, max_blocks, Hq).transpose(1, 2).contiguous()
    return u.masked_fill(~keep[:, None, :], NEG_INF)


def score_blocks_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                     block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                     max_blocks: int | None = None, num_sink: int = 0,
                     window_start: torch.Tensor | None = None,
                     combine: str = "shifted_max",
                     range_weight: float = RANGE_WEIGHT) -> torch.Tensor:
    """[R, Hkv, max_blocks] float32: `head_bounds_ref` combined over each kv group."""
    u = head_bounds_ref(q, kmin, kmax, block_offsets, num_blocks, group_size, max_blocks,
                        num_sink, window_start, range_weight)
    return combine_heads(u, group_size, combine)


def score_blocks_torch(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                       block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                       max_blocks: int, num_sink: int = 0,
                       window_start: torch.Tensor | None = None,
                       combine: str = "shifted_max",
                       range_weight: float = RANGE_WEIGHT) -> torch.Tensor:
    """Same contract as `score_blocks_ref` via the two-vector identity (module docstring): one
    batched matmul instead of a [R, M, Hkv, G, D] temporary. The CPU path."""
    R, Hq, D = q.shape
    Hkv = kmin.shape[1]
    keep = _scored_range(block_offsets, num_blocks, max_blocks, num_sink, window_start)
    qf = q.float().view(R, Hkv, group_size, D)
    qv = torch.cat(box_weights(qf, range_weight), -1)  # [R, Hkv, G, 2D]
    b = torch.arange(max_blocks, device=q.device)
    idx = (block_offsets.long()[:, None] + b[None, :]).clamp(0, max(kmin.shape[0] - 1, 0))
    summ = torch.cat([kmax[idx], kmin[idx]], -1).float().permute(0, 2, 3, 1)  # [R, Hkv, 2D, M]
    u = torch.matmul(qv, summ).view(R, Hq, max_blocks)
    return combine_heads(u.masked_fill(~keep[:, None, :], NEG_INF), group_size, combine)


def topk_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, Hkv, M] -> (block ids [R, Hkv, k] int32 sorted by score desc, -1 where there
    are fewer than k finite scores; their scores, -inf there). Fixed shapes, no host sync.
    Equal scores rank the lower block first (a stable sort, where torch.topk leaves ties
    unspecified), as the pipeline's fused select does: blocks of repeated tokens have equal
    summaries, and the two paths must pick the same ones."""
    R, H, M = scores.shape
    kk = min(k, M)
    vals, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, ids = vals[..., :kk], ids[..., :kk]
    ids = torch.where(vals == NEG_INF, -1, ids).to(torch.int32)
    if kk < k:
        ids = torch.cat([ids, ids.new_full((R, H, k - kk), -1)], -1)
        vals = torch.cat([vals, vals.new_full((R, H, k - kk), NEG_INF)], -1)
    return ids, vals


def score_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
               block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
               k: int, max_blocks: int, num_sink: int = 0,
               window_start: torch.Tensor | None = None, *,
               combine: str = "shifted_max",
               range_weight: float = RANGE_WEIGHT) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted blocks of each (sequence, kv head): Triton on CUDA, torch otherwise.
    Returns (ids [R, Hkv, k] int32, scores [R, Hkv, k] float32) as `topk_blocks`."""
    if q.is_cuda and triton is not None:
        return score_topk_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, k,
                                 max_blocks, num_sink, window_start, combine=combine,
                                 range_weight=range_weight)
    s = score_blocks_torch(q, kmin, kmax, block_offsets, num_blocks, group_size, max_blocks,
                           num_sink, window_start, combine, range_weight)
    return topk_blocks(s, k)


# --------------------------------------------------------------------------- Triton (GPU)

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
    """Per-head bounds [R, Hq, max_blocks] float32 as `head_bounds_ref` (and each tile's best
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
    """Scores [R, Hkv, max_blocks] float32 as `score_blocks_ref`: the bounds kernel (one pass
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


def score_topk_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                      block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                      k: int, max_blocks: int, num_sink: int = 0,
                      window_start: torch.Tensor | None = None,
                      block_tile: int = 64, combine: str = "shifted_max",
                      range_weight: float = RANGE_WEIGHT) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton scores (bounds, combine), then a sorted top-K over the [R, Hkv, max_blocks] float32
    scores: the in-line path's prediction, best first. The pipeline uses `score_select`
    instead, which skips the sort (docs/benchmarks.md, "Kernels alone")."""
    s = score_blocks_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, max_blocks,
                            num_sink, window_start, block_tile, combine=combine,
                            range_weight=range_weight)
    return topk_blocks(s, k)


# ------------------------------------------------------- fused combine + top-K (the pipeline)

SELECT_MAX_BLOCKS = 16384  # one program holds a row's scores in registers; longer rows sort


def score_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                 k: int, max_blocks: int, num_sink: int = 0,
                 window_start: torch.Tensor | None = None, *, out: tuple | None = None,
                 block_tile: int = 64, range_weight: float = RANGE_WEIGHT,
                 tiles_per_program: int = 8,
                 stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The predicted top-K as a set: (ids [R, Hkv, k] int32, scores [R, Hkv, k] float32), the
    blocks `score_topk` picks (ties aside), each with its score, but in block order rather
    than best first, with the -1 / -inf padding anywhere. A consumer that needs the best first
    ranks by the scores (the pipeline's capped eviction does). `out`: (ids, scores) buffers
    [R * Hkv, k] to write into.

    On CUDA: the bounds kernel, then one program per (sequence, kv head) that combines the G
    heads and selects the top K in registers (a radix select of the K-th largest score, then
    a prefix-sum compaction): no sort, faster than `torch.topk` (docs/benchmarks.md, "Kernels
    alone"). Elsewhere: `score_topk`."""
    if q.is_cuda and triton is not None and max_blocks <= SELECT_MAX_BLOCKS:
        return score_select_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, k, max_blocks,
                                   num_sink, window_start, out=out, block_tile=block_tile,
                                   range_weight=range_weight, tiles_per_program=tiles_per_program,
                                   stages=stages)
    R, Hkv = q.shape[0], kmin.shape[1]
    ids, vals = score_topk(q, kmin, kmax, block_offsets, num_blocks, group_size, k, max_blocks,
                           num_sink, window_start, range_weight=range_weight)
    if out is None:
        return ids, vals
    out[0].copy_(ids.view(R * Hkv, k))
    out[1].copy_(vals.view(R * Hkv, k))
    return out[0].view(R, Hkv, k), out[1].view(R, Hkv, k)


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

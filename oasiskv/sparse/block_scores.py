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

On CUDA the bounds kernel (`kernels/block_bounds.py`) loads each (block tile, kv head) of
summaries once and computes the G heads' bounds from it on the tensor cores, one pass over the
summaries; a second small kernel takes each head's best over the tiles and combines, or, for
the pipeline, combines and selects the top K (`kernels/block_select.py`). The torch path (CPU)
does the same with one batched matmul; the reference spells out the literal max per head. All
agree up to float32 rounding.

Scores are indexed by the sequence's logical block (0 .. num_blocks-1); blocks outside the
scored range are -inf. Optionally the sink blocks (< num_sink) and the local window
(>= window_start) are left out too: they are always on the GPU, so top-K spends its K on the
dynamic blocks only (and the shift is the best *dynamic* block's bound).
"""
from __future__ import annotations

import torch

from oasiskv.kernels.block_bounds import COMBINES, RANGE_WEIGHT, score_blocks_triton, triton
from oasiskv.kernels.block_select import score_select_triton

NEG_INF = float("-inf")


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


def score_topk_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                      block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                      k: int, max_blocks: int, num_sink: int = 0,
                      window_start: torch.Tensor | None = None,
                      block_tile: int = 64, combine: str = "shifted_max",
                      range_weight: float = RANGE_WEIGHT) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton scores (bounds, combine), then a sorted top-K over the [R, Hkv, max_blocks] float32
    scores: the conversion's and the evaluation's prediction, best first. The pipeline uses `score_select`
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

"""Block scoring from the compressed keys and per-(sequence, kv head) top-K (DESIGN §3 step 3).

The draft query of a sequence (all Hq heads) is scored against every block's summary with the
Quest upper bound of q·k, summed over the G query heads of each kv group:

    score(b, h) = Σ_{g in group h} Σ_i max(q_gi · kmax_bhi, q_gi · kmin_bhi)

Because kmax >= kmin elementwise, max(q·kmax, q·kmin) is q·kmax for q >= 0 and q·kmin for
q < 0, so the group sum collapses to two D-vectors per (sequence, kv head):

    score(b, h) = Σ_i (Σ_g max(q_gi, 0)) · kmax_bhi + (Σ_g min(q_gi, 0)) · kmin_bhi

which is what the Triton kernel computes: one pass over the summaries, 2·D multiply-adds and
4·D bytes (bf16) per (block, head), i.e. purely bandwidth-bound. The reference spells out the
literal max; the two agree up to float32 rounding.

Scores are indexed by the sequence's logical block (0 .. num_blocks-1); blocks outside the
scored range are -inf. Optionally the sink blocks (< num_sink) and the local window
(>= window_start) are left out too: they are always on the GPU, so top-K spends its K on the
dynamic blocks only.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch path
    triton = None

NEG_INF = float("-inf")


def _scored_range(block_offsets, num_blocks, max_blocks, num_sink, window_start):
    """[R, max_blocks] bool: blocks that get a finite score."""
    b = torch.arange(max_blocks, device=num_blocks.device)
    end = num_blocks.long()
    if window_start is not None:
        end = torch.minimum(end, window_start.long())
    return (b[None, :] >= num_sink) & (b[None, :] < end[:, None])


def score_blocks_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                     block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                     max_blocks: int | None = None, num_sink: int = 0,
                     window_start: torch.Tensor | None = None) -> torch.Tensor:
    """Quest bound summed over each kv group (DESIGN §3 step 3), literally, in float32.

    q: [R, Hq, D] one draft query per sequence; kmin, kmax: [total_blocks, Hkv, D];
    block_offsets, num_blocks: [R] int, where each sequence's blocks start in the global tensor
    and how many it has; max_blocks: width of the output (default: num_blocks.max(), a host sync).
    Returns [R, Hkv, max_blocks] float32, -inf for b >= num_blocks, b < num_sink and
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
    s = torch.maximum(qg * hi[:, :, :, None], qg * lo[:, :, :, None]).sum((-1, -2))  # [R, M, Hkv]
    s = s.transpose(1, 2).contiguous()
    return s.masked_fill(~keep[:, None, :], NEG_INF)


def score_blocks_torch(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                       block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                       max_blocks: int, num_sink: int = 0,
                       window_start: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `score_blocks_ref` via the two-vector identity (module docstring): one
    batched matmul instead of a [R, M, Hkv, G, D] temporary. The CPU path."""
    R, Hq, D = q.shape
    Hkv = kmin.shape[1]
    keep = _scored_range(block_offsets, num_blocks, max_blocks, num_sink, window_start)
    qf = q.float().view(R, Hkv, group_size, D)
    qv = torch.cat([qf.clamp_min(0).sum(2), qf.clamp_max(0).sum(2)], -1)  # [R, Hkv, 2D]
    b = torch.arange(max_blocks, device=q.device)
    idx = (block_offsets.long()[:, None] + b[None, :]).clamp(0, max(kmin.shape[0] - 1, 0))
    summ = torch.cat([kmax[idx], kmin[idx]], -1).float().permute(0, 2, 3, 1)  # [R, Hkv, 2D, M]
    s = torch.matmul(qv[:, :, None, :], summ)[:, :, 0]  # [R, Hkv, M]
    return s.masked_fill(~keep[:, None, :], NEG_INF)


def topk_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, Hkv, M] -> (block ids [R, Hkv, k] int32 sorted by score desc, -1 where there
    are fewer than k finite scores; their scores, -inf there). Fixed shapes, no host sync."""
    R, H, M = scores.shape
    kk = min(k, M)
    vals, ids = torch.topk(scores, kk, dim=-1, largest=True, sorted=True)
    ids = torch.where(vals == NEG_INF, -1, ids).to(torch.int32)
    if kk < k:
        ids = torch.cat([ids, ids.new_full((R, H, k - kk), -1)], -1)
        vals = torch.cat([vals, vals.new_full((R, H, k - kk), NEG_INF)], -1)
    return ids, vals


def score_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
               block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
               k: int, max_blocks: int, num_sink: int = 0,
               window_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted blocks of each (sequence, kv head): Triton on CUDA, torch otherwise.
    Returns (ids [R, Hkv, k] int32, scores [R, Hkv, k] float32) as `topk_blocks`."""
    if q.is_cuda and triton is not None:
        return score_topk_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, k,
                                 max_blocks, num_sink, window_start)
    s = score_blocks_torch(q, kmin, kmax, block_offsets, num_blocks, group_size, max_blocks,
                           num_sink, window_start)
    return topk_blocks(s, k)


# --------------------------------------------------------------------------- Triton (GPU)

if triton is not None:

    @triton.jit
    def _score_kernel(q_ptr, kmin_ptr, kmax_ptr, off_ptr, nb_ptr, ws_ptr, out_ptr,
                      stride_qr, stride_qh, stride_kb, stride_kh,
                      stride_or, stride_oh, max_blocks, num_sink,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                      BB: tl.constexpr, HAS_WS: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        t = tl.program_id(2)
        # The G query heads of this kv group, folded once into the two D-vectors.
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        qmask = (g[:, None] < G) & (d[None, :] < D)
        q = tl.load(q_ptr + r * stride_qr + (h * G + g)[:, None] * stride_qh + d[None, :],
                    mask=qmask, other=0.0).to(tl.float32)
        qp = tl.sum(tl.maximum(q, 0.0), axis=0)  # [DP]
        qn = tl.sum(tl.minimum(q, 0.0), axis=0)
        start = tl.load(off_ptr + r).to(tl.int64)
        end = tl.load(nb_ptr + r)
        if HAS_WS:
            end = tl.minimum(end, tl.load(ws_ptr + r))
        b = t * BB + tl.arange(0, BB)
        keep = (b >= num_sink) & (b < end)
        ptrs = (start + b)[:, None] * stride_kb + h * stride_kh + d[None, :]
        m = keep[:, None] & (d[None, :] < D)
        hi = tl.load(kmax_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
        lo = tl.load(kmin_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
        s = tl.sum(hi * qp[None, :] + lo * qn[None, :], axis=1)  # [BB] fp32
        s = tl.where(keep, s, float("-inf"))
        tl.store(out_ptr + r * stride_or + h * stride_oh + b, s, mask=b < max_blocks)


def score_blocks_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                        block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                        max_blocks: int, num_sink: int = 0,
                        window_start: torch.Tensor | None = None, block_tile: int = 64,
                        num_warps: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [R, Hkv, max_blocks] float32 as `score_blocks_ref`. Grid (R, Hkv, block tiles);
    launch sizes come from shapes and the static `max_blocks`, the per-sequence counts are read
    on device, so the launch is CUDA-graph capturable. Tiles past a sequence's end only
    store -inf (their loads are masked off)."""
    R, Hq, D = q.shape
    Hkv = kmin.shape[1]
    G = group_size
    assert Hq == G * Hkv and q.stride(-1) == 1 and kmin.stride() == kmax.stride() \
        and kmin.stride(-1) == 1
    if out is None:
        out = torch.empty(R, Hkv, max_blocks, device=q.device, dtype=torch.float32)
    ws = window_start if window_start is not None else num_blocks
    grid = (R, Hkv, triton.cdiv(max_blocks, block_tile))
    if R and max_blocks:
        _score_kernel[grid](
            q, kmin, kmax, block_offsets, num_blocks, ws, out,
            q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1),
            out.stride(0), out.stride(1), max_blocks, num_sink,
            G=G, GP=triton.next_power_of_2(G), D=D, DP=triton.next_power_of_2(D), BB=block_tile,
            HAS_WS=window_start is not None, num_warps=num_warps)
    return out


def score_topk_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                      block_offsets: torch.Tensor, num_blocks: torch.Tensor, group_size: int,
                      k: int, max_blocks: int, num_sink: int = 0,
                      window_start: torch.Tensor | None = None,
                      block_tile: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton scores, then torch.topk over the [R, Hkv, max_blocks] float32 buffer.

    Why not a fused top-K: the buffer is 4 bytes per (block, head) against the 4·D = 512 bytes
    of summaries the scoring reads, so the extra round trip is < 1% of the bytes, and
    torch.topk is one graph-capturable launch with sorted output; a fused kernel would need a
    cross-tile merge (a second pass anyway) for a gain inside that 1%."""
    s = score_blocks_triton(q, kmin, kmax, block_offsets, num_blocks, group_size, max_blocks,
                            num_sink, window_start, block_tile)
    return topk_blocks(s, k)

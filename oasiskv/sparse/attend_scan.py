"""The working-set attention and the prediction's scan of the summaries in one launch.

The pipeline's predict stage scores every block of a layer from the summaries with the draft
query (`block_scores`). Its input, the draft query, is ready when the layer's qkv epilogue has
run, before the attention; yet as a kernel of its own on the predict stream, the scan either
raced the attention for the SMs (forked before it: 16K 7.45 -> 7.76 ms, batch 16 on the H200)
or held the SMs the next GEMM wanted (forked after it: ~10 µs a layer of idle foreground
before o_proj; docs/benchmarks.md). Here the attention's B * Hkv programs (one split each) and
the scan's programs are one grid: the attention's programs come first, so the block scheduler
places them first, and the scan's fill the shared memory and warps they leave on each SM. The
scan adds a quarter (16K) to a half (32K) of the attention's bytes, read beside it by more
programs than the attention has; nothing waits between the two, and the GEMM after them sees
no scan at all. The select (combine + top-K, `select_from_bounds`) stays on the predict stream.

Each program is the one the separate kernels would run (`decode_split_program`,
`bounds_program`), so the outputs are theirs bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.kernels.paged_decode import DECODE_STAGES, split_launch
from oasiskv.sparse.block_scores import RANGE_WEIGHT, bounds_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch it
    triton = None


@dataclass
class BoundsScan:
    """One layer's scan, as `head_bounds_triton` takes it: the draft queries [R, Hq, D], that
    layer's summaries, the scored range of each row, and the outputs (per-head bounds
    [R, Hq, max_blocks], per-tile maxima [R, Hq, tiles]) that the select stage reads later."""
    q: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    block_offsets: torch.Tensor
    num_blocks: torch.Tensor
    window_start: torch.Tensor | None
    num_sink: int
    bounds: torch.Tensor
    tile_max: torch.Tensor
    block_tile: int
    tiles_per_program: int
    stages: int
    range_weight: float = RANGE_WEIGHT


if triton is not None:
    from oasiskv.kernels.paged_decode import decode_split_program
    from oasiskv.sparse.block_scores import bounds_program

    @triton.jit
    def _attend_scan_kernel(
            # decode_split_program's arguments (one split)
            q_ptr, kv_ptr, slot_ptr, len_ptr, pm_ptr, pl_ptr, pacc_ptr, sq_b, sq_q, sq_h, skv_slot, skv_kv, skv_tok,
            sst_b, sst_h, sl_b, sl_h, qk_scale, num_splits,
            kn_ptr, vn_ptr, out_ptr, skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, so_b, so_q, so_h, count_ptr,
            # bounds_program's
            dq_ptr, kmin_ptr, kmax_ptr, off_ptr, nb_ptr, ws_ptr, u_ptr, tmax_ptr,
            stride_qr, stride_qh, stride_kb, stride_kh, stride_ur, stride_uh, stride_tr, stride_th,
            max_blocks, num_tiles, num_sink, wide, narrow,
            # the grid: num_attention = B * num_heads attention programs, then the scan's
            num_heads, num_attention, tile_groups,
            G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr,
            TILE_BLKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SINGLE: tl.constexpr,
            FUSED_MERGE: tl.constexpr, MS: tl.constexpr, SC: tl.constexpr,
            S_G: tl.constexpr, S_GP: tl.constexpr, S_NC: tl.constexpr, S_D: tl.constexpr, S_DP: tl.constexpr,
            S_BB: tl.constexpr, S_TILES: tl.constexpr, S_STAGES: tl.constexpr, S_HAS_WS: tl.constexpr,
            S_PRECISION: tl.constexpr, S_FP8: tl.constexpr, S_UPCAST: tl.constexpr):
        pid = tl.program_id(0)
        if pid < num_attention:
            decode_split_program(
                pid // num_heads, pid % num_heads, 0, num_heads,
                q_ptr, kv_ptr, slot_ptr, len_ptr, pm_ptr, pl_ptr, pacc_ptr, sq_b, sq_q, sq_h, skv_slot, skv_kv,
                skv_tok, sst_b, sst_h, sl_b, sl_h, qk_scale, num_splits,
                kn_ptr, vn_ptr, out_ptr, skn_b, skn_q, skn_h, svn_b, svn_q, svn_h, so_b, so_q, so_h, count_ptr,
                G, Q, D, BS, M, TILE_BLKS, UPCAST, PRECISION, SINGLE, FUSED_MERGE, MS, SC)
        else:
            p = pid - num_attention
            bounds_program(
                p // (num_heads * tile_groups), (p // tile_groups) % num_heads, (p % tile_groups) * S_TILES,
                dq_ptr, kmin_ptr, kmax_ptr, off_ptr, nb_ptr, ws_ptr, u_ptr, tmax_ptr,
                stride_qr, stride_qh, stride_kb, stride_kh, stride_ur, stride_uh, stride_tr, stride_th,
                max_blocks, num_tiles, num_sink, wide, narrow,
                S_G, S_GP, S_NC, S_D, S_DP, S_BB, S_TILES, S_STAGES, S_HAS_WS, S_PRECISION, S_FP8, S_UPCAST)


def attend_and_scan(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
                    slot_tables: torch.Tensor, cache_lens: torch.Tensor, scale: float, scan: BoundsScan,
                    num_stages: int | None = None, tile_blocks: int = 8, num_warps: int = 4,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_decode_triton` with one split (same contract and result), and in the same launch
    `head_bounds_triton` over `scan` (its bounds and tile maxima land in scan.bounds and
    scan.tile_max). CUDA-graph capturable, as both are. The two must agree on num_warps: 4,
    both kernels' default."""
    B, _, Hq, _ = q.shape
    Hkv = k_new.shape[2]
    R, max_blocks = scan.q.shape[0], scan.bounds.shape[-1]
    if out is None:
        out = torch.empty_like(q)
    attn_args, attn_consts = split_launch(q, k_new, v_new, kv_cache, slot_tables, cache_lens, scale, 1,
                                          tile_blocks, out)
    scan_args, scan_consts = bounds_launch(scan.q, scan.kmin, scan.kmax, scan.block_offsets, scan.num_blocks,
                                           Hq // Hkv, max_blocks, scan.num_sink, scan.window_start,
                                           scan.block_tile, scan.bounds, scan.tile_max, scan.range_weight,
                                           scan.tiles_per_program, scan.stages)
    assert scan.kmin.shape[1] == Hkv and scan_consts["G"] == attn_consts["G"]
    groups = triton.cdiv(scan.tile_max.shape[-1], scan.tiles_per_program) if R and max_blocks else 0
    _attend_scan_kernel[(B * Hkv + R * Hkv * groups,)](
        *attn_args, *scan_args, Hkv, B * Hkv, max(groups, 1), **attn_consts,
        **{f"S_{name}": v for name, v in scan_consts.items()}, num_warps=num_warps,
        num_stages=num_stages or DECODE_STAGES)
    return out

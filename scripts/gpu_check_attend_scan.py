"""The working-set attention and the bounds scan in one launch (`sparse.attend_scan`), on the GPU
at the benchmark's shapes (qwen3-8b: 32 query heads, 8 kv heads, D = 128; batch 16, two query
rows a request, a 133-block working set, summaries of 1,024 and 2,048 blocks):

1. exactness: the fused launch's attention output, bounds and tile maxima equal those of the two
   kernels launched apart, bit for bit, in bf16 with bf16 and fp8 summaries;
2. timings (a CUDA graph of 36 layers' launches, so per layer as in the step): the attention
   alone, the scan alone, the two one after the other, and fused, for a few scan tilings.

    PYTHONPATH=. python3 scripts/gpu_check_attend_scan.py [--json OUT]
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "scripts")
from gpu_check_pipeline import report, time_graph  # noqa: E402

from oasiskv.kernels.paged_decode import paged_decode_triton  # noqa: E402
from oasiskv.sparse.attend_scan import BoundsScan, attend_and_scan  # noqa: E402
from oasiskv.sparse.block_scores import head_bounds_triton  # noqa: E402
from oasiskv.sparse.pipeline import bounds_tiling  # noqa: E402
from oasiskv.sparse.summaries import FP8, to_summary  # noqa: E402

dev = torch.device("cuda")
B, HKV, G, Q, D, BS, WS_BLOCKS, LAYERS = 16, 8, 4, 2, 128, 16, 133, 36


def inputs(blocks: int, fp8: bool, gen: torch.Generator):
    """One layer's attention inputs over random working sets, and its scan over `blocks` blocks
    of random summaries (min <= max) a request, windowed as the pipeline scores them."""
    slots = B * HKV * WS_BLOCKS
    kv = torch.randn(slots, 2, BS, D, generator=gen).to(dev, torch.bfloat16)
    tables = torch.randperm(slots, generator=gen).view(B, HKV, WS_BLOCKS).to(dev, torch.int32)
    lens = torch.full((B, HKV), WS_BLOCKS * BS - BS // 2, dtype=torch.int32, device=dev)
    q = torch.randn(B, Q, G * HKV, D, generator=gen).to(dev, torch.bfloat16)
    k_new = torch.randn(B, Q, HKV, D, generator=gen).to(dev, torch.bfloat16)
    v_new = torch.randn(B, Q, HKV, D, generator=gen).to(dev, torch.bfloat16)
    lo = torch.randn(B * blocks, HKV, D, generator=gen)
    kmin, kmax = lo.to(dev, torch.bfloat16), (lo + torch.randn(lo.shape, generator=gen).abs()).to(dev, torch.bfloat16)
    if fp8:
        kmin, kmax = to_summary(kmin, FP8), to_summary(kmax, FP8)
    offsets = torch.arange(B, device=dev) * blocks
    num_blocks = torch.full((B,), blocks, device=dev)
    window = num_blocks - 3
    draft = torch.randn(B, G * HKV, D, generator=gen).to(dev, torch.bfloat16)
    return (q, k_new, v_new, kv, tables, lens), (draft, kmin, kmax, offsets, num_blocks, window)


def make_scan(scan_in, blocks, tiling) -> BoundsScan:
    tile, per_program, stages = tiling
    tiles = -(-blocks // tile)
    return BoundsScan(*scan_in, 1, torch.empty(B, G * HKV, blocks, device=dev),
                      torch.empty(B, G * HKV, tiles, device=dev), tile, per_program, stages)


def check(results: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    scale = D ** -0.5
    for blocks in (1024, 2048):
        for fp8 in (False, True):
            att, scan_in = inputs(blocks, fp8, gen)
            name = f"{blocks} blocks, {'fp8' if fp8 else 'bf16'} summaries"
            tiling = bounds_tiling(blocks)
            fused, apart = make_scan(scan_in, blocks, tiling), make_scan(scan_in, blocks, tiling)
            out = attend_and_scan(*att, scale, fused)
            out_apart = paged_decode_triton(*att, scale, num_splits=1)
            head_bounds_triton(scan_in[0], *scan_in[1:5], G, blocks, 1, scan_in[5], tiling[0], out=apart.bounds,
                               tile_max=apart.tile_max, tiles_per_program=tiling[1], stages=tiling[2])
            results[f"{name}: exact"] = bool(torch.equal(out, out_apart) and torch.equal(fused.bounds, apart.bounds)
                                            and torch.equal(fused.tile_max, apart.tile_max))
            if not fp8:
                continue
            # Timings: 36 layers' launches in one graph (the step's shape), per layer.
            layers = [inputs(blocks, fp8, gen) for _ in range(4)]  # a few distinct buffers, cycled
            per = lambda t: 1e3 * t / LAYERS  # noqa: E731  ms per graph -> µs per layer
            results[f"{name}: attention alone us"] = per(time_graph(lambda: [
                paged_decode_triton(*layers[i % 4][0], scale, num_splits=1) for i in range(LAYERS)]))
            for tiling in (bounds_tiling(blocks), (64, -(-blocks // 64), 3), (64, -(-blocks // 128), 3),
                           (32, -(-blocks // 64), 3)):
                scans = [make_scan(layers[i][1], blocks, tiling) for i in range(4)]
                tag = ":".join(map(str, tiling))
                results[f"{name}: scan {tag} alone us"] = per(time_graph(lambda: [
                    head_bounds_triton(s.q, s.kmin, s.kmax, s.block_offsets, s.num_blocks, G, blocks, 1,
                                       s.window_start, s.block_tile, out=s.bounds, tile_max=s.tile_max,
                                       tiles_per_program=s.tiles_per_program, stages=s.stages)
                    for s in (scans[i % 4] for i in range(LAYERS))]))
                results[f"{name}: attention then scan {tag} us"] = per(time_graph(lambda: [
                    (paged_decode_triton(*layers[i % 4][0], scale, num_splits=1),
                     head_bounds_triton(s.q, s.kmin, s.kmax, s.block_offsets, s.num_blocks, G, blocks, 1,
                                        s.window_start, s.block_tile, out=s.bounds, tile_max=s.tile_max,
                                        tiles_per_program=s.tiles_per_program, stages=s.stages))
                    for i, s in ((i, scans[i % 4]) for i in range(LAYERS))]))
                results[f"{name}: fused {tag} us"] = per(time_graph(lambda: [
                    attend_and_scan(*layers[i % 4][0], scale, scans[i % 4]) for i in range(LAYERS)]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict = {}
    try:
        check(results)
    except Exception as exc:  # report what ran
        import traceback
        traceback.print_exc()
        results["error"] = repr(exc)
    report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

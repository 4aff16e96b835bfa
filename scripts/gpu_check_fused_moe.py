"""Check the fused MoE kernels against `fused_moe_ref` on a GPU at Qwen3-30B-A3B's shapes, then
time them against this card's measured ceilings, tile by tile.

    PYTHONPATH=. python3 scripts/gpu_check_fused_moe.py [--quick]

Checks: bf16, E = 128 experts, top 8, H = 2048, I = 768, T in {1, 4, 16, 64, 4096} tokens routed
by a random router; each passes when max |out - ref| / (|ref| + 1) < 4e-2, gate and up fused and
split; the one-program routing equals `route_ref` + `group_by_expert`. Timing: CUDA-graph
replays over 4 layers' distinct weights (so no layer's experts stay in L2). Decode (T = 1, 16,
64): the bytes of the experts the batch routes to over the time, as a fraction of the measured
device copy rate. Prefill (T = 4096, one chunk): the active experts' FLOPs over the time, as a
fraction of the measured bf16 GEMM rate. Also timed: the grouping alone and the whole layer
(router, top-k, grouping, kernels, the sum of the k outputs). JSON to $OUT/fused_moe.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from oasiskv.bench.ceilings import measure
from oasiskv.kernels.fused_moe import (MoeTiling, choose_tiling, experts_grouped_mm, fused_moe_routed,
                                       fused_moe_triton, group_by_expert, route_and_group)
from oasiskv.kernels.reference import fused_moe_ref, route_ref

E, K, H, I, LAYERS = 128, 8, 2048, 768, 4
DEV, DT = "cuda", torch.bfloat16


def graph_ms(fn, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the default tiles only, no sweep")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceil = measure()
    print(f"{ceil['device']}: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {ceil['bf16_gemm_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    gates = [torch.randn(E, H, device=DEV, dtype=DT) * 0.02 for _ in range(LAYERS)]
    gate_up = [torch.randn(E, 2 * I, H, device=DEV, dtype=DT) * 0.02 for _ in range(LAYERS)]
    down = [torch.randn(E, H, I, device=DEV, dtype=DT) * 0.02 for _ in range(LAYERS)]
    expert_bytes = (2 * I * H + H * I) * 2
    out = {"ceilings": ceil, "checks": [], "decode": [], "prefill": [], "layer": []}

    def inputs(T: int):
        x = torch.randn(T, H, device=DEV, dtype=DT)
        return x, [route_ref(x @ g.T, K, True) for g in gates]

    for T in (1, 4, 16, 64, 4096):
        x, routes = inputs(T)
        w, ids = routes[0]
        want = fused_moe_ref(x, gate_up[0], down[0], w, ids).float()
        for split in (False, True):
            tile = MoeTiling(choose_tiling(T * K, E).block_m, split_gate_up=split)
            got = fused_moe_triton(x, gate_up[0], down[0], w, ids, tile).float()
            err = ((got - want).abs() / (want.abs() + 1)).max().item()
            out["checks"].append({"tokens": T, "split_gate_up": split, "err": err, "ok": err < 4e-2})
            print(f"check T={T:5d} split={split}: max err {err:.2e} {'ok' if err < 4e-2 else 'FAIL'}", flush=True)
        try:  # torch's grouped GEMM, a candidate for prefill
            got = experts_grouped_mm(x, gate_up[0], down[0], w, ids).float()
            err = ((got - want).abs() / (want.abs() + 1)).max().item()
            out["checks"].append({"tokens": T, "grouped_mm": True, "err": err, "ok": err < 4e-2})
            print(f"check T={T:5d} torch._grouped_mm: max err {err:.2e} {'ok' if err < 4e-2 else 'FAIL'}", flush=True)
        except (RuntimeError, AttributeError) as e:  # not on this torch or card: timed below if it is
            print(f"check T={T:5d} torch._grouped_mm: unavailable ({e})", flush=True)
        if T <= 128:  # fp32 logits: bf16's would tie, and ties may go either way
            logits = x.float() @ gates[0].float().T
            rw, rids, blocks = route_and_group(logits, K, True, 16)
            w, ids = route_ref(logits, K, True)
            ref = group_by_expert(ids, E, 16)
            ok = (torch.equal(rids.long(), ids) and torch.allclose(rw, w, atol=1e-6)
                  and torch.equal(blocks.rows, ref.rows) and torch.equal(blocks.experts, ref.experts))
            out["checks"].append({"tokens": T, "routing": True, "ok": ok})
            print(f"check T={T:5d} one-program routing: {'ok' if ok else 'FAIL'}", flush=True)

    decode_tiles = [None] if args.quick else [None] + [
        MoeTiling(16, bn, bk, warps, stages)
        for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128), (2, 4), (3, 4))]
    for T in (1, 16, 64):
        x, routes = inputs(T)
        touched = sum(ids.unique().numel() for _, ids in routes)
        nbytes = touched * expert_bytes
        group_ms = graph_ms(lambda: [group_by_expert(ids, E, 16) for _, ids in routes]) / LAYERS
        for tile in decode_tiles:
            try:
                ms = graph_ms(lambda: [fused_moe_triton(x, gu, d, w, ids, tile)
                                       for gu, d, (w, ids) in zip(gate_up, down, routes)]) / LAYERS
            except Exception as e:  # a tile Triton cannot build (shared memory)
                print(f"  T={T} {tile}: {type(e).__name__}", flush=True)
                continue
            frac = nbytes / LAYERS / (ms / 1e3) / ceil["copy_bytes_per_s"]
            kern = nbytes / LAYERS / ((ms - group_ms) / 1e3) / ceil["copy_bytes_per_s"]
            row = {"tokens": T, "tiling": str(tile or choose_tiling(T * K, E)), "default": tile is None,
                   "ms_per_layer": ms, "group_ms": group_ms, "experts_touched_per_layer": touched / LAYERS,
                   "copy_fraction": frac, "copy_fraction_kernels_only": kern}
            out["decode"].append(row)
            print(f"decode T={T:3d} {row['tiling']}: {1e3 * ms:7.1f} us/layer ({1e3 * group_ms:.1f} grouping), "
                  f"{touched / LAYERS:.0f} experts, {100 * frac:.1f}% of copy ({100 * kern:.1f}% kernels only)",
                  flush=True)

    prefill_tiles = [None] if args.quick else [None] + [
        MoeTiling(bm, bn, bk, warps, stages) for bm, bn, bk, warps, stages in
        ((64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
         (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 256, 64, 8, 3), (128, 256, 64, 8, 3),
         (128, 128, 128, 8, 3))] + [MoeTiling(128, 128, 64, 8, 4, split_gate_up=False)]
    T = 4096
    x, routes = inputs(T)
    flops = 2 * T * K * 3 * H * I
    for tile in prefill_tiles:
        try:
            ms = graph_ms(lambda: [fused_moe_triton(x, gu, d, w, ids, tile)
                                   for gu, d, (w, ids) in zip(gate_up, down, routes)], replays=5) / LAYERS
        except Exception as e:
            print(f"  prefill {tile}: {type(e).__name__}", flush=True)
            continue
        frac = flops / (ms / 1e3) / ceil["bf16_gemm_flops_per_s"]
        row = {"tokens": T, "tiling": str(tile or choose_tiling(T * K, E)), "default": tile is None,
               "ms_per_layer": ms, "tflops": flops / (ms / 1e3) / 1e12, "gemm_fraction": frac}
        out["prefill"].append(row)
        print(f"prefill T={T} {row['tiling']}: {ms:.3f} ms/layer, {row['tflops']:.0f} TFLOP/s, "
              f"{100 * frac:.1f}% of the GEMM rate", flush=True)

    try:
        ms = graph_ms(lambda: [experts_grouped_mm(x, gu, d, w, ids)
                               for gu, d, (w, ids) in zip(gate_up, down, routes)], replays=5) / LAYERS
        frac = flops / (ms / 1e3) / ceil["bf16_gemm_flops_per_s"]
        out["prefill"].append({"tokens": T, "tiling": "torch._grouped_mm", "default": False, "ms_per_layer": ms,
                               "tflops": flops / (ms / 1e3) / 1e12, "gemm_fraction": frac})
        print(f"prefill T={T} torch._grouped_mm: {ms:.3f} ms/layer, {flops / (ms / 1e3) / 1e12:.0f} TFLOP/s, "
              f"{100 * frac:.1f}% of the GEMM rate", flush=True)
    except (RuntimeError, AttributeError) as e:
        print(f"prefill torch._grouped_mm: {type(e).__name__}: {e}", flush=True)

    for T in (1, 16, 64):  # the whole layer as the model runs it, default tiles
        x, routes = inputs(T)

        def layer():
            for g, gu, d in zip(gates, gate_up, down):
                fused_moe_routed(x, gu, d, x @ g.T, K, True)
        ms = graph_ms(layer) / LAYERS
        touched = sum(ids.unique().numel() for _, ids in routes) / LAYERS
        frac = touched * expert_bytes / (ms / 1e3) / ceil["copy_bytes_per_s"]
        out["layer"].append({"tokens": T, "ms_per_layer": ms, "copy_fraction": frac})
        print(f"whole MoE layer T={T}: {1e3 * ms:.1f} us, ~{touched:.0f} experts, {100 * frac:.1f}% of copy", flush=True)

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fused_moe.json"), "w") as f:
            json.dump(out, f, indent=2)
    assert all(c["ok"] for c in out["checks"]), out["checks"]


if __name__ == "__main__":
    main()

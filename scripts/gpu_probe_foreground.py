"""Two questions about the sparse step's foreground at batch 16 on one H200, timed alone:

1. The decode GEMMs (Qwen3-8B shapes, 32 rows: token + draft of 16 requests) under cuBLAS
   and cuBLASLt, with torch's SM carve-out off / 4 / 8 SMs: which kernel each picks, how many
   CTAs it launches, and its time alone.
2. The working-set attention (1 + 128 + 4 blocks per (request, kv head)) as the batch grows,
   at 1 to 3 splits (merged by a second launch, or "fused": by the last split program) and a
   few tilings and pipeline depths: does the kernel's rate per byte rise with more programs
   or more tiles in flight (a single short wave that leaves memory latency exposed) or stay
   flat (a per-SM limit)?

    PYTHONPATH=. python3 scripts/gpu_probe_foreground.py [--batches 16,32,64,128]   # JSON to $OUT/probe_foreground.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import triton

from oasiskv.kernels.paged_decode import paged_decode_triton

DEV = "cuda"
ROWS = 32
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
BS, HQ, HKV, D = 16, 32, 8, 128


def graph_us(fn, reps=20) -> float:
    """Microseconds of fn(i) inside a graph of `reps` calls (fn cycles its operands so the
    calls of one replay do not hit L2)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    return triton.testing.do_bench(g.replay, warmup=5, rep=40, return_mode="median") * 1e3 / reps


def kernel_launches(fn) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [{"name": e["name"][:70], "grid": e.get("args", {}).get("grid"), "us": e.get("dur")}
            for e in events if e.get("cat") == "kernel"]


def probe_gemms() -> list[dict]:
    rows = []
    # Four copies of each weight, cycled: more bytes than the 50 MB L2.
    weights = {k: [torch.randn(n, k_, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
               for k, (n, k_) in SHAPES.items()}
    xs = {k: torch.randn(ROWS, k_, device=DEV, dtype=torch.bfloat16) for k, (n, k_) in SHAPES.items()}
    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        for carveout in (0, 4, 8):
            torch._C._set_sm_carveout_experimental(carveout or None)
            for name, w in weights.items():
                fn = lambda i: torch.nn.functional.linear(xs[name], w[i % 4])  # noqa: E731
                alone = graph_us(fn)
                launches = kernel_launches(lambda: fn(0))
                rows.append({"backend": backend, "carveout": carveout, "gemm": name, "us_alone": round(alone, 2),
                             "kernels": launches})
                print(f"{backend:9s} carveout {carveout}  {name:8s} {alone:6.1f} us  "
                      f"{[(k['name'][:40], k['grid']) for k in launches]}")
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("default")
    return rows


def probe_attention(batches) -> list[dict]:
    rows = []
    ctx = (1 + 128 + 4) * BS
    for B in batches:
        nblk = ctx // BS
        pool = torch.randn(B * HKV * nblk + 64, 2, BS, D, device=DEV, dtype=torch.bfloat16)
        slots = torch.randperm(pool.shape[0] - 64, device=DEV)[:B * HKV * nblk].view(B, HKV, nblk).int()
        lens = torch.full((B, HKV), ctx, device=DEV, dtype=torch.int32)
        q = torch.randn(B, 2, HQ, D, device=DEV, dtype=torch.bfloat16)
        kn = torch.randn(B, 2, HKV, D, device=DEV, dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        out = torch.empty_like(q)
        for splits, fused in ((1, False), (2, False), (2, True), (3, False), (3, True)):
            # 5 stages keep two K/V tiles in flight a program, 3 one (scripts/inspect_decode_kernel.py).
            for tile, warps, stages in ((8, 4, 3), (8, 4, 5), (4, 4, 3), (4, 4, 6)):
                fn = lambda i: paged_decode_triton(q, kn, vn, pool, slots, lens, D ** -0.5, num_splits=splits,  # noqa: E731
                                                 tile_blocks=tile, num_warps=warps, num_stages=stages, out=out,
                                                 fused_merge=fused)
                try:
                    us = graph_us(fn, reps=10)
                except Exception as e:  # noqa: BLE001 (a config the compiler refuses)
                    print(f"B {B} splits {splits} tile {tile}: {e!r}"[:160])
                    continue
                nbytes = B * HKV * ctx * 2 * D * 2
                r = {"B": B, "splits": splits, "fused_merge": fused, "tile_blocks": tile, "num_warps": warps,
                     "num_stages": stages,
                     "us": round(us, 1), "us_per_request": round(us / B, 2), "TB_s": round(nbytes / us / 1e6, 2)}
                rows.append(r)
                print(f"attention B {B:3d} splits {splits}{' fused' if fused else '      '} tile {tile} warps {warps} "
                      f"stages {stages}: "
                      f"{us:7.1f} us, {r['TB_s']} TB/s")
        del pool
    return rows


def main():
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="16,32,64,128", help="batch sizes of the attention part")
    a = ap.parse_args()
    res = {"gemms": probe_gemms(), "attention": probe_attention([int(b) for b in a.batches.split(",")])}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_foreground.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Check the decode GEMM (oasiskv/kernels/decode_gemm.py) against a float64 reference on a GPU,
then time it against cuBLAS (F.linear) at Qwen3-8B's decode shapes, as a fraction of the
4.25 TB/s copy rate over the weight bytes.

    PYTHONPATH=. python3 scripts/gpu_check_gemm.py [--quick]

Checks: bf16 / fp16 / fp32, with and without bias, M in {1, 5, 16, 32, 64}, every split, each
output NaN-poisoned first; ten launches in a row (the arrival counters must reset); a CUDA-graph
replay after the inputs change. Pass: ||y - ref|| / ||ref|| under 1e-2 (16-bit) or 1e-5 (fp32).
Timing: a CUDA graph of 8 launches over 8 different weights (so no launch reads a weight from
L2), median of do_bench, per launch. Table to stdout, JSON to $OUT/gemm.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton

from oasiskv.bench.roofline import HBM_BYTES_PER_S
from oasiskv.kernels.decode_gemm import GemmTiling, decode_linear, default_tiling, supports

DEV = "cuda"
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
results = {"checks": [], "timings": []}


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def check(M, N, K, dtype, tiling, bias):
    x = torch.randn(M, K, device=DEV, dtype=dtype)
    w = torch.randn(N, K, device=DEV, dtype=dtype) / K ** 0.5
    b = torch.randn(N, device=DEV, dtype=dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    errs = [rel_err(decode_linear(x, w, b, tiling), ref) for _ in range(10)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok = supports(x, w, tiling) and max(errs) < tol and all(e == errs[0] for e in errs)
    row = dict(M=M, N=N, K=K, dtype=str(dtype), tiling=str(tiling), bias=bias, err=max(errs), ok=ok)
    results["checks"].append(row)
    return ok


def check_graph(dtype=torch.bfloat16, M=32, N=6144, K=4096):
    x = torch.randn(M, K, device=DEV, dtype=dtype)
    w = torch.randn(N, K, device=DEV, dtype=dtype) / K ** 0.5
    decode_linear(x, w)  # counters made outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = decode_linear(x, w)
    ok = True
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        g.replay()
        err = rel_err(y, x.double() @ w.double().T)
        ok &= err < 1e-2
    results["checks"].append(dict(what="graph replay", err=err, ok=ok))
    return ok


def time_graph(fn, xs, ws):
    fn(xs[0], ws[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x, w in zip(xs, ws):
            fn(x, w)
    return triton.testing.do_bench(g.replay, warmup=20, rep=100, return_mode="median") / len(ws)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="checks and the default tiling only")
    args = ap.parse_args()
    torch.manual_seed(0)
    n_ok = n = 0
    for M, dtype, bias, (N, K, tiling) in itertools.product(
            [1, 5, 16, 32, 64], [torch.bfloat16, torch.float16, torch.float32], [False, True],
            [(100, 1024, GemmTiling(block_n=64, split_k=4)), (6144, 4096, default_tiling(6144, 4096)),
             (4096, 12288, default_tiling(4096, 12288)), (333, 2048, GemmTiling(block_n=128, block_k=64, split_k=1))]):
        n += 1
        n_ok += check(M, N, K, dtype, tiling, bias)
    n += 1
    n_ok += check_graph()
    print(f"checks: {n_ok}/{n} pass")
    for r in results["checks"]:
        if not r["ok"]:
            print("FAIL", r)

    tilings = [None] if args.quick else [None] + [
        GemmTiling(block_n=bn, block_k=bk, split_k=s, stages=st, warps=wp)
        for bn, bk, s, st, wp in itertools.product([64, 128], [128, 256], [1, 2, 4, 8], [3, 4], [4])]
    print(f"{'shape':>8} {'M':>3} {'cuBLAS us':>10} {'frac':>6} {'best us':>8} {'frac':>6}  best tiling")
    for name, (N, K) in SHAPES.items():
        copies = 2 if name == "lm_head" else 8
        ws = [torch.randn(N, K, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        for M in (16, 32):
            xs = [torch.randn(M, K, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
            floor_us = N * K * 2 / HBM_BYTES_PER_S * 1e6
            cublas = time_graph(lambda x, w: F.linear(x, w), xs, ws) * 1e3
            best = None
            for t in tilings:
                tt = t or default_tiling(N, K)
                if not supports(xs[0], ws[0], tt) or (t is not None and t.block_k * t.split_k > K):
                    continue
                try:
                    us = time_graph(lambda x, w: decode_linear(x, w, tiling=tt), xs, ws) * 1e3
                except Exception as e:  # a tiling Triton cannot fit (shared memory): skip it
                    print("skip", tt, type(e).__name__)
                    continue
                row = dict(shape=name, M=M, N=N, K=K, tiling=str(tt), default=t is None, us=us,
                           frac=floor_us / us, cublas_us=cublas, cublas_frac=floor_us / cublas)
                results["timings"].append(row)
                if best is None or us < best["us"]:
                    best = row
            dflt = next(r for r in results["timings"] if r["shape"] == name and r["M"] == M and r["default"])
            print(f"{name:>8} {M:>3} {cublas:>10.1f} {floor_us / cublas:>6.1%} {best['us']:>8.1f} {best['frac']:>6.1%}"
                  f"  {best['tiling']}  (default {dflt['us']:.1f} us)")
        del ws
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemm.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

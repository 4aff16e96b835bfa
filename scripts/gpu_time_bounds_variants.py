"""Experiment: the bounds kernel's variants (four products, stacked columns, fp8 MMA) timed alone."""
import os
import sys

import torch

import oasiskv.sparse.block_scores as bs
from oasiskv.sparse.summaries import FP8, to_summary

sys.path.insert(0, os.path.dirname(__file__))
from gpu_check_sparse import G, HKV, bench, score_inputs  # noqa: E402

R, M = 16, 2048
q, kmin, kmax, off, nb = score_inputs(R, M, torch.bfloat16)
nb.fill_(M)
out = torch.empty(R, q.shape[1], M, device="cuda")
ref = bs.head_bounds_ref(q, kmin, kmax, off, nb, G, M)
for fp8 in (False, True):
    a, b = (to_summary(kmin, FP8), to_summary(kmax, FP8)) if fp8 else (kmin, kmax)
    nbytes = R * HKV * M * 2 * 128 * a.element_size()
    for v in ("four", "stacked", "fp8_mma") if fp8 else ("four", "stacked"):
        for tile, tpp, st, warps in ((64, 8, 3, 4), (64, 4, 3, 4), (64, 16, 3, 4), (128, 4, 3, 4), (128, 8, 3, 8), (64, 8, 4, 4)):
            cfg = dict(block_tile=tile, tiles_per_program=tpp, stages=st, num_warps=warps, variant=v)
            try:
                us = bench(lambda: bs.head_bounds_triton(q, a, b, off, nb, G, M, out=out, **cfg))
            except Exception as e:  # noqa: BLE001
                print(v, cfg, "failed", repr(e)[:200])
                continue
            print(f"{'fp8 ' if fp8 else 'bf16'} {v:<8} t{tile} x{tpp} s{st} w{warps}: {us:6.1f} us "
                  f"{nbytes / us / 1e3 / 4250:.1%} of 4.25 TB/s")

"""The decode-batch linear (oasiskv/kernels/skinny_gemm.py) on the GPU: Qwen3-8B's four linears
at decode row counts, bf16, against torch's (error), and timed (triton.testing.do_bench, median)
beside torch's linear as the dense step runs it (default BLAS) and as the sparse step does
(cuBLASLt with the step's SM carve-out). Bandwidth = the weight's bytes over the time.

    PYTHONPATH=. python3 scripts/gpu_skinny_gemm.py [--rows 16 48 96]
Writes $OUT/skinny_gemm.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from oasiskv.kernels import skinny_gemm
from oasiskv.sparse.decode_step import foreground_gemms
from oasiskv.sparse.pipeline import GEMM_SM_CARVEOUT

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}  # (K, N)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 48, 64])
    a = ap.parse_args()
    rows, ok = [], True
    for M in a.rows:
        for name, (K, N) in SHAPES.items():
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            ref = F.linear(x.float(), w.float())
            got = skinny_gemm.skinny_linear(x, w).float()
            err = float((got - ref).norm() / ref.norm())
            ok &= err < 1e-2
            t_default = triton.testing.do_bench(lambda: F.linear(x, w))
            with foreground_gemms(GEMM_SM_CARVEOUT):
                t_lt = triton.testing.do_bench(lambda: F.linear(x, w))
            t_skinny = triton.testing.do_bench(lambda: skinny_gemm.skinny_linear(x, w))
            gb = w.numel() * 2 / 1e9
            r = {"rows": M, "linear": name, "K": K, "N": N, "rel_err": err,
                 "us_default": 1e3 * t_default, "us_cublaslt_carveout": 1e3 * t_lt, "us_skinny": 1e3 * t_skinny,
                 "TBps_default": gb / t_default, "TBps_cublaslt_carveout": gb / t_lt, "TBps_skinny": gb / t_skinny}
            rows.append(r)
            print(f"M {M:3d} {name:8s} err {err:.1e}  default {r['us_default']:7.1f} us ({r['TBps_default']:.2f} TB/s)"
                  f"  cuBLASLt+carve-out {r['us_cublaslt_carveout']:7.1f} ({r['TBps_cublaslt_carveout']:.2f})"
                  f"  skinny {r['us_skinny']:7.1f} ({r['TBps_skinny']:.2f})", flush=True)
    print("all checks pass" if ok else "CHECK FAILED")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "skinny_gemm.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

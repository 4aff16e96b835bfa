"""The ceilings of the GPU a benchmark runs on, measured in the same process: the device copy
rate (bytes read + written per second) and a large bf16 GEMM's FLOP rate. A fraction printed
against them is a fraction of what this card does now, not of a datasheet."""
from __future__ import annotations

import torch

from oasiskv.sparse.fetch_budget import measure_link  # an amount over fn's best time: bytes or FLOPs


def copy_bytes_per_s(gib: float = 2.0) -> float:
    """One device-to-device copy of `gib` GiB: read + written bytes over its best time."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rate = measure_link(lambda: dst.copy_(src), 2 * src.numel(), repeats=10)
    del src, dst
    return rate


def gemm_flops_per_s(n: int = 8192) -> float:
    """An n x n x n bf16 matmul's FLOPs (2 per multiply-add) over its best time."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    rate = measure_link(lambda: a @ b, 2 * n**3, repeats=10)
    del a, b
    return rate


def measure() -> dict:
    out = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bytes_per_s(),
           "bf16_gemm_flops_per_s": gemm_flops_per_s()}
    torch.cuda.empty_cache()  # the memory planner sees the card as it was
    return out

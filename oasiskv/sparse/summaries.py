"""Compressed key cache (Quest-style; docs/design.md, "Memory layout"): per (block, kv head) the
elementwise min and max of the block's post-RoPE keys, 2 vectors per block = 1/16 of the KV
bytes at block size 16. The scores of `block_scores` read only these.

The summaries of every sparse request of a layer live in one tensor [total_blocks, Hkv, D]
indexed by a global block id (request offset + logical block); the caller keeps the offsets.

They are stored in fp8 (e4m3; `--summary-dtype auto` on CUDA, or `fp8`), or in the KV dtype (`kv`,
and `auto` off CUDA). fp8 halves the bytes that every decode step's prediction scans (at 32K
context as many as the working set's KV). A min is rounded down and a max up (so the box holds
every key and the block's bound stays an upper bound; rounded to nearest, Qwen2.5-Coder-0.5B's
mean KL to dense at 8K is 1.8x float32's, rounded outward 1.07x), both clamped to e4m3's
±448. Directed rounding is monotone, so the min of keys rounded down is the exact min rounded
down, and folding a token in fp8 gives what rounding the exact summary would. The rounding and
the fold of decode's new keys (`to_summary`, `update_block_minmax`) are the qkv epilogue's
reference, in `kernels/summary_fold.py`.
"""
from __future__ import annotations

import torch

from oasiskv.kernels.summary_fold import FP8, to_summary
from oasiskv.sparse.config import SUMMARY_DTYPES  # auto: the KV cache's dtype; fp8: e4m3


def summary_dtype(name: str, kv_dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The summaries' dtype: `auto` is fp8 where the KV cache is on CUDA (the sparse server 1-4%
    faster on an H100, the accuracy within noise: docs/benchmarks.md, docs/accuracy.md) and the KV
    dtype elsewhere; `kv` the KV dtype; `fp8` e4m3."""
    if name not in SUMMARY_DTYPES:
        raise ValueError(f"unknown summary dtype {name!r}; choose one of {', '.join(SUMMARY_DTYPES)}")
    if name == "auto":
        name = "fp8" if torch.device(device).type == "cuda" else "kv"
    return FP8 if name == "fp8" else kv_dtype


def block_minmax(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n_tokens, Hkv, D] -> (kmin, kmax), each [ceil(n_tokens / block_size), Hkv, D] in
    keys' dtype. The last block may be partial: it is padded with +inf (for the min) and -inf
    (for the max), so only its valid tokens count."""
    n, H, D = keys.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    lo = keys if pad == 0 else torch.cat([keys, keys.new_full((pad, H, D), float("inf"))])
    hi = keys if pad == 0 else torch.cat([keys, keys.new_full((pad, H, D), float("-inf"))])
    return (lo.view(nb, block_size, H, D).amin(1), hi.view(nb, block_size, H, D).amax(1))


def write_block_minmax(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor, block_size: int) -> None:
    """`block_minmax` of keys into the first blocks of kmin, kmax (any summary dtype)."""
    lo, hi = block_minmax(keys, block_size)
    kmin[:lo.shape[0]] = to_summary(lo, kmin.dtype, -1)
    kmax[:hi.shape[0]] = to_summary(hi, kmax.dtype, +1)

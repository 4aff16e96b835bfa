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
down, and folding a token in fp8 gives what rounding the exact summary would.
"""
from __future__ import annotations

import torch

from oasiskv.sparse.config import SUMMARY_DTYPES  # auto: the KV cache's dtype; fp8: e4m3

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def summary_dtype(name: str, kv_dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The summaries' dtype: `auto` is fp8 where the KV cache is on CUDA (the sparse server 1-4%
    faster on an H100, the accuracy within noise: docs/benchmarks.md, docs/accuracy.md) and the KV
    dtype elsewhere; `kv` the KV dtype; `fp8` e4m3."""
    if name not in SUMMARY_DTYPES:
        raise ValueError(f"unknown summary dtype {name!r}; choose one of {', '.join(SUMMARY_DTYPES)}")
    if name == "auto":
        name = "fp8" if torch.device(device).type == "cuda" else "kv"
    return FP8 if name == "fp8" else kv_dtype


def to_summary(x: torch.Tensor, dtype: torch.dtype, toward: int = 0) -> torch.Tensor:
    """x in the summaries' dtype; fp8 saturates at ±448 (±inf, the padding of a partial block's
    min and max, included) instead of overflowing to NaN, and rounds up (toward +1: a max) or
    down (-1: a min), so the box still holds every key, or to nearest (0)."""
    if dtype != FP8:
        return x.to(dtype)
    x = x.float().clamp(-FP8_MAX, FP8_MAX)
    y = x.to(dtype)
    if not toward:
        return y
    need = y.float() < x if toward > 0 else y.float() > x
    code = y.view(torch.uint8).to(torch.int16)
    step = torch.where(code >= 128, -toward, toward)  # a negative code grows with the magnitude
    return torch.where(need, code + step, code).to(torch.uint8).view(dtype)


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


def update_block_minmax(kmin: torch.Tensor, kmax: torch.Tensor, block_ids: torch.Tensor,
                        keys: torch.Tensor, first_in_block: torch.Tensor) -> None:
    """Fold new tokens into their (partial) blocks' summaries, in place, as decode fills them.

    kmin, kmax: [total_blocks, Hkv, D]; block_ids: [R] global block id of each token (-1: skip,
    e.g. a padding row of a captured batch); keys: [R, Hkv, D]; first_in_block: [R] bool, the
    token starts a new block, whose old summary (stale, from a block freed earlier) is dropped.
    Several rows may name the same block (a chunk of tokens): if any of them is first, the
    block is reset and then reduced over all of them. No host sync (CUDA-graph safe).
    """
    valid = block_ids >= 0
    idx = block_ids.long().clamp_min(0)  # skipped rows point at block 0 with neutral values
    first = first_in_block & valid
    # Rows of one block must agree on the reset so the index_put below writes one value per
    # block whatever the order among duplicates; R is a batch of tokens, so R x R is small.
    same = idx[:, None] == idx[None, :]
    reset = (same & first[None, :]).any(1)[:, None, None]
    # Reduce in float32 (fp8 has no min on CPU) into each block's first row, then write every
    # row of the block from it: duplicates write equal values.
    lead = same.int().argmax(1)[:, None, None]
    k_lo, k_hi = to_summary(keys, kmin.dtype, -1).float(), to_summary(keys, kmax.dtype, +1).float()
    v = valid[:, None, None]
    inf = torch.full((), float("inf"), device=kmin.device)  # no H2D copy
    lo = torch.where(reset, inf, kmin[idx].float())
    hi = torch.where(reset, -inf, kmax[idx].float())
    at = lead.expand_as(k_lo)
    lo.scatter_reduce_(0, at, torch.where(v, k_lo, inf), "amin", include_self=True)
    hi.scatter_reduce_(0, at, torch.where(v, k_hi, -inf), "amax", include_self=True)
    at = lead[:, 0, 0]
    kmin.index_put_((idx,), to_summary(lo[at], kmin.dtype))
    kmax.index_put_((idx,), to_summary(hi[at], kmax.dtype))

"""Compressed key cache (Quest-style, DESIGN §2 "Compressed keys"): per (block, kv head) the
elementwise min and max of the block's post-RoPE keys, 2 vectors per block = 1/16 of the KV
bytes at block size 16. The scores of `block_scores` read only these.

The summaries of every sparse request of a layer live in one tensor [total_blocks, Hkv, D]
indexed by a global block id (request offset + logical block); the caller keeps the offsets.
"""
from __future__ import annotations

import torch


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
    inf = torch.full((), float("inf"), dtype=kmin.dtype, device=kmin.device)  # no H2D copy
    kmin.index_put_((idx,), torch.where(reset, inf, kmin[idx]))
    kmax.index_put_((idx,), torch.where(reset, -inf, kmax[idx]))
    k = keys.to(kmin.dtype)
    v = valid[:, None, None]
    at = idx[:, None, None].expand_as(k)
    kmin.scatter_reduce_(0, at, torch.where(v, k, inf), "amin", include_self=True)
    kmax.scatter_reduce_(0, at, torch.where(v, k, -inf), "amax", include_self=True)


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch path
    triton = None


def fold_keys_(kmin: torch.Tensor, kmax: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor,
               first_in_block: torch.Tensor, rows_from: torch.Tensor | None = None,
               rows_to: torch.Tensor | None = None) -> None:
    """`update_block_minmax` for one token per row, each row a different block (a decode step
    of distinct requests): one launch on CUDA instead of a dozen, since it runs in every layer
    of every step on the critical path. block_ids -1: skip the row.

    rows_from -> rows_to ([R, ...], each row contiguous): copied in the same launch, every row
    (the pipeline's draft queries: a separate strided copy cost a launch per layer)."""
    copy = rows_from is not None
    if kmin.is_cuda and triton is not None:
        R, H, D = keys.shape
        assert kmin.is_contiguous() and keys.stride(-1) == 1 and keys.stride(-2) == D
        if copy:
            assert rows_to.is_contiguous() and rows_from.shape == rows_to.shape
            assert rows_from[0].is_contiguous()
        n = rows_to[0].numel() if copy else 1
        if R:
            _fold_keys_kernel[(R,)](kmin, kmax, block_ids, keys, first_in_block, keys.stride(0),
                                    rows_from if copy else keys, rows_to if copy else keys,
                                    rows_from.stride(0) if copy else 0,
                                    HD=H * D, HDP=triton.next_power_of_2(H * D), COPY=copy, N=n,
                                    NP=triton.next_power_of_2(n), num_warps=4)
        return
    update_block_minmax(kmin, kmax, block_ids, keys, first_in_block)
    if copy:
        rows_to.copy_(rows_from)


if triton is not None:

    @triton.jit
    def _fold_keys_kernel(kmin_ptr, kmax_ptr, block_ptr, key_ptr, first_ptr, stride_key,
                          from_ptr, to_ptr, stride_from, HD: tl.constexpr, HDP: tl.constexpr,
                          COPY: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
        r = tl.program_id(0)
        if COPY:
            j = tl.arange(0, NP)
            x = tl.load(from_ptr + r * stride_from + j, mask=j < N)
            tl.store(to_ptr + r * N + j, x, mask=j < N)
        b = tl.load(block_ptr + r).to(tl.int64)
        if b >= 0:
            i = tl.arange(0, HDP)
            m = i < HD
            k = tl.load(key_ptr + r * stride_key + i, mask=m)
            lo = tl.load(kmin_ptr + b * HD + i, mask=m)
            hi = tl.load(kmax_ptr + b * HD + i, mask=m)
            first = tl.load(first_ptr + r) != 0
            lo = tl.where(first, k, tl.minimum(lo, k.to(lo.dtype)))
            hi = tl.where(first, k, tl.maximum(hi, k.to(hi.dtype)))
            tl.store(kmin_ptr + b * HD + i, lo, mask=m)
            tl.store(kmax_ptr + b * HD + i, hi, mask=m)

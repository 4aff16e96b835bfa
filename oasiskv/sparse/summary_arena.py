"""Block summaries live in the GPU page pool (docs/design.md, "Memory layout"): one KV page holds
the summaries of `blocks_per_page` blocks, so summaries come out of the same budget as pages and
only for the blocks that sparse requests hold.

A page's bytes in layer l (`Hkv * 2 * block_size * D` KV elements) are read as
`[blocks_per_page, 2, Hkv, D]` summary elements: block g's min and max sit side by side in page
g // blocks_per_page. Over the whole pool that gives `kmin, kmax [L, pages * blocks_per_page,
Hkv, D]`, strided views with a uniform block stride (2 * Hkv * D), so the kernels address block
g as before. A sparse request takes a run of consecutive pages for its summaries
(`BlockManager.take_run`) and addresses them from `first_page * blocks_per_page`.
"""
from __future__ import annotations

import torch


def blocks_per_page(block_size: int, kv_dtype: torch.dtype, summary_dtype: torch.dtype) -> int:
    """Blocks whose min and max fit one page: a block's KV per head is 2 * block_size vectors
    in the KV dtype, its summary 2 vectors in the summary dtype."""
    kv_bytes, summary_bytes = kv_dtype.itemsize, summary_dtype.itemsize
    if block_size * kv_bytes % summary_bytes:
        raise ValueError(f"a page of {block_size} tokens in {kv_dtype} holds no whole number of {summary_dtype} "
                         "summaries")
    return block_size * kv_bytes // summary_bytes


def pages_for(num_blocks: int, per_page: int) -> int:
    """Pages that hold the summaries of `num_blocks` blocks."""
    return -(-num_blocks // per_page)


class SummaryArena:
    """kmin, kmax [L, NB, Hkv, D] over the page pool `kv` for `num_kv_heads` heads a page."""

    def __init__(self, kv: torch.Tensor, num_kv_heads: int, summary_dtype: torch.dtype):
        assert kv.is_contiguous()
        L, slots, _, bs, D = kv.shape
        H, per_page = num_kv_heads, blocks_per_page(bs, kv.dtype, summary_dtype)
        layer_bytes = kv.view(torch.uint8).view(L, -1) if kv.numel() else kv.new_empty((L, 0), dtype=torch.uint8)
        both = layer_bytes.view(summary_dtype).view(L, slots // H * per_page, 2, H, D)
        self.kmin, self.kmax = both[:, :, 0], both[:, :, 1]
        self.blocks_per_page = per_page
        self.dtype = summary_dtype

    def offset(self, first_page: int) -> int:
        """The summary block index of the first block a run starting at `first_page` holds."""
        return first_page * self.blocks_per_page

    def pages_for(self, num_blocks: int) -> int:
        return pages_for(num_blocks, self.blocks_per_page)

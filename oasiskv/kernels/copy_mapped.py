"""The transfer and write-through of pipeline rows whose items sit where a map says: a decode
instance's disaggregated rows (docs/disaggregation.md, "On the batched pipeline"). Their
blocks are not in a host extent but in the arena of received items, one by one, so the item
of (layer, block, head) of row r is item_map[row_slot[r], layer, block, head] (-1: not here)
instead of the extent's arithmetic (`copy_items.fetch_admitted`). Rows with row_slot -1 are
skipped: the extent forms move them. The copy loop is `copy_items`'s.
"""
from __future__ import annotations

import torch

from oasiskv.kernels.copy_items import DEFAULT_PROGRAMS, ITEMS_PER_LOAD, NUM_WARPS, _launch, copy_items, triton

if triton is not None:
    import triton.language as tl

    from oasiskv.kernels.copy_items import _move


def fetch_mapped(items: torch.Tensor, kv_layer: torch.Tensor, layer: int, admit_blocks: torch.Tensor,
                 admit_slots: torch.Tensor, pages: torch.Tensor, row_slot: torch.Tensor, item_map: torch.Tensor,
                 num_heads: int, num_sink: int, num_programs: int = DEFAULT_PROGRAMS,
                 items_per_load: int = ITEMS_PER_LOAD, num_warps: int = NUM_WARPS) -> None:
    """The transfer stage of mapped rows: admitted (row, head, block) items -> their GPU slots.

    items: [N, *item] the arena (a `device_view` of pinned memory on CUDA); admit_blocks /
    admit_slots: [R * num_heads, C] as `fetch_admitted`'s; row_slot: [>= R] int64, the map slot
    of each row (-1: not mapped); item_map: [slots, L, max_blocks, num_heads] int32. An entry
    whose map says -1 moves nothing (the prediction never admits one: `RemoteRows.mask`)."""
    RH, C = admit_blocks.shape
    if kv_layer.is_cuda and triton is not None:
        _, L, MB, _ = item_map.shape
        _launch(_fetch_mapped_kernel, RH * C, num_programs, kv_layer[0].numel(), items, kv_layer, admit_blocks,
                admit_slots, pages, row_slot, item_map, layer, RH * C, C, num_heads, pages.shape[1], num_sink,
                L, MB, items_per_load=items_per_load, num_warps=num_warps)
        return
    row = torch.arange(RH, device=admit_blocks.device)
    r, h = row // num_heads, row % num_heads
    slot = row_slot[r]
    blocks = admit_blocks.long()
    ok = (blocks >= 0) & (slot[:, None] >= 0)
    src = item_map[slot.clamp_min(0)[:, None], layer, blocks.clamp(0, item_map.shape[2] - 1), h[:, None]].long()
    ok &= src >= 0
    page = pages.long()[r[:, None], num_sink + admit_slots.long().clamp_min(0)]
    copy_items(items, kv_layer, torch.where(ok, src, -1).view(-1),
               torch.where(ok, page * num_heads + h[:, None], -1).view(-1))


def write_through_mapped(kv: torch.Tensor, items: torch.Tensor, completed: torch.Tensor,
                         window_slot: torch.Tensor, row_slot: torch.Tensor, item_map: torch.Tensor,
                         block: torch.Tensor, num_heads: int, num_programs: int = DEFAULT_PROGRAMS) -> None:
    """Mapped rows whose token completed a block copy it, every layer and head, GPU -> their
    items (placed before the step: `RemoteSource.before_pipeline_step`). Arguments as
    `copy_items.write_through`'s, with row_slot and item_map for the extent."""
    L, num_slots = kv.shape[0], kv.shape[1]
    R = completed.shape[0]
    MB = item_map.shape[2]
    if kv.is_cuda and triton is not None:
        if R:
            item = kv[0, 0].numel()
            _write_through_mapped_kernel[(min(num_programs, R),)](
                kv, items, completed, window_slot, row_slot, item_map, block, L, R, num_heads, num_slots, MB,
                ITEM=item, ITEMP=triton.next_power_of_2(item), ITEMS=ITEMS_PER_LOAD, num_warps=NUM_WARPS)
        return
    slot = row_slot[:R]
    layer = torch.arange(L, device=kv.device)[:, None, None]
    h = torch.arange(num_heads, device=kv.device)[None, None, :]
    dst = item_map[slot.clamp_min(0)[None, :, None], layer, block.clamp(0, MB - 1)[None, :, None], h].long()
    ok = (completed & (slot >= 0))[None, :, None] & (dst >= 0)
    src = torch.where(ok, layer * num_slots + window_slot[None, :, None] + h, -1)
    copy_items(kv.view(L * num_slots, *kv.shape[2:]), items, src.reshape(-1), torch.where(ok, dst, -1).reshape(-1))


if triton is not None:

    @triton.jit
    def _fetch_mapped_kernel(items_ptr, kv_ptr, blk_ptr, slot_ptr, pages_ptr, row_slot_ptr, map_ptr,
                             layer, n, C, H, P, S, L, MB,
                             ITEM: tl.constexpr, ITEMP: tl.constexpr, ITEMS: tl.constexpr):
        for i0 in range(tl.program_id(0) * ITEMS, n, tl.num_programs(0) * ITEMS):
            w = i0 + tl.arange(0, ITEMS)
            blk = tl.load(blk_ptr + w, mask=w < n, other=-1).to(tl.int64)
            r = w // C // H
            h = (w // C % H).to(tl.int64)
            rs = tl.load(row_slot_ptr + r, mask=blk >= 0, other=-1).to(tl.int64)
            ok = (blk >= 0) & (rs >= 0)
            src = tl.load(map_ptr + ((rs * L + layer) * MB + blk) * H + h, mask=ok, other=-1).to(tl.int64)
            ok = ok & (src >= 0)
            slot = tl.load(slot_ptr + w, mask=ok, other=0)
            page = tl.load(pages_ptr + r * P + S + slot, mask=ok, other=0).to(tl.int64)
            _move(items_ptr, kv_ptr, src, page * H + h, ok, ITEM, ITEMP)

    @triton.jit
    def _write_through_mapped_kernel(kv_ptr, items_ptr, done_ptr, wslot_ptr, row_slot_ptr, map_ptr, block_ptr,
                                     L, R, H, num_slots, MB,
                                     ITEM: tl.constexpr, ITEMP: tl.constexpr, ITEMS: tl.constexpr):
        for r in range(tl.program_id(0), R, tl.num_programs(0)):
            rs = tl.load(row_slot_ptr + r).to(tl.int64)
            if (tl.load(done_ptr + r) != 0) & (rs >= 0):
                wslot = tl.load(wslot_ptr + r).to(tl.int64)
                blk = tl.load(block_ptr + r).to(tl.int64)
                for j0 in range(0, L * H, ITEMS):
                    j = j0 + tl.arange(0, ITEMS)
                    layer = (j // H).to(tl.int64)
                    h = (j % H).to(tl.int64)
                    dst = tl.load(map_ptr + ((rs * L + layer) * MB + blk) * H + h, mask=j < L * H, other=-1)
                    dst = dst.to(tl.int64)
                    _move(kv_ptr, items_ptr, layer * num_slots + wslot + h, dst, (j < L * H) & (dst >= 0),
                          ITEM, ITEMP)

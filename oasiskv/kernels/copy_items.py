"""Copy whole KV items (one (block, head) K+V, `[2, block_size, head_dim]`) between two item
arrays by index lists: the transfer stage (host pool -> GPU slots) and write-through (GPU
slots -> host pool) of sparse decode.

On CUDA the copy is a Triton kernel with a **bounded grid** of persistent programs that read
the pinned host arena through its UVA address (docs/design.md, "Memory layout"): a
one-program-per-item launch takes every SM and stops the foreground model from overlapping
with it; a few persistent programs, each moving whole 8 KiB items per load, leave the SMs
to the model and still reach PCIe speed. Indices below zero are skipped, so fixed-shape (CUDA-graph) index lists
can carry unused entries.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch path
    triton = None

DEFAULT_PROGRAMS = 8  # reaches PCIe speed alone (docs/benchmarks.md, "Correctness on the GPU")


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing pinned host memory (UVA: the GPU reads it at the same address),
    so kernels can take host items as an ordinary pointer argument."""
    # The caller guarantees `host` is page-locked (HostKVPool registers it with CUDA).

    class _Iface:
        __cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype],
            "data": (host.data_ptr(), False), "version": 3,
            "strides": tuple(s * host.element_size() for s in host.stride()),
        }

    view = torch.as_tensor(_Iface(), device=device)
    return view if view.dtype == host.dtype else view.view(host.dtype)


# bfloat16 has no array-interface code: alias it as int16 and view back.
_TYPESTR = {torch.bfloat16: "<i2", torch.float16: "<f2", torch.float32: "<f4", torch.int16: "<i2"}


def copy_items(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
               num_programs: int = DEFAULT_PROGRAMS) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for every i with both indices >= 0.

    src, dst: [N, *item] contiguous, same dtype and item shape; src may be a `device_view` of
    pinned host memory. Index lists: [n] integer, on the kernel's device."""
    if dst.is_cuda and triton is not None:
        _copy_items_triton(src, dst, src_idx, dst_idx, num_programs)
        return
    keep = (src_idx >= 0) & (dst_idx >= 0)
    s, d = src_idx[keep].long(), dst_idx[keep].long()
    dst[d.to(dst.device)] = src[s.to(src.device)].to(dst.device)


ITEMS_PER_LOAD = 4  # whole items each program moves per iteration
NUM_WARPS = 8


def _launch(kernel, n: int, num_programs: int, item: int, *args, items_per_load: int = ITEMS_PER_LOAD,
            num_warps: int = NUM_WARPS) -> None:
    """Persistent grid of at most `num_programs` programs over n work items."""
    if n:
        kernel[(max(1, min(num_programs, triton.cdiv(n, items_per_load))),)](
            *args, ITEM=item, ITEMP=triton.next_power_of_2(item), ITEMS=items_per_load, num_warps=num_warps)


def _copy_items_triton(src, dst, src_idx, dst_idx, num_programs):
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
    item = src[0].numel() if src.shape[0] else dst[0].numel()
    n = src_idx.numel()
    _launch(_copy_items_kernel, n, num_programs, item, src, dst, src_idx, dst_idx, n)


if triton is not None:

    @triton.jit
    def _move(src_ptr, dst_ptr, s, d, ok, ITEM: tl.constexpr, ITEMP: tl.constexpr):
        """Items src[s[i]] -> dst[d[i]] where ok[i], all ITEMS of them with one load: the reads
        cross PCIe with microseconds of latency, so a program must keep many bytes in flight
        to be worth its SM."""
        offs = tl.arange(0, ITEMP)
        m = ok[:, None] & (offs < ITEM)[None, :]
        x = tl.load(src_ptr + s[:, None] * ITEM + offs[None, :], mask=m)
        tl.store(dst_ptr + d[:, None] * ITEM + offs[None, :], x, mask=m)

    @triton.jit
    def _copy_items_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n,
                           ITEM: tl.constexpr, ITEMP: tl.constexpr, ITEMS: tl.constexpr):
        for i0 in range(tl.program_id(0) * ITEMS, n, tl.num_programs(0) * ITEMS):
            j = i0 + tl.arange(0, ITEMS)
            s = tl.load(src_idx_ptr + j, mask=j < n, other=-1).to(tl.int64)
            d = tl.load(dst_idx_ptr + j, mask=j < n, other=-1).to(tl.int64)
            _move(src_ptr, dst_ptr, s, d, (s >= 0) & (d >= 0), ITEM, ITEMP)


# --------------------------------------------------------------------------- sparse decode forms

def fetch_admitted(host: torch.Tensor, kv_layer: torch.Tensor, layer: int, admit_blocks: torch.Tensor,
                   admit_slots: torch.Tensor, pages: torch.Tensor, extent_start: torch.Tensor,
                   extent_blocks: torch.Tensor, num_heads: int, num_sink: int,
                   num_programs: int = DEFAULT_PROGRAMS, items_per_load: int = ITEMS_PER_LOAD,
                   num_warps: int = NUM_WARPS) -> None:
    """The transfer stage: every admitted (request, head, block) item host -> its GPU slot.

    admit_blocks / admit_slots: [R * num_heads, C] (row r * num_heads + h; -1 unused); the
    item of block b of row r is host[extent_start[r] + (layer * extent_blocks[r] + b) * H + h]
    (HostExtent's layout) and goes to slot pages[r, num_sink + slot] * H + h of `kv_layer`;
    rows with extent_blocks 0 have no host extent and are skipped (`copy_mapped` moves them).
    On CUDA the addresses are computed inside the copy kernel: one launch per layer."""
    RH, C = admit_blocks.shape
    if kv_layer.is_cuda and triton is not None:
        _launch(_fetch_kernel, RH * C, num_programs, kv_layer[0].numel(), host, kv_layer, admit_blocks,
                admit_slots, pages, extent_start, extent_blocks, layer, RH * C, C, num_heads,
                pages.shape[1], num_sink, items_per_load=items_per_load, num_warps=num_warps)
        return
    row = torch.arange(RH, device=admit_blocks.device)
    r, h = row // num_heads, row % num_heads
    blocks = torch.where(extent_blocks[r, None] > 0, admit_blocks.long(), -1)
    src = torch.where(blocks >= 0, extent_start[r, None] + (layer * extent_blocks[r, None] + blocks)
                      * num_heads + h[:, None], -1)
    page = pages.long()[r[:, None], num_sink + admit_slots.long().clamp_min(0)]
    dst = torch.where(blocks >= 0, page * num_heads + h[:, None], -1)
    copy_items(host, kv_layer, src.view(-1), dst.view(-1))


def write_through(kv: torch.Tensor, host: torch.Tensor, completed: torch.Tensor, window_slot: torch.Tensor,
                  extent_start: torch.Tensor, extent_blocks: torch.Tensor, block: torch.Tensor,
                  num_heads: int, num_programs: int = DEFAULT_PROGRAMS) -> None:
    """Rows whose token completed a block copy that block, every layer and head, GPU -> host.

    kv: [L, num_slots, *item]; completed: [R] bool; window_slot: [R] the page of the block's
    window position times num_heads (head 0's slot); block: [R] its logical block. Rows with
    extent_blocks 0 have no host extent and are skipped (`copy_mapped` moves them)."""
    L, num_slots = kv.shape[0], kv.shape[1]
    R = completed.shape[0]
    if kv.is_cuda and triton is not None:
        if R:  # one program a row at most
            item = kv[0, 0].numel()
            _write_through_kernel[(min(num_programs, R),)](
                kv, host, completed, window_slot, extent_start, extent_blocks, block, L, R, num_heads, num_slots,
                ITEM=item, ITEMP=triton.next_power_of_2(item), ITEMS=ITEMS_PER_LOAD, num_warps=NUM_WARPS)
        return
    layer = torch.arange(L, device=kv.device)[:, None, None]
    h = torch.arange(num_heads, device=kv.device)[None, None, :]
    ok = (completed & (extent_blocks > 0))[None, :, None].expand(L, R, num_heads)
    src = torch.where(ok, layer * num_slots + window_slot[None, :, None] + h, -1)
    dst = torch.where(ok, extent_start[None, :, None] + (layer * extent_blocks[None, :, None]
                      + block[None, :, None]) * num_heads + h, -1)
    copy_items(kv.view(L * num_slots, *kv.shape[2:]), host, src.reshape(-1), dst.reshape(-1))


if triton is not None:

    @triton.jit
    def _admitted_item(w, n, blk_ptr, slot_ptr, pages_ptr, ext_start_ptr, ext_blocks_ptr, layer, C, H, P, S):
        """Entry w (a scalar or a vector) of a layer's transfer plan -> (host item, GPU slot,
        ok); the addresses of a skipped entry (-1, or w >= n) are meaningless."""
        blk = tl.load(blk_ptr + w, mask=w < n, other=-1).to(tl.int64)
        r = w // C // H
        nblk = tl.load(ext_blocks_ptr + r, mask=blk >= 0, other=0)
        ok = (blk >= 0) & (nblk > 0)  # a row without a host extent: `copy_mapped`'s
        slot = tl.load(slot_ptr + w, mask=ok, other=0)
        h = (w // C % H).to(tl.int64)
        page = tl.load(pages_ptr + r * P + S + slot, mask=ok, other=0).to(tl.int64)
        start = tl.load(ext_start_ptr + r, mask=ok, other=0)
        return start + (layer * nblk + blk) * H + h, page * H + h, ok

    @triton.jit
    def _fetch_kernel(host_ptr, kv_ptr, blk_ptr, slot_ptr, pages_ptr, ext_start_ptr, ext_blocks_ptr,
                      layer, n, C, H, P, S,
                      ITEM: tl.constexpr, ITEMP: tl.constexpr, ITEMS: tl.constexpr):
        for i0 in range(tl.program_id(0) * ITEMS, n, tl.num_programs(0) * ITEMS):
            w = i0 + tl.arange(0, ITEMS)
            src, dst, ok = _admitted_item(w, n, blk_ptr, slot_ptr, pages_ptr, ext_start_ptr, ext_blocks_ptr,
                                          layer, C, H, P, S)
            _move(host_ptr, kv_ptr, src, dst, ok, ITEM, ITEMP)

    @triton.jit
    def _write_through_kernel(kv_ptr, host_ptr, done_ptr, wslot_ptr, ext_start_ptr, ext_blocks_ptr,
                              block_ptr, L, R, H, num_slots,
                              ITEM: tl.constexpr, ITEMP: tl.constexpr, ITEMS: tl.constexpr):
        # Row by row, and a row only if its token completed a block: most steps complete none,
        # so one load per row replaces a loop over every (layer, row, head) item.
        for r in range(tl.program_id(0), R, tl.num_programs(0)):
            nblk = tl.load(ext_blocks_ptr + r)
            if (tl.load(done_ptr + r) != 0) & (nblk > 0):  # a row without a host extent: `copy_mapped`'s
                wslot = tl.load(wslot_ptr + r).to(tl.int64)
                start = tl.load(ext_start_ptr + r)
                blk = tl.load(block_ptr + r).to(tl.int64)
                for j0 in range(0, L * H, ITEMS):
                    j = j0 + tl.arange(0, ITEMS)
                    layer = (j // H).to(tl.int64)
                    h = (j % H).to(tl.int64)
                    _move(kv_ptr, host_ptr, layer * num_slots + wslot + h, start + (layer * nblk + blk) * H + h,
                          j < L * H, ITEM, ITEMP)

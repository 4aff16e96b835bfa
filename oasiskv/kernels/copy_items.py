"""Copy whole KV items (one (block, head) K+V, `[2, block_size, head_dim]`) between two item
arrays by index lists: the transfer stage (host pool -> GPU slots) and write-through (GPU
slots -> host pool) of sparse decode.

On CUDA the copy is a Triton kernel with a **bounded grid** of persistent programs that read
the pinned host arena through its UVA address (DESIGN §7): a one-program-per-item launch
takes every SM and stops the foreground model from overlapping with it; a few dozen
programs, each moving a whole 8 KiB item per load, leave the SMs to the model and still
reach PCIe speed. Indices below zero are skipped, so fixed-shape (CUDA-graph) index lists
can carry unused entries.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch path
    triton = None

DEFAULT_PROGRAMS = 32


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


def _copy_items_triton(src, dst, src_idx, dst_idx, num_programs, items_per_load: int = 4):
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
    item = src[0].numel() if src.shape[0] else dst[0].numel()
    n = src_idx.numel()
    if n:
        grid = (max(1, min(num_programs, triton.cdiv(n, items_per_load))),)
        _copy_items_kernel[grid](src, dst, src_idx, dst_idx, n, ITEM=item,
                                 ITEMP=triton.next_power_of_2(item), ITEMS=items_per_load, num_warps=8)


if triton is not None:

    @triton.jit
    def _copy_items_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n,
                           ITEM: tl.constexpr, ITEMP: tl.constexpr, ITEMS: tl.constexpr):
        # Each iteration moves ITEMS whole items with one load: the reads cross PCIe with
        # microseconds of latency, so a program must keep many bytes in flight to be worth its SM.
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        offs = tl.arange(0, ITEMP)
        for i0 in range(pid * ITEMS, n, progs * ITEMS):
            j = i0 + tl.arange(0, ITEMS)
            s = tl.load(src_idx_ptr + j, mask=j < n, other=-1).to(tl.int64)
            d = tl.load(dst_idx_ptr + j, mask=j < n, other=-1).to(tl.int64)
            m = ((s >= 0) & (d >= 0))[:, None] & (offs < ITEM)[None, :]
            x = tl.load(src_ptr + s[:, None] * ITEM + offs[None, :], mask=m)
            tl.store(dst_ptr + d[:, None] * ITEM + offs[None, :], x, mask=m)

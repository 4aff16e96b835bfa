"""Host KV pool (docs/design.md, "Memory layout"): one preallocated arena holding the FULL KV
of every sparse request, pinned when CUDA is present so host -> GPU copies (and the fetch
kernel's UVA reads) run at PCIe speed, which pageable memory does not reach.

The unit is an item: the K and V of one (layer, block, kv head), `[2, block_size, head_dim]`,
the same bytes as one GPU slot (kernels/reference.py), so one transfer is one contiguous item
(8 KiB at 16 x 128 x bf16). A request gets one contiguous extent laid out [layer][block][head]:
a block's heads are adjacent, and a whole layer of the request is one contiguous range.
Extents are placed first-fit over a sorted free list; freeing coalesces neighbours. Finished
requests' extents may stay as the prefix cache's host tier (`host_cache.HostPrefixCache`):
when no free range fits, allocation evicts them, least recently used first.
"""
from __future__ import annotations

import bisect
import math
import mmap
import weakref
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, slots=True)
class HostExtent:
    """Items [start, start + num_items) of the arena, owned by one request."""
    request_id: int | str
    start: int
    num_layers: int
    max_blocks: int
    num_kv_heads: int

    @property
    def num_items(self) -> int:
        return self.num_layers * self.max_blocks * self.num_kv_heads

    def item_index(self, layer: int, block: int, head: int) -> int:
        assert 0 <= layer < self.num_layers and 0 <= block < self.max_blocks \
            and 0 <= head < self.num_kv_heads
        return self.start + (layer * self.max_blocks + block) * self.num_kv_heads + head


def item_indices(start: torch.Tensor | int, max_blocks: torch.Tensor | int, num_kv_heads: int,
                 layer: torch.Tensor | int, block: torch.Tensor | int,
                 head: torch.Tensor | int) -> torch.Tensor:
    """Vectorized `HostExtent.item_index`: every argument broadcasts, so one call covers items of
    many requests (start and max_blocks per request). Returns int64; no bounds check."""
    t = lambda x: torch.as_tensor(x, dtype=torch.int64)  # noqa: E731
    return t(start) + (t(layer) * t(max_blocks) + t(block)) * num_kv_heads + t(head)


HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised host memory on 2 MiB boundaries, advised to the kernel as transparent huge
    pages (where THP is "madvise" or "always"; elsewhere ordinary memory). On 4 KiB pages the
    GPU needs a translation for about every 8 KiB item the fetch reads through UVA, which slows
    the attention that runs beside the fetch; huge pages take that away, and a large pool also
    registers with CUDA faster (`bench decode --host-pages huge|base` compares them)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(shape, dtype=dtype)
    # Private: shared anonymous memory is shmem, whose huge pages follow another switch.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf` until the tensor is freed
    skip = -raw.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def anon_huge_page_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (Linux; 0 elsewhere): what the
    kernel actually granted of `huge_page_empty`'s advice."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """Page-locked host memory of exactly the asked size, mapped for the GPU (UVA).

    `torch.empty(pin_memory=True)` goes through the caching host allocator, which rounds every
    request up to a power of two: a 70 GiB arena would ask for 128 GiB and fail on a machine
    with 125 GiB. So take ordinary memory (huge pages unless told not to) and register it with
    CUDA instead (unregistered when the tensor is freed)."""
    t = huge_page_empty(shape, dtype) if huge_pages else torch.empty(shape, dtype=dtype)
    register_pinned(t, t)
    return t


def register_pinned(t: torch.Tensor, owner: torch.Tensor, flag: str = "--host-kv-gb") -> None:
    """Page-lock the memory of `t` (a range of `owner`) and map it for the GPU, until `owner`
    is freed. Memory another library registered already (a transport's) stays as it is."""
    nbytes = t.numel() * t.element_size()
    if nbytes:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), nbytes, _REGISTER_PORTABLE | _REGISTER_MAPPED)
        if int(err) == _ALREADY_REGISTERED:
            return
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (error {int(err)}): "
                               f"lower {flag}")
        weakref.finalize(owner, cudart.cudaHostUnregister, t.data_ptr())


_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class PinnedOnUse:
    """An arena `tensor` [N, *item] page-locked and mapped for the GPU a chunk at a time, as far
    as it has been handed out (`pin_to`), so a large arena that fills from its low end (the
    decode side's received items, `disagg.LocalItems`) commits only the memory it used. The
    first chunk is pinned at once: a device view of the range needs its start registered."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
                 chunk_bytes: int = 256 << 20, page_bytes: int = HUGE_PAGE, flag: str = "--remote-kv-gb"):
        self.tensor = huge_page_empty(shape, dtype)
        item_bytes = max(1, self.tensor[0].numel() * self.tensor.element_size()) if shape[0] else 1
        unit = page_bytes // math.gcd(item_bytes, page_bytes)  # items that end on a page boundary
        self.chunk_items = max(1, chunk_bytes // item_bytes // unit) * unit  # no page in two chunks
        self.pin, self.flag = pin, flag
        self.pinned_items = 0
        self.pin_to(1)

    def pin_to(self, end: int) -> None:
        """Items [0, end) are page-locked from now on."""
        end = min(end, self.tensor.shape[0])
        while self.pin and self.pinned_items < end:
            stop = min(self.pinned_items + self.chunk_items, self.tensor.shape[0])
            register_pinned(self.tensor[self.pinned_items:stop], self.tensor, self.flag)
            self.pinned_items = stop


class HostKVPool:
    """Arena `items[num_items, 2, block_size, head_dim]` with per-request extents."""

    def __init__(self, capacity_gb: float, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, pin: bool = True, *,
                 num_items: int | None = None, huge_pages: bool = True):
        """`capacity_gb` GiB (2**30 bytes, as --kv-cache-gb), rounded down to whole items;
        `num_items` sets the item count exactly instead (tests, small pools); huge_pages: the
        pinned arena on 2 MiB pages (`huge_page_empty`)."""
        self.block_size, self.head_dim, self.dtype = block_size, head_dim, dtype
        self.item_bytes = 2 * block_size * head_dim * torch.empty((), dtype=dtype).element_size()
        if num_items is None:
            num_items = int(capacity_gb * 2**30) // self.item_bytes
        self.pinned = pin and torch.cuda.is_available()
        shape = (num_items, 2, block_size, head_dim)
        self.items = pinned_empty(shape, dtype, huge_pages) if self.pinned else torch.empty(shape, dtype=dtype)
        self._free: list[tuple[int, int]] = [(0, num_items)] if num_items else []  # (start, length)
        self._extents: dict[int | str, HostExtent] = {}
        self.cache = None  # the HostPrefixCache whose extents allocation may evict (it sets this)

    # ------------------------------------------------------------------ accounting
    @property
    def num_items(self) -> int:
        return self.items.shape[0]

    @property
    def items_free(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def bytes_free(self) -> int:
        return self.items_free * self.item_bytes

    @property
    def items_cached(self) -> int:
        """Items of finished requests' extents kept as the prefix cache (free when needed)."""
        return self.cache.items_cached if self.cache is not None else 0

    @property
    def bytes_used(self) -> int:
        """Bytes that requests hold (the prefix cache's extents not counted)."""
        return (self.num_items - self.items_free - self.items_cached) * self.item_bytes

    def largest_free_items(self) -> int:
        return max((n for _, n in self._free), default=0)

    def can_fit(self, num_layers: int, max_blocks: int, num_kv_heads: int) -> bool:
        need = num_layers * max_blocks * num_kv_heads
        return any(n >= need for _, n in self._free)

    # ------------------------------------------------------------------ allocation
    def allocate(self, request_id: int | str, num_layers: int, max_blocks: int,
                 num_kv_heads: int) -> HostExtent | None:
        """First free range that fits, evicting the prefix cache's extents (least recently used
        first) until one does; None if none does now (the caller makes it wait)."""
        if request_id in self._extents:
            raise ValueError(f"request {request_id!r} already holds a host extent")
        need = num_layers * max_blocks * num_kv_heads
        if need <= 0:
            raise ValueError("an extent needs at least one item")
        while True:
            ext = self._first_fit(request_id, need, num_layers, max_blocks, num_kv_heads)
            if ext is not None or self.cache is None or not self.cache.evict_lru():
                return ext

    def _first_fit(self, request_id, need: int, num_layers: int, max_blocks: int,
                   num_kv_heads: int) -> HostExtent | None:
        for i, (start, n) in enumerate(self._free):
            if n >= need:
                if n == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, n - need)
                ext = HostExtent(request_id, start, num_layers, max_blocks, num_kv_heads)
                self._extents[request_id] = ext
                return ext
        return None

    def free(self, request_id: int | str) -> None:
        """Return the request's extent, merging it with adjacent free ranges."""
        ext = self._extents.pop(request_id)
        start, n = ext.start, ext.num_items
        i = bisect.bisect_left(self._free, (start, 0))
        if i < len(self._free) and start + n == self._free[i][0]:  # merge with the next
            n += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the previous
            start, prev_n = self._free[i - 1]
            self._free[i - 1] = (start, prev_n + n)
        else:
            self._free.insert(i, (start, n))

    def rename(self, request_id: int | str, new_id: int | str) -> HostExtent:
        """The extent passes to another key (a finished request's, to the prefix cache)."""
        ext = replace(self._extents.pop(request_id), request_id=new_id)
        self._extents[new_id] = ext
        return ext

    def extent(self, request_id: int | str) -> HostExtent | None:
        return self._extents.get(request_id)

    # ------------------------------------------------------------------ addressing
    def item_index(self, extent: HostExtent, layer, block, head) -> int | torch.Tensor:
        """Arena index of items of one extent: an int (bounds-checked) for int arguments, an
        int64 tensor when any argument is a tensor (broadcast, unchecked)."""
        if all(isinstance(x, int) for x in (layer, block, head)):
            return extent.item_index(layer, block, head)
        return item_indices(extent.start, extent.max_blocks, extent.num_kv_heads,
                            layer, block, head)

    def extent_items(self, extent: HostExtent) -> torch.Tensor:
        """The extent as a view [num_layers, max_blocks, num_kv_heads, 2, block_size, head_dim]."""
        return self.items[extent.start:extent.start + extent.num_items].view(
            extent.num_layers, extent.max_blocks, extent.num_kv_heads, 2, self.block_size,
            self.head_dim)

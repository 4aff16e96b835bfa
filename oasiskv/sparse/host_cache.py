"""Host tier of the prefix cache (docs/prefix_caching.md): a finished sparse request's host
extent (its full KV) and block summaries stay in the host pool, named by the same chained block
hashes as GPU pages (`engine/block_hash.py`), until the pool needs the room.

Only the blocks a request computed densely (full when it converted) are named: the K/V of a
block written during sparse decode came from attention over a working set, not the K/V a
prefill computes. Names are chained, so the entry that holds a request's deepest hit block holds
every block before it: a hit is one entry and a block count. Entries wait in LRU order
(least recently used first); `HostKVPool.allocate` evicts the oldest one nobody pins when no
free range fits. A request that hits an entry pins it until its blocks are loaded into GPU pages.
When a newer entry holds every name an older one holds, the older one is unreachable and goes.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from oasiskv.sparse.host_pool import HostExtent


@dataclass(eq=False)
class CachedExtent:
    """A finished request's extent, kept for its first `len(names)` blocks."""
    key: tuple[str, int]  # its key in the host pool
    extent: HostExtent
    names: list[bytes]
    kmin: torch.Tensor  # [L, len(names), Hkv, D] summaries of those blocks
    kmax: torch.Tensor
    pins: int = 0  # requests whose hit on it is not loaded yet
    live: int = 0  # names of the index that point at it; 0: unreachable


@dataclass(frozen=True)
class HostHit:
    """Blocks [first_block, first_block + num_blocks) of a request are in `entry`."""
    entry: CachedExtent
    first_block: int
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class HostPrefixCache:
    def __init__(self, pool):
        self.pool = pool  # HostKVPool: extents move between its requests and this cache
        pool.cache = self  # its allocation evicts from here
        self.entries: OrderedDict[tuple[str, int], CachedExtent] = OrderedDict()  # LRU first
        self.index: dict[bytes, CachedExtent] = {}  # block name -> the entry holding that block
        self._keys = (("host-cache", i) for i in itertools.count())
        # prefix_cache_queries / hits of this tier: prompt tokens looked up at admission, and
        # those found here beyond the GPU tier's hits (loaded, not prefilled).
        self.queries = 0
        self.hits = 0

    @property
    def items_cached(self) -> int:
        return sum(e.extent.num_items for e in self.entries.values())

    def keep(self, request_id: int | str, names: list[bytes], kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        """The finished request's extent joins the cache (newest) under `names`; with no names
        it goes back to the pool."""
        if not names:
            self.pool.free(request_id)
            return
        key = next(self._keys)
        entry = CachedExtent(key, self.pool.rename(request_id, key), list(names), kmin, kmax)
        self.entries[key] = entry
        for name in names:  # the newest copy of a block answers: the older one is evicted first
            old = self.index.get(name)
            if old is not None:
                old.live -= 1
            self.index[name] = entry
            entry.live += 1
            if old is not None and old.live == 0 and old.pins == 0:
                self._drop(old)

    def lookup(self, names: list[bytes], skip: int = 0) -> HostHit | None:
        """The longest run of `names` from block 0 held here, if it reaches past block `skip`
        (the blocks the GPU tier already holds)."""
        n = 0
        while n < len(names) and names[n] in self.index:
            n += 1
        if n <= skip:
            return None
        entry = self.index[names[n - 1]]
        return HostHit(entry, skip, n - skip, self.pool.block_size)

    def pin(self, entry: CachedExtent) -> None:
        entry.pins += 1
        self.entries.move_to_end(entry.key)  # used: the last to be evicted

    def unpin(self, entry: CachedExtent) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, "a host-cache entry unpinned more often than pinned"
        if entry.pins == 0 and entry.live == 0:
            self._drop(entry)

    def evict_lru(self) -> bool:
        """Give the least recently used unpinned entry's extent back to the pool; False if none."""
        for entry in self.entries.values():
            if entry.pins == 0:
                self._drop(entry)
                return True
        return False

    def clear(self) -> None:
        """Forget every entry nobody pins (`reset_prefix_cache`); pinned ones lose their names
        and go when unpinned."""
        for entry in list(self.entries.values()):
            for name in entry.names:
                if self.index.get(name) is entry:
                    del self.index[name]
            entry.live = 0
            if entry.pins == 0:
                self._drop(entry)

    def _drop(self, entry: CachedExtent) -> None:
        for name in entry.names:
            if self.index.get(name) is entry:
                del self.index[name]
        entry.live = 0
        del self.entries[entry.key]
        self.pool.free(entry.key)

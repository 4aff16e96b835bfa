"""The decode side's host memory for disaggregated requests (docs/disaggregation.md): an arena
of KV items, `[num_items, 2, block_size, head_dim]` as the host pool's, handed out one item at
a time. A request holds only the items it has received (its admission's working set, the
blocks it fetched since, the blocks it wrote itself), not a reservation for its whole context.

Free items are kept as sorted runs, and a batch of n items is taken from the lowest runs, so
the items of one read come out mostly adjacent and adjacent remote items land in adjacent local
ones: one extent each run (`remote_reads.merge_runs`).
"""
from __future__ import annotations

import numpy as np
import torch

from oasiskv.sparse.host_pool import PinnedOnUse, huge_page_empty


class LocalItems:
    def __init__(self, num_items: int, block_size: int, head_dim: int, dtype: torch.dtype):
        self.items = huge_page_empty((num_items, 2, block_size, head_dim), dtype)
        self._init_runs(num_items, block_size, head_dim, dtype)

    @classmethod
    def over(cls, arena: PinnedOnUse) -> "LocalItems":
        """Items handed out of an arena made elsewhere (the model runner's `remote_items`, which
        the pipeline reads): each batch pinned before it is handed out (`PinnedOnUse.pin_to`)."""
        store = cls.__new__(cls)
        items = store.items = arena.tensor
        store._init_runs(items.shape[0], items.shape[2], items.shape[3], items.dtype)
        store._grow = arena.pin_to
        return store

    def _init_runs(self, num_items: int, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        self.item_bytes = 2 * block_size * head_dim * dtype.itemsize
        self._runs: list[tuple[int, int]] = [(0, num_items)] if num_items else []  # (start, length)
        self._free_count = num_items
        self.peak_items = 0  # the most handed out at once
        self._grow = None  # called with the end of every batch handed out

    @property
    def num_items(self) -> int:
        return self.items.shape[0]

    @property
    def items_free(self) -> int:
        return self._free_count

    @property
    def bytes_used(self) -> int:
        return (self.num_items - self._free_count) * self.item_bytes

    def allocate(self, n: int) -> np.ndarray | None:
        """n item indices, ascending, lowest runs first; None (nothing taken) if fewer are free."""
        if n > self._free_count:
            return None
        out, need = [], n
        while need:
            start, length = self._runs[0]
            take = min(need, length)
            out.append(np.arange(start, start + take, dtype=np.int64))
            if take == length:
                self._runs.pop(0)
            else:
                self._runs[0] = (start + take, length - take)
            need -= take
        self._free_count -= n
        self.peak_items = max(self.peak_items, self.num_items - self._free_count)
        if not out:
            return np.zeros(0, dtype=np.int64)
        if self._grow is not None:
            self._grow(int(out[-1][-1]) + 1)
        return np.concatenate(out)

    def free(self, indices: np.ndarray) -> None:
        """Give items back; runs are merged with their neighbours."""
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        if not len(idx):
            return
        if len(idx) != len(np.asarray(indices).reshape(-1)):
            raise ValueError("an item freed twice in one call")
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        new = [(int(r[0]), len(r)) for r in np.split(idx, breaks)]
        runs = sorted(self._runs + new)
        merged: list[tuple[int, int]] = []
        for start, length in runs:
            if merged and merged[-1][0] + merged[-1][1] > start:
                raise ValueError(f"item {start} freed while free")
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._runs = merged
        self._free_count += len(idx)

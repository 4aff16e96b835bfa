"""The pipeline's state for a decode instance's disaggregated rows (docs/disaggregation.md, "On
the batched pipeline").

Such a row's blocks are not in a host extent: those the decode side has are items of the
arena of received items (`LocalItems`' memory, pinned and mapped on CUDA, so the transfer
reads it as it reads the host pool), the others are still in the prefill's host pool. Each
row takes a slot, and on the device

    item_map [slots, L, max_blocks, Hkv] int32   the arena item of each (layer, block, head),
                                                 -1 while it is not local
    row_slot [R]                                 each pipeline row's slot, -1 for local rows
    wanted [R * Hkv, L, K] int32                 the blocks each layer's prediction asked for
                                                 and did not get, this step (-1 elsewhere);
                                                 a step's first rows are one contiguous copy

The host writes the map between steps, on the stream the steps run on, as items arrive
(`set_map`, `update_map`). Inside the step, after each layer's prediction, `mask` takes out
the predicted blocks that are not local (so the selection never admits one and the working set
keeps what it holds) and records them in `wanted`, which the host
reads with the step's tokens (`stage_wanted`, `read_wanted`) and asks of the prefill.
"""
from __future__ import annotations

import numpy as np
import torch

from oasiskv.kernels.copy_items import device_view
from oasiskv.kernels.copy_mapped import fetch_mapped, write_through_mapped
from oasiskv.sparse.host_pool import pinned_empty


class RemoteRows:
    def __init__(self, items: torch.Tensor, num_slots: int, num_layers: int, max_blocks: int, num_kv_heads: int,
                 max_rows: int, top_k: int, device: torch.device, want_per_head: int = 0):
        """items: the arena [N, 2, bs, D] (pinned and mapped on CUDA: `pinned_empty`); want_per_head: the
        best-ranked missing blocks a (row, head) asks for at each layer (0: all)."""
        L, H, R = num_layers, num_kv_heads, max_rows
        self.items = items
        self.items_on_device = device_view(items, device) if device.type == "cuda" else items
        self.L, self.H, self.max_blocks = L, H, max_blocks
        self.want_per_head = want_per_head
        i32 = dict(dtype=torch.int32, device=device)
        self.item_map = torch.full((num_slots, L, max_blocks, H), -1, **i32)
        self.row_slot = torch.full((R,), -1, dtype=torch.long, device=device)
        self.row_slots = [-1] * R  # the host's copy of row_slot
        self.wanted = torch.full((R * H, L, top_k), -1, **i32)
        self.head_of = torch.arange(R * H, device=device) % H  # the KV head of each (row, head) line
        self._free = list(range(num_slots - 1, -1, -1))
        shape = (R * H, L, top_k)
        pin = device.type == "cuda"
        self._wanted_host = pinned_empty(shape, torch.int32) if pin else torch.empty(shape, dtype=torch.int32)
        self._staged_lines = 0

    @property
    def num_slots(self) -> int:
        return self.item_map.shape[0]

    # ---- slots (host) ------------------------------------------------------------------
    def take_slot(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_slot(self, slot: int) -> None:
        self._free.append(slot)

    def set_row(self, row: int, slot: int) -> None:
        self.row_slots[row] = slot
        self.row_slot[row] = slot

    def move_row(self, src: int, dst: int) -> None:
        """Row `src`'s slot moves to row `dst` (`LookaheadPipeline.release`); src is left local."""
        self.set_row(dst, self.row_slots[src])
        self.set_row(src, -1)

    # ---- the map (host, between steps) ---------------------------------------------------
    def set_map(self, slot: int, where: np.ndarray) -> None:
        """A slot's whole map from a request's table `where` [L, blocks, Hkv] (< 0: not local)."""
        table = torch.from_numpy(np.where(where >= 0, where, -1).astype(np.int32))
        self.item_map[slot].fill_(-1)
        self.item_map[slot, :, :table.shape[1]] = table.to(self.item_map.device)

    def update_map(self, slots: np.ndarray, layer: np.ndarray, block: np.ndarray, head: np.ndarray,
                   items: np.ndarray) -> None:
        """Entries that became local: item_map[slots, layer, block, head] = items (one copy)."""
        if not len(items):
            return
        dev = self.item_map.device
        index = tuple(torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(dev)
                      for x in (slots, layer, block, head))
        self.item_map[index] = torch.from_numpy(np.ascontiguousarray(items, dtype=np.int32)).to(dev)

    # ---- inside the step -----------------------------------------------------------------
    def mask(self, layer: int, predicted: torch.Tensor, scores: torch.Tensor, active: torch.Tensor) -> None:
        """After layer l's prediction of the first B rows (predicted, scores: [B * Hkv, K], in
        place; active: [B]): mapped rows' blocks that are not local go to `wanted` and out of
        the prediction; each line asks for its `want_per_head` best of them. Fixed shapes, no
        host sync: it runs inside the captured step."""
        n = predicted.shape[0]
        B = n // self.H
        slot = self.row_slot[:B, None].expand(B, self.H).reshape(n, 1)
        mapped = (slot >= 0) & active[:B, None].expand(B, self.H).reshape(n, 1) & (predicted >= 0)
        local = self.item_map[slot.clamp_min(0), layer, predicted.long().clamp(0, self.max_blocks - 1),
                              self.head_of[:n, None]] >= 0
        missing = mapped & ~local
        asked = missing
        if self.want_per_head:  # the prediction is sorted best first: its first misses
            asked = missing & (missing.cumsum(-1) <= self.want_per_head)
        self.wanted[:n, layer] = torch.where(asked, predicted, -1)
        predicted.masked_fill_(missing, -1)
        scores.masked_fill_(missing, float("-inf"))

    def fetch(self, kv_layer: torch.Tensor, layer: int, admit_blocks: torch.Tensor, admit_slots: torch.Tensor,
              pages: torch.Tensor, num_sink: int, programs: int, items_per_load: int, warps: int) -> None:
        fetch_mapped(self.items_on_device, kv_layer, layer, admit_blocks, admit_slots, pages, self.row_slot,
                     self.item_map, self.H, num_sink, programs, items_per_load, warps)

    def write_through(self, kv: torch.Tensor, completes: torch.Tensor, window_slot: torch.Tensor,
                      block: torch.Tensor, programs: int) -> None:
        write_through_mapped(kv, self.items_on_device, completes, window_slot, self.row_slot, self.item_map,
                             block, self.H, programs)

    # ---- after the step ------------------------------------------------------------------
    def stage_wanted(self, rows: int) -> None:
        """Copy the step's `wanted` of its first `rows` rows to the host, on the stream, before
        the step's tokens are copied (their read then covers it)."""
        n = rows * self.H
        self._wanted_host[:n].copy_(self.wanted[:n], non_blocking=True)
        self._staged_lines = n

    def read_wanted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The staged step's wanted blocks as (layer, row, head, block), row by row (each row's
        heads in order, each head's layers in order). Call once the step's tokens are read."""
        w = self._wanted_host[:self._staged_lines].numpy()  # [lines, L, K]
        line, layer, k = np.nonzero(w >= 0)
        return layer, line // self.H, line % self.H, w[line, layer, k].astype(np.int64)

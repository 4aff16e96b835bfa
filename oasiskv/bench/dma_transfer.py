"""`bench decode --transfer-backend dma`: the transfer stage as CPU gather + one copy-engine DMA.

After the step (whose pipeline ran predict and select only: `PipelineTuning(stages=2)`), CPU
threads gather every layer's admitted items into pinned staging, one DMA copy brings them over
and one scatter puts them in their slots, all before the next step. It reads the plan on the
host, so it cannot live in the captured step: the transfer is on the critical path, between
steps, and takes no SMs. The engine uses the in-graph UVA fetch (docs/kernel_benchmarks.md
compares the two).
"""
from __future__ import annotations

import torch

from oasiskv.sparse.host_pool import pinned_empty
from oasiskv.sparse.pipeline import LookaheadPipeline


class DmaTransfer:
    def __init__(self, pipeline: LookaheadPipeline):
        self.pipeline = pipeline
        self.staging: torch.Tensor | None = None  # pinned host buffer the CPU gathers into

    def __call__(self) -> None:
        """Move the admissions of the step that just ran, every layer's, into their slots."""
        p = self.pipeline
        B, H, C, L = p.B, p.H, p.C, p.L
        blocks = p.admit_blocks[:, :B * H].cpu()  # [L, B*H, C]; the sync that ends the step
        slots = p.admit_slots[:, :B * H].cpu()
        layer, row, col = (blocks >= 0).nonzero(as_tuple=True)
        n = layer.numel()
        if not n:
            return
        r, h = row // H, row % H
        start, nblk, pages = p.extent_start[:B].cpu(), p.extent_blocks[:B].cpu(), p.pages[:B].cpu().long()
        src = start[r] + (layer * nblk[r] + blocks[layer, row, col].long()) * H + h
        num_slots = p.kv.shape[1]
        dst = layer * num_slots + pages[r, p.S + slots[layer, row, col].long()] * H + h
        if self.staging is None or self.staging.shape[0] < n:
            shape = (max(n, L * B * H * C), *p.host.items.shape[1:])
            pin = p.device.type == "cuda"
            self.staging = pinned_empty(shape, p.kv.dtype) if pin else torch.empty(shape, dtype=p.kv.dtype)
        torch.index_select(p.host.items, 0, src, out=self.staging[:n])
        items = self.staging[:n].to(p.device, non_blocking=True)
        p.kv.view(-1, *p.kv.shape[2:])[dst.to(p.device)] = items

"""Where GPU memory goes: the start-up plan (weights, the activation peak of a prefill step, the
page pool, the sparse pipeline's rows, CUDA graphs) and, while serving, the pool's pages by what
holds them (dense page tables, sparse working sets, sparse summaries, free). The KV budget
(--kv-cache-gb, or what --gpu-memory-utilization leaves) is the pool plus the pipeline's rows:
every byte of KV state.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
GIB = 2**30


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


@dataclass
class MemoryPlan:
    """Bytes by kind at start-up. `weights`, `kv_pool` and `pipeline_rows` are counted from the
    tensors; `activation_peak` is the profiled prefill step's (freed again); `cuda_graphs` and
    `allocated` are measured (torch.cuda.memory_allocated; 0 off CUDA)."""
    weights: int
    activation_peak: int
    kv_pool: int
    page_bytes: int
    pipeline_rows: int
    cuda_graphs: int = 0
    allocated: int = 0

    @property
    def kv_budget(self) -> int:
        return self.kv_pool + self.pipeline_rows

    @property
    def counted(self) -> int:
        return self.weights + self.kv_pool + self.pipeline_rows + self.cuda_graphs

    def log(self) -> None:
        g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
        log.info("GPU memory plan (GiB): weights %s, activations (peak of a prefill step) %s, KV budget %s = "
                 "page pool %s (%d pages of %.2f MiB: dense pages, sparse working sets and summaries) + sparse "
                 "pipeline rows %s; CUDA graphs %s; allocated %s", g(self.weights), g(self.activation_peak),
                 g(self.kv_budget), g(self.kv_pool), self.kv_pool // self.page_bytes, self.page_bytes / 2**20,
                 g(self.pipeline_rows), g(self.cuda_graphs), g(self.allocated))


def pages_by_kind(scheduler, block_manager, working_set_blocks: int) -> dict[str, int]:
    """The pool's pages now: held by dense page tables (shared pages once), by sparse working sets,
    by sparse summaries (each sparse request's pages past its working set), and free."""
    ws = summaries = 0
    for seq in scheduler.running:
        if seq.sparse is not None:
            ws += working_set_blocks
            summaries += len(seq.pages) - working_set_blocks
    held = block_manager.num_pages - block_manager.num_free
    return {"kv_dense": held - ws - summaries, "kv_working_sets": ws, "kv_summaries": summaries,
            "kv_free": block_manager.num_free}


def gpu_bytes_by_kind(plan: MemoryPlan, scheduler, block_manager, working_set_blocks: int) -> dict[str, int]:
    """GPU bytes by kind for /metrics (`oasiskv:gpu_memory_bytes{kind=...}`)."""
    out = {"weights": plan.weights, "sparse_pipeline_rows": plan.pipeline_rows, "cuda_graphs": plan.cuda_graphs}
    for kind, pages in pages_by_kind(scheduler, block_manager, working_set_blocks).items():
        out[kind] = pages * plan.page_bytes
    return out

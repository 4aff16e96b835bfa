"""The head-wise working set of one sparse request (docs/design.md, "Memory layout"), and its
per-step bookkeeping.

The request owns P = S + K + W GPU pages. Position i of head h (in every layer) is the
physical slot `pages[i] * Hkv + h`; what changes from step to step is which logical block
each (layer, head, position) holds:
  positions [0, S)         sink blocks 0..S-1, fixed
  positions [S, S+K)       the K dynamic blocks chosen by prediction + capped eviction
  positions [S+K, S+K+W)   the local window, a ring: block b sits at S + K + b % W
The full KV stays in the host pool (write-through as blocks complete); the per-block
min/max key summaries stay on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from oasiskv.sparse.config import SparseConfig
from oasiskv.sparse.drafters import TokenHistory
from oasiskv.sparse.host_pool import HostExtent

if TYPE_CHECKING:
    from oasiskv.disagg.remote_reads import RemoteRequest


@dataclass
class SparseStats:
    steps: int = 0
    predicted: int = 0  # predicted blocks, summed over (layer, head, step)
    hits: int = 0
    admitted: int = 0
    evicted: int = 0
    bytes_to_device: int = 0
    drafts: int = 0  # draft tokens proposed
    drafts_accepted: int = 0  # ... that equalled the real next token
    stall_s: float = 0.0  # time its steps' foreground waited on the pipeline streams (CUDA)

    def absorb(self, counts: list[int], item_bytes: int) -> None:
        """Add a pipeline row's device counters (hits, missed, admitted, evicted)."""
        hits, missed, admitted, evicted = counts
        self.predicted += hits + missed
        self.hits += hits
        self.admitted += admitted
        self.evicted += evicted
        self.bytes_to_device += admitted * item_bytes

    def as_dict(self, resident_blocks: int, total_blocks: int) -> dict:
        return {
            "sparse_steps": self.steps,
            "resident_blocks_per_head": resident_blocks,
            "context_blocks": total_blocks,
            "predicted": self.predicted, "hits": self.hits,
            "hit_rate": self.hits / self.predicted if self.predicted else None,
            "admitted": self.admitted, "evicted": self.evicted,
            "bytes_to_device": self.bytes_to_device,
            "blocks_fetched_per_step": self.admitted / self.steps if self.steps else 0.0,
            "bytes_fetched_per_step": self.bytes_to_device / self.steps if self.steps else 0.0,
            "drafts": self.drafts, "drafts_accepted": self.drafts_accepted,
            "draft_acceptance": self.drafts_accepted / self.drafts if self.drafts else None,
            "pipeline_stall_s": self.stall_s,
        }


@dataclass
class WorkingSet:
    cfg: SparseConfig
    pages: list[int]  # P GPU pages
    extent: HostExtent | None  # the request's reservation in the host pool
    # As the conversion (or a decode instance's admission) builds the working set; they move to
    # the pipeline's batched state (LookaheadPipeline.adopt) and are None then; `row` says where.
    blocks: torch.Tensor | None  # [L, Hkv, P] int32 logical block per position, -1 empty
    last_selected: torch.Tensor | None  # [L, Hkv, K] int64
    kmin: torch.Tensor | None  # [L, max_blocks, Hkv, D] summaries
    kmax: torch.Tensor | None
    draft: int | None = None  # the lookahead token proposed for the next step
    history: TokenHistory | None = None  # the request's tokens, for prompt lookup
    noise: torch.Tensor | None = None  # [V] sampling noise of the next position, drawn a step early
    stats: SparseStats = field(default_factory=SparseStats)
    row: int | None = None  # its row of the LookaheadPipeline, once adopted
    remote: RemoteRequest | None = None  # a disaggregated request's: its blocks come from a peer
    exact_blocks: int = 0  # full blocks when it converted: computed dense, so the host tier may name them
    summary_offset: int = 0  # its first block's index in the page pool's summaries (`summary_arena`)

    @property
    def dynamic(self) -> slice:
        return slice(self.cfg.sink_blocks, self.cfg.sink_blocks + self.cfg.top_k_blocks)

    def position(self, block: int) -> int:
        """Where the block lives while it is a sink or in the window: a sink block (one a
        prompt shorter than the sinks is still filling included) at its own position."""
        return block if block < self.cfg.sink_blocks else self.window_position(block)

    def window_position(self, block: int) -> int:
        c = self.cfg
        return c.sink_blocks + c.top_k_blocks + block % c.window_blocks

    def window_start(self, num_tokens: int, block_size: int) -> int:
        """First window block once the context holds `num_tokens` tokens plus the one being added."""
        cur = num_tokens // block_size  # the block the newest token goes to
        return max(self.cfg.sink_blocks, cur - self.cfg.window_blocks + 1)

    def window_positions(self, cached: int, block_size: int) -> tuple[list[int], int]:
        """Window positions holding cached tokens, oldest first (the partial block last), and
        how many tokens the partial block holds, for a step that adds token number `cached`."""
        cur = cached // block_size
        positions = [self.window_position(b) for b in range(self.window_start(cached, block_size), cur)]
        partial = cached % block_size
        if partial:
            positions.append(self.position(cur))
        return positions, partial

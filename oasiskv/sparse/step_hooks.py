"""What a decode step of the in-line path asks of the sparse manager inside each layer, around
attention: the `AttentionHooks` the batched `LookaheadPipeline` also implements."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oasiskv.kernels.qkv_epilogue import SummaryFold
from oasiskv.layers.attention import AttentionMetadata
from oasiskv.sparse.drafters import Drafter
from oasiskv.sparse.manager import SparseManager
from oasiskv.sparse.working_set import WorkingSet


@dataclass
class SparseRow:
    batch_index: int  # b: its tokens are rows b*Q (the real token) and b*Q+1 (the draft)
    ws: WorkingSet
    cached: int  # tokens in the cache before this step's token


@dataclass
class SparseStepHooks:
    manager: SparseManager
    rows: list[SparseRow]
    query_len: int
    drafter: Drafter
    prefetch: bool = True  # off for a first pass (`Drafter.first_pass`)
    record_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # token row -> [L, Hq, D]

    def summary_fold(self, layer: int) -> SummaryFold | None:
        return None  # the in-line path folds per request, after attention

    def before_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        if not (self.drafter.retrieves_on_demand and self.prefetch):
            return
        # Quest/ArkVale-style retrieval: this token's own query, fetched on the critical path.
        m = self.manager
        for r in self.rows:
            m.prefetch(r.ws, layer, q[r.batch_index * self.query_len], r.cached, m.cfg.top_k_blocks)
            slots, lens = m.attention_tables(r.ws, r.cached, layers=slice(layer, layer + 1))
            n = slots.shape[-1]
            meta.slot_tables[layer, r.batch_index, :, :n] = slots[0].to(meta.slot_tables.device)
            meta.cache_lens[layer, r.batch_index] = lens[0].to(meta.cache_lens.device)

    def after_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        for row, buf in self.record_rows.items():
            buf[layer] = q[row]
        m, Q = self.manager, self.query_len
        for r in self.rows:
            m.update_summaries(r.ws, layer, k[r.batch_index * Q], r.cached)
        if self.prefetch and not self.drafter.retrieves_on_demand:
            # The lookahead query predicts step t+1's blocks; without a draft token, the current token's.
            draft = 1 if self.drafter.sends_draft_token else 0
            m.prefetch_layer([(r.ws, q[r.batch_index * Q + draft], r.cached + 1) for r in self.rows], layer)
        if self.prefetch:  # not a first pass: that one only finds the draft
            for observe in m.observers:
                observe(layer, q, self)

    def fork_point(self, layer: int, part: str) -> None:
        return None  # the in-line path runs its stages inside `after_attention`

"""The `AttentionHooks` of a dense step after which requests convert to sparse: each such
request's last query, in every layer, is copied into its buffer, for the conversion's first
prediction (`SparseManager.convert`). Nothing else changes: the step is a plain dense one."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.kernels.qkv_epilogue import SummaryFold
from oasiskv.layers.attention import AttentionMetadata


@dataclass
class QueryRecorder:
    rows: dict[int, torch.Tensor]  # token row of the step -> its request's buffer [L, Hq, D]

    def summary_fold(self, layer: int) -> SummaryFold | None:
        return None

    def before_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        return None

    def after_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> None:
        for row, buf in self.rows.items():
            buf[layer] = q[row]

    def fork_point(self, layer: int, part: str) -> None:
        return None

"""Megatron-style layers whose output needs the other ranks: one collective each.

Column-parallel layers (qkv, gate/up) need none: each rank computes its own heads and MLP
rows from the whole input. A row-parallel layer (o_proj, down) multiplies the rank's slice of
the input by the matching weight columns; the partial sums add up across ranks. A MoE layer is
both at once for every expert, behind a router every rank runs whole.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.distributed.group import ParallelGroup
from oasiskv.layers.moe import MoeMLP
from oasiskv.models.config import ModelConfig


class RowParallelLinear(nn.Linear):
    """y = x_r W_r^T summed over ranks r: one all-reduce."""

    def __init__(self, in_features: int, out_features: int, group: ParallelGroup):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


class ParallelMoeMLP(MoeMLP):
    """Each expert's intermediate rows split over the ranks (gate/up by rows, down by columns),
    the router replicated, so every rank routes a token alike: the weighted partial outputs add
    up across ranks, one all-reduce after the layer as after the dense MLP's down."""

    def __init__(self, cfg: ModelConfig, group: ParallelGroup):
        super().__init__(cfg)  # cfg: the rank's shapes (`sharding.local_config`)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the vocabulary; a token outside them contributes
    zeros, so the all-reduce adds exactly one rank's row to zeros (the result is exact)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, group: ParallelGroup):
        super().__init__(num_embeddings, embedding_dim)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.group.all_reduce(x.masked_fill(~mine[:, None], 0))


def parallel_logits(hidden: torch.Tensor, weight_shard: torch.Tensor, vocab_size: int,
                    group: ParallelGroup) -> torch.Tensor:
    """float32 logits over the whole vocabulary on every rank: each rank's vocabulary rows,
    all-gathered, the last rank's padding cut off."""
    return group.all_gather(F.linear(hidden, weight_shard).float())[..., :vocab_size]

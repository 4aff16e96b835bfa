"""The Llama-family decoder of one tensor-parallel rank (models/llama.py, sharded).

The decoder is built with the rank's shapes (`sharding.local_config`: its query and KV heads,
its MLP rows, its vocabulary rows), so attention, the KV cache and the sparse state see only
the rank's heads; o_proj, down (or a whole MoE layer) and the embedding are swapped for their
parallel layers, and the logits are gathered over the vocabulary.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch

from oasiskv.distributed.group import ParallelGroup
from oasiskv.distributed.layers import ParallelMoeMLP, RowParallelLinear, VocabParallelEmbedding, parallel_logits
from oasiskv.distributed.sharding import ShardPlan, local_config, shard_weights
from oasiskv.models.config import ModelConfig
from oasiskv.models.llama import LlamaForCausalLM


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, group: ParallelGroup):
        local = local_config(cfg, plan)
        super().__init__(replace(local, vocab_size=plan.vocab_shard))
        self.plan, self.group, self.vocab_size = plan, group, cfg.vocab_size
        h = cfg.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(plan.vocab_shard, h, plan.vocab.start, group)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.o_proj = RowParallelLinear(local.num_heads * local.head_dim, h, group)
            if cfg.is_moe_layer(i):
                layer.mlp = ParallelMoeMLP(local, group)
            else:
                layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, h, group)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return parallel_logits(hidden, weight, self.vocab_size, self.group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: the whole checkpoint; the rank keeps its slice of each tensor."""
        super().load_weights(shard_weights(weights, self.plan))

"""Which part of the model a tensor-parallel rank holds, and the checkpoint slices that fill it.

Megatron's split: q/k/v and gate/up are cut by output rows (whole heads, whole intermediate
rows), o_proj and down by input columns, the embedding and LM head by vocabulary rows. A MoE
layer's experts are each cut the same way (every rank holds a slice of every expert); its router
is replicated. Query
heads are split evenly; KV heads too while there are at least as many as ranks, and beyond
that each KV head is replicated on `size / num_kv_heads` ranks (as vLLM does), so a rank's
query heads always sit with their own KV head. Norms are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Iterator

import torch

from oasiskv.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    size: int
    head_dim: int
    q_heads: range  # global query heads this rank holds
    kv_heads: range  # global KV heads this rank holds
    intermediate: range  # MLP rows (gate/up) and columns (down)
    expert_intermediate: range  # the same of each MoE expert
    vocab: range  # vocabulary rows holding real tokens
    vocab_shard: int  # rows of the rank's embedding and LM head (the last rank's are padded)


def shard_plan(cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
    if Hq % size or cfg.intermediate_size % size or cfg.moe_intermediate_size % size:
        raise ValueError(f"--tensor-parallel-size {size} must divide the model's {Hq} query heads "
                         f"and its MLP width {cfg.intermediate_size} (experts' {cfg.moe_intermediate_size})")
    if (size <= Hkv and Hkv % size) or (size > Hkv and size % Hkv):
        raise ValueError(f"--tensor-parallel-size {size} must divide the model's {Hkv} KV heads, "
                         f"or be a multiple of them")
    q = Hq // size
    kv = range(rank * Hkv // size, (rank + 1) * Hkv // size) if size <= Hkv else \
        range(rank // (size // Hkv), rank // (size // Hkv) + 1)
    inter, expert = cfg.intermediate_size // size, cfg.moe_intermediate_size // size
    per = -(-cfg.vocab_size // size)
    return ShardPlan(rank, size, cfg.head_dim, range(rank * q, (rank + 1) * q), kv,
                     range(rank * inter, (rank + 1) * inter), range(rank * expert, (rank + 1) * expert),
                     range(min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size)), per)


def local_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The shapes one rank runs: its heads and MLP rows (the vocabulary stays whole: it is
    what requests and sampling see)."""
    return replace(cfg, num_heads=len(plan.q_heads), num_kv_heads=len(plan.kv_heads),
                   intermediate_size=len(plan.intermediate), moe_intermediate_size=len(plan.expert_intermediate))


def shard_tensor(name: str, w: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """The rank's slice of the checkpoint tensor `name` (HF name and [out, in] orientation)."""
    D = plan.head_dim
    q = slice(plan.q_heads.start * D, plan.q_heads.stop * D)
    kv = slice(plan.kv_heads.start * D, plan.kv_heads.stop * D)
    rows = plan.expert_intermediate if ".experts." in name else plan.intermediate
    inter = slice(rows.start, rows.stop)
    if ".q_proj." in name:
        return w[q]
    if ".k_proj." in name or ".v_proj." in name:
        return w[kv]
    if ".o_proj." in name:
        return w[:, q]
    if ".gate_proj." in name or ".up_proj." in name:
        return w[inter]
    if ".down_proj." in name:
        return w[:, inter]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = w[plan.vocab.start:plan.vocab.stop]
        pad = plan.vocab_shard - rows.shape[0]
        return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows
    return w


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], plan: ShardPlan
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a whole checkpoint cut to the rank's slice, one at a time (the slice is
    copied so the whole tensor can be freed)."""
    for name, w in weights:
        yield name, shard_tensor(name, w, plan).contiguous().clone()

"""Byte roofline of a decode step: the bytes it must move over the measured ceilings
(docs/benchmarks.md, "How to read the columns")."""
from __future__ import annotations

from oasiskv.models.config import ModelConfig

HBM_BYTES_PER_S = 4.25e12  # device-to-device copy rate of the benchmark GPU (an H200)
PCIE_BYTES_PER_S = 55.5e9  # pinned host -> GPU, one large copy


def weight_bytes_per_step(mc: ModelConfig, dtype_bytes: int) -> int:
    """Every weight is read once per decode step, except the input embedding table
    (only B rows are gathered); tied models read it fully as the output head."""
    params = mc.num_params()
    if not mc.tie_word_embeddings:
        params -= mc.vocab_size * mc.hidden_size
    return params * dtype_bytes


def kv_bytes_per_step(mc: ModelConfig, dtype_bytes: int, context_tokens: int) -> int:
    """K and V of every cached token of every sequence in the batch, all layers."""
    return context_tokens * mc.kv_bytes_per_token(dtype_bytes)

"""The bytes a decode step must read from GPU memory: the model's weights and the batch's K/V.
The engine counts them per step; `bench.roofline` divides them by the measured ceilings."""
from __future__ import annotations

from oasiskv.models.config import ModelConfig


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

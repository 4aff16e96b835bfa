"""The bytes a decode step must read from GPU memory: the model's weights and the batch's K/V.
The engine counts them per step; `bench.roofline` divides them by the measured ceilings."""
from __future__ import annotations

from oasiskv.models.config import ModelConfig


def weight_bytes_per_step(mc: ModelConfig, dtype_bytes: int, experts_touched: int | None = None) -> int:
    """Every weight is read once per decode step, except the input embedding table
    (only B rows are gathered; tied models read it fully as the output head) and, in a
    mixture-of-experts model, the experts no token routes to: `experts_touched` is the step's
    count summed over its MoE layers (None: every expert)."""
    params = mc.num_params()
    if not mc.tie_word_embeddings:
        params -= mc.vocab_size * mc.hidden_size
    if mc.num_experts and experts_touched is not None:
        moe_layers = sum(mc.is_moe_layer(layer) for layer in range(mc.num_layers))
        params -= (moe_layers * mc.num_experts - experts_touched) * 3 * mc.hidden_size * mc.moe_intermediate_size
    return params * dtype_bytes


def experts_touched_bound(mc: ModelConfig, batch: int) -> int | None:
    """At most min(E, B * k) experts a MoE layer, summed over the layers (None: a dense model)."""
    if not mc.num_experts:
        return None
    moe_layers = sum(mc.is_moe_layer(layer) for layer in range(mc.num_layers))
    return moe_layers * min(mc.num_experts, batch * mc.num_experts_per_tok)


def kv_bytes_per_step(mc: ModelConfig, dtype_bytes: int, context_tokens: int) -> int:
    """K and V of every cached token of every sequence in the batch, all layers."""
    return context_tokens * mc.kv_bytes_per_token(dtype_bytes)

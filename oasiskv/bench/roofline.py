"""Byte roofline of a decode step: the bytes it must move (`models.step_bytes`) over the measured
ceilings (docs/benchmarks.md, "How to read the columns"); FLOP roofline of a prefill."""
from __future__ import annotations

from oasiskv.models.config import ModelConfig

HBM_BYTES_PER_S = 4.25e12  # device-to-device copy rate of the benchmark GPU (an H200)
PCIE_BYTES_PER_S = 55.5e9  # pinned host -> GPU, one large copy
BF16_FLOPS_PER_S = 989e12  # the H200's dense bf16 tensor-core peak (NVIDIA's datasheet)


def prefill_flops(mc: ModelConfig, prompt_len: int) -> tuple[int, int]:
    """(linear, attention) FLOPs of one prompt's prefill, 2 per multiply-add. Linear: every
    projection of every token (in a MoE layer the router and the top-k experts it runs), and the
    output head for the last token only (the one sampled).
    Attention: causal, so the query at position p scores and sums p + 1 keys (QK^T and PV)."""
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    mlp = sum(3 * h * mc.num_experts_per_tok * mc.moe_intermediate_size + h * mc.num_experts
              if mc.is_moe_layer(layer) else 3 * h * i for layer in range(mc.num_layers))
    per_token = 2 * (mc.num_layers * (h * (q + 2 * kv) + q * h) + mlp)
    linear = prompt_len * per_token + 2 * h * mc.vocab_size
    attention = mc.num_layers * 4 * q * (prompt_len * (prompt_len + 1) // 2)
    return linear, attention

"""Rotary position embedding tables (HF rotate-half convention), with Llama-3 and YaRN scaling.

Applied by the qkv epilogue (`kernels/qkv_epilogue.py`). Scaling is static, as in vLLM: the
same frequencies at every context length."""
from __future__ import annotations

import math

import torch


def rope_parameters(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies (float64) and the factor applied to cos and sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, yarn)")


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): dimensions that turn more than beta_fast times over the original
    context keep their frequency, those that turn fewer than beta_slow times are divided by
    `factor`, a linear ramp between; cos and sin are scaled by 0.1 ln(factor) + 1."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        mag = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0  # noqa: E731
        attention_factor = mag(mscale) / mag(mscale_all_dim) if mscale and mscale_all_dim else mag(1)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq, attention_factor = rope_parameters(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        # [max_positions, head_dim] cos and sin, each half repeated (rotate-half layout).
        self.register_buffer("cos", torch.cat([cos, cos], -1).float(), persistent=False)
        self.register_buffer("sin", torch.cat([sin, sin], -1).float(), persistent=False)

"""Qwen3-MoE's MLP: a router sends each token to the top k of E SwiGLU experts.

Parameter names follow HF's (`mlp.gate` is the router, `mlp.experts`); each expert's gate and
up rows are stacked like the dense MLP's `gate_up_proj`, all experts in one tensor, so the fused
kernel (kernels/fused_moe.py) reads any expert by its index.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from oasiskv.kernels.fused_moe import fused_moe

if TYPE_CHECKING:
    from oasiskv.models.config import ModelConfig


class Experts(nn.Module):
    """E SwiGLU experts: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class MoeMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.touched: list[int] | None = None  # distinct experts of each call, while `experts_touched` counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.touched is not None:
            self.touched.append(logits.topk(self.top_k, dim=-1).indices.unique().numel())
        return fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, logits, self.top_k, self.renormalize)


def experts_touched(model: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """The distinct experts the MoE layers route to while `run()` calls the model eagerly (a host
    sync a layer: for benchmarks, never inside a captured step), summed over the layers."""
    layers = [m for m in model.modules() if isinstance(m, MoeMLP)]
    for m in layers:
        m.touched = []
    try:
        run()
        return sum(sum(m.touched) for m in layers)
    finally:
        for m in layers:
            m.touched = None

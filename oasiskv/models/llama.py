"""The Llama-family decoder: Llama 2/3, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), and
Qwen3-MoE (a router over experts, layers/moe.py, in place of the MLP where the config says).

Weights are loaded under Hugging Face names; q/k/v and gate/up are fused into one
matmul each (fewer launches, one read of the activations), and a MoE layer's experts are
stacked into one tensor per projection.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.layers.attention import AttentionMetadata, attend
from oasiskv.kernels.qkv_epilogue import qkv_epilogue
from oasiskv.layers.fused import add_rms_norm, rms_norm, silu_mul
from oasiskv.layers.moe import MoeMLP
from oasiskv.layers.rotary import RotaryEmbedding
from oasiskv.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata):
        # Norm, RoPE, the K/V store and the sparse pipeline's summary fold: one launch on CUDA.
        fold = meta.hooks.summary_fold(self.layer) if meta.hooks is not None else None
        norm = self.q_norm is not None
        q, k, v = qkv_epilogue(self.qkv_proj(x), self.num_heads, self.num_kv_heads, positions,
                               self.rotary.cos, self.rotary.sin, self.q_norm.weight if norm else None,
                               self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0,
                               kv_cache, meta.write_slots, meta.write_offsets, fold)
        o = attend(q, k, v, kv_cache, meta, self.scale, self.layer)
        o = self.o_proj(o.reshape(x.shape[0], self.q_size))
        if meta.hooks is not None:
            meta.hooks.fork_point(self.layer, "o_proj")
        return o


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, layer)
        self.mlp = MoeMLP(cfg) if cfg.is_moe_layer(layer) else LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, meta):
        """Pre-norm block with the residual add fused into each norm (vLLM's layout)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if meta.hooks is not None:
            meta.hooks.fork_point(self.self_attn.layer, "mlp")
        return x, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, rotary, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (fused parameter, shard index)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still ship it
            target, part = self._destination(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            dest = self._part(target, params[target], part)
            _check_shape(name, dest.shape, tensor.shape)
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add((target, part))
        expected = {(n, part) for n, p in params.items() for part in self._parts(n, p)}
        missing = sorted(f"{n}{list(part) if part else ''}" for n, part in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _destination(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The parameter a checkpoint tensor goes into and its part there: () the whole,
        (shard,) of a fused q/k/v or gate/up, (expert,) or (expert, shard) of stacked experts."""
        expert = _EXPERT.search(name)
        if expert:
            e, proj = int(expert[1]), expert[2]
            stem = name[:expert.start()] + ".experts."
            return (stem + "down_proj", (e,)) if proj == "down" else (stem + "gate_up_proj", (e, int(proj == "up")))
        for part, (fused, idx) in self._FUSED.items():
            if f".{part}." in name:
                return name.replace(part, fused), (idx,)
        return name, ()

    def _parts(self, name: str, param: torch.Tensor) -> list[tuple[int, ...]]:
        """Every part `_destination` can name in the parameter: what a whole checkpoint fills."""
        if ".experts." in name:
            shards = [(s,) for s in range(2)] if "gate_up_proj" in name else [()]
            return [(e, *s) for e in range(param.shape[0]) for s in shards]
        if "qkv_proj" in name:
            return [(s,) for s in range(3)]
        if "gate_up_proj" in name:
            return [(s,) for s in range(2)]
        return [()]

    def _part(self, target: str, param: torch.Tensor, part: tuple[int, ...]) -> torch.Tensor:
        if ".experts." in target:  # the expert's own [2I, H] or [H, I] first
            param, part = param[part[0]], part[1:]
        if not part:
            return param
        start, size = self._shard_range(target, part[0])
        return param[start:start + size]

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        cfg = self.config
        if "qkv_proj" in target:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        width = cfg.moe_intermediate_size if ".experts." in target else cfg.intermediate_size
        return shard * width, width


# A MoE layer's expert tensor in an HF checkpoint: `...mlp.experts.<e>.<gate|up|down>_proj.weight`.
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _check_shape(name, want, got):
    if tuple(want) != tuple(got):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")

"""The Llama-family decoder: Llama 2/3, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm).

Weights are loaded under Hugging Face names; q/k/v and gate/up are fused into one
matmul each (fewer launches, one read of the activations).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.layers.attention import AttentionMetadata, attend
from oasiskv.kernels.qkv_epilogue import qkv_epilogue
from oasiskv.layers.fused import add_rms_norm, rms_norm, silu_mul
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
        self.mlp = LlamaMLP(cfg)
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
            target, shard = name, None
            for part, (fused, idx) in self._FUSED.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), idx
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    _check_shape(name, param.shape, tensor.shape)
                    param.copy_(tensor)
                else:
                    start, size = self._shard_range(target, shard)
                    _check_shape(name, param[start:start + size].shape, tensor.shape)
                    param[start:start + size].copy_(tensor)
            loaded.add((target, shard))
        expected = {(n, None) for n in params if "qkv_proj" not in n and "gate_up_proj" not in n}
        expected |= {(n, s) for n in params if "qkv_proj" in n for s in range(3)}
        expected |= {(n, s) for n in params if "gate_up_proj" in n for s in range(2)}
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        cfg = self.config
        if "qkv_proj" in target:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return shard * cfg.intermediate_size, cfg.intermediate_size


def _check_shape(name, want, got):
    if tuple(want) != tuple(got):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")

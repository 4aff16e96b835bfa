"""Architecture description of a Llama-family decoder, and named presets.

One `ModelConfig` covers Llama 2/3, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and
Qwen3-MoE (Qwen3 with a router over experts in place of the MLP). Presets mirror the published
config.json of each model, so `--load-format dummy --model qwen3-8b` moves the same bytes as
the real thing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF "rope_scaling" (llama3 and yarn types supported)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    # Qwen3-MoE: a layer's MLP is `num_experts` SwiGLU experts of width moe_intermediate_size, each
    # token routed to num_experts_per_tok of them (0 experts: every layer is dense). A layer is
    # dense if listed in mlp_only_layers or if (layer + 1) is not a multiple of decoder_sparse_step.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "custom"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts}")

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        # KV bytes per token: N_layer * 2 * N_kv * d_h * s (keys and values, every layer)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self, active: bool = False) -> int:
        """Every parameter; with `active`, a MoE layer counts only the experts one token runs
        (top-k of them), as "A3B" in Qwen3-30B-A3B does."""
        h, v = self.hidden_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + 2 * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * self.head_dim
        experts = self.num_experts_per_tok if active else self.num_experts
        mlp = [experts * 3 * h * self.moe_intermediate_size + self.num_experts * h  # experts + router
               if self.is_moe_layer(i) else 3 * h * self.intermediate_size for i in range(self.num_layers)]
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * attention + sum(mlp) + embed + h

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "custom") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        is_qwen3 = model_type.startswith("qwen3") or any("Qwen3" in a for a in archs)
        is_qwen2 = model_type.startswith("qwen2") or any("Qwen2" in a for a in archs)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers >= 5 spelling
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # transformers 5 writes the latter
        if num_experts and model_type != "qwen3_moe":
            raise ValueError(f"mixture-of-experts model type {model_type!r} is not supported (only qwen3_moe)")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", is_qwen2 and not is_qwen3),
            qk_norm=is_qwen3,
            num_experts=num_experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 8) if num_experts else 0,  # HF's defaults
            moe_intermediate_size=cfg.get("moe_intermediate_size", 768) if num_experts else 0,
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        return cls.from_hf_dict(json.loads(path.read_text()), name=path.parent.name or "custom")


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2]),
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, bos_token_id=151643, eos_token_ids=[151645]),
    "qwen3-32b": ModelConfig(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, bos_token_id=151643, eos_token_ids=[151645]),
    # Qwen3-30B-A3B: 48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128 experts of width 768,
    # top-8 renormalised, every layer MoE (intermediate_size 6144 is unused); 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, bos_token_id=151643, eos_token_ids=[151645]),
    # Qwen3-235B-A22B: 94 layers, hidden 4096, 64 query / 4 KV heads of 128, 128 experts of width
    # 1536, top-8 renormalised, every layer MoE; 235B parameters, 22B active.
    "qwen3-235b-a22b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1536, norm_topk_prob=True, bos_token_id=151643, eos_token_ids=[151645]),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=[128001, 128008, 128009]),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, qkv_bias=True, bos_token_id=151643, eos_token_ids=[151645]),
    # The GGUFs of `oasiskv download` (models/downloads.py): their headers, checked by tests/models/test_downloads.py.
    "qwen2.5-coder-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, qkv_bias=True, bos_token_id=151643, eos_token_ids=[151645]),
    "qwen2.5-coder-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, qkv_bias=True, bos_token_id=151643, eos_token_ids=[151645]),
}


def with_rope_scaling(cfg: ModelConfig, scaling: dict) -> ModelConfig:
    """`--rope-scaling` over a model's own RoPE. YaRN stretches the context it was trained on
    (`original_max_position_embeddings`, default: the model's) by `factor`: Qwen2.5's 4 x 32,768."""
    scaling = dict(scaling)
    kind = scaling.pop("type", None) or scaling.get("rope_type")
    if kind not in ("yarn", "llama3"):
        raise ValueError(f"--rope-scaling: rope_type must be yarn or llama3, got {kind!r}")
    if not isinstance(scaling.get("factor"), (int, float)) or scaling["factor"] < 1:
        raise ValueError(f"--rope-scaling: factor must be a number >= 1, got {scaling.get('factor')!r}")
    scaling["rope_type"] = kind
    old_len = scaling.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    max_len = int(old_len * scaling["factor"]) if kind == "yarn" else cfg.max_position_embeddings
    return replace(cfg, rope_scaling=scaling, max_position_embeddings=max_len)


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], name=name, eos_token_ids=list(PRESETS[name].eos_token_ids))

"""A tiny random Qwen3-MoE saved by HF transformers' own `Qwen3MoeForCausalLM`: 4 layers, 8
experts, top-2 renormalised, layer 1 dense (`mlp_only_layers`), with a word-level tokenizer so
the directory loads as an HF checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
              max_position_embeddings=1024, rope_theta=1000000.0, rms_norm_eps=1e-6,
              initializer_range=0.1)  # wider than HF's 0.02: decisive routing, logits of order 1


def save_tiny_qwen3_moe(path: Path):
    """Writes the model and tokenizer to `path`; returns the HF model (float32, eval)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval()
    model.save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(path)
    return model

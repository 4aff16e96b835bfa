"""HF transformers `generate` on the same architecture and the same weights: the peer reference.

Built from our ModelConfig and fed by our own weight iterator, so dummy presets give HF
exactly the tensors our engine runs on.
"""
from __future__ import annotations

import time

import torch

from oasiskv.models.config import ModelConfig
from oasiskv.models.loader import ModelSource, iter_weights


def hf_config(mc: ModelConfig):
    import transformers

    common = dict(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
                  intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
                  num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
                  head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
                  max_position_embeddings=mc.max_position_embeddings,
                  tie_word_embeddings=mc.tie_word_embeddings)
    rope = {"rope_type": "default", "rope_theta": mc.rope_theta}
    if mc.rope_scaling:
        rope = {**mc.rope_scaling, "rope_theta": mc.rope_theta}
    if mc.qk_norm:
        cls = transformers.Qwen3Config
    elif mc.qkv_bias:
        cls = transformers.Qwen2Config
    else:
        cls = transformers.LlamaConfig
    cfg = cls(**common)
    if hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = rope
    else:
        cfg.rope_theta, cfg.rope_scaling = mc.rope_theta, mc.rope_scaling
    return cfg


def build_hf_model(source: ModelSource, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    cfg = hf_config(source.config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = dict(iter_weights(source, dtype, device=device))
    if source.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("rotary" not in m for m in missing):
        raise RuntimeError(f"HF peer weights do not line up: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(device).eval()


@torch.inference_mode()
def time_hf_generate(model, batch: int, input_len: int, output_len: int, vocab: int, seed: int = 0) -> dict:
    """Greedy generate of `output_len` tokens for `batch` random prompts; prefill timed apart."""
    dev = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, input_len), generator=g).to(dev)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    model.generate(ids[:, :16], max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    sync()
    t1 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
    sync()
    t2 = time.perf_counter()
    n_out = (out.shape[1] - input_len) * batch
    prefill = t1 - t0
    return {"batch": batch, "input_len": input_len, "output_len": output_len,
            "elapsed_time": t2 - t1, "output_tokens_per_second": n_out / (t2 - t1),
            "prefill_seconds": prefill,
            "mean_decode_step_ms": 1e3 * max(t2 - t1 - prefill, 0) / max(output_len - 1, 1)}

"""RoPE scaling against HF transformers: YaRN (Qwen2.5's 4 x 32,768) and Llama 3.1.

HF computes its angles in float32, so its cos/sin are exact to 1e-5 only where the angle
(position x frequency) is small; the tables are compared there, the frequencies everywhere."""
from __future__ import annotations

import json

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.bench.hf_peer import build_hf_model, hf_config
from oasiskv.layers.rotary import RotaryEmbedding, rope_parameters
from oasiskv.models.config import PRESETS, preset, with_rope_scaling

QWEN_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # as Qwen2.5 documents it


def _hf_rotary(mc):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return Qwen2RotaryEmbedding(hf_config(mc))


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "qwen2.5-7b"])
def test_yarn_matches_hf(name):
    mc = with_rope_scaling(preset(name), QWEN_YARN)
    assert mc.max_position_embeddings == 131072 and mc.rope_scaling["rope_type"] == "yarn"
    hf = _hf_rotary(mc)
    inv_freq, factor = rope_parameters(mc.head_dim, mc.rope_theta, mc.rope_scaling)
    assert factor == pytest.approx(hf.attention_scaling, rel=1e-12) and factor == pytest.approx(1.1386, abs=1e-4)
    torch.testing.assert_close(inv_freq.float(), hf.inv_freq, rtol=1e-6, atol=0)
    # YaRN leaves the fast dimensions alone and divides the slow ones by the factor.
    plain, _ = rope_parameters(mc.head_dim, mc.rope_theta, None)
    assert torch.equal(inv_freq[:4], plain[:4])
    torch.testing.assert_close(inv_freq[-4:], plain[-4:] / 4, rtol=1e-12, atol=0)

    ours = RotaryEmbedding(mc.head_dim, mc.max_position_embeddings, mc.rope_theta, mc.rope_scaling)
    pos = torch.cat([torch.arange(64), torch.arange(32700, 32840), torch.arange(131000, 131072)])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos[None])
    angle = pos[:, None].double() * torch.cat([inv_freq, inv_freq])
    exact = angle < 64  # float32 angles are good to 1e-5 there
    assert exact[-1, mc.head_dim // 2 - 1]  # the stretched dimensions are compared at 131K
    torch.testing.assert_close(ours.cos[pos][exact], cos[0][exact], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.sin[pos][exact], sin[0][exact], rtol=0, atol=1e-5)


def test_llama3_matches_hf():
    mc = PRESETS["llama-3.1-8b"]
    inv_freq, factor = rope_parameters(mc.head_dim, mc.rope_theta, mc.rope_scaling)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    hf = LlamaRotaryEmbedding(hf_config(mc))
    assert factor == hf.attention_scaling == 1.0
    torch.testing.assert_close(inv_freq.float(), hf.inv_freq, rtol=1e-6, atol=0)


def test_rope_scaling_flag_is_checked():
    with pytest.raises(ValueError, match="rope_type must be yarn or llama3"):
        with_rope_scaling(preset("qwen2.5-7b"), {"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="factor must be a number"):
        with_rope_scaling(preset("qwen2.5-7b"), {"type": "yarn"})
    # the original context defaults to the model's own
    assert with_rope_scaling(preset("qwen2.5-7b"), {"rope_type": "yarn", "factor": 2.0}).max_position_embeddings == 65536


def test_engine_with_yarn_matches_hf_logits(tmp_path):
    """A small random Qwen2 with YaRN (factor 4 over 256 positions): the engine's greedy tokens
    and logits equal HF's over a prompt that runs past the original context."""
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    llm = LLM(str(tmp_path), load_format="dummy", rope_scaling=yarn)
    source = llm.engine.runner.source
    assert source.config.max_position_embeddings == 1024
    hf = build_hf_model(source, torch.float32, torch.device("cpu"))
    assert hf.model.rotary_emb.attention_scaling != 1.0
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    model, seen = llm.engine.runner.model, []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(compute_logits(hidden)) or seen[-1]
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]
    assert out.token_ids == ref.argmax(-1).tolist()
    ours = torch.cat(seen)
    rel = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-5, f"relative logit error {rel:.2e}"

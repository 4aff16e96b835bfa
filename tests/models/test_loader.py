"""Model resolution, weight loading (GGUF, safetensors, dummy) and the tokenizer cache.

The reference for GGUF is transformers' own GGUF loader: its state dict must
equal ours tensor for tensor, which pins down the llama q/k un-permutation.
"""
from __future__ import annotations

import dataclasses
import json
import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from oasiskv.models import loader
from oasiskv.models.config import PRESETS, ModelConfig, preset
from oasiskv.models.loader import (ModelSource, default_model_path, gguf_config, hf_weight_shapes, iter_weights,
                                   resolve_model, unpermute_qk)
from oasiskv.models.tokenizer import gguf_tokenizer_cache_path, load_tokenizer

ARCH_FIELDS = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "name"]


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def hf_reference_state_dict(default_source, hf_default):
    assert hf_default[0].name_or_path == str(default_source.path.parent)
    return hf_default[0].state_dict()


# --- resolution ---------------------------------------------------------------------

def test_default_gguf_matches_smollm2_preset(default_source):
    """The default model starts from the preset, without parsing the file: it is the file's header."""
    assert default_source.kind == "gguf"
    assert default_source.path == default_model_path()
    header, expected = gguf_config(default_source.path), preset("smollm2-135m")
    for name in ARCH_FIELDS:
        assert getattr(header, name) == getattr(expected, name) == getattr(default_source.config, name), name


@pytest.mark.parametrize("model,load_format", [
    ("no-such-model", "auto"), ("no-such-model", "dummy"), ("qwen3-8b", "auto"), ("/nonexistent/dir", "auto")])
def test_unknown_model_names_the_model(model, load_format):
    with pytest.raises(ValueError, match=model) as err:
        resolve_model(model, load_format)
    assert "qwen3-8b" in str(err.value)  # lists the known presets


def test_dir_without_config_and_bad_load_format(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="load_format"):
        resolve_model("smollm2-135m", "pt")


# --- GGUF ---------------------------------------------------------------------------

@pytest.mark.slow
def test_gguf_weights_equal_transformers(default_source, hf_reference_state_dict):
    """Dequantized from the file and as read back from the weights cache every start uses."""
    ref = hf_reference_state_dict
    dequantized = dict(loader._iter_gguf(default_source.path, default_source.config, torch.float32, "cpu"))
    for ours in (dequantized, dict(iter_weights(default_source, torch.float32))):
        # transformers lists the tied lm_head too; we leave it out
        assert set(ours) == set(ref) - {"lm_head.weight"}
        assert set(ours) == set(hf_weight_shapes(default_source.config))
        for name, w in ours.items():
            assert w.dtype == torch.float32 and w.shape == ref[name].shape, name
            # (assert_close is ~70 ms per tensor here; a max over the difference is not)
            assert (w - ref[name]).abs().max().item() <= 1e-6, name


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape,n_head", [((9 * 64, 576), 9), ((3 * 64, 576), 3), ((4 * 32,), 4)])
def test_unpermute_inverts_llama_cpp(shape, n_head):
    w = torch.randn(shape)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
    assert not torch.equal(_llama_cpp_permute(w, n_head), w)


def _tiny_config(arch: str) -> ModelConfig:
    # rows of 256 so every quant type (K-quants: 256-element blocks) fits
    return ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32 if arch == "qwen3" else 64, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=1024, tie_word_embeddings=arch != "llama",
                       qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", bos_token_id=3, eos_token_ids=[4])


def _fake_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    # gguf-py cannot quantize K-quants; random blocks with sane f16 scales dequantize fine
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.array([0.01, 0.001], dtype=np.float16).view(np.uint8)  # d, dmin
    return blocks.reshape(rows, -1)


def _write_gguf(path, arch: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A tiny GGUF the way convert_hf_to_gguf writes one; returns the expected HF tensors."""
    rng = np.random.default_rng(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    expected = {}
    for i, (hf_name, shape) in enumerate(hf_weight_shapes(cfg).items()):
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        x = rng.standard_normal(shape, dtype=np.float32)
        if len(shape) == 1:
            data, qtype = x, Q.F32
        else:
            qtype = (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K)[i % 6]
            data = _fake_q4_k(*shape, rng) if qtype == Q.Q4_K else gguf.quants.quantize(x, qtype)
        x = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(shape).copy())
        if arch == "llama" and ("attn_q." in gguf_name or "attn_k." in gguf_name):
            n_head = cfg.num_heads if "attn_q." in gguf_name else cfg.num_kv_heads
            data = _llama_cpp_permute(torch.from_numpy(data), n_head).numpy()
        w.add_tensor(gguf_name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        expected[hf_name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip(tmp_path, arch):
    cfg = _tiny_config(arch)
    expected = _write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, cfg)
    source = resolve_model(str(tmp_path / f"tiny-{arch}.gguf"))
    assert source.kind == "gguf"
    for name in ARCH_FIELDS:
        assert getattr(source.config, name) == getattr(cfg, name), name
    ours = dict(iter_weights(source, torch.bfloat16))
    assert list(ours) == list(expected)
    for name, w in ours.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, expected[name].bfloat16()), name


# --- HF safetensors -----------------------------------------------------------------

@pytest.mark.parametrize("model_type,shard", [("llama", False), ("llama", True), ("qwen3", True)])
def test_hf_dir_round_trip(tmp_path, model_type, shard):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, tie_word_embeddings=model_type == "qwen3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard

    source = resolve_model(str(tmp_path))
    assert source.kind == "hf" and source.config.qk_norm == (model_type == "qwen3")
    ours = dict(iter_weights(source, torch.float32))
    ref = {k: v for k, v in model.state_dict().items() if not (hf_cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert set(ours) == set(ref) == set(hf_weight_shapes(source.config))
    for name, w in ours.items():
        assert torch.equal(w, ref[name]), name
    assert all(w.dtype == torch.float16 for _, w in iter_weights(source, torch.float16))


# --- dummy --------------------------------------------------------------------------

def test_dummy_qwen3_8b_shapes_on_meta():
    source = resolve_model("qwen3-8b", "dummy")
    assert source.kind == "dummy" and source.path is None
    shapes = {name: tuple(w.shape) for name, w in iter_weights(source, torch.bfloat16, device="meta")}
    assert shapes == hf_weight_shapes(PRESETS["qwen3-8b"])
    assert shapes["model.layers.35.self_attn.q_norm.weight"] == (128,)
    assert shapes["lm_head.weight"] == (151936, 4096)
    assert sum(int(np.prod(s)) for s in shapes.values()) == source.config.num_params()


def test_dummy_is_seeded_and_scaled(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 300, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source = resolve_model(str(tmp_path / "config.json"), "dummy")
    assert source.kind == "dummy" and source.config.qkv_bias
    a = dict(iter_weights(source, torch.bfloat16))
    b = dict(iter_weights(resolve_model(str(tmp_path), "dummy"), torch.bfloat16))
    assert a.keys() == b.keys() == hf_weight_shapes(source.config).keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(w.dtype == torch.bfloat16 for w in a.values())
    assert torch.all(a["model.norm.weight"] == 1.0)
    assert abs(a["model.embed_tokens.weight"].float().std().item() - 0.02) < 0.002


# --- tokenizer ----------------------------------------------------------------------

@pytest.mark.slow
def test_tokenizer_round_trip_and_cache(default_source, tmp_path, monkeypatch):
    monkeypatch.setenv("OASISKV_CACHE_DIR", str(tmp_path / "cache"))
    cached = gguf_tokenizer_cache_path(default_source.path)
    assert str(cached).startswith(str(tmp_path / "cache" / "tokenizers"))
    assert not cached.exists()
    first = load_tokenizer(default_source)
    assert (cached / "tokenizer.json").is_file()

    t0 = time.perf_counter()
    second = load_tokenizer(default_source)
    assert time.perf_counter() - t0 < 3.0  # conversion takes ~5 s; the cache ~0.2 s

    text = "Hello, world! Ünïcödé and 12345 <|im_end|>"
    ids = first(text)["input_ids"]
    assert ids == second(text)["input_ids"]
    assert ids[-1] == default_source.config.eos_token_ids[0]
    assert second.decode(ids) == text
    assert second.eos_token_id in default_source.config.eos_token_ids
    chat = [{"role": "user", "content": "hi"}]
    prompt = second.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "hi<|im_end|>" in prompt

    # an HF directory (config + tokenizer) loads its own tokenizer, also under dummy
    second.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4}))
    assert load_tokenizer(resolve_model(str(tmp_path / "hf"), "dummy"))(text)["input_ids"] == ids
    assert load_tokenizer(resolve_model("smollm2-135m", "dummy")) is None


def test_default_model_can_be_named_by_the_environment(monkeypatch, tmp_path):
    staged = tmp_path / "model.gguf"
    staged.write_bytes(b"GGUF")
    monkeypatch.setenv("OASISKV_DEFAULT_GGUF", str(staged))
    assert default_model_path() == staged
    monkeypatch.setenv("OASISKV_DEFAULT_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="OASISKV_DEFAULT_GGUF"):
        default_model_path()

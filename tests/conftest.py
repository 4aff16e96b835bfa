"""What the test folders share.

Tiers (markers in pyproject.toml): `pytest -q` runs everything, as CI does; `pytest -m "not
slow"` is the quick tier (minutes); `server`, `multiproc` and `real_model` name tests that start
servers, run ranks or peers in processes, or need a downloaded real model.

The HF transformers reference of the default model is loaded once for the session: every test
that compares the engine with HF (logits, logprobs, weights, lm-eval answers) reads it and
none may change it.
"""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def hf_default():
    """(HF model, HF tokenizer) of the embedded default model, float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oasiskv.models.loader import default_model_path

    path = default_model_path()
    kw = dict(gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32, **kw).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(os.path.dirname(path), **kw)

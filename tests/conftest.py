"""What the test folders share.

Tiers (markers in pyproject.toml): `pytest -q` runs everything, as CI does; `pytest -m "not
slow"` is the quick tier (minutes); `server`, `multiproc` and `real_model` name tests that start
servers, run ranks or peers in processes, or need a downloaded real model.

The suite runs on two pytest-xdist workers (pyproject's addopts: `-n 2 --dist loadfile`), a
module per worker at a time, the longest modules first so that both end together; each worker
computes on one torch thread (two workers, two cores), and so do the servers it starts.

The HF transformers reference of the default model is loaded once for the session: every test
that compares the engine with HF (logits, logprobs, weights, lm-eval answers) reads it and
none may change it.
"""
from __future__ import annotations

import os

import pytest
import torch

# The longest modules (`pytest --durations`), handed out first, longest first; the rest follow
# in file order.
LONGEST_FIRST = [
    "disagg/test_disagg_serve.py",
    "sparse/test_sparse_engine.py",
    "eval/test_passkey.py",
    "sparse/test_pipeline.py",
    "models/test_qwen_coder_sparse.py",
    "distributed/test_tensor_parallel.py",
    "disagg/test_disagg_pipeline.py",
    "sparse/test_short_prompts_sparse.py",
    "engine/test_engine_vs_hf.py",
    "sparse/test_conversion_policy.py",
    "bench/test_bench_decode.py",
    "models/test_qwen_coder_vs_hf.py",
    "sparse/test_streamed_prefill.py",
    "server/test_server.py",
]

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the servers and ranks a test starts


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith("tests/" + name)), len(LONGEST_FIRST))
    items.sort(key=rank)  # stable: each module's tests keep their order


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

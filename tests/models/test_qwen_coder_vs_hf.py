"""Qwen2.5-Coder-0.5B (`oasiskv download qwen2.5-coder-0.5b`) against HF transformers loading
the same GGUF itself: equal weights, and `oasiskv generate --temperature 0` gives HF's greedy
tokens. 14 query heads share each of 2 KV heads here, a wider group than SmolLM2's 3.
Skipped when the model is not downloaded; HF's own GGUF load takes about a minute."""
from __future__ import annotations

import json

import pytest
import torch

from oasiskv.entrypoints.cli import main
from oasiskv.models.downloads import DOWNLOADS
from oasiskv.models.loader import iter_weights, resolve_model

MODEL = "qwen2.5-coder-0.5b"
pytestmark = [pytest.mark.slow, pytest.mark.real_model,
              pytest.mark.skipif(not DOWNLOADS[MODEL].path.is_file(),
                                reason=f"{MODEL} is not downloaded (oasiskv download {MODEL})")]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = DOWNLOADS[MODEL].path
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_weights_equal_hf_gguf_loader(hf_model):
    ref = hf_model.state_dict()
    ours = dict(iter_weights(resolve_model(MODEL), torch.float32))
    assert set(ours) == set(ref)
    for name, w in ours.items():
        assert torch.equal(w, ref[name]), name


@pytest.mark.parametrize("chat", [False, True])
def test_generate_cli_greedy_equals_hf(hf_model, capsys, chat):
    prompt = "Write a Python function that returns the n-th prime number." if chat else "def quicksort(xs):"
    argv = ["generate", "--model", MODEL, "--prompt", prompt, "--temperature", "0", "--max-tokens", "24",
            "--ignore-eos", "--json"] + (["--chat"] if chat else [])
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ids = out["prompt_token_ids"]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                pad_token_id=151643)
    assert out["token_ids"] == ref[0, len(ids):].tolist()

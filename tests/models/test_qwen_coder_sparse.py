"""Sparse decode on Qwen2.5-Coder-0.5B (14 query heads per 2 KV heads) at ~2K tokens: the fast
form of docs/accuracy.md's runs. Passkey: sparse at K = 32 (a third of the context) finds the
key in real source code and the asked one among four named keys (on the filler alone, the
default model's passkey tests).
Skipped when the model is not downloaded."""
from __future__ import annotations

import pytest

from oasiskv import LLM
from oasiskv.eval.passkey import make_case, score
from oasiskv.eval.texts import module_source
from oasiskv.models.downloads import DOWNLOADS

MODEL = "qwen2.5-coder-0.5b"
pytestmark = [pytest.mark.slow, pytest.mark.real_model,
              pytest.mark.skipif(not DOWNLOADS[MODEL].path.is_file(),
                                reason=f"{MODEL} is not downloaded (oasiskv download {MODEL})")]
SPARSE = dict(sparse=True, top_k_blocks=32, window_blocks=4, sink_blocks=1, sparse_threshold=1024,
              drafter="self", host_kv_gb=1.0)


@pytest.fixture(scope="module")
def right():
    """{case set: sparse right}, the sparse engine built once. Dense decode finds every key
    of these cases; sparse must find them too."""
    from oasiskv.eval.passkey import make_cases

    sparse = LLM(MODEL, max_model_len=2100, kv_cache_gb=0.5, **SPARSE)
    tok = sparse.tokenizer
    code = tok.encode(module_source("argparse"), add_special_tokens=False)
    sets = {"code": [make_case(tok, 2000, 0.6, 1, "argparse", code)],
            "four keys": make_cases(tok, 2000, depths=[0.8], seeds=[0], keys=4)}
    cases = [c for group in sets.values() for c in group]
    sparse_right = score(sparse, cases, exact=True)
    out, at = {}, 0
    for name, group in sets.items():
        out[name] = sparse_right[at:at + len(group)]
        at += len(group)
    return out


def test_passkey_2k_sparse_finds_the_key_in_code(right):
    assert right["code"] == [True]


def test_multikey_2k_sparse_finds_the_asked_key(right):
    """Four named keys on the suite's filler: sparse at K = 32 answers the asked key."""
    assert all(right["four keys"])

"""Sparse decode on Qwen2.5-Coder-0.5B (14 query heads per 2 KV heads) at ~2K tokens: the fast
form of docs/accuracy.md's runs. Passkey: sparse at K = 32 (a third of the context) finds the
keys dense finds, on the suite's filler, in real source code and among four named keys.
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
    """{case set: (dense right, sparse right)}: each engine built once, every case scored by both."""
    from oasiskv.eval.passkey import make_cases

    dense = LLM(MODEL, max_model_len=2100, kv_cache_gb=0.5)
    tok = dense.tokenizer
    code = tok.encode(module_source("argparse"), add_special_tokens=False)
    sets = {"filler and code": [make_case(tok, 2000, 0.3, 0), make_case(tok, 2000, 0.6, 1, "argparse", code)],
            "four keys": make_cases(tok, 2000, depths=[0.8], seeds=[0], keys=4)}
    cases = [c for group in sets.values() for c in group]
    dense_right = score(dense, cases, exact=True)
    del dense
    sparse_right = score(LLM(MODEL, max_model_len=2100, kv_cache_gb=0.5, **SPARSE), cases, exact=True)
    out, at = {}, 0
    for name, group in sets.items():
        out[name] = dense_right[at:at + len(group)], sparse_right[at:at + len(group)]
        at += len(group)
    return out


def test_passkey_2k_sparse_equals_dense(right):
    dense_right, sparse_right = right["filler and code"]
    assert all(dense_right)  # the model can do it
    assert sparse_right == dense_right


def test_multikey_2k_sparse_equals_dense(right):
    """Four named keys on the suite's filler: sparse at K = 32 answers the asked key where dense does."""
    dense_right, sparse_right = right["four keys"]
    assert all(dense_right)  # the model can tell the keys apart
    assert sparse_right == dense_right

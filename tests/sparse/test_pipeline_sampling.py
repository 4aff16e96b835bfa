"""Penalties, bias, min_tokens and logprobs through the batched lookahead pipeline: the same
tokens and logprobs as the in-line reference (tests/inline_reference.py; the draft row gets the
same rules, so the draft acceptance is the reference's too)."""
import argparse

import pytest

from inline_reference import inline_llm

from oasiskv import LLM, SamplingParams

pytestmark = pytest.mark.slow

BUDGET = dict(max_model_len=768, sparse=True, top_k_blocks=8, window_blocks=2, sink_blocks=1,
              sparse_threshold=256, fetch_ratio=0.25, host_kv_gb=0.25)


def test_pipeline_samples_with_the_rules_as_inline():
    ids = None
    runs = {}
    for path in ("off", "on"):
        llm = (LLM if path == "on" else inline_llm)(**BUDGET)  # off: the in-line reference
        ids = ids or llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)
        params = [SamplingParams(temperature=0.8, seed=1, max_tokens=10, min_tokens=10, frequency_penalty=1.5,
                                 logprobs=2),
                  SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.4, logit_bias={13: 4.0},
                                 presence_penalty=0.5, logprobs=0)]
        runs[path] = llm.generate([ids[:300], ids[3000:3290]], params)
        assert (llm.engine.runner.pipeline is not None) == (path == "on")
    for ref, got in zip(runs["off"], runs["on"]):
        assert got.token_ids == ref.token_ids and got.stats["sparse_steps"] > 0
        assert got.stats["draft_acceptance"] == ref.stats["draft_acceptance"]
        for a, b in zip(got.logprobs, ref.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)

"""The batched lookahead pipeline (issue 4: GPU-resident state, stages as tensor work, rows of
many requests) against the in-line per-request path, through the whole engine on the real
default model: with a small budget (eviction and the cap at work), two requests batched, one
finishing before the other (its row is released and the other moves into it), both paths
decode the same tokens and count the same hits, admissions, evictions and bytes."""
import argparse

import pytest

from oasiskv import LLM, SamplingParams

BUDGET = dict(max_model_len=768, sparse=True, top_k_blocks=8, window_blocks=2, sink_blocks=1,
              sparse_threshold=256, fetch_ratio=0.25, host_kv_gb=0.25)


@pytest.mark.parametrize("drafter", ["self", "prev"])
def test_pipeline_matches_inline_path(drafter):
    text = open(argparse.__file__).read()
    runs = {}
    for path in ("off", "on"):
        llm = LLM(sparse_pipeline=path, drafter=drafter, **BUDGET)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        prompts = [ids[:400], ids[3000:3330]]
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)]
        runs[path] = llm.generate(prompts, params)
        if path == "on":
            assert llm.engine.runner.pipeline is not None and llm.engine.runner.pipeline.num_rows == 0
    for ref, got in zip(runs["off"], runs["on"]):
        assert got.token_ids == ref.token_ids
        keys = ["sparse_steps", "predicted", "hits", "admitted", "evicted", "bytes_to_device", "draft_acceptance"]
        assert {k: got.stats[k] for k in keys} == {k: ref.stats[k] for k in keys}
    assert runs["on"][1].stats["admitted"] > 0 and runs["on"][1].stats["evicted"] > 0

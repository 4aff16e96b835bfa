"""Async scheduling (decode step t+1 launched before step t's tokens are read) gives the same
outputs as the synchronous loop on the real default model: greedy and seeded sampling, stop
strings, stop tokens, max_tokens, and a request aborted while a step is in flight."""
import pytest
from oasiskv import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4,", "The three primary colors are", "import numpy as np\n"]


def _params(llm):
    stop_tok = llm.tokenizer.encode(",", add_special_tokens=False)[0]
    return [SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
            SamplingParams(temperature=0, max_tokens=24, stop=[" and"]),
            SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True)]


def test_async_matches_sync():
    runs = {}
    for mode in ("off", "on"):
        llm = LLM(async_scheduling=mode, max_model_len=256)
        runs[mode] = llm.generate(PROMPTS, _params(llm))
        if mode == "on":
            assert llm.engine.step_stats["overlapped_steps"] > 0
            bm = llm.engine.block_manager
            assert bm.num_free == bm.num_pages
    for a, b in zip(runs["off"], runs["on"]):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_abort_while_a_step_is_in_flight():
    outs = {}
    for mode in ("off", "on"):
        llm = LLM(async_scheduling=mode, max_model_len=256)
        eng = llm.engine
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        rids = [eng.add_request(p, params) for p in PROMPTS[:3]]
        got = {}
        for i in range(40):
            if i == 4:
                eng.abort(rids[1])
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.token_ids
            if not eng.has_unfinished():
                break
        assert rids[1] not in got and eng.block_manager.num_free == eng.block_manager.num_pages
        outs[mode] = [got[rids[0]], got[rids[2]]]
    assert outs["on"] == outs["off"]

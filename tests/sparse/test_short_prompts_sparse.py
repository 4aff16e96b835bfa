"""Requests that go sparse before their first block is full (a prefill instance hands every
prompt over sparse, whatever its length): the partial block is a sink, and each new token must
go to that sink until the block fills. Greedy tokens equal dense for every prompt length from 1
to 18 and around the next block boundaries (through the proxy: tests/disagg/test_disagg_serve.py),
with a full budget, through the pipeline."""
import argparse

import pytest

from oasiskv import LLM, SamplingParams

pytestmark = pytest.mark.slow

LENGTHS = list(range(1, 19)) + [31, 32, 33, 47, 48, 49, 63, 64, 65]  # every length to past one block, then boundaries
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # a 1-token prompt fills its block, then 5 more


@pytest.fixture(scope="module")
def prompts():
    dense = LLM(max_model_len=512)
    ids = dense.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)
    prompts = [ids[100:100 + n] for n in LENGTHS]
    return prompts, [o.token_ids for o in dense.generate(prompts, GREEDY)]


@pytest.mark.parametrize("sinks", [1, 2])
def test_short_prompts_decode_as_dense(prompts, sinks):
    prompts, want = prompts
    llm = LLM(max_model_len=512, sparse=True, top_k_blocks=8, window_blocks=2, sink_blocks=sinks,
              host_kv_gb=0.2, max_num_seqs=16)
    engine = llm.engine
    seqs = []
    for ids in prompts:  # converted when their prefill ends, as a prefill instance hands them over
        seqs.append(engine.seqs[engine.add_request(ids, GREEDY)])
        seqs[-1].hand_over = True
    while engine.has_unfinished():
        engine.step()
    assert all(s.sparse is not None for s in seqs), "every request decoded sparse"
    bad = [n for n, s, w in zip(LENGTHS, seqs, want) if s.output_token_ids != w]
    assert not bad, f"prompt lengths whose tokens differ from dense: {bad}"

"""Prefill beyond HBM (oasiskv/sparse/streamed_prefill.py): a prompt about 4x the GPU pool is
prefilled through the host pool, chunk by chunk, and decodes what the same sparse engine
decodes when its pool holds the prompt (float32, greedy), with the same K/V in the host pool;
the request never holds more than its staging run, and nothing leaks."""
import argparse

import pytest
import torch

from oasiskv import LLM, SamplingParams

PAGE_GB = 30 * 3 * 2 * 16 * 64 * 4 / 2**30  # SmolLM2-135M, float32: one page of 16 tokens
SPARSE = dict(max_model_len=2048, sparse=True, top_k_blocks=8, window_blocks=4, sink_blocks=1,
              sparse_threshold=1024, host_kv_gb=0.25, max_num_batched_tokens=256, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt_ids(llm, n):
    return llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:n]


def run(llm, ids):
    engine = llm.engine
    rid = engine.add_request(ids, GREEDY)
    seq, kv, held = engine.seqs[rid], None, []
    while engine.has_unfinished():
        if seq.sparse is not None and kv is None:
            kv = engine.runner.sparse.host.extent_items(seq.host_extent)[:, :len(ids) // 16].clone()
        engine.step()
        held.append(engine.block_manager.num_pages - engine.block_manager.num_free)
    return seq, kv, held


@pytest.mark.slow
def test_a_prompt_4x_the_pool_decodes_as_in_hbm():
    in_hbm = LLM(kv_cache_gb=200 * PAGE_GB, **SPARSE)
    ids = prompt_ids(in_hbm, 1500)  # 94 blocks
    want, want_kv, _ = run(in_hbm, ids)
    assert not want.streamed and want.sparse is not None
    streamed = LLM(kv_cache_gb=23.5 * PAGE_GB, **SPARSE)
    engine = streamed.engine
    assert engine.block_manager.num_pages * 4 <= len(ids) // 16 + 1
    got, got_kv, held = run(streamed, ids)
    assert got.streamed and got.sparse is not None
    assert got.output_token_ids == want.output_token_ids
    assert torch.equal(got_kv, want_kv)  # the prompt's K/V, every layer and head
    run_pages = engine.runner.sparse.streamed_pages(got, engine.max_model_len)
    assert max(held) <= run_pages < engine.block_manager.num_pages  # never more than its staging run
    bm, host = engine.block_manager, engine.runner.sparse.host
    assert bm.num_free == bm.num_pages and all(c == 0 for c in bm.ref_counts)
    assert host.bytes_used == 0


@pytest.mark.slow
def test_streamed_prompt_refused_when_the_host_pool_cannot_hold_it():
    llm = LLM(kv_cache_gb=24 * PAGE_GB, **dict(SPARSE, host_kv_gb=0.02))
    ids = prompt_ids(llm, 1500)
    with pytest.raises(ValueError, match="exceeds the host KV pool"):
        llm.engine.add_request(ids, GREEDY)
    bm, host = llm.engine.block_manager, llm.engine.runner.sparse.host
    assert bm.num_free == bm.num_pages and host.bytes_used == 0 and not llm.engine.has_unfinished()


@pytest.mark.slow
def test_dense_refuses_a_prompt_longer_than_the_pool():
    llm = LLM(kv_cache_gb=24 * PAGE_GB, max_model_len=2048)
    with pytest.raises(ValueError, match="KV pages but the cache holds only"):
        llm.engine.add_request(prompt_ids(llm, 1500), GREEDY)

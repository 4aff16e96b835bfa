"""Prefix caching on the real default model (CPU, float32): greedy tokens with the cache on equal
those with it off, for a shared prefix, one ending mid-block, a whole cached prompt, a hit after
eviction and refill, concurrent requests sharing pages, preemption of a request whose pages are
shared, async scheduling, and requests that convert to sparse from shared pages.

One small engine per module (block size 8, a pool of a few pages, chunked prefill); "off" is the
same engine with the cache switched off and emptied, so both runs share weights and pool."""
from __future__ import annotations

import pytest

from oasiskv import LLM, SamplingParams

BS = 8
PAGE_GB = 30 * 3 * 64 * 2 * 4 * BS / 2**30  # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * j) % 3000 + 100 for j in range(n)]


DOC = tokens(1, 45)  # 5 full blocks and 5 tokens


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, block_size=BS, kv_cache_gb=12 * PAGE_GB, max_num_batched_tokens=32,
               max_num_seqs=4)


def generate(llm, prompts, params=GREEDY, caching=True):
    """One generate call with the cache on or off (emptied first); the pool is whole after it."""
    bm = llm.engine.block_manager
    bm.enable_caching = caching
    bm.reset_prefix_cache()
    outs = llm.generate(prompts, params)
    assert all(c == 0 for c in bm.ref_counts) and bm.num_free == bm.num_pages
    return outs


def both(llm, runs, params=GREEDY):
    """runs: lists of prompts generated one after another, cache off, then on. Their tokens must be
    equal; -> the cache-on outputs."""
    got = {}
    for caching in (False, True):
        bm = llm.engine.block_manager
        bm.enable_caching = caching
        bm.reset_prefix_cache()
        got[caching] = [o for prompts in runs for o in llm.generate(prompts, params)]
        assert all(c == 0 for c in bm.ref_counts) and bm.num_free == bm.num_pages
    assert [o.token_ids for o in got[True]] == [o.token_ids for o in got[False]]
    assert all(o.num_cached_tokens == 0 for o in got[False])
    return got[True]


@pytest.mark.slow
def test_shared_prefix_ending_mid_block(llm):
    first = DOC + tokens(2, 3)
    others = [DOC + tokens(3 + i, 3) for i in range(3)]
    outs = both(llm, [[first], others])
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40, 40]  # the 5 full blocks of DOC


@pytest.mark.slow
def test_whole_prompt_cached_recomputes_its_last_block(llm):
    prompt = tokens(9, 48)  # exactly 6 blocks
    bm = llm.engine.block_manager
    hits, queries = bm.hits, bm.queries
    outs = both(llm, [[prompt], [prompt], [prompt + tokens(10, 1)]])
    assert [o.num_cached_tokens for o in outs] == [0, 40, 48]
    assert (bm.hits - hits, bm.queries - queries) == (88, 48 + 48 + 49)  # counted with the cache on only


@pytest.mark.slow
def test_concurrent_requests_share_pages(llm):
    bm = llm.engine.block_manager
    generate(llm, [DOC + tokens(2, 3)])  # the cache now holds DOC's 5 full blocks
    eng = llm.engine
    rids = [eng.add_request(DOC + tokens(20 + i, 3), GREEDY) for i in range(3)]
    eng.step()  # one prefill step admits all three, each computing its last 8 tokens
    seqs = [eng.seqs[r] for r in rids]
    shared = seqs[0].pages[:5]
    assert all(s.pages[:5] == shared for s in seqs) and all(bm.ref_counts[p] == 3 for p in shared)
    assert len({s.pages[5] for s in seqs}) == 3  # each writes its own tail page
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o.token_ids) for o in eng.step() if o.finished)
    bm.enable_caching = False
    bm.reset_prefix_cache()
    alone = llm.generate([s.prompt_token_ids for s in seqs], GREEDY)
    assert [done[r] for r in rids] == [o.token_ids for o in alone]


@pytest.mark.slow
def test_hit_after_eviction_and_refill(llm):
    prompt = DOC + tokens(30, 3)
    fill = [tokens(40 + i, 40) for i in range(2)]  # with their outputs, 2 x 6 pages: every page
    outs = both(llm, [[prompt], fill, [prompt], [prompt]])
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0, 40]  # evicted, recomputed, then hit


@pytest.mark.slow
def test_preemption_of_a_request_whose_pages_are_shared(llm):
    """Three requests share DOC's blocks; the newest is preempted (as the scheduler does when the
    pool runs short) after two decode steps: the shared pages stay with the other two, and when it
    is readmitted it finds DOC and its own full blocks cached. The pool-pressure preemption itself
    is in tests/engine/test_prefix_cache_pool.py."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [DOC + tokens(80 + i, 3) for i in range(3)]
    got = {}
    for caching in (False, True):
        eng, bm = llm.engine, llm.engine.block_manager
        bm.enable_caching = caching
        bm.reset_prefix_cache()
        generate(llm, [DOC + tokens(79, 3)], caching=caching)  # the cache holds DOC
        rids = [eng.add_request(p, params) for p in prompts]
        victim, done = eng.seqs[rids[2]], {}

        def step():
            done.update((o.request_id, o) for o in eng.step() if o.finished)

        while len(victim.output_token_ids) < 3:  # its prefill, then two decode steps
            step()
        shared = victim.pages[:5]
        eng.scheduler.preempt(victim)
        if caching:
            assert all(bm.ref_counts[p] == 2 and bm.page_name[p] is not None for p in shared)
        while eng.has_unfinished():
            step()
        got[caching] = [done[r] for r in rids]
        assert got[caching][2].metrics["num_preemptions"] == 1
        assert all(c == 0 for c in bm.ref_counts) and bm.num_free == bm.num_pages
    assert [o.token_ids for o in got[True]] == [o.token_ids for o in got[False]]
    assert [o.num_cached_tokens for o in got[True]] == [40, 40, 40]


@pytest.mark.slow
def test_async_scheduling_with_the_cache(llm):
    eng = llm.engine
    eng.async_scheduling = True
    try:
        outs = both(llm, [[DOC + tokens(60, 3)], [DOC + tokens(61 + i, 3) for i in range(2)]],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        eng.async_scheduling = False
    assert eng.step_stats["overlapped_steps"] > 0 and [o.num_cached_tokens for o in outs] == [0, 40, 40]


@pytest.mark.slow
def test_sparse_conversion_from_shared_pages():
    """Requests that convert to sparse right after a prefill that started past a shared prefix:
    each converted one gives back only its own references; the shared pages stay for the others
    and the cache. Same tokens as with the cache off."""
    llm = LLM(max_model_len=128, block_size=BS, kv_cache_gb=20 * PAGE_GB, max_num_seqs=4, sparse=True,
              top_k_blocks=2, sink_blocks=1, window_blocks=2, sparse_threshold=48, host_kv_gb=0.02)
    doc = tokens(70, 32)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = both(llm, [[doc + tokens(71, 16)], [doc + tokens(72 + i, 16) for i in range(2)]], params)
    assert llm.engine.runner.sparse.num_conversions == 6
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    assert all(o.stats for o in outs)  # every one decoded sparse

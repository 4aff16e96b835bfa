"""One GPU budget for all KV state: the page pool and the sparse pipeline's rows stay inside
--kv-cache-gb, summaries take pages of the pool while a sparse request holds them and give them
back when it ends."""
import argparse

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.memory_plan import pages_by_kind
from oasiskv.sparse.summary_arena import SummaryArena, blocks_per_page


def test_summary_arena_views_the_page_pool():
    """Block g's min and max sit in page g // blocks_per_page, in every layer's own bytes."""
    L, H, bs, D, pages = 3, 2, 16, 8, 5
    kv = torch.zeros(L, pages * H, 2, bs, D, dtype=torch.bfloat16)
    arena = SummaryArena(kv, H, torch.float8_e4m3fn)
    assert arena.blocks_per_page == blocks_per_page(bs, torch.bfloat16, torch.float8_e4m3fn) == 32
    assert arena.kmin.shape == (L, pages * 32, H, D) and arena.kmin.stride()[1:] == (2 * H * D, D, 1)
    arena.kmax[1, 70, 1] = 1.0  # block 70: page 2, sixth block of it
    touched = kv.view(L, pages, -1).ne(0).any(-1).nonzero().tolist()
    assert touched == [[1, 2]]
    kv32 = torch.zeros(L, pages * H, 2, bs, D)
    assert SummaryArena(kv32, H, torch.float32).blocks_per_page == bs


def test_take_run_finds_the_highest_run_and_may_use_own_pages():
    bm = BlockManager(12, 16)
    held = bm.take(12)
    bm.release([held[i] for i in (1, 2, 3, 6, 7, 9)])  # free: 1 2 3 6 7 9
    assert bm.take_run(3) == [1, 2, 3]
    assert bm.take_run(3) is None  # 6 7 9: no three in a row
    assert bm.take_run(3, own=[8]) == [7, 8, 9]
    assert bm.ref_counts[8] == 1 and 7 not in bm.free_pages and 9 not in bm.free_pages
    bm.give_back([7, 9])
    assert bm.num_free == 3


def _long_ids(llm, n):
    return llm.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:n]


@pytest.mark.slow
def test_sparse_kv_state_stays_in_the_budget_and_summaries_shrink():
    gb = 0.2
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=16, sparse_threshold=1024, host_kv_gb=0.5,
              kv_cache_gb=gb, max_num_seqs=4)
    engine = llm.engine
    plan = engine.runner.memory_plan
    assert plan.kv_budget <= gb * 2**30 < plan.kv_budget + plan.page_bytes
    assert plan.pipeline_rows > 0
    bm, sparse = engine.block_manager, engine.runner.sparse
    ids = _long_ids(llm, 1500)
    seen = []
    for i in range(2):
        engine.add_request(ids[i * 10:], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        seen.append(pages_by_kind(engine.scheduler, bm, sparse.cfg.working_set_blocks))
    held = [s for s in seen if s["kv_summaries"]]
    assert held, "no request held summaries"
    per_request = sparse.arena.pages_for(-(-(1500 - 10 + 24) // 16))
    assert max(s["kv_summaries"] for s in held) == 2 * per_request
    assert seen[-1] == {"kv_dense": 0, "kv_working_sets": 0, "kv_summaries": 0, "kv_free": bm.num_pages}
    assert sum(engine.gpu_bytes_by_kind()[k] for k in ("kv_dense", "kv_working_sets", "kv_summaries",
                                                        "kv_free")) == plan.kv_pool


@pytest.mark.slow
def test_sparse_pool_is_the_dense_pool_less_the_pipeline_rows():
    """At equal budget the dense pool is all pages, the sparse one the pages left beside the
    pipeline's rows."""
    gb = 0.2
    dense = LLM(max_model_len=4200, kv_cache_gb=gb)
    sparse = LLM(max_model_len=4200, sparse=True, sparse_threshold=1024, host_kv_gb=0.5, kv_cache_gb=gb)
    plan = sparse.engine.runner.memory_plan
    assert dense.engine.block_manager.num_pages == int(gb * 2**30 // plan.page_bytes)
    assert sparse.engine.block_manager.num_pages == int((gb * 2**30 - plan.pipeline_rows) // plan.page_bytes)

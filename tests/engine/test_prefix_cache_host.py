"""The prefix cache's host tier on the real default model (CPU, float32): a finished sparse
request's blocks stay in the host pool, and a later request whose prefix they hold loads them
into its pages instead of prefilling them, reuses their summaries when it converts, and decodes
sparse with the tokens of the same request prefilled from scratch; at full budget (K covering
every block) with all of the prefix or its tail in the host tier, for a dense request, and on a
passkey at K = 32 (where the reused summaries choose the working set); eviction and reset free
the pool."""
from __future__ import annotations

import pytest

from oasiskv import LLM, SamplingParams

pytestmark = pytest.mark.slow

BS = 8
PAGE_GB = 30 * 3 * 64 * 2 * 4 * BS / 2**30  # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * j) % 3000 + 100 for j in range(n)]


DOC = tokens(1, 64)  # 8 full blocks


def sparse_llm(top_k: int) -> LLM:
    """Converts from 48 tokens; max_model_len 128 = 16 blocks, so K = 16 covers every block."""
    return LLM(max_model_len=128, block_size=BS, kv_cache_gb=48 * PAGE_GB, max_num_seqs=4, sparse=True,
               top_k_blocks=top_k, sink_blocks=1, window_blocks=2, sparse_threshold=48, host_kv_gb=0.02)


@pytest.fixture(scope="module")
def full_budget():
    return sparse_llm(16)


def forget_gpu_tier(llm, keep_blocks: list[int] = ()) -> None:
    """Drop the GPU tier's names but those of DOC's blocks `keep_blocks`, as an eviction of
    those pages would; the host tier keeps its entries."""
    from oasiskv.engine.block_hash import extend_block_names
    from oasiskv.engine.sequence import Sequence

    bm = llm.engine.block_manager
    names = extend_block_names(Sequence("", DOC, GREEDY), bm.salt, BS, len(DOC) // BS)
    keep = {names[b] for b in keep_blocks}
    for name in [n for n in bm.named if n not in keep]:
        bm.page_name[bm.named.pop(name)] = None


def from_scratch(llm, prompts, params=GREEDY):
    """The same prompts with the cache off (both tiers emptied), then back on."""
    bm = llm.engine.block_manager
    bm.reset_prefix_cache()
    bm.enable_caching = False
    try:
        return llm.generate(prompts, params)
    finally:
        bm.enable_caching = True


def assert_pools_whole(llm) -> None:
    bm, host = llm.engine.block_manager, llm.engine.runner.sparse.host
    assert all(c == 0 for c in bm.ref_counts) and bm.num_free == bm.num_pages
    assert host.bytes_used == 0 and host.items_free + host.items_cached == host.num_items
    assert not any(e.pins for e in bm.host_tier.entries.values())
def test_host_hits_equal_prefill(full_budget):
    """DOC + a question runs (converts, finishes: the host tier holds DOC's blocks); with the GPU
    tier's names dropped, DOC + other questions load DOC from the host tier: all of it, after 3
    blocks the GPU tier still holds, and into a request too short to go sparse. Each equals the
    same request prefilled from scratch."""
    llm, bm = full_budget, full_budget.engine.block_manager
    bm.reset_prefix_cache()
    first = llm.generate([DOC + tokens(2, 8)], GREEDY)[0]
    assert first.stats and first.num_host_cached_tokens == 0 and len(bm.host_tier.entries) == 1
    hits = bm.host_tier.hits
    sparse, reused = llm.engine.runner.sparse, []
    convert = sparse.convert
    sparse.convert = lambda seq, *a: (reused.append(seq.host_summaries is not None), convert(seq, *a))
    forget_gpu_tier(llm)
    whole = llm.generate([DOC + tokens(3, 8)], GREEDY)[0]
    assert (whole.num_cached_tokens, whole.num_host_cached_tokens) == (64, 64) and whole.stats
    forget_gpu_tier(llm, keep_blocks=[0, 1, 2])
    after_gpu = llm.generate([DOC + tokens(4, 8)], GREEDY)[0]
    assert (after_gpu.num_cached_tokens, after_gpu.num_host_cached_tokens) == (64, 40) and after_gpu.stats
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    short_prompt = DOC[:40] + tokens(5, 6)  # 46 + 2 tokens, not past the threshold: dense
    forget_gpu_tier(llm)
    dense = llm.generate([short_prompt], short)[0]
    assert (dense.num_cached_tokens, dense.num_host_cached_tokens) == (40, 40) and not dense.stats
    assert bm.host_tier.hits - hits == 64 + 40 + 40
    sparse.convert = convert
    assert reused == [True, True]  # both sparse hits converted from the entry's summaries
    assert_pools_whole(llm)
    ref = from_scratch(llm, [DOC + tokens(3, 8), DOC + tokens(4, 8)])
    assert all(r.stats and r.num_cached_tokens == 0 for r in ref)
    assert [whole.token_ids, after_gpu.token_ids] == [r.token_ids for r in ref]
    assert dense.token_ids == from_scratch(llm, [short_prompt], short)[0].token_ids


def test_eviction_and_reset_give_the_pool_back(full_budget):
    """Reservations evict the host tier's entries when the pool is full; a reset gives back the rest."""
    llm, bm = full_budget, full_budget.engine.block_manager
    host, sparse = llm.engine.runner.sparse.host, llm.engine.runner.sparse
    bm.reset_prefix_cache()
    llm.generate([DOC + tokens(2, 8)], GREEDY)
    forget_gpu_tier(llm)
    taken = []
    while bm.host_tier.entries:  # reservations of 10-block requests, until DOC's entry is evicted
        taken.append(f"fill{len(taken)}")
        assert host.allocate(taken[-1], sparse.L, 10, sparse.Hkv) is not None
    for rid in taken:
        host.free(rid)
    out = llm.generate([DOC + tokens(3, 8)], GREEDY)[0]
    assert (out.num_cached_tokens, out.num_host_cached_tokens) == (0, 0)  # prefilled again
    assert_pools_whole(llm)
    bm.reset_prefix_cache()
    assert host.items_free == host.num_items and host.items_cached == 0
def test_passkey_from_the_host_tier_at_k32():
    """A 1.2K-token passkey prompt at K = 32 (75 blocks of 16): the second request, its prefix
    loaded from the host tier and its summaries reused, answers right, with the first
    (prefilled) request's tokens."""
    from oasiskv.eval.passkey import is_right, make_cases

    llm = LLM(max_model_len=1300, sparse=True, top_k_blocks=32, window_blocks=4, sink_blocks=1,
              sparse_threshold=1024, host_kv_gb=0.25)
    case = make_cases(llm.tokenizer, 1200, depths=[0.5], seeds=[0])[0]
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate([case.token_ids], params)[0]
    bm = llm.engine.block_manager
    tier, bm.host_tier = bm.host_tier, None
    bm.reset_prefix_cache()  # the GPU tier only
    bm.host_tier = tier
    again = llm.generate([case.token_ids], params)[0]
    assert first.stats and again.stats and again.num_host_cached_tokens == (len(case.token_ids) - 1) // 16 * 16
    assert is_right(first.text, case.key, exact=True) and again.token_ids == first.token_ids

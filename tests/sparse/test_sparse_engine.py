"""Sparse decode on the real default model: exact with a full budget, and under bad input."""
import argparse

import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.sparse.drafters import ngram_propose

pytestmark = pytest.mark.slow

# prefill + 32 decode steps: two blocks complete while the request decodes sparse
GREEDY32 = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)


def _long_ids(llm, n_tokens):
    # Real text nobody here wrote: Python's own argparse module.
    text = open(argparse.__file__).read()
    return llm.tokenizer.encode(text, add_special_tokens=False)[:n_tokens]


@pytest.fixture(scope="module")
def dense():
    return LLM(max_model_len=4200)


@pytest.fixture(scope="module")
def prompt(dense):
    return _long_ids(dense, 1100)


@pytest.fixture(scope="module")
def dense_tokens(dense, prompt):
    return dense.generate(prompt, GREEDY32)[0].token_ids
@pytest.mark.parametrize("drafter", ["ngram", "oracle", "ondemand"])
def test_full_budget_reproduces_dense(drafter, prompt, dense_tokens):
    """K >= context blocks: every block is resident, so sparse greedy == dense greedy. The
    drafters other than these (`self`, `prev`) are checked token for token against the in-line
    reference under a tight budget (tests/sparse/test_pipeline.py); `self` at a full budget below."""
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=80, sparse_threshold=1024, drafter=drafter,
              host_kv_gb=0.5)
    out = llm.generate(prompt, GREEDY32)[0]
    assert out.token_ids == dense_tokens
    assert out.stats["sparse_steps"] == 32
    if drafter == "oracle":
        assert out.stats["draft_acceptance"] == 1.0
def test_sampled_full_budget_equals_dense_and_the_draft_holds(dense, prompt, monkeypatch):
    """Seeded sampling. A sparse request draws each position's noise a step early (its draft
    samples with it) but in the same order as dense draws it, so with a full budget it samples
    dense's tokens; and the `self` draft, sampled with that noise, is the next token whenever
    the chain holds: once a draft is right, every later one is. (The chain starts from prompt
    lookup, so when it first holds depends on the text; with a fresh draw for the draft, later
    drafts missed about two times in three.)"""
    from oasiskv.engine.sparse_runner import SparseRunner

    hits = []
    count_step = SparseRunner._count_step

    def recording(ws, drafter, tok):
        hits.append(ws.draft == tok)
        count_step(ws, drafter, tok)
    monkeypatch.setattr(SparseRunner, "_count_step", staticmethod(recording))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=33, ignore_eos=True)
    want = dense.generate(prompt, params)[0].token_ids
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=80, sparse_threshold=1024, host_kv_gb=0.5)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == want
    assert len(hits) == 32 and True in hits
    first = hits.index(True)
    assert all(hits[first:]) and first <= 16, hits  # held from its first hit, for 16 steps or more
def test_full_budget_3k_prompt(dense):
    """188 blocks (more than a 128-wide scan), converted after its prefill: 16 steps at that
    context (the steps' own rules are the 1,100-token tests')."""
    ids = _long_ids(dense, 3000)
    greedy = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    want = dense.generate(ids, greedy)[0].token_ids
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=192, sparse_threshold=1024, host_kv_gb=0.5)
    out = llm.generate(ids, greedy)[0]
    assert out.token_ids == want and out.stats["sparse_steps"] == 16
def test_small_budget_caps_traffic(prompt):
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=16, window_blocks=4, sink_blocks=1,
              sparse_threshold=1024, fetch_ratio=0.1, host_kv_gb=0.5)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    st = out.stats
    layers, heads = 30, 3
    cap = 2  # ceil(0.1 * 16)
    assert st["admitted"] <= cap * layers * heads * st["sparse_steps"]
    assert st["resident_blocks_per_head"] == 21
    assert st["bytes_to_device"] == st["admitted"] * 2 * 16 * 64 * 4


@pytest.mark.parametrize("kwargs, words", [
    ({"top_k_blocks": 0}, "top-k-blocks"),
    ({"fetch_ratio": 0.0}, "fetch-ratio"),
    ({"fetch_ratio": 1.5}, "fetch-ratio"),
    ({"drafter": "eagle9"}, "drafter"),
    ({"window_blocks": 0}, "window-blocks"),
    ({"window_blocks": 1}, "window-blocks must be >= 2"),
    ({"host_kv_gb": -1}, "host-kv-gb"),
    ({"sparse_threshold": 32}, "sparse-threshold"),
])
def test_bad_sparse_flags(kwargs, words):
    from oasiskv.config import EngineConfig
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_flat(sparse=True, **kwargs)


def test_host_pool_too_small_makes_request_wait(prompt):
    """Two long requests, a host pool that holds one: the second waits, then runs."""
    L, H, bs, D = 30, 3, 16, 64
    one_request = L * H * 2 * bs * D * 4 * -(-(len(prompt) + 8) // bs)  # float32 items
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=16, sparse_threshold=1024,
              host_kv_gb=1.5 * one_request / 2**30)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = llm.engine
    a = engine.add_request(prompt, params)
    b = engine.add_request(prompt, params)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == [a]
    assert [s.request_id for s in engine.scheduler.waiting] == [b]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[a].token_ids == done[b].token_ids and len(done[b].token_ids) == 8
def test_sparse_requests_batched_together(dense):
    """Two sparse requests decode in one batch (2 query rows each) and match dense."""
    ids = _long_ids(dense, 2300)
    prompts = [ids[:1100], ids[1100:2300]]
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    want = [o.token_ids for o in dense.generate(prompts, params)]
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=80, sparse_threshold=1024, host_kv_gb=0.5)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert all(o.stats["sparse_steps"] == 16 for o in got)
def test_first_sparse_step_drafts_by_prompt_lookup(prompt):
    """Right after the conversion there is no draft row to take an argmax from: the first draft
    is the prompt-lookup proposal, not a copy of the current token."""
    llm = LLM(max_model_len=4200, sparse=True, top_k_blocks=16, sparse_threshold=1024, host_kv_gb=0.5)
    engine = llm.engine
    # A repeated tail: the model continues the copy, so prompt lookup has an n-gram to follow.
    engine.add_request(prompt + prompt[-50:], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while not any(s.sparse is not None for s in engine.scheduler.running):
        engine.step()
    seq = engine.scheduler.running[0]
    proposal = ngram_propose(seq.token_ids)
    assert proposal is not None and proposal != seq.token_ids[-1]  # the case means something
    assert seq.sparse.draft == proposal

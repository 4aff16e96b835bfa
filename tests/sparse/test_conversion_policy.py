"""When a request goes sparse: past the threshold only if its working set is well below its
context (the default threshold), and instead of a preemption when the GPU pool runs short (the
longest dense requests convert, from their own pages; one short of a page waits a step)."""
from __future__ import annotations

import pytest
from types import SimpleNamespace

from oasiskv import LLM, SamplingParams
from oasiskv.config import EngineConfig
from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.scheduler import Scheduler
from oasiskv.engine.sequence import Sequence, SequenceStatus
from oasiskv.sparse.config import SparseConfig, auto_threshold
from oasiskv.sparse.manager import SparseManager


class FakeSparse:
    """The scheduler's view of the sparse manager: which requests could convert now."""

    def __init__(self, convertible):
        self.convertible = convertible

    def can_convert(self, seq):
        return seq.request_id in self.convertible

    def pages_freed(self, seq):
        return len(seq.pages) - 3  # a working set of 3 pages

    def reserve(self, seq, max_model_len):
        return True

    def leave_pipeline(self, seq):
        pass


def running(scheduler, bm, rid, tokens):
    """A decoding request whose `tokens` cached tokens fill its pages: its next token needs one."""
    seq = Sequence(rid, list(range(tokens)), SamplingParams(max_tokens=100))
    bm.grow(seq, tokens)
    seq.num_cached_tokens = tokens
    seq.output_token_ids.append(1)
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
    return seq


def short_pool(convertible, num_pages=13):
    """Two decoding requests that both need a new page this step, and one page free."""
    bm = BlockManager(num_pages=num_pages, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, sparse=FakeSparse(convertible))
    long_, short = running(sched, bm, "short", 16), running(sched, bm, "long", 32)  # 4 + 8 pages
    long_, short = short, long_
    return sched, bm, long_, short


def test_requests_convert_ahead_and_one_short_of_a_page_waits_instead_of_preemption():
    sched, bm, long_, short = short_pool({"long", "short"})
    batch = sched._schedule_decode()
    assert sched.num_preemptions == 0
    assert long_.convert_early and short.convert_early  # every one that can, together
    assert len(batch.seqs) == 1  # the one that got the free page runs (its query is recorded) ...
    waiting = short if batch.seqs[0] is long_ else long_
    assert waiting.status == SequenceStatus.RUNNING and waiting in sched.running  # ... the other waits a step


def test_without_a_convertible_request_it_preempts_as_before():
    sched, bm, long_, short = short_pool(set())
    batch = sched._schedule_decode()
    assert sched.num_preemptions == 1
    assert not long_.convert_early and not short.convert_early
    assert len(batch.seqs) == 1


def test_no_conversion_while_every_dense_request_has_a_free_page():
    sched, bm, long_, short = short_pool({"long", "short"}, num_pages=14)  # two free pages, two dense requests
    sched._schedule_decode()
    assert not long_.convert_early and sched.num_preemptions == 0


def test_default_threshold_is_past_twice_the_working_set():
    assert auto_threshold(128, 1, 4, 16) == 2 * 133 * 16 == 4256
    assert auto_threshold(32, 1, 4, 16) == 4096  # never below the base
    assert EngineConfig.from_flat(sparse=True).sparse.sparse_threshold == 4256
    explicit = EngineConfig.from_flat(sparse=True, sparse_threshold=1024)
    assert explicit.sparse.sparse_threshold == 1024  # an explicit one stays


def test_should_convert_needs_the_threshold_or_an_early_request_past_the_floor():
    import torch
    mc = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, group_size=1)
    cfg = SparseConfig(enabled=True, top_k_blocks=8, sink_blocks=1, window_blocks=2, sparse_threshold=1000,
                       host_kv_gb=0.001)
    m = SparseManager(cfg, mc, torch.zeros(2, 4, 2, 16, 8), block_size=16)
    assert m.conversion_floor == 2 * 11 * 16 == 352 and m.pressure_floor == 264
    seq = Sequence("a", list(range(400)), SamplingParams(max_tokens=10))
    seq.host_extent = object()
    assert not m.should_convert(seq, 400)  # below the threshold
    assert m.should_convert(seq, 1000)
    seq.convert_early = True
    assert m.should_convert(seq, 300)  # asked for, past the pressure floor
    assert not m.should_convert(seq, 200)  # asked for, but its working set is most of its context
    assert not m.should_convert(Sequence("b", [1], SamplingParams()), 5000)  # no host extent: never


PROMPTS = [[(7 * i + 3 * j) % 1000 + 10 for j in range(150)] for i in range(2)]
POOL = dict(max_model_len=512, kv_cache_gb=0.0152, max_num_seqs=2)  # 22 pages of 16 tokens


@pytest.mark.slow
def test_a_dense_engine_preempts_under_the_load():
    """The load of the next test: two requests whose dense KV outgrows the pool together
    (2 x (150 + 60) tokens > 22 pages): a dense engine preempts one and both finish."""
    dense = LLM(**POOL)
    assert dense.engine.block_manager.num_pages == 22
    outs = dense.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert all(len(o.token_ids) == 60 for o in outs)
    assert dense.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [120, 60])
def test_engine_converts_instead_of_preempting(max_tokens):
    """Under that load a sparse engine converts both requests as the pool runs short (before
    its threshold) and both finish without a preemption. With 60 tokens they never reach the
    threshold (150 + 60 < 260): they hold host extents anyway, taken at admission because they
    pass the pressure floor, so they convert too."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Working set 5 blocks: the pressure floor is 120 tokens; the threshold (260) comes later.
    sparse = LLM(**POOL, sparse=True, top_k_blocks=2, sink_blocks=1, window_blocks=2, sparse_threshold=260,
                 host_kv_gb=0.05)
    outs = sparse.generate(PROMPTS, params)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    assert sparse.engine.scheduler.num_preemptions == 0
    assert sparse.engine.runner.sparse.num_conversions == 2


@pytest.mark.slow
def test_dense_steps_of_a_sparse_engine_overlap_and_convert_as_in_sync():
    """With sparse decode on, the dense steps before a conversion run under async scheduling
    too; the request still converts after the same step as in the synchronous loop (the full
    budget makes sparse exact, so the tokens must match)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [(11 * j) % 900 + 20 for j in range(300)]
    runs = {}
    for mode in ("off", "on"):
        llm = LLM(max_model_len=512, async_scheduling=mode, sparse=True, top_k_blocks=40, sparse_threshold=320,
                  host_kv_gb=0.05)
        out = llm.generate([prompt], params)[0]
        runs[mode] = (out.token_ids, out.stats["sparse_steps"])
        if mode == "on":
            assert llm.engine.step_stats["overlapped_steps"] > 0
    assert runs["on"] == runs["off"]
    # Decode steps bring the cache from 301 to 339 tokens (the prefill sampled the first
    # output); the request converts after the step that reaches 320, so the 19 after are sparse.
    assert runs["off"][1] == 339 - 320

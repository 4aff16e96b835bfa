"""The prefix cache's page pool under random request interleavings (hypothesis), without a model:
the scheduler and block manager run as the engine runs them, and a fake KV store records which
token each page slot holds. No page a request uses is ever freed or overwritten (a write goes only
to a page its request holds alone and that has no name; every computed token is still in its
page), names always point at pages holding exactly the named tokens, and at the end every
reference count is zero and the pool is whole."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from oasiskv.engine.block_hash import engine_salt
from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.scheduler import Scheduler
from oasiskv.engine.sequence import Sequence, SequenceStatus
from oasiskv.sampling_params import SamplingParams

BS = 4
SPARSE = object()  # stands for a working set: the request's pages are no longer its blocks
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 9, 9], [7] * 13]


class FakeKV:
    """pages[p][i]: the token whose K/V slot i of page p holds (None: never written)."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.pages = [[None] * BS for _ in range(bm.num_pages)]

    def write(self, seq: Sequence, start: int, n: int) -> None:
        for pos in range(start, start + n):
            page = seq.pages[pos // BS]
            assert self.bm.ref_counts[page] == 1, "a write into a page another request holds"
            assert self.bm.page_name[page] is None, "a write into a named (cached) page"
            self.pages[page][pos % BS] = seq.token_slice(pos, pos + 1)[0]

    def overwrite(self, pages: list[int]) -> None:  # a working set's contents
        for p in pages:
            assert self.bm.ref_counts[p] == 1 and self.bm.page_name[p] is None
            self.pages[p] = [-1] * BS

    def check(self, seqs: list[Sequence]) -> None:
        bm = self.bm
        for s in seqs:  # every computed token of a dense request is still where it was written
            if s.sparse is None:
                got = [self.pages[s.pages[p // BS]][p % BS] for p in range(s.num_cached_tokens)]
                assert got == s.token_slice(0, s.num_cached_tokens)
        held = {}
        for s in seqs:
            for p in s.pages:
                held[p] = held.get(p, 0) + 1
        assert all(bm.ref_counts[p] == held.get(p, 0) for p in range(bm.num_pages))
        assert set(bm.free_pages) == {p for p in range(bm.num_pages) if p not in held}
        for name, page in bm.named.items():
            assert bm.page_name[page] == name and None not in self.pages[page]


def make_request(i: int, prefix: int, tail: list[int], max_tokens: int) -> Sequence:
    return Sequence(str(i), PREFIXES[prefix] + tail, SamplingParams(max_tokens=max_tokens))


requests = st.lists(st.tuples(st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(1, 3), max_size=6),
                              st.integers(1, 6)), min_size=1, max_size=8)
# convert: a working set from free pages if there are enough, else from the request's own (the
# engine's order); convert_own: from its own pages at once (as when the pool is full).
actions = st.lists(st.sampled_from(["add", "add"] + ["step"] * 5 + ["abort", "convert", "convert_own"]),
                   min_size=10, max_size=120)


@settings(max_examples=150, deadline=None)
@given(requests, actions, st.integers(8, 24), st.integers(3, 16), st.booleans())
def test_no_page_in_use_is_freed_or_overwritten(reqs, script, num_pages, chunk, caching):
    bm = BlockManager(num_pages, BS, enable_caching=caching, salt=engine_salt("fake"))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=chunk)
    kv = FakeKV(bm)
    pending = [make_request(i, *r) for i, r in enumerate(reqs)]
    live: list[Sequence] = []

    def step() -> None:
        batch = sched.schedule()
        if batch is None:
            return
        for s, n in zip(batch.seqs, batch.num_tokens):
            if s.sparse is None:
                kv.write(s, s.num_cached_tokens, n)
            s.num_cached_tokens += n
            if s.sparse is None:
                bm.name_full_blocks(s)
            if s.num_cached_tokens == s.num_tokens:  # a token is sampled
                s.output_token_ids.append(1 + (sum(s.token_slice(s.num_tokens - 3, s.num_tokens)) % 3))
                if len(s.output_token_ids) >= s.params.max_tokens:
                    sched.finish(s)
                    live.remove(s)

    def convert(own_first: bool) -> None:  # as LLMEngine._convert_to_sparse: a working set of 2 pages
        dense = [s for s in sched.running if s.sparse is None and not s.in_prefill]
        if not dense:
            return
        s = dense[0]
        pages = bm.take_own(s, 2) if own_first else bm.take(2) or bm.take_own(s, 2)
        if pages is None:
            return
        kv.overwrite(pages)
        rest = [p for p in s.pages if p not in set(pages)]
        s.pages, s.sparse = pages, SPARSE
        bm.release(reversed(rest))

    for action in script + ["add"] * len(pending):
        if action == "add" and pending:
            s = pending.pop(0)
            sched.add(s)
            live.append(s)
        elif action == "step":
            step()
        elif action == "abort" and live:
            s = live.pop(0)
            sched.finish(s)
        elif action.startswith("convert"):
            convert(action == "convert_own")
        kv.check([s for s in live if s.status == SequenceStatus.RUNNING])
    for _ in range(2000):  # drain: every request finishes (the oldest always makes progress)
        if not sched.has_unfinished():
            break
        step()
        kv.check(list(sched.running))
    assert not sched.has_unfinished() and not live
    assert all(c == 0 for c in bm.ref_counts) and bm.num_free == num_pages
    kv.check([])


def test_hits_are_shared_and_survive_until_evicted():
    bm = BlockManager(6, BS, enable_caching=True, salt=engine_salt("fake"))
    a = make_request(0, 0, [3], 4)  # 11 tokens: blocks 0 and 1 full
    bm.admit(a, bm.cached_prefix(a))
    bm.grow(a, a.num_tokens)
    a.num_cached_tokens = a.num_tokens
    bm.name_full_blocks(a)
    b = make_request(1, 0, [2, 2], 4)  # same first 10 tokens: 2 blocks shared
    hits = bm.cached_prefix(b)
    assert hits == a.pages[:2]
    bm.admit(b, hits)
    assert b.num_cached_tokens == 8 and b.prefix_hit_tokens == 8 and bm.ref_counts[hits[0]] == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and bm.num_cached_free == 2  # kept, named, in the LRU list
    c = make_request(2, 0, [], 4)  # 10 tokens: at most (10 - 1) // 4 = 2 blocks from the cache
    assert bm.cached_prefix(c) == hits
    bm.take(6)  # every page handed out: the cached ones are evicted
    assert bm.cached_prefix(c) == [] and not bm.named


def test_a_whole_cached_prompt_still_computes_its_last_block():
    bm = BlockManager(8, BS, enable_caching=True, salt=engine_salt("fake"))
    a = Sequence("a", list(range(8)), SamplingParams())  # exactly two blocks
    bm.admit(a, [])
    bm.grow(a, 8)
    a.num_cached_tokens = 8
    bm.name_full_blocks(a)
    again = Sequence("b", list(range(8)), SamplingParams())
    assert len(bm.cached_prefix(again)) == 1  # the last block is recomputed, into a page of its own
    asks_logprobs = Sequence("c", list(range(8)), SamplingParams(prompt_logprobs=1))
    assert bm.cached_prefix(asks_logprobs) == []  # prompt logprobs need the prompt computed
    other = BlockManager(8, BS, enable_caching=True, salt=engine_salt("another model"))
    assert Sequence("d", list(range(8)), SamplingParams()).block_names == []
    assert other.cached_prefix(Sequence("d", list(range(8)), SamplingParams())) == []


def test_requests_that_cannot_all_fit_a_tiny_pool_finish():
    """Four requests of 3-4 pages each in a pool of 5, chunked prefill of 4 tokens, with the
    cache off and on. A request short of a page preempts the newest request admitted after it,
    chunked prefills included; when it spared them it preempted itself instead, and two requests
    took each other's pages for ever."""
    for caching in (False, True):
        bm = BlockManager(5, BS, enable_caching=caching, salt=engine_salt("fake"))
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
        seqs = [Sequence(str(i), [i + 1] * n, SamplingParams(max_tokens=m))
                for i, (n, m) in enumerate([(11, 4), (10, 7), (9, 4), (8, 4)])]
        for s in seqs:
            sched.add(s)
        for _ in range(500):
            batch = sched.schedule()
            if batch is None:
                break
            for s, n in zip(batch.seqs, batch.num_tokens):
                s.num_cached_tokens += n
                bm.name_full_blocks(s)
                if s.num_cached_tokens == s.num_tokens:
                    s.output_token_ids.append(1)
                    if len(s.output_token_ids) >= s.params.max_tokens:
                        sched.finish(s)
        assert not sched.has_unfinished(), f"a livelock (cache {'on' if caching else 'off'})"
        assert all(len(s.output_token_ids) == s.params.max_tokens for s in seqs) and bm.num_free == 5

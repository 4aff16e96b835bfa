"""The prefix cache's host tier over the host pool, without a model: finished extents stay as
cached blocks, a lookup finds the longest named run, allocation evicts the least recently used
unpinned entry, and nothing leaks. A hypothesis test runs random interleavings of requests that
reserve, write, finish into the cache, hit it and load from it: no extent a request holds, and no
entry a request has pinned, is ever freed or overwritten, and after a reset the pool is whole."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from oasiskv.sparse.host_cache import HostPrefixCache
from oasiskv.sparse.host_pool import HostKVPool

L, H = 2, 1  # layers and KV heads of the fake model: an extent of B blocks is 2 * B items


def small_pool(num_items: int = 40) -> tuple[HostKVPool, HostPrefixCache]:
    pool = HostKVPool(0, block_size=2, head_dim=2, dtype=torch.float32, pin=False, num_items=num_items)
    return pool, HostPrefixCache(pool)


def chain(prefix: str, n: int) -> list[bytes]:
    """Names of n blocks whose first ones another chain with the same prefix letters shares."""
    return [prefix[:i + 1].encode() for i in range(n)]


def keep(pool, cache, rid, names, blocks):
    pool.allocate(rid, L, blocks, H)
    summaries = torch.zeros(L, len(names), H, 2)
    cache.keep(rid, names, summaries, summaries)


def test_lookup_finds_the_longest_run_past_the_gpu_hits():
    pool, cache = small_pool()
    keep(pool, cache, "a", chain("xyz", 3), 4)
    assert pool.extent("a") is None and pool.items_cached == 8 and pool.bytes_used == 0
    hit = cache.lookup(chain("xyq", 4))
    assert (hit.first_block, hit.num_blocks, hit.num_tokens) == (0, 2, 4)
    assert cache.lookup(chain("xyz", 3), skip=1).num_blocks == 2
    assert cache.lookup(chain("xyz", 3), skip=3) is None  # the GPU tier holds all of it
    assert cache.lookup(chain("q", 1)) is None


def test_allocation_evicts_least_recently_used_unpinned_and_the_pool_returns_whole():
    pool, cache = small_pool(24)  # three extents of 4 blocks
    for rid, p in (("a", "a"), ("b", "b"), ("c", "c")):
        keep(pool, cache, rid, chain(p, 2), 4)
    assert pool.items_free == 0
    cache.pin(cache.lookup(chain("a", 2)).entry)  # a: pinned, and now the most recently used
    assert pool.allocate("d", L, 4, H) is not None  # evicts b, the least recently used unpinned
    assert cache.lookup(chain("b", 2)) is None and cache.lookup(chain("c", 2)) is not None
    assert pool.allocate("e", L, 8, H) is None  # needs a and c gone: a is pinned
    assert cache.lookup(chain("a", 2)) is not None  # c went trying; a stays
    cache.unpin(cache.lookup(chain("a", 2)).entry)
    pool.free("d")
    cache.clear()
    assert not cache.entries and not cache.index and pool.items_free == pool.num_items


def test_a_newer_copy_of_every_block_retires_the_older_entry():
    pool, cache = small_pool()
    keep(pool, cache, "a", chain("doc", 2), 3)
    keep(pool, cache, "b", chain("doc", 3), 3)  # holds a's two names and one more: a is unreachable
    assert len(cache.entries) == 1 and pool.items_cached == 6
    pinned = cache.lookup(chain("doc", 3)).entry
    cache.pin(pinned)
    keep(pool, cache, "c", chain("doc", 3), 3)  # supersedes b, which is pinned: it goes at unpin
    assert len(cache.entries) == 2
    cache.unpin(pinned)
    assert len(cache.entries) == 1 and pool.items_cached == 6
    keep(pool, cache, "d", [], 3)  # no named block: straight back to the pool
    assert pool.items_cached == 6 and pool.items_free == pool.num_items - 6


# ---- random interleavings -------------------------------------------------------------------
PREFIXES = ["abcd", "abxy", "qrst"]
actions = st.lists(st.tuples(st.sampled_from(["reserve"] * 3 + ["finish"] * 2 + ["hit"] * 2 + ["load", "abort", "reset"]),
                             st.integers(0, 2), st.integers(1, 4)), min_size=5, max_size=80)


@settings(max_examples=150, deadline=None)
@given(actions, st.integers(8, 24))
def test_no_extent_in_use_is_freed_or_overwritten(script, num_items):
    """Each request writes its tag into every item of its extent; an entry keeps the tag of the
    request it came from. Whatever a live request holds and whatever a pinned entry holds must
    still carry its tag after every action; at the end, with no request left, a reset frees all."""
    pool, cache = small_pool(num_items)
    live: dict[str, tuple[int, list[bytes], int]] = {}  # request -> (tag, names, blocks)
    pins: list = []  # (entry, its tag), a hit admitted but not loaded
    tags = {}  # entry key -> tag
    counter = iter(range(1, 10**6))

    def check():
        for rid, (tag, _, _) in live.items():
            ext = pool.extent(rid)
            assert ext is not None and bool((pool.extent_items(ext) == tag).all())
        for entry, tag in pins:
            assert entry.key in cache.entries, "a pinned entry was evicted"
            assert pool.extent(entry.key) == entry.extent
            assert bool((pool.extent_items(entry.extent) == tag).all()), "a pinned entry was overwritten"
        extents = sorted((e.start, e.num_items) for e in pool._extents.values())
        ranges = sorted(extents + pool._free)
        assert sum(n for _, n in ranges) == num_items  # extents and free ranges tile the arena
        assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))

    for action, which, blocks in script:
        rids = sorted(live)
        if action == "reserve":
            rid = f"r{next(counter)}"
            if pool.allocate(rid, L, blocks, H) is not None:
                tag = float(next(counter))
                pool.extent_items(pool.extent(rid)).fill_(tag)
                live[rid] = (tag, chain(PREFIXES[which], blocks), blocks)
        elif action == "finish" and rids:
            rid = rids[which % len(rids)]
            tag, names, n = live.pop(rid)
            keep_names = names[:n - 1] if n > 1 else []  # its last block was written sparse
            cache.keep(rid, keep_names, torch.zeros(L, len(keep_names), H, 2), torch.zeros(L, len(keep_names), H, 2))
            if keep_names:  # the newest entry
                tags[next(reversed(cache.entries))] = tag
        elif action == "hit":
            hit = cache.lookup(chain(PREFIXES[which], blocks))
            if hit is not None:
                cache.pin(hit.entry)
                pins.append((hit.entry, tags[hit.entry.key]))
        elif action == "load" and pins:
            entry, tag = pins.pop(which % len(pins))
            assert bool((pool.extent_items(entry.extent) == tag).all())
            cache.unpin(entry)
        elif action == "abort" and rids:
            pool.free(rids[which % len(rids)])
            del live[rids[which % len(rids)]]
        elif action == "reset":
            cache.clear()
        check()
    for entry, _ in pins:
        cache.unpin(entry)
    for rid in list(live):
        pool.free(rid)
    cache.clear()
    assert not cache.entries and not cache.index and pool.items_free == num_items and pool.items_cached == 0

"""Host KV pool: extent allocation (first fit, coalescing), addressing, and isolation."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from oasiskv.sparse.host_pool import HostKVPool, item_indices


def small_pool(num_items=64):
    return HostKVPool(0, block_size=2, head_dim=4, dtype=torch.float32, pin=False,
                      num_items=num_items)


def test_sizes_in_gb():
    pool = HostKVPool(1 / 1024, block_size=16, head_dim=128, dtype=torch.bfloat16, pin=False)
    assert pool.item_bytes == 8192 and pool.num_items == 2**20 // 8192  # 1 MiB of 8 KiB items
    assert pool.bytes_free == 2**20 and pool.bytes_used == 0
    assert pool.items.shape == (128, 2, 16, 128) and not pool.pinned


def test_allocate_free_coalesce():
    pool = small_pool(24)
    a = pool.allocate("a", 2, 2, 2)  # 8 items
    b = pool.allocate("b", 1, 4, 2)
    c = pool.allocate("c", 2, 1, 4)
    assert (a.start, b.start, c.start) == (0, 8, 16) and pool.items_free == 0
    assert pool.allocate("d", 1, 1, 1) is None and not pool.can_fit(1, 1, 1)
    pool.free("a")
    pool.free("c")
    assert pool.bytes_free == 16 * pool.item_bytes and pool.largest_free_items() == 8
    assert pool.allocate("d", 3, 3, 1) is None  # 9 items: free but fragmented, must wait
    pool.free("b")  # the three ranges merge into one
    assert pool._free == [(0, 24)]
    d = pool.allocate("d", 3, 3, 1)
    assert d is not None and d.start == 0 and pool.bytes_used == 9 * pool.item_bytes
    with pytest.raises(ValueError):
        pool.allocate("d", 1, 1, 1)


def test_request_waits_until_another_frees():
    pool = small_pool(20)
    pool.allocate(1, 2, 4, 2)  # 16
    assert pool.allocate(2, 1, 4, 2) is None and not pool.can_fit(1, 4, 2)
    pool.free(1)
    assert pool.can_fit(1, 4, 2) and pool.allocate(2, 1, 4, 2) is not None


def test_item_index_layout():
    pool = small_pool(200)
    pool.allocate("x", 1, 1, 1)
    ext = pool.allocate("y", 3, 5, 4)
    assert ext.start == 1 and ext.num_items == 60
    # [layer][block][head]: heads of a block adjacent, then blocks, then layers
    assert pool.item_index(ext, 0, 0, 1) == 2 and pool.item_index(ext, 0, 1, 0) == 5
    assert pool.item_index(ext, 2, 4, 3) == 60
    L, B, H = torch.meshgrid(torch.arange(3), torch.arange(5), torch.arange(4), indexing="ij")
    idx = pool.item_index(ext, L, B, H)
    assert idx.flatten().tolist() == list(range(1, 61))
    view = pool.extent_items(ext)
    view.copy_(torch.randn_like(view))
    assert torch.equal(pool.items[idx[2, 3, 1]], view[2, 3, 1])
    # across requests: per-element starts and max_blocks broadcast
    other = pool.allocate("z", 2, 7, 4)
    many = item_indices(torch.tensor([ext.start, other.start]), torch.tensor([5, 7]), 4,
                        torch.tensor([1, 1]), torch.tensor([2, 6]), torch.tensor([3, 0]))
    assert many.tolist() == [ext.item_index(1, 2, 3), other.item_index(1, 6, 0)]


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 3), st.integers(1, 6),
                              st.integers(1, 3), st.integers(0, 50)), min_size=1, max_size=40))
def test_random_alloc_free_sequences(ops):
    """Random allocate/free: extents never overlap, the free list and the extents tile the arena
    exactly, free ranges are sorted and coalesced, first fit is honoured, None means no range
    fits, and writing one extent never changes another's bytes."""
    pool = small_pool(96)
    live: dict[int, float] = {}  # request -> fill value
    next_id = 0
    for alloc, L, B, H, pick in ops:
        if alloc or not live:
            free_before = list(pool._free)
            need = L * B * H
            ext = pool.allocate(next_id, L, B, H)
            fits = [s for s, n in free_before if n >= need]
            if ext is None:
                assert not fits
            else:
                assert ext.start == fits[0]
                live[next_id] = float(next_id + 1)
                pool.extent_items(ext).fill_(live[next_id])
            next_id += 1
        else:
            rid = sorted(live)[pick % len(live)]
            pool.free(rid)
            del live[rid]
        for s, n in pool._free:  # scribble over free space: must not reach a live extent
            pool.items[s:s + n].fill_(-1.0)
        ranges = sorted([(e.start, e.num_items, "x") for e in pool._extents.values()]
                        + [(s, n, "f") for s, n in pool._free])
        pos = 0
        for s, n, _ in ranges:
            assert s == pos and n > 0
            pos += n
        assert pos == pool.num_items
        assert pool._free == sorted(pool._free)
        assert all(a[0] + a[1] < b[0] for a, b in zip(pool._free, pool._free[1:]))  # coalesced
        for rid, val in live.items():
            assert (pool.extent_items(pool.extent(rid)) == val).all()


def test_huge_page_arena_is_aligned_writable_and_reports_its_huge_pages():
    from oasiskv.sparse.host_pool import HUGE_PAGE, anon_huge_page_bytes, huge_page_empty
    t = huge_page_empty((1024, 2, 16, 128), torch.bfloat16)  # 8 MiB: four huge pages
    assert t.shape == (1024, 2, 16, 128) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()
    assert anon_huge_page_bytes() >= 0  # what the kernel grants depends on its THP switch
    assert huge_page_empty((0, 2, 16, 128), torch.float32).numel() == 0

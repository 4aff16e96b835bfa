"""The decode side's remote blocks against owners in this process (socket transport): one read
per peer per flush, merged extents, the byte budget, items read at most once, a dead peer
failing only its requests, and the local arena back to zero."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oasiskv.disagg.local_items import LocalItems
from oasiskv.disagg.remote_reads import IN_FLIGHT, REMOTE, RemoteReads, RemoteRequest, merge_runs
from oasiskv.disagg.socket_transport import SocketTransport

BS, D, L, H = 16, 8, 2, 2
OWNER_ITEMS = 512


def owner(seed: int) -> tuple[SocketTransport, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    items = torch.randn(OWNER_ITEMS, 2, BS, D, generator=g).to(torch.bfloat16)
    t = SocketTransport()
    t.register(items)
    t.serve()
    return t, items


@pytest.fixture
def side():
    store = LocalItems(256, BS, D, torch.bfloat16)
    t = SocketTransport()
    t.register(store.items)
    reads = RemoteReads(t, store)
    yield reads, store
    t.close()
    assert store.bytes_used == 0, "the decode side's items must all be back"


def request(rid: str, peer: str, start: int) -> RemoteRequest:
    # The peer's extent: 8 blocks per layer, 6 complete; the decode side's: 10 per layer.
    return RemoteRequest.new(rid, peer, start, 8, 6, L, 10, H)


def check_bytes(req: RemoteRequest, store: LocalItems, owner_items: torch.Tensor) -> int:
    """Every local item of req equals its item on the owner; returns how many."""
    layer, block, head = np.nonzero(req.where >= 0)
    for l, b, h in zip(layer, block, head):
        assert torch.equal(store.items[req.where[l, b, h]], owner_items[req.remote_item(l, b, h)])
    return len(layer)


def test_merge_runs():
    r, l, n = merge_runs(np.array([7, 3, 4, 5, 9, 10]), np.array([5, 0, 1, 3, 6, 7]))
    # sorted by remote: 3->0, 4->1, 5->3 (local gap), 7->5, 9->6, 10->7
    assert r.tolist() == [3, 5, 7, 9] and l.tolist() == [0, 3, 5, 6] and n.tolist() == [2, 1, 1, 2]


def test_one_read_per_peer_merged_and_once(side):
    reads, store = side
    (o1, items1), (o2, items2) = owner(1), owner(2)
    try:
        p1, p2 = reads.transport.add_peer(o1.metadata()), reads.transport.add_peer(o2.metadata())
        a, b, c = request("a", p1, 10), request("b", p1, 200), request("c", p2, 40)
        for r in (a, b, c):
            reads.admit(r)
        # A block's heads of a layer are adjacent on the owner: one extent.
        assert not reads.want(a, 0, 3, np.arange(H)).any()
        reads.want(a, 1, np.array([0, 5]), 1)
        reads.want(b, np.arange(L)[:, None], 2, np.arange(H)[None, :])
        reads.want(c, 0, np.arange(4), 0)
        reads.want(a, 0, 3, 0)  # asked twice in one step: once
        reads.want(a, 0, 7, 0)  # past the peer's complete blocks: never read
        posted = reads.flush()
        assert reads.totals.reads == 2  # one per peer, requests and layers merged
        assert posted == (2 + 2 + 4 + 4) * store.item_bytes
        assert a.where[0, 3, 0] == IN_FLIGHT and a.where[0, 7, 0] == REMOTE
        reads.want(a, 0, 3, 0)  # in flight: not asked again
        assert reads.flush() == 0
        reads.wait()
        assert reads.totals.bytes_read == posted
        assert check_bytes(a, store, items1) == 4 and check_bytes(b, store, items1) == 4
        assert check_bytes(c, store, items2) == 4
        assert reads.want(a, 0, 3, np.arange(H)).all()  # local now: eligible, never read again
        assert reads.flush() == 0 and reads.totals.reads == 2
        extents_first = reads.totals.extents
        assert extents_first < 12  # adjacent items merged
    finally:
        for r in (a, b, c):
            reads.release(r)
        o1.close(), o2.close()


def test_byte_budget_keeps_the_first_asked(side):
    reads, store = side
    o, items = owner(3)
    try:
        peer = reads.transport.add_peer(o.metadata())
        a = request("a", peer, 0)
        reads.admit(a)
        blocks = np.array([5, 1, 4, 0, 2, 3])
        reads.want(a, 0, blocks, 0)  # best first
        assert reads.flush(budget_bytes=4 * store.item_bytes + 100) == 4 * store.item_bytes
        assert reads.totals.items_over_budget == 2
        reads.wait()
        assert (a.where[0, blocks[:4], 0] >= 0).all() and (a.where[0, blocks[4:], 0] == REMOTE).all()
        reads.want(a, 0, blocks, 0)  # next step: only the rest is read
        assert reads.flush(budget_bytes=4 * store.item_bytes) == 2 * store.item_bytes
        reads.wait()
        assert check_bytes(a, store, items) == 6
    finally:
        reads.release(a)
        o.close()


def test_placed_items_and_release_while_in_flight(side):
    reads, store = side
    o, items = owner(4)
    try:
        peer = reads.transport.add_peer(o.metadata())
        a = request("a", peer, 30)
        reads.admit(a)
        local = reads.place(a, 0, np.array([0, 1]), 1)  # e.g. the admission's working set
        store.items[local] = items[a.remote_item(0, np.array([0, 1]), 1)]
        reads.want(a, 0, np.arange(4), 1)
        assert reads.flush() == 2 * store.item_bytes  # the placed two are not read
        reads.release(a)  # released with its read in flight: its items wait for the read
        assert store.bytes_used > 0
        reads.wait()
    finally:
        o.close()


def test_dead_peer_fails_only_its_requests(side):
    reads, store = side
    (o1, _), (o2, items2) = owner(5), owner(6)
    p1, p2 = reads.transport.add_peer(o1.metadata()), reads.transport.add_peer(o2.metadata())
    a, b = request("a", p1, 0), request("b", p2, 0)
    reads.admit(a), reads.admit(b)
    try:
        o1.close()  # the prefill instance goes away
        reads.want(a, 0, np.arange(6), 0)
        reads.want(b, 0, np.arange(6), 0)
        reads.flush()
        reads.wait()
        assert reads.failed == [a] and a.error is not None and b.error is None
        assert (a.where == REMOTE).all() and check_bytes(b, store, items2) == 6
        reads.want(a, 0, 0, 1)  # a failed request asks for nothing
        assert reads.flush() == 0
    finally:
        reads.release(a), reads.release(b)
        o2.close()


def test_local_items_runs():
    store = LocalItems(10, BS, D, torch.bfloat16)
    a = store.allocate(4)
    b = store.allocate(3)
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5, 6]
    store.free(a[[1, 2]])
    assert store.allocate(4).tolist() == [1, 2, 7, 8]  # the lowest runs first
    assert store.allocate(2) is None and store.items_free == 1  # nothing taken when short
    with pytest.raises(ValueError):
        store.free(np.array([9]))  # never handed out: free already
    store.free(np.array([0, 1, 2, 3, 4, 5, 6, 7, 8]))
    assert store.bytes_used == 0 and store.allocate(10) is not None


def test_no_local_room_reads_what_fits_and_leaves_the_rest_remote(side):
    """800 items wanted, 256 in the arena: the read takes what fits less two blocks of every
    layer and head for the request's own blocks; the others stay remote, asked again later."""
    reads, store = side
    o, _ = owner(7)
    try:
        peer = reads.transport.add_peer(o.metadata())
        a = RemoteRequest.new("a", peer, 0, 200, 200, L, 200, H)
        reads.admit(a)
        reads.want(a, np.arange(L)[:, None, None], np.arange(200)[None, :, None], np.arange(H))
        room = store.num_items - 2 * L * H
        assert reads.flush() == room * store.item_bytes and reads.totals.items_no_room == L * 200 * H - room
        reads.wait()
        assert (a.where >= 0).sum() == room and (a.where == REMOTE).sum() == L * 200 * H - room
        assert (a.where[0, :room // H] >= 0).all()  # the first layer's blocks first
    finally:
        reads.release(a)
        o.close()

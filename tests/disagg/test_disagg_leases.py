"""The owner's leases on a host pool, with a hand-driven clock: no extent is reused before its
release, or its expiry plus the grace."""
from __future__ import annotations

import pytest
import torch

from oasiskv.disagg.leases import LeaseKeeper, LeaseTable
from oasiskv.sparse.host_pool import HostKVPool


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool():
    p = HostKVPool(0, 16, 8, torch.float16, pin=False, num_items=64)
    yield p
    assert p.bytes_used == 0


def test_release_frees_at_the_next_reap(pool):
    clock = Clock()
    leases = LeaseTable(pool.free, ttl_s=10, grace_s=5, clock=clock)
    a = pool.allocate("a", 1, 8, 2)
    leases.grant("a", "decode-0")
    with pytest.raises(ValueError):
        leases.grant("a", "decode-1")
    assert leases.reap() == [] and pool.extent("a") == a
    assert leases.release("a") and not leases.release("a")
    assert pool.extent("a") == a  # marked only: the pool's owner frees in reap
    assert leases.reap() == ["a"] and pool.extent("a") is None
    assert leases.held() == 0 and leases.expired_total == 0


def test_expiry_then_grace_before_reuse(pool):
    clock = Clock()
    leases = LeaseTable(pool.free, ttl_s=10, grace_s=5, clock=clock)
    pool.allocate("a", 1, 16, 2)  # 32 items of 64
    pool.allocate("b", 1, 8, 2)
    leases.grant("a", "decode-0")
    leases.grant("b", "decode-0")
    for _ in range(3):  # renewed: alive well past one TTL
        clock.now += 8
        assert leases.heartbeat("decode-0", ["a", "b"]) == []
    assert leases.heartbeat("decode-1", ["a"]) == ["a"]  # not that peer's
    clock.now += 8
    assert leases.heartbeat("decode-0", ["b", "zzz"]) == ["zzz"]  # a lapses; b renewed
    clock.now += 3  # a: 11 s since its last renewal, past the TTL
    assert leases.heartbeat("decode-0", ["a"]) == ["a"]  # void: no renewal brings it back
    assert leases.reap() == [] and pool.extent("a") is not None  # in its grace
    assert pool.allocate("c", 1, 16, 2) is None  # its items are not handed out
    clock.now += 4.5  # 15.5 s: past TTL + grace
    assert leases.reap() == ["a"] and leases.expired_total == 1
    assert pool.extent("a") is None and leases.holds("b")
    assert pool.allocate("c", 1, 16, 2) is not None
    pool.free("c")
    assert leases.release_peer("decode-0") == 1
    assert leases.reap() == ["b"] and leases.held() == 0


def test_keeper_renews_with_one_heartbeat_per_peer(pool):
    """The decode side's keeper against two owners' tables: its leases outlive many TTLs with
    one batched heartbeat per peer; an owner that cannot be reached loses all of its leases;
    a lease the owner voided comes back as lost."""
    clock = Clock()
    owners = {p: LeaseTable(pool.free, ttl_s=3, grace_s=1, clock=clock) for p in ("p0", "p1")}
    sent, unreachable = [], set()

    def send(peer: str, ids: list[str]) -> list[str]:
        sent.append((peer, sorted(ids)))
        if peer in unreachable:
            raise ConnectionError("unreachable")
        return owners[peer].heartbeat("decode-0", ids)

    keeper = LeaseKeeper(send, clock)
    for peer, rid in (("p0", "a"), ("p0", "b"), ("p1", "c")):
        pool.allocate(rid, 1, 4, 2)
        keeper.hold(peer, rid, owners[peer].grant(rid, "decode-0"))
    for _ in range(20):  # 10 s: three TTLs of 3 s
        clock.now += 0.5
        assert keeper.beat() == {}
    assert all(owners[p].reap() == [] for p in owners) and keeper.held() == 3
    assert ("p0", ["a", "b"]) in sent and all(len(ids) <= 2 for _, ids in sent)
    assert len(sent) == keeper.heartbeats <= 2 * 10  # one per peer per TTL / 3 (1 s)
    owners["p0"].release("b"), keeper.drop("b")
    unreachable.add("p1")
    clock.now += 1
    assert keeper.beat() == {"p1": ["c"]}
    for _ in range(9):  # c lapses at p1 (TTL 3 + grace 1); a is renewed at p0
        clock.now += 0.5
        assert keeper.beat() == {}
    assert owners["p1"].reap() == ["c"] and owners["p0"].reap() == ["b"]
    owners["p0"]._leases["a"].expires = clock.now - 1  # p0 voids a (e.g. a lost heartbeat)
    clock.now += 1
    assert keeper.beat() == {"p0": ["a"]} and keeper.held() == 0
    clock.now += 2
    assert owners["p0"].reap() == ["a"]


def test_unclaimed_lease_is_taken_by_the_first_admitting_peer(pool):
    """The prefill server grants a hand-over's lease to no peer; the decode server that fetches
    the admission claims it (and renews it); another peer cannot; an unclaimed lease expires."""
    clock = Clock()
    leases = LeaseTable(pool.free, ttl_s=10, grace_s=5, clock=clock)
    pool.allocate("a", 1, 8, 2)
    pool.allocate("b", 1, 8, 2)
    leases.grant("a", "")
    leases.grant("b", "")
    clock.now += 8
    assert leases.claim("a", "decode-0") and leases.claim("a", "decode-0")
    assert not leases.claim("a", "decode-1")
    assert leases.heartbeat("decode-1", ["a"]) == ["a"] and leases.heartbeat("decode-0", ["a"]) == []
    clock.now += 3  # b's TTL passed unclaimed: it can no longer be claimed, and goes after the grace
    assert not leases.claim("b", "decode-0")
    clock.now += 5
    assert leases.reap() == ["b"] and leases.expired_total == 1
    assert leases.release("a") and leases.reap() == ["a"]

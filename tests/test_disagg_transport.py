"""Both transports between two processes (tests/disagg_peer.py is the owner): reads verified
byte for byte, out-of-range reads refused, a peer killed mid-read, leases that expire, and
both host pools back to zero bytes used."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from disagg_peer import BLOCK_SIZE, HEAD_DIM, pattern
from oasiskv.disagg.nixl_transport import nixl_available
from oasiskv.disagg.transport import PeerDisconnected, ReadRefused, ReadTimeout
from oasiskv.sparse.host_pool import HostKVPool

ROOT = Path(__file__).resolve().parent.parent
OWNER_ITEMS = 2048  # 8 MiB at 4 KiB items
TRANSPORTS = ["socket", pytest.param("nixl", marks=pytest.mark.skipif(
    nixl_available() is not None, reason=str(nixl_available())))]


class Owner:
    """An owner process and its command line."""

    def __init__(self, kind: str, seed: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.seed = seed
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "disagg_peer.py"), kind, str(seed),
                                      str(OWNER_ITEMS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.metadata = json.loads(self.proc.stdout.readline())["metadata"].encode()

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def used_after_reap(self, timeout_s: float = 2.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.ask("used")
            if out["used"] == 0 or time.monotonic() > deadline:
                return out
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=10)


def make_reader(kind: str):
    if kind == "nixl":
        from oasiskv.disagg.nixl_transport import NixlTransport
        return NixlTransport()
    from oasiskv.disagg.socket_transport import SocketTransport
    return SocketTransport()


@pytest.fixture
def reader_pool():
    pool = HostKVPool(0, BLOCK_SIZE, HEAD_DIM, torch.bfloat16, pin=False, num_items=4096)
    yield pool
    assert pool.bytes_used == 0, "the reader's pool must be back to zero bytes used"


@pytest.fixture(params=TRANSPORTS)
def kind(request):
    return request.param


def scattered(item_bytes: int, first_item: int, num_items: int, count: int, rng) -> np.ndarray:
    """`count` distinct items of an extent, in random order, as (offset, length) rows."""
    items = first_item + rng.choice(num_items, size=count, replace=False)
    return np.stack([items * item_bytes, np.full(count, item_bytes)], 1)


def test_reads_byte_for_byte_and_refusals(kind, reader_pool):
    owner = Owner(kind, seed=3)
    reader = make_reader(kind)
    reader.register(reader_pool.items)
    try:
        peer = reader.add_peer(owner.metadata)
        ib = reader_pool.item_bytes
        src = owner.ask("alloc r1 512")  # 1024 items, 4 MiB
        rng = np.random.default_rng(0)
        remote = scattered(ib, src["offset"] // ib, src["nbytes"] // ib, 700, rng)
        remote[::7, 1] = ib // 2  # some extents shorter than an item
        ext = reader_pool.allocate("landing", 1, 512, 2)
        local = ext.start * ib + np.arange(len(remote)) * ib
        pending = reader.read(peer, remote, local)
        reader.wait(pending)
        region = reader_pool.items.view(-1).view(torch.uint8)
        for (off, n), dst in zip(remote.tolist(), local.tolist()):
            assert torch.equal(region[dst:dst + n], pattern(owner.seed, off, n)), (off, n)
        # Outside the owner's region: refused on the reader, nothing posted.
        with pytest.raises(ReadRefused):
            reader.read(peer, [[OWNER_ITEMS * ib - 16, 32]], [ext.start * ib])
        with pytest.raises(ReadRefused):
            reader.read(peer, [[-ib, ib]], [ext.start * ib])
        # Outside the reader's own region.
        with pytest.raises(ReadRefused):
            reader.read(peer, [[0, ib]], [reader_pool.items.numel() * 2])
        # The peer still serves reads after the refusals.
        again = reader.read(peer, remote[:3], local[:3])
        reader.wait(again)
        reader_pool.free("landing")
        assert owner.ask("release r1") == {"released": False}  # never leased
        owner.ask("lease r1 reader 5 0")
        assert owner.ask("release r1") == {"released": True}
        assert owner.ask("used")["used"] == src["nbytes"]  # void, not yet freed
        assert owner.used_after_reap(timeout_s=3.0) == {"used": 0, "leases": 0}
    finally:
        reader.close()
        owner.close()


def test_socket_owner_refuses_out_of_range(reader_pool):
    """The owner checks extents itself, whatever the reader claims its region is."""
    owner = Owner("socket", seed=1)
    reader = make_reader("socket")
    reader.register(reader_pool.items)
    try:
        peer = reader.add_peer(owner.metadata)
        reader._peers[peer].size *= 4  # a reader that believes the region is larger
        pending = reader.read(peer, [[OWNER_ITEMS * reader_pool.item_bytes, 64]], [0])
        with pytest.raises(ReadRefused):
            reader.wait(pending)
        ok = reader.read(peer, [[0, 64]], [0])  # the connection stays usable
        reader.wait(ok)
        assert torch.equal(reader_pool.items.view(-1).view(torch.uint8)[:64], pattern(1, 0, 64))
    finally:
        reader.close()
        owner.close()


def test_peer_killed_mid_read(kind, reader_pool):
    """A killed owner fails the reads addressed to it within 5 s; another owner keeps serving."""
    doomed, other = Owner(kind, seed=5), Owner(kind, seed=6)
    reader = make_reader(kind)
    reader.register(reader_pool.items)
    try:
        p_doomed, p_other = reader.add_peer(doomed.metadata), reader.add_peer(other.metadata)
        ib = reader_pool.item_bytes
        remote = np.stack([np.arange(OWNER_ITEMS) * ib, np.full(OWNER_ITEMS, ib)], 1)
        local = np.arange(OWNER_ITEMS) * ib
        doomed.proc.kill()
        killed = time.monotonic()
        with pytest.raises(PeerDisconnected):
            while True:  # reads posted as the process dies: one of them must fail
                reader.wait(reader.read(p_doomed, remote, local, timeout_s=5.0))
        assert time.monotonic() - killed < 5.0
        with pytest.raises(PeerDisconnected):  # and later ones fail at once
            reader.read(p_doomed, remote[:1], local[:1])
        reader.remove_peer(p_doomed)
        pending = reader.read(p_other, remote, local)
        reader.wait(pending)
        region = reader_pool.items.view(-1).view(torch.uint8)
        assert torch.equal(region[:OWNER_ITEMS * ib], pattern(6, 0, OWNER_ITEMS * ib))
    finally:
        reader.close()
        doomed.proc.wait(timeout=10)
        other.close()


def test_read_timeout_drops_only_that_peer(reader_pool):
    """A peer that stops answering (stopped, not dead) fails by the read's deadline."""
    slow, other = Owner("socket", seed=7), Owner("socket", seed=8)
    reader = make_reader("socket")
    reader.register(reader_pool.items)
    try:
        p_slow, p_other = reader.add_peer(slow.metadata), reader.add_peer(other.metadata)
        ib = reader_pool.item_bytes
        remote = np.stack([np.arange(OWNER_ITEMS) * ib, np.full(OWNER_ITEMS, ib)], 1)
        local = np.arange(OWNER_ITEMS) * ib
        slow.proc.send_signal(19)  # SIGSTOP: the socket stays open, nothing comes back
        start = time.monotonic()
        with pytest.raises((ReadTimeout, PeerDisconnected)):
            for _ in range(100):  # the kernel's buffers may take a few reads before one stalls
                reader.wait(reader.read(p_slow, remote, local, timeout_s=0.5))
        assert time.monotonic() - start < 5.0
        with pytest.raises(PeerDisconnected):
            reader.read(p_slow, remote[:1], local[:1])
        reader.wait(reader.read(p_other, remote[:8], local[:8]))
    finally:
        reader.close()
        slow.proc.send_signal(18)  # SIGCONT
        slow.close()
        other.close()


def test_lease_expiry_frees_the_extent(kind, reader_pool):
    owner = Owner(kind, seed=9)
    reader = make_reader(kind)
    reader.register(reader_pool.items)
    try:
        peer = reader.add_peer(owner.metadata)
        src = owner.ask("alloc r1 64")
        owner.ask("lease r1 decode-0 0.4 1.0")
        for _ in range(4):  # renewed past its TTL: kept, and readable
            time.sleep(0.15)
            assert owner.ask("beat decode-0 r1") == {"lost": []}
        last_beat = time.monotonic()
        assert owner.ask("used")["leases"] == 1
        assert owner.ask("beat decode-1 r1") == {"lost": ["r1"]}  # another peer holds nothing
        ext = reader_pool.allocate("landing", 1, 64, 2)
        n = src["nbytes"]
        reader.wait(reader.read(peer, [[src["offset"], n]], [ext.start * reader_pool.item_bytes]))
        start = ext.start * reader_pool.item_bytes
        assert torch.equal(reader_pool.items.view(-1).view(torch.uint8)[start:start + n],
                           pattern(9, src["offset"], n))
        reader_pool.free("landing")
        time.sleep(max(0.0, last_beat + 0.5 - time.monotonic()))  # past the TTL, in the grace
        assert owner.ask("beat decode-0 r1") == {"lost": ["r1"]}
        assert owner.ask("used")["used"] == src["nbytes"]  # void, not yet freed
        assert owner.used_after_reap(timeout_s=3.0) == {"used": 0, "leases": 0}
    finally:
        reader.close()
        owner.close()

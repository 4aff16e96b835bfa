"""Both transports between two processes (tests/disagg_peer.py is the owner): reads verified
byte for byte, out-of-range reads refused, a peer killed mid-read, leases that expire, and
both host pools back to zero bytes used."""
from __future__ import annotations

import json
import os
import signal
import socket
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

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
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
        self.metadata = b""

    def started(self) -> "Owner":
        self.metadata = self._answer()["metadata"].encode()
        return self

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):  # a library's log line
            line = self.proc.stdout.readline()
        return json.loads(line)

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer()

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


@pytest.fixture(scope="module", params=TRANSPORTS)
def owners(request):
    """The owner processes of one transport, started together (each imports torch once)."""
    started = {role: Owner(request.param, seed) for seed, role in enumerate(["main", "doomed"], start=3)}
    started = {role: o.started() for role, o in started.items()}
    yield request.param, started
    for o in started.values():
        if o.proc.poll() is None:
            o.proc.send_signal(signal.SIGCONT)
            o.close()


def make_reader(kind: str):
    if kind == "nixl":
        from oasiskv.disagg.nixl_transport import NixlTransport
        return NixlTransport()
    from oasiskv.disagg.socket_transport import SocketTransport
    return SocketTransport()


@pytest.fixture
def reader(owners):
    kind, _ = owners
    pool = HostKVPool(0, BLOCK_SIZE, HEAD_DIM, torch.bfloat16, pin=False, num_items=4096)
    transport = make_reader(kind)
    transport.register(pool.items)
    yield transport, pool
    transport.close()
    assert pool.bytes_used == 0, "the reader's pool must be back to zero bytes used"


def pretend_peer_size(transport, peer: str, size: int) -> None:
    """A reader that believes the peer's region is `size` bytes, to see the owner's own check."""
    p = transport._peers[peer]
    if isinstance(p, dict):
        p["size"] = size
    else:
        p.size = size


def scattered(item_bytes: int, first_item: int, num_items: int, count: int, rng) -> np.ndarray:
    """`count` distinct items of an extent, in random order, as (offset, length) rows."""
    items = first_item + rng.choice(num_items, size=count, replace=False)
    return np.stack([items * item_bytes, np.full(count, item_bytes)], 1)


def region(pool: HostKVPool) -> torch.Tensor:
    return pool.items.view(-1).view(torch.uint8)


@pytest.mark.slow
def test_reads_byte_for_byte_and_refusals(owners, reader):
    (kind, o), (transport, pool) = owners, reader
    owner = o["main"]
    peer = transport.add_peer(owner.metadata)
    ib = pool.item_bytes
    src = owner.ask("alloc r1 512")  # 1024 items, 4 MiB
    rng = np.random.default_rng(0)
    remote = scattered(ib, src["offset"] // ib, src["nbytes"] // ib, 700, rng)
    remote[::7, 1] = ib // 2  # some extents shorter than an item
    ext = pool.allocate("landing", 1, 512, 2)
    local = ext.start * ib + np.arange(len(remote)) * ib
    transport.wait(transport.read(peer, remote, local))
    for (off, n), dst in zip(remote.tolist(), local.tolist()):
        assert torch.equal(region(pool)[dst:dst + n], pattern(owner.seed, off, n)), (off, n)
    # Outside the owner's region: refused on the reader, nothing posted.
    with pytest.raises(ReadRefused):
        transport.read(peer, [[OWNER_ITEMS * ib - 16, 32]], [ext.start * ib])
    with pytest.raises(ReadRefused):
        transport.read(peer, [[-ib, ib]], [ext.start * ib])
    with pytest.raises(ReadRefused):  # outside the reader's own region
        transport.read(peer, [[0, ib]], [pool.items.numel() * 2])
    # A reader that believes the region is larger: the owner's side refuses it.
    pretend_peer_size(transport, peer, 4 * OWNER_ITEMS * ib)
    with pytest.raises(ReadRefused):
        transport.wait(transport.read(peer, [[2 * OWNER_ITEMS * ib, 64]], [ext.start * ib]))
    # The peer still serves reads after the refusals.
    transport.wait(transport.read(peer, remote[:3], local[:3]))
    pool.free("landing")
    assert owner.ask("release r1") == {"released": False}  # never leased
    owner.ask("lease r1 decode-0 5 0")
    assert owner.ask("release r1") == {"released": True}
    assert owner.used_after_reap() == {"used": 0, "leases": 0}


def test_peer_killed_mid_read(owners, reader):
    """A killed owner fails the reads addressed to it within 5 s; another owner keeps serving."""
    (kind, o), (transport, pool) = owners, reader
    p_doomed, p_other = transport.add_peer(o["doomed"].metadata), transport.add_peer(o["main"].metadata)
    ib = pool.item_bytes
    remote = np.stack([np.arange(OWNER_ITEMS) * ib, np.full(OWNER_ITEMS, ib)], 1)
    local = np.arange(OWNER_ITEMS) * ib
    o["doomed"].proc.kill()
    killed = time.monotonic()
    with pytest.raises(PeerDisconnected):
        while True:  # reads posted as the process dies: one of them must fail
            transport.wait(transport.read(p_doomed, remote, local, timeout_s=5.0))
    assert time.monotonic() - killed < 5.0
    with pytest.raises(PeerDisconnected):  # and later ones fail at once
        transport.read(p_doomed, remote[:1], local[:1])
    transport.remove_peer(p_doomed)
    transport.wait(transport.read(p_other, remote, local))
    assert torch.equal(region(pool)[:OWNER_ITEMS * ib], pattern(o["main"].seed, 0, OWNER_ITEMS * ib))


def test_read_timeout_drops_only_that_peer(owners, reader):
    """A peer that accepts a read and never answers fails it by its deadline, and only it.
    Socket only: NIXL's same-host reads are one-sided and never wait on the owner."""
    (kind, o), (transport, pool) = owners, reader
    if kind != "socket":
        pytest.skip("one-sided reads do not need the owner to answer")
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, reads nothing, answers nothing
    md = {"transport": "socket", "host": "127.0.0.1", "port": silent.getsockname()[1], "size": 1 << 20}
    try:
        p_silent = transport.add_peer(json.dumps(md).encode())
        p_other = transport.add_peer(o["main"].metadata)
        start = time.monotonic()
        with pytest.raises(ReadTimeout):
            transport.wait(transport.read(p_silent, [[0, 4096]], [0], timeout_s=0.5))
        assert 0.5 <= time.monotonic() - start < 5.0
        with pytest.raises(PeerDisconnected):
            transport.read(p_silent, [[0, 4096]], [0])
        transport.wait(transport.read(p_other, [[0, 4096]], [0]))
        assert torch.equal(region(pool)[:4096], pattern(o["main"].seed, 0, 4096))
    finally:
        silent.close()


@pytest.mark.slow
def test_lease_expiry_frees_the_extent(owners, reader):
    (kind, o), (transport, pool) = owners, reader
    owner = o["main"]
    peer = transport.add_peer(owner.metadata)
    src = owner.ask("alloc r2 64")
    owner.ask("lease r2 decode-0 0.4 1.0")
    for _ in range(4):  # renewed past its TTL: kept, and readable
        time.sleep(0.15)
        assert owner.ask("beat decode-0 r2") == {"lost": []}
    last_beat = time.monotonic()
    assert owner.ask("used")["leases"] == 1
    assert owner.ask("beat decode-1 r2") == {"lost": ["r2"]}  # another peer holds nothing
    ext = pool.allocate("landing", 1, 64, 2)
    n, start = src["nbytes"], ext.start * pool.item_bytes
    transport.wait(transport.read(peer, [[src["offset"], n]], [start]))
    assert torch.equal(region(pool)[start:start + n], pattern(owner.seed, src["offset"], n))
    pool.free("landing")
    time.sleep(max(0.0, last_beat + 0.5 - time.monotonic()))  # past the TTL, in the grace
    assert owner.ask("beat decode-0 r2") == {"lost": ["r2"]}
    assert owner.ask("used")["used"] == src["nbytes"]  # void, not yet freed
    assert owner.used_after_reap(timeout_s=3.0) == {"used": 0, "leases": 0}


class _SlowAgent:
    """Stands in for a NIXL agent whose posting call does the copies (as UCX does between two
    processes of one host): `transfer` returns only once `release` is set."""

    def __init__(self):
        import threading
        self.release, self.posted = threading.Event(), threading.Event()

    def get_xfer_descs(self, rows, kind):
        return rows

    def initialize_xfer(self, op, local, remote, peer):
        return object()

    def transfer(self, handle):
        self.posted.set()
        self.release.wait(10)
        return "DONE"

    def release_xfer_handle(self, handle):
        pass


def test_nixl_reads_post_off_the_callers_thread():
    """`read` returns while the posting call is still copying, `poll` says not done, and the
    read completes once the copies do: the engine's thread never waits for a copy."""
    if nixl_available() is not None:
        pytest.skip(nixl_available())
    from oasiskv.disagg.nixl_transport import NixlTransport
    t = NixlTransport()
    real, t.agent = t.agent, _SlowAgent()  # the real one back for close()
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    t.region, t._base = region, region.data_ptr()
    t._peers["p"] = {"addr": 0, "size": 1 << 16, "error": None}
    pending = t.read("p", np.array([[0, 4096]]), np.array([0]), timeout_s=10)
    assert t.agent.posted.wait(5) and not t.poll(pending)
    t.agent.release.set()
    t.wait(pending)
    assert pending.done
    t._peers.clear()
    t.agent = real
    t.close()

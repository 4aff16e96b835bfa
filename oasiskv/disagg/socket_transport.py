"""The reference transport: a block server over TCP, stdlib only (docs/disaggregation.md).

The owner listens on a port; a reader keeps one connection per peer and sends each batched read
as a request, `read_id, n` then n (offset, length) pairs. The owner checks every extent against
its region, then answers `read_id, status, nbytes` and streams the extents' bytes straight from
the region (scatter-gather `sendmsg`, no staging copy); the reader receives them straight into
its own region (`recvmsg_into`). One worker thread per peer on the reader side runs that peer's
reads in order, so a slow or dead peer holds up only its own reads.
"""
from __future__ import annotations

import json
import queue
import socket
import struct
import threading

import numpy as np
import torch

from oasiskv.disagg.transport import (PeerDisconnected, PendingRead, ReadRefused, Transport,
                                      TransportError, out_of_range)

REQUEST = struct.Struct("<QQ")  # read_id, number of extents
REPLY = struct.Struct("<QQQ")  # read_id, status, bytes that follow
OK, REFUSED = 0, 1
MAX_IOV = 512  # buffers per sendmsg / recvmsg_into (IOV_MAX is 1024 on Linux)
CONNECT_TIMEOUT_S = 5.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(data)


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left after the first n bytes of bufs went through."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _send_buffers(sock: socket.socket, bufs: list[memoryview]) -> None:
    while bufs:
        bufs = _advance(bufs, sock.sendmsg(bufs[:MAX_IOV]))


def _recv_buffers(sock: socket.socket, bufs: list[memoryview]) -> None:
    while bufs:
        k = sock.recvmsg_into(bufs[:MAX_IOV])[0]
        if k == 0:
            raise ConnectionError("connection closed mid-read")
        bufs = _advance(bufs, k)


def _slices(view: memoryview, offsets: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    return [view[o:o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]


class _Peer:
    """The reader's side of one owner: a connection and the worker that runs its reads."""

    def __init__(self, name: str, sock: socket.socket, region_view: memoryview, size: int):
        self.name, self.sock, self.size = name, sock, size
        self.region_view = region_view
        self.error: TransportError | None = None  # set once: the peer is dead or dropped
        self.reads: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self._run, name=f"read-{name}", daemon=True)
        self.worker.start()

    def _run(self) -> None:
        read_id = 0
        while True:
            job = self.reads.get()
            if job is None:
                return
            pending, offsets, lengths, local = job
            if self.error is not None:
                pending.error = pending.error or self.error
                continue
            read_id += 1
            try:
                extents = np.stack([offsets, lengths], 1).astype("<i8")
                self.sock.sendall(REQUEST.pack(read_id, len(offsets)) + extents.tobytes())
                rid, status, nbytes = REPLY.unpack(_recv_exact(self.sock, REPLY.size))
                if rid != read_id or (status == OK and nbytes != pending.nbytes):
                    raise ConnectionError("reply out of step with the request")
                if status == REFUSED:
                    pending.error = ReadRefused(self.name, "the owner refused an extent outside its region")
                    continue
                _recv_buffers(self.sock, _slices(self.region_view, local, lengths))
                pending.done = True
            except OSError as e:  # ConnectionError, a reset, or a shutdown after a drop
                self.fail(PeerDisconnected(self.name, f"connection lost ({e})"))
                pending.error = pending.error or self.error

    def fail(self, error: TransportError) -> None:
        """Mark the peer dead; queued and later reads fail with its error."""
        if self.error is None:
            self.error = error
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.fail(PeerDisconnected(self.name, "removed"))
        self.reads.put(None)
        self.sock.close()


class SocketTransport(Transport):
    name = "socket"

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__()
        self.host, self.port = host, port
        self._listener: socket.socket | None = None
        self._serving: list[socket.socket] = []  # the owner's accepted connections
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ---- owner side -----------------------------------------------------------------
    def _register(self, region: torch.Tensor) -> None:
        self._view = memoryview(region.numpy())

    def serve(self) -> None:
        self._listener = socket.create_server((self.host, self.port))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="block-server", daemon=True).start()

    def metadata(self) -> bytes:
        return json.dumps({"transport": self.name, "host": self.host, "port": self.port,
                           "size": self.region.numel()}).encode()

    def _accept(self) -> None:
        listener = self._listener
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # shut down by close()
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:  # accepted as close() ran: never serve it
                    conn.close()
                    return
                self._serving.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="block-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer one reader's requests until it goes away."""
        size = len(self._view)
        try:
            while True:
                read_id, n = REQUEST.unpack(_recv_exact(conn, REQUEST.size))
                extents = np.frombuffer(_recv_exact(conn, 16 * n), dtype="<i8").reshape(n, 2)
                offsets, lengths = extents[:, 0], extents[:, 1]
                if out_of_range(offsets, lengths, size):
                    conn.sendall(REPLY.pack(read_id, REFUSED, 0))
                    continue
                conn.sendall(REPLY.pack(read_id, OK, int(lengths.sum())))
                _send_buffers(conn, _slices(self._view, offsets, lengths))
        except OSError:
            pass
        finally:
            with self._lock:
                if conn in self._serving:
                    self._serving.remove(conn)
            conn.close()

    # ---- reader side ----------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        if self.region is None:
            raise RuntimeError("register the local region before adding peers")
        md = json.loads(metadata)
        name = f"tcp://{md['host']}:{md['port']}"
        old = self._peers.get(name)
        if old is not None and old.error is None:
            return name
        if old is not None:  # dropped earlier: connect afresh
            self.remove_peer(name)
        try:
            sock = socket.create_connection((md["host"], md["port"]), timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            raise PeerDisconnected(name, f"cannot connect ({e})") from e
        sock.settimeout(None)  # reads are timed by their deadlines (poll), not the socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[name] = _Peer(name, sock, memoryview(self.region.numpy()), int(md["size"]))
        return name

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise PeerDisconnected(peer, "not connected")
        return p

    def peer_size(self, peer: str) -> int:
        return self._peer(peer).size

    def remove_peer(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is not None:
            p.close()

    def _post(self, pending: PendingRead, offsets, lengths, local) -> None:
        p = self._peer(pending.peer)
        if p.error is not None:
            raise p.error
        p.reads.put((pending, offsets, lengths, local))

    def _progress(self, pending: PendingRead) -> None:
        pass  # the peer's worker completes it

    def _drop(self, pending: PendingRead) -> None:
        p = self._peers.get(pending.peer)
        if p is not None:
            p.fail(PeerDisconnected(pending.peer, "dropped after a read timed out"))

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        with self._lock:
            self._closed = True
        if self._listener is not None:
            try:  # wakes the accept thread (a close alone leaves it blocked on Linux)
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            for conn in self._serving:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

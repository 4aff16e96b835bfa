"""The NIXL transport (NVIDIA's NIXL over UCX, `nixl-cu12`; docs/disaggregation.md).

Each side makes one agent and registers its region once, NIXL's progress thread off (on a
small host it competes with the engine: it halved the read rate on 2 cores). On one
host UCX does a READ's copies inside the call that posts it, so the reader posts and settles
its reads on a thread of its own (NIXL releases the GIL meanwhile) and `poll` only looks at
the outcome: the engine never waits for a copy. The owner must progress too (UCX's connection
set-up, and reads that are not zero-copy), so `serve` starts a thread that does that every
millisecond.
`metadata()` carries the agent's metadata plus the region's address and size; `add_peer` loads
the agent metadata into the local agent. A batched read is one NIXL READ request of N
descriptors, (remote address, length) into (local address, length).

NIXL reports an address outside the peer's registration as an error, and a dead peer as one
within milliseconds, but a read of memory the peer has deregistered or reused "succeeds":
the owner's leases (leases.py) keep an extent alive while it may be read.

Imported lazily: `nixl_available()` says whether the package imports.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid

import numpy as np
import torch

from oasiskv.disagg.transport import (PeerDisconnected, PendingRead, ReadRefused, Transport,
                                      TransportError)


def _import_nixl():
    try:
        import nixl_cu12 as nixl  # noqa: PLC0415
    except ImportError as cu12_error:
        try:
            import nixl_cu13 as nixl  # noqa: PLC0415  (CUDA 13 hosts)
        except ImportError:
            raise cu12_error from None
    return nixl


def nixl_available() -> str | None:
    """None when NIXL imports, else why not (for a skip reason or an error)."""
    try:
        _import_nixl()
    except Exception as e:  # ImportError, or a missing shared library inside the wheel
        return f"NIXL does not import ({type(e).__name__}: {e}); install nixl-cu12 (scripts/setup.sh test)"
    return None


PROGRESS_INTERVAL_S = 0.001
SETTLE_INTERVAL_S = 0.0002


def _is_disconnect(e: Exception) -> bool:
    return "Disconnect" in type(e).__name__ or "DISCONNECT" in str(e).upper()


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, agent_name: str | None = None):
        super().__init__()
        nixl = _import_nixl()
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
        # UCX reads UCX_* from the environment at agent creation: e.g. UCX_TLS to restrict it.
        # STRICT: the owner's progress thread, the poster thread and the caller share the agent.
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent_name = agent_name or f"oasiskv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl.nixl_agent(self.agent_name, config)
        self._peers: dict[str, dict] = {}  # name -> {"addr", "size", "error"}
        self._reg = None
        self._closed = threading.Event()
        self._progress_thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # reads for the poster thread
        self._poster: threading.Thread | None = None

    def _register(self, region: torch.Tensor) -> None:
        self._reg = self.agent.register_memory(region)
        self._base = region.data_ptr()

    def serve(self) -> None:
        self._progress_thread = threading.Thread(target=self._progress_forever, name="nixl-progress",
                                                 daemon=True)
        self._progress_thread.start()

    def _progress_forever(self) -> None:
        while not self._closed.is_set():
            self.agent.get_new_notifs()  # progresses the UCX workers
            self._closed.wait(PROGRESS_INTERVAL_S)

    def metadata(self) -> bytes:
        return json.dumps({"transport": self.name, "agent": self.agent.get_agent_metadata().hex(),
                           "addr": self._base, "size": self.region.numel()}).encode()

    def add_peer(self, metadata: bytes) -> str:
        md = json.loads(metadata)
        try:
            name = self.agent.add_remote_agent(bytes.fromhex(md["agent"]))
        except Exception as e:
            raise PeerDisconnected("?", f"cannot load the peer's metadata ({type(e).__name__}: {e})") from e
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[name] = {"addr": int(md["addr"]), "size": int(md["size"]), "error": None}
        return name

    def _peer(self, peer: str) -> dict:
        p = self._peers.get(peer)
        if p is None:
            raise PeerDisconnected(peer, "not connected")
        return p

    def peer_size(self, peer: str) -> int:
        return self._peer(peer)["size"]

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception:  # already gone on NIXL's side
                pass

    def _descs(self, addr: int, offsets: np.ndarray, lengths: np.ndarray):
        rows = np.empty((len(offsets), 3), dtype=np.uint64)
        rows[:, 0] = addr + offsets
        rows[:, 1] = lengths
        rows[:, 2] = 0
        return self.agent.get_xfer_descs(rows, "DRAM")

    def _post(self, pending: PendingRead, offsets, lengths, local) -> None:
        p = self._peer(pending.peer)
        if p["error"] is not None:
            raise p["error"]
        if self._poster is None:
            self._poster = threading.Thread(target=self._post_forever, name="nixl-reads", daemon=True)
            self._poster.start()
        self._jobs.put((pending, offsets, lengths, local, p["addr"]))

    def _post_forever(self) -> None:
        """The poster thread: each read posted (its copies done here, on one host) and settled
        in turn; a read that timed out meanwhile (`pending.error` set) is abandoned."""
        while (job := self._jobs.get()) is not None:
            pending, offsets, lengths, local, addr = job
            if pending.error is not None:
                continue
            try:
                pending.state = self.agent.initialize_xfer("READ", self._descs(self._base, local, lengths),
                                                           self._descs(addr, offsets, lengths), pending.peer)
                status = self.agent.transfer(pending.state)
                while status == "PROC" and pending.error is None:
                    time.sleep(SETTLE_INTERVAL_S)
                    status = self.agent.check_xfer_state(pending.state)
            except Exception as e:
                status = e
            if pending.error is None:
                self._settle(pending, status)
            else:
                self._release(pending)

    def _progress(self, pending: PendingRead) -> None:
        """Nothing to do: the poster thread settles every read."""

    def _settle(self, pending: PendingRead, status) -> None:
        if status == "PROC":
            return
        if status == "DONE":
            pending.done = True
        else:
            cause = status if isinstance(status, Exception) else RuntimeError(f"transfer state {status}")
            pending.error = self._error(pending.peer, cause)
        self._release(pending)

    def _error(self, peer: str, e: Exception) -> TransportError:
        if "NotFound" in type(e).__name__:
            return ReadRefused(peer, f"outside the peer's registered memory ({type(e).__name__})")
        error = PeerDisconnected(peer, f"{type(e).__name__}: {e}")
        if peer in self._peers and _is_disconnect(e):  # the peer is gone: later reads fail at once
            self._peers[peer]["error"] = error
        return error

    def _release(self, pending: PendingRead) -> None:
        if pending.state is not None:
            try:
                self.agent.release_xfer_handle(pending.state)
            except Exception:  # a handle of a dead peer may refuse; NIXL frees it with the agent
                pass
            pending.state = None

    def _drop(self, pending: PendingRead) -> None:
        # pending.error is set: the poster thread releases (aborts) it
        if pending.peer in self._peers:
            self._peers[pending.peer]["error"] = PeerDisconnected(pending.peer, "dropped after a read timed out")

    def close(self) -> None:
        self._closed.set()
        if self._progress_thread is not None:
            self._progress_thread.join()
        if self._poster is not None:
            self._jobs.put(None)
            self._poster.join()
        for peer in list(self._peers):
            self.remove_peer(peer)
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
